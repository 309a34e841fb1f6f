"""Chunked, batched prefill on a prefill worker.

Queues, in order::

    waiting (no scratch KV blocks free yet) -> active (one chunk per step) -> sent (final chunk queued) -> done

Every step packs active prompts' next chunks into one forward in arrival order: the
oldest prompt's chunk always, then each next prompt's while the step stays within
``step_tokens`` and ``max_batch`` prompts; the first chunk that does not fit ends the step,
so a later prompt never overtakes an earlier one. On a CPU a forward is compute-bound from a few
dozen tokens, so packing the chunks of prompts that arrived together into every step (as this
scheduler once did) only made each of them wait for all the others: a burst of six 427-token
prompts on the bench model got their first tokens together, 17 s on (bench/RESULTS.md). In
order, a prompt's wait is the work queued ahead of it, which is what the gateway prices
(``cm.queued_prefill_ms``), and no prompt admitted later adds to it.

After each step, each prompt's finished chunk is read out of the local scratch pool and
handed to its ``KVSender`` at once as a ``ReadyChunk`` (eager send: this scheduler decides
what is ready, the sender frames it and moves the bytes); when the last chunk is done the
first token is sampled and travels with it, with the prompt's rope delta. A job's prompt is a
``PreparedPrompt`` (spliced embeddings, M-RoPE positions, DeepStack rows): each chunk is its
``item(start, end, blocks)``. On a model with sliding-window layers (``trim_sliding``, on by
default) a chunk carries those layers' KV only from the prompt's ``KVLayout.window_from`` on:
decode never reads older positions there. On a windowed pool (``EPD_SLIDING_WINDOW_KV``) a job's
sliding layers live in rings sized for its own chunk (``longest_write``), and each chunk is read
out before the next overwrites it. Scratch blocks are freed as soon as the last chunk has been
read out, on every path (done, cancelled, failed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.model import grammar
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import PreparedPrompt, VLMAdapter
from runtime.model.sampling import SampledToken, SamplingContext, SamplingParams, for_choice, sample
from runtime.worker import state_parts, torch_thread
from runtime.worker.background_loop import start_loop, stop_loop
from runtime.worker.timing_log import TimingLog
from runtime.worker.tracing import current_context, record_span

from .kv_sender import FinalChunk, KVSender, ReadyChunk

log = logging.getLogger("epd.prefill")


@dataclass(slots=True, eq=False)  # identity: membership tests must not compare tensors
class PrefillJob:
    request_id: str
    prompt: PreparedPrompt           # [T] tokens ready to run: embeddings, positions, DeepStack rows
    sampling: SamplingParams
    chunk_tokens: int
    sender: KVSender                 # frames and sends what this job's steps make ready
    prompt_ids: list[int] = field(default_factory=list)   # what sampling reads of the prompt (repetition_penalty)
    blocks: list[int] | None = None
    rings: list[list[int]] | None = None   # windowed pool: its sliding layers' rings (sized for its chunk)
    state_slot: int | None = None    # hybrid decoders: the linear layers' state, carried chunk to chunk
    next_start: int = 0
    chunk_index: int = 0
    first_token: int | None = None
    compute_ms: float = 0.0
    cancelled: bool = False
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    trace: Any = field(default_factory=current_context)   # its Prefill RPC's trace context (None: tracing off)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def longest_write(self) -> int:
        """The most positions one of its forwards writes: a chunk, or an image span kept whole."""
        return max(self.chunk_tokens, self.prompt.longest_image_span)


class PrefillScheduler:
    def __init__(self, adapter: VLMAdapter, pool: KVBlockPool, *, max_batch: int = 8, step_tokens: int = 256,
                 timings: TimingLog | None = None, trim_sliding: bool = True):
        self.adapter = adapter
        self.step_tokens = step_tokens   # a step's prompt tokens at most (its first chunk goes whatever its size)
        self.trim_sliding = trim_sliding   # False only to measure the saving (bench/sliding_window_handoff.py)
        self.pool = pool
        self.max_batch = max_batch
        # hybrid decoders: a state slot per active job beside its scratch blocks, freed with them
        self.states = adapter.new_state_slots(max(2 * max_batch, 8))
        self.timings = timings or TimingLog()
        self.waiting: list[PrefillJob] = []
        self.active: list[PrefillJob] = []
        self.max_observed_batch = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def submit(self, job: PrefillJob) -> None:
        if self.pool.pages_for(job.prompt_len, job.longest_write) > self.pool.num_blocks:
            raise ValueError(f"prompt of {job.prompt_len} tokens exceeds this prefill worker's scratch KV pool")
        self.waiting.append(job)
        self._wake.set()

    def cancel(self, job: PrefillJob) -> None:
        job.cancelled = True
        self._wake.set()

    async def first_token(self, job: PrefillJob, sending: asyncio.Future) -> int:
        """``job``'s first token once its last chunk is computed and ``sending`` (its KV transfer) has
        ended well. A transfer that ends first (decode gone, or the deadline reached while the prompt
        waited its turn) cancels the job at once, so nothing queued behind it waits for a prompt whose
        KV nobody can take, and its failure (``TransferBroken``) is raised."""
        await asyncio.wait({job.done, sending}, return_when=asyncio.FIRST_COMPLETED)
        if not job.done.done():
            self.cancel(job)
            await sending
        token = await job.done
        await sending
        return token

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + len(self.active)

    @property
    def queued_tokens(self) -> int:
        return sum(j.prompt_len - j.next_start for j in (*self.waiting, *self.active))

    def start(self) -> None:
        self._task = start_loop(self._loop(), "prefill-scheduler")

    async def stop(self) -> None:
        await stop_loop(self._task)
        for job in [*self.waiting, *self.active]:
            self._finish(job, RuntimeError("prefill worker stopping"))

    async def _loop(self) -> None:
        while True:
            self._admit()
            if not self.active:
                self._wake.clear()
                await self._wake.wait()
                continue
            spans = self._next_spans()
            try:
                await self._step(spans)
            except Exception as exc:
                log.exception("prefill step failed")
                for job, _, _ in spans:
                    self._finish(job, exc)

    def _next_spans(self) -> list[tuple[PrefillJob, int, int]]:
        """This step's chunks ``(job, start, end)``: the oldest active prompt's next chunk, then each
        next prompt's in arrival order while the step holds at most ``step_tokens`` tokens and
        ``max_batch`` prompts (the first that does not fit ends it). A chunk never splits a
        bidirectional image span (``PreparedPrompt.chunk_end``), so a first chunk may pass the budget."""
        spans: list[tuple[PrefillJob, int, int]] = []
        tokens = 0
        for job in self.active:
            end = job.prompt.chunk_end(job.next_start, job.chunk_tokens)
            if spans and (tokens + end - job.next_start > self.step_tokens or len(spans) == self.max_batch):
                break
            spans.append((job, job.next_start, end))
            tokens += end - job.next_start
        return spans

    def _admit(self) -> None:
        for job in [j for j in (*self.waiting, *self.active) if j.cancelled]:
            self._finish(job, asyncio.CancelledError())
        for job in list(self.waiting):
            if self.states is not None and self.states.free_slots == 0:
                break
            got = self.pool.allocate_sequence(job.prompt_len, chunk=job.longest_write)
            if got is None:
                break  # FIFO: later prompts wait behind the first that does not fit
            job.blocks, job.rings = got
            job.state_slot = None if self.states is None else self.states.allocate()
            self.waiting.remove(job)
            self.active.append(job)

    async def _step(self, spans: list[tuple[PrefillJob, int, int]]) -> None:
        started, started_ns = time.perf_counter(), time.time_ns()
        chunks, first_tokens, states = await torch_thread.run(self._forward, spans)
        step_ms = (time.perf_counter() - started) * 1000
        ended_ns = time.time_ns()
        for job, start, end in spans:
            record_span("prefill.chunk", job.trace, started_ns, ended_ns, **{
                "epd.request_id": job.request_id, "epd.chunk": job.chunk_index, "epd.tokens": end - start,
                "epd.batch": len(spans)})
        self.max_observed_batch = max(self.max_observed_batch, len(spans))
        self.timings.record("prefill", sum(e - s for _, s, e in spans), step_ms)
        for (job, start, end), kv, first, state in zip(spans, chunks, first_tokens, states):
            job.compute_ms += step_ms
            if job.cancelled:
                continue
            last = end == job.prompt_len
            final = FinalChunk(job.chunk_index + 1, first[0], job.compute_ms, job.prompt.rope_delta,
                               state_parts=tuple(state), others=tuple(first[1:])) if last else None
            job.sender.send(ReadyChunk(job.chunk_index, start, end, kv, final, self._sliding_from(job)))
            job.next_start, job.chunk_index = end, job.chunk_index + 1
            if last:
                job.first_token = first[0].token_id
                job.sender.finish()
                self._finish(job, None)

    def _forward(self, spans):
        items = [job.prompt.item(s, e, job.blocks, rings=job.rings) for job, s, e in spans]
        for item, (job, _, _) in zip(items, spans):
            item.state_slot = job.state_slot
        logits = self.adapter.forward_packed(self.pool, items, self.states)
        states = [state_parts.to_pb(self.states.read(job.state_slot)) if job.state_slot is not None and e == job.prompt_len
                  else [] for job, _, e in spans]
        # pool.read already copied out of the pool (.cpu() copies only for a GPU pool): send that buffer as is
        payloads = [memoryview(self._read(job, s, e).cpu().view(torch.uint8).numpy()).cast("B") for job, s, e in spans]
        firsts = [None if l is None else self._sample_first(job, l) for l, (job, _, _) in zip(logits, spans)]
        return payloads, firsts, states

    def _sliding_from(self, job: PrefillJob) -> int:
        return self.pool.layout.window_from(job.prompt_len) if self.trim_sliding else 0

    def _read(self, job: PrefillJob, start: int, end: int) -> torch.Tensor:
        """The chunk's wire bytes: dense, or with sliding layers trimmed to the window decode needs."""
        sliding_from = self._sliding_from(job)
        if sliding_from <= start and self.pool.layout.uniform:
            return self.pool.read(job.blocks, start, end, job.rings)
        return self.pool.read_wire(job.blocks, start, end, self.pool.layout.layer_from(start, end, sliding_from), job.rings)

    def _sample_first(self, job: PrefillJob, logits: torch.Tensor) -> list[SampledToken]:
        """The first token of each of the request's ``n`` choices (no output yet; choice i samples with
        ``for_choice``), with its logprobs when asked for: they travel with the last chunk."""
        ctx = SamplingContext(job.prompt_ids, (), self.adapter.eos_token_ids)
        allowed = self._first_allowed(job)
        return [sample(logits, for_choice(job.sampling, i), ctx, job.prompt_len, allowed) for i in range(job.sampling.n)]

    def _first_allowed(self, job: PrefillJob) -> torch.Tensor | None:
        """The grammar's mask for the first token (a fresh matcher: nothing is sampled before it)."""
        if not job.sampling.grammar:
            return None
        return grammar.Matcher(job.sampling.grammar, grammar.model_vocabulary(self.adapter)).allowed()

    def _finish(self, job: PrefillJob, error: BaseException | None) -> None:
        """Retire a job from the scheduler: scratch blocks back exactly once, future resolved once."""
        if job in self.waiting:
            self.waiting.remove(job)
        if job in self.active:
            self.active.remove(job)
        if job.blocks is not None:
            self.pool.free(self.pool.owned_pages(job.blocks, job.rings))
            job.blocks = job.rings = None
        if job.state_slot is not None:
            self.states.free(job.state_slot)
            job.state_slot = None
        if error is not None:
            job.sender.abort()
        if not job.done.done():
            if error is None:
                job.done.set_result(job.first_token)
            else:
                job.done.set_exception(error)

