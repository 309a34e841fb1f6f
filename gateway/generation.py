"""One request's token stream as the HTTP layer sees it: counted, timed, detokenized, stopped.

``Generation`` owns the backend's event generator for its request (see
``gateway.chat_backend`` for the rules) and is the one place that decides a
request's ``finish_reason``:

* ``"stop"``  — the backend said so (EOS), or a ``stop`` string matched here;
* ``"length"`` — the backend said so, or ``max_tokens`` tokens have arrived
  (extra tokens from a misbehaving backend are dropped, not sent).

It also records the per-request metrics (TTFT, ITL per token, end-to-end,
success by finish reason) and assembles the TTFT breakdown: the backend's
entries plus ``gateway_ms`` (arrival -> job handed to the backend: body,
images, tokenization) and ``ttft_ms`` (arrival -> first token here).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from runtime.model.sampling import SampledToken

from .chat_backend import ChatJob, TokenEvent
from .detokenize import IncrementalDetokenizer
from .errors import ApiError
from .http_metrics import HttpMetrics

log = logging.getLogger("epd.gateway")

FINISH_REASONS = ("stop", "length")
DRAIN_TIMEOUT_S = 5.0   # how long a finished backend generator may take to run its cleanup


class Generation:
    """Consumes one backend event stream: counts, detokenizes, stops, times; owns the generator."""

    def __init__(self, job: ChatJob, events: AsyncIterator[TokenEvent], detok: IncrementalDetokenizer,
                 metrics: HttpMetrics, submitted_s: float):
        self.job = job
        self.events = events
        self.detok = detok
        self.metrics = metrics
        self.submitted_s = submitted_s
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.ttft_breakdown: dict[str, float] = {}
        self._last_s: float | None = None   # when the previous event arrived; None before the first
        self._backend_finished = False      # the backend sent the finish_reason (not a cut made here)
        self._logprobs: list[SampledToken] = []   # of the tokens consumed since the last take_logprobs()

    @property
    def backend_finished(self) -> bool:
        """Whether the backend itself sent this reply's finish reason (not a cut made here)."""
        return self._backend_finished

    async def first_event(self, grace_s: float) -> TokenEvent:
        """The first event, or the error that replaces it; the gateway's own deadline guard included."""
        remaining = self.job.ttft_deadline_s - time.monotonic() + grace_s
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                return await anext(self.events)
        except TimeoutError:
            raise ApiError(504, "time-to-first-token deadline exceeded (no token from the backend in time)",
                           "timeout_error", None, "deadline_exceeded") from None
        except StopAsyncIteration:
            raise ApiError(502, "backend ended the request without a token", "server_error", None, "backend_failure") from None

    async def close(self) -> None:
        """Release the backend's generator. Idempotent.

        When the backend itself finished the request, its generator is first run
        to its end, so that its cleanup runs as on any normal end; otherwise (stop
        string, ``max_tokens`` cut here, client gone, error) ``aclose()`` is the
        cancel signal.
        """
        try:
            if self._backend_finished:
                self._backend_finished = False
                await self._drain()
        finally:   # a cancelled drain (the client gone meanwhile) still closes it
            await self.events.aclose()  # type: ignore[attr-defined]  # ChatBackend.generate is an async generator

    async def _drain(self) -> None:
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                await anext(self.events)
            log.warning("request %s: backend sent an event after its finish_reason; closing it", self.job.request_id)
        except (StopAsyncIteration, TimeoutError):
            pass
        except Exception:  # the answer is complete; a cleanup fault behind it must not turn it into an error
            log.exception("request %s: backend failed while finishing", self.job.request_id)

    def consume(self, event: TokenEvent) -> str:
        """Account for one event; return the text it adds. Sets ``finish_reason`` on the last one."""
        now = time.monotonic()
        room = self.job.max_tokens - self.completion_tokens
        truncated = len(event.token_ids) > room
        ids = list(event.token_ids[:room])
        if self._last_s is None:
            self._on_first(event, now)
            self.metrics.generation_tokens.inc(len(ids))
        else:
            self.metrics.observe_tokens(now - self._last_s, len(ids))
        self._last_s = now
        self.completion_tokens += len(ids)
        if event.logprobs:
            self._logprobs.extend(event.logprobs[: len(ids)])
        text = self.detok.add(ids)
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif truncated or event.finish_reason is not None or self.completion_tokens >= self.job.max_tokens:
            reason = "length" if truncated else (event.finish_reason or "length")
            self._backend_finished = not truncated and event.finish_reason is not None
            if reason not in FINISH_REASONS:
                log.warning("request %s: backend finish_reason %r read as 'stop'", self.job.request_id, reason)
                reason = "stop"
            self.finish_reason = reason
            text += self.detok.flush()
        if self.finish_reason is not None:
            self.metrics.e2e.observe(now - self.job.arrival_s)
            self.metrics.success.labels(finished_reason=self.finish_reason).inc()
        return text

    def take_logprobs(self) -> list[SampledToken]:
        """The logprobs of the tokens consumed since the last call (empty when the request asked for none)."""
        taken, self._logprobs = self._logprobs, []
        return taken

    def _on_first(self, event: TokenEvent, now: float) -> None:
        ttft = now - self.job.arrival_s
        self.metrics.observe_ttft(ttft)
        breakdown = dict(event.ttft_breakdown or {})
        breakdown.setdefault("gateway_ms", (self.submitted_s - self.job.arrival_s) * 1e3)
        breakdown.setdefault("ttft_ms", ttft * 1e3)
        self.ttft_breakdown = {k: round(float(v), 3) for k, v in breakdown.items()}

    def ended_without_finish(self) -> str:
        """The backend stopped without a finish reason: infer one (and say so in the log)."""
        log.warning("request %s: backend ended without a finish_reason", self.job.request_id)
        self.finish_reason = "length" if self.completion_tokens >= self.job.max_tokens else "stop"
        self.metrics.e2e.observe(time.monotonic() - self.job.arrival_s)
        self.metrics.success.labels(finished_reason=self.finish_reason).inc()
        return self.detok.flush()

    async def texts(self, first: TokenEvent) -> AsyncIterator[str]:
        """Text pieces from ``first`` on until ``finish_reason`` is set; may yield ""."""
        event = first
        while True:
            yield self.consume(event)
            if self.finish_reason is not None:
                return
            try:
                event = await anext(self.events)
            except StopAsyncIteration:
                yield self.ended_without_finish()
                return
