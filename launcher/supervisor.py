"""``epd serve``'s supervisor: keeps every child process running, and stops them all cleanly.

Workers start first; the gateway starts once every worker is ready (or given up on).
Each child is in one state, terminal ones after the boundary:

    STARTING -> READY -> (exits on its own) BACKOFF -> STARTING -> ...
    any -> STOPPED (serve is stopping) | GAVE_UP (it exited too often)

Rules:

- a child that exits while serve is not stopping is restarted with the same command, so on
  the same address (the gateway's static lists stay valid), after ``ExitHistory``'s backoff;
  at the policy's limit serve gives up on it with one line naming its role, address and exit
  codes. If that leaves a required role with no live child, everything stops and ``run``
  returns 1;
- ``request_stop`` (SIGINT / SIGTERM): no restart from then on; the gateway's stop group goes
  first (no new work), then the workers drain, each group within its children's
  ``stop_timeout_s`` (then SIGKILL), and ``run`` returns 0. A second request kills what is left
  at once;
- children run in their own process group (a terminal's Ctrl-C reaches serve alone, which stops
  them in order) and get the parent-death signal, so none outlives a killed serve.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TextIO

from .processes import Process, ProcessSpec, stop_group
from .restart_policy import ExitHistory, RestartPolicy


class ChildState(IntEnum):
    STARTING = 0   # running, not yet ready since its last start
    READY = 1      # running and seen ready
    BACKOFF = 2    # exited on its own; restarts at ``restart_at``
    STOPPED = 3    # terminal: stopped by serve
    GAVE_UP = 4    # terminal: exited ``limit`` times within the window

    @property
    def terminal(self) -> bool:
        return self >= ChildState.STOPPED


@dataclass(frozen=True)
class ChildSpec:
    role: str
    address: str
    argv: list[str]
    env: dict[str, str]
    ready: Callable[[], bool]      # a quick probe (about a second at most)
    stop_group: int = 1            # lower groups are stopped first
    stop_timeout_s: float = 30.0   # SIGTERM, then SIGKILL after this long

    def process_spec(self) -> ProcessSpec:
        """Its own process group, and the parent-death signal (launcher/processes.py)."""
        return ProcessSpec(f"{self.role} at {self.address}", self.argv, self.env,
                           stop_timeout_s=self.stop_timeout_s, own_group=True)


@dataclass
class Child:
    spec: ChildSpec
    history: ExitHistory
    state: ChildState = ChildState.STARTING
    restart_at: float = 0.0
    process: Process = field(init=False)

    def __post_init__(self) -> None:
        self.process = Process(self.spec.process_spec())

    @property
    def starts(self) -> int:
        return self.process.starts

    @property
    def alive(self) -> bool:
        return self.process.alive()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)


@dataclass
class Supervisor:
    policy: RestartPolicy
    required_roles: frozenset[str]
    log: TextIO = field(default_factory=lambda: sys.stderr)
    start_timeout_s: float = 300.0
    tick_s: float = 0.2
    children: list[Child] = field(default_factory=list)
    _stop_requests: int = 0

    def request_stop(self, *_: object) -> None:
        """Safe from a signal handler: only counts."""
        self._stop_requests += 1

    def _say(self, line: str) -> None:
        print(f"epd serve: {line}", file=self.log, flush=True)

    def run(self, workers: list[ChildSpec], gateway: ChildSpec, on_ready: Callable[[list[Child]], None]) -> int:
        """Supervise until stopped (0) or a required role is lost or never became ready (1)."""
        worker_children = [Child(spec, ExitHistory(self.policy)) for spec in workers]
        gw = Child(gateway, ExitHistory(self.policy))
        self.children = list(worker_children)
        announced = False
        deadline = time.monotonic() + self.start_timeout_s
        try:
            for c in worker_children:
                self._spawn(c)
            while not self._stop_requests:
                for c in self.children:
                    self._tend(c)
                lost = self._lost_required_role()
                if lost is not None:
                    self._say(f"no {lost} left running; stopping everything")
                    return 1
                if gw not in self.children and all(c.state in (ChildState.READY, ChildState.GAVE_UP) for c in worker_children):
                    self.children.append(gw)
                    self._spawn(gw)
                if not announced:
                    if gw.state == ChildState.READY:
                        on_ready(self.children)
                        announced = True
                    elif time.monotonic() > deadline:
                        late = [c for c in self.children if c.state != ChildState.READY] or [gw]
                        self._say("not ready after %.0f s: %s; stopping" % (
                            self.start_timeout_s, ", ".join(f"{c.spec.role} at {c.spec.address}" for c in late)))
                        return 1
                time.sleep(self.tick_s)
            return 0
        finally:
            self._shutdown()

    def _spawn(self, c: Child) -> None:
        c.process.start()
        c.state = ChildState.STARTING

    def _tend(self, c: Child) -> None:
        """One look at a child: restart it when its backoff is over, note readiness, handle an exit."""
        now = time.monotonic()
        if c.state.terminal:
            return
        if c.state == ChildState.BACKOFF:
            if now >= c.restart_at and not self._stop_requests:
                self._spawn(c)
                self._say(f"restarted {c.spec.role} at {c.spec.address} (pid {c.process.pid})")
            return
        code = c.process.poll()
        if code is None:
            if c.state == ChildState.STARTING and c.spec.ready():
                c.state = ChildState.READY
                if c.starts > 1:
                    self._say(f"{c.spec.role} at {c.spec.address} is serving again")
            return
        if self._stop_requests:
            return   # stopping: the shutdown accounts for it, nothing restarts
        delay = c.history.record(now, code)
        if delay is None:
            c.state = ChildState.GAVE_UP
            codes = ", ".join(describe_exit(x) for x in c.history.codes())
            self._say(f"giving up on {c.spec.role} at {c.spec.address}: it exited {len(c.history.exits)} times "
                      f"within {self.policy.window_s:g} s (exit codes {codes})")
            return
        c.state = ChildState.BACKOFF
        c.restart_at = now + delay
        self._say(f"{c.spec.role} at {c.spec.address} exited with {describe_exit(code)}; restarting in {round(delay, 2):g} s")

    def _lost_required_role(self) -> str | None:
        for role in sorted(self.required_roles):
            members = [c for c in self.children if c.spec.role == role]
            if members and all(c.state == ChildState.GAVE_UP for c in members):
                return role
        return None

    def _shutdown(self) -> None:
        """Stop groups in order: SIGTERM, wait (a further stop request cuts the wait), SIGKILL the rest."""
        requests_at_start = self._stop_requests
        for group in sorted({c.spec.stop_group for c in self.children}):
            members = [c.process for c in self.children if c.spec.stop_group == group]
            stop_group(members, cut_short=lambda: self._stop_requests != requests_at_start)
        for c in self.children:
            if not c.state.terminal:
                c.state = ChildState.STOPPED


def install_stop_signals(supervisor: Supervisor) -> Callable[[], None]:
    """SIGINT and SIGTERM ask the supervisor to stop; returns a function restoring the old handlers."""
    previous = {sig: signal.signal(sig, supervisor.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
