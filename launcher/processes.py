"""Real processes on this machine: start one from a spec, wait until it serves, stop a group.

The one layer under everything that runs ``epd`` processes: ``epd serve``'s supervision, the
test clusters and the benchmarks. A ``Process`` is one spec and, once started, its current
OS process:

    Process(spec) --start()--> running --(it exits | stop_group)--> exited --start()--> ...

Rules:

- a spec carries the whole environment (``child_env`` builds one from this process's); the
  child writes stdout and stderr to ``log_path`` (truncated at the first start, appended to on
  a restart) or, without one, to this process's own;
- with ``bind_to_parent`` (the default) the child gets SIGTERM when the thread that started it
  dies (Linux), so none is orphaned; start from a thread that lives as long as the child.
  With ``own_group`` it runs in its own process group, so a terminal's Ctrl-C reaches the
  parent alone, which stops its children in order;
- a process is signalled by its own pid only: ``stop_group`` sends SIGTERM to every live
  member, waits up to the group's longest ``stop_timeout_s`` (or until ``cut_short()``), then
  SIGKILLs what is left and reaps every member;
- readiness is a probe (``grpc_serving``, ``http_ok``, ``accepting``, or any function) that
  ``wait_serving`` polls; it fails early, with the log's tail, when a process it watches exits.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1


class StartError(RuntimeError):
    """A process exited before it served, or did not serve in time."""


class StartTimeout(StartError, TimeoutError):
    """Not serving after the timeout (the process is still running)."""


_HANDED_OUT: collections.deque[tuple[str, int]] = collections.deque(maxlen=4096)
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, never one this process handed out among its last 4096.

    The port is bound by a child later, so until then the kernel may offer it again: a stack's
    ports planned in one go (``epd serve``) would otherwise now and then give two workers one port."""
    with _HANDED_OUT_LOCK:
        while True:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if (host, port) not in _HANDED_OUT:
                _HANDED_OUT.append((host, port))
                return port


def child_env(overlay: Mapping[str, str] | None = None, drop: Iterable[str] = (),
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) less ``drop``, unbuffered Python output,
    then ``overlay``."""
    dropped = set(drop)
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in dropped}
    return {**env, "PYTHONUNBUFFERED": "1", **(overlay or {})}


def _bind_to_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):   # not Linux: the stop path still stops it
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class ProcessSpec:
    name: str                          # for messages: a role, "epd serve", "gateway@0,1" ...
    argv: Sequence[str]
    env: Mapping[str, str] | None = None   # the whole environment; None: this process's
    log_path: Path | None = None       # stdout + stderr; None: inherit this process's
    cwd: Path | None = None
    stop_timeout_s: float = 20.0       # SIGTERM, then SIGKILL after this long
    own_group: bool = False            # its own process group
    bind_to_parent: bool = True        # SIGTERM when the starting thread dies


@dataclass(eq=False)
class Process:
    """One spec and its current OS process (None before the first start)."""

    spec: ProcessSpec
    popen: subprocess.Popen | None = None
    starts: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def cmd(self) -> list[str]:
        return list(self.spec.argv)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self) -> Process:
        """Spawn the spec (again, after an exit); raises while the last one is still running."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        log = None
        if self.spec.log_path is not None:
            self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.spec.log_path, "a" if self.starts else "w")
        try:
            self.popen = subprocess.Popen(
                list(self.spec.argv), cwd=self.spec.cwd, env=None if self.spec.env is None else dict(self.spec.env),
                stdout=log, stderr=subprocess.STDOUT if log is not None else None,
                preexec_fn=_bind_to_parent if self.spec.bind_to_parent else None,
                process_group=0 if self.spec.own_group else None)
        finally:
            if log is not None:
                log.close()
        self.starts += 1
        return self

    def poll(self) -> int | None:
        """The exit code once it exited, else None (also None before the first start)."""
        return self.popen.poll() if self.popen is not None else None

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        """The log file's text ("" without one, or before it exists)."""
        if self.spec.log_path is None:
            return ""
        try:
            return self.spec.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stop(self, timeout_s: float | None = None) -> None:
        stop_group([self], timeout_s)


def start_process(spec: ProcessSpec) -> Process:
    return Process(spec).start()


def stop_group(processes: Sequence[Process], timeout_s: float | None = None,
               cut_short: Callable[[], bool] | None = None) -> None:
    """SIGTERM every live member, wait for all (``timeout_s``, default the members' longest
    ``stop_timeout_s``; ``cut_short()`` true ends the wait), SIGKILL the rest, reap every one."""
    members = [p for p in processes if p.popen is not None]
    live = [p for p in members if p.alive()]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.popen.send_signal(signal.SIGTERM)
    wait_s = max((p.spec.stop_timeout_s for p in live), default=0.0) if timeout_s is None else timeout_s
    end = time.monotonic() + wait_s
    while any(p.alive() for p in live) and time.monotonic() < end and not (cut_short and cut_short()):
        time.sleep(0.05)
    for p in members:
        if p.alive():
            with contextlib.suppress(ProcessLookupError):
                p.popen.kill()
        p.popen.wait()


def wait_serving(probe: Callable[[], bool], watched: Sequence[Process], timeout_s: float = 300.0,
                 what: str = "", poll_s: float = 0.3, log_lines: int = 15) -> None:
    """Poll ``probe`` until it returns True; ``StartError`` (with its log's tail) as soon as one
    of ``watched`` exits, ``StartTimeout`` after ``timeout_s``. ``what`` names it in the message."""
    end = time.monotonic() + timeout_s
    while True:
        for p in watched:
            if p.popen is not None and p.poll() is not None:
                raise StartError(f"{p.name} exited with {p.returncode}:\n{p.tail(log_lines)}")
        if probe():
            return
        if time.monotonic() > end:
            tails = "".join(f"\n{p.name}:\n{p.tail(log_lines)}" for p in watched)
            raise StartTimeout(f"{what or 'process'} not healthy after {timeout_s:.0f} s{tails}")
        time.sleep(poll_s)


# ---------------------------------------------------------------- probes: one quick look, never raise


def grpc_serving(address: str, timeout_s: float = 1.0) -> bool:
    """The worker's gRPC health service says SERVING (the whole server, service "")."""
    from .healthcheck import check_grpc

    return check_grpc(address, "", timeout_s)[0]


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """``GET url`` answers 200 (no proxy from the environment)."""
    import httpx

    try:
        with httpx.Client(trust_env=False, timeout=timeout_s) as client:
            return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def accepting(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Something accepts TCP connections on ``host:port`` (a wildcard host is dialled on loopback)."""
    connect_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        with socket.create_connection((connect_host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
