"""KVBlockPool: block ownership (allocate / free / double free / full) and slot addressing."""

from __future__ import annotations

import pytest
import torch

from runtime.model.kv_pool import FREE, KVBlockPool, KVLayout, StaleBlocksError

LAYOUT = KVLayout(layers=3, kv_heads=2, head_dim=4, dtype=torch.float32)


def pool(num_blocks: int = 8, block_size: int = 4) -> KVBlockPool:
    return KVBlockPool(LAYOUT, num_blocks=num_blocks, block_size=block_size)


def chunk(n: int, seed: int = 0) -> torch.Tensor:
    """A wire chunk ``[layers, 2, n, kv_heads, head_dim]`` of distinct values."""
    return torch.randn(LAYOUT.layers, 2, n, LAYOUT.kv_heads, LAYOUT.head_dim, generator=torch.Generator().manual_seed(seed))


# -- layout and sizing -----------------------------------------------------------------------
def test_layout_bytes_and_description():
    assert LAYOUT.bytes_per_token == 3 * 2 * 2 * 4 * 4
    assert KVLayout(2, 1, 8, torch.bfloat16).bytes_per_token == 2 * 2 * 1 * 8 * 2
    assert LAYOUT.describe() == "L3xKV2xD4:float32"
    assert LAYOUT.describe() != KVLayout(3, 2, 4, torch.float16).describe()


