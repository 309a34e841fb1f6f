"""The batched attention kernels against the per-sequence reference loop.

Kernel level: random pool contents, a packed row mixing decodes of different context
lengths, prompt chunks in the middle of their context and a whole-prompt chunk, over
non-contiguous block tables; every batched kernel's output equals the loop's. Model
level: the demo model (1-D RoPE) and a Qwen-VL checkpoint (3-D M-RoPE positions, applied
before attention) decode a batch of sequences token-identically with the loop and with
the batched kernel, with a prefill chunk in the same forward as the decodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.model import attention_kernels, attention_reference
from runtime.model.families.base import PositionKind
from runtime.model.kv_pool import KVBlockPool, KVLayout
from runtime.model.model_adapter import DecodeInput, VLMAdapter
from runtime.model.packed_batch import PackedItem, pack
from runtime.model.sampling import SamplingParams
from tests import qwen_vl_cases

DEMO_MODEL = Path(__file__).resolve().parents[1] / "models" / "demo-vlm"
BATCHED = [k for k in attention_kernels.KERNELS if k != "flex_attention" or attention_kernels.flex_available()]


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


MIXED = [(40, 1), (3, 1), (17, 1), (0, 1), (63, 1), (20, 9), (5, 30), (0, 12)]


def _mixed_row(pool: KVBlockPool, hidden: int, shapes=MIXED):
    """(items, row): by default 5 decodes of different lengths, 2 mid-context chunks, 1 whole-prompt chunk."""
    gen = torch.Generator().manual_seed(0)
    # (start, q_len): a decode has q_len 1; (0, n) is a whole prompt in one chunk
    scratch = pool.allocate(8 * pool.block_size)      # taken first, so later tables are not one run
    items = []
    for i, (start, q_len) in enumerate(shapes):
        blocks = pool.allocate(start + q_len)
        if i % 2:                                      # interleave: non-adjacent blocks in one table
            blocks = list(reversed(blocks))
        items.append(PackedItem(torch.randn(q_len, hidden, generator=gen), start, blocks))
    pool.free(scratch)
    return items, pack(pool, items, PositionKind.ONE_D, torch.device("cpu"))


@pytest.mark.parametrize("shapes", [MIXED, [(40, 1)], [(20, 9)], [(0, 12)], [(0, 1), (9, 1)]],
                         ids=["mixed", "lone-decode", "lone-chunk", "lone-prompt", "two-decodes"])
@pytest.mark.parametrize("kernel", BATCHED)
def test_batched_kernel_equals_the_loop(kernel, shapes):
    layout = KVLayout(layers=1, kv_heads=2, head_dim=16, dtype=torch.float32)
    pool = KVBlockPool(layout, num_blocks=64, block_size=4)
    items, row = _mixed_row(pool, hidden=8, shapes=shapes)
    if shapes is MIXED:
        assert len(row.groups) == 2 and row.groups[0].size == 5 and row.groups[1].size == 3
        assert any(len(s.context_runs) > 1 for s in row.spans), "some context must span several runs"
    gen = torch.Generator().manual_seed(1)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    total = sum(i.q_len for i in items)
    query = torch.randn(1, 4, total, 16, generator=gen)       # 4 heads over 2 KV heads (GQA)
    k_blocks, v_blocks = pool.kv[0, 0], pool.kv[0, 1]
    flat_k, flat_v = k_blocks.reshape(-1, 2, 16), v_blocks.reshape(-1, 2, 16)
    ref = attention_reference.attend_loop(query, flat_k, flat_v, row.spans, 0.25)
    out = attention_kernels.attend(kernel, query, k_blocks, v_blocks, row.groups, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_select_kernel_refuses_unknown_names():
    assert attention_kernels.select_kernel("cpu") == "sdpa_padded"
    with pytest.raises(ValueError, match="not one of"):
        attention_kernels.select_kernel("cpu", "reference_loop")


def _decode_batch(adapter: VLMAdapter, prompts: list[tuple[list[int], list]], steps: int, kernel: str,
                  rope: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt, then ``steps`` batched decode steps; the last prompt's second chunk
    runs in the same forward as the first decode step (both attention groups in one call)."""
    adapter.attention_kernel = kernel
    pool = KVBlockPool(adapter.kv_layout, num_blocks=256, block_size=8)
    seqs, logits_seen = [], []
    for ids, embeddings in prompts:
        prepared = adapter.prepare(ids, embeddings)
        blocks = pool.allocate(len(ids) + steps + 1)
        seqs.append({"prepared": prepared, "blocks": blocks, "n": len(ids)})
    for s in seqs[:-1]:
        (logit,) = adapter.forward_packed(pool, [s["prepared"].item(0, s["n"], s["blocks"])])
        s["tokens"] = [int(logit.argmax())]
        logits_seen.append(logit)
    last = seqs[-1]
    half = last["n"] // 2
    adapter.forward_packed(pool, [last["prepared"].item(0, half, last["blocks"])])
    # first decode step of the others beside the rest of the last prompt: decodes + a chunk in one forward
    embeds = adapter.embed_tokens([s["tokens"][-1] for s in seqs[:-1]])
    items = [PackedItem(embeds[i: i + 1], s["n"], s["blocks"],
                        rope_delta=s["prepared"].rope_delta if rope else None) for i, s in enumerate(seqs[:-1])]
    items.append(last["prepared"].item(half, last["n"], last["blocks"]))
    mixed = adapter.forward_packed(pool, items)
    logits_seen.extend(mixed)
    for s, logit in zip(seqs, mixed):
        s.setdefault("tokens", []).append(int(logit.argmax()))
    for step in range(steps):
        batch = [DecodeInput(s["tokens"][-1], s["n"] + len(s["tokens"]) - 1 - (s is last), s["blocks"], SamplingParams(),
                             s["prepared"].rope_delta if rope else None) for s in seqs]
        for s, token in zip(seqs, adapter.decode_step(pool, batch)):
            s["tokens"].append(token)
    adapter.attention_kernel = attention_kernels.select_kernel(adapter.device)
    return [s["tokens"] for s in seqs], logits_seen


