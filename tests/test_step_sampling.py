"""A decode step samples every running sequence by its own parameters, whatever else is in the batch.

The scheduler takes the plain greedy sequences' tokens in one argmax call for the whole batch
(``DecodeScheduler._sample_decodes``) and samples the rest one by one. Here a real scheduler (demo
model, real KV pool) runs sequences with different parameters in one batch and each output must
equal the same sequence run alone (logprobs to float rounding: a batch sums its matmuls in another
order); the greedy ones must equal ``model.generate()``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from cluster import DEMO_MODEL
from demo_jobs import greedy_reference

from decode_svc.reservations import ReservationTable
from decode_svc.scheduler import DecodeScheduler, Sequence
from runtime.demo_model.shapes import QUESTIONS
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter
from runtime.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 12
PLAIN = SamplingParams()
MIXED = [PLAIN, PLAIN, SamplingParams(repetition_penalty=2.0, ignore_eos=True), SamplingParams(temperature=2.0, seed=7),
         SamplingParams(logprobs=2), PLAIN]


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    torch.set_grad_enabled(False)
    return VLMAdapter.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def prompts(adapter) -> list[tuple[list[int], torch.Tensor, list[int]]]:
    """(prompt ids, image embedding, greedy ``generate()`` output without EOS) for three images."""
    out = []
    for seed in range(3):
        ids, image, expected = greedy_reference(adapter, seed, QUESTIONS[seed % len(QUESTIONS)], MAX_TOKENS)
        out.append((ids, adapter.encode([image])[0], expected))
    return out


async def _run(adapter, prompts, params: list[SamplingParams]) -> list[tuple[list[int], list]]:
    """Every (prompt i % 3, params[i]) in one scheduler, inserted together: each output and its logprobs."""
    pool = KVBlockPool(adapter.kv_layout, 64, 16)
    table = ReservationTable(pool)
    scheduler = DecodeScheduler(adapter, pool, on_retire=lambda s: table.release(s.reservation_id, "done"))
    scheduler.start()
    seqs = []
    try:
        for i, p in enumerate(params):
            ids, embedding, _ = prompts[i % len(prompts)]
            res = table.reserve(f"r{i}", len(ids), MAX_TOKENS, time.monotonic() + 60, "digest", "fp")
            seq = Sequence(f"r{i}", res.lease, res.blocks, res.prompt_tokens, MAX_TOKENS, p, prompt_ids=ids)
            scheduler.insert_colocated(seq, adapter.prepare(ids, [embedding]))
            seqs.append(seq)
        out = []
        for seq in seqs:
            tokens, logprobs = [], []
            while True:
                ev = await asyncio.wait_for(seq.events.get(), 30)
                tokens += ev.token_ids
                logprobs += [(s.token_id, s.logprob, s.top) for s in ev.logprobs]
                if ev.finish_reason:
                    break
            out.append((tokens, logprobs))
        assert scheduler.max_observed_batch == len(params)   # they did share steps
        return out
    finally:
        await scheduler.stop()
        assert not table.active and pool.free_blocks == 64


async def test_each_sequence_samples_as_it_would_alone(adapter, prompts):
    together = await _run(adapter, prompts, MIXED)
    for i, p in enumerate(MIXED):
        (alone,) = await _run(adapter, [prompts[i % len(prompts)]], [p])
        assert together[i][0] == alone[0], f"sequence {i} ({p}) changed in a mixed batch"
        # logprobs: the same tokens; values to float rounding (a batch's matmuls sum in another order)
        assert [(t, [x.token_id for x in top]) for t, _, top in together[i][1]] == \
               [(t, [x.token_id for x in top]) for t, _, top in alone[1]]
        assert [v for _, v, _ in together[i][1]] == pytest.approx([v for _, v, _ in alone[1]], abs=1e-5)
        if p is PLAIN:
            assert together[i][0] == prompts[i % len(prompts)][2]   # generate()'s greedy answer
    assert together[2][0] != together[5][0] and together[3][0] != together[0][0]   # the parameters mattered
