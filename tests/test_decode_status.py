"""A decode request's status: one ordered enum, moved only by the reservation table's methods.

A real ``ReservationTable`` over a real (small) KV pool; no model is needed to move statuses.
"""

from __future__ import annotations

import time

import pytest
import torch

from decode_svc.request_status import DecodeStatus, finish_reason
from decode_svc.reservations import AttachRefused, Fit, ReservationTable
from runtime.model.kv_pool import KVBlockPool, KVLayout

S = DecodeStatus
LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)
BLOCKS, BLOCK = 8, 4


@pytest.fixture
def table() -> ReservationTable:
    return ReservationTable(KVBlockPool(LAYOUT, num_blocks=BLOCKS, block_size=BLOCK), lease_margin_s=0.0)


def reserve(table: ReservationTable, prompt: int = 6, max_tokens: int = 2, lease_s: float = 30.0):
    return table.reserve("req", prompt, max_tokens, time.monotonic() + lease_s, "digest", "fp")


def test_finished_statuses_all_come_after_one_boundary():
    live = [S.RESERVED, S.RECEIVING, S.INSERTED, S.PREFILLING, S.RUNNING]
    assert sorted(DecodeStatus)[: len(live)] == live                    # the lifecycle, in order
    assert [s for s in DecodeStatus if not s.is_finished] == live
    assert all(s.is_finished for s in DecodeStatus if s > S.RUNNING)


def test_one_map_turns_an_end_state_into_its_finish_reason():
    assert {s: finish_reason(s) for s in DecodeStatus if s.is_finished and s is not S.RELEASED} == {
        S.FINISHED_STOPPED: "stop", S.FINISHED_LENGTH: "length", S.FINISHED_CANCELLED: "cancelled",
        S.FINISHED_ABORTED: "aborted", S.FINISHED_ERROR: "error"}
    assert all(finish_reason(s) is None for s in DecodeStatus if not s.is_finished)


def test_can_reserve_checks_without_taking_and_reserve_commits(table):
    pool = table.pool
    assert table.can_reserve(BLOCKS * BLOCK, 1) is Fit.NEVER
    assert table.can_reserve(6, 2) is Fit.NOW
    assert pool.free_blocks == BLOCKS                                   # the check took nothing
    held = [reserve(table) for _ in range(BLOCKS // 2)]                  # 2 blocks each: the pool is full
    assert all(r is not None for r in held) and pool.free_blocks == 0
    assert table.can_reserve(6, 2) is Fit.NO_ROOM
    assert reserve(table) is None and table.active == len(held)          # a commit without room takes nothing
    table.release(held[0].reservation_id)
    assert table.can_reserve(6, 2) is Fit.NOW


def test_a_reservation_moves_forward_only_through_the_tables_methods(table):
    res = reserve(table)
    assert res.status is S.RESERVED and table.waiting == 1
    with pytest.raises(AttributeError):
        res.status = S.INSERTED                                          # nobody else assigns it

    assert table.attach(res.reservation_id, 1) is res and res.status is S.RECEIVING
    assert table.attach(res.reservation_id, 1) is AttachRefused.ATTACHED
    old = res.lease
    assert table.rearm(res.reservation_id) is res                        # a retry: back to RESERVED, generation 2
    assert (res.status, res.generation) == (S.RESERVED, 2)
    assert table.attach(res.reservation_id, 1) is AttachRefused.STALE_GENERATION
    assert table.attach(res.reservation_id, 2) is res
    assert not table.mark_inserted(old) and res.status is S.RECEIVING   # a stale lease inserts nothing

    assert table.mark_inserted(res.lease) and res.status is S.INSERTED
    assert table.waiting == 0 and table.pending_chunks == 0
    assert table.attach(res.reservation_id, 2) is AttachRefused.GENERATING
    assert table.rearm(res.reservation_id) is None                       # inserted: no retry into it
    assert table.expired(time.monotonic() + 3600) == []                  # nor is it the reaper's

    assert table.release(res.reservation_id, "test") and res.status is S.RELEASED
    assert not table.release(res.reservation_id, "test")                 # exactly once
    assert table.get(res.reservation_id) is None and table.transfer_state(res.reservation_id) is None
    assert table.attach(res.reservation_id, 2) is AttachRefused.GONE


def test_only_a_reservation_not_yet_inserted_is_reaped(table):
    waiting, inserted = reserve(table, lease_s=0.0), reserve(table, lease_s=0.0)
    table.attach(inserted.reservation_id, 1)
    table.mark_inserted(inserted.lease)
    assert table.reap_expired(time.monotonic() + 1) == [waiting]
    assert (waiting.status, inserted.status, table.reaped_total) == (S.RELEASED, S.INSERTED, 1)
    assert table.release_all("stopping") == 1 and table.active == 0
