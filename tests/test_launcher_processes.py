"""launcher/processes.py: start, wait for, restart and stop real child processes.

The children are tiny ``python -c`` scripts (no model, no worker), so this runs without the
heavy lock; every process started here is stopped by the test that started it.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from launcher.processes import (
    Process,
    ProcessSpec,
    StartError,
    StartTimeout,
    accepting,
    child_env,
    free_port,
    grpc_serving,
    http_ok,
    start_process,
    stop_group,
    wait_serving,
)


def script(tmp_path: Path, name: str, code: str, **spec) -> ProcessSpec:
    return ProcessSpec(name, [sys.executable, "-c", textwrap.dedent(code)], child_env(), tmp_path / f"{name}.log",
                       **spec)


IGNORES_TERM = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(120)
"""
SLEEPS = """
    import time
    print("ready", flush=True)
    time.sleep(120)
"""


def wait_ready(p: Process) -> None:
    wait_serving(lambda: "ready" in p.log(), [p], 30, p.name, poll_s=0.05)


def test_wait_serving_fails_early_with_the_log_tail(tmp_path: Path) -> None:
    p = start_process(script(tmp_path, "crasher", "print('no model here'); raise SystemExit(3)"))
    with pytest.raises(StartError) as exc:
        wait_serving(lambda: False, [p], timeout_s=120, what="crasher")
    assert not isinstance(exc.value, StartTimeout)
    assert "crasher exited with 3" in str(exc.value) and "no model here" in str(exc.value)


def test_wait_serving_times_out_while_the_process_runs(tmp_path: Path) -> None:
    p = start_process(script(tmp_path, "sleeper", SLEEPS))
    try:
        with pytest.raises(StartTimeout) as exc:
            wait_serving(lambda: False, [p], timeout_s=0.3, what="http://127.0.0.1:1/health", poll_s=0.05)
        assert isinstance(exc.value, TimeoutError) and isinstance(exc.value, StartError)
        assert "http://127.0.0.1:1/health not healthy" in str(exc.value)
        assert p.alive()
    finally:
        p.stop()


def test_stop_group_terms_then_kills(tmp_path: Path) -> None:
    polite = start_process(script(tmp_path, "polite", SLEEPS))
    stubborn = start_process(script(tmp_path, "stubborn", IGNORES_TERM))
    never_started = Process(script(tmp_path, "never", SLEEPS))
    wait_ready(polite)
    wait_ready(stubborn)
    stop_group([polite, stubborn, never_started], timeout_s=0.5)
    assert polite.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    assert never_started.popen is None and not polite.alive() and not stubborn.alive()
    stop_group([polite, stubborn])   # stopping again: nothing to signal, nothing raised


def test_cut_short_ends_the_wait(tmp_path: Path) -> None:
    stubborn = start_process(script(tmp_path, "stubborn", IGNORES_TERM, stop_timeout_s=600))
    wait_ready(stubborn)
    asked: list[bool] = []

    def stop_now() -> bool:
        asked.append(True)
        return True

    stop_group([stubborn], cut_short=stop_now)
    assert asked and stubborn.returncode == -signal.SIGKILL


def test_restart_appends_to_the_log_and_refuses_a_second_live_copy(tmp_path: Path) -> None:
    p = Process(script(tmp_path, "twice", "print('run', flush=True)"))
    assert p.poll() is None and not p.alive() and p.log() == ""
    p.start().popen.wait()
    p.start().popen.wait()
    assert p.starts == 2 and p.poll() == 0
    assert p.log().splitlines() == ["run", "run"]
    fresh = start_process(script(tmp_path, "twice", SLEEPS))   # a new Process truncates the log
    try:
        wait_ready(fresh)
        assert fresh.log().splitlines() == ["ready"]
        with pytest.raises(RuntimeError, match="already running"):
            fresh.start()
    finally:
        fresh.stop()


def test_own_group(tmp_path: Path) -> None:
    alone = start_process(script(tmp_path, "alone", SLEEPS, own_group=True))
    shared = start_process(script(tmp_path, "shared", SLEEPS))
    try:
        assert os.getpgid(alone.pid) == alone.pid
        assert os.getpgid(shared.pid) == os.getpgid(0)
    finally:
        stop_group([alone, shared])


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in state   # a zombie nobody reaped yet has exited


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_a_child_does_not_outlive_its_parent(tmp_path: Path) -> None:
    parent = textwrap.dedent("""
        import sys, time
        from launcher.processes import ProcessSpec, start_process
        child = start_process(ProcessSpec("child", [sys.executable, "-c", "import time; time.sleep(120)"]))
        print(child.pid, flush=True)
        time.sleep(0.5)
    """)
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    pid = int(out.stdout.strip())
    end = time.monotonic() + 30
    while not _dead(pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert _dead(pid), "the child kept running after its parent exited"


def test_child_env() -> None:
    env = child_env({"B": "2"}, drop=("SECRET",), base={"A": "1", "SECRET": "x", "B": "1"})
    assert env == {"A": "1", "B": "2", "PYTHONUNBUFFERED": "1"}


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_probes() -> None:
    closed = free_port()
    assert not accepting("127.0.0.1", closed)
    assert not http_ok(f"http://127.0.0.1:{closed}/health", timeout_s=1)
    assert not grpc_serving(f"127.0.0.1:{closed}", timeout_s=1)
    server = http.server.HTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert accepting("0.0.0.0", port) and accepting("127.0.0.1", port)
        assert http_ok(f"http://127.0.0.1:{port}/health")
        assert not http_ok(f"http://127.0.0.1:{port}/draining")
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:   # free_port's port can be bound
        s.bind(("127.0.0.1", free_port()))
