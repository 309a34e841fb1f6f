"""Per-request placement, admission and transfer-failure policy (pure functions).

The gateway and the simulator both call these functions with a ``CostModel`` and
snapshots of stage load; nothing here does I/O or keeps state.

Placements:

- ``colocated``: prefill runs on decode worker X between its decode steps, then the
  sequence joins X's batch. TTFT = X's queued local work + prefill. When X holds the
  first ``cached_prefix_tokens`` of the prompt as cached KV, it prefills only the rest
  (``CostModel.suffix_prefill_ms``: the new tokens against the whole context) and the
  images wholly inside that prefix are not encoded. Every sequence
  already running on X waits out the prefill: its next inter-token gap is
  ``prefill + step`` (or ``chunk + step`` per chunk when prefill is chunked).
- ``disaggregated`` (remote): prefill on P, KV over the link P -> X (after prefill,
  or chunk by chunk so the transfer overlaps prefill), then one decode step on X
  before the first token. TTFT = P's queue + prefill + transfer (behind the link's
  queue) + X's slot wait + one step. When P computes on X's own cores (one machine, overlapping
  CPUs: ``PrefillWorkerLoad.shared_cores``), P's prompt does not run beside X's queued work but
  takes the cores that work needs: the choice is charged X's queued local work in the share those
  cores are busy (``shared_ms``: all of it on saturated cores, none on idle ones), beside its TTFT;
  for a prompt longer than a chunk, at most its own prefill (X would drain it at the step budget
  across many steps; P computes it in one call, and takes the cores only that long).
  On two cores at 16 concurrent demo requests, remote placements chosen without this charge ("local
  queue slower") cost 17-20% of the throughput that colocating them gives (bench/RESULTS.md). It is
  a cost, not a wait of the request's own: the landed sequence joins X's next step whatever X has
  queued, and counted in its TTFT, a bench-model long prompt behind a queue of colocated long
  prompts was estimated at 10-17 s remote and 20-26 s colocated against a 20 s deadline and
  refused, where the remote prompts admitted beside it had first tokens in 1-3 s. Charged that whole
  queue rather than its own prefill, such a prompt stayed colocated behind it (first tokens in ~10 s
  against ~2 s remote); capped, bench-long served 15% more requests/s. A short prompt rides X's next
  refill step with the queue, so it is charged the whole queue still: capped for every prompt, the
  short ones of bench-long went remote three times as often, at ~2 s first tokens against ~0.75 s.
- ``conditional``: per request, the option that harms fewer requests' SLOs, then
  the cheaper one. Harm ("damage") counts this request if its TTFT estimate
  misses the deadline, plus, for colocated, every running neighbour whose next
  gap would breach the ITL SLO. Cost in ms is the TTFT, plus for colocated the
  interference ``neighbours x stall`` summed over SLO-breaching gaps (a stall that
  keeps every gap within the SLO costs nothing). So a long prompt beside busy
  decoders goes remote (the chapter's 8 neighbours x 230 ms stall against a
  95 ms transfer), and under low load the transfer buys nothing and colocated wins.
  Where the prefill worker is known to compute on other CPUs than the decode worker
  (``PrefillWorkerLoad.apart_from``: both report their cores, none shared), the colocated
  cost counts the stall of every gap, within the SLO too: there the split is the chapter's
  trade exactly (the stall it removes, spread across the neighbours, against the transfer and
  the added queueing), paid from cores the decode step does not use. On two cores with the
  decode step on a core of its own (``epd serve --cpu-bind reserve``), colocating every short
  chat beside 15 decoding neighbours served 8.3 requests/s, this rule 9.4 (it sends them to
  the prefill worker on the other core; bench/RESULTS.md, "One core for the decode step"). GPU
  workers report no cores, so nothing changes there.

Admission (``admit``) places the request, then refuses it when the chosen placement's
TTFT estimate, plus the pipeline's backlog beyond the queue that estimate holds and the
model's recent misprediction (``loads.Pressure``), would miss the deadline.

Reasons are short, label-safe strings (see ``REASONS``). The inputs are built by
``runtime.policy.worker_stats.stage_loads`` from what the workers report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from runtime.policy.cost_model import CostModel
from runtime.policy.loads import DecodeWorkerLoad, EncoderLoad, LinkLoad, PrefillWorkerLoad, Pressure, RequestShape, StageLoads

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
    "stall_on_busy_decoders",  # remote: on cores apart, its extra TTFT is less than the stall colocated puts on the neighbours
)


@dataclass(slots=True)
class LocalEstimate:
    worker: str
    ttft_ms: float
    gap_ms: float  # largest inter-token gap the neighbours see
    interference_ms: float  # neighbours x stall, over SLO-breaching gaps only
    breached: int  # neighbours whose ITL SLO the prefill breaks
    stall_ms: float  # neighbours x stall, over every gap (what a prefill worker apart spares them)
    queue_ms: float = 0.0  # of ttft_ms, the wait before its own prefill starts (queued work, slots, encode)


@dataclass(slots=True)
class RemoteEstimate:
    prefill_worker: str
    decode_worker: str
    ttft_ms: float
    transfer_ms: float
    queue_ms: float = 0.0  # of ttft_ms, the prefill worker's queue it waits out
    shared_ms: float = 0.0  # not of ttft_ms: the decode worker's queued work its prompt takes the cores of


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
    retry_after_s: int  # 0 when admitted, else >= 1 (HTTP ``Retry-After``: whole seconds)
    backlog_ms: float = 0.0  # the pressure's backlog the deadline check added
    overrun_ms: float = 0.0  # ... and its misprediction margin
    estimated_ttft_ms: float = 0.0  # refused on time (ttft_deadline, pipeline_backlog): the best placement's estimate
    estimated_queue_ms: float = 0.0  # ... and the reported queue it holds (``queue_ms``)
    retry_after_ms: float = 0.0  # refused: the wait itself (``retry_wait_ms``; the ``retry-after-ms`` header)


# ---- estimates --------------------------------------------------------------------


def kv_blocks_needed(prompt_tokens: int, max_tokens: int, choices: int, block_size: int,
                     ring_groups: int = 0, ring_blocks: int = 0) -> int:
    """What ``decode_svc/reservations.py`` reserves: the prompt's blocks once, each further choice's own
    (its partial prompt block and output), and on a windowed pool every choice's rings (``ring_groups``
    rings of at most ``ring_blocks`` blocks, never more than the sequence's own blocks)."""
    one = -(-(prompt_tokens + max_tokens) // block_size)
    rings = ring_groups * min(one, ring_blocks)
    return one + (choices - 1) * (one - prompt_tokens // block_size) + choices * rings


def blocks_needed(shape: RequestShape, block_size: int, ring_groups: int = 0, ring_blocks: int = 0) -> int:
    return kv_blocks_needed(shape.prompt_tokens, shape.max_tokens, shape.choices, block_size, ring_groups, ring_blocks)


def has_capacity(shape: RequestShape, worker: DecodeWorkerLoad) -> bool:
    """Whether ``worker`` has the KV blocks for this request now (True when it reports none)."""
    return worker.free_blocks is None or worker.free_blocks >= blocks_needed(
        shape, worker.block_size, worker.ring_groups, worker.ring_blocks)


def estimate_encode_ms(shape: RequestShape, encoder: EncoderLoad | None, cm: CostModel) -> float:
    if encoder is None or shape.n_images == 0:
        return 0.0
    return encoder.queue_wait_ms + cm.encode_ms(shape.new_image_tokens, shape.n_images_cached)


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


def _remote_landed(
    shape: RequestShape, prefill: PrefillWorkerLoad, link: LinkLoad, cm: CostModel, transfer_chunk_tokens: int | None,
    encode_ms: float, prompt_prefill_ms: float,
) -> tuple[float, float]:
    """(when the KV has landed on the decode side, the transfer's own duration).
    ``prompt_prefill_ms`` is ``cm.prefill_ms(shape.prompt_tokens)``, computed once per request."""
    tokens = shape.prompt_tokens
    nbytes = cm.kv_bytes(tokens)
    share = link_share(nbytes, link)
    start = encode_ms if encode_ms > prefill.queue_wait_ms else prefill.queue_wait_ms
    transfer = cm.transfer_ms(nbytes, share)
    if transfer_chunk_tokens is not None and tokens > transfer_chunk_tokens:
        return start + cm.transfer_done_ms(tokens, transfer_chunk_tokens, share), transfer
    return start + prompt_prefill_ms + transfer, transfer


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
    prompt_ms = cost_model.prefill_ms(shape.prompt_tokens)  # shared by every worker
    if local_capable:
        local = _best_local(shape, local_capable, cost_model, itl_slo_ms, ttft_deadline_ms, local_chunk_tokens, enc,
                            prompt_ms, loads.encoder)
    if loads.prefill and (mode != COLOCATED or not local_capable):
        remote = _best_remote(shape, loads.prefill, loads.link, decode, cost_model, transfer_chunk_tokens, enc, prompt_ms,
                              local_chunk_tokens)
    if local is None and remote is None:
        return None
    if local is None or remote is None:
        chosen: LocalEstimate | RemoteEstimate = local if remote is None else remote  # type: ignore[assignment]
        placement = COLOCATED if remote is None else REMOTE
        return _decision(chosen, "forced" if mode == placement else "only_option", local, remote)
    local_miss = local.ttft_ms > ttft_deadline_ms
    remote_miss = remote.ttft_ms > ttft_deadline_ms
    local_harm = local_miss + local.breached
    apart = any(p.address == remote.prefill_worker and local.worker in p.apart_from for p in loads.prefill)
    stall = local.stall_ms if apart else local.interference_ms
    remote_cost = remote.ttft_ms + remote.shared_ms
    if remote_miss < local_harm or (remote_miss == local_harm and remote_cost < local.ttft_ms + stall):
        if local.breached:
            reason = "long_prompt_busy_decoders"
        elif local_miss and not remote_miss:
            reason = "local_misses_deadline"
        else:
            reason = "stall_on_busy_decoders" if remote_cost >= local.ttft_ms + local.interference_ms else "local_queue_slower"
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
    encoder: EncoderLoad | None = None,
) -> LocalEstimate:
    """The worker with the least harm (own deadline miss + neighbours breached), then cost.

    On one worker: TTFT is its queued local work (or slot wait) plus the prefill; each
    running neighbour's next gap is prefill + step (chunked: chunk + step, per chunk).
    ``prompt_prefill_ms`` is ``cm.prefill_ms(shape.prompt_tokens)``, computed once per request.
    A worker with ``cached_prefix_tokens`` prefills only the rest, and encodes only the images
    outside that prefix.
    """
    best: tuple[float, float, float, int, float, float] | None = None
    best_w, best_cost = None, 0.0
    full = shape.prompt_tokens
    for w in workers:
        cached = w.cached_prefix_tokens
        tokens = full - cached
        start = w.queue_wait_ms + (w.slot_wait_ms if w.free_slots < shape.choices else 0.0)
        enc = encode_ms
        if cached and w.cached_images:
            enc = 0.0 if encoder is None else estimate_encode_ms(shape.images_after(w.cached_images), encoder, cm)
        if enc > start:
            start = enc
        n = w.running_seqs
        if local_chunk_tokens is not None and tokens > local_chunk_tokens:
            step = cm.decode_step_ms(n) if n else 0.0
            total = gap = interference = stall = 0.0
            times = cm.suffix_chunk_times(cached, full, local_chunk_tokens) if cached else cm.chunk_times(
                tokens, local_chunk_tokens)
            for c in times:
                total += c + step
                stall += n * c
                if n and c + step > gap:
                    gap = c + step
                if n and c + step > itl_slo_ms:
                    interference += n * c
        else:
            total = cm.suffix_prefill_ms(cached, full) if cached else prompt_prefill_ms
            gap = total + cm.decode_step_ms(n + 1) if n else 0.0
            stall = n * total
            interference = stall if gap > itl_slo_ms else 0.0
        ttft, breached = start + total, n if gap > itl_slo_ms else 0
        harm = (ttft > ttft_deadline_ms) + breached
        # harm dominates: add a cost far larger than any TTFT difference per unit of harm
        cost = harm * 1e9 + ttft + interference
        if best_w is None or _better(cost, w, best_cost, best_w):
            best, best_w, best_cost = (ttft, gap, interference, breached, stall, start), w, cost
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
    local_chunk_tokens: int | None = None,
) -> RemoteEstimate:
    """The prefill worker that finishes soonest, then the decode worker with the lowest TTFT plus
    ``shared_ms``.

    A landed sequence is inserted once a slot is reserved, at the next step boundary (it
    does not wait for the worker's local prefill queue); then one step makes its first token.
    On cores shared with the prefill worker, the prompt takes the cores that queue needs, in the
    share they are busy: ``shared_ms``, a cost of the choice, not a wait of the request's own. A
    prompt longer than a chunk (``local_chunk_tokens``) takes them for its own prefill at most: on
    the decode worker it would drain at the step budget across many steps, on P it is one call.
    """
    prefill, soonest = prefill_workers[0], math.inf
    for p in prefill_workers if len(prefill_workers) > 1 else ():  # one worker is the soonest
        if p.queue_wait_ms < soonest:  # every one prefills the prompt in the same time
            prefill, soonest = p, p.queue_wait_ms
    landed, transfer = _remote_landed(shape, prefill, link, cm, transfer_chunk_tokens, encode_ms, prompt_prefill_ms)
    shared = dict(prefill.shared_cores)
    long = local_chunk_tokens is not None and shape.prompt_tokens > local_chunk_tokens
    best_w, best_ttft, best_shared = None, 0.0, 0.0
    for w in decode:
        at = landed
        busy = shared.get(w.address)
        # w's queued work P's prompt competes with (a long prompt: for as long as it computes)
        queued = min(w.queue_wait_ms, prompt_prefill_ms) if long else w.queue_wait_ms
        taken = busy * queued if busy else 0.0
        if w.free_slots < shape.choices and w.slot_wait_ms > at:
            at = w.slot_wait_ms
        ttft = at + cm.decode_step_ms(w.running_seqs + 1)
        if best_w is None or _better(ttft + taken, w, best_ttft + best_shared, best_w):
            best_w, best_ttft, best_shared = w, ttft, taken
    return RemoteEstimate(prefill.address, best_w.address, best_ttft, transfer,  # type: ignore[union-attr]
                          prefill.queue_wait_ms, best_shared)


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
    estimates = {"ttft_ms": chosen.ttft_ms, "queue_ms": chosen.queue_ms}
    if local is not None:
        estimates["local_ttft_ms"] = local.ttft_ms
        estimates["local_gap_ms"] = local.gap_ms
        estimates["local_interference_ms"] = local.interference_ms
        estimates["local_breached"] = float(local.breached)
    if remote is not None:
        estimates["remote_ttft_ms"] = remote.ttft_ms
        estimates["remote_transfer_ms"] = remote.transfer_ms
        estimates["remote_shared_ms"] = remote.shared_ms
    if isinstance(chosen, LocalEstimate):
        return PlacementDecision(COLOCATED, chosen.worker, None, reason, estimates)
    return PlacementDecision(REMOTE, chosen.decode_worker, chosen.prefill_worker, reason, estimates)


