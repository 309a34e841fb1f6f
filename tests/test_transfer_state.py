"""TransferState: ordered like a poll result, ``min()`` of the parts decides, terminal states are sticky."""

from __future__ import annotations

import itertools

import pytest

from runtime.worker.transfer_state import IllegalTransition, TransferState, advance, from_wire, to_wire

S = TransferState
ORDER = [S.FAILED, S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS]
LIVE = [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING]


def test_total_order():
    assert sorted(TransferState) == ORDER
    assert all(a < b for a, b in zip(ORDER, ORDER[1:]))


def test_terminal_states():
    assert {s for s in TransferState if s.terminal} == {S.FAILED, S.SUCCESS}


@pytest.mark.parametrize(
    ("parts", "overall"),
    [
        ([S.SUCCESS, S.SUCCESS, S.SUCCESS], S.SUCCESS),
        ([S.SUCCESS, S.TRANSFERRING, S.SUCCESS], S.TRANSFERRING),          # the slowest part decides
        ([S.TRANSFERRING, S.WAITING_FOR_INPUT], S.WAITING_FOR_INPUT),
        ([S.SUCCESS, S.BOOTSTRAPPING, S.TRANSFERRING], S.BOOTSTRAPPING),
        ([S.SUCCESS, S.SUCCESS, S.FAILED], S.FAILED),                     # one failed part fails the transfer
        ([S.FAILED, S.TRANSFERRING], S.FAILED),
        ([S.WAITING_FOR_INPUT], S.WAITING_FOR_INPUT),
    ],
)
def test_min_of_parts(parts, overall):
    assert min(parts) == overall


def test_min_over_all_combinations_matches_rules():
    for parts in itertools.product(ORDER, repeat=3):
        overall = min(parts)
        if S.FAILED in parts:
            assert overall == S.FAILED
        elif all(p == S.SUCCESS for p in parts):
            assert overall == S.SUCCESS
        else:
            assert not overall.terminal and overall in parts


def test_forward_path():
    state = S.BOOTSTRAPPING
    for nxt in [S.WAITING_FOR_INPUT, S.TRANSFERRING, S.TRANSFERRING, S.SUCCESS]:
        state = advance(state, nxt)
        assert state == nxt


def test_states_may_be_skipped_forwards():
    assert advance(S.BOOTSTRAPPING, S.TRANSFERRING) == S.TRANSFERRING
    assert advance(S.BOOTSTRAPPING, S.SUCCESS) == S.SUCCESS


@pytest.mark.parametrize("live", LIVE)
def test_live_state_stays_or_fails(live):
    assert advance(live, live) == live
    assert advance(live, S.FAILED) == S.FAILED


@pytest.mark.parametrize(("current", "new"), [(a, b) for a in LIVE for b in LIVE if b < a])
def test_no_going_back(current, new):
    with pytest.raises(IllegalTransition):
        advance(current, new)


@pytest.mark.parametrize("terminal", [S.FAILED, S.SUCCESS])
def test_terminal_states_are_sticky(terminal):
    assert advance(terminal, terminal) == terminal
    for other in TransferState:
        if other != terminal:
            with pytest.raises(IllegalTransition, match=terminal.name):
                advance(terminal, other)


def test_success_cannot_turn_into_failure_and_back():
    state = advance(advance(S.BOOTSTRAPPING, S.TRANSFERRING), S.SUCCESS)
    with pytest.raises(IllegalTransition):
        advance(state, S.FAILED)
    failed = advance(S.TRANSFERRING, S.FAILED)
    with pytest.raises(IllegalTransition):
        advance(failed, S.SUCCESS)
    with pytest.raises(IllegalTransition):
        advance(failed, S.BOOTSTRAPPING)


def test_wire_names_round_trip_and_nothing_else_is_a_state():
    for state in TransferState:
        assert from_wire(to_wire(state)) is state
    assert to_wire(None) == "" and from_wire("") is None                 # the stream named no live reservation
    assert from_wire("success") is None and from_wire("4") is None       # names only, exactly
