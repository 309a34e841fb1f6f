"""A worker's event loop is uvloop's where uvloop is installed (``runtime/worker/runner.py``: every
token crosses from the torch thread to the loop, and uvloop's hand-offs are cheaper), else asyncio's."""

from __future__ import annotations

import asyncio
import builtins

from runtime.worker import runner


def loop_module() -> str:
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__.split(".")[0])

    runner.run_event_loop(main())
    return seen[0]


def test_a_worker_runs_on_uvloop_where_it_is_installed():
    assert loop_module() == "uvloop"


def test_without_uvloop_a_worker_runs_on_asyncios_own_loop(monkeypatch):
    real_import = builtins.__import__

    def no_uvloop(name, *args, **kwargs):
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert loop_module() == "asyncio"
