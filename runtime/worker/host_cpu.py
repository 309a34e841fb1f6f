"""The cores a CPU worker computes on, the machine they belong to, and how busy they are.

Every worker reports these in ``Stats`` (``host_id``, ``cpus``, ``cpus_busy``) so that the
placement policy can tell when a prefill worker computes on the decode worker's own cores: on
such a host a remote prompt does not add capacity but takes it from the decode worker's queue
(``runtime.policy.placement_policy``, ``worker_stats.stage_loads``).

- ``host_id``: the kernel's boot id (``/proc/sys/kernel/random/boot_id``): processes and containers
  of one machine share it, two machines never do. "" where it cannot be read (then nothing is
  judged shared).
- ``cpus``: the cores the worker's model runs on: ``EPD_MODEL_CORES`` where set (``model_cores``:
  its model thread's own cores, apart from the process's other threads), else this process's CPU
  affinity (what ``taskset``, ``epd serve --cpu-bind`` or a container's cpuset allow); empty for a
  worker whose model runs on a GPU (its compute is not on those cores).
- ``busy()``: the share of those CPUs' time spent busy (everything but idle and iowait, any process)
  since the previous read, from ``/proc/stat``; reads closer together than ``MIN_INTERVAL_S`` return
  the last value. -1 until two reads exist or where ``/proc/stat`` is missing.

Owned by the worker's ``ServingState``; read on its event loop only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

MODEL_CORES_ENV = "EPD_MODEL_CORES"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
PROC_STAT = Path("/proc/stat")
MIN_INTERVAL_S = 0.05


def read_host_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def model_cores(environ=os.environ) -> set[int] | None:
    """``EPD_MODEL_CORES`` (comma-separated core numbers): the cores the worker's model thread, and
    the OpenMP team it starts, run on (``runtime.worker.torch_thread`` binds itself there); ``None``
    when unset. ``ValueError`` for anything but core numbers."""
    text = environ.get(MODEL_CORES_ENV, "").strip()
    if not text:
        return None
    cores = {int(part) for part in text.split(",")}
    if min(cores) < 0:
        raise ValueError(f"not a list of core numbers: {text!r}")
    return cores


def cpu_times(cpus: set[int], text: str) -> tuple[int, int] | None:
    """(busy, total) jiffies summed over ``cpus`` from ``/proc/stat``'s text; None if none of them is listed."""
    busy = total = 0
    found = False
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        values = [int(f) for f in fields[:8]]   # user nice system idle iowait irq softirq steal
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        total += sum(values)
        busy += sum(values) - idle
        found = True
    return (busy, total) if found else None


class HostCpu:
    def __init__(self, device_type: str = "cpu"):
        self.host_id = read_host_id()
        self.cpus: list[int] = sorted(model_cores() or os.sched_getaffinity(0)) if device_type == "cpu" else []
        self._last: tuple[int, int] | None = None
        self._last_s = 0.0
        self._busy = -1.0

    def busy(self) -> float:
        """The share of ``cpus``' time busy since the previous read (0-1), or -1 when not known."""
        if not self.cpus:
            return -1.0
        now = time.monotonic()
        if self._last is not None and now - self._last_s < MIN_INTERVAL_S:
            return self._busy
        try:
            sample = cpu_times(set(self.cpus), PROC_STAT.read_text())
        except OSError:
            sample = None
        if sample is None:
            return -1.0
        if self._last is not None and sample[1] > self._last[1]:
            self._busy = min(1.0, max(0.0, (sample[0] - self._last[0]) / (sample[1] - self._last[1])))
        self._last, self._last_s = sample, now
        return self._busy
