"""A windowed KV pool keeps a sliding layer's last W positions only, and the split stays exact.

Gemma 3's demo checkpoint (5 layers, 3 sliding with W = 12; 16-token image runs) on pools
whose sliding layers live in rings (``kv_pool``: ``window_chunk``):

* the pool: layers grouped into pages, rings sized ``W + chunk - 1`` positions (or the whole
  sequence), positions wrapping around a ring, every page under the owner token's fence,
  and a memory budget holding more long sequences than the dense pool of the same bytes;
* the model: prefill on a windowed pool (chunks 1, 5, 16, 40, whole: 5 and 16 would cut an
  image run, so some chunks grow to a run), the chunks landed trimmed (``read_wire`` /
  ``write_wire``: the sliding layers' KV from ``window_from`` on) into a decode pool whose
  rings hold W positions, then decode steps while the rings wrap: greedy output equals
  ``generate()`` for every prompt, and with the reference loop and flex attention too;
* colocated: the same prompts prefilled straight into the decode pool's rings;
* several sequences decoding in one forward with rings at different wrap points.
"""

from __future__ import annotations

import pytest
import torch
from qwen_vl_cases import GREEDY, NEW_TOKENS, prompts_for

from runtime.demo_model.gemma3 import IMAGE_TOKENS, WINDOW, build_gemma3
from runtime.model import attention_kernels, attention_reference
from runtime.model.kv_pool import KVBlockPool, KVLayout, PageGroups, StaleBlocksError
from runtime.model.model_adapter import DecodeInput, FirstToken, KVChunk, VLMAdapter

CHUNK_SIZES = (1, 5, 16, 40, None)
BLOCK = 8
KERNELS = ["sdpa_padded", attention_reference.KERNEL, *(["flex_attention"] if attention_kernels.flex_available() else [])]
LAYOUT = KVLayout(5, 1, 4, torch.float32, sliding_layers=(0, 1, 3), sliding_window=12)

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


# -- the pool ------------------------------------------------------------------
def test_layers_are_grouped_into_pages_and_dense_stays_one_group():
    groups = PageGroups.for_layout(LAYOUT, windowed=True)
    assert (groups.page_layers, groups.window_groups) == (2, 2)
    assert groups.layers_in(0) == [2, 4] and groups.layers_in(1) == [0, 1] and groups.layers_in(2) == [3]
    assert PageGroups.for_layout(LAYOUT, windowed=False) == PageGroups.dense(5)
    assert PageGroups.for_layout(KVLayout(3, 1, 4, torch.float32), windowed=True) == PageGroups.dense(3)


def test_ring_size_follows_window_and_chunk():
    pool = KVBlockPool(LAYOUT, 64, block_size=4, window_chunk=1)
    assert pool.ring_blocks(100) == 3                      # 12 positions
    assert pool.ring_blocks(100, chunk=9) == 5             # 12 + 9 - 1 = 20 positions
    assert pool.ring_blocks(6) == 2                        # never more than the sequence has
    assert pool.pages_for(100) == 25 + 2 * 3
    dense = KVBlockPool(LAYOUT, 64, block_size=4)
    assert dense.ring_blocks(100) == 0 and dense.pages_for(100) == 25


def test_a_budget_holds_more_long_sequences_windowed():
    budget = 1 << 20
    dense = KVBlockPool.from_memory_budget(LAYOUT, budget, block_size=4)
    windowed = KVBlockPool.from_memory_budget(LAYOUT, budget, block_size=4, window_chunk=1)
    assert dense.page_bytes * dense.num_blocks <= budget and windowed.page_bytes * windowed.num_blocks <= budget
    long = 400
    assert windowed.num_blocks // windowed.pages_for(long) > 2 * (dense.num_blocks // dense.pages_for(long))


