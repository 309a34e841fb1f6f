"""Which CPU cores a worker computes on, so placement knows when two stages share them.

``cpu_cores(device)`` describes, for a worker computing on the CPU, the set of cores it may run on:
``host`` names that set (the kernel's boot id, the same in every process and container on one
machine, with the cpus of the process's affinity), ``cores`` is its size and ``threads`` the torch
threads the worker computes with. ``None`` on an accelerator, whose work does not take the host's
cores. A prefill and a decode worker on one set whose threads fill it (``CpuCores.crowds``) share
those cores: a prompt sent from one to the other gains no compute, it only adds the handoff
(``runtime/policy/placement_policy.py``). Where the boot id cannot be read, the host name stands in.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from runtime.policy.loads import CpuCores

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def cpu_cores(device: object) -> CpuCores | None:
    """The cores a worker on ``device`` computes on (its threads: this thread's torch threads); None off the CPU."""
    if str(device).split(":")[0] != "cpu":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return CpuCores(f"{_machine()}/{_ranges(cpus)}", len(cpus), torch.get_num_threads())


def _machine() -> str:
    try:
        return BOOT_ID.read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def _ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(out)