# ---- admission --------------------------------------------------------------------


MIN_RETRY_MS = 100.0   # the least wait a refusal names: a retry sooner would meet the same queue
MAX_RETRY_MS = 60_000.0


def retry_after_s(wait_ms: float) -> int:
    """Whole seconds a client should wait for ``wait_ms`` of queue to drain (>= 1)."""
    if not math.isfinite(wait_ms):
        return 60
    return max(1, math.ceil(wait_ms / 1000.0))


def retry_wait_ms(wait_ms: float) -> float:
    """The wait itself, for clients that read milliseconds (the OpenAI SDKs' ``retry-after-ms``): a queue
    that drains in 0.2 s is not worth a whole second's wait. Between ``MIN_RETRY_MS`` and ``MAX_RETRY_MS``."""
    if not math.isfinite(wait_ms):
        return MAX_RETRY_MS
    return min(MAX_RETRY_MS, max(MIN_RETRY_MS, wait_ms))


def _refused(reason: str, wait_ms: float, **terms: float) -> Admission:
    return Admission(False, None, reason, retry_after_s(wait_ms), retry_after_ms=retry_wait_ms(wait_ms), **terms)


def admit(
    shape: RequestShape,
    loads: StageLoads,
    cost_model: CostModel,
    mode: Mode,
    ttft_deadline_ms: float,
    itl_slo_ms: float,
    *,
    pressure: Pressure | None = None,
    transfer_chunk_tokens: int | None = None,
    local_chunk_tokens: int | None = None,
) -> Admission:
    """Place the request, or refuse it before any work is done (side-effect free).

    Refusals, in order: ``no_decode_workers``; ``no_decode_capacity`` (no decode worker
    has the KV blocks it needs; retry after the soonest slot frees); ``ttft_deadline``
    (the best placement's estimated TTFT exceeds the time left; retry after the excess
    drains); ``pipeline_backlog`` (that estimate plus the ``pressure``'s backlog and
    misprediction margin exceeds it; retry after the overshoot drains). The backlog (the requests admitted
    here and still waiting for a first token, over the rate they get one) and the estimate's own
    queue (``queue_ms``: the queued work the workers last reported ahead of it) are two measures of
    one wait, and so is the margin, learnt mostly from the queue of a burst no report showed yet: the
    check adds only what backlog plus margin come to beyond that queue. Summed, a burst's queue counted
    twice as soon as a report showed it (bench-short: an estimate of 1041 ms, 16 of it the request's
    own work, plus a 494 ms backlog and a 559 ms margin against 1998 ms left refused 19 of 48
    requests; the TTFTs of those admitted just before were 0.7-1.1 s; with the backlog counted once,
    an estimate of 1175 ms and a 956 ms margin against 1995 ms left refused 20 of 48, those admitted
    just before had 0.75-1.43 s). ``backlog_ms`` stays the whole
    backlog, and the margin is learnt against the estimate plus it, as before: learnt against the
    estimate plus only the backlog beyond its queue, TTFT p50 rose in 17 of 22 bench-short rounds
    (bench/RESULTS.md). The placement itself is
    chosen without the pressure, which every placement would wait out alike. An empty
    pipeline (nothing admitted is waiting for its first token) is judged by the stage
    estimates alone: the margin learnt in a burst is mostly queueing the backlog term missed,
    and refusals bring no first tokens to correct it, so a tight SLO right after a burst would
    otherwise refuse every request of an idle server until the window forgets.
    ``retry_after_s`` is at least 1; ``retry_after_ms`` is the wait itself (``retry_wait_ms``).
    """
    if not loads.decode:
        return _refused("no_decode_workers", 1000.0)   # nothing drains: ask for the whole second
    decision = choose_placement(
        shape, loads, cost_model, mode, ttft_deadline_ms, itl_slo_ms,
        transfer_chunk_tokens=transfer_chunk_tokens, local_chunk_tokens=local_chunk_tokens,
    )
    if decision is None:
        return _refused("no_decode_capacity", min(w.slot_wait_ms for w in loads.decode))
    excess = decision.estimates["ttft_ms"] - ttft_deadline_ms
    if excess > 0:
        return _refused("ttft_deadline", excess, estimated_ttft_ms=decision.estimates["ttft_ms"],
                        estimated_queue_ms=decision.estimates["queue_ms"])
    if pressure is None:
        return Admission(True, decision, decision.reason, 0)
    backlog, overrun = pressure.backlog_ms(), pressure.margin_ms()
    beyond = backlog + overrun - decision.estimates["queue_ms"]   # one wait, counted once (see the docstring)
    if excess + (beyond if beyond > 0.0 else 0.0) > 0:
        return _refused("pipeline_backlog", excess + beyond, backlog_ms=backlog, overrun_ms=overrun,
                        estimated_ttft_ms=decision.estimates["ttft_ms"], estimated_queue_ms=decision.estimates["queue_ms"])
    return Admission(True, decision, decision.reason, 0, backlog, overrun)
