"""The prefix cache in the KV pool and the reservation table: keys, references, LRU eviction.

Keys (``runtime/model/prefix_keys.py``) name everything the KV depends on; blocks are
reference-counted while reused, evicted least recently used and only when nobody references
them, and a reservation always wins over cached blocks. At rest every block is free or cached.
"""

from __future__ import annotations

import time

import pytest
import torch

from decode_svc.reservations import ReservationTable
from runtime.model.kv_pool import CACHED, KVBlockPool, KVLayout
from runtime.model.prefix_keys import ImageSpan, block_keys, cached_prefix_blocks, image_spans, summary_id

LAYOUT = KVLayout(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
BS = 4
IMG = 9   # placeholder id in these prompts


def keys(ids, images=(), salt="", fp="fp", positions=None):
    return block_keys(ids, list(images), block_size=BS, model_fingerprint=fp, cache_salt=salt, positions=positions)


def at_rest(pool: KVBlockPool) -> None:
    assert pool.free_blocks + pool.cached_blocks == pool.num_blocks
    assert pool.available_blocks == pool.num_blocks


# -- keys ----------------------------------------------------------------------------------
def test_keys_chain_everything_the_kv_depends_on():
    ids = [1, 2, IMG, IMG, IMG, IMG, 5, 6, 7, 8, 3]
    a = image_spans(ids, IMG, ["imgA"], [4])
    b = image_spans(ids, IMG, ["imgB"], [4])
    assert a == [ImageSpan("imgA", 2, 4)]
    base = keys(ids, a)
    assert len(base) == 2                                   # 11 tokens: two full blocks of 4
    assert keys(ids, a) == base                             # deterministic
    assert keys(ids, b)[0] != base[0] and keys(ids, b)[1] != base[1]   # same text, other image
    assert keys(ids, a, salt="tenant")[0] != base[0]        # another tenant
    assert keys(ids, a, fp="other")[0] != base[0]           # another model
    positions = torch.arange(len(ids)).repeat(3, 1)
    shifted = positions.clone()
    shifted[:, 6:] += 5
    assert keys(ids, a, positions=positions)[0] == keys(ids, a, positions=shifted)[0]   # block 0 untouched
    assert keys(ids, a, positions=positions)[1] != keys(ids, a, positions=shifted)[1]   # other M-RoPE positions
    # a block's key names its parent: the same second block after another first block differs
    other_first = [1, 7] + ids[2:]
    assert keys(other_first, image_spans(other_first, IMG, ["imgA"], [4]))[1] != base[1]
    # a longer prompt with the same start has the same leading keys
    longer = ids + [4, 4, 4, 4, 4]
    assert keys(longer, a)[:2] == base
    assert cached_prefix_blocks(keys(longer, a), {summary_id(k) for k in base}) == 2


def test_image_spans_refuse_counts_that_do_not_add_up():
    with pytest.raises(ValueError):
        image_spans([IMG, IMG, 1], IMG, ["a"], [3])
    with pytest.raises(ValueError):
        image_spans([IMG, IMG, 1], IMG, ["a", "b"], [2])


# -- pool ----------------------------------------------------------------------------------
def retire_into_cache(pool: KVBlockPool, ks: list[bytes], extra_blocks: int = 1) -> list[int]:
    owner = pool.new_token()
    blocks = pool.allocate_blocks(len(ks) + extra_blocks, owner)
    pool.cache(blocks[: len(ks)], ks, owner)
    pool.free(blocks[len(ks):], owner=owner)
    return blocks[: len(ks)]


def test_cached_blocks_are_shared_by_reference_and_evicted_only_unreferenced():
    pool = KVBlockPool(LAYOUT, num_blocks=6, block_size=BS, prefix_cache=True)
    ks = keys(list(range(1, 13)))                            # three full blocks
    cached = retire_into_cache(pool, ks)
    at_rest(pool)
    assert pool.cached_blocks == 3 and pool.free_blocks == 3
    assert all(pool.owner_of(b) == CACHED for b in cached)
    held = pool.acquire(ks[:2])                              # a running sequence reads two of them
    assert held == cached[:2] and pool.available_blocks == 4
    with pytest.raises(RuntimeError):
        pool.free(held)                                      # cached blocks are unreferenced, never freed
    assert pool.allocate_blocks(5) is None                   # only the FREE and the unreferenced one fit
    mine = pool.allocate_blocks(4)                           # evicts the unreferenced third block
    assert mine is not None and cached[2] in mine and pool.evicted_total == 1
    assert pool.lookup(ks) == 2                               # the referenced ones survived
    assert pool.allocate_blocks(1) is None                   # nothing left to evict: referenced blocks stay
    pool.free(mine, owner=pool.owner_of(mine[0]))
    pool.unref(held)
    at_rest(pool)
    with pytest.raises(RuntimeError):
        pool.unref(held)                                     # one reference each, dropped once


def test_lru_evicts_a_chain_from_its_tail_and_old_chains_first():
    pool = KVBlockPool(LAYOUT, num_blocks=5, block_size=BS, prefix_cache=True)
    old = keys([50 + i for i in range(8)])
    new = keys([1 + i for i in range(8)])
    retire_into_cache(pool, old, extra_blocks=0)
    retire_into_cache(pool, new, extra_blocks=0)
    assert pool.free_blocks == 1
    pool.allocate_blocks(2)                                  # one free, one evicted: the old chain's tail
    assert pool.lookup(old) == 1 and pool.lookup(new) == 2
    pool.allocate_blocks(2)                                  # then the old root, then the new chain's tail
    assert pool.lookup(old) == 0 and pool.lookup(new) == 1


def test_a_second_copy_of_a_cached_key_is_freed_and_the_cache_off_caches_nothing():
    pool = KVBlockPool(LAYOUT, num_blocks=4, block_size=BS, prefix_cache=True)
    ks = keys(list(range(1, 9)))
    retire_into_cache(pool, ks, extra_blocks=0)
    retire_into_cache(pool, ks, extra_blocks=0)
    assert pool.cached_blocks == 2 and pool.free_blocks == 2
    off = KVBlockPool(LAYOUT, num_blocks=4, block_size=BS, prefix_cache=False)
    retire_into_cache(off, ks)
    assert off.cached_blocks == 0 and off.free_blocks == 4


# -- reservations ----------------------------------------------------------------------------
def table(num_blocks: int) -> ReservationTable:
    return ReservationTable(KVBlockPool(LAYOUT, num_blocks=num_blocks, block_size=BS, prefix_cache=True))


def reserve(t: ReservationTable, prompt: int, out: int, ks, reuse: bool):
    return t.reserve("r", prompt, out, time.monotonic() + 60, "d", "fp", prefix_keys=ks, reuse_prefix=reuse)


def test_a_reservation_reuses_cached_blocks_and_wins_over_unreferenced_ones():
    t = table(8)
    ids = list(range(1, 14))                                 # 13 tokens: 3 full blocks
    ks = keys(ids)
    first = reserve(t, 13, 3, ks, reuse=True)
    assert first.shared == 0 and len(first.blocks) == 4
    first.keys_verified = True
    t.release(first.reservation_id, cache_tokens=13)
    assert t.pool.cached_blocks == 3
    at_rest(t.pool)
    again = reserve(t, 13, 3, ks, reuse=True)
    assert again.shared == 3 and again.cached_tokens == 12 and again.blocks[:3] == [t.pool._by_key[k] for k in ks]
    assert len(again.owned) == 1
    # a reservation needing every other block evicts nothing the reused prefix holds
    big = reserve(t, 4 * 4, 0, [], reuse=False)
    assert big is not None and t.pool.lookup(ks) == 3
    assert reserve(t, 4, 0, [], reuse=False) is None         # the referenced blocks are never taken
    t.release(big.reservation_id)
    again.keys_verified = True
    t.release(again.reservation_id, cache_tokens=14)
    at_rest(t.pool)
    assert t.pool.cached_blocks == 3


def test_the_last_prompt_token_is_always_computed_and_unverified_keys_are_not_cached():
    t = table(8)
    ks = keys(list(range(1, 9)))                             # 8 tokens: exactly two full blocks
    r = reserve(t, 8, 2, ks, reuse=True)
    t.release(r.reservation_id, cache_tokens=8)              # keys never verified: nothing cached
    assert t.pool.cached_blocks == 0
    r = reserve(t, 8, 2, ks, reuse=True)
    r.keys_verified = True
    t.release(r.reservation_id, cache_tokens=8)
    assert t.pool.cached_blocks == 2
    r = reserve(t, 8, 2, ks, reuse=True)
    assert r.shared == 1                                     # (8 - 1) // 4: the last block is recomputed
    t.release(r.reservation_id, cache_tokens=3)              # its own blocks hold too little to cache
    at_rest(t.pool)
    assert t.pool.cached_blocks == 2


def test_a_failed_reservation_takes_no_reference():
    t = table(4)
    ks = keys(list(range(1, 9)))
    r = reserve(t, 8, 0, ks, reuse=False)
    r.keys_verified = True
    t.release(r.reservation_id, cache_tokens=8)
    assert reserve(t, 9, 100, ks, reuse=True) is None        # too big even with the hit
    at_rest(t.pool)
    assert t.pool.lookup(ks) == 2


def test_a_block_key_hashes_the_tokens_as_int64_bytes():
    """The key format is shared by the gateway and every decode worker, across releases: a block's key
    is blake3 of its parent's key and its tokens' int64 bytes (a change here only costs cache hits
    while old and new processes mix, but it must not change by accident)."""
    import blake3

    from runtime.model.prefix_keys import KEY_BYTES, root_key

    ids = [1, 2, 300000, 4, 5, 6, 7, 8]
    expected, parent = [], root_key("fp", BS, "")
    for i in range(2):
        parent = blake3.blake3(parent + torch.tensor(ids[i * BS:(i + 1) * BS], dtype=torch.int64).numpy().tobytes()).digest(KEY_BYTES)
        expected.append(parent)
    assert keys(ids) == expected
    assert keys(torch.tensor(ids)) == expected   # a tensor of ids keys as its list does
