"""The gateway's own work before it calls any worker, in-process: request in -> job handed on.

    python -m bench.gateway_hot_path [--model models/demo-vlm] [--requests 64] [--profile 25]

Builds the real gateway app (``gateway.app.create_app``: validation, image decode, template,
tokenization, the thread hops) with a backend that answers each job with one finished token at
once, and sends the load generator's requests (one new image each, streamed) one at a time
through httpx's ASGI transport. Prints the median of the wall time from the request's arrival to
the backend's call (as the client clocks it: the breakdown's ``gateway_ms`` also counts the
event loop's recent lag as a hidden wait) and of the whole request; with ``--profile N`` the N slowest functions by own time under cProfile. No worker,
no model weights: what it measures is only the gateway's pre-pipeline path.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from bench.harness.paths import ROOT
from bench.workload import build_workload
from gateway.app import create_app
from gateway.chat_backend import ChatJob, TokenEvent
from gateway.settings import GatewaySettings


class AnswerAtOnce:
    """A ChatBackend that records when each job arrived and finishes it with one token."""

    def __init__(self) -> None:
        self.sent_s = 0.0                   # when the client sent the current request
        self.gateway_ms: list[float] = []

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def healthy(self) -> bool:
        return True

    def status(self) -> dict:
        return {}

    def shed_estimate_ms(self) -> float:
        return 0.0

    async def generate(self, job: ChatJob) -> AsyncIterator[TokenEvent]:
        self.gateway_ms.append((time.monotonic() - self.sent_s) * 1e3)
        yield TokenEvent([job.token_ids[-1]], "length", {})


async def run(model: Path, requests: int, seed: int, profiler: cProfile.Profile | None) -> dict:
    backend = AnswerAtOnce()
    app = create_app(GatewaySettings(model=str(model), served_model_name="demo"), backend)
    work = build_workload(requests + 4, requests + 4, seed)
    total_ms: list[float] = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as client:
            for i, spec in enumerate(work.requests):
                body = {"model": "demo", "messages": spec.messages, "max_tokens": 1, "temperature": 0,
                        "stream": True}
                if i == 4 and profiler is not None:   # the first 4 warm up
                    profiler.enable()
                t0 = time.perf_counter()
                backend.sent_s = time.monotonic()
                async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
                    if resp.status_code != 200:
                        raise RuntimeError(f"status {resp.status_code}")
                total_ms.append((time.perf_counter() - t0) * 1e3)
    if profiler is not None:
        profiler.disable()
    return {"gateway_ms_p50": statistics.median(backend.gateway_ms[4:]),
            "request_ms_p50": statistics.median(total_ms[4:]), "requests": requests}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_hot_path", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "demo-vlm")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=500)
    p.add_argument("--profile", type=int, default=0, help="print the N functions with the most own time")
    args = p.parse_args(argv)
    profiler = cProfile.Profile() if args.profile else None
    out = asyncio.run(run(args.model, args.requests, args.seed, profiler))
    print(f"gateway_ms p50 {out['gateway_ms_p50']:.2f} ms, whole request p50 {out['request_ms_p50']:.2f} ms "
          f"({out['requests']} requests, one at a time)")
    if profiler is not None:
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(args.profile)
        print(s.getvalue())
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("cumulative").print_stats(args.profile * 2)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
