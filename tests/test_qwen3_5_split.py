"""Qwen3.5 (Gated DeltaNet linear attention + full attention) through the split: token-identical to ``generate()``.

The tiny random checkpoint (``epd demo-model --family qwen3_5``) has layers
linear, full, linear, full. The KV pool holds the two full-attention layers; each
sequence's linear-attention state (recurrent + conv, per linear layer) lives in a
state slot, carried from chunk to chunk in prefill (chunks of 1 token up to the
whole prompt, boundaries inside image spans), handed over with the last chunk,
and updated in place by batched decode steps that also carry other prompts'
chunks. A slot that does not hold the state of the positions a forward starts
at is refused, never used.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLProcessor

from qwen3_5_cases import build_checkpoint, land_prefill, run_split
from qwen_vl_cases import GREEDY, NEW_TOKENS, image_runs, prompts_for
from runtime.model.families.base import PositionKind
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import DecodeInput, PackedItem, VLMAdapter
from runtime.model.state_slots import StateKind, StateMismatch

CHUNK_SIZES = (1, 3, 7, 16, None)   # None: the whole prompt as one chunk


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> VLMAdapter:
    return VLMAdapter.load(build_checkpoint(tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def prompts(adapter):
    return prompts_for(adapter)


def test_the_checkpoint_is_hybrid(adapter):
    assert type(adapter.model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert isinstance(adapter.processor, Qwen3VLProcessor)
    assert adapter.family.position_kind == PositionKind.MROPE
    assert adapter.kv_layout.layers == 2, "the KV pool holds the full-attention layers only"
    layout = adapter.state_layout
    assert layout.layers == (0, 2)
    assert layout.recurrent_shape == (4, 16, 16) and layout.conv_shape == (128, 4)
    assert layout.recurrent_dtype == torch.float32


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES, ids=lambda c: f"chunk-{c or 'whole'}")
def test_split_is_token_identical_to_generate(adapter, prompts, chunk_size):
    pool = KVBlockPool(adapter.kv_layout, num_blocks=48, block_size=8)
    states = adapter.new_state_slots(2)
    got = {name: run_split(adapter, pool, states, p, chunk_size) for name, p in prompts.items()}
    assert got == {name: p.reference for name, p in prompts.items()}
    assert pool.free_blocks == pool.num_blocks and states.free_slots == states.num_slots, "leaked blocks or slots"
    if chunk_size in (3, 7, 16):
        ids = prompts["three-images"].ids
        runs = image_runs(ids, adapter.image_token_id)
        assert any(s < b < e for s, e in runs for b in range(chunk_size, len(ids), chunk_size))


def test_state_parts_are_typed_per_layer(adapter, prompts):
    p = prompts["one-image"]
    chunks = [e for e in adapter.prefill(p.ids, p.embeddings, 5) if hasattr(e, "kv")]
    parts = chunks[-1].state
    assert [(s.layer, s.kind) for s in parts] == [(0, StateKind.RECURRENT), (0, StateKind.CONV),
                                                 (2, StateKind.RECURRENT), (2, StateKind.CONV)]
    assert all(s.tensor.abs().sum() > 0 for s in parts), "a real state, not zeros"
    assert chunks[-1].kv.shape[0] == 2, "wire KV holds the full-attention layers only"


def test_packed_steps_mix_decodes_and_prompt_chunks(adapter, prompts):
    """Several sequences' decodes in one batched step (states updated in place per slot), with another
    prompt's chunks riding the same forwards (as the colocated scheduler packs them)."""
    pool = KVBlockPool(adapter.kv_layout, num_blocks=96, block_size=8)
    states = adapter.new_state_slots(len(prompts))
    names = list(prompts)
    late = names.pop(1)
    seqs = {}
    for i, name in enumerate(names):
        p = prompts[name]
        blocks, slot = pool.allocate(len(p.ids) + NEW_TOKENS), states.allocate()
        first = land_prefill(adapter, pool, blocks, states, slot, p, (2, 9, 64, len(p.ids))[i % 4])
        seqs[name] = {"tokens": [first.token_id], "pos": len(p.ids), "blocks": blocks, "delta": first.rope_delta,
                      "slot": slot}
    lp = prompts[late]
    late_prompt = adapter.prepare(lp.ids, lp.embeddings)
    late_blocks, late_slot = pool.allocate(len(lp.ids) + NEW_TOKENS), states.allocate()
    late_tokens, start, chunk = [], 0, -(-len(lp.ids) // (NEW_TOKENS - 2))
    for _ in range(NEW_TOKENS - 1):
        order = list(seqs)
        embeds = adapter.embed_tokens([seqs[n]["tokens"][-1] for n in order])
        items = [PackedItem(embeds[i: i + 1], seqs[n]["pos"], seqs[n]["blocks"], rope_delta=seqs[n]["delta"],
                            state_slot=seqs[n]["slot"]) for i, n in enumerate(order)]
        end = min(len(lp.ids), start + chunk)
        if start < end:
            item = late_prompt.item(start, end, late_blocks)
            item.state_slot = late_slot
            items.append(item)
        logits = adapter.forward_packed(pool, items, states)
        for i, n in enumerate(order):
            seqs[n]["tokens"].append(int(torch.argmax(logits[i])))
            seqs[n]["pos"] += 1
        if start < end and end == len(lp.ids):
            late_tokens.append(int(torch.argmax(logits[-1])))
        start = end
    assert {n: s["tokens"] for n, s in seqs.items()} == {n: prompts[n].reference for n in seqs}
    position = len(lp.ids)
    while len(late_tokens) < NEW_TOKENS:
        (token,) = adapter.decode_step(pool, [DecodeInput(late_tokens[-1], position, late_blocks, GREEDY,
                                                          late_prompt.rope_delta, state_slot=late_slot)], states)
        late_tokens.append(token)
        position += 1
    assert late_tokens == lp.reference


def test_a_slot_at_another_position_or_no_slot_is_refused(adapter, prompts):
    p = prompts["one-image"]
    pool = KVBlockPool(adapter.kv_layout, num_blocks=16, block_size=8)
    states = adapter.new_state_slots(1)
    prompt = adapter.prepare(p.ids, p.embeddings)
    blocks, slot = pool.allocate(len(p.ids) + 1), states.allocate()
    item = prompt.item(4, 8, blocks)          # a chunk from position 4 into a slot that holds nothing yet
    item.state_slot = slot
    with pytest.raises(StateMismatch, match="after 0 tokens, not 4"):
        adapter.forward_packed(pool, [item], states)
    with pytest.raises(StateMismatch, match="no state slot"):
        adapter.forward_packed(pool, [prompt.item(0, 4, blocks)], states)
    with pytest.raises(StateMismatch, match="needs the state slots"):
        adapter.forward_packed(pool, [item])
    states.free(slot)
    pool.free(blocks)


def test_another_prompts_state_gives_other_tokens(adapter, prompts):
    """The state decides the output: decoding with the KV of one prompt and the state of another is not silent."""
    a, b = prompts["one-image"], prompts["system-prompt"]
    pool = KVBlockPool(adapter.kv_layout, num_blocks=48, block_size=8)
    states = adapter.new_state_slots(1)
    blocks, slot = pool.allocate(len(a.ids) + NEW_TOKENS), states.allocate()
    first = land_prefill(adapter, pool, blocks, states, slot, a, 7)
    other = [e for e in adapter.prefill(b.ids, b.embeddings, 7) if hasattr(e, "kv")][-1].state
    states.load(slot, other, len(a.ids))
    tokens, position = [first.token_id], len(a.ids)
    while len(tokens) < NEW_TOKENS:
        (t,) = adapter.decode_step(pool, [DecodeInput(tokens[-1], position, blocks, GREEDY, first.rope_delta,
                                                      state_slot=slot)], states)
        tokens.append(t)
        position += 1
    assert tokens != a.reference


def test_start_up_check_takes_hybrid_layers_only_where_the_family_is_hybrid(adapter):
    from runtime.model.supported_models import UnsupportedModel, check_config
    config = adapter.model.config
    check_config(config)
    text = config.get_text_config()
    saved = list(text.layer_types)
    try:
        text.layer_types = ["linear_attention"] * len(saved)      # no attention layer: nothing for the KV pool
        with pytest.raises(UnsupportedModel, match="attention layer types"):
            check_config(config)
        text.layer_types = ["sliding_attention", *saved[1:]]
        with pytest.raises(UnsupportedModel, match="attention layer types"):
            check_config(config)
    finally:
        text.layer_types = saved
