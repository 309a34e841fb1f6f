"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL through the split (issue 17): token-identical to ``generate()``.

Each family's tiny random checkpoint (``epd demo-model --family``) is built once
per module and loaded with ``VLMAdapter.load`` (the torchvision-free processor
loader, ``AutoModelForImageTextToText``). The split runs as the workers run it:
``encode`` the images to the encoder cache's tensors, chunked prefill through a
paged KV pool (chunks of 1 token up to the whole prompt, chunk boundaries inside
image spans), each chunk landed in the decode side's blocks, then greedy decode
steps through ``forward_packed`` with the sequence's rope delta. The reference is
the same loaded model's ``generate()``.

On the code before issue 17 every test here fails at load: the Qwen-VL
architectures were refused ("M-RoPE (3-D position ids)") and AutoProcessor
needed torchvision.
"""

from __future__ import annotations

import pytest
import torch

from qwen_vl_cases import FAMILIES, GREEDY, NEW_TOKENS, build_checkpoint, image_runs, land_prefill, prompts_for, run_split
from runtime.model.families.base import PositionKind
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import DecodeInput, KVChunk, PackedItem, VLMAdapter

CHUNK_SIZES = (1, 3, 7, 16, None)   # None: the whole prompt as one chunk


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def adapter(family, tmp_path_factory) -> VLMAdapter:
    return VLMAdapter.load(build_checkpoint(family, tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def prompts(adapter):
    return prompts_for(adapter)


def test_the_checkpoint_is_the_family_with_m_rope(adapter, family, prompts):
    assert adapter.family.position_kind == PositionKind.MROPE
    assert type(adapter.model).__name__ == {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                            "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                            "qwen3_vl": "Qwen3VLForConditionalGeneration"}[family]
    assert adapter.family.deepstack_levels == (2 if family == "qwen3_vl" else 0)
    grids = {tuple(g) for p in prompts.values() if "image_grid_thw" in p.inputs for g in p.inputs["image_grid_thw"].tolist()}
    assert len(grids) >= 5, f"images of different sizes should give different grids: {grids}"
    deltas = {adapter.prepare(p.ids, p.embeddings).rope_delta for p in prompts.values()}
    assert 0 in deltas and len(deltas) >= 3, f"cases should exercise different rope deltas: {deltas}"


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES, ids=lambda c: f"chunk-{c or 'whole'}")
def test_split_is_token_identical_to_generate(adapter, prompts, chunk_size):
    pool = KVBlockPool(adapter.kv_layout, num_blocks=48, block_size=8)   # shared by every case
    got = {name: run_split(adapter, pool, p, chunk_size) for name, p in prompts.items()}
    assert got == {name: p.reference for name, p in prompts.items()}
    assert pool.free_blocks == pool.num_blocks
    if chunk_size in (3, 7, 16):   # the boundaries really cut image spans
        runs = image_runs(prompts["three-images"].ids, adapter.image_token_id)
        assert any(s < b < e for s, e in runs for b in range(chunk_size, len(prompts["three-images"].ids), chunk_size))


def test_chunked_prefill_kv_equals_one_pass_and_transformers_cache(adapter, prompts):
    p = prompts["three-images"]
    with torch.inference_mode():
        cache = adapter.model(**p.inputs, use_cache=True).past_key_values
    hf = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]).permute(0, 1, 3, 2, 4)
    whole = torch.cat([e.kv for e in adapter.prefill(p.ids, p.embeddings, len(p.ids)) if isinstance(e, KVChunk)], dim=2)
    torch.testing.assert_close(whole, hf, rtol=1e-4, atol=1e-5)
    for chunk_size in (1, 5):
        chunked = torch.cat([e.kv for e in adapter.prefill(p.ids, p.embeddings, chunk_size) if isinstance(e, KVChunk)], dim=2)
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-5)


def test_packed_steps_mix_sequences_of_different_lengths(adapter, prompts):
    """Several sequences (different lengths, grids, deltas) in one packed decode step, with another
    prompt's chunks riding the same forwards (as the colocated scheduler packs them)."""
    pool = KVBlockPool(adapter.kv_layout, num_blocks=96, block_size=8)
    names = list(prompts)
    late = names.pop(1)                       # prefilled chunk by chunk inside the decode steps
    state = {}
    for i, name in enumerate(names):
        p = prompts[name]
        blocks = pool.allocate(len(p.ids) + NEW_TOKENS)
        first = land_prefill(adapter, pool, blocks, p, (2, 9, 64, len(p.ids))[i % 4])
        state[name] = {"tokens": [first.token_id], "pos": len(p.ids), "blocks": blocks, "delta": first.rope_delta}
    lp = prompts[late]
    late_prompt = adapter.prepare(lp.ids, lp.embeddings)
    late_blocks = pool.allocate(len(lp.ids) + NEW_TOKENS)
    late_tokens, start, chunk = [], 0, -(-len(lp.ids) // (NEW_TOKENS - 2))   # done within the steps
    for _ in range(NEW_TOKENS - 1):
        order = list(state)
        embeds = adapter.embed_tokens([state[n]["tokens"][-1] for n in order])
        items = [PackedItem(embeds[i: i + 1], state[n]["pos"], state[n]["blocks"], rope_delta=state[n]["delta"])
                 for i, n in enumerate(order)]
        end = min(len(lp.ids), start + chunk)
        if start < end:
            items.append(late_prompt.item(start, end, late_blocks))
        logits = adapter.forward_packed(pool, items)
        for i, n in enumerate(order):
            state[n]["tokens"].append(int(torch.argmax(logits[i])))
            state[n]["pos"] += 1
        if start < end and end == len(lp.ids):
            late_tokens.append(int(torch.argmax(logits[-1])))
        start = end
    assert {n: s["tokens"] for n, s in state.items()} == {n: prompts[n].reference for n in state}
    assert late_tokens and late_tokens[0] == lp.reference[0], "the chunked prompt's first token"
    position = len(lp.ids)
    while len(late_tokens) < NEW_TOKENS:
        (token,) = adapter.decode_step(pool, [DecodeInput(late_tokens[-1], position, late_blocks, GREEDY,
                                                          late_prompt.rope_delta)])
        late_tokens.append(token)
        position += 1
    assert late_tokens == lp.reference


def test_a_wrong_or_missing_rope_delta_is_not_silent(adapter, prompts):
    """The handoff's rope delta decides the output: the known bug (a lost grid, delta 0) gives other tokens."""
    pool = KVBlockPool(adapter.kv_layout, num_blocks=48, block_size=8)
    for name in ("one-image", "three-images", "multi-turn"):
        p = prompts[name]
        true_delta = adapter.prepare(p.ids, p.embeddings).rope_delta
        assert true_delta < 0
        assert run_split(adapter, pool, p, 7) == p.reference
        assert run_split(adapter, pool, p, 7, rope_delta=0) != p.reference, f"{name}: delta 0 went unnoticed"
        assert run_split(adapter, pool, p, 7, rope_delta=true_delta + 1) != p.reference, name
    p = prompts["one-image"]
    blocks = pool.allocate(len(p.ids) + 1)
    first = land_prefill(adapter, pool, blocks, p, len(p.ids))
    with pytest.raises(ValueError, match="rope_delta"):   # no delta at all: refused, never taken as 0
        adapter.decode_step(pool, [DecodeInput(first.token_id, len(p.ids), blocks, GREEDY)])
    with pytest.raises(TypeError, match="prepare"):       # embeddings without positions cannot be used
        adapter.embed(p.ids, p.embeddings)
    pool.free(blocks)


def test_positions_are_the_models_own_and_the_same_without_weights(adapter, prompts):
    """The family's plan is ``get_rope_index`` of the loaded model, and a config-only family
    (what the gateway builds) computes exactly the same positions and delta from the processor's grids."""
    config_only = type(adapter.family)(adapter.model.config)
    for name, p in prompts.items():
        grids = [e.grid for e in adapter.embeddings(p.embeddings)]
        plan = adapter.family.position_plan(p.ids, grids)
        again = config_only.position_plan(p.ids, [tuple(g) for g in p.inputs.get("image_grid_thw", torch.empty(0, 3)).tolist()])
        assert torch.equal(plan.positions, again.positions) and plan.rope_delta == again.rope_delta
        if "image_grid_thw" in p.inputs:
            with torch.inference_mode():
                ref, delta = adapter.model.model.get_rope_index(
                    p.inputs["input_ids"], mm_token_type_ids=p.inputs["mm_token_type_ids"],
                    image_grid_thw=p.inputs["image_grid_thw"])
            assert torch.equal(plan.positions, ref[:, 0]) and plan.rope_delta == int(delta), name
        else:
            assert torch.equal(plan.positions, torch.arange(len(p.ids)).expand(3, -1)) and plan.rope_delta == 0


def test_deepstack_levels_are_applied_per_chunk(adapter, family, prompts):
    """Qwen3-VL: dropping the DeepStack levels changes the output (so the split really applies them);
    the other families have none."""
    p = prompts["three-images"]
    prepared = adapter.prepare(p.ids, p.embeddings)
    if family != "qwen3_vl":
        assert prepared.deepstack is None
        return
    assert prepared.deepstack.shape == (2, sum(e.tokens for e in adapter.embeddings(p.embeddings)), adapter.hidden_size)
    pool = KVBlockPool(adapter.kv_layout, num_blocks=48, block_size=8)
    blocks = pool.allocate(len(p.ids))
    logits = {}
    for drop in (False, True):
        for start in range(0, len(p.ids), 5):
            item = prepared.item(start, min(len(p.ids), start + 5), blocks)
            if drop:
                item.deepstack = None
            (row,) = adapter.forward_packed(pool, [item])
        logits[drop] = row
    assert int(torch.argmax(logits[False])) == p.reference[0]
    assert not torch.allclose(logits[False], logits[True], atol=1e-3)
    pool.free(blocks)
