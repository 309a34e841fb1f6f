"""Encoder replicas as separate OS processes sharing the real Redis on 127.0.0.1:6379.

Two replica processes (tests/helpers_cache/replica.py) start together once
for this module; this pytest process is a third replica. The Redis counter
``{namespace}:test:computes`` counts encoder runs in the child processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cache.fixtures import REDIS_URL, Encoder, must_not_compute, namespace, open_cache, raw  # noqa: F401

from helpers_cache.replica import expected_tensor

REPLICA = Path(__file__).parent / "helpers_cache" / "replica.py"


class Replica:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(REPLICA)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def send(self, namespace: str, key: str, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"url": REDIS_URL, "namespace": namespace, "key": key, **cmd}) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        out = self.line()
        assert out.startswith("{"), f"replica said {out!r} (exit code {self.proc.poll()})"
        return json.loads(out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


class ReplicaPool:
    """Replica processes started together (torch imports in parallel); a killed one is replaced on use."""

    def __init__(self, size: int) -> None:
        self._replicas = [Replica() for _ in range(size)]
        self._ready = [False] * size

    def __getitem__(self, index: int) -> Replica:
        if self._replicas[index].proc.poll() is not None:
            self._replicas[index], self._ready[index] = Replica(), False
        if not self._ready[index]:
            assert self._replicas[index].line() == "ready"
            self._ready[index] = True
        return self._replicas[index]

    def stop(self) -> None:
        for replica in self._replicas:
            replica.stop()


@pytest.fixture(scope="module")
def replicas() -> Iterator[ReplicaPool]:
    pool = ReplicaPool(2)
    yield pool
    pool.stop()


def computes(raw, namespace: str) -> int:
    return int(raw.get(f"{namespace}:test:computes") or 0)


async def test_single_flight_across_processes_then_hit_in_another(replicas, open_cache, raw, namespace) -> None:
    a, b = replicas[0], replicas[1]
    here = open_cache()  # this pytest process races too
    local = Encoder(expected_tensor(), delay_s=0.5)
    a.send(namespace, "img", tasks=4, delay=0.5)
    b.send(namespace, "img", tasks=4, delay=0.5)
    ours = await asyncio.gather(*(here.get_or_compute("img", local) for _ in range(4)))
    theirs = [await asyncio.to_thread(r.result) for r in (a, b)]
    # 12 concurrent requests in 3 processes: exactly one encode anywhere
    assert computes(raw, namespace) + local.calls == 1
    assert all(t["ok"] for t in theirs) and all(torch.equal(f.tensor, expected_tensor()) for f in ours)
    hits = [f.hit for f in ours] + [h for t in theirs for h in t["hits"]]
    assert sorted(hits) == [False] + [True] * 11
    # all but one joined the encode in flight (merge); a replica slowed down by a busy host may
    # instead arrive after it finished and read the stored entry (hit): never a second encode
    served = [here.stats()] + [t["stats"] for t in theirs]
    assert sum(st["merges"] + st["hits"] for st in served) == 11 and sum(st["merges"] for st in served) >= 3

    # an image encoded by one replica process is a hit for a fresh replica elsewhere
    fresh = open_cache()
    fetched = await fresh.get_or_compute("img", must_not_compute)
    assert fetched.hit and torch.equal(fetched.tensor, expected_tensor()) and fresh.stats()["remote_hits"] == 1


async def test_image_encoded_here_is_a_hit_for_a_child_process(replicas, open_cache, raw, namespace) -> None:
    await open_cache().get_or_compute("img2", Encoder(expected_tensor()))
    replicas[0].send(namespace, "img2")
    child = await asyncio.to_thread(replicas[0].result)
    assert child["hits"] == [True] and child["stats"]["computes"] == 0 and child["ok"]
    assert computes(raw, namespace) == 0


async def test_lock_of_a_killed_holder_expires_and_another_process_encodes(replicas, open_cache, raw, namespace):
    holder = replicas[1]
    holder.send(namespace, "img", mode="hold", lock_ttl=0.6)
    assert await asyncio.to_thread(holder.line) == "computing"
    assert raw.exists(f"{namespace}:lock:img")
    replica = open_cache()
    encoder = Encoder(expected_tensor())
    waiting = asyncio.create_task(replica.get_or_compute("img", encoder))
    await asyncio.sleep(0.8)
    assert not waiting.done()  # the live holder renews its 0.6 s lock: we keep waiting
    t0 = time.monotonic()
    holder.stop()  # SIGKILL: no release, no more renewals
    fetched = await asyncio.wait_for(waiting, timeout=10)
    assert not fetched.hit and encoder.calls == 1
    assert time.monotonic() - t0 < 3.0  # freed by the lock's expiry, not by the 30 s wait timeout
    assert computes(raw, namespace) == 1  # the dead holder's run; ours is counted by `encoder`
