"""Reservations: decode blocks committed to one request before any KV moves.

Lifecycle of a reservation (one owner: the decode worker's ``ReservationTable``)::

    reserve ──> attempt(gen 1): WAITING_FOR_INPUT ─chunk─> TRANSFERRING ─all chunks verified─> SUCCESS ─> inserted
                     │                                                                     (running sequence)
                     └─ FAILED ──rearm──> attempt(gen 2) ...
    any state ──release──> gone (blocks back in the pool, pending chunks dropped), exactly once

Every retirement path (finished, failed transfer, cancel, client disconnect,
deadline, lease expiry) ends in ``ReservationTable.release``, which is idempotent:
the first call frees, later calls are no-ops. A lease (deadline + margin) bounds
how long a reservation that was never inserted may hold blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field

from runtime.kv_pool import KVBlockPool

from .transfer_state import TransferState, advance


@dataclass(slots=True)
class TransferAttempt:
    """Chunk bookkeeping for one generation of a reservation."""

    generation: int
    state: TransferState = TransferState.BOOTSTRAPPING
    received: dict[int, tuple[int, int]] = field(default_factory=dict)  # chunk index -> token range
    landing: set[int] = field(default_factory=set)   # chunk indices being received in place (bulk path)
    total_chunks: int | None = None
    first_token: int | None = None
    token_digest: str = ""
    model_fingerprint: str = ""
    prefill_ms: float | None = None
    bytes_received: int = 0
    first_chunk_at: float | None = None
    completed_at: float | None = None
    detail: str = ""
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def set_state(self, new: TransferState, detail: str = "") -> None:
        self.state = advance(self.state, new)
        if detail:
            self.detail = detail
        if self.state.terminal:
            self.completed_at = time.monotonic()
            self.done.set()


@dataclass(slots=True)
class Reservation:
    request_id: str
    reservation_id: str
    blocks: list[int]
    prompt_tokens: int
    max_tokens: int
    token_digest: str
    model_fingerprint: str
    lease_expires_at: float      # monotonic
    alloc_ms: float
    created_at: float = field(default_factory=time.monotonic)
    attempt: TransferAttempt = field(default_factory=lambda: TransferAttempt(generation=1))
    inserted: bool = False
    released: bool = False

    @property
    def generation(self) -> int:
        return self.attempt.generation

    @property
    def pending_chunks(self) -> int:
        """Chunks landed but not yet handed to the running batch."""
        return 0 if self.inserted or self.released else len(self.attempt.received)


class ReservationTable:
    def __init__(self, pool: KVBlockPool, lease_margin_s: float = 10.0):
        self.pool = pool
        self.lease_margin_s = lease_margin_s
        self._by_id: dict[str, Reservation] = {}
        self._ids = itertools.count(1)
        self.released_total = 0

    # -- check, then commit -----------------------------------------------------
    def can_reserve(self, prompt_tokens: int, max_tokens: int) -> bool:
        return self.pool.can_allocate(prompt_tokens + max_tokens)

    def fits_at_all(self, prompt_tokens: int, max_tokens: int) -> bool:
        return self.pool.blocks_for(prompt_tokens + max_tokens) <= self.pool.num_blocks

    def reserve(self, request_id: str, prompt_tokens: int, max_tokens: int, deadline_s: float,
                token_digest: str, model_fingerprint: str) -> Reservation | None:
        """Allocate destination blocks now, or return ``None`` (nothing taken)."""
        started = time.perf_counter()
        blocks = self.pool.allocate(prompt_tokens + max_tokens)
        if blocks is None:
            return None
        res = Reservation(
            request_id=request_id,
            reservation_id=f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            blocks=blocks,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            token_digest=token_digest,
            model_fingerprint=model_fingerprint,
            lease_expires_at=deadline_s + self.lease_margin_s,
            alloc_ms=(time.perf_counter() - started) * 1000,
        )
        res.attempt.set_state(TransferState.WAITING_FOR_INPUT)  # block map is published with the reply
        self._by_id[res.reservation_id] = res
        return res

    def get(self, reservation_id: str) -> Reservation | None:
        return self._by_id.get(reservation_id)

    def rearm(self, reservation_id: str) -> Reservation | None:
        """New transfer attempt (generation + 1) into the same blocks; stale chunks will be rejected."""
        res = self._by_id.get(reservation_id)
        if res is None or res.inserted or res.released:
            return None
        res.attempt.done.set()  # wake anyone waiting on the old attempt
        res.attempt = TransferAttempt(generation=res.generation + 1)
        res.attempt.set_state(TransferState.WAITING_FOR_INPUT)
        return res

    def release(self, reservation_id: str, reason: str = "") -> bool:
        """Free blocks and chunk bookkeeping exactly once. Returns whether this call freed them."""
        res = self._by_id.pop(reservation_id, None)
        if res is None or res.released:
            return False
        res.released = True
        if not res.attempt.state.terminal:
            res.attempt.set_state(TransferState.FAILED, reason or "released")
        res.attempt.received.clear()
        res.attempt.landing.clear()
        res.attempt.done.set()
        self.pool.free(res.blocks)
        self.released_total += 1
        return True

    def expired(self, now: float | None = None) -> list[Reservation]:
        now = time.monotonic() if now is None else now
        return [r for r in self._by_id.values() if not r.inserted and r.lease_expires_at < now]

    # -- gauges -----------------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self._by_id)

    @property
    def pending_chunks(self) -> int:
        return sum(r.pending_chunks for r in self._by_id.values())
