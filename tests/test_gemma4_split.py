"""Gemma 4 through the split: token-identical to ``generate()`` (issue 18).

The tiny random checkpoint (``epd demo-model --family gemma4``: 8 layers, sliding (2 KV heads
of 16, window 12) and full (1 KV head of 32) interleaved, the last 3 reusing earlier layers'
K/V, per-layer input embeddings, images of up to 70 soft tokens attending both ways on
sliding layers only) on pools that hold layers of two sizes and keep only the store layers
(``decoder_kv``): prefill in chunks (1, 5, 40, whole: boundaries move to image-run edges),
each chunk landed in the per-layer wire form into a decode pool, dense or keeping the sliding
layers in rings of W positions (trimmed to the window), then decode steps: greedy output equals
``generate()`` for 1 and 3 images, multi-turn, system prompt and text only, with the batched
kernel and the reference loop. Without the per-layer inputs, the KV sharing or the causal
full layers the output differs (checked by turning each off).
"""

from __future__ import annotations

import pytest
import torch
from qwen_vl_cases import GREEDY, NEW_TOKENS, prompts_for

from runtime.demo_model import cli
from runtime.model import attention_reference
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import DecodeInput, FirstToken, KVChunk, VLMAdapter

BLOCK = 8
pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> VLMAdapter:
    out = tmp_path_factory.mktemp("ckpt") / "gemma4"
    assert cli.main(["--family", "gemma4", "--out", str(out)]) == 0
    return VLMAdapter.load(out)


@pytest.fixture(scope="module")
def prompts(adapter):
    return prompts_for(adapter)


def run(adapter: VLMAdapter, p, chunk: int, windowed: bool) -> list[int]:
    layout, n = adapter.kv_layout, len(p.ids)
    pool = KVBlockPool(layout, 256, BLOCK, window_chunk=1 if windowed else None)
    blocks, rings = pool.allocate_sequence(n + NEW_TOKENS)
    owner = pool.owner_of(blocks[0])
    sliding_from = layout.window_from(n) if windowed else 0
    events = list(adapter.prefill(p.ids, p.embeddings, chunk, GREEDY))
    staging = KVBlockPool(layout, -(-n // BLOCK), BLOCK)
    dense = staging.allocate(n)
    for c in events[:-1]:
        assert isinstance(c, KVChunk)
        staging.write_wire(dense, c.start, c.end, c.kv, [c.start] * layout.layers, owner=staging.owner_of(dense[0]))
        layer_from = layout.layer_from(c.start, c.end, sliding_from)
        wire = staging.read_wire(dense, c.start, c.end, layer_from)
        pool.write_wire(blocks, c.start, c.end, wire, layer_from, owner=owner, rings=rings)
    first = events[-1]
    assert isinstance(first, FirstToken)
    tokens, position = [first.token_id], n
    while len(tokens) < NEW_TOKENS:
        (token,) = adapter.decode_step(pool, [DecodeInput(tokens[-1], position, blocks, GREEDY, rings=rings)])
        tokens.append(token)
        position += 1
    pool.free(pool.owned_pages(blocks, rings))
    assert pool.free_blocks == pool.num_blocks
    return tokens


def test_the_pool_holds_the_store_layers_in_two_sizes(adapter):
    layout = adapter.kv_layout
    text = adapter.model.config.get_text_config()
    assert layout.layers == text.num_hidden_layers - text.num_kv_shared_layers
    assert not layout.uniform and {layout.shape(l) for l in range(layout.layers)} == {(2, 16), (1, 32)}
    assert layout.sliding_layers and layout.sliding_window == text.sliding_window
    reused = [l for l in adapter._decoder.layers if l.self_attn.epd_kv_reused]
    assert len(reused) == text.num_kv_shared_layers


@pytest.mark.parametrize("kernel", ["sdpa_padded", attention_reference.KERNEL])
@pytest.mark.parametrize("windowed", [False, True], ids=["dense", "windowed"])
@pytest.mark.parametrize("chunk", [1, 5, 40, None], ids=lambda c: f"chunk-{c or 'whole'}")
def test_split_is_token_identical_to_generate(adapter, prompts, chunk, windowed, kernel):
    if kernel == attention_reference.KERNEL and chunk in (1, 5):
        pytest.skip("the reference loop: the longer chunks cover it")
    adapter.attention_kernel = kernel
    try:
        got = {name: run(adapter, p, chunk or len(p.ids), windowed) for name, p in prompts.items()}
    finally:
        adapter.attention_kernel = "sdpa_padded"
    assert got == {name: p.reference for name, p in prompts.items()}


@pytest.mark.parametrize("what", ["per_layer_inputs", "kv_sharing", "causal_full_layers"])
def test_each_gemma4_rule_matters(adapter, prompts, what, monkeypatch):
    if what == "per_layer_inputs":   # every token looks up the pad id: the per-layer inputs carry no token
        looked_up = adapter._decoder.get_per_layer_inputs
        monkeypatch.setattr(adapter._decoder, "get_per_layer_inputs",
                            lambda ids, embeds: looked_up(torch.full_like(ids, adapter.pad_token_id), embeds))
    elif what == "kv_sharing":   # a reusing layer reads another store layer of its size, not its producer
        layout = adapter.kv_layout
        for layer in adapter._decoder.layers:
            attn = layer.self_attn
            if attn.epd_kv_reused:
                other = next(l for l in range(layout.layers)
                             if l != attn.epd_kv_layer and layout.shape(l) == layout.shape(attn.epd_kv_layer))
                monkeypatch.setattr(attn, "epd_kv_layer", other)
    else:
        for layer in adapter._decoder.layers:
            monkeypatch.setattr(layer.self_attn, "epd_causal_images", False)
    got = {name: run(adapter, p, 40, False) for name, p in prompts.items()}
    assert got != {name: p.reference for name, p in prompts.items()}
