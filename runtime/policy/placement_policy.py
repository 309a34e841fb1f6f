"""Per-request placement, admission and transfer-failure policy (pure functions).

The gateway and the simulator both call these functions with a ``CostModel`` and
snapshots of stage load; nothing here does I/O or keeps state.

Placements:

- ``colocated``: prefill runs on decode worker X between its decode steps, then the
  sequence joins X's batch. TTFT = X's queued local work + prefill. Every sequence
  already running on X waits out the prefill: its next inter-token gap is
  ``prefill + step`` (or ``chunk + step`` per chunk when prefill is chunked).
- ``disaggregated`` (remote): prefill on P, KV over the link P -> X (after prefill,
  or chunk by chunk so the transfer overlaps prefill), then one decode step on X
  before the first token. TTFT = P's queue + prefill + transfer (behind the link's
  queue) + X's slot wait + one step.
- ``conditional``: per request, the option that harms fewer requests' SLOs, then
  the cheaper one. Harm ("damage") counts this request if its TTFT estimate
  misses the deadline, plus, for colocated, every running neighbour whose next
  gap would breach the ITL SLO. Cost in ms is the TTFT, plus for colocated the
  interference ``neighbours x stall`` summed over SLO-breaching gaps (a stall that
  keeps every gap within the SLO costs nothing). So a long prompt beside busy
  decoders goes remote (the chapter's 8 neighbours x 230 ms stall against a
  95 ms transfer), and under low load the transfer buys nothing and colocated wins.

Reasons are short, label-safe strings (see ``REASONS``). The dataclasses here are
plain (not frozen: construction is on every request's path) but are snapshots:
treat them as read-only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from runtime.policy.cost_model import CostModel

Mode = Literal["colocated", "disaggregated", "conditional"]
MODES: tuple[str, ...] = ("colocated", "disaggregated", "conditional")
COLOCATED, REMOTE = "colocated", "disaggregated"

REASONS: tuple[str, ...] = (
    "forced",  # mode colocated / disaggregated
    "only_option",  # the other placement has no worker
    "short_prompt_low_load",  # colocated: its stall breaches nobody's ITL SLO
    "remote_misses_deadline",  # colocated: only it meets this request's TTFT deadline
    "stall_cheaper_than_transfer",  # colocated although a neighbour breaches (remote is no better)
    "long_prompt_busy_decoders",  # remote: colocated would breach the neighbours' ITL SLO
    "local_misses_deadline",  # remote: only it meets this request's TTFT deadline
    "local_queue_slower",  # remote: equal harm, lower TTFT
)


@dataclass(slots=True)
class RequestShape:
    """What placement needs to know about one request.

    ``prompt_tokens`` counts every token prefill processes (image tokens included).
    """

    prompt_tokens: int
    max_tokens: int
    n_images: int = 0
    n_images_cached: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.n_images_cached <= self.n_images:
            raise ValueError(f"need 0 <= n_images_cached <= n_images, got {self.n_images_cached}/{self.n_images}")


@dataclass(slots=True)
class EncoderLoad:
    """The encoder pool: wait until the least-loaded encoder could start."""

    queue_wait_ms: float = 0.0


@dataclass(slots=True)
class PrefillWorkerLoad:
    address: str
    queue_wait_ms: float = 0.0  # until this worker could start a new prompt
    cached_prefix_tokens: int = 0  # of this request's prompt already in its prefix cache


@dataclass(slots=True)
class DecodeWorkerLoad:
    """One decode worker. ``running_seqs`` are the neighbours a local prefill would stall."""

    address: str
    running_seqs: int = 0
    free_slots: int = 1  # batch slots neither running, reserved nor promised to queued requests
    free_blocks: int | None = None  # free KV blocks; None: not reported (no block check)
    block_size: int = 16  # tokens per KV block
    queue_wait_ms: float = 0.0  # local prefill work already queued on this worker
    slot_wait_ms: float = 0.0  # until a slot frees, when free_slots == 0
    cached_prefix_tokens: int = 0  # of this request's prompt already cached here
    accepts_local_prefill: bool = True  # False: a pure decode worker (no colocated option)

    def __post_init__(self) -> None:
        if self.running_seqs < 0 or self.block_size < 1:
            raise ValueError(f"bad decode load for {self.address}: running_seqs >= 0 and block_size >= 1")
        if self.queue_wait_ms < 0 or self.slot_wait_ms < 0:
            raise ValueError(f"negative wait in decode load for {self.address}")


@dataclass(slots=True)
class LinkLoad:
    """The KV link. A new transfer waits for ``queued_bytes`` (FIFO, ahead of it) and
    shares bandwidth with ``active_transfers`` that still have ``inflight_bytes`` to move."""

    active_transfers: int = 0
    inflight_bytes: float = 0.0
    queued_bytes: float = 0.0


@dataclass(slots=True)
class StageLoads:
    """Snapshot of every stage. ``encoder`` is None when encoding is done or not needed."""

    decode: tuple[DecodeWorkerLoad, ...]
    prefill: tuple[PrefillWorkerLoad, ...] = ()
    link: LinkLoad = field(default_factory=LinkLoad)
    encoder: EncoderLoad | None = None


@dataclass(slots=True)
class LocalEstimate:
    worker: str
    ttft_ms: float
    gap_ms: float  # largest inter-token gap the neighbours see
    interference_ms: float  # neighbours x stall, over SLO-breaching gaps only
    breached: int  # neighbours whose ITL SLO the prefill breaks


@dataclass(slots=True)
class RemoteEstimate:
    prefill_worker: str
    decode_worker: str
    ttft_ms: float
    transfer_ms: float


@dataclass(slots=True)
class PlacementDecision:
    placement: str  # "colocated" | "disaggregated"
    decode_worker: str
    prefill_worker: str | None  # None for colocated
    reason: str  # one of REASONS
    estimates: dict[str, float]  # always "ttft_ms"; "local_*" / "remote_*" where evaluated


@dataclass(slots=True)
class Admission:
    ok: bool
    decision: PlacementDecision | None  # None when refused
    reason: str  # the decision's reason when admitted, else the refusal's
    retry_after_s: int  # 0 when admitted, else >= 1


@dataclass(slots=True)
class FailureAction:
    kind: Literal["retry", "other_decode", "reprefill", "fail"]
    reason: str
    cost_ms: float  # estimated time to first token of the chosen action (inf for fail)


# ---- estimates --------------------------------------------------------------------


def blocks_needed(shape: RequestShape, block_size: int) -> int:
    return -(-(shape.prompt_tokens + shape.max_tokens) // block_size)


def has_capacity(shape: RequestShape, worker: DecodeWorkerLoad) -> bool:
    """Whether ``worker`` has the KV blocks for this request now (True when it reports none)."""
    return worker.free_blocks is None or worker.free_blocks >= blocks_needed(shape, worker.block_size)


def estimate_encode_ms(shape: RequestShape, encoder: EncoderLoad | None, cm: CostModel) -> float:
    if encoder is None or shape.n_images == 0:
        return 0.0
    return encoder.queue_wait_ms + cm.encode_ms(shape.n_images, shape.n_images_cached)


def link_share(nbytes: float, link: LinkLoad) -> float:
    """Fraction of the link's bandwidth a new transfer effectively gets: it waits for the
    queued bytes, then shares with the active transfers (each delays it by at most its own size)."""
    if nbytes <= 0:
        return 1.0
    competing = link.queued_bytes
    if link.active_transfers > 0:
        sharing = link.active_transfers * nbytes
        competing += link.inflight_bytes if link.inflight_bytes < sharing else sharing
    return nbytes / (nbytes + competing)


def estimate_local(
    shape: RequestShape,
    worker: DecodeWorkerLoad,
    cm: CostModel,
    itl_slo_ms: float,
    *,
    local_chunk_tokens: int | None = None,
    encode_ms: float = 0.0,
) -> LocalEstimate:
    """Colocated on ``worker``: its TTFT and the stall its running neighbours absorb."""
    prompt_ms = cm.prefill_ms(shape.prompt_tokens)
    return _best_local(shape, (worker,), cm, itl_slo_ms, math.inf, local_chunk_tokens, encode_ms, prompt_ms)


def estimate_remote(
    shape: RequestShape,
    prefill: PrefillWorkerLoad,
    decode: DecodeWorkerLoad,
    link: LinkLoad,
    cm: CostModel,
    *,
    transfer_chunk_tokens: int | None = None,
    encode_ms: float = 0.0,
) -> RemoteEstimate:
    """Remote prefill on ``prefill``, KV over the link, first token from ``decode``."""
    prompt_ms = cm.prefill_ms(shape.prompt_tokens)
    return _best_remote(shape, (prefill,), link, (decode,), cm, transfer_chunk_tokens, encode_ms, prompt_ms)


def _remote_landed(
    shape: RequestShape,
    prefill: PrefillWorkerLoad,
    decode_cached_tokens: int,
    link: LinkLoad,
    cm: CostModel,
    transfer_chunk_tokens: int | None,
    encode_ms: float,
    prompt_prefill_ms: float,
) -> tuple[float, float]:
    """(when the KV has landed on the decode side, the transfer's own duration).
    ``prompt_prefill_ms`` is ``cm.prefill_ms(shape.prompt_tokens)``, computed once per request."""
    tokens = shape.prompt_tokens - prefill.cached_prefix_tokens
    if tokens < 1:
        tokens = 1
    kv_tokens = shape.prompt_tokens - decode_cached_tokens
    nbytes = cm.kv_bytes(kv_tokens if kv_tokens > 0 else 0)
    share = link_share(nbytes, link)
    start = encode_ms if encode_ms > prefill.queue_wait_ms else prefill.queue_wait_ms
    transfer = cm.transfer_ms(nbytes, share)
    if transfer_chunk_tokens is not None and tokens > transfer_chunk_tokens:
        return start + cm.transfer_done_ms(tokens, transfer_chunk_tokens, share), transfer
    prefill_ms = cm.prefill_ms(tokens) if prefill.cached_prefix_tokens else prompt_prefill_ms
    return start + prefill_ms + transfer, transfer


# ---- placement --------------------------------------------------------------------


def choose_placement(
    shape: RequestShape,
    loads: StageLoads,
    cost_model: CostModel,
    mode: Mode,
    ttft_deadline_ms: float,
    itl_slo_ms: float,
    *,
    transfer_chunk_tokens: int | None = None,
    local_chunk_tokens: int | None = None,
) -> PlacementDecision | None:
    """Pick colocated-on-X or remote P -> X; None when no decode worker has the KV blocks.

    ``ttft_deadline_ms`` is the time left until the TTFT deadline. A forced mode
    falls back to the other placement only when its own has no worker
    (reason ``only_option``). Decode workers are compared by harm, then cost;
    ties go to the worker with more free slots, then fewer running sequences.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not itl_slo_ms > 0:
        raise ValueError(f"itl_slo_ms must be > 0, got {itl_slo_ms}")
    forced_remote = mode == REMOTE and bool(loads.prefill)
    decode: list[DecodeWorkerLoad] = []  # the workers with the KV blocks this request needs
    local_capable: list[DecodeWorkerLoad] = []  # ... that may also prefill it (colocated)
    for w in loads.decode:
        if w.free_blocks is None or has_capacity(shape, w):
            decode.append(w)
            if w.accepts_local_prefill and not forced_remote:
                local_capable.append(w)
    if not decode:
        return None
    enc = 0.0 if loads.encoder is None else estimate_encode_ms(shape, loads.encoder, cost_model)
    local = remote = None
    prompt_ms = cost_model.prefill_ms(shape.prompt_tokens)  # shared by every worker without a cached prefix
    if local_capable:
        local = _best_local(shape, local_capable, cost_model, itl_slo_ms, ttft_deadline_ms, local_chunk_tokens, enc, prompt_ms)
    if loads.prefill and (mode != COLOCATED or not local_capable):
        remote = _best_remote(shape, loads.prefill, loads.link, decode, cost_model, transfer_chunk_tokens, enc, prompt_ms)
    if local is None and remote is None:
        return None
    if local is None or remote is None:
        chosen: LocalEstimate | RemoteEstimate = local if remote is None else remote  # type: ignore[assignment]
        placement = COLOCATED if remote is None else REMOTE
        return _decision(chosen, "forced" if mode == placement else "only_option", local, remote)
    local_miss = local.ttft_ms > ttft_deadline_ms
    remote_miss = remote.ttft_ms > ttft_deadline_ms
    local_harm = local_miss + local.breached
    if remote_miss < local_harm or (remote_miss == local_harm and remote.ttft_ms < local.ttft_ms + local.interference_ms):
        if local.breached:
            reason = "long_prompt_busy_decoders"
        else:
            reason = "local_misses_deadline" if local_miss and not remote_miss else "local_queue_slower"
        return _decision(remote, reason, local, remote)
    if local.breached:
        reason = "stall_cheaper_than_transfer"
    else:
        reason = "remote_misses_deadline" if remote_miss and not local_miss else "short_prompt_low_load"
    return _decision(local, reason, local, remote)


def _best_local(
    shape: RequestShape,
    workers: Sequence[DecodeWorkerLoad],
    cm: CostModel,
    itl_slo_ms: float,
    ttft_deadline_ms: float,
    local_chunk_tokens: int | None,
    encode_ms: float,
    prompt_prefill_ms: float,
) -> LocalEstimate:
    """The worker with the least harm (own deadline miss + neighbours breached), then cost.

    On one worker: TTFT is its queued local work (or slot wait) plus the prefill; each
    running neighbour's next gap is prefill + step (chunked: chunk + step, per chunk).
    ``prompt_prefill_ms`` is ``cm.prefill_ms(shape.prompt_tokens)``, computed once per request.
    """
    best: tuple[float, float, float, int] | None = None
    best_w, best_cost = None, 0.0
    for w in workers:
        cached = w.cached_prefix_tokens
        tokens = shape.prompt_tokens - cached
        if tokens < 1:
            tokens = 1
        start = w.queue_wait_ms + (w.slot_wait_ms if w.free_slots <= 0 else 0.0)
        if encode_ms > start:
            start = encode_ms
        n = w.running_seqs
        if local_chunk_tokens is not None and tokens > local_chunk_tokens:
            step = cm.decode_step_ms(n) if n else 0.0
            total = gap = interference = 0.0
            for c in cm.chunk_times(tokens, local_chunk_tokens):
                total += c + step
                if n and c + step > gap:
                    gap = c + step
                if n and c + step > itl_slo_ms:
                    interference += n * c
        else:
            total = cm.prefill_ms(tokens) if cached else prompt_prefill_ms
            gap = total + cm.decode_step_ms(n + 1) if n else 0.0
            interference = n * total if gap > itl_slo_ms else 0.0
        ttft, breached = start + total, n if gap > itl_slo_ms else 0
        harm = (ttft > ttft_deadline_ms) + breached
        # harm dominates: add a cost far larger than any TTFT difference per unit of harm
        cost = harm * 1e9 + ttft + interference
        if best_w is None or _better(cost, w, best_cost, best_w):
            best, best_w, best_cost = (ttft, gap, interference, breached), w, cost
    return LocalEstimate(best_w.address, *best)  # type: ignore[union-attr, misc]  # workers is non-empty


def _best_remote(
    shape: RequestShape,
    prefill_workers: Sequence[PrefillWorkerLoad],
    link: LinkLoad,
    decode: Sequence[DecodeWorkerLoad],
    cm: CostModel,
    transfer_chunk_tokens: int | None,
    encode_ms: float,
    prompt_prefill_ms: float,
) -> RemoteEstimate:
    """The prefill worker that finishes soonest, then the decode worker with the lowest TTFT.

    A landed sequence is inserted once a slot is reserved, at the next step boundary (it
    does not wait for the worker's local prefill queue); then one step makes its first token.
    """
    prefill, soonest = prefill_workers[0], math.inf
    for p in prefill_workers if len(prefill_workers) > 1 else ():  # one worker is the soonest
        cached = p.cached_prefix_tokens
        done = p.queue_wait_ms + (cm.prefill_ms(shape.prompt_tokens - cached) if cached else prompt_prefill_ms)
        if done < soonest:
            prefill, soonest = p, done
    chunk = transfer_chunk_tokens
    common = _remote_landed(shape, prefill, 0, link, cm, chunk, encode_ms, prompt_prefill_ms)
    best_w, best_ttft, best_transfer = None, 0.0, 0.0
    for w in decode:
        if w.cached_prefix_tokens:  # this worker already holds part of the KV: less to send
            at, transfer = _remote_landed(shape, prefill, w.cached_prefix_tokens, link, cm, chunk, encode_ms, prompt_prefill_ms)
        else:
            at, transfer = common
        if w.free_slots <= 0 and w.slot_wait_ms > at:
            at = w.slot_wait_ms
        ttft = at + cm.decode_step_ms(w.running_seqs + 1)
        if best_w is None or _better(ttft, w, best_ttft, best_w):
            best_w, best_ttft, best_transfer = w, ttft, transfer
    return RemoteEstimate(prefill.address, best_w.address, best_ttft, best_transfer)  # type: ignore[union-attr]


_TIE_MS = 1e-3  # estimates closer than this are a tie


def _better(cost: float, w: DecodeWorkerLoad, best_cost: float, best_w: DecodeWorkerLoad | None) -> bool:
    """Lower cost wins; a tie goes to more free slots, then fewer running sequences."""
    if best_w is None or cost < best_cost - _TIE_MS:
        return True
    return cost <= best_cost + _TIE_MS and _tie_better(w, best_w)


def _tie_better(w: DecodeWorkerLoad, other: DecodeWorkerLoad) -> bool:
    if w.free_slots != other.free_slots:
        return w.free_slots > other.free_slots
    return w.running_seqs < other.running_seqs


def _decision(
    chosen: LocalEstimate | RemoteEstimate, reason: str, local: LocalEstimate | None, remote: RemoteEstimate | None
) -> PlacementDecision:
    estimates = {"ttft_ms": chosen.ttft_ms}
    if local is not None:
        estimates["local_ttft_ms"] = local.ttft_ms
        estimates["local_gap_ms"] = local.gap_ms
        estimates["local_interference_ms"] = local.interference_ms
        estimates["local_breached"] = float(local.breached)
    if remote is not None:
        estimates["remote_ttft_ms"] = remote.ttft_ms
        estimates["remote_transfer_ms"] = remote.transfer_ms
    if isinstance(chosen, LocalEstimate):
        return PlacementDecision(COLOCATED, chosen.worker, None, reason, estimates)
    return PlacementDecision(REMOTE, chosen.decode_worker, chosen.prefill_worker, reason, estimates)


# ---- admission --------------------------------------------------------------------


def retry_after_s(wait_ms: float) -> int:
    """Whole seconds a client should wait for ``wait_ms`` of queue to drain (>= 1)."""
    if not math.isfinite(wait_ms):
        return 60
    return max(1, math.ceil(wait_ms / 1000.0))


def admit(
    shape: RequestShape,
    loads: StageLoads,
    cost_model: CostModel,
    mode: Mode,
    ttft_deadline_ms: float,
    itl_slo_ms: float,
    *,
    transfer_chunk_tokens: int | None = None,
    local_chunk_tokens: int | None = None,
) -> Admission:
    """Place the request, or refuse it before any work is done (side-effect free).

    Refusals: ``no_decode_workers``; ``no_decode_capacity`` (no decode worker has
    the KV blocks it needs; retry after the soonest slot frees); ``ttft_deadline``
    (the best placement's estimated TTFT exceeds the time left; retry after the
    excess drains). ``retry_after_s`` is at least 1.
    """
    if not loads.decode:
        return Admission(False, None, "no_decode_workers", retry_after_s(0.0))
    decision = choose_placement(
        shape, loads, cost_model, mode, ttft_deadline_ms, itl_slo_ms,
        transfer_chunk_tokens=transfer_chunk_tokens, local_chunk_tokens=local_chunk_tokens,
    )
    if decision is None:
        return Admission(False, None, "no_decode_capacity", retry_after_s(min(w.slot_wait_ms for w in loads.decode)))
    excess = decision.estimates["ttft_ms"] - ttft_deadline_ms
    if excess > 0:
        return Admission(False, None, "ttft_deadline", retry_after_s(excess))
    return Admission(True, decision, decision.reason, 0)


# ---- transfer failure -------------------------------------------------------------


def on_transfer_failure(
    remaining_ms: float,
    reservation_held: bool,
    attempts: int,
    shape: RequestShape,
    cost_model: CostModel,
    other_decode_available: bool,
    prefill_free: bool,
    *,
    max_attempts: int = 3,
    link: LinkLoad | None = None,
    prefill_wait_ms: float = 0.0,
    decode_batch: int = 1,
) -> FailureAction:
    """What to do after transfer attempt number ``attempts`` failed, ``remaining_ms`` before the deadline.

    In order: retry into the held reservation (costs a transfer, behind the link's
    queue, plus a decode step); re-reserve on another decode worker and retry
    (same cost); re-prefill (prefill + transfer + step, plus the prefill queue
    unless a worker is free); otherwise fail. Bounded: after ``max_attempts``
    transfer attempts the request fails. The caller releases what the action gives up.
    """
    if attempts < 1 or max_attempts < 1:
        raise ValueError(f"attempts and max_attempts must be >= 1, got {attempts}, {max_attempts}")
    if attempts >= max_attempts:
        return FailureAction("fail", "attempts_exhausted", math.inf)
    nbytes = cost_model.kv_bytes(shape.prompt_tokens)
    transfer = cost_model.transfer_ms(nbytes, link_share(nbytes, link or LinkLoad()))
    retry_cost = transfer + cost_model.decode_step_ms(decode_batch)
    if reservation_held and retry_cost <= remaining_ms:
        return FailureAction("retry", "reservation_held_retry_fits", retry_cost)
    if other_decode_available and retry_cost <= remaining_ms:
        return FailureAction("other_decode", "retry_on_other_decode_fits", retry_cost)
    reprefill_cost = (0.0 if prefill_free else prefill_wait_ms) + cost_model.prefill_ms(shape.prompt_tokens) + retry_cost
    if reprefill_cost <= remaining_ms:
        return FailureAction("reprefill", "reprefill_fits", reprefill_cost)
    return FailureAction("fail", "deadline_exhausted", math.inf)
