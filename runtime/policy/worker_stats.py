"""What workers report, and the one function that turns it into the policy's inputs.

The gateway fills a ``StatsSnapshot`` from its registry (each worker's last ``WorkerStats``
and its own count of requests on the worker); the simulator fills one from its simulated
workers, field for field as a real worker would report them. Both hand it to
``stage_loads``, so the same snapshot gives the same ``StageLoads`` and so the same
decision. Every estimate made here uses only these fields and the cost model:

- a queue of prompts (prefill, or a decode worker's colocated prompts): ``queued_prefill_ms``
  of its queued tokens, the fixed cost once per queued request; a decode worker that reports
  each prompt's tokens (``queued_prompts``) serves the least remaining first, so only the
  prompts no longer than the new one count (the simulator's workers run one prompt at a time,
  not preempted by a shorter one, and report none: every queued token counts); a decode worker
  that reports ``step_prompt_tokens`` batches its queue and the new prompt into steps of that
  many tokens, so the wait is that drain less the new prompt's own prefill (``local_queue_ms``); a
  prompt longer than one chunk (``local_chunk_tokens``, the chunk the caller asks for) drains at
  ``step_long_prompt_tokens`` where reported (a refill step widens only the short prompts it finishes);
  a worker's report lags a burst, so where the caller's own prompts placed there and still without
  a first token (``placed_prompts``) add up to more than the reported queue, they are the queue:
  a burst of long prompts admitted within one poll otherwise each saw that poll's queue, as if alone
  (on a decode worker only prompts longer than a chunk count: a refill step carries a burst of short
  ones together, and counted as a queue a closed loop's wave of 16 chats was refused);
- decode slots: ``max_batch`` (the worker's configured batch; the cost model's slot count
  when not reported) less what is claimed, ``max(running + queued, in_flight)``: the
  worker's own count, or the caller's where that is fresher (placed since the last poll);
- a request takes one slot per choice (``shape.choices``: ``n`` sequences in the batch), and the
  caller's ``in_flight`` counts its own requests the same way;
- slot wait, when fewer than its choices are free: the ``k``-th retirement among ``running``
  sequences whose remaining lengths are taken as spread evenly up to this request's
  ``max_tokens`` (the only output length the policy knows): ``k x max_tokens / (running + 1)`` steps;
- the KV link: the remote requests the caller has admitted that have no first token yet
  (``kv_transfers``, ``kv_bytes``), all sharing the link with a new transfer;
- the encoder pool: the least-loaded encoder's queue, each waiting image priced as a call of its
  own over its placeholder tokens (``queued_image_tokens``); where the caller's own requests there
  outnumber the reported queue (placed since the last poll), the extra ones are priced at the
  queue's mean tokens per image, or at this request's when the queue is empty;
- a decode worker's prefix cache: ``cached_prefix_tokens`` of this request's prompt that it
  holds as cached KV (the gateway reads it from the worker's reported summary,
  ``gateway/prefix_routing.py``; the simulator has no prefix cache and reports 0) and
  ``cached_images``, the images wholly inside that prefix: a colocated prefill there runs
  only the rest and skips encoding those images;
- shared cores: a prefill worker whose ``cpus`` overlap a decode worker's on the same machine
  (``host_id``; ``runtime/worker/host_cpu.py``) computes on that worker's cores, so its load names
  that decode worker with how busy the shared cores were (the larger of the two reports, 0 when
  neither has measured yet); workers that report no machine or no cores share nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from runtime.policy.cost_model import CostModel
from runtime.policy.loads import (
    DecodeWorkerLoad,
    EncoderLoad,
    LinkLoad,
    PrefillWorkerLoad,
    RequestShape,
    StageLoads,
)


class Role(StrEnum):
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class WorkerReport:
    """One worker's stats as the policy reads them (``WorkerStats`` fields, same meaning)."""

    role: Role
    address: str
    running_seqs: int = 0  # decode: sequences in the running batch
    queue_depth: int = 0  # work accepted, not running: prompts (prefill), reservations not yet in the batch (decode)
    queued_prefill_tokens: int = 0  # prompt tokens still to prefill there
    queued_image_tokens: int = 0  # encoder: the placeholder tokens of the images waiting there
    queued_prompts: tuple[int, ...] = ()  # decode: each colocated prompt's share of them, when it serves
    # the least remaining first (empty: every queued token is ahead of a new prompt)
    step_prompt_tokens: int = 0  # decode: prompt tokens one step may carry now (0: not reported, one prompt a step)
    step_long_prompt_tokens: int = 0  # decode: of those, for prompts longer than a chunk (0: as step_prompt_tokens)
    free_blocks: int | None = None  # decode: free KV blocks (None: not reported, no block check)
    total_blocks: int = 0
    block_size: int = 16
    ring_groups: int = 0  # decode, windowed pool: rings per sequence and the most blocks in one
    ring_blocks: int = 0
    max_batch: int = 0  # decode: the configured batch size (0: not reported)
    in_flight: int = 0  # the caller's requests on this worker, placed and not yet retired
    placed_prompts: tuple[int, ...] = ()  # the caller's prompts placed to prefill there, no first token yet
    cached_prefix_tokens: int = 0  # decode: of this request's prompt, held there as cached KV
    cached_images: int = 0  # decode: this request's images wholly inside that cached prefix
    host_id: str = ""  # the machine (its boot id); "" = unknown
    cpus: tuple[int, ...] = ()  # the CPUs its model computes on (empty: a GPU worker, or unknown)
    cpus_busy: float = -1.0  # their busy share since the worker's previous report (0-1; -1 = unknown)

    def __post_init__(self) -> None:
        self.role = Role(self.role)
        self.queued_prompts = tuple(self.queued_prompts)   # from_dict hands a list
        self.placed_prompts = tuple(self.placed_prompts)
        self.cpus = tuple(self.cpus)
        if min(self.running_seqs, self.queue_depth, self.queued_prefill_tokens, self.queued_image_tokens,
               self.step_prompt_tokens,
               self.step_long_prompt_tokens,
               self.max_batch, self.in_flight,
               self.cached_prefix_tokens, self.cached_images, *self.queued_prompts, *self.placed_prompts) < 0:
            raise ValueError(f"negative count in the report of {self.address}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 in the report of {self.address}")


