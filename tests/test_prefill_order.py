"""The order colocated prompts get prefilled in on a decode worker (``decode_svc/prefill_order.py``),
and when (``DecodeScheduler``'s refill wait).

A short chat prompt queued behind a long document on the same decode worker gets its first token
within a step or two instead of after every chunk of the document; a prompt whose first-token
deadline is at risk goes first whatever its length; and the order changes no token. A step that
refills the batch waits, briefly, for the colocated prompts on their way, so a burst starts together.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from cluster import DEMO_MODEL

from decode_svc.prefill_order import prefill_order
from decode_svc.request_status import DecodeStatus
from decode_svc.reservations import Lease
from decode_svc.scheduler import DecodeScheduler, Sequence
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter
from runtime.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 4


def seq(name: str, prompt_len: int, prefilled: int = 0, deadline_s: float = math.inf) -> Sequence:
    s = Sequence(name, Lease(name, 0, 0), [], prompt_len, MAX_TOKENS, SamplingParams())
    s.prefilled, s.first_token_deadline_s = prefilled, deadline_s
    return s


def names(order: list[Sequence]) -> list[str]:
    return [s.request_id for s in order]


def test_least_remaining_prompt_first_in_arrival_order_among_equals():
    doc, chat, doc2, chat2 = seq("doc", 400), seq("chat", 26), seq("doc2", 400, prefilled=300), seq("chat2", 26)
    assert names(prefill_order([doc, chat, doc2, chat2], 1.5, 0.0)) == ["chat", "chat2", "doc2", "doc"]


def test_arrival_order_until_a_prompt_token_is_priced():
    doc, chat = seq("doc", 400), seq("chat", 26)
    assert names(prefill_order([doc, chat], None, 0.0)) == ["doc", "chat"]


def test_a_prompt_whose_deadline_is_at_risk_goes_first_earliest_deadline_first():
    """Queued work 2 x 1 ms x (400 + 26 + 400) = 1.65 s: a deadline nearer than that is at risk."""
    now = 100.0
    doc = seq("doc", 400, deadline_s=now + 1.0)       # at risk: ahead of the shorter prompt
    late = seq("late", 400, deadline_s=now + 0.5)     # at risk and sooner: first
    chat = seq("chat", 26, deadline_s=now + 30.0)
    assert names(prefill_order([doc, chat, late], 1.0, now)) == ["late", "doc", "chat"]
    relaxed = seq("doc", 400, deadline_s=now + 2.0)    # would make it even if served last
    assert names(prefill_order([relaxed, chat], 1.0, now)) == ["chat", "doc"]


# -- the scheduler takes its chunks in that order --------------------------------------------------------
@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    torch.set_grad_enabled(False)
    return VLMAdapter.load(DEMO_MODEL)


def text_ids(adapter: VLMAdapter, n: int, offset: int) -> list[int]:
    vocab = adapter.model.config.get_text_config().vocab_size
    special = {adapter.image_token_id, *adapter.eos_token_ids}
    ids = [(offset + 7 * i) % vocab for i in range(3 * n)]
    return [t for t in ids if t not in special][:n]


async def run(adapter: VLMAdapter, prompts: dict[str, list[int]], deadlines: dict[str, float] | None = None):
    """Insert ``prompts`` colocated in dict order (a 16-token budget a step, after one priced step) and
    collect, per prompt, its tokens and the statuses of the others when its first token came."""
    pool = KVBlockPool(adapter.kv_layout, 96, 16)
    scheduler = DecodeScheduler(adapter, pool, prefill_token_budget=16)
    scheduler.step_budget.refill_tokens = 16   # one chunk a step, refills too: the order decides who goes first
    scheduler.start()
    try:
        warm = text_ids(adapter, 20, 3)   # prices a prompt token (the order needs ``token_ms``)
        seqs = {"warm": _sequence(pool, "warm", len(warm))}
        scheduler.insert_colocated(seqs["warm"], adapter.prepare(warm, []))
        await _drain(seqs["warm"])
        assert scheduler.step_budget.token_ms
        for name, ids in prompts.items():
            seqs[name] = _sequence(pool, name, len(ids))
            seqs[name].first_token_deadline_s = (deadlines or {}).get(name, math.inf)
        seen: dict[str, dict[str, DecodeStatus]] = {}
        for name, ids in prompts.items():   # no await between inserts: the next step sees them all
            scheduler.insert_colocated(seqs[name], adapter.prepare(ids, []))
        outputs = await asyncio.gather(*(_drain(seqs[n], seen, seqs) for n in prompts))
        return dict(zip(prompts, outputs)), seen
    finally:
        await scheduler.stop()


def _sequence(pool: KVBlockPool, name: str, prompt_len: int) -> Sequence:
    owner = pool.new_token()
    blocks = pool.allocate(prompt_len + MAX_TOKENS, owner=owner)
    return Sequence(name, Lease(name, 0, owner), blocks, prompt_len, MAX_TOKENS, SamplingParams())


async def _drain(s: Sequence, seen=None, seqs=None) -> list[int]:
    tokens: list[int] = []
    while True:
        ev = await asyncio.wait_for(s.events.get(), 30)
        if seen is not None and not tokens:
            seen[s.request_id] = {n: o.status for n, o in seqs.items() if n != s.request_id}
        tokens += ev.token_ids
        if ev.finish_reason:
            return tokens


async def test_a_short_prompt_behind_a_long_one_gets_its_first_token_while_the_long_one_prefills(adapter):
    long_ids, short_ids = text_ids(adapter, 160, 11), text_ids(adapter, 6, 5)
    outputs, seen = await run(adapter, {"long": long_ids, "short": short_ids})
    assert seen["short"]["long"] is DecodeStatus.PREFILLING, "the short prompt waited for the whole long one"
    alone_long, _ = await run(adapter, {"long": long_ids})
    alone_short, _ = await run(adapter, {"short": short_ids})
    assert outputs == {"long": alone_long["long"], "short": alone_short["short"]}   # the order changes no token


async def test_a_long_prompt_at_risk_of_its_deadline_is_not_passed(adapter):
    long_ids, short_ids = text_ids(adapter, 160, 11), text_ids(adapter, 6, 5)
    _, seen = await run(adapter, {"long": long_ids, "short": short_ids}, deadlines={"long": time.monotonic() + 0.01})
    assert seen["long"]["short"] is DecodeStatus.PREFILLING


# -- a refill step waits for the prompts on their way --------------------------------------------------
async def _first_token_steps(adapter: VLMAdapter, on_the_way: list[int], decode_ms: float,
                             second_after_s: float) -> tuple[dict[str, int], DecodeScheduler]:
    """Prompt ``a`` now and ``b`` ``second_after_s`` later (``on_the_way[0]`` counts ``b`` until it is
    inserted), with a decode step priced at ``decode_ms``; the step each one's first token came from."""
    pool = KVBlockPool(adapter.kv_layout, 96, 16)
    scheduler = DecodeScheduler(adapter, pool, prefill_token_budget=16, prompts_on_the_way=lambda: on_the_way[0])
    scheduler.start()
    try:
        ids = {"a": text_ids(adapter, 6, 5), "b": text_ids(adapter, 6, 9)}
        seqs = {n: _sequence(pool, n, len(i)) for n, i in ids.items()}
        scheduler.step_budget.decode_ms = decode_ms   # as if the worker had timed its decode steps
        steps: dict[str, int] = {}

        async def first(name: str) -> None:
            await asyncio.wait_for(seqs[name].events.get(), 30)
            steps[name] = scheduler.steps

        waiters = [asyncio.create_task(first(n)) for n in ids]
        scheduler.insert_colocated(seqs["a"], adapter.prepare(ids["a"], []))
        await asyncio.sleep(second_after_s)
        on_the_way[0] = 0
        scheduler.insert_colocated(seqs["b"], adapter.prepare(ids["b"], []))
        await asyncio.gather(*waiters)
        return steps, scheduler
    finally:
        await scheduler.stop()


