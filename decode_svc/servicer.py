"""The Decode gRPC service: reserve, receive KV, verify, insert, stream tokens.

Who owns what: the reservation table owns blocks and each reservation's status
(RESERVED -> RECEIVING -> INSERTED, ``request_status.py``), the scheduler each
inserted sequence's (PREFILLING -> RUNNING -> FINISHED_*); this servicer moves
them only through their methods (``attach``, ``mark_inserted``, ``insert``,
``cancel``) and reads them through their queries.

Who frees what: a reservation is released (exactly once,
``ReservationTable.release`` is idempotent) by
  - the scheduler's retire callback, once the sequence was inserted (only while
    the sequence's lease is still the reservation's: ``release_lease``);
  - ``Generate`` itself when it ends before insertion (deadline, cancel, error),
    except on a FAILED transfer, where the reservation is kept so the gateway can
    retry into it (``Rearm``) while its lease lasts. A colocated ``Generate`` may
    reserve itself (``GenerateRequest.reserve``: ``Reserve``'s checks, then the commit and
    the attach with no await between), and then owns its reservation the same way;
  - ``Release`` from the gateway (for an inserted sequence: it is cancelled, and
    its retirement frees);
  - the lease reaper, for reservations not inserted in time (counted:
    ``lease_reaped_total``). A lease never outlasts ``max_lease_s`` (+ margin).

A ``Generate`` holds the ``Lease`` of the generation it was started for. After
every await before insertion (the KV transfer; a colocated prompt's embedding
fetch and ``embed``) it checks the reservation still holds that lease, else it
ends with ABORTED and inserts nothing (the last check is ``mark_inserted`` itself);
the scheduler and the pool check the lease again before any write (see
``scheduler.py``, ``runtime/model/kv_pool.py``).

An embedding-fetch failure is this request's, not this worker's: FAILED_PRECONDITION
with ``epd-failure: embedding_fetch`` (``runtime/worker/rpc_failure.py``), never UNAVAILABLE;
so is a fetched entry whose layout or grid is not the request's image
(``cache/embedding_fetch.checked_embeddings``). A ``Generate`` whose images' layout variants are
not the family's for its image count (``wire.variant_problem``) is INVALID_ARGUMENT before attaching.

The rope delta (``runtime/worker/rope_delta.py``): ``Reserve`` records the gateway's (an
M-RoPE model refuses a Reserve without one); before insertion it must equal the delta of
the prompt that made the KV: the final chunk's (``kv_receiver.py``), or, colocated, the
delta of the prompt this worker prepared itself. The sequence then decodes with it.

The prefix cache (``prefix_match.py``, ``reservations.py``): ``Reserve`` counts the lookup and,
for a colocated request (``reuse_prefix``), starts the reservation with the cached blocks of
its keys' longest cached chain; ``Generate`` recomputes the keys from the prompt it carries
and refuses a reuse whose keys are not the prompt's (FAILED_PRECONDITION) before any forward;
a verified sequence that retires STOPPED, LENGTH or CANCELLED hands its written full prompt
blocks to the cache.

Choices (``n`` > 1, ``SamplingParams.n``): ``Reserve`` takes blocks for all of them
(``ReserveRequest.choices``; ``reservations.py``), ``Generate`` makes one ``Sequence`` per choice
(choice i samples with ``for_choice``), inserted together after the verified transfer (each with
the first token the last chunk carries for it) or forked from choice 0 when a colocated prompt
is in (``scheduler.py``). Every event names its choice (``TokenEvent.index``); the stream ends
when every choice has its finish reason. Each choice's retirement is counted once
(``ReservationTable.retire_choice``); the last one releases the reservation. A ``Release`` that
names ``choices`` retires only those (the gateway ended them early): each leaves the batch at the
next step boundary, frees its fork's own blocks, and ends its part of the stream with
finish_reason "cancelled" (no abort); the others run on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from cache.embedding_fetch import EmbeddingFetcher
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter
from runtime.model.prefix_keys import summary_id
from runtime.model.sampling import MAX_CHOICES, for_choice
from runtime.worker.faults import FaultInjector
from runtime.worker.rope_delta import RopeDeltaRule
from runtime.worker.serving_state import ServingState
from runtime.worker.timing_log import TimingLog
from runtime.worker.tracing import annotate, span
from runtime.worker.wire import logprobs_to_pb, sampling_from_pb, variant_problem

from .generate_mux import GenerateMany
from .generate_steps import GenerateSteps
from .kv_receiver import KVReceiver, StreamTally
from .local_encode import LocalEncoder
from .prefix_match import PrefixCacheCounters
from .request_status import DecodeStatus, finish_reason
from .reservations import AttachRefused, Fit, Reservation, ReservationTable
from .scheduler import DecodeScheduler
from .sequence import Sequence

log = logging.getLogger("epd.decode")


def unix_ms_to_monotonic(deadline_unix_ms: int, default_s: float = 600.0) -> float:
    if deadline_unix_ms <= 0:
        return time.monotonic() + default_s
    return time.monotonic() + (deadline_unix_ms / 1000.0 - time.time())


# a sequence that ends in one of these statuses ends its Generate with this gRPC status
_ABORT_CODES = {DecodeStatus.FINISHED_CANCELLED: grpc.StatusCode.CANCELLED,
                DecodeStatus.FINISHED_ABORTED: grpc.StatusCode.ABORTED,
                DecodeStatus.FINISHED_ERROR: grpc.StatusCode.INTERNAL}
_ATTACH_CODES = {AttachRefused.GONE: grpc.StatusCode.NOT_FOUND, AttachRefused.GENERATING: grpc.StatusCode.ALREADY_EXISTS,
                 AttachRefused.STALE_GENERATION: grpc.StatusCode.FAILED_PRECONDITION,
                 AttachRefused.ATTACHED: grpc.StatusCode.ALREADY_EXISTS}


class DecodeServicer(GenerateSteps, pb_grpc.DecodeServicer):
    def __init__(self, adapter: VLMAdapter, pool: KVBlockPool, *, fetcher: EmbeddingFetcher,
                 max_batch: int = 64, prefill_chunk_tokens: int = 256, lease_margin_s: float = 10.0,
                 max_lease_s: float = 300.0, faults: FaultInjector | None = None):
        self.adapter = adapter
        self.pool = pool
        self.fetcher = fetcher
        self.local_encoder = LocalEncoder(adapter, fetcher)   # a colocated request's images sent as bytes
        self.faults = faults or FaultInjector("")
        self.timings = TimingLog()
        # hybrid decoders: one linear-attention state slot per reservation, beside its blocks
        self.states = adapter.new_state_slots(2 * max_batch)
        longest = max(prefill_chunk_tokens, adapter.longest_image_span)   # what one colocated step writes at most
        if pool.groups.windowed and pool.window_chunk < longest:
            raise ValueError(f"the KV pool's rings hold {pool.window_chunk}-token chunks; this worker's steps write up to {longest}")
        self.table = ReservationTable(pool, lease_margin_s, max_lease_s, states=self.states)
        self.prefix = PrefixCacheCounters()
        self.rope_delta = RopeDeltaRule(adapter.family.position_kind)
        self.receiver = KVReceiver(self.table, pool, self.rope_delta, states=self.states)
        self.scheduler = DecodeScheduler(adapter, pool, states=self.states, max_batch=max_batch,
                                         prefill_token_budget=prefill_chunk_tokens,
                                         on_retire=self._on_retire, timings=self.timings,
                                         step_delay_s=self.faults.amount("delay_step_ms") / 1000,
                                         prompts_on_the_way=lambda: self.table.prompts_on_the_way)
        self.state = ServingState("decode", self.timings, adapter.model_fingerprint, adapter.attention_kernel,
                                  adapter.linear_kernel, adapter.device.type)
        self._boot = uuid.uuid4().hex[:12]   # a restarted worker's summary is a new one (its cache is gone)
        self.bulk_address = ""      # set when the bulk KV path is listening (server.py)
        self._reaper: asyncio.Task | None = None
        self._on_stop: list = []

    def start(self) -> None:
        self.scheduler.start()
        self._reaper = asyncio.create_task(self._reap_leases(), name="lease-reaper")

    def add_bulk_path(self, address: str, stop) -> None:
        """The bulk KV path listens on ``address`` (advertised in every Reserve reply); ``stop`` ends it in ``close``."""
        self.bulk_address = address
        self._on_stop.append(stop)

    async def close(self) -> None:
        for callback in self._on_stop:
            await callback()
        if self._reaper:
            self._reaper.cancel()
        await self.scheduler.stop()
        self.table.release_all("worker stopping")
        await self.local_encoder.close()   # before the fetcher: its stores use the fetcher's channels
        await self.fetcher.close()

    def busy(self) -> bool:
        """What a drain waits for: reservations held or sequences in the batch (new Reserves are refused)."""
        return bool(self.table.active or self.scheduler.busy)

    def _on_retire(self, seq: Sequence) -> None:
        # KV written by completed steps is good on these ends; a failed step or a lost lease caches nothing
        good = seq.status in (DecodeStatus.FINISHED_STOPPED, DecodeStatus.FINISHED_LENGTH, DecodeStatus.FINISHED_CANCELLED)
        self.table.retire_choice(seq.lease, seq.index, finish_reason(seq.status) or "retired",
                                 seq.kv_written if good else 0)

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for res in self.table.reap_expired():
                log.warning("lease expired for %s (%s); released", res.request_id, res.reservation_id)

    # -- RPCs ---------------------------------------------------------------------
    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        return self._reserve_response(await self._reserve(request, context))

    async def _reserve(self, request: pb.ReserveRequest, context) -> Reservation:
        """Reserve's checks and commit (``Reserve``, or a colocated ``Generate`` that reserves
        itself); a refusal aborts the call. Awaits only to abort: the commit follows its check."""
        if not self.state.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining")
        if request.prompt_tokens < 1 or request.max_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens and max_tokens must be >= 1")
        if request.model_fingerprint and request.model_fingerprint != self.adapter.model_fingerprint:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model fingerprint differs from this decode worker's")
        rope_delta = self.rope_delta.read(request)
        problem = self.rope_delta.invalid(rope_delta, "Reserve")
        if problem:   # absent for an M-RoPE model, or non-zero for a 1-D one
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        choices = max(1, request.choices)
        if choices > MAX_CHOICES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"choices must be at most {MAX_CHOICES}")
        tokens = request.prompt_tokens + request.max_tokens
        fit = self.table.can_reserve(request.prompt_tokens, request.max_tokens, choices)
        if fit is Fit.NEVER:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{tokens} tokens can never fit this worker's KV pool")
        keys = list(request.prefix_keys) if self.pool.prefix_cache else []
        # the commit right after its check, no await between: it takes the blocks the check saw free
        with span("decode.reserve", **{"epd.request_id": request.request_id, "epd.tokens": tokens}):
            res = self.table.reserve(
                request.request_id, request.prompt_tokens, request.max_tokens,
                unix_ms_to_monotonic(request.deadline_unix_ms), request.token_digest,
                request.model_fingerprint or self.adapter.model_fingerprint, rope_delta,
                prefix_keys=keys, reuse_prefix=request.reuse_prefix and bool(keys),
                choices=choices, prompt_here=request.reuse_prefix) if fit is Fit.NOW else None
        if res is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"no room for {tokens} tokens ({self.pool.available_blocks} free blocks"
                                + (f", {self.states.free_slots} free state slots)" if self.states else ")"))
        if self.pool.prefix_cache:
            self.prefix.count(request.prompt_tokens, res.cached_tokens)
        return res

    def _reserve_response(self, res: Reservation) -> pb.ReserveResponse:
        return pb.ReserveResponse(
            reservation=pb.Reservation(reservation_id=res.reservation_id, generation=res.generation),
            blocks=len(res.owned), alloc_ms=res.alloc_ms, bulk_address=self.bulk_address,
            cached_tokens=res.cached_tokens)

    async def Rearm(self, request: pb.RearmRequest, context) -> pb.ReserveResponse:
        res = self.table.rearm(request.reservation.reservation_id)
        if res is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "reservation is gone, inserted or released")
        return self._reserve_response(res)

    async def PushKV(self, request_iterator, context) -> pb.PushKVResponse:
        tally = StreamTally(self.receiver)
        async for chunk in request_iterator:
            chunk = self.faults.mangle_chunk(chunk)
            if chunk is None:
                continue
            tally.saw(chunk)
            tally.record(self.receiver.land(chunk))
        return tally.reply()

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        rid = request.reservation.reservation_id
        res = self.table.get(rid)
        if request.choices:   # only these choices; an uninserted reservation has none running yet
            marked = self.scheduler.retire_choices(rid, request.reservation.generation, set(request.choices))
            return pb.ReleaseResponse(released=bool(marked))
        if res is not None and res.status is DecodeStatus.INSERTED:
            self.scheduler.cancel_reservation(rid)     # its retirement releases
            return pb.ReleaseResponse(released=True)
        return pb.ReleaseResponse(released=self.table.release(rid, request.reason or "released by gateway"))

    async def Generate(self, request: pb.GenerateRequest, context):
        try:
            sampling = sampling_from_pb(request.sampling)
        except ValueError as exc:   # before attaching: nothing is held yet
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}")
        problem = variant_problem(self.adapter.family, request.images)
        if problem:   # before attaching: nothing is held yet
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        reserved = None
        if request.HasField("reserve"):   # colocated: reserve here, then attach at once (no await between)
            if not request.colocated or request.reservation.reservation_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reserve rides on a colocated Generate only, "
                                                                      "instead of a reservation")
            if max(1, request.reserve.choices) != sampling.n:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"n={sampling.n} for a reservation of {max(1, request.reserve.choices)} choices")
            reserved = await self._reserve(request.reserve, context)
            request.reservation.reservation_id, request.reservation.generation = (reserved.reservation_id,
                                                                                  reserved.generation)
        res = self.table.get(request.reservation.reservation_id)
        if res is not None and sampling.n != res.choices:   # before attaching: nothing changes
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"n={sampling.n} for a reservation of {res.choices} choices")
        res = self.table.attach(request.reservation.reservation_id, request.reservation.generation)
        if isinstance(res, AttachRefused):
            await context.abort(_ATTACH_CODES[res], res.value)
        lease = res.lease
        # nothing waits past the lease: the reaper frees the blocks then anyway
        deadline = min(unix_ms_to_monotonic(request.deadline_unix_ms), res.lease_expires_at)
        arrived = time.monotonic()
        events: asyncio.Queue = asyncio.Queue()    # every choice's, told apart by index
        prompt_ids = list(request.token_ids) if sampling.needs_prompt_ids else []
        seqs = [Sequence(request.request_id, lease, res.choice_blocks(i), res.prompt_tokens,
                         min(request.max_tokens or res.max_tokens, res.max_tokens), for_choice(sampling, i),
                         rope_delta=res.rope_delta,   # the transfer or the colocated prompt must agree before insertion
                         prompt_ids=prompt_ids, events=events, shared=res.shared, index=i,
                         state_slot=res.state_slot, rings=res.choice_rings(i))
                for i in range(res.choices)]
        seq = seqs[0]
        seq.forks = seqs[1:] if request.colocated else []
        keep_reservation = False
        try:
            annotate(**{"epd.request_id": request.request_id,
                        "epd.placement": "colocated" if request.colocated else "disaggregated"})
            problem = self._check_prefix_keys(request, res)
            if problem:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
            if request.colocated:
                with span("decode.colocated_prefill", **{"epd.request_id": request.request_id}):
                    await self._start_colocated(request, res, lease, seq, deadline, context)
            else:
                if seq.prompt_ids and len(seq.prompt_ids) != res.prompt_tokens:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"{len(seq.prompt_ids)} prompt ids for a reservation of {res.prompt_tokens} tokens")
                failure = await self._await_transfer(res, lease, deadline, request.request_id)
                if failure is not None:
                    code, detail, keep_reservation = failure
                    await context.abort(code, detail)
                firsts = self._choice_firsts(res)
                if firsts is None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"the transfer carried no first token for each of {res.choices} choices")
                with span("decode.insert", **{"epd.request_id": request.request_id}):
                    self.scheduler.insert(seq, firsts[0])
                    for child, first_token in zip(seqs[1:], firsts[1:]):
                        self.scheduler.fork(seq, child, first_token)
            first = True
            stores_held = request.colocated   # images encoded here wait for the first token (local_encode.py)
            live = set(range(len(seqs)))
            while True:
                timeout = max(0.0, deadline - time.monotonic()) if first else None
                try:
                    if first:   # the first step: the wait for the running batch to make this sequence's token
                        with span("decode.first_step", **{"epd.request_id": request.request_id}):
                            ev = await asyncio.wait_for(seq.events.get(), timeout)
                    else:
                        ev = await asyncio.wait_for(seq.events.get(), timeout)
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no first token before the deadline")
                early = ev.end is DecodeStatus.FINISHED_CANCELLED and seqs[ev.index].ended_by_gateway
                if ev.end in _ABORT_CODES and not early:   # a choice the gateway ended is no failure
                    await context.abort(_ABORT_CODES[ev.end], ev.detail or ev.finish_reason)
                out = pb.TokenEvent(token_ids=ev.token_ids, finish_reason=ev.finish_reason or "",
                                    logprobs=[logprobs_to_pb(s) for s in ev.logprobs], index=ev.index)
                if first:
                    first = False
                    self._fill_first_event(out, res, arrived, seq)
                    if reserved is not None:
                        out.reserved.CopyFrom(self._reserve_response(reserved))
                yield out
                if stores_held:   # the first token is out: now the images' stores
                    stores_held = False
                    self.local_encoder.start_stores(request.request_id)
                if ev.finish_reason:
                    live.discard(ev.index)
                    if not live:
                        return
        finally:
            if request.colocated:
                self.local_encoder.start_stores(request.request_id)
            held = [s for s in seqs if self.scheduler.holds(s)]
            for s in held:
                self.scheduler.cancel(s)             # each retirement is counted; the last releases
            if not held and not seq.status.is_finished and not keep_reservation:
                self.table.release_lease(lease, "generate ended before insertion")

    async def GenerateMany(self, request_iterator, context):
        """Many ``Generate`` calls on one stream from a gateway (``generate_mux.py``): each runs ``Generate``."""
        async for event in GenerateMany(self.Generate).serve(request_iterator):
            yield event

    def local_stats(self) -> dict[str, int]:
        return {"reservations_active": self.table.active, "pending_chunks": self.table.pending_chunks,
                "free_blocks": self.pool.available_blocks, "total_blocks": self.pool.num_blocks,
                "cached_blocks": self.pool.cached_blocks,
                "prefix_cache_queries_total": self.prefix.queries_total,
                "prefix_cache_hits_total": self.prefix.hits_total, "running_seqs": self.scheduler.running_seqs,
                "in_flight": self.table.active, "lease_reaped_total": self.table.reaped_total,
                "choices_retired_early_total": self.scheduler.choices_retired_early,
                "refill_waits_total": self.scheduler.refill_waits,
                "images_encoded_here_total": self.local_encoder.encoded,
                "embedding_store_failures_total": self.local_encoder.store_failures,
                "embedding_store_calls_total": self.local_encoder.store_calls,
                **{f"kv_chunks_{outcome}": n for outcome, n in self.receiver.outcomes.items()}}

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        version = f"{self._boot}:{self.pool.cache_version}"
        send = request.prefix_summary_version != version
        return self.state.stats(
            request,
            queue_depth=self.scheduler.prefilling_seqs + self.table.waiting,
            in_flight=self.table.active, running_seqs=self.scheduler.running_seqs, computes=self.local_encoder.encoded,
            free_blocks=self.pool.available_blocks, total_blocks=self.pool.num_blocks, block_size=self.pool.block_size,
            free_state_slots=self.states.free_slots if self.states else 0,
            ring_groups=self.pool.groups.window_groups, ring_blocks=self.pool.ring_blocks_max,
            total_state_slots=self.states.num_slots if self.states else 0,
            cached_blocks=self.pool.cached_blocks, prefix_cache=self.pool.prefix_cache,
            prefix_cache_queries_total=self.prefix.queries_total, prefix_cache_hits_total=self.prefix.hits_total,
            prefix_summary_version=version, prefix_summary_sent=send,
            prefix_summary=[summary_id(k) for k in self.pool.summary()] if send else [],
            reservations_active=self.table.active, pending_chunks=self.table.pending_chunks,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens,
            queued_prompt_tokens=self.scheduler.queued_prompt_tokens,
            step_prompt_tokens=self.scheduler.step_prompt_tokens,
            step_long_prompt_tokens=self.scheduler.step_long_prompt_tokens,
            max_batch=self.scheduler.max_observed_batch, max_batch_configured=self.scheduler.max_batch,
            lease_reaped_total=self.table.reaped_total,
            choices_retired_early_total=self.scheduler.choices_retired_early,
            bulk_address=self.bulk_address,
        )