def test_positions_wrap_around_a_ring_and_the_window_survives():
    pool = KVBlockPool(LAYOUT, 64, block_size=4, window_chunk=1)
    blocks, rings = pool.allocate_sequence(40)
    owner = pool.owner_of(blocks[0])
    assert [len(r) for r in rings] == [3, 3] and pool.owns(pool.owned_pages(blocks, rings), owner)
    kv = torch.randn(5, 2, 40, 1, 4)
    for start in range(0, 40, 7):     # landed in order, as a decode worker's steps write
        pool.write(blocks, start, kv[:, :, start: start + 7], owner=owner, rings=rings)
    out = pool.read(blocks, 28, 40, rings)          # the last W positions: every layer has them
    torch.testing.assert_close(out, kv[:, :, 28:40])
    old = pool.read(blocks, 0, 12, rings)           # older ones: full layers only
    torch.testing.assert_close(old[[2, 4]], kv[[2, 4], :, 0:12])
    assert not torch.equal(old[[0, 1, 3]], kv[[0, 1, 3], :, 0:12])
    first = LAYOUT.window_from(40)
    layer_from = LAYOUT.layer_from(24, 40, first)
    wire = pool.read_wire(blocks, 24, 40, layer_from, rings)
    views = pool.host_views(blocks, 24, 40, owner=owner, layer_from=layer_from, rings=rings)
    assert b"".join(bytes(v) for v in views) == bytes(wire.numpy())
    assert len(wire) == LAYOUT.wire_bytes(24, 40, first)


def test_ring_pages_are_fenced_and_freed_with_the_sequence():
    pool = KVBlockPool(LAYOUT, 64, block_size=4, window_chunk=1)
    blocks, rings = pool.allocate_sequence(40)
    owner = pool.owner_of(blocks[0])
    pages = pool.owned_pages(blocks, rings)
    assert pool.free_blocks == 64 - len(pages)
    pool.free(rings[1], owner=owner)                   # a ring page changed hands: every write refuses
    with pytest.raises(StaleBlocksError):
        pool.write(blocks, 0, torch.zeros(5, 2, 4, 1, 4), owner=owner, rings=rings)
    with pytest.raises(StaleBlocksError):
        pool.host_views(blocks, 0, 4, owner=owner, rings=rings)
    pool.free(blocks + rings[0], owner=owner)
    assert pool.free_blocks == 64
    with pytest.raises(ValueError, match="rings"):
        pool.read(blocks, 0, 4)                         # a windowed pool never addresses without rings


def test_a_windowed_pool_caches_no_prefixes():
    with pytest.raises(ValueError, match="cache prefixes"):
        KVBlockPool(LAYOUT, 16, window_chunk=1, prefix_cache=True)


# -- the model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> VLMAdapter:
    return VLMAdapter.load(build_gemma3("gemma3", tmp_path_factory.mktemp("ckpt") / "gemma3"))


@pytest.fixture(scope="module")
def prompts(adapter):
    return prompts_for(adapter)


def decode_pool(adapter: VLMAdapter, chunk: int = 1) -> KVBlockPool:
    return KVBlockPool(adapter.kv_layout, num_blocks=96, block_size=BLOCK, window_chunk=chunk)


