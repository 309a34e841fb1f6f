"""A request's ``n`` > 1 choices as the HTTP layer sees them: one backend stream, one ``Generation`` per choice.

The backend sends every choice's events on one stream, each naming its choice
(``TokenEvent.index``: ``gateway/chat_backend.py``). ``Choices`` takes them in arrival
order and hands each to its choice's own ``Generation`` (its detokenizer and stop
strings, its count against ``max_tokens``, its logprobs and finish reason), so every
rule of a single reply holds per choice. ``events()`` yields ``(index, text)`` in the
order the tokens arrived: a streamed reply interleaves its choices' chunks the same way.

A choice that ends here (a stop string, ``max_tokens``) ignores the rest of its events and is
told to the backend (``job.choice_ends``), which retires it on decode at once (its fork's
blocks freed; ``Decode.Release`` naming the choice) while the others run on.
``completion_tokens`` sums the choices.

Metrics count the request once: every choice's tokens and gaps, but one TTFT (the first
token of any choice) and one end-to-end latency and finish (when the last choice ends).

Ownership: ``close`` closes the backend's generator (the cancel signal) on every path; when
the backend itself finished every choice, it is first run to its end, as ``Generation``
does for one reply.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from .chat_backend import BackendFailure, ChatJob, TokenEvent
from .detokenize import IncrementalDetokenizer
from .generation import DRAIN_TIMEOUT_S, Generation
from .http_metrics import HttpMetrics


class _NoEvents:
    """A per-choice ``Generation``'s own event source: ``Choices`` feeds it instead, so it pulls nothing."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    async def aclose(self) -> None:
        return None


class _RequestMetrics:
    """What the choices' ``Generation``s record, counted per request: tokens and gaps per choice, the
    TTFT once (the first choice's first token), the end-to-end latency and the finish once (the last
    choice's)."""

    def __init__(self, metrics: HttpMetrics, n: int):
        self._metrics, self._left, self._ttft_seen = metrics, n, False
        self.generation_tokens = metrics.generation_tokens
        self.e2e, self.success = self, self

    def observe_ttft(self, ttft_s: float) -> None:
        if not self._ttft_seen:
            self._ttft_seen = True
            self._metrics.observe_ttft(ttft_s)

    def observe_tokens(self, gap_s: float, count: int) -> None:
        self._metrics.observe_tokens(gap_s, count)

    def observe(self, e2e_s: float) -> None:   # as e2e: each choice ends once; the last one is the request's
        self._left -= 1
        if self._left == 0:
            self._metrics.e2e.observe(e2e_s)

    def labels(self, finished_reason: str):     # as success: counted with the last choice's end (just observed)
        return self._metrics.success.labels(finished_reason=finished_reason) if self._left == 0 else _NotCounted


class _NotCounted:
    @staticmethod
    def inc() -> None:
        return None


class Choices:
    def __init__(self, stream: Generation, first: TokenEvent, detoks: list[IncrementalDetokenizer],
                 metrics: HttpMetrics, submitted_s: float):
        self.stream = stream               # owns the backend's generator; its own counters stay unused
        self.job: ChatJob = stream.job
        self.first = first
        counted = _RequestMetrics(metrics, len(detoks))
        self.gens = [Generation(self.job, _NoEvents(), d, counted, submitted_s) for d in detoks]  # type: ignore[arg-type]
        self._first_index = first.index
        self._drain = True                 # until the first close

    @property
    def n(self) -> int:
        return len(self.gens)

    @property
    def completion_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.gens)

    @property
    def finish_reason(self) -> str | None:
        """Choice 0's once every choice has one (``None`` while any runs): what the request's record says."""
        return self.gens[0].finish_reason if all(g.finish_reason for g in self.gens) else None

    @property
    def ttft_breakdown(self) -> dict[str, float]:
        return self.gens[self._first_index].ttft_breakdown

    def _consume(self, event: TokenEvent) -> tuple[int, str] | None:
        if not 0 <= event.index < self.n:
            raise BackendFailure(f"backend sent choice {event.index} of {self.n}", 502)
        gen = self.gens[event.index]
        if gen.finish_reason is not None:
            return None            # ended here (stop string, max_tokens): the rest is not sent
        text = gen.consume(event)
        if gen.finish_reason is not None and not gen.backend_finished:
            self.job.choice_ends.end(event.index)   # ended here: decode stops generating it
        return event.index, text

    async def events(self) -> AsyncIterator[tuple[int, str]]:
        """``(index, text)`` per event in arrival order, until every choice has its finish reason."""
        out = self._consume(self.first)
        if out is not None:
            yield out
        while any(g.finish_reason is None for g in self.gens):
            try:
                event = await anext(self.stream.events)
            except StopAsyncIteration:
                for i, g in enumerate(self.gens):
                    if g.finish_reason is None:
                        yield i, g.ended_without_finish()
                return
            out = self._consume(event)
            if out is not None:
                yield out

    async def texts(self) -> list[str]:
        """Every choice's whole text, by index (``events`` to the end)."""
        texts: list[list[str]] = [[] for _ in range(self.n)]
        async for index, text in self.events():
            texts[index].append(text)
        return ["".join(t) for t in texts]

    async def close(self) -> None:
        """Release the backend's generator (idempotent); drained first when the backend finished every choice."""
        finished, self._drain = self._drain and all(g.backend_finished for g in self.gens), False
        try:
            if finished:
                with contextlib.suppress(StopAsyncIteration, TimeoutError):
                    async with asyncio.timeout(DRAIN_TIMEOUT_S):
                        await anext(self.stream.events)
        finally:   # a cancelled drain (the client gone meanwhile) still closes it
            await self.stream.close()
