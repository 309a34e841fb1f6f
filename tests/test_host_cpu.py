"""Where a worker computes, as its Stats report it (``runtime/worker/host_cpu.py``)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.worker import host_cpu
from runtime.worker.host_cpu import HostCpu, cpu_times

STAT = """cpu  300 0 100 600 10 0 0 0 0 0
cpu0 100 0 50 300 5 0 0 0 0 0
cpu1 200 0 50 300 5 0 0 0 0 0
intr 12345
"""

linux = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc/stat")


def test_busy_and_total_time_of_the_named_cpus_only() -> None:
    assert cpu_times({1}, STAT) == (250, 555)          # idle and iowait are not busy
    assert cpu_times({0, 1}, STAT) == (400, 1010)
    assert cpu_times({7}, STAT) is None


@linux
def test_a_cpu_worker_reports_its_machine_its_cores_and_how_busy_they_are() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    try:
        host = HostCpu("cpu")
        assert host.host_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip() != ""
        assert host.cpus == [core]
        assert host.busy() == -1.0                       # one read: nothing to compare yet
        end = time.monotonic() + 0.3
        while time.monotonic() < end:                    # this process keeps its only core busy
            pass
        spun = host.busy()
        assert spun >= 0.8
        assert host.busy() == spun                       # read again within MIN_INTERVAL_S: the same value
        time.sleep(0.1)
        assert 0.0 <= host.busy() <= 1.0                 # a new window (other processes may use the core)
    finally:
        os.sched_setaffinity(0, before)


def test_a_gpu_worker_reports_no_cores(monkeypatch) -> None:
    host = HostCpu("cuda")
    assert host.cpus == [] and host.busy() == -1.0


def test_no_boot_id_names_no_machine(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(host_cpu, "BOOT_ID", tmp_path / "missing")
    assert HostCpu("cpu").host_id == ""


def test_a_worker_whose_model_thread_has_cores_of_its_own_reports_those(monkeypatch) -> None:
    monkeypatch.setenv("EPD_MODEL_CORES", "0")
    assert HostCpu("cpu").cpus == [0]
    assert HostCpu("cuda").cpus == []
    monkeypatch.setenv("EPD_MODEL_CORES", "3,1")
    assert host_cpu.model_cores() == {1, 3}
    for bad in ("x", "0,,1", "-1"):
        monkeypatch.setenv("EPD_MODEL_CORES", bad)
        with pytest.raises(ValueError):
            host_cpu.model_cores()


MODEL_THREAD = """
import asyncio, os, sys
import torch
from runtime.worker import torch_thread

def on_the_model_thread():
    torch.set_num_threads(2)
    torch.ones(256, 256) @ torch.ones(256, 256)   # starts the thread's OpenMP team
    return sorted(os.sched_getaffinity(0))

print(asyncio.run(torch_thread.run(on_the_model_thread)), sorted(os.sched_getaffinity(0)))
tasks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(sum(cores == [int(os.environ["EPD_MODEL_CORES"])] for cores in tasks.values()))
"""


@linux
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_model_thread_and_its_openmp_team_run_on_the_model_cores_and_the_rest_does_not() -> None:
    """``--cpu-bind reserve``: the torch thread binds itself to ``EPD_MODEL_CORES`` as it starts, and
    the OpenMP threads it starts inherit that; the process's other threads keep their cores."""
    process_cores = sorted(os.sched_getaffinity(0))
    model = process_cores[0]
    env = {**os.environ, "EPD_MODEL_CORES": str(model), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", MODEL_THREAD], env=env, capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    first, count = out.stdout.strip().splitlines()
    assert first == f"{[model]} {process_cores}"     # the model thread on its core, the main thread unbound
    assert int(count) >= 2                           # the torch thread and its OpenMP helper


@linux
def test_a_worker_refuses_model_cores_it_may_not_use(monkeypatch) -> None:
    from launcher.cpu_layout import bind_from_env

    allowed = os.sched_getaffinity(0)
    for bad in ("x", str(max(allowed) + 64)):
        with pytest.raises(SystemExit, match="EPD_MODEL_CORES"):
            bind_from_env({"EPD_MODEL_CORES": bad})
    assert os.sched_getaffinity(0) == allowed
    assert bind_from_env({"EPD_MODEL_CORES": str(min(allowed))}) is None   # valid, and no process binding asked