@dataclass(slots=True)
class StatsSnapshot:
    """Every healthy worker's report at one moment, plus the caller's remote requests that
    have no first token yet (their KV has still to cross the link)."""

    workers: tuple[WorkerReport, ...]
    kv_transfers: int = 0
    kv_bytes: float = 0.0

    def less_transfer(self, nbytes: float) -> StatsSnapshot:
        """This snapshot without one of its transfers: a request pricing a retry of its own
        failed transfer does not compete with itself."""
        return StatsSnapshot(self.workers, max(0, self.kv_transfers - 1), max(0.0, self.kv_bytes - nbytes))

    def to_dict(self) -> dict[str, Any]:
        return {"workers": [asdict(w) for w in self.workers], "kv_transfers": self.kv_transfers,
                "kv_bytes": self.kv_bytes}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StatsSnapshot:
        return cls(tuple(WorkerReport(**w) for w in doc["workers"]), int(doc.get("kv_transfers", 0)),
                   float(doc.get("kv_bytes", 0.0)))


def stage_loads(snapshot: StatsSnapshot, shape: RequestShape, cm: CostModel,
                local_chunk_tokens: int | None = None) -> StageLoads:
    """The policy's inputs for ``shape`` from ``snapshot`` (see the module docstring); ``local_chunk_tokens``:
    the chunk a colocated prompt is prefilled in (None: unchunked, every prompt drains as a short one)."""
    decode: list[DecodeWorkerLoad] = []
    prefill: list[PrefillWorkerLoad] = []
    encoder_queue: tuple[int, int] | None = None   # the least-loaded encoder's waiting (images, tokens)
    for w in snapshot.workers:
        pending = w.queue_depth if w.queue_depth > w.in_flight else w.in_flight
        if w.role is Role.DECODE:
            decode.append(decode_load(w, shape, cm, local_chunk_tokens))
        elif w.role is Role.PREFILL:
            shared = tuple((d.address, max(0.0, w.cpus_busy, d.cpus_busy)) for d in snapshot.workers
                           if d.role is Role.DECODE and shares_cores(w, d))
            apart = tuple(d.address for d in snapshot.workers if d.role is Role.DECODE and computes_apart(w, d))
            placed = sum(w.placed_prompts)
            if placed > w.queued_prefill_tokens:
                queue_ms = cm.queued_prefill_ms(placed, max(pending, len(w.placed_prompts)))
            else:
                queue_ms = cm.queued_prefill_ms(w.queued_prefill_tokens, pending)
            prefill.append(PrefillWorkerLoad(w.address, queue_ms, shared, apart))
        elif encoder_queue is None or pending < encoder_queue[0]:
            encoder_queue = (pending, encoder_queue_tokens(w, pending, shape))
    encoder = None if encoder_queue is None else EncoderLoad(cm.encode_queue_ms(*encoder_queue))
    link = LinkLoad(snapshot.kv_transfers, snapshot.kv_bytes) if snapshot.kv_transfers else LinkLoad()
    return StageLoads(tuple(decode), tuple(prefill), link, encoder)


