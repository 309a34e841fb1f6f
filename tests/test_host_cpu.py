"""Where a worker computes, as its Stats report it (``runtime/worker/host_cpu.py``)."""

import os
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