async def test_a_refill_step_waits_for_a_colocated_prompt_on_its_way(adapter):
    """``b`` is reserved here (on its way) when ``a`` arrives to an idle batch: the step waits for it,
    and both start decoding from the same step."""
    steps, scheduler = await _first_token_steps(adapter, [1], decode_ms=10_000.0, second_after_s=0.3)
    assert steps["a"] == steps["b"] == 1, steps
    assert scheduler.refill_waits == 1


async def test_nothing_on_the_way_means_no_wait_and_the_wait_is_bounded(adapter):
    steps, scheduler = await _first_token_steps(adapter, [0], decode_ms=10_000.0, second_after_s=0.3)
    assert steps["a"] == 1 and steps["b"] > 1, steps        # nothing announced: ``a`` went at once
    assert scheduler.refill_waits == 0
    started = time.monotonic()
    steps, scheduler = await _first_token_steps(adapter, [1], decode_ms=20.0, second_after_s=1.0)
    assert steps["a"] == 1 and steps["b"] > 1, steps        # ``b`` came later than 3 decode steps: ``a`` went alone
    assert scheduler.refill_waits == 1 and time.monotonic() - started < 5.0


# -- what the worker reports for placement's queue price ----------------------------------------------
async def test_a_long_prompt_drains_at_the_reported_long_prompt_rate_not_the_refill_budget(adapter):
    """A refill step (nothing decoding) widens only the prompts it finishes: the worker reports twice a
    chunk for those (``step_prompt_tokens``) and one chunk for a prompt longer than a chunk
    (``step_long_prompt_tokens``), and one step drains each at that rate. Priced at the refill's rate,
    a queue of long colocated prompts looked to drain twice as fast as it does."""
    pool = KVBlockPool(adapter.kv_layout, 96, 16)
    scheduler = DecodeScheduler(adapter, pool, prefill_token_budget=16)
    ids = {"long": text_ids(adapter, 160, 11), "short": text_ids(adapter, 6, 5)}
    seqs = {n: _sequence(pool, n, len(i)) for n, i in ids.items()}
    for name in ("long", "short"):
        scheduler.insert_colocated(seqs[name], adapter.prepare(ids[name], []))
    assert (scheduler.step_prompt_tokens, scheduler.step_long_prompt_tokens) == (32, 16)
    await scheduler._step()   # one step, as the loop would take it
    assert seqs["short"].status is not DecodeStatus.PREFILLING and seqs["long"].prefilled == 16
    await scheduler.stop()


