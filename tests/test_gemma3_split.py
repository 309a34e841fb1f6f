"""Gemma 3 through the split (issue 18): token-identical to ``generate()``.

The tiny random checkpoint (``epd demo-model --family gemma3``) has 16 image tokens an
image, decoder layers interleaving sliding-window (12 positions) and global attention,
and every prompt of ``qwen_vl_cases.CASES`` (one image, three images of different
sizes, multi-turn, system prompt, text only) is longer than the window. What the
split must get right, and each test shows it matters:

* bidirectional attention inside an image (the model's ``token_type_ids`` mask): each
  image token sees its whole run; built into the batched groups and the reference loop;
* the chunker never cuts an image's run: a boundary moves to the run's edge, and a
  chunk size smaller than a run gives a chunk holding the whole run;
* sliding-window layers: a key ``W`` or more positions back is invisible on those layers.

The reference is the same loaded model's ``generate()`` on the processor's output.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from qwen_vl_cases import CASES, image_runs, prompts_for, run_split

from runtime.demo_model.gemma3 import IMAGE_TOKENS, WINDOW, build_gemma3
from runtime.model import attention_kernels, attention_reference, supported_models
from runtime.model.families import load_processor
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import KVChunk, VLMAdapter
from runtime.model.packed_batch import PackedItem

CHUNK_SIZES = (1, 5, 16, 40, None)   # 5 and 16 would cut image runs; None: the whole prompt
KERNELS = ["sdpa_padded", attention_reference.KERNEL, *(["flex_attention"] if attention_kernels.flex_available() else [])]


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_gemma3("gemma3", tmp_path_factory.mktemp("ckpt") / "gemma3")


@pytest.fixture(scope="module")
def adapter(checkpoint) -> VLMAdapter:
    return VLMAdapter.load(checkpoint)


@pytest.fixture(scope="module")
def prompts(adapter):
    return prompts_for(adapter)


def test_the_checkpoint_is_served_as_gemma3(adapter, checkpoint):
    supported_models.check_checkpoint(checkpoint)
    assert adapter.family.name == "Gemma 3" and adapter.family.bidirectional_images
    assert isinstance(load_processor(checkpoint), transformers.Gemma3Processor)
    text = adapter.model.config.get_text_config()
    assert text.sliding_window == WINDOW and {"sliding_attention", "full_attention"} == set(text.layer_types)


def test_every_prompt_is_longer_than_the_window_and_images_are_runs(adapter, prompts):
    for case in CASES:
        p = prompts[case.name]
        assert len(p.ids) > 2 * WINDOW, case.name
        runs = image_runs(p.ids, adapter.image_token_id)
        assert [e - s for s, e in runs] == [IMAGE_TOKENS] * len(case.images), case.name
        assert all(e.shape[0] == IMAGE_TOKENS for e in p.embeddings)
    assert IMAGE_TOKENS > WINDOW, "an image run longer than the window: image tokens see past it only within the run"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES, ids=lambda c: f"chunk-{c or 'whole'}")
def test_split_is_token_identical_to_generate(adapter, prompts, chunk_size, kernel):
    if kernel == "flex_attention" and chunk_size in (1, 5):
        pytest.skip("uncompiled flex_attention on a CPU: the longer chunks cover its masks in seconds")
    adapter.attention_kernel = kernel
    try:
        pool = KVBlockPool(adapter.kv_layout, num_blocks=128, block_size=8)
        got = {name: run_split(adapter, pool, p, chunk_size) for name, p in prompts.items()}
    finally:
        adapter.attention_kernel = "sdpa_padded"
    assert got == {name: p.reference for name, p in prompts.items()}
    assert pool.free_blocks == pool.num_blocks


@pytest.mark.parametrize("chunk_size", [5, 16])
def test_the_chunker_moves_boundaries_to_image_span_edges(adapter, prompts, chunk_size):
    p = prompts["three-images"]
    runs = image_runs(p.ids, adapter.image_token_id)
    naive = range(chunk_size, len(p.ids), chunk_size)
    assert any(s < b < e for s, e in runs for b in naive), "the plain boundaries would cut an image run"
    chunks = [e for e in adapter.prefill(p.ids, p.embeddings, chunk_size) if isinstance(e, KVChunk)]
    assert not any(s < c.end < e for c in chunks for s, e in runs)
    assert [c for c in chunks if (c.start, c.end) in set(runs)] or chunk_size > IMAGE_TOKENS
    if chunk_size < IMAGE_TOKENS:   # a chunk smaller than a run: the run is one chunk of its own
        assert {(s, e) for s, e in runs} <= {(c.start, c.end) for c in chunks}
    prepared = adapter.prepare(p.ids, p.embeddings)
    s, e = runs[0]
    assert prepared.chunk_end(s - 2, 5) == s and prepared.chunk_end(s, 5) == e and prepared.chunk_end(s + 3, 5) == e
    with pytest.raises(ValueError, match="cuts a bidirectional image span"):
        prepared.item(0, s + 1, list(range(16)))


def test_chunked_prefill_kv_equals_transformers_cache(adapter, prompts):
    """Global layers: every position equals the model's own cache; sliding layers: the last window does
    (transformers' sliding cache keeps only that much)."""
    p = prompts["three-images"]
    with torch.inference_mode():
        cache = adapter.model(**p.inputs, use_cache=True).past_key_values
    chunked = torch.cat([e.kv for e in adapter.prefill(p.ids, p.embeddings, 7) if isinstance(e, KVChunk)], dim=2)
    for layer, kind in enumerate(adapter.model.config.get_text_config().layer_types):
        hf = torch.stack([cache.layers[layer].keys[0], cache.layers[layer].values[0]]).permute(0, 2, 1, 3)
        n = hf.shape[1]
        assert kind == "full_attention" and n == len(p.ids) or kind == "sliding_attention" and n < len(p.ids)
        torch.testing.assert_close(chunked[layer, :, -n:], hf, rtol=1e-4, atol=1e-5)


def test_batched_kernel_equals_the_loop_with_image_spans_and_windows(adapter, prompts):
    """Decodes beside two prompt chunks holding image runs, in one forward: the batched groups and the
    per-sequence loop give the same logits (sliding and global layers, bidirectional runs)."""
    seqs = [prompts[n] for n in ("one-image", "three-images", "multi-turn")]
    results = {}
    for kernel in ("sdpa_padded", attention_reference.KERNEL):
        adapter.attention_kernel = kernel
        pool = KVBlockPool(adapter.kv_layout, num_blocks=128, block_size=8)
        prepared = [adapter.prepare(p.ids, p.embeddings) for p in seqs]
        tables = [pool.allocate(len(p.ids) + 2) for p in seqs]
        n0 = len(seqs[0].ids)
        adapter.forward_packed(pool, [prepared[0].item(0, n0, tables[0])])
        cut = [prepared[i].chunk_end(0, 30) for i in (1, 2)]
        adapter.forward_packed(pool, [prepared[i].item(0, cut[i - 1], tables[i]) for i in (1, 2)])
        token = adapter.embed_tokens([seqs[0].reference[0]])
        items = [PackedItem(token, n0, tables[0])]
        items += [prepared[i].item(cut[i - 1], len(seqs[i].ids), tables[i]) for i in (1, 2)]
        results[kernel] = adapter.forward_packed(pool, items)
    adapter.attention_kernel = "sdpa_padded"
    for a, b in zip(results["sdpa_padded"], results[attention_reference.KERNEL]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