def encoder_queue_tokens(w: WorkerReport, pending: int, shape: RequestShape) -> int:
    """The placeholder tokens of the ``pending`` images waiting at encoder ``w``: those it reports, and
    any more the caller placed there since, at the reported queue's mean (or ``shape``'s) per image."""
    extra = pending - w.queue_depth
    if extra <= 0:
        return w.queued_image_tokens
    if w.queue_depth:
        return w.queued_image_tokens + extra * w.queued_image_tokens // w.queue_depth
    return extra * (shape.image_tokens // shape.n_images if shape.n_images else 1)


def shares_cores(a: WorkerReport, b: WorkerReport) -> bool:
    """Whether ``a`` and ``b`` compute on some of the same CPUs of one machine."""
    return bool(a.host_id) and a.host_id == b.host_id and not set(a.cpus).isdisjoint(b.cpus)


def computes_apart(a: WorkerReport, b: WorkerReport) -> bool:
    """Whether ``a`` and ``b`` are known to compute on different CPUs: both report their machine and
    cores (CPU workers) and share none (other machines, or disjoint cores of one)."""
    return bool(a.cpus and b.cpus and a.host_id and b.host_id) and not shares_cores(a, b)


def local_queue_ms(tokens: int, prompts: int, own: int, w: WorkerReport, cm: CostModel, long: bool = False) -> float:
    """How much later a new prompt of ``own`` tokens gets its first token for the ``prompts`` queued
    colocated prompts (``tokens`` between them) ahead of it on decode worker ``w``.

    Reported ``step_prompt_tokens``: a step carries queued prompts up to it, so the queue and the new
    prompt drain together in ``ceil((tokens + own) / step_prompt_tokens)`` steps, each paying the
    prefill's fixed cost once; the wait is that drain less the prompt's own prefill (within one
    step, only the queued tokens' time). Priced one whole prefill per queued prompt, a demo-model
    burst of three queued 26-token prompts (one ~10 ms step) read ~29 ms, the split path looked
    faster, and 40-60% of some 16-concurrent runs' requests went through the prefill worker at ~25%
    less throughput. Unreported (0): one prompt after another (``cm.queued_prefill_ms``).

    ``long``: the new prompt is longer than one chunk, so the drain runs at ``step_long_prompt_tokens``
    where reported, to its last token: a refill step carries twice a chunk for the short prompts it
    finishes but only its usual budget for the rest, and priced at the refill's rate a queue of long
    prompts looked to drain up to twice as fast as it does. (The short prompts ahead of it drain
    faster than that; they are few tokens beside a long prompt's.)"""
    if tokens <= 0:
        return 0.0
    if w.step_prompt_tokens <= 0:
        return cm.queued_prefill_ms(tokens, prompts)
    per_step = w.step_long_prompt_tokens if long and w.step_long_prompt_tokens else w.step_prompt_tokens
    steps = max(1, -(-(tokens + own) // per_step))
    wait = cm.queued_prefill_ms(tokens + own, steps) - cm.prefill_ms(own)
    return wait if wait > 0.0 else 0.0


def decode_load(w: WorkerReport, shape: RequestShape, cm: CostModel,
                local_chunk_tokens: int | None = None) -> DecodeWorkerLoad:
    """One decode worker's load for ``shape``: neighbours, free slots, local queue and slot wait."""
    slots = w.max_batch or cm.decode_slots
    queued = w.running_seqs + w.queue_depth
    claimed = queued if queued > w.in_flight else w.in_flight
    running = w.running_seqs if w.running_seqs > w.in_flight - w.queue_depth else w.in_flight - w.queue_depth
    free = slots - claimed
    cached = max(0, min(w.cached_prefix_tokens, shape.prompt_tokens - 1))
    own = shape.prompt_tokens - cached
    long = local_chunk_tokens is not None and own > local_chunk_tokens
    # the caller's long prompts placed there since the report; short ones are not a queue: a refill step
    # carries a burst of them together, which ``step_prompt_tokens`` already prices
    placed = [t for t in w.placed_prompts if local_chunk_tokens is not None and t > local_chunk_tokens]
    if w.queued_prompts:   # least remaining first: only the prompts no longer than this one are ahead
        reported = [t for t in w.queued_prompts if t <= shape.prompt_tokens]
        mine = [t for t in placed if t <= shape.prompt_tokens]
        ahead = mine if sum(mine) > sum(reported) else reported
        local_ms = local_queue_ms(sum(ahead), len(ahead), own, w, cm, long)
    elif sum(placed) > w.queued_prefill_tokens:
        local_ms = local_queue_ms(sum(placed), len(placed), own, w, cm, long)
    else:
        local_ms = local_queue_ms(w.queued_prefill_tokens, w.queue_depth, own, w, cm, long)
    slot_wait = 0.0
    if free < shape.choices:  # the (claimed - slots + choices)-th retirement frees the last slot it needs
        steps = (shape.choices - free) * shape.max_tokens / (running + 1)
        slot_wait = steps * cm.decode_step_ms(running)
    return DecodeWorkerLoad(w.address, running, free if free > 0 else 0, w.free_blocks, w.block_size, local_ms,
                            slot_wait, ring_groups=w.ring_groups, ring_blocks=w.ring_blocks,
                            cached_prefix_tokens=cached,
                            cached_images=min(w.cached_images, shape.n_images) if cached else 0)
