"""``n`` > 1 on the decode worker: one reservation for every choice, forks of the prompt's KV.

The reservation holds the prompt's full blocks once and each further choice's own blocks (its
copy of the last partial prompt block, its output); a choice's retirement frees its own blocks
once, the last one releases the rest; a release (gateway, reaper) frees every choice's blocks;
a re-arm fences them all. The fork's copy of the partial block is the parent's KV. The
end-to-end behaviour (greedy choices equal the n=1 answer, both placements) is in
``tests/test_n_choices.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

from decode_svc.reservations import Fit, ReservationTable
from runtime.model.kv_pool import KVBlockPool, KVLayout, StaleBlocksError
from runtime.model.sampling import SEED_MAX, SEED_MIN, SamplingParams, choice_seed, for_choice
from runtime.policy.loads import RequestShape
from runtime.policy.placement_policy import blocks_needed

LAYOUT = KVLayout(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
BS = 4


def table(blocks: int = 32) -> tuple[KVBlockPool, ReservationTable]:
    pool = KVBlockPool(LAYOUT, blocks, BS)
    return pool, ReservationTable(pool)


def reserve(t: ReservationTable, prompt: int, max_tokens: int, choices: int):
    return t.reserve("req", prompt, max_tokens, time.monotonic() + 60, "digest", "fp", choices=choices)


@pytest.mark.parametrize(("prompt", "max_tokens", "choices", "want"), [
    (10, 6, 1, 4),          # one choice: ceil(16 / 4)
    (10, 6, 3, 4 + 2 * 2),  # 2 full prompt blocks shared; each other choice: its partial block + output = 2
    (8, 4, 3, 3 + 2 * 1),   # a prompt ending on a block boundary: nothing to copy, output only
])
def test_blocks_for_every_choice_count_the_prompt_once(prompt, max_tokens, choices, want):
    pool, t = table()
    assert t.blocks_needed(prompt, max_tokens, choices) == want
    assert blocks_needed(RequestShape(prompt, max_tokens, choices=choices), BS) == want   # admission agrees
    res = reserve(t, prompt, max_tokens, choices)
    assert len(res.owned) == want and pool.free_blocks == 32 - want
    full = prompt // BS
    for i in range(1, choices):
        table_i = res.choice_blocks(i)
        assert table_i[:full] == res.blocks[:full]                  # the full prompt blocks are shared
        assert len(table_i) == len(res.blocks)                       # room for the prompt and max_tokens
        assert not set(table_i[full:]) & set(res.blocks[full:])      # the rest is the choice's own
    t.release(res.reservation_id)
    assert pool.free_blocks == 32


def test_each_choice_retires_once_and_the_last_releases():
    pool, t = table()
    res = reserve(t, 10, 6, 3)
    lease = res.lease
    assert t.retire_choice(lease, 1) and pool.free_blocks == 32 - 6   # choice 1's own two blocks back
    assert not t.retire_choice(lease, 1)                              # once per choice
    assert t.retire_choice(lease, 0) and pool.free_blocks == 32 - 6   # shared blocks held while choice 2 runs
    assert t.get(res.reservation_id) is not None
    assert t.retire_choice(lease, 2) and pool.free_blocks == 32       # the last one releases the rest
    assert t.get(res.reservation_id) is None and not t.retire_choice(lease, 2)


def test_a_release_frees_every_choice_and_a_rearm_fences_them_all():
    pool, t = table()
    res = reserve(t, 10, 6, 3)
    old = res.lease
    t.rearm(res.reservation_id)
    for i in range(3):   # a stale generation can neither write nor retire a choice
        with pytest.raises(StaleBlocksError):
            pool.copy_block(res.blocks[2], res.choice_blocks(i)[2], owner=old.owner)
    assert not t.retire_choice(old, 1) and pool.free_blocks == 32 - 8
    assert t.retire_choice(res.lease, 1)
    assert t.release(res.reservation_id) and pool.free_blocks == 32   # the forks left are freed too, once
    assert not t.release(res.reservation_id)


def test_a_fork_copies_the_partial_prompt_block():
    pool, t = table()
    res = reserve(t, 10, 6, 2)
    pool.kv[:, :, res.blocks[2]] = torch.randn_like(pool.kv[:, :, 0])
    pool.copy_block(res.blocks[2], res.choice_blocks(1)[2], owner=res.lease.owner)
    assert torch.equal(pool.read(res.choice_blocks(1), 0, 10), pool.read(res.blocks, 0, 10))


def test_choices_that_cannot_all_fit_are_refused_whole():
    pool, t = table(7)   # n=2 takes 6 blocks, n=3 8
    assert t.can_reserve(10, 6, 2) is Fit.NOW and t.can_reserve(10, 6, 3) is Fit.NEVER
    held = pool.allocate_blocks(2)
    assert t.can_reserve(10, 6, 2) is Fit.NO_ROOM and reserve(t, 10, 6, 2) is None and pool.free_blocks == 5
    pool.free(held)


def test_choice_seeds_are_distinct_reproducible_and_choice_0_is_the_request():
    p = SamplingParams(temperature=1.0, seed=42, n=4)
    assert for_choice(p, 0) is p and for_choice(SamplingParams(n=2), 1).seed is None
    seeds = [for_choice(p, i).seed for i in range(4)]
    assert len(set(seeds)) == 4 and seeds == [for_choice(p, i).seed for i in range(4)]
    assert all(SEED_MIN <= choice_seed(s, i) <= SEED_MAX for s in (SEED_MIN, -1, 0, SEED_MAX) for i in range(16))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=17)


def test_a_choice_the_gateway_ends_early_retires_and_frees_once():
    """``retire_choices`` (the gateway ended choice 1) retires it at the step boundary and frees its
    own blocks; its normal end afterwards (or a second early retire) frees nothing again, and the
    other choices run on until they end and release the rest."""
    from decode_svc.request_status import DecodeStatus
    from decode_svc.scheduler import DecodeScheduler, Sequence
    pool, t = table()
    res = reserve(t, 10, 6, 3)
    sched = DecodeScheduler(None, pool, on_retire=lambda s: t.retire_choice(s.lease, s.index, "retired"))
    seqs = [Sequence("r", res.lease, res.choice_blocks(i), 10, 6, SamplingParams(n=3), index=i) for i in range(3)]
    for s in seqs:
        s._status = DecodeStatus.RUNNING
        sched._running.append(s)
    assert sched.retire_choices(res.reservation_id, res.lease.generation + 1, {1}) == 0   # another generation's
    assert sched.retire_choices(res.reservation_id, res.lease.generation, {1}) == 1
    assert pool.free_blocks == 32 - 8                   # marked only: it leaves at the step boundary
    sched._drop_cancelled()
    assert seqs[1].status is DecodeStatus.FINISHED_CANCELLED and pool.free_blocks == 32 - 6
    assert sched.choices_retired_early == 1 and sched.running_seqs == 2
    sched._retire(seqs[1], DecodeStatus.FINISHED_LENGTH)   # its normal end comes too late: a no-op
    assert not t.retire_choice(res.lease, 1) and pool.free_blocks == 32 - 6
    assert sched.retire_choices(res.reservation_id, res.lease.generation, {1}) == 0
    assert seqs[1].events.qsize() == 1                  # one end event for the choice
    for s in (seqs[0], seqs[2]):
        sched._retire(s, DecodeStatus.FINISHED_LENGTH)
    assert pool.free_blocks == 32 and t.get(res.reservation_id) is None
    assert sched.choices_retired_early == 1