def land_trimmed(adapter: VLMAdapter, prompt, chunk_size: int, pool: KVBlockPool, blocks, rings) -> FirstToken:
    """Prefill on a windowed prefill pool; each chunk goes on as the wire does (sliding layers from window_from)."""
    prefill_pool = KVBlockPool(adapter.kv_layout, num_blocks=96, block_size=BLOCK, window_chunk=chunk_size)
    n = len(prompt.ids)
    sliding_from = adapter.kv_layout.window_from(n)
    staging = KVBlockPool(adapter.kv_layout, num_blocks=-(-n // BLOCK), block_size=BLOCK)   # dense: trims any chunk
    dense = staging.allocate(n)
    owner = pool.owner_of(blocks[0])
    events = list(adapter.prefill(prompt.ids, prompt.embeddings, chunk_size, GREEDY, pool=prefill_pool))
    for c in events[:-1]:
        assert isinstance(c, KVChunk)
        staging.write(dense, c.start, c.kv, owner=staging.owner_of(dense[0]))
        layer_from = adapter.kv_layout.layer_from(c.start, c.end, sliding_from)
        wire = staging.read_wire(dense, c.start, c.end, layer_from)
        pool.write_wire(blocks, c.start, c.end, wire, layer_from, owner=owner, rings=rings)
    assert prefill_pool.free_blocks == prefill_pool.num_blocks
    return events[-1]


def decode(adapter, pool, blocks, rings, first: FirstToken, n: int) -> list[int]:
    tokens, position = [first.token_id], n
    while len(tokens) < NEW_TOKENS:
        (token,) = adapter.decode_step(pool, [DecodeInput(tokens[-1], position, blocks, GREEDY, rings=rings)])
        tokens.append(token)
        position += 1
    return tokens


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES, ids=lambda c: f"chunk-{c or 'whole'}")
def test_disaggregated_through_windowed_pools_is_token_identical(adapter, prompts, chunk_size, kernel):
    if kernel == "flex_attention" and chunk_size in (1, 5):
        pytest.skip("uncompiled flex_attention on a CPU: the longer chunks cover its masks in seconds")
    adapter.attention_kernel = kernel
    pool = decode_pool(adapter)
    got = {}
    try:
        for name, p in prompts.items():
            n = len(p.ids)
            blocks, rings = pool.allocate_sequence(n + NEW_TOKENS)
            assert all(len(r) * BLOCK < n for r in rings), "the rings must wrap for this test to mean anything"
            first = land_trimmed(adapter, p, chunk_size or n, pool, blocks, rings)
            got[name] = decode(adapter, pool, blocks, rings, first, n)
            pool.free(pool.owned_pages(blocks, rings))
    finally:
        adapter.attention_kernel = "sdpa_padded"
    assert got == {name: p.reference for name, p in prompts.items()}
    assert pool.free_blocks == pool.num_blocks


@pytest.mark.parametrize("chunk_size", (1, 5, 16, 40), ids=lambda c: f"chunk-{c}")
def test_colocated_prefill_into_rings_is_token_identical(adapter, prompts, chunk_size):
    pool = decode_pool(adapter, chunk=max(chunk_size, IMAGE_TOKENS))
    got = {}
    for name, p in prompts.items():
        n = len(p.ids)
        blocks, rings = pool.allocate_sequence(n + NEW_TOKENS)
        prepared = adapter.prepare(p.ids, p.embeddings)
        start = 0
        while start < n:
            end = prepared.chunk_end(start, chunk_size)
            (logits,) = adapter.forward_packed(pool, [prepared.item(start, end, blocks, rings=rings)])
            start = end
        first = FirstToken(int(logits.argmax()), 0, None)
        got[name] = decode(adapter, pool, blocks, rings, first, n)
        pool.free(pool.owned_pages(blocks, rings))
    assert got == {name: p.reference for name, p in prompts.items()}


def test_a_batch_of_wrapping_rings_equals_the_loop(adapter, prompts):
    """Every prompt decoding in one forward, rings wrapped at different points: batched kernel == loop."""
    pool = decode_pool(adapter)
    seqs = []
    for p in prompts.values():
        n = len(p.ids)
        blocks, rings = pool.allocate_sequence(n + NEW_TOKENS)
        first = land_trimmed(adapter, p, 7, pool, blocks, rings)
        seqs.append((blocks, rings, first, n))
    assert len({n % (len(seqs[0][1][0]) * BLOCK) for *_, n in seqs}) > 1
    batch = [DecodeInput(f.token_id, n, b, GREEDY, rings=r) for b, r, f, n in seqs]
    results = {}
    for kernel in ("sdpa_padded", attention_reference.KERNEL):
        adapter.attention_kernel = kernel
        try:
            results[kernel] = adapter.decode_step(pool, batch)
        finally:
            adapter.attention_kernel = "sdpa_padded"
    assert results["sdpa_padded"] == results[attention_reference.KERNEL]
    assert results["sdpa_padded"] == [p.reference[1] for p in prompts.values()]


def test_a_chunk_longer_than_the_rings_allow_is_refused_not_corrupted(adapter, prompts):
    p = prompts["three-images"]
    pool = decode_pool(adapter, chunk=1)          # rings for decode steps only
    blocks, rings = pool.allocate_sequence(len(p.ids))
    prepared = adapter.prepare(p.ids, p.embeddings)
    with pytest.raises(ValueError, match="window_chunk"):
        adapter.forward_packed(pool, [prepared.item(0, len(p.ids), blocks, rings=rings)])
