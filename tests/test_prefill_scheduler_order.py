"""A prefill worker serves prompts in arrival order, within a step's token budget.

The demo model's real forwards in process, with a sender that records what each step made
ready (the bytes' way to decode is ``test_kv_handoff.py``'s). A burst of long prompts submitted
together: the first gets all its chunks, and its first token, before the second starts, so its
wait is its own work, not the whole burst's. Short prompts still share a step up to the budget.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from cluster import DEMO_MODEL

from prefill_svc.kv_sender import TransferBroken
from prefill_svc.scheduler import PrefillJob, PrefillScheduler
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter
from runtime.model.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RecordingSender:
    """What a ``KVSender`` is handed, in order, for every job of one scheduler (``log``)."""

    def __init__(self, name: str, log: list[tuple[str, int, int, bool]]):
        self.name, self.log = name, log

    def send(self, chunk) -> None:
        self.log.append((self.name, chunk.token_start, chunk.token_end, chunk.final is not None))

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        self.log.append((self.name, -1, -1, False))   # logged as a chunk that spans nothing


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    torch.set_grad_enabled(False)
    return VLMAdapter.load(DEMO_MODEL)


async def _burst(adapter: VLMAdapter, lengths: list[int], chunk: int, step_tokens: int):
    """Submit one prompt of each length at once; (what was sent, in order, and each step's prompts)."""
    pool = KVBlockPool(adapter.kv_layout, 64, 16)
    scheduler = PrefillScheduler(adapter, pool, max_batch=8, step_tokens=step_tokens)
    steps: list[list[str]] = []
    step = scheduler._step

    async def recorded(spans):
        steps.append([job.request_id for job, _, _ in spans])
        await step(spans)

    scheduler._step = recorded
    log: list[tuple[str, int, int, bool]] = []
    jobs = []
    for i, n in enumerate(lengths):
        words = [t for t in range(3, 60) if t != adapter.image_token_id]
        ids = [1] + [words[(i + k) % len(words)] for k in range(n - 1)]
        jobs.append(PrefillJob(f"p{i}", adapter.prepare(ids, []), SamplingParams(), chunk, RecordingSender(f"p{i}", log),
                               prompt_ids=ids))
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(job.done for job in jobs)), 60)
    finally:
        await scheduler.stop()
    assert pool.free_blocks == 64
    return log, steps


async def test_a_burst_of_long_prompts_is_prefilled_one_after_another(adapter):
    log, steps = await _burst(adapter, [40, 40, 40], chunk=16, step_tokens=16)
    assert log == [(p, s, e, e == 40) for p in ("p0", "p1", "p2") for s, e in ((0, 16), (16, 32), (32, 40))]
    # a tail of 8 and the next prompt's chunk of 16 pass the budget together: one prompt a step
    assert steps == [["p0"]] * 3 + [["p1"]] * 3 + [["p2"]] * 3


async def test_short_prompts_share_a_step_up_to_the_budget_in_arrival_order(adapter):
    log, steps = await _burst(adapter, [10, 10, 10, 10, 30], chunk=16, step_tokens=32)
    assert steps[0] == ["p0", "p1", "p2"]          # 30 tokens; the fourth would pass 32
    assert steps[1] == ["p3", "p4"]               # 10 + the last one's first chunk of 16
    assert [entry[0] for entry in log if entry[3]] == ["p0", "p1", "p2", "p3", "p4"]


async def test_a_prompt_longer_than_the_budget_still_moves_a_whole_chunk_a_step(adapter):
    log, steps = await _burst(adapter, [48, 8], chunk=32, step_tokens=16)
    assert steps == [["p0"], ["p0"], ["p1"]]
    assert [(p, s, e) for p, s, e, _ in log] == [("p0", 0, 32), ("p0", 32, 48), ("p1", 0, 8)]


async def test_a_prompt_whose_transfer_ended_while_it_waited_is_dropped_without_compute(adapter):
    """Its deadline came (or its decode worker went) while a long prompt ahead was prefilled: the
    wait ends with the transfer's failure at once, and the prompt never takes a step."""
    pool = KVBlockPool(adapter.kv_layout, 64, 16)
    scheduler = PrefillScheduler(adapter, pool, max_batch=8, step_tokens=16)
    log: list[tuple[str, int, int, bool]] = []
    words = [t for t in range(3, 60) if t != adapter.image_token_id]
    ahead = PrefillJob("ahead", adapter.prepare([1] + words[:47], []), SamplingParams(), 16,
                       RecordingSender("ahead", log))
    late = PrefillJob("late", adapter.prepare([1] + words[:20], []), SamplingParams(), 16,
                      RecordingSender("late", log))
    scheduler.submit(ahead)
    scheduler.submit(late)
    broken = asyncio.get_running_loop().create_future()
    broken.set_exception(TransferBroken("bulk KV stream failed: TimeoutError()"))
    scheduler.start()
    try:
        with pytest.raises(TransferBroken):
            await asyncio.wait_for(scheduler.first_token(late, broken), 5)
        await asyncio.wait_for(ahead.done, 30)
        with pytest.raises(asyncio.CancelledError):
            await late.done
    finally:
        await scheduler.stop()
    assert [e for e in log if e[0] == "ahead"] == [("ahead", 0, 16, False), ("ahead", 16, 32, False), ("ahead", 32, 48, True)]
    assert [e for e in log if e[0] == "late"] == [("late", -1, -1, False)]   # aborted, and never a chunk
    assert late.next_start == 0 and pool.free_blocks == 64
