"""Continuous batching on a decode worker.

Queues, in order (moving a sequence from one to the next IS its state change; its
``DecodeStatus``, ``request_status.py``, names the queue and only this scheduler moves it)::

    reservations (transfer in flight; see reservations.py)
        └─ verified ─> insert() ─> running (RUNNING) ─> retired (FINISHED_*)
    colocated prompts ─> insert_colocated() ─> prefilling (PREFILLING, chunked, interleaved with decode steps) ─> running

One step = one packed forward holding one new token for every running sequence
plus at most one prompt chunk per prefilling sequence (bounded by a token
budget: while sequences decode, ``step_budget.StepBudget`` prices the prompt tokens a
step may carry so it stays near a decode step's own time), so a long colocated prompt
is spread across steps instead of stalling its neighbours. A step with at least as many
prompts waiting as sequences decoding refills the batch in one go (the step budget's refill
budget, for the short prompts it finishes: a prompt longer than a chunk drains at the usual
budget to its last token, whose chunk its decoding neighbours would otherwise take as one gap);
before it, the loop waits up to ``REFILL_WAIT_STEPS`` decode steps for the colocated
prompts already on their way here (reserved, their images still being encoded or fetched:
``prompts_on_the_way``), so a burst whose requests reach this worker a few milliseconds apart
starts decoding in one step rather than in groups that stay staggered, each later group's
prompts a step beside the earlier groups' decoders. The budget goes to the prompts in
``prefill_order``'s order: least remaining prompt first, those whose first-token deadline is at
risk before the rest. A colocated prompt is a ``PreparedPrompt``
(embeddings, M-RoPE positions, DeepStack rows); each chunk is its ``item``. Every
decode token carries its sequence's ``rope_delta`` (M-RoPE: position = index +
delta; 0 for 1-D families), verified before the sequence was handed over. Sequences join and leave only at step
boundaries; tokens are pushed to each sequence's queue after every step.

Threading: the forward runs in a worker thread; all bookkeeping happens on the
event loop between steps, so no lock is needed. ``cancel`` only marks a sequence:
it leaves at the next step boundary, never while a forward may be writing its
blocks. Retiring a sequence (FINISHED_STOPPED, _LENGTH, _CANCELLED, _ABORTED or
_ERROR) calls the ``on_retire`` callback exactly once, which releases its reservation.

Leases: every sequence carries the ``Lease`` of the reservation generation it was
started for. Joining the batch and every step (on the event loop, right before the
forward is dispatched) check that the pool's blocks still carry that lease's owner
token; a sequence whose lease is gone (released, re-armed or expired under it) is
retired FINISHED_ABORTED and never written — whatever path forgot to stop it.

Hybrid decoders: each sequence also writes its reservation's state slot (``state_slot``: the
linear-attention layers' state), which every step's forward updates in place; a colocated
prompt's chunks carry it from chunk to chunk (``runtime/model/linear_attention.py``).

Choices (``n`` > 1): each choice is its own ``Sequence`` (its ``index``, its sampling
parameters, output, matcher), all on one events queue. A disaggregated request's choices are
inserted together once the transfer is verified, each with the first token prefill sampled
for it; a colocated one prefills choice 0 only, with the others waiting in its ``forks``:
the step that completes the prompt samples every choice's first token from the same logits
(and the same grammar mask), and ``fork`` copies the last partial prompt block into each
other choice's own block before any step writes past the prompt. A choice retires on its
own; choices still waiting end with their prompt. The gateway may end a running choice early
(``retire_choices``: a stop string or its own length matched there): it retires FINISHED_CANCELLED
with ``ended_by_gateway`` set, at the next step boundary, while the other choices run on; such
retirements are counted (``choices_retired_early``).

Windowed pool: a sequence also writes its own ``rings`` (the sliding-window layers' last
positions, ``runtime/model/kv_pool.py``); a fork gets a copy of its parent's rings.

Prefix cache: a sequence's first ``shared`` blocks are cached KV it only reads (its
reservation holds references on them; the lease check covers the rest). A colocated
sequence whose reservation reused a cached prefix starts prefilling at ``prefilled =
cached tokens``. ``kv_written`` is how many leading positions hold KV that completed
steps wrote (what its retirement may hand to the cache).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from runtime.model import grammar
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import PackedItem, PreparedPrompt, VLMAdapter
from runtime.model.sampling import SampledToken, SamplingContext, greedy_tokens, sample
from runtime.model.state_slots import StateSlotPool
from runtime.worker import torch_thread
from runtime.worker.background_loop import start_loop, stop_loop
from runtime.worker.timing_log import TimingLog

from .request_status import DecodeStatus
from .prefill_order import prefill_order
from .sequence import Sequence, StepEvent, allowed_mask
from .step_budget import StepBudget

__all__ = ["DecodeScheduler", "Sequence", "StepEvent"]

log = logging.getLogger("epd.decode")

# Before a refill step, how long (in decode steps, the step budget's ``decode_ms``) the loop may wait
# for colocated prompts on their way. On the bench model a closed-loop burst of 16 short chats
# reached the decode worker over ~0.2 s (intake, encodes): waiting up to one decode step (~40 ms)
# still split some bursts in two, three started all of them together (bench/RESULTS.md).
REFILL_WAIT_STEPS = 3.0


class DecodeScheduler:
    def __init__(self, adapter: VLMAdapter, pool: KVBlockPool, *, states: StateSlotPool | None = None, max_batch: int = 64,
                 prefill_token_budget: int = 256, on_retire: Callable[[Sequence], None] | None = None,
                 timings: TimingLog | None = None, step_delay_s: float = 0.0,
                 prompts_on_the_way: Callable[[], int] = lambda: 0):
        self.adapter = adapter
        self.pool = pool
        self.states = states   # hybrid decoders: the reservations' state slots, updated in place by each step
        self.max_batch = max_batch
        self.prefill_token_budget = prefill_token_budget
        self.step_budget = StepBudget(prefill_token_budget)   # prompt tokens beside running decodes (a refill: twice that)
        self.on_retire = on_retire or (lambda seq: None)
        self.timings = timings or TimingLog()
        self.step_delay_s = step_delay_s   # fault injection (``delay_step_ms``): every step waits first
        self.prompts_on_the_way = prompts_on_the_way   # colocated prompts reserved here, not yet prefilling
        self.refill_waits = 0   # refill steps that waited for prompts on their way
        self._running: list[Sequence] = []
        self._prefilling: list[Sequence] = []
        self._cancelling: set[Sequence] = set()   # marked by cancel(); retired at the next step boundary
        self.max_observed_batch = 0
        self.choices_retired_early = 0   # running choices retired because the gateway ended them
        self.steps = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # -- admission into the batch ----------------------------------------------
    def insert(self, seq: Sequence, first: SampledToken) -> None:
        """A verified handoff joins the batch; its first token (from prefill, with its logprobs) is emitted now."""
        if self._lease_lost(seq) or not self._start_grammar(seq):
            return
        seq.prefilled = seq.prompt_len      # the whole prompt's KV is in its blocks (verified, or prefilled here)
        if self._accept(seq, first):
            seq._status = DecodeStatus.RUNNING
            self._running.append(seq)
        self._wake.set()

    def insert_colocated(self, seq: Sequence, prompt: PreparedPrompt, chunk_tokens: int | None = None) -> None:
        """Prefill here, at most ``chunk_tokens`` (default: the step's token budget) per step."""
        if self._lease_lost(seq) or not self._start_grammar(seq):
            return
        seq.prompt = prompt
        seq.prefill_chunk = chunk_tokens
        seq.long_prompt = seq.prompt_len - seq.prefilled > (chunk_tokens or self.prefill_token_budget)
        seq._status = DecodeStatus.PREFILLING
        self._prefilling.append(seq)
        self._wake.set()

    def fork(self, parent: Sequence, child: Sequence, first: SampledToken) -> None:
        """Choice ``child`` joins from ``parent``'s prompt KV: the full prompt blocks are shared (the same
        block ids in both tables), the last partial one is copied into ``child``'s own block first. Called
        right after ``parent``'s prompt is complete, before any step writes past it."""
        if self._lease_lost(child):
            return
        full, partial = divmod(child.prompt_len, self.pool.block_size)
        if partial:
            self.pool.copy_block(parent.blocks[full], child.blocks[full], owner=child.lease.owner)
        for ring, own in zip(parent.rings or (), child.rings or ()):   # a ring is written by every step: copied whole
            for src, dst in zip(ring, own):
                self.pool.copy_block(src, dst, owner=child.lease.owner)
        self.insert(child, first)

    def _start_grammar(self, seq: Sequence) -> bool:
        """A constrained sequence's matcher, at the grammar's start: it verifies every token from here
        on, the first one from prefill included. A grammar that does not compile retires the sequence."""
        if not seq.sampling.grammar:
            return True
        try:
            seq.matcher = grammar.Matcher(seq.sampling.grammar, grammar.model_vocabulary(self.adapter))
        except grammar.GrammarError as exc:
            self._retire(seq, DecodeStatus.FINISHED_ERROR, f"grammar does not compile: {exc}")
            return False
        return True

    def cancel(self, seq: Sequence) -> None:
        """Mark for removal; it leaves at the next step boundary (or now if idle). No-op unless it is held."""
        if self.holds(seq):
            self._cancelling.add(seq)
            self._wake.set()

    def cancel_reservation(self, reservation_id: str) -> bool:
        """``cancel`` the sequence that runs in ``reservation_id``'s blocks; whether there was one."""
        found = [s for s in (*self._running, *self._prefilling) if s.reservation_id == reservation_id]
        for seq in found:
            self.cancel(seq)
        return bool(found)

    def retire_choices(self, reservation_id: str, generation: int, indices: set[int]) -> int:
        """The gateway ended these choices of the request: ``cancel`` each one still running (a choice the
        gateway ended has sent tokens, so it is RUNNING or already finished); how many were marked."""
        found = [s for s in self._running if s.reservation_id == reservation_id
                 and s.lease.generation == generation and s.index in indices]
        for seq in found:
            seq.ended_by_gateway = True
            self.cancel(seq)
        return len(found)

    # -- queries ----------------------------------------------------------------
    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` is in one of the queues (PREFILLING or RUNNING): then its retirement frees its blocks."""
        return seq.status in (DecodeStatus.PREFILLING, DecodeStatus.RUNNING)

    @property
    def running_seqs(self) -> int:
        return len(self._running)

    @property
    def prefilling_seqs(self) -> int:
        return len(self._prefilling)

    @property
    def queued_prompt_tokens(self) -> list[int]:
        """Each prefilling prompt's tokens still to run (what admission reads to price ``prefill_order``)."""
        return [s.prompt_len - s.prefilled for s in self._prefilling]

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(self.queued_prompt_tokens)

    @property
    def step_prompt_tokens(self) -> int:
        """The prompt tokens the next step may carry (``StepBudget.prefill_tokens`` as things stand)."""
        return self.step_budget.prefill_tokens(min(len(self._running), self.max_batch), len(self._prefilling))

    @property
    def step_long_prompt_tokens(self) -> int:
        """Of those, what the next step may carry for a prompt longer than a chunk and for the prompts it
        does not finish (a long prompt drains at this to its end: a refill widens only the short prompts
        it finishes; ``_step``'s ``partial``)."""
        decoding = min(len(self._running), self.max_batch)
        return min(self.step_prompt_tokens, self.step_budget.stretch_tokens(decoding))

    @property
    def busy(self) -> bool:
        return bool(self._running or self._prefilling)

    # -- the loop ---------------------------------------------------------------
    def start(self) -> None:
        self._task = start_loop(self._loop(), "decode-scheduler")

    async def stop(self) -> None:
        await stop_loop(self._task)
        for seq in [*self._running, *self._prefilling]:
            self._retire(seq, DecodeStatus.FINISHED_CANCELLED, "worker stopping")

    async def _loop(self) -> None:
        while True:
            self._drop_cancelled()
            if not self.busy:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)   # untimed: the fits see the real forward
                self._drop_cancelled()
            await self._wait_to_refill()
            try:
                await self._step()
            except Exception as exc:  # a failed step fails its sequences, never the worker
                log.exception("decode step failed")
                for seq in [*self._running, *self._prefilling]:
                    self._retire(seq, DecodeStatus.FINISHED_ERROR, f"decode step failed: {exc}")

    def _refilling(self) -> bool:
        return bool(self._prefilling) and len(self._prefilling) >= min(len(self._running), self.max_batch)

    async def _wait_to_refill(self) -> None:
        """Before a refill step, wait for the colocated prompts on their way here, at most
        ``REFILL_WAIT_STEPS`` decode steps (none before a decode step has been timed). Every arrival
        wakes the loop; it stops waiting once none is on its way, or the batch no longer refills."""
        if self.step_budget.decode_ms is None or not self._refilling() or not self.prompts_on_the_way():
            return
        self.refill_waits += 1
        end = time.monotonic() + REFILL_WAIT_STEPS * self.step_budget.decode_ms / 1000
        while self._refilling() and self.prompts_on_the_way() and (left := end - time.monotonic()) > 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                break
        self._drop_cancelled()

    def _drop_cancelled(self) -> None:
        cancelling, self._cancelling = self._cancelling, set()
        for seq in cancelling:
            self._retire(seq, DecodeStatus.FINISHED_CANCELLED, "cancelled")

    def _lease_lost(self, seq: Sequence) -> bool:
        """Retire ``seq`` (FINISHED_ABORTED) if its blocks no longer carry its lease's owner token."""
        if self.pool.owns(self.pool.owned_pages(seq.blocks[seq.shared:], seq.rings), seq.lease.owner):
            return False
        log.error("sequence %s lost its reservation %s (generation %d); retired unwritten",
                  seq.request_id, seq.reservation_id, seq.lease.generation)
        self._retire(seq, DecodeStatus.FINISHED_ABORTED, "reservation released while the sequence held it; nothing was written")
        return True

    async def _step(self) -> None:
        # the fence: no await between this check and dispatching the forward below
        for seq in [*self._running, *self._prefilling]:
            self._lease_lost(seq)
        if not self.busy:
            return
        decoding = self._running[: self.max_batch]
        chunks: list[tuple[Sequence, int, int]] = []
        budget = self.step_prompt_tokens          # what Stats reports, so placement prices what the step does
        partial = self.step_long_prompt_tokens    # of it, for long prompts and those this step does not finish
        for seq in prefill_order(self._prefilling, self.step_budget.token_ms, time.monotonic()):
            if budget <= 0 or len(decoding) + len(chunks) >= self.max_batch:
                break
            start = seq.prefilled
            chunk = min(budget, seq.prefill_chunk or self.prefill_token_budget)   # a refill's budget is wider than a chunk
            # a refill widens only the short prompts it finishes: not one it leaves unfinished, and not
            # a long prompt's last chunk (its decoding neighbours would take the whole chunk as one gap)
            drains = seq.long_prompt or start + chunk < seq.prompt_len
            if drains:
                chunk = min(chunk, partial)
                if chunk <= 0:
                    continue
            end = seq.prompt.chunk_end(start, chunk)   # whole image spans
            if drains:
                partial -= end - start
            chunks.append((seq, start, end))
            budget -= end - start

        started = time.perf_counter()
        next_tokens, first_tokens = await torch_thread.run(self._forward, decoding, chunks)
        step_ms = (time.perf_counter() - started) * 1000
        self.steps += 1
        self.max_observed_batch = max(self.max_observed_batch, len(decoding) + len(chunks))
        self.step_budget.observe(len(decoding), sum(e - s for _, s, e in chunks), step_ms)
        # Only pure steps are samples: a step that both decodes and prefills costs more than
        # either part, and would inflate the decode-step and prefill fits alike.
        if decoding and not chunks:
            self.timings.record("decode_step", len(decoding), step_ms)
        elif chunks and not decoding:
            self.timings.record("prefill", sum(e - s for _, s, e in chunks), step_ms)

        for seq, token in zip(decoding, next_tokens):
            if seq in self._cancelling or seq.status.is_finished:
                continue
            self._accept(seq, token)
        for (seq, _, end), tokens in zip(chunks, first_tokens):
            seq.prefilled = end
            if tokens is None or seq in self._cancelling:
                continue
            seq.first_step_ms = step_ms
            self._prefilling.remove(seq)
            seq.prompt = None
            forks, seq.forks = seq.forks, []
            self.insert(seq, tokens[0])
            for child, token in zip(forks, tokens[1:]):
                child.first_step_ms = step_ms
                self.fork(seq, child, token)

    def _forward(self, decoding: list[Sequence], chunks: list[tuple[Sequence, int, int]]):
        items: list[PackedItem] = []
        if decoding:
            ids = torch.tensor([s.output[-1] for s in decoding], dtype=torch.long)
            embeds = self.adapter.embed_tokens(ids.tolist())
            items += [PackedItem(embeds[i: i + 1], s.next_position, s.blocks, rope_delta=s.rope_delta,
                                 state_slot=s.state_slot, rings=s.rings, token_ids=ids[i: i + 1])
                      for i, s in enumerate(decoding)]
        for seq, start, end in chunks:
            item = seq.prompt.item(start, end, seq.blocks, rings=seq.rings)
            item.state_slot = seq.state_slot
            items.append(item)
        logits = self.adapter.forward_packed(self.pool, items, self.states)
        next_tokens = self._sample_decodes(decoding, logits)
        first_tokens = []
        for j, (seq, _, end) in enumerate(chunks):
            row = logits[len(decoding) + j]
            first_tokens.append(None if row is None else
                                [self._sample(s, row, seq.prompt_len, allowed_mask(seq)) for s in (seq, *seq.forks)])
        return next_tokens, first_tokens

    def _sample_decodes(self, decoding: list[Sequence], logits: list) -> list[SampledToken]:
        """Each decode's token (``logits[i]``: ``decoding[i]``'s row); the plain greedy ones in one argmax call."""
        plain = [i for i, s in enumerate(decoding) if s.sampling.plain_greedy and s.matcher is None]
        out: list[SampledToken | None] = [None] * len(decoding)
        if len(plain) > 1:
            for i, token in zip(plain, greedy_tokens([logits[i] for i in plain])):
                out[i] = SampledToken(token)
        return [self._sample(s, logits[i], s.next_position + 1) if out[i] is None else out[i]
                for i, s in enumerate(decoding)]

    def _sample(self, seq: Sequence, logits, position: int, allowed=None) -> SampledToken:
        """The token for ``position``: the pipeline sees the prompt ids it needs and the output so far
        (``allowed``: the mask, when not ``seq``'s own matcher's: a fork's first token takes its parent's)."""
        ctx = SamplingContext(seq.prompt_ids, seq.output, self.adapter.eos_token_ids)
        return sample(logits, seq.sampling, ctx, position, allowed_mask(seq) if allowed is None else allowed)

    # -- retirement -------------------------------------------------------------
    def _accept(self, seq: Sequence, sampled: SampledToken) -> bool:
        """Emit the token (unless it ends the turn) and retire the sequence if it is done. True while it runs on.

        EOS (unless ``ignore_eos``) and the request's ``stop_token_ids`` end the turn and are not content.
        """
        token = sampled.token_id
        if seq.matcher is not None:
            try:
                seq.matcher.advance(token)
            except grammar.GrammarViolation as exc:
                self._retire(seq, DecodeStatus.FINISHED_ERROR, str(exc))
                return False
        if token in seq.sampling.stop_token_ids or (token in self.adapter.eos_token_ids and not seq.sampling.ignore_eos):
            self._retire(seq, DecodeStatus.FINISHED_STOPPED)
            return False
        seq.output.append(token)
        seq.events.put_nowait(StepEvent([token], logprobs=[sampled] if sampled.logprob is not None else [],
                                        index=seq.index))
        if len(seq.output) >= seq.max_tokens or seq.prompt_len + len(seq.output) >= self.adapter.context_length:
            self._retire(seq, DecodeStatus.FINISHED_LENGTH)
            return False
        return True

    def _retire(self, seq: Sequence, end: DecodeStatus, detail: str = "") -> None:
        """Leave the batch for good with the finished status ``end``; once per sequence (later calls are no-ops)."""
        if seq.status.is_finished:
            return
        seq._status = end
        if seq.ended_by_gateway and end is DecodeStatus.FINISHED_CANCELLED:
            self.choices_retired_early += 1
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        self._cancelling.discard(seq)
        seq.prompt = None
        seq.events.put_nowait(StepEvent([], end, detail, index=seq.index))
        self.on_retire(seq)
        forks, seq.forks = seq.forks, []
        for child in forks:     # choices still waiting for this prompt end with it
            self._retire(child, end, detail)

