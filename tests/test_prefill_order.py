"""The order colocated prompts get prefilled in on a decode worker (``decode_svc/prefill_order.py``).

A short chat prompt queued behind a long document on the same decode worker gets its first token
within a step or two instead of after every chunk of the document; a prompt whose first-token
deadline is at risk goes first whatever its length; and the order changes no token.
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
