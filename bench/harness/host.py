"""The machine a benchmark runs on: what it is (for the results file) and how busy its cores are."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import platform
import subprocess
from typing import Any

from .paths import ROOT

VERSIONS = ("torch", "transformers", "accelerate", "fastapi", "uvicorn")


def host_basics() -> dict[str, Any]:
    """Cores, load average, Python and machine type."""
    return {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version(),
            "machine": platform.machine()}


def host_info() -> dict[str, Any]:
    """``host_basics`` plus the CPU model (``lscpu``), package versions and the git commit."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}
    with contextlib.suppress(OSError):
        info["load_avg"] = list(os.getloadavg())
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor"):
                info[key.strip()] = value.strip()
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["versions"] = {p: importlib.metadata.version(p) for p in VERSIONS}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout  # noqa: E731
        info["git_commit"] = git("rev-parse", "--short", "HEAD").strip()
        info["git_dirty_files"] = len(git("status", "--short").splitlines())
        info["git_diff_sha1"] = hashlib.sha1(git("diff", "HEAD").encode()).hexdigest()[:12]
    return info


def host_busy() -> tuple[float, float] | None:
    """(busy, total) CPU ticks of this host so far, summed over its cores (``/proc/stat``); None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def busy_cores(cores: int, before: tuple[float, float] | None, after: tuple[float, float] | None) -> float:
    """Cores' worth of work between two ``host_busy()`` readings (0 when unknown)."""
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    return cores * max(0.0, after[0] - before[0]) / (after[1] - before[1])
