"""The state of one KV transfer attempt, ordered like a poll result.

``FAILED < BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING < SUCCESS``. Because the
values are ordered, a multi-part transfer's state is the ``min()`` of its parts:
the slowest or failed part decides. Terminal states (``FAILED``, ``SUCCESS``) are
sticky: an attempt never leaves them; a retry is a new attempt with a new
generation number (see ``reservations.Reservation.rearm``).
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