def test_pool_tensor_shape_and_capacity():
    p = pool(num_blocks=5, block_size=4)
    assert p.kv.shape == (3, 2, 5, 4, 2, 4) and p.kv.dtype == torch.float32
    assert p.free_blocks == 5
    assert [p.blocks_for(t) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_invalid_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        KVBlockPool(LAYOUT, num_blocks=num_blocks, block_size=block_size)


def test_from_memory_budget():
    block_bytes = LAYOUT.bytes_per_token * 4
    p = KVBlockPool.from_memory_budget(LAYOUT, block_bytes * 7 + block_bytes - 1, block_size=4)
    assert p.num_blocks == 7
    with pytest.raises(ValueError):
        KVBlockPool.from_memory_budget(LAYOUT, block_bytes - 1, block_size=4)


# -- ownership -------------------------------------------------------------------------------
def test_allocate_hands_out_distinct_blocks_low_ids_first():
    p = pool(num_blocks=8, block_size=4)
    a = p.allocate(5)   # 2 blocks
    b = p.allocate(4)   # 1 block
    c = p.allocate(1)   # 1 block
    assert a == [0, 1] and b == [2] and c == [3]
    assert p.free_blocks == 4


def test_allocate_zero_tokens():
    p = pool()
    assert p.allocate(0) == []
    assert p.free_blocks == p.num_blocks


def test_allocate_returns_none_when_full_and_takes_nothing():
    p = pool(num_blocks=4, block_size=4)
    held = p.allocate(12)
    assert len(held) == 3 and p.free_blocks == 1
    assert not p.can_allocate(5)
    assert p.allocate(5) is None
    assert p.free_blocks == 1, "a failed allocate must not take any block"
    assert p.can_allocate(4)
    last = p.allocate(4)
    assert last == [3] and p.free_blocks == 0
    assert p.allocate(1) is None
    p.free(held)
    assert p.allocate(12) is not None


def test_can_allocate_is_side_effect_free():
    p = pool(num_blocks=2, block_size=4)
    for _ in range(3):
        assert p.can_allocate(8) and not p.can_allocate(9)
    assert p.free_blocks == 2


def test_free_returns_blocks_for_reuse():
    p = pool(num_blocks=4, block_size=4)
    a, b = p.allocate(8), p.allocate(8)
    p.free(a)
    assert p.free_blocks == 2
    c = p.allocate(8)
    assert sorted(c) == sorted(a) and not set(c) & set(b)
    p.free(b)
    p.free(c)
    assert p.free_blocks == 4


def test_double_free_raises():
    p = pool()
    a = p.allocate(8)
    p.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        p.free(a)
    assert p.free_blocks == p.num_blocks, "the failed double free must not add blocks"


def test_freeing_a_never_allocated_block_raises():
    p = pool()
    with pytest.raises(RuntimeError, match="freed twice"):
        p.free([3])
    assert p.free_blocks == p.num_blocks


def test_free_blocks_never_exceed_capacity_under_churn():
    p = pool(num_blocks=6, block_size=2)
    held: list[list[int]] = []
    for step in range(60):
        if step % 3 != 2:
            blocks = p.allocate(1 + step % 5)
            if blocks is not None:
                held.append(blocks)
        elif held:
            p.free(held.pop(step % len(held)))
        owned = [b for bl in held for b in bl]
        assert len(owned) == len(set(owned)), "a block was handed to two owners"
        assert p.free_blocks + len(owned) == p.num_blocks


# -- addressing ------------------------------------------------------------------------------
def test_slots_follow_the_block_table():
    p = pool(num_blocks=8, block_size=4)
    blocks = [5, 2, 7]
    assert p.slots(blocks, 0, 12).tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    assert p.slots(blocks, 3, 6).tolist() == [23, 8, 9]
    assert p.slots(blocks, 6, 6).tolist() == []
    assert p.slots(blocks, 0, 12).dtype == torch.long


@pytest.mark.parametrize(("start", "end"), [(0, 13), (-1, 2), (5, 4)])
def test_slots_outside_the_block_table(start, end):
    with pytest.raises(IndexError):
        pool(num_blocks=8, block_size=4).slots([5, 2, 7], start, end)


def test_write_read_roundtrip_non_contiguous_and_unaligned():
    p = pool(num_blocks=8, block_size=4)
    t = p.new_token()
    p.allocate(8 * 4, t)               # every block is t's, so the table below need not be 0, 1, 2
    blocks = [6, 1, 3]
    first, second = chunk(5, seed=1), chunk(6, seed=2)
    p.write(blocks, 0, first, owner=t)          # positions 0..4 (crosses a block boundary)
    p.write(blocks, 5, second, owner=t)         # positions 5..10 (unaligned start)
    torch.testing.assert_close(p.read(blocks, 0, 5), first, rtol=0, atol=0)
    torch.testing.assert_close(p.read(blocks, 5, 11), second, rtol=0, atol=0)
    torch.testing.assert_close(p.read(blocks, 3, 7), torch.cat([first[:, :, 3:], second[:, :, :2]], dim=2), rtol=0, atol=0)
    # the data really lives at kv[layer, k_or_v, block, offset]: position 6 is block 1 offset 2
    torch.testing.assert_close(p.kv[:, :, 1, 2], second[:, :, 1], rtol=0, atol=0)


def test_writes_stay_inside_their_own_blocks():
    p = pool(num_blocks=6, block_size=4)
    a, b = p.allocate(8), p.allocate(8)
    ta, tb = p.owner_of(a[0]), p.owner_of(b[0])
    data_b = chunk(8, seed=3)
    p.write(b, 0, data_b, owner=tb)
    p.write(a, 0, chunk(8, seed=4), owner=ta)
    p.write(a, 2, chunk(3, seed=5), owner=ta)    # overwrite inside a only
    torch.testing.assert_close(p.read(b, 0, 8), data_b, rtol=0, atol=0)
    untouched = [blk for blk in range(6) if blk not in a + b]
    assert torch.count_nonzero(p.kv[:, :, untouched]) == 0


def test_write_casts_to_the_pool_dtype():
    p = KVBlockPool(KVLayout(3, 2, 4, torch.bfloat16), num_blocks=2, block_size=4)
    blocks = p.allocate(4, owner=7)
    data = chunk(3, seed=6)  # float32
    p.write(blocks, 1, data, owner=7)
    out = p.read(blocks, 1, 4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, data.to(torch.bfloat16), rtol=0, atol=0)


def test_write_past_the_block_table_raises():
    p = pool(num_blocks=4, block_size=4)
    blocks = p.allocate(4, owner=7)
    with pytest.raises(IndexError):
        p.write(blocks, 2, chunk(3), owner=7)


def test_read_is_a_copy():
    p = pool()
    blocks = p.allocate(4, owner=7)
    p.write(blocks, 0, chunk(4, seed=7), owner=7)
    out = p.read(blocks, 0, 4)
    out.zero_()
    assert torch.count_nonzero(p.read(blocks, 0, 4)) > 0


def test_a_freed_sequence_hands_its_blocks_back_in_order():
    p = pool(num_blocks=8)
    first = p.allocate(4 * 6)
    p.free(first)
    again = p.allocate(4 * 6)
    assert again == first
    assert len(p.runs(again, 0, 24)) == 1      # still one contiguous run: one copy per layer to land


def test_host_views_are_the_wire_chunk_in_place():
    p = pool(num_blocks=8)
    blocks = p.allocate(4 * 5, owner=7)
    blocks[1], blocks[3] = blocks[3], blocks[1]   # a fragmented block table
    c = chunk(17, seed=3)
    wire = c.contiguous().view(torch.uint8).numpy().tobytes()
    offset = 0
    for view in p.host_views(blocks, 2, 19, owner=7):
        view[:] = wire[offset: offset + len(view)]
        offset += len(view)
    assert offset == len(wire)
    assert torch.equal(p.read(blocks, 2, 19), c)


# -- the ownership fence (owner tokens) ----------------------------------------------------------
def test_every_allocation_gets_its_own_token_and_free_clears_it():
    p = pool(num_blocks=4, block_size=4)
    a, b = p.allocate(4), p.allocate(4)
    assert p.owner_of(a[0]) != p.owner_of(b[0]) and FREE not in (p.owner_of(a[0]), p.owner_of(b[0]))
    t = p.owner_of(a[0])
    assert p.owns(a, t) and not p.owns(b, t)
    p.free(a)
    assert p.owner_of(a[0]) == FREE and not p.owns(a, t)
    again = p.allocate(4)
    assert again == a and not p.owns(again, t), "a reused block never carries the old token"
    assert p.new_token() != p.new_token()


def test_write_with_a_stale_token_raises_and_writes_nothing():
    """The fence: the first holder's blocks were freed and handed to a second holder; a late
    write under the first token is refused, and the second holder's bytes are untouched."""
    p = pool(num_blocks=4, block_size=4)
    first = p.new_token()
    blocks = p.allocate(8, first)
    p.free(blocks, owner=first)
    second = p.new_token()
    assert p.allocate(8, second) == blocks               # the very same blocks, new owner
    theirs = chunk(8, seed=11)
    p.write(blocks, 0, theirs, owner=second)
    snapshot = p.kv.clone()
    with pytest.raises(StaleBlocksError, match="no longer belongs"):
        p.write(blocks, 0, chunk(8, seed=12) * 1e3, owner=first)
    with pytest.raises(StaleBlocksError):
        p.write(blocks, 5, chunk(1, seed=13), owner=first)   # one block, partly
    with pytest.raises(StaleBlocksError):
        p.host_views(blocks, 0, 8, owner=first)
    assert torch.equal(p.kv, snapshot), "a refused write must not touch the pool"
    torch.testing.assert_close(p.read(blocks, 0, 8), theirs, rtol=0, atol=0)


def test_write_into_free_blocks_is_refused():
    p = pool(num_blocks=4, block_size=4)
    t = p.new_token()
    with pytest.raises(StaleBlocksError):
        p.write([0, 1], 0, chunk(8), owner=t)
    with pytest.raises(StaleBlocksError):
        p.write([0], 0, chunk(4), owner=FREE)          # the free tag is nobody's token
    assert torch.count_nonzero(p.kv) == 0


def test_retag_fences_the_old_token_and_free_checks_the_owner():
    p = pool(num_blocks=4, block_size=4)
    old, new = p.new_token(), p.new_token()
    blocks = p.allocate(8, old)
    p.retag(blocks, old, new)
    assert p.owns(blocks, new) and not p.owns(blocks, old)
    with pytest.raises(StaleBlocksError):
        p.write(blocks, 0, chunk(8), owner=old)
    with pytest.raises(StaleBlocksError):
        p.retag(blocks, old, p.new_token())
    with pytest.raises(StaleBlocksError):
        p.free(blocks, owner=old)                     # a stale holder cannot free the new owner's blocks
    assert p.free_blocks == 2
    p.free(blocks, owner=new)
    assert p.free_blocks == 4
