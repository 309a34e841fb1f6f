"""What the HTTP layer asks of the machinery behind it, and nothing more.

The HTTP layer (``gateway.app``) turns an OpenAI request into a ``ChatJob`` —
images decoded and checked, prompt tokenized with image placeholders expanded,
sampling and deadlines fixed — and hands it to a ``ChatBackend``. The backend
(``gateway.orchestrator`` in production, ``tests.inprocess_backend`` in tests)
answers with a stream of ``TokenEvent``.

Ownership and cancellation, the one rule both sides follow:

* ``generate(job)`` is an async generator. It raises ``AdmissionRefused`` or
  ``DeadlineExceeded`` *before its first event* when the request cannot be run;
  after the first event it may still raise ``BackendFailure`` or
  ``DeadlineExceeded``.
* The last event carries ``finish_reason``; the generator then ends. With ``n`` > 1
  choices every event names its choice (``index``), each choice's last event carries
  its ``finish_reason``, and the generator ends after the last choice's.
* The HTTP layer closes the generator (``aclose()``) on every path — a normal
  end, a stop string matched, the client gone, the gateway's own deadline — so
  the backend's ``finally`` is where it releases what the request held
  (queue slots, KV leases, encoder work) everywhere. Closing an already
  finished generator is a no-op.
* With ``n`` > 1 a choice the HTTP layer ends itself (a stop string, its ``max_tokens``) is
  told to the backend through ``job.choice_ends``, so the backend can stop generating it while
  the other choices run on; the backend may still send its events, which are ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from PIL import Image

from runtime.model.sampling import SampledToken, SamplingParams


@dataclass(slots=True)
class PreparedImage:
    data: bytes              # raw image bytes as received (cache keys hash the decoded pixels of these)
    image: Image.Image       # decoded from ``data``, validated, not converted (mode may be RGBA, P, L, ...)


class ChoiceEnds:
    """The choices (``n`` > 1) the HTTP layer ended itself, for the backend: ``end`` records one
    (once), ``listen`` hands each one ended so far and every later one to the backend's callback."""

    def __init__(self) -> None:
        self.ended: list[int] = []
        self._listener: Callable[[int], None] | None = None

    def end(self, index: int) -> None:
        if index in self.ended:
            return
        self.ended.append(index)
        if self._listener is not None:
            self._listener(index)

    def listen(self, callback: Callable[[int], None] | None) -> None:
        """``callback`` hears every ended choice from now on (``None``: nobody listens any more)."""
        self._listener = callback
        for index in self.ended if callback is not None else ():
            callback(index)


@dataclass(slots=True)
class ChatJob:
    request_id: str
    token_ids: list[int]     # prompt with image placeholders expanded
    images: list[PreparedImage]   # empty for text-only requests: the encoder is skipped
    max_tokens: int
    sampling: SamplingParams
    ttft_deadline_s: float   # absolute time.monotonic() by which the first token must arrive
    itl_slo_ms: float
    arrival_s: float         # time.monotonic() when the request arrived at the gateway
    # the tenant's encoder-cache namespace: the request's cache_salt, combined with its API key's
    # digest when salting per key (gateway.auth.effective_cache_salt); "" = the shared namespace
    cache_salt: str = ""
    # M-RoPE families (gateway.prompt.BuiltPrompt): each image's grid (t, h, w), empty or one per
    # image (None for 1-D families), and the sequence's rope delta from the gateway's position plan.
    # The workers verify both before insertion, so a job built without them fails loudly, never silently.
    image_grids: list[tuple[int, int, int] | None] = field(default_factory=list)
    rope_delta: int = 0
    # what the backend decided, for the request's log line and the dashboard (gateway/request_journal.py)
    placement: str = ""
    placement_reason: str = ""
    # prefix-cache keys (runtime/model/prefix_keys.py): each image's placeholder count, and the
    # M-RoPE plan's [3, T] positions (None for 1-D families)
    image_tokens: list[int] = field(default_factory=list)
    positions: Any = None
    image_token_id: int = -1     # the placeholder token id (-1: unknown, no prefix-cache keys with images)
    # each image's layout variant (gateway.prompt.BuiltPrompt.image_variants; empty = "" each, the only form of
    # most families): in its cache key and its ImageRef. The workers refuse a variant that is not their family's
    image_variants: list[str] = field(default_factory=list)
    choice_ends: ChoiceEnds = field(default_factory=ChoiceEnds)   # n > 1: choices ended by the HTTP layer


@dataclass(slots=True)
class TokenEvent:
    token_ids: list[int]                             # new tokens (usually one)
    finish_reason: str | None = None                 # "stop" (EOS) or "length", on the last event only
    ttft_breakdown: dict[str, float] | None = None   # on the first event: milliseconds per stage
    logprobs: list[SampledToken] | None = None       # one per token when the request asked for logprobs
    index: int = 0                                   # the choice (n > 1) the tokens and finish_reason are of


class ChatBackend(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, job: ChatJob) -> AsyncIterator[TokenEvent]:
        """An async generator (``aclose()`` is the cancel signal) of events for ``job``; see the module docstring."""
        ...

    def status(self) -> dict: ...

    def healthy(self) -> bool: ...

    def shed_estimate_ms(self) -> float:
        """The wait a new request faces from the work already admitted, as the pre-body shed judges it.

        Checked before the body is even read, so an overloaded gateway sheds with a
        cheap 429 instead of spending its CPU parsing requests it will refuse."""
        ...


class AdmissionRefused(Exception):
    """The request was refused before any work; the client may retry after ``retry_after_s``.
    ``terms``: what admission weighed (milliseconds: ``estimated_ttft_ms``, the reported queue it
    holds, ``estimated_queue_ms``, ``backlog_ms``, ``overrun_ms``, ``remaining_ms``), for the
    request's record; empty where nothing was priced."""

    def __init__(self, status: int, reason: str, retry_after_s: float, terms: dict[str, float] | None = None):
        if status not in (429, 503):
            raise ValueError(f"AdmissionRefused status must be 429 or 503, got {status}")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.terms = dict(terms or {})


class DeadlineExceeded(Exception):
    """The request's TTFT deadline passed (or would pass) before its first token: HTTP 504."""


class BackendFailure(Exception):
    """A server-side fault behind the gateway (worker lost, transfer failed): HTTP 502 or 503."""

    def __init__(self, message: str, status: int = 502):
        if status not in (502, 503):
            raise ValueError(f"BackendFailure status must be 502 or 503, got {status}")
        super().__init__(message)
        self.status = status
