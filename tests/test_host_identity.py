"""Which CPU cores a worker computes on (``runtime/worker/host_identity.py``), as its Stats report them."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from proto.epd.v1 import epd_pb2 as pb
from runtime.policy.loads import CpuCores
from runtime.worker.host_identity import cpu_cores
from runtime.worker.serving_state import ServingState
from runtime.worker.timing_log import TimingLog


def test_a_cpu_worker_names_its_cores_and_an_accelerator_none():
    mine = cpu_cores(torch.device("cpu"))
    assert mine is not None
    assert mine.cores == len(os.sched_getaffinity(0)) and mine.threads == torch.get_num_threads()
    assert cpu_cores("cuda:0") is None and cpu_cores(torch.device("cuda")) is None
    # another process on this machine, on the same cpus, names the same set
    other = subprocess.run([sys.executable, "-c", "from runtime.worker.host_identity import cpu_cores; "
                            "print(cpu_cores('cpu').host)"], capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert other.stdout.strip() == mine.host


def test_the_stats_reply_carries_the_cores_and_the_policy_sees_them_crowded():
    cores = CpuCores("m/0-1", 2, 1)
    stats = ServingState("prefill", TimingLog(), "fp", cpu=cores).stats(pb.StatsRequest())
    assert (stats.cpu.host, stats.cpu.cores, stats.cpu.threads) == ("m/0-1", 2, 1)
    assert not ServingState("decode", TimingLog(), "fp").stats(pb.StatsRequest()).HasField("cpu")
    assert cores.crowds(CpuCores("m/0-1", 2, 2)) and cores.crowds(CpuCores("m/0-1", 2, 1))
    assert not cores.crowds(CpuCores("m/2-3", 2, 1)) and not cores.crowds(None)
    assert not CpuCores("m/0-63", 64, 16).crowds(CpuCores("m/0-63", 64, 16))
