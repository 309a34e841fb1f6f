"""The state of one KV transfer attempt, ordered like a poll result; both ends of the handoff share it.

``FAILED < BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING < SUCCESS``. The values
are ordered so that a transfer in several parts would be the ``min()`` of its parts
(the slowest or failed part decides); today an attempt is one part, judged whole by
``decode_svc/kv_receiver.py``. Terminal states (``FAILED``, ``SUCCESS``) are
sticky: an attempt never leaves them; a retry is a new attempt with a new
generation number (see ``decode_svc/reservations.py``, ``ReservationTable.rearm``).

On the wire (``PushKVResponse.state``) a state travels as its name; ``to_wire`` and
``from_wire`` are the only conversions, one at each end.
"""

from __future__ import annotations

from enum import IntEnum


class TransferState(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def terminal(self) -> bool:
        return self in (TransferState.FAILED, TransferState.SUCCESS)


class IllegalTransition(RuntimeError):
    pass


def advance(current: TransferState, new: TransferState) -> TransferState:
    """Return the next state; terminal states are sticky, FAILED is reachable from any live state."""
    if current.terminal:
        if new == current:
            return current
        raise IllegalTransition(f"transfer already {current.name}; cannot become {new.name}")
    if new != TransferState.FAILED and new < current:
        raise IllegalTransition(f"transfer cannot go back from {current.name} to {new.name}")
    return new


def to_wire(state: TransferState | None) -> str:
    """``PushKVResponse.state``: the state's name, ``""`` when the stream named no live reservation."""
    return "" if state is None else state.name


def from_wire(text: str) -> TransferState | None:
    """The state a ``PushKVResponse`` reports; ``None`` for ``""`` (no live reservation) or a name this side does not know."""
    return TransferState.__members__.get(text)