@pytest.fixture(scope="module")
def demo() -> VLMAdapter:
    return VLMAdapter.load(DEMO_MODEL)


def test_demo_model_batched_decode_is_token_identical_to_the_loop(demo):
    from runtime.demo_model.shapes import QUESTIONS, draw_shape
    import random

    rng = random.Random(7)
    prompts = []
    for i in range(6):
        image = draw_shape(rng).image
        content = [{"type": "image"}, {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]
        text = demo.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        ids = demo.processor(images=[image], text=text, return_tensors="pt")["input_ids"][0].tolist()
        prompts.append((ids, demo.encode([image])))
    ref, ref_logits = _decode_batch(demo, prompts, 6, attention_reference.KERNEL, rope=False)
    for kernel in BATCHED:
        got, got_logits = _decode_batch(demo, prompts, 6, kernel, rope=False)
        assert got == ref, kernel
        for a, b in zip(got_logits, ref_logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> VLMAdapter:
    return VLMAdapter.load(qwen_vl_cases.build_checkpoint(qwen_vl_cases.FAMILIES[0], tmp_path_factory.mktemp("qwen")))


def test_qwen_vl_mrope_batched_decode_is_token_identical_to_the_loop(qwen):
    prompts = []
    for case in qwen_vl_cases.CASES:
        text = qwen.processor.apply_chat_template(case.messages, add_generation_prompt=True)
        ids = qwen.processor(images=case.images or None, text=text, return_tensors="pt")["input_ids"][0].tolist()
        prompts.append((ids, qwen.encode(case.images)))
    ref, ref_logits = _decode_batch(qwen, prompts, 5, attention_reference.KERNEL, rope=True)
    got, got_logits = _decode_batch(qwen, prompts, 5, "sdpa_padded", rope=True)
    assert got == ref
    assert len({tuple(t) for t in ref}) > 1, "degenerate model: every sequence gave the same tokens"
    for a, b in zip(got_logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5, 16], ids=lambda w: f"window-{w}")
@pytest.mark.parametrize("kernel", BATCHED)
def test_batched_kernel_equals_the_loop_with_image_spans_and_a_window(kernel, window):
    """Gemma 3's masks: prompt chunks holding bidirectional image runs (``key_limits``: an image token
    sees up to its run's end) and a sliding window, beside decodes; the batched kernel equals the loop."""
    layout = KVLayout(layers=1, kv_heads=2, head_dim=16, dtype=torch.float32)
    pool = KVBlockPool(layout, num_blocks=64, block_size=4)
    items, _ = _mixed_row(pool, hidden=8)
    for item in items:
        if item.q_len > 1:   # a run of image tokens in the middle of each chunk
            positions = torch.arange(item.start, item.start + item.q_len)
            lo, hi = item.start + item.q_len // 4, item.start + 3 * item.q_len // 4
            item.key_limits = torch.where((positions >= lo) & (positions < hi), hi - 1, positions)
    row = pack(pool, items, PositionKind.ONE_D, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    query = torch.randn(1, 4, sum(i.q_len for i in items), 16, generator=gen)
    k_blocks, v_blocks = pool.kv[0, 0], pool.kv[0, 1]
    ref = attention_reference.attend_loop(query, k_blocks.reshape(-1, 2, 16), v_blocks.reshape(-1, 2, 16), row.spans,
                                          0.25, window)
    out = attention_kernels.attend(kernel, query, k_blocks, v_blocks, row.groups, 0.25, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    plain = attention_reference.attend_loop(query, k_blocks.reshape(-1, 2, 16), v_blocks.reshape(-1, 2, 16),
                                            pack(pool, [PackedItem(i.embeds, i.start, i.blocks) for i in items],
                                                 PositionKind.ONE_D, torch.device("cpu")).spans, 0.25)
    assert not torch.allclose(ref, plain), "the spans and the window must change the result"
