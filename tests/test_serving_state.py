"""The part of every role's servicer the common runner drives: the drain, and the Stats envelope."""

from __future__ import annotations

import asyncio
import time

from proto.epd.v1 import epd_pb2 as pb
from runtime.worker.serving_state import ServingState
from runtime.worker.timing_log import TimingLog


async def test_a_drain_refuses_new_work_at_once_and_waits_for_accepted_work():
    state = ServingState("prefill", TimingLog(), "fp")
    in_flight = [1]
    drain = asyncio.ensure_future(state.drain(lambda: in_flight[0], timeout_s=30))
    await asyncio.sleep(0.1)
    assert not state.serving and not drain.done()        # refusing new work, still waiting for the accepted
    in_flight[0] = 0
    await asyncio.wait_for(drain, 5)


async def test_a_drain_gives_up_after_its_timeout():
    state = ServingState("decode", TimingLog(), "fp")
    started = time.monotonic()
    await state.drain(lambda: True, timeout_s=0.2)
    assert not state.serving and time.monotonic() - started < 5


def test_every_stats_reply_carries_the_workers_identity_and_new_samples():
    timings = TimingLog()
    state = ServingState("encoder", timings, "fp-1")
    state.address = "10.0.0.1:50051"
    for ms in (1.0, 2.0, 3.0):
        timings.record("encode", 1, ms)
    stats = state.stats(pb.StatsRequest(since_sample=1), queue_depth=4, max_batch=2)
    assert (stats.role, stats.address, stats.serving, stats.model_fingerprint) == ("encoder", "10.0.0.1:50051", True, "fp-1")
    assert [s.ms for s in stats.samples] == [2.0, 3.0] and stats.last_sample == 3
    assert (stats.queue_depth, stats.max_batch) == (4, 2)
