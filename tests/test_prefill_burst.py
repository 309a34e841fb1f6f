"""A burst of colocated prompts on an idle decode worker (``decode_svc/scheduler.py``, ``step_budget.py``).

With nothing decoding, no running sequence's gap grows, so the step takes every waiting prompt its
token budget and the tightest first-token deadline allow: one step for the whole burst, not one
prompt per step. A prompt close to its deadline keeps the plain budget. Either way each sequence's
tokens are those of ``model.generate()`` (the real demo model, a real pool and scheduler).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from cluster import DEMO_MODEL

from decode_svc.reservations import Lease
from decode_svc.scheduler import DecodeScheduler, Sequence
from runtime.demo_model.shapes import QUESTIONS, draw_shape
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import PreparedPrompt, VLMAdapter
from runtime.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 6
BURST = 5             # ~25-token demo prompts: 125 tokens, over the 32-token budget, under its idle 128
BUDGET = 32


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    torch.set_grad_enabled(False)
    return VLMAdapter.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def prompts(adapter) -> list[tuple[PreparedPrompt, int, list[int]]]:
    """(prepared prompt, its length, generate()'s tokens without EOS) for each of the burst."""
    processor, eos = adapter.processor, set(adapter.eos_token_ids)
    out = []
    for seed in range(BURST):
        sample = draw_shape(random.Random(seed))
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[seed % len(QUESTIONS)]}]}],
            add_generation_prompt=True)
        enc = processor(images=[sample.image], text=text, return_tensors="pt")
        new = adapter.model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)[0, enc["input_ids"].shape[1]:]
        expected = []
        for t in new.tolist():
            if t in eos:
                break
            expected.append(t)
        ids = enc["input_ids"][0].tolist()
        out.append((adapter.prepare(ids, [adapter.encode([sample.image])[0]]), len(ids), expected))
    assert sum(n for _, n, _ in out) > BUDGET
    return out


async def burst(adapter, prompts, slack_s: float) -> tuple[list[Sequence], list[list[int]]]:
    """Insert every prompt at once (first token due ``slack_s`` from now), run them to the end."""
    pool = KVBlockPool(adapter.kv_layout, 64, 16)
    sched = DecodeScheduler(adapter, pool, prefill_token_budget=BUDGET)
    sched.step_budget.observe(0, 100, 10.0)      # a prompt token's cost, as a prefill-only step measured it
    seqs = []
    for i, (prepared, n, _) in enumerate(prompts):
        owner = pool.new_token()
        blocks = pool.allocate(n + MAX_TOKENS, owner)
        seq = Sequence(f"r{i}", Lease(f"res-{i}", 1, owner), blocks, n, MAX_TOKENS, SamplingParams(),
                       first_token_by=time.monotonic() + slack_s)
        sched.insert_colocated(seq, prepared)
        seqs.append(seq)

    async def tokens(seq: Sequence) -> list[int]:
        out = []
        while True:
            ev = await asyncio.wait_for(seq.events.get(), 30)
            out += ev.token_ids
            if ev.end is not None:
                return out

    sched.start()
    try:
        outputs = await asyncio.gather(*(tokens(s) for s in seqs))
    finally:
        await sched.stop()
    assert pool.free_blocks == 64 - sum(len(s.blocks) for s in seqs)   # retired, freed by the owner (none here)
    return seqs, outputs


async def test_an_idle_worker_prefills_a_burst_in_one_step_as_generate_would(adapter, prompts):
    seqs, outputs = await burst(adapter, prompts, slack_s=30.0)
    assert outputs == [expected for _, _, expected in prompts]
    assert len({s.first_step_ms for s in seqs}) == 1, "every first token should come from the same step"


async def test_a_prompt_near_its_deadline_keeps_the_plain_budget(adapter, prompts):
    seqs, outputs = await burst(adapter, prompts, slack_s=0.002)   # 0.8 x 2 ms pays for 16 tokens: under 32
    assert outputs == [expected for _, _, expected in prompts]
    assert len({s.first_step_ms for s in seqs}) > 1
