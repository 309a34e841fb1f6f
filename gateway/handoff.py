"""A placed request from its reservation to its last token: the attempt/failure loop as a state machine.

States (``HandoffState``), in order; a failure raises out of any of them::

    RESERVING ──> ATTEMPTING ──────────> STREAMING ──> FINISHED
                    ^      │
                    │      v
                  RECOVERING

RESERVING   ``Reserve`` on the chosen decode worker while the request's images are encoded
            (``encode``: Reserve needs only the token counts, the digest, the rope delta and
            the prefix keys, none of them from Encode, so the two RPCs overlap); when Reserve
            fails because the worker is gone (nothing was sent anywhere yet), once more on the
            least loaded other one. Both must succeed to leave the state: a failed Reserve
            cancels the Encode still running (its result is unused) and raises Reserve's error,
            or Encode's when Encode had already failed (Encode went first before they overlapped);
            a failed Encode raises once Reserve is done, with the reservation held, and
            ``events``' ``finally`` releases it.
            Every Reserve names the prompt's prefix-cache keys for that worker
            (``gateway/prefix_routing.py``); a colocated one asks to reuse its cached blocks,
            and the reply's ``cached_tokens`` (in the TTFT breakdown) is what it reused. An image
            that was not encoded because the prefix was expected cached, but that the
            reservation did not get, is encoded now (``encode_images``).
            A colocated request with nothing to overlap (no Encode RPC, no skipped image) sends
            no Reserve: its first attempt's Generate reserves itself (``reserve_in_generate``,
            one round trip less), and the first event names the reservation; a refusal is
            Reserve's (429 when no room), and a failed attempt leaves nothing held on decode
            (a recovery reserves anew).
ATTEMPTING  ``run_attempt`` (``gateway/attempt.py``): FIRST_TOKEN -> STREAMING, any other
            outcome -> RECOVERING. With ``images_on_decode`` a colocated attempt carries the
            images' bytes for decode to encode; an attempt a recovery gave a prefill worker
            first has them encoded (``encode_images``: prefill fetches by key).
RECOVERING  probe the attempt's workers, mark the gone ones, ask the failure policy and carry
            out its ``RecoveryPlan`` (``gateway/recovery.py``): RETRY / REPREFILL re-arm the
            held reservation, then close the old stream; OTHER_DECODE releases it and reserves
            on the new worker; FAIL releases it and raises (503, or 504 past the deadline).
            Bounded: the policy fails the request after a few attempts. A plan (or a Reserve
            moved off a dead decode worker) tells ``on_move`` which worker prefills the prompt
            now: the admission ticket counts the prompt there until its first token.
STREAMING   yield decode's events; the one with a finish reason ends it (FINISHED); with ``n`` > 1
            choices, the last choice's finish reason (each event names its choice). A choice the
            HTTP layer ended itself (``job.choice_ends``) is retired on decode at once
            (``WorkerRpc.retire_choices``); decode ends its events with "cancelled".

Who frees what: the reservation is this object's while ``reservation`` is set. An event
with a finish reason means decode retired the sequence and freed the blocks itself; every
other end (a failure, a stop string, the client gone) releases it exactly once, in
``events``' ``finally``, which also settles the last attempt's Prefill RPC and drops the
gateway's ``inflight`` count on the decode worker (one per choice: the batch slots it takes).
That freeing runs as its own task (``_close``), so a cancelled request task cannot cut it short.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import IntEnum

import grpc

from proto.epd.v1 import epd_pb2 as pb
from runtime.model.sampling import SampledToken
from runtime.policy.cost_model import CostModel
from runtime.policy.loads import RequestShape, StageLoads
from runtime.policy.placement_policy import PlacementDecision
from runtime.worker.wire import sampled_from_pb

from . import pipeline_metrics as m
from .attempt import AttemptOutcome, AttemptResult, record_first_event, run_attempt
from .chat_backend import BackendFailure, ChatJob, DeadlineExceeded, TokenEvent
from .prefix_routing import PrefixView
from runtime.model.prefix_keys import summary_id
from .recovery import Failure, RecoveryPlan, Step, choose_action, least_loaded_decode, plan_recovery
from .worker_registry import WorkerHandle, WorkerRegistry
from .worker_rpc import WorkerRpc

log = logging.getLogger("epd.gateway")

# handoffs' freeing still running after their request's task was cancelled (kept from collection)
_CLOSING: set[asyncio.Task] = set()

# after the last token, how long a Prefill RPC still finishing may take before it is cancelled
# (decode verified the transfer before its first event, so the reply is normally already in)
PREFILL_SETTLE_S = 1.0


class HandoffState(IntEnum):
    RESERVING = 0
    ATTEMPTING = 1
    RECOVERING = 2
    STREAMING = 3
    FINISHED = 4    # the event with a finish reason went out: decode freed the blocks itself


class Handoff:
    def __init__(self, job: ChatJob, shape: RequestShape, decision: PlacementDecision, refs: list[pb.ImageRef],
                 digest: str, breakdown: dict[str, float], *, registry: WorkerRegistry, rpc: WorkerRpc,
                 cost_model: CostModel, loads: Callable[[], StageLoads], chunk_tokens: int,
                 prefix: PrefixView | None = None, skipped: frozenset[int] = frozenset(),
                 encode_images: Callable[[set[int]], Awaitable[None]] | None = None,
                 encode: Callable[[], Awaitable[None]] | None = None, images_on_decode: bool = False,
                 reserve_in_generate: bool = False, on_move: Callable[[WorkerHandle], None] | None = None):
        self.job, self.shape, self.refs, self.digest, self.breakdown = job, shape, refs, digest, breakdown
        self.prefix = prefix                  # the prompt's prefix-cache keys per decode worker
        self.skipped = set(skipped)           # images not encoded: expected in the colocated worker's cache
        self.encode_images = encode_images
        self.encode = encode                  # the images' Encode, run beside the first Reserve (once)
        self.images_on_decode = images_on_decode   # colocated attempts send the bytes; decode encodes them
        self.registry, self.rpc, self.cost_model, self.chunk_tokens = registry, rpc, cost_model, chunk_tokens
        self.loads = loads   # the policy's inputs now (gateway/admission.py), for the failure policy
        self.on_move = on_move   # told the worker that prefills the prompt after a recovery moves it
        decode = registry.get("decode", decision.decode_worker)
        prefill = registry.get("prefill", decision.prefill_worker) if decision.prefill_worker else None
        if decode is None or (decision.prefill_worker and prefill is None):
            raise BackendFailure("the worker chosen for this request left before it got there", 503)
        self.decode: WorkerHandle = decode
        self.prefill: WorkerHandle | None = prefill   # None: colocated
        # colocated, nothing to overlap with a Reserve: the first attempt's Generate reserves itself
        self.reserve_in_generate = reserve_in_generate and prefill is None
        self.state = HandoffState.RESERVING
        self.reservation: pb.Reservation | None = None
        self.result: AttemptResult | None = None      # the current attempt's
        self.attempts = 0                             # failed attempts so far
        self._retiring: set[asyncio.Task] = set()     # choice retirements in flight (awaited by _close)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Run the machine; yields the request's events. Close it (``aclose``) to end it early."""
        self.decode.inflight += self.job.sampling.n  # one per choice (batch slots); from before Reserve: a handle dropped from discovery keeps its channel while > 0
        try:
            while self.state < HandoffState.STREAMING:
                if self.state is HandoffState.RESERVING:
                    await self._reserve()
                elif self.state is HandoffState.ATTEMPTING:
                    await self._attempt()
                else:
                    await self._recover()
            async for event in self._stream():
                yield event
        except grpc.aio.AioRpcError as exc:
            raise self.rpc.failure("decode", self.decode, exc, self.job, self.state is HandoffState.STREAMING) from exc
        finally:   # FINISHED, a failure in any state, or closed early (a stop string, the client gone)
            await self._close()

    # -- states --------------------------------------------------------------------
    async def _reserve(self) -> None:
        if self.reserve_in_generate:   # no Reserve RPC: the encode step only books (no RPC either)
            if self.encode is not None:
                await self.encode()
                self.encode = None
            self.state = HandoffState.ATTEMPTING
            return
        encoding = asyncio.create_task(self.encode()) if self.encode is not None else None
        self.encode = None
        try:
            try:
                await self._reserve_on_decode()
            except BackendFailure:
                moved = await self._replacement_decode()
                if moved is None:
                    raise
                self._move_to(moved)
                self._moved()
                await self._reserve_on_decode()
        except BaseException as exc:   # no reservation (or the client gone): the Encode is not needed
            if encoding is not None:
                failed = await _cancel(encoding)
                if failed is not None and isinstance(exc, Exception):
                    raise failed from None   # it failed first: its error, as when Encode ran before Reserve
            raise
        if encoding is not None:
            await encoding   # a failure raises with the reservation held: the close releases it
        self.state = HandoffState.ATTEMPTING

    async def _reserve_on_decode(self) -> None:
        """Reserve on ``self.decode`` (reusing its cached prefix when colocated), then encode any
        skipped image whose placeholders the reused prefix does not cover."""
        keys = self.prefix.keys_for(self.decode) if self.prefix is not None else []
        resp = await self.rpc.reserve(self.decode, self.job, self.digest, keys, reuse_prefix=self.prefill is None)
        self.reservation = resp.reservation
        self.breakdown["cached_tokens"] = float(resp.cached_tokens)
        if self.skipped and self.prefix is not None:
            cached = resp.cached_tokens if self.prefill is None else 0
            missing = self.skipped & set(self.prefix.images_needed(cached))
            if missing and self.encode_images is not None:
                await self.encode_images(missing)
                self.skipped -= missing

    async def _attempt(self) -> None:
        self.result = None
        if self.images_on_decode and self.prefill is not None:
            # a recovery moved the prompt to a prefill worker, which fetches by key: encode them now
            if self.encode_images is not None:
                await self.encode_images(set(range(len(self.refs))))
            self.images_on_decode = False
        reserve, keys = None, []
        if self.reserve_in_generate:   # the first attempt only
            self.reserve_in_generate = False
            keys = self.prefix.keys_for(self.decode) if self.prefix is not None else []
            reserve = self.rpc.reserve_request(self.decode, self.job, self.digest, keys, reuse_prefix=True)
        try:
            self.result = await run_attempt(self.rpc, self.job, self.decode, self.prefill, self.reservation,
                                            self.refs, self.digest, self.chunk_tokens,
                                            images_on_decode=self.images_on_decode, reserve=reserve)
        except grpc.aio.AioRpcError as exc:
            if reserve is None:
                raise
            raise self.rpc.reserve_failure(self.decode, exc, self.job) from exc
        if self.result.outcome is AttemptOutcome.FIRST_TOKEN:
            if reserve is not None:   # the reservation decode made for this Generate
                reserved = self.result.first.reserved
                self.reservation = reserved.reservation
                self.breakdown["cached_tokens"] = float(reserved.cached_tokens)
                self.rpc.reserved(self.decode, self.job, reserved, bool(keys))
            record_first_event(self.result, self.breakdown)
            self.state = HandoffState.STREAMING
            for ref in self.refs:   # no further attempt will send them: a long stream holds no embedding bytes
                ref.ClearField("embedding")
        else:
            self.state = HandoffState.RECOVERING

    async def _recover(self) -> None:
        result = self.result
        self.attempts += 1
        m.KV_TRANSFER_FAILED.inc()
        prefill_gone = result.outcome is AttemptOutcome.PREFILL_LOST and not await self.rpc.alive(self.prefill)
        decode_gone = result.outcome is AttemptOutcome.DECODE_LOST or not await self.rpc.alive(self.decode)
        failure = Failure(result.outcome, result.detail, prefill_gone, decode_gone)
        if prefill_gone:   # confirmed: a prefill whose push broke because the decode worker died is innocent
            self.registry.mark_unhealthy("prefill", self.prefill.address)
        if decode_gone:
            self.registry.mark_unhealthy("decode", self.decode.address)
        others = [h for h in self.registry.healthy("decode") if h.address != self.decode.address]
        free_prefill = [h for h in self.registry.healthy("prefill")
                        if self.prefill is None or h.address != self.prefill.address]
        action = choose_action(failure, self.attempts, self.shape, self.cost_model, self.loads(), self.decode.address,
                               (self.job.ttft_deadline_s - time.monotonic()) * 1000)
        plan = plan_recovery(failure, action, self.decode, self.prefill, others, free_prefill)
        m.FAILURE_ACTIONS.labels(plan.step.value).inc()
        log.warning("request %s transfer attempt %d failed (%s); action %s (%s)",
                    self.job.request_id, self.attempts, failure.detail, plan.step.value, plan.reason)
        await self._carry_out(plan, failure)

    async def _carry_out(self, plan: RecoveryPlan, failure: Failure) -> None:
        result = self.result
        if not plan.step.keeps_reservation:
            if self.reservation is not None:
                await self.rpc.release(self.decode, self.reservation, self.job, f"transfer failed: {plan.step.value}")
            self.reservation = None   # released: the close must not release it again
            result.close_stream()
        if plan.step is Step.FAIL:
            if time.monotonic() >= self.job.ttft_deadline_s:
                raise DeadlineExceeded(f"KV transfer failed and the deadline passed: {failure.detail}")
            raise BackendFailure(f"KV transfer failed and no recovery fits the time left: {failure.detail}", 503)
        self.prefill = plan.prefill
        if plan.step is Step.OTHER_DECODE:
            self._move_to(plan.decode)
            await self._reserve_on_decode()
        elif self.reservation is None:   # the failed Generate reserved itself: decode freed it, reserve anew
            result.close_stream()
            await self._reserve_on_decode()
        else:
            self.reservation = await self.rpc.rearm(self.decode, self.reservation, self.job)  # blocks kept
            result.close_stream()   # only now: the old Generate ending first would free the blocks
        self._moved()
        self.state = HandoffState.ATTEMPTING

    async def _stream(self) -> AsyncIterator[TokenEvent]:
        live = set(range(self.job.sampling.n))   # choices without their finish reason yet

        def event(ev: pb.TokenEvent, breakdown: dict[str, float] | None = None) -> TokenEvent:
            if ev.index not in range(self.job.sampling.n):
                raise BackendFailure(f"decode sent choice {ev.index} of a request with n={self.job.sampling.n}", 502)
            if ev.finish_reason:
                live.discard(ev.index)
                if not live:   # the decode worker retired every choice and freed the blocks itself
                    self.reservation = None
                    self.state = HandoffState.FINISHED
            return TokenEvent(list(ev.token_ids), ev.finish_reason or None, breakdown, _logprobs(ev), ev.index)

        yield event(self.result.first, self.breakdown)
        if not live:
            return
        if self.job.sampling.n > 1:
            self.job.choice_ends.listen(self._retire_choice)
        async for ev in self.result.stream:
            yield event(ev)
            if not live:
                return

    # -- helpers -------------------------------------------------------------------
    def _retire_choice(self, index: int) -> None:
        """The HTTP layer ended choice ``index``: tell decode now (the stream goes on for the others)."""
        if self.reservation is None or self.state is not HandoffState.STREAMING:
            return
        task = asyncio.ensure_future(self.rpc.retire_choices(self.decode, self.reservation, self.job, [index]))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _close(self) -> None:
        """Free what the request holds, to the end, even when the request's task is cancelled.

        A client gone makes the HTTP server cancel the request's task at every await it reaches
        (anyio's cancel scopes), this ``finally`` included; cut at its first await, the rest (the
        Prefill call, the ``inflight`` count) would stay held. So the freeing is its own task,
        awaited shielded: a cancelled wait leaves it running to its end (``_CLOSING`` keeps it)."""
        freeing = asyncio.ensure_future(self._free())
        _CLOSING.add(freeing)
        freeing.add_done_callback(_CLOSING.discard)
        try:
            await asyncio.shield(freeing)
        except asyncio.CancelledError:
            freeing.add_done_callback(_log_failure)   # nobody awaits it now
            raise

    async def _free(self) -> None:
        """The freeing itself, in order; the ``inflight`` count drops last, whatever happened before."""
        try:
            self.job.choice_ends.listen(None)
            if self._retiring:   # before the whole release: both are idempotent, but the order keeps the counts true
                await asyncio.gather(*self._retiring, return_exceptions=True)
            if self.state is HandoffState.FINISHED and self.prefix is not None:
                # decode retired the sequence and cached its full prompt blocks before its last event:
                # the summary knows it now, before the next poll brings the worker's own
                keys = self.prefix.keys_for(self.decode)
                if keys:
                    self.decode.prefix_summary = self.decode.prefix_summary | {summary_id(k) for k in keys}
            if self.reservation is not None:
                await self.rpc.release(self.decode, self.reservation, self.job, "request ended")
                self.reservation = None
            if self.result is not None:
                if self.state is not HandoffState.FINISHED:
                    self.result.close_stream()
                if self.result.prefill is not None:
                    await self.result.prefill.settle(PREFILL_SETTLE_S if self.state is HandoffState.FINISHED else 0.0)
        finally:
            self.decode.inflight -= self.job.sampling.n

    def _moved(self) -> None:
        if self.on_move is not None:
            self.on_move(self.prefill or self.decode)

    def _move_to(self, decode: WorkerHandle) -> None:
        self.decode.inflight -= self.job.sampling.n
        self.decode = decode
        self.decode.inflight += self.job.sampling.n

    async def _replacement_decode(self) -> WorkerHandle | None:
        """After a failed Reserve: if the decode worker is really gone, mark it and name the least
        loaded other healthy one (``None``: the failure stands)."""
        lost = self.decode
        if await self.rpc.alive(lost):
            return None
        self.registry.mark_unhealthy("decode", lost.address)
        others = [h for h in self.registry.healthy("decode") if h.address != lost.address]
        if not others:
            return None
        m.FAILURE_ACTIONS.labels("other_decode").inc()
        log.warning("decode worker %s is gone; placing the request on another", lost.address)
        return least_loaded_decode(others)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("freeing a cancelled request's resources failed", exc_info=task.exception())


async def _cancel(task: asyncio.Task) -> BaseException | None:
    """Cancel ``task`` and wait for it to end; the exception it had already ended with, if any."""
    failed = task.exception() if task.done() and not task.cancelled() else None
    task.cancel()
    await asyncio.wait([task])
    if not failed and not task.cancelled():
        task.exception()   # retrieved: a failure after the cancel is not logged as unretrieved
    return failed


def _logprobs(ev: pb.TokenEvent) -> list[SampledToken] | None:
    """The event's tokens with their logprobs, or ``None`` when the decode worker sent none (not asked for)."""
    if not ev.logprobs:
        return None
    if len(ev.logprobs) != len(ev.token_ids):
        raise BackendFailure(f"decode sent {len(ev.logprobs)} logprobs for {len(ev.token_ids)} tokens", 502)
    return [sampled_from_pb(t, lp) for t, lp in zip(ev.token_ids, ev.logprobs)]
