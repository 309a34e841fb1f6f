"""``epd serve``'s supervisor and restart policy, with real (tiny) child processes.

The children are short Python scripts, not epd workers, so these run in seconds:
restart with backoff on the same command, giving up loudly after the window's limit,
a required role lost stops everything (1), an optional one does not, a stop request
stops groups in order with no restart during the shutdown (0), and a second stop
request kills what ignores SIGTERM.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from launcher.restart_policy import ExitHistory, RestartPolicy
from launcher.supervisor import ChildSpec, ChildState, Supervisor

FAST = RestartPolicy(backoff_s=0.05, max_backoff_s=0.4, limit=3, window_s=60.0)

# appends "<name> start <pid>" when it starts and "<name> term <time>" on SIGTERM, then runs until stopped
RECORDER = r"""
import os, signal, sys, time
name, path, on_term = sys.argv[1], sys.argv[2], sys.argv[3]
def log(line):
    with open(path, "a") as f:
        f.write(line + "\n")
def term(*_):
    log(f"{name} term {time.monotonic()}")
    if on_term == "exit":
        time.sleep(0.2)
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
log(f"{name} start {os.getpid()}")
while True:
    time.sleep(0.05)
"""


def recorder(role: str, path: Path, *, on_term: str = "exit", group: int = 1, stop_timeout_s: float = 10.0) -> ChildSpec:
    return ChildSpec(role, f"{role}-addr", [sys.executable, "-c", RECORDER, role, str(path), on_term],
                     dict(os.environ), lambda: True, stop_group=group, stop_timeout_s=stop_timeout_s)


def crasher(role: str, code: int = 3) -> ChildSpec:
    return ChildSpec(role, f"{role}-addr", [sys.executable, "-c", f"import sys; sys.exit({code})"],
                     dict(os.environ), lambda: True)


def lines(path: Path, word: str) -> list[list[str]]:
    if not path.exists():
        return []
    return [ln.split() for ln in path.read_text().splitlines() if ln.split()[1] == word]


def until(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)


def in_background(fn) -> threading.Thread:
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as exc:  # surfaced by the test through .errors
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.errors = errors  # type: ignore[attr-defined]
    t.start()
    return t


# -- the policy -------------------------------------------------------------------------------

def test_backoff_doubles_and_gives_up_at_the_limit_within_the_window():
    h = ExitHistory(RestartPolicy(backoff_s=1.0, max_backoff_s=3.0, limit=4, window_s=60.0))
    assert [h.record(t, 1) for t in (0.0, 1.0, 3.0)] == [1.0, 2.0, 3.0]   # capped at the maximum
    assert h.record(10.0, -9) is None                                     # the 4th within 60 s
    assert h.codes() == [1, 1, 1, -9]


def test_exits_older_than_the_window_are_forgotten():
    h = ExitHistory(RestartPolicy(backoff_s=1.0, max_backoff_s=30.0, limit=2, window_s=10.0))
    assert h.record(0.0, 1) == 1.0
    assert h.record(11.0, 1) == 1.0       # the first has left the window: a first exit again
    assert h.record(12.0, 1) is None


def test_bad_policies_are_refused():
    for kwargs in ({"limit": 0}, {"window_s": 0}, {"backoff_s": 5.0, "max_backoff_s": 1.0}, {"backoff_s": -1}):
        with pytest.raises(ValueError):
            RestartPolicy(**kwargs)


# -- the supervisor ---------------------------------------------------------------------------

def test_a_crashing_required_child_is_retried_then_given_up_on_loudly():
    out = io.StringIO()
    sup = Supervisor(FAST, frozenset({"decode"}), log=out, tick_s=0.02)
    t0 = time.monotonic()
    rc = sup.run([crasher("decode")], crasher("gateway"), lambda children: None)
    took = time.monotonic() - t0
    text = out.getvalue()
    assert rc == 1
    decode = sup.children[0]
    assert decode.state == ChildState.GAVE_UP and decode.starts == 3
    assert "decode at decode-addr exited with 3; restarting in 0.05 s" in text
    assert "exited with 3; restarting in 0.1 s" in text      # the backoff doubled
    assert "giving up on decode at decode-addr: it exited 3 times within 60 s (exit codes 3, 3, 3)" in text
    assert "no decode left running; stopping everything" in text
    assert took >= 0.15, "the restarts waited their backoff"


def test_an_optional_role_given_up_on_leaves_the_rest_running(tmp_path):
    events = tmp_path / "events"
    out = io.StringIO()
    sup = Supervisor(FAST, frozenset({"decode", "gateway"}), log=out, tick_s=0.02)
    ready: list[list[str]] = []

    def control():
        until(lambda: "giving up on prefill" in out.getvalue(), 10, "prefill given up on")
        until(lambda: ready, 10, "the stack announced")
        time.sleep(0.3)                     # still running after the optional role was lost
        sup.request_stop()

    t = in_background(control)
    rc = sup.run([crasher("prefill", 1), recorder("decode", events)], recorder("gateway", events, group=0),
                 lambda children: ready.append([c.spec.role for c in children]))
    t.join(5)
    assert not t.errors, t.errors
    assert rc == 0
    assert ready == [["prefill", "decode", "gateway"]]   # the gateway started once prefill was settled
    assert [ln[0] for ln in lines(events, "term")] == ["gateway", "decode"]


def test_a_killed_child_is_restarted_with_the_same_command_and_stop_restarts_nothing(tmp_path):
    events = tmp_path / "events"
    out = io.StringIO()
    sup = Supervisor(FAST, frozenset({"decode", "gateway"}), log=out, tick_s=0.02)

    def control():
        until(lambda: len(lines(events, "start")) == 3, 10, "both children started")
        first_pid = next(int(ln[2]) for ln in lines(events, "start") if ln[0] == "decode")
        os.kill(first_pid, signal.SIGKILL)
        until(lambda: len([ln for ln in lines(events, "start") if ln[0] == "decode"]) == 2, 10, "decode restarted")
        until(lambda: "decode at decode-addr is serving again" in out.getvalue(), 10, "the restart announced")
        sup.request_stop()

    t = in_background(control)
    rc = sup.run([recorder("decode", events), recorder("encoder", events)], recorder("gateway", events, group=0),
                 lambda children: None)
    t.join(5)
    assert not t.errors, t.errors
    assert rc == 0
    assert "decode at decode-addr exited with SIGKILL; restarting in 0.05 s" in out.getvalue()
    # the gateway's group was told first, and nothing started after the stop
    terms = lines(events, "term")
    assert terms[0][0] == "gateway" and {ln[0] for ln in terms[1:]} == {"decode", "encoder"}
    assert float(terms[0][2]) < min(float(ln[2]) for ln in terms[1:])
    assert len(lines(events, "start")) == 4
    assert all(not c.alive for c in sup.children)
    assert all(c.state == ChildState.STOPPED for c in sup.children)


def test_a_second_stop_request_kills_what_ignores_sigterm(tmp_path):
    events = tmp_path / "events"
    sup = Supervisor(FAST, frozenset({"decode", "gateway"}), log=io.StringIO(), tick_s=0.02)
    pids: list[int] = []

    def control():
        until(lambda: len(lines(events, "start")) == 2, 10, "children started")
        pids.extend(int(ln[2]) for ln in lines(events, "start"))
        sup.request_stop()
        until(lambda: len(lines(events, "term")) == 1, 10, "SIGTERM delivered to the gateway")
        sup.request_stop()                   # it ignores SIGTERM: its 60 s grace is cut, and the workers' too

    t = in_background(control)
    t0 = time.monotonic()
    rc = sup.run([recorder("decode", events, on_term="ignore", stop_timeout_s=60)],
                 recorder("gateway", events, on_term="ignore", group=0, stop_timeout_s=60), lambda children: None)
    t.join(5)
    assert not t.errors, t.errors
    assert rc == 0
    assert time.monotonic() - t0 < 20
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