async def test_a_refill_beside_decodes_drains_a_long_prompt_to_its_end_at_the_long_rate(adapter):
    """A prompt longer than a chunk drains at ``step_long_prompt_tokens`` to its last token: a refill
    step does not widen its last chunk, which its decoding neighbours would take as one gap (on the
    bench model a 223-token last chunk beside decodes was a 1.0-1.3 s inter-token gap)."""
    pool = KVBlockPool(adapter.kv_layout, 96, 16)
    scheduler = DecodeScheduler(adapter, pool, prefill_token_budget=32)
    ids = {"chat": text_ids(adapter, 6, 5), "long": text_ids(adapter, 40, 11)}
    seqs = {n: _sequence(pool, n, len(i)) for n, i in ids.items()}
    scheduler.insert_colocated(seqs["chat"], adapter.prepare(ids["chat"], []))
    await scheduler._step()   # the chat's prompt: it decodes from now on
    assert seqs["chat"].status is DecodeStatus.RUNNING
    budget = scheduler.step_budget
    budget.decode_ms, budget.token_ms = 1.0, 10.0   # a prompt token priced dear beside decodes...
    budget.observe = lambda *_: None                # ...and kept so
    scheduler.insert_colocated(seqs["long"], adapter.prepare(ids["long"], []))
    # one prompt waiting, one sequence decoding: a refill step (64 tokens), 16 of them for a long prompt
    assert (scheduler.step_prompt_tokens, scheduler.step_long_prompt_tokens) == (64, 16)
    drained, beside = [], []
    while seqs["long"].status is DecodeStatus.PREFILLING:
        beside.append(seqs["chat"].status)
        await scheduler._step()
        drained.append(seqs["long"].prefilled)
    assert drained == [16, 32, 40]
    assert beside[:2] == [DecodeStatus.RUNNING] * 2   # the chat decoded beside the chunks (the last one: EOS or not)
    await scheduler.stop()
