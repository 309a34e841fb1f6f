"""Reservations: decode blocks committed to one request before any KV moves.

Lifecycle of a reservation (one owner: the decode worker's ``ReservationTable``; its
``DecodeStatus``, ``request_status.py``, moves only through the table's methods)::

    reserve ──> RESERVED ─attach (Generate)─> RECEIVING ─mark_inserted─> INSERTED (its sequence runs)
                  transfer attempt(gen 1): WAITING_FOR_INPUT ─chunk─> TRANSFERRING ─all verified─> SUCCESS
                     └─ FAILED ──rearm──> RESERVED, attempt(gen 2) ...
    any status ──release──> RELEASED (blocks back in the pool, pending chunks dropped), exactly once

``can_reserve`` / ``reserve`` are a check and its commit: the check has no side
effect and says whether the blocks are there now (or could ever be); the commit
takes them, or returns ``None`` and takes nothing.

Every retirement path (finished, failed transfer, cancel, client disconnect,
deadline, lease expiry) ends in ``ReservationTable.release``, which is idempotent:
the first call frees, later calls are no-ops. A lease (deadline + margin, the
deadline capped at ``max_lease_s`` from now whatever the caller sent) bounds how
long a reservation that was never inserted may hold blocks; ``reap_expired``
releases those and counts them (``reaped_total``: a healthy run never needs it).

Fencing: each attempt (generation) tags the reservation's blocks in the pool with
its own owner token (``Lease.owner``); a re-arm moves the blocks to a new token,
a release clears it. Whoever writes into the blocks (chunk landing, the decode
scheduler's steps) names the token it was given, and the pool refuses a write
under a token that is no longer the blocks' — so no stale attempt, released
reservation or expired lease can write into blocks that changed owner.

Prefix cache (``runtime/model/kv_pool.py``): a reservation's block table is its ``shared``
leading cached blocks (references taken by ``reserve`` when the caller asks to reuse its
``prefix_keys``: a colocated prompt, whose decode worker then computes only the rest) and
its own blocks (``owned``, allocated for everything else, evicting unreferenced cached
blocks when needed: a reservation wins over the cache). The owner token and every fence
cover the owned blocks only; nobody writes into shared ones. ``release`` drops the
references and, given how many prompt tokens hold written KV (``cache_tokens``: the
retiring sequence's), hands the full prompt blocks among the owned ones to the cache under
their keys — only keys the decode worker recomputed from the prompt itself
(``keys_verified``) — and frees the rest.

Hybrid decoders (``states``: a ``StateSlotPool``): a reservation also holds one state slot
(``state_slot``) for the linear-attention layers' fixed-size state, taken with the blocks
(both or neither) and freed with them by the one ``release``. Such a reservation never
reuses or caches a prefix: a block boundary has KV but no saved linear state, so a cached
prefix could only be continued from a wrong (absent) state.

Choices (``n`` > 1, ``choices_blocks``): one reservation holds every choice's blocks, all under
its owner token. Choice 0's table is ``blocks``, as for one choice; choice ``i`` > 0 shares its
``F = prompt_tokens // block_size`` full prompt blocks and owns ``forks[i - 1]``: a copy of the
last partial prompt block (the decode worker copies it when the sequence forks) and its output
blocks. The full prompt blocks are reference-counted by the choices still live: each choice
retires once (``retire_choice``), a fork's own blocks are freed when it retires, and the last
choice's retirement releases the reservation (the prompt blocks, choice 0's, any fork left).

Windowed pool (sliding-window layers kept in rings, ``runtime/model/kv_pool.py``): every choice
also owns its rings (``rings[i]``, ``choice_rings``), taken with the blocks under the same owner
token and freed when that choice retires (choice 0's with the reservation); a fork's rings get
a copy of choice 0's when it forks. The reservation's size is ``placement_policy.kv_blocks_needed``,
the formula admission uses with the ``ring_groups`` / ``ring_blocks`` the worker reports.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum

from proto.epd.v1 import epd_pb2 as pb
from runtime.model.kv_pool import KVBlockPool
from runtime.policy.placement_policy import kv_blocks_needed
from runtime.model.state_slots import StateSlotPool
from runtime.worker.transfer_state import TransferState, advance

from .request_status import DecodeStatus


@dataclass(frozen=True, slots=True)
class Lease:
    """What a writer into a reservation's blocks holds: valid while the pool's blocks carry ``owner``."""

    reservation_id: str
    generation: int
    owner: int               # the pool owner token of this generation's blocks


@dataclass(slots=True)
class TransferAttempt:
    """Chunk bookkeeping for one generation of a reservation."""

    generation: int
    owner: int                                      # pool owner token of the blocks for this generation
    state: TransferState = TransferState.BOOTSTRAPPING
    received: dict[int, tuple[int, int]] = field(default_factory=dict)  # chunk index -> token range
    landing: set[int] = field(default_factory=set)   # chunk indices being received in place (bulk path)
    total_chunks: int | None = None
    first_token: int | None = None
    first_logprobs: pb.TokenLogprobs | None = None  # the final chunk's, when the request asked for logprobs
    choice_first_tokens: list[int] = field(default_factory=list)   # n > 1: choices 1..n-1's first tokens
    choice_first_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)   # and theirs (when asked)
    token_digest: str = ""
    model_fingerprint: str = ""
    rope_delta: int | None = None                   # the final chunk's (None: it carried none)
    prefill_ms: float | None = None
    bytes_received: int = 0
    window_trimmed: bool = False                    # a chunk left out sliding layers' older KV: never cached
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
    attempt: TransferAttempt     # the current generation; replaced by ``rearm``
    rope_delta: int = 0          # the sequence's M-RoPE offset, as reserved (0 for 1-D families)
    prefix_keys: list[bytes] = field(default_factory=list)  # one per full prompt block (prefix_keys.py)
    shared: int = 0              # leading blocks of ``blocks`` that are cached (referenced, never written)
    keys_verified: bool = False  # the decode worker recomputed ``prefix_keys`` from the prompt: cacheable
    block_size: int = 16
    state_slot: int | None = None   # hybrid decoders: the linear-attention state slot (freed with the blocks)
    forks: list[list[int]] = field(default_factory=list)   # choice i > 0's own blocks at i - 1 ([] once freed)
    rings: list[list[list[int]]] = field(default_factory=list)   # windowed pool: choice i's rings at i ([] once freed)
    retired: set[int] = field(default_factory=set)         # choices whose sequence retired (each once)
    cache_tokens: int = 0        # the most prompt KV any retired choice had written (what release may cache)
    prompt_here: bool = False    # colocated: this worker prefills the prompt (the gateway asked to reuse a prefix)
    created_at: float = field(default_factory=time.monotonic)
    _status: DecodeStatus = field(default=DecodeStatus.RESERVED, init=False)   # ReservationTable moves it

    @property
    def status(self) -> DecodeStatus:
        return self._status

    @property
    def owned(self) -> list[int]:
        """The blocks this reservation allocated (its owner token's); the rest are shared cached ones."""
        return (self.blocks[self.shared:] + [b for fork in self.forks for b in fork]
                + [p for rings in self.rings for ring in rings for p in ring])

    @property
    def choices(self) -> int:
        return 1 + len(self.forks)

    @property
    def full_prompt_blocks(self) -> int:
        """``F``: the leading blocks every choice shares (whole prompt blocks, never written after the prompt)."""
        return self.prompt_tokens // self.block_size

    def choice_blocks(self, index: int) -> list[int]:
        """Choice ``index``'s block table: ``blocks`` for 0, the shared full prompt blocks + its fork for the others."""
        return self.blocks if index == 0 else self.blocks[: self.full_prompt_blocks] + self.forks[index - 1]

    def choice_rings(self, index: int) -> list[list[int]] | None:
        """Choice ``index``'s rings on a windowed pool (each choice writes its own), else ``None``."""
        return self.rings[index] if self.rings else None

    @property
    def cached_tokens(self) -> int:
        """Prompt positions whose KV is already in the shared blocks (computed by no one for this request)."""
        return self.shared * self.block_size

    @property
    def generation(self) -> int:
        return self.attempt.generation

    @property
    def lease(self) -> Lease:
        return Lease(self.reservation_id, self.attempt.generation, self.attempt.owner)

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still this reservation's live generation (not released, not re-armed)."""
        return self.status is not DecodeStatus.RELEASED and self.attempt.owner == lease.owner

    @property
    def before_insertion(self) -> bool:
        """Blocks held for a request not yet in the batch (what the lease reaper may free)."""
        return self.status < DecodeStatus.INSERTED

    @property
    def pending_chunks(self) -> int:
        """Chunks landed but not yet handed to the running batch."""
        return len(self.attempt.received) if self.before_insertion else 0


class Fit(Enum):
    """``ReservationTable.can_reserve``'s answer."""

    NOW = "now"                   # the blocks are free: ``reserve`` takes them
    NO_ROOM = "no room"           # not now: too few blocks free
    NEVER = "never"               # more blocks than the whole pool


class AttachRefused(Enum):
    """Why ``ReservationTable.attach`` did not attach a Generate."""

    GONE = "no such reservation (released or expired)"
    GENERATING = "reservation already generating"
    STALE_GENERATION = "stale reservation generation"
    ATTACHED = "another Generate is attached to this reservation"


class ReservationTable:
    def __init__(self, pool: KVBlockPool, lease_margin_s: float = 10.0, max_lease_s: float = 300.0,
                 states: StateSlotPool | None = None):
        if max_lease_s <= 0:
            raise ValueError(f"max_lease_s must be > 0, got {max_lease_s}")
        self.pool = pool
        self.states = states
        self.lease_margin_s = lease_margin_s
        self.max_lease_s = max_lease_s
        self._by_id: dict[str, Reservation] = {}
        self._ids = itertools.count(1)
        self.reaped_total = 0        # released by the lease reaper: a leak somebody else should have freed

    # -- check, then commit -----------------------------------------------------
    def blocks_needed(self, prompt_tokens: int, max_tokens: int, choices: int = 1) -> int:
        """The prompt's blocks once, plus each further choice's own (its partial prompt block and output),
        plus every choice's rings on a windowed pool (the policy's formula: admission counts the same)."""
        return kv_blocks_needed(prompt_tokens, max_tokens, choices, self.pool.block_size,
                                self.pool.groups.window_groups, self.pool.ring_blocks_max)

    def can_reserve(self, prompt_tokens: int, max_tokens: int, choices: int = 1) -> Fit:
        """Whether ``reserve`` would get its blocks now; no side effect."""
        blocks = self.blocks_needed(prompt_tokens, max_tokens, choices)
        if blocks > self.pool.num_blocks or (self.states is not None and (self.states.num_slots == 0 or choices > 1)):
            return Fit.NEVER
        if self.states is not None and self.states.free_slots == 0:
            return Fit.NO_ROOM
        return Fit.NOW if blocks <= self.pool.available_blocks else Fit.NO_ROOM

    def reserve(self, request_id: str, prompt_tokens: int, max_tokens: int, deadline_s: float,
                token_digest: str, model_fingerprint: str, rope_delta: int = 0, *,
                prefix_keys: list[bytes] | None = None, reuse_prefix: bool = False,
                choices: int = 1, prompt_here: bool = False) -> Reservation | None:
        """Allocate destination blocks now, or return ``None`` (nothing taken).

        ``reuse_prefix``: start the block table with the cached blocks of the longest cached chain
        of ``prefix_keys`` (at most ``(prompt_tokens - 1) // block_size``: the last prompt token is
        always computed, for the first token's logits), and allocate only the rest.

        The lease ends at ``min(deadline_s, now + max_lease_s) + lease_margin_s``: a caller
        cannot hold blocks longer than the cap by sending a far-future deadline."""
        started = time.perf_counter()
        keys = list(prefix_keys or [])[: prompt_tokens // self.pool.block_size]
        if self.states is not None:
            keys = []     # hybrid: no prefix reuse or caching (no linear state is saved at block boundaries)
        shared = self.pool.acquire(keys[: (prompt_tokens - 1) // self.pool.block_size]) if reuse_prefix else []
        slot = None
        if self.states is not None:
            slot = self.states.allocate()
            if slot is None:
                self.pool.unref(shared)
                return None
        owner = self.pool.new_token()
        one = self.pool.blocks_for(prompt_tokens + max_tokens)
        per_fork = one - prompt_tokens // self.pool.block_size
        owned = self.pool.allocate_blocks(self.blocks_needed(prompt_tokens, max_tokens, choices) - len(shared), owner)
        if owned is None:
            self.pool.unref(shared)
            if slot is not None:
                self.states.free(slot)
            return None
        blocks = shared + owned[: one - len(shared)]
        rest = owned[one - len(shared):]
        forks = [rest[i * per_fork: (i + 1) * per_fork] for i in range(choices - 1)]
        rest = rest[(choices - 1) * per_fork:]
        per_choice = len(rest) // choices    # windowed pool: each choice's rings (none on a dense pool)
        rings = [self.pool.split_rings(rest[i * per_choice: (i + 1) * per_choice], self.pool.ring_blocks(prompt_tokens + max_tokens))
                 for i in range(choices)] if self.pool.groups.windowed else []
        lease_end = min(deadline_s, time.monotonic() + self.max_lease_s)
        res = Reservation(
            request_id=request_id,
            reservation_id=f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            blocks=blocks,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            token_digest=token_digest,
            model_fingerprint=model_fingerprint,
            lease_expires_at=lease_end + self.lease_margin_s,
            alloc_ms=(time.perf_counter() - started) * 1000,
            attempt=TransferAttempt(generation=1, owner=owner),
            rope_delta=rope_delta,
            prefix_keys=keys,
            shared=len(shared),
            block_size=self.pool.block_size,
            state_slot=slot,
            forks=forks,
            rings=rings,
            prompt_here=prompt_here,
        )
        res.attempt.set_state(TransferState.WAITING_FOR_INPUT)  # block map is published with the reply
        self._by_id[res.reservation_id] = res
        return res

    def get(self, reservation_id: str) -> Reservation | None:
        """The live reservation (never a released one), to read; its status changes only through this table."""
        return self._by_id.get(reservation_id)

    def transfer_state(self, reservation_id: str) -> TransferState | None:
        """The current attempt's transfer state; ``None`` when no live reservation has that id."""
        res = self._by_id.get(reservation_id)
        return None if res is None else res.attempt.state

    def attach(self, reservation_id: str, generation: int) -> Reservation | AttachRefused:
        """RESERVED -> RECEIVING: one Generate per generation, and none once the sequence is inserted."""
        res = self._by_id.get(reservation_id)
        if res is None:
            return AttachRefused.GONE
        if not res.before_insertion:
            return AttachRefused.GENERATING
        if generation != res.generation:
            return AttachRefused.STALE_GENERATION
        if res.status is DecodeStatus.RECEIVING:
            return AttachRefused.ATTACHED
        res._status = DecodeStatus.RECEIVING
        return res

    def mark_inserted(self, lease: Lease) -> bool:
        """RECEIVING -> INSERTED, only while ``lease`` is the reservation's live generation (else nothing
        changes and the caller must not insert). From here only the sequence's retirement frees the blocks."""
        res = self._by_id.get(lease.reservation_id)
        if res is None or not res.holds(lease) or res.status is not DecodeStatus.RECEIVING:
            return False
        res._status = DecodeStatus.INSERTED
        return True

    def rearm(self, reservation_id: str) -> Reservation | None:
        """New transfer attempt (generation + 1) into the same blocks, back to RESERVED; stale chunks will
        be rejected. ``None`` when the reservation is gone or already inserted."""
        res = self._by_id.get(reservation_id)
        if res is None or not res.before_insertion:
            return None
        res.attempt.done.set()  # wake anyone waiting on the old attempt
        owner = self.pool.new_token()
        self.pool.retag(res.owned, res.attempt.owner, owner)   # the old generation's writes are fenced
        res.attempt = TransferAttempt(generation=res.generation + 1, owner=owner)
        res.attempt.set_state(TransferState.WAITING_FOR_INPUT)
        if res.state_slot is not None:
            self.states.reset(res.state_slot)   # no state of the failed attempt survives into the next
        res._status = DecodeStatus.RESERVED
        return res

    def release(self, reservation_id: str, reason: str = "", cache_tokens: int = 0) -> bool:
        """Free blocks and chunk bookkeeping exactly once. Returns whether this call freed them.

        ``cache_tokens``: leading prompt positions whose KV is written (the retiring sequence's);
        the full blocks among them with verified keys go to the prefix cache instead of FREE."""
        res = self._by_id.pop(reservation_id, None)
        if res is None:
            return False
        res._status = DecodeStatus.RELEASED
        if not res.attempt.state.terminal:
            res.attempt.set_state(TransferState.FAILED, reason or "released")
        res.attempt.received.clear()
        res.attempt.landing.clear()
        res.attempt.done.set()
        # KV that arrived with its sliding layers trimmed to the window cannot serve another prompt's prefix
        cacheable = res.keys_verified and not res.attempt.window_trimmed
        keep = min(cache_tokens // self.pool.block_size, len(res.prefix_keys)) if cacheable else 0
        keep = max(keep, res.shared)
        owned, owner = res.owned, res.attempt.owner
        self.pool.check_owner(owned, owner, "free")      # nothing changes on a mismatch
        self.pool.cache(res.blocks[res.shared: keep], res.prefix_keys[res.shared: keep], owner)
        self.pool.free(res.blocks[keep:], owner=owner)
        for i, fork in enumerate(res.forks):
            self.pool.free(fork, owner=owner)
            res.forks[i] = []
        for i, rings in enumerate(res.rings):
            self.pool.free([p for ring in rings for p in ring], owner=owner)
            res.rings[i] = []
        self.pool.unref(res.blocks[: res.shared])
        if res.state_slot is not None:
            self.states.free(res.state_slot)
        return True

    def retire_choice(self, lease: Lease, index: int, reason: str = "", cache_tokens: int = 0) -> bool:
        """Choice ``index``'s sequence retired (once per choice; only while ``lease`` is live): its fork's
        blocks are freed now, and the last choice to retire releases the reservation. Whether this call freed."""
        res = self._by_id.get(lease.reservation_id)
        if res is None or not res.holds(lease) or index in res.retired or not 0 <= index < res.choices:
            return False
        res.retired.add(index)
        res.cache_tokens = max(res.cache_tokens, cache_tokens)
        if len(res.retired) == res.choices:
            return self.release(lease.reservation_id, reason, res.cache_tokens)
        if index > 0:
            self.pool.free(res.forks[index - 1], owner=res.attempt.owner)
            res.forks[index - 1] = []
            if res.rings:
                self.pool.free([p for ring in res.rings[index] for p in ring], owner=res.attempt.owner)
                res.rings[index] = []
        return True

    def release_lease(self, lease: Lease, reason: str = "", cache_tokens: int = 0) -> bool:
        """``release`` only if ``lease`` is still the reservation's live generation: a holder of a
        stale lease never frees blocks that a later generation (or another request) holds."""
        res = self._by_id.get(lease.reservation_id)
        return res is not None and res.holds(lease) and self.release(lease.reservation_id, reason, cache_tokens)

    def release_all(self, reason: str) -> int:
        """Release every reservation (the worker is stopping); returns how many this call freed."""
        return sum(self.release(rid, reason) for rid in list(self._by_id))

    def expired(self, now: float | None = None) -> list[Reservation]:
        now = time.monotonic() if now is None else now
        return [r for r in self._by_id.values() if r.before_insertion and r.lease_expires_at < now]

    def reap_expired(self, now: float | None = None) -> list[Reservation]:
        """Release every reservation whose lease has ended (never an inserted one); counted."""
        reaped = [r for r in self.expired(now) if self.release(r.reservation_id, "lease expired")]
        self.reaped_total += len(reaped)
        return reaped

    # -- gauges -----------------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self._by_id)

    @property
    def waiting(self) -> int:
        """Reservations whose request is not in the batch yet (reserved, or receiving its KV)."""
        return sum(r.before_insertion for r in self._by_id.values())

    @property
    def prompts_on_the_way(self) -> int:
        """Colocated reservations whose prompt has not reached the scheduler yet (its Generate not
        here, or its images still being encoded or fetched)."""
        return sum(r.before_insertion and r.prompt_here for r in self._by_id.values())

    @property
    def pending_chunks(self) -> int:
        return sum(r.pending_chunks for r in self._by_id.values())
