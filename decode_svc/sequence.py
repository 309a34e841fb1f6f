"""One decoding sequence and the events it streams (``scheduler.py`` moves them; nothing else does).

A ``Sequence`` is one choice of one request on this decode worker: the lease of the reservation
generation whose blocks it writes, its block table (and, on a windowed pool, its rings), its
sampling parameters and output, and, while it prefills here, its prompt. Its ``status`` is
changed only by the ``DecodeScheduler``. A ``StepEvent`` is what one step emits for it: its new
tokens, and on its last event the finished status.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from runtime.model import grammar
from runtime.model.model_adapter import PreparedPrompt
from runtime.model.sampling import SampledToken, SamplingParams

from .request_status import DecodeStatus, finish_reason
from .reservations import Lease


@dataclass(slots=True)
class StepEvent:
    token_ids: list[int]
    end: DecodeStatus | None = None    # the sequence's finished status on its last event
    detail: str = ""
    logprobs: list[SampledToken] = field(default_factory=list)   # one per token when the request asked
    index: int = 0                     # the choice (n > 1) these tokens and this end belong to

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.end)


@dataclass(slots=True, eq=False)  # identity: membership tests must not compare tensors
class Sequence:
    request_id: str
    lease: Lease                       # the reservation generation whose blocks this sequence writes
    blocks: list[int]
    prompt_len: int
    max_tokens: int
    sampling: SamplingParams
    rope_delta: int = 0                # M-RoPE offset of every token after the prompt (verified; 0 for 1-D)
    prompt_ids: list[int] = field(default_factory=list)   # what sampling reads of the prompt (repetition_penalty)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    output: list[int] = field(default_factory=list)       # every token emitted, the first (prefill's) included
    # colocated prefill state: the prompt still to run, from `prefilled` on
    prompt: PreparedPrompt | None = None
    prefilled: int = 0
    prefill_chunk: int | None = None   # most prompt tokens per step (the request's chunk size)
    long_prompt: bool = False          # over a chunk to prefill here: drains at the long-prompt budget to its end
    first_token_deadline_s: float = math.inf   # monotonic; colocated prompts are ordered by it when at risk (``prefill_order``)
    first_step_ms: float | None = None
    matcher: grammar.Matcher | None = None   # the grammar's state after ``output`` (constrained requests)
    shared: int = 0                    # leading blocks that are cached KV (read-only, referenced)
    rings: list[list[int]] | None = None   # windowed pool: its own ring pages (sliding-window layers)
    state_slot: int | None = None      # hybrid decoders: its reservation's linear-attention state slot
    index: int = 0                     # its choice (n > 1): choices share one events queue, told apart by index
    forks: list["Sequence"] = field(default_factory=list)   # colocated choice 0: choices forked when its prompt is in
    ended_by_gateway: bool = False     # n > 1: the gateway ended this choice (its cancellation is no failure)
    _status: DecodeStatus = field(default=DecodeStatus.RECEIVING, init=False)   # DecodeScheduler moves it

    @property
    def status(self) -> DecodeStatus:
        """RECEIVING until the scheduler takes it, then PREFILLING / RUNNING, then a FINISHED_* status."""
        return self._status

    @property
    def reservation_id(self) -> str:
        return self.lease.reservation_id

    @property
    def kv_written(self) -> int:
        """Leading positions whose KV completed steps (or the verified transfer) wrote."""
        return self.prompt_len + len(self.output) - 1 if self.output else self.prefilled

    @property
    def next_position(self) -> int:
        """Position of the last sampled token (its KV is written by the next step)."""
        return self.prompt_len + len(self.output) - 1


def allowed_mask(seq: Sequence):
    """The token mask its grammar allows next (``None``: unconstrained)."""
    return None if seq.matcher is None else seq.matcher.allowed()
