"""What running processes use: CPU seconds by role, resident memory (psutil, read on demand).

Processes that exited are not counted, so take differences over a stretch the processes survive.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from launcher.processes import Process

ROLES = ("encoder", "prefill", "decode", "gateway")


def cpu_seconds(process: Process) -> dict[str, float]:
    """User+system CPU seconds so far of ``process`` and its descendants, by role.

    The role of an ``epd`` child is its subcommand (encoder, prefill, decode, gateway);
    anything else counts under the process's name. Empty when it is not running.
    """
    import psutil

    out: dict[str, float] = {}
    if not process.alive():
        return out
    try:
        root = psutil.Process(process.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            t = proc.cpu_times()
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        role = next((c for c in cmd if c in ROLES), process.name)
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def wait_quiet(processes: Sequence[Process], *, window_s: float = 0.2, max_cores: float = 0.05,
               timeout_s: float = 15.0) -> float:
    """Wait until ``processes`` together use under ``max_cores`` of a core over one ``window_s``; the
    seconds waited (``timeout_s`` at most). A server can keep working after its load ends (vLLM's
    CPU engine spins a core for about a second), and a round started then shares the host with it."""
    started = time.monotonic()
    before = sum(sum(cpu_seconds(p).values()) for p in processes)
    while True:
        time.sleep(window_s)
        now = sum(sum(cpu_seconds(p).values()) for p in processes)
        waited = time.monotonic() - started
        if now - before < max_cores * window_s or waited >= timeout_s:
            return waited
        before = now


def listener_cpu_seconds(address: str) -> float | None:
    """CPU seconds so far of the local process listening on ``address``'s port (None if not found,
    or without psutil)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        port = int(address.rsplit(":", 1)[1])
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                t = psutil.Process(conn.pid).cpu_times()
                return t.user + t.system
    except (ValueError, OSError, psutil.Error):
        return None
    return None


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, MiB."""
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20
