"""A worker's model calls share one thread (``runtime/worker/torch_thread.py``): one OpenMP team per process.

The failure this guards against was silent: forwards spread over the default executor's
threads each grew their own OpenMP team, which spun against the others. Checked here: every
call, from any number of concurrent tasks, runs on the one thread, one at a time and in
submission order, in its caller's context.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest
import torch

from runtime.worker import torch_thread

REQUEST = contextvars.ContextVar("request", default="")


def test_concurrent_calls_run_on_one_thread_in_order_with_their_context():
    active = []
    seen: list[tuple[str, str]] = []

    def work(name: str) -> str:
        active.append(name)
        assert len(active) == 1, "two calls overlapped"
        time.sleep(0.005)
        seen.append((threading.current_thread().name, REQUEST.get()))
        active.remove(name)
        return name

    async def one(i: int) -> str:
        REQUEST.set(f"r{i}")
        return await torch_thread.run(work, f"call{i}")

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(main()) == [f"call{i}" for i in range(8)]
    assert {name for name, _ in seen} == {seen[0][0]} and seen[0][0].startswith("epd-torch")
    assert [ctx for _, ctx in seen] == [f"r{i}" for i in range(8)]


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    def boom():
        raise ValueError("bad input")

    async def main():
        with pytest.raises(ValueError, match="bad input"):
            await torch_thread.run(boom)
        return await torch_thread.run(lambda: torch.ones(2).sum().item())

    assert asyncio.run(main()) == 2.0



def test_a_call_whose_caller_left_before_it_started_never_runs():
    ran = []

    async def main():
        first = asyncio.ensure_future(torch_thread.run(time.sleep, 0.2))
        await asyncio.sleep(0.05)   # the thread is busy with the first call
        second = asyncio.ensure_future(torch_thread.run(ran.append, "second"))
        await asyncio.sleep(0)
        second.cancel()
        await first
        assert await torch_thread.run(lambda: "after") == "after"   # behind the skipped one, in order
        return second.cancelled()

    assert asyncio.run(main()) is True
    assert ran == []


def test_loops_in_two_threads_each_get_their_own_results():
    """The one thread serves loops in two threads at once; each result is settled on its own caller's loop."""
    results: dict[str, list[int]] = {}

    def in_thread(name: str) -> None:
        async def main():
            return [await torch_thread.run(lambda i=i: (time.sleep(0.002), i)[1]) for i in range(20)]
        results[name] = asyncio.run(main())

    threads = [threading.Thread(target=in_thread, args=(f"t{k}",)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {"t0": list(range(20)), "t1": list(range(20))}


def test_the_handoff_benchmark_measures_both_kinds(tmp_path):
    """``bench.torch_handoff`` runs end to end and reports each kind (no timing claim here)."""
    import json

    from bench import torch_handoff

    out = tmp_path / "handoff.json"
    assert torch_handoff.main(["--calls", "5", "--warmup", "1", "--gap-ms", "0", "--core", "", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == list(torch_handoff.KINDS)
    assert all(row["us_p50"] > 0 for row in summary.values())
    assert summary["torch_thread"]["over_torch_thread"] == 1.0
