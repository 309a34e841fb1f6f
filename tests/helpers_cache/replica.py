"""An encoder replica in its own OS process, for the cross-process cache tests.

Started once (importing torch is the slow part), then driven over stdin:

    python tests/helpers_cache/replica.py
    -> prints "ready"
    <- one JSON command per line:
       {"url": ..., "namespace": ..., "key": ..., "mode": "encode" | "hold",
        "tasks": N, "delay": S, "lock_ttl": S}
    -> encode: runs N concurrent get_or_compute(key) whose compute sleeps
       `delay`, INCRs "{namespace}:test:computes" and returns expected_tensor();
       prints one JSON line {"hits": [...], "ok": bool, "stats": {...}}
    -> hold: the compute INCRs the counter, prints "computing" and never
       returns (the test kills this process while it holds the lock).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis  # noqa: E402
import torch  # noqa: E402

from cache import open_encoder_cache  # noqa: E402


def expected_tensor() -> torch.Tensor:
    return torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 7


async def run(cmd: dict[str, Any]) -> dict[str, Any]:
    cache = open_encoder_cache(
        cmd["url"],
        max_bytes=1 << 24,
        ttl_s=60,
        namespace=cmd["namespace"],
        lock_ttl_s=cmd.get("lock_ttl", 10.0),
        poll_interval_s=0.05,
    )
    counter = redis.Redis.from_url(cmd["url"])

    async def encode() -> torch.Tensor:
        counter.incr(f"{cmd['namespace']}:test:computes")
        if cmd.get("mode") == "hold":
            print("computing", flush=True)
            await asyncio.Event().wait()
        await asyncio.sleep(cmd.get("delay", 0.0))
        return expected_tensor()

    try:
        results = await asyncio.gather(*(cache.get_or_compute(cmd["key"], encode) for _ in range(cmd.get("tasks", 1))))
        ok = all(torch.equal(r.tensor, expected_tensor()) for r in results)
        return {"hits": [r.hit for r in results], "ok": ok, "stats": cache.stats()}
    finally:
        await cache.close()
        counter.close()


async def main() -> None:
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        print(json.dumps(await run(json.loads(line))), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
