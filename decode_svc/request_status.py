"""One decode request's status: ordered, with every finished state after one boundary.

A request is first a reservation (owned by ``ReservationTable``), then a sequence
(owned by ``DecodeScheduler``); each record's status moves forward through the
same enum, and only its owner's methods move it::

    reservation:  RESERVED ─Generate─> RECEIVING ─KV verified / prompt embedded─> INSERTED ─retired─> RELEASED
                     ^                    │
                     └──────Rearm─────────┘  (a new generation; any live status ─release─> RELEASED)
    sequence:     RECEIVING ─insert─> [PREFILLING (colocated) ─>] RUNNING ─> FINISHED_*

Until insertion the reservation's status is the request's; from insertion its
sequence's is, and the reservation stays INSERTED until the sequence's retirement
releases it. ``is_finished`` is one comparison; ``finish_reason`` is the one map
from an end state to the reason a ``TokenEvent`` (or a retirement log) names.
"""

from __future__ import annotations

from enum import IntEnum


class DecodeStatus(IntEnum):
    RESERVED = 0            # blocks held; no Generate attached to the current generation
    RECEIVING = 1           # a Generate is attached: its KV is arriving, or its colocated prompt is fetched and embedded
    INSERTED = 2            # the reservation's sequence is in the scheduler, whose retirement frees the blocks
    PREFILLING = 3          # the sequence's colocated prompt still has chunks to run
    RUNNING = 4             # the sequence makes one token per step
    # -- finished: every status from here on is terminal --------------------------------------
    FINISHED_STOPPED = 5    # EOS
    FINISHED_LENGTH = 6     # max_tokens, or the model's context length
    FINISHED_CANCELLED = 7  # Release from the gateway, its Generate went away, or the worker is stopping
    FINISHED_ABORTED = 8    # its lease was lost (released, re-armed or expired under it): retired unwritten
    FINISHED_ERROR = 9      # a decode step failed
    RELEASED = 10           # a reservation's blocks are back in the pool

    @property
    def is_finished(self) -> bool:
        return self >= DecodeStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    DecodeStatus.FINISHED_STOPPED: "stop",
    DecodeStatus.FINISHED_LENGTH: "length",
    DecodeStatus.FINISHED_CANCELLED: "cancelled",
    DecodeStatus.FINISHED_ABORTED: "aborted",
    DecodeStatus.FINISHED_ERROR: "error",
}


def finish_reason(status: DecodeStatus | None) -> str | None:
    """``"stop"`` / ``"length"`` (what the client sees) or ``"cancelled"`` / ``"aborted"`` / ``"error"``
    (the Generate ends with a gRPC status instead); ``None`` for a status that is no sequence's end."""
    return _FINISH_REASONS.get(status)
