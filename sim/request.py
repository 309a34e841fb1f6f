"""One simulated request: its shape, where it was placed, and its progress.

A plain ``__slots__`` class (a million are created per benchmark run). The
simulator (and its remote path) owns every field; decode workers read ``rid``, ``kv_need``,
``decode_tokens``, ``prefill_ms``, ``local_chunks`` and keep ``chunk_i`` and
``breach_base`` (the worker's ITL-breach counter when the request joined).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from runtime.policy.loads import RequestShape
from sim.workload import Arrival


class SimRequest:
    __slots__ = (
        "rid", "arrival", "tokens", "output", "images", "cached", "image_tokens", "kv_need", "deadline", "decode_tokens",
        "prefill_ms", "local_chunks", "chunk_i", "breach_base", "worker", "reserved", "prefill_done",
        "chunk_bytes", "chunks_ready", "chunks_sent", "flows", "landed", "resend_full", "attempts", "local",
        "t_first", "t_mark", "t_reserve", "t_send", "shape", "prefill_server", "kv_bytes", "t_admit", "model_ms", "ahead",
    )

    def __init__(self, rid: int, spec: Arrival, ttft_slo_ms: float) -> None:
        self.rid = rid
        self.arrival, self.tokens, self.output, self.images, self.cached, self.image_tokens = spec   # tokens per image
        self.kv_need = self.tokens + self.output
        self.deadline = self.arrival + ttft_slo_ms
        self.decode_tokens = self.output - 1  # the prefill makes the first token (local and remote)
        self.prefill_ms = 0.0
        self.local_chunks: list[float] | None = None
        self.chunk_i = self.breach_base = self.attempts = 0
        self.worker: Any = None  # the DecodeWorker holding (or to hold) its KV
        self.prefill_server: Any = None  # remote: the prefill worker admission chose (None: colocated)
        self.kv_bytes = 0.0  # remote, until its first token: its KV, counted on the link's load
        self.t_admit = 0.0        # with admission: when admitted
        self.model_ms: float | None = 0.0   # ... and the TTFT predicted then (None: the queue was not priced)
        self.ahead = 0            # ... and the admitted requests still waiting for a first token then
        self.reserved = self.prefill_done = self.resend_full = self.local = False
        self.chunk_bytes: list[int] | None = None
        self.chunks_ready = self.chunks_sent = self.flows = self.landed = 0
        self.t_first = self.t_mark = self.t_reserve = self.t_send = 0.0
        self.shape = _shape(self.tokens, self.output, self.images, self.cached, self.image_tokens)  # what placement sees

    @property
    def new_image_tokens(self) -> int:
        """The placeholder tokens of its images to encode (those not in the encoder cache)."""
        return (self.images - self.cached) * self.image_tokens


@lru_cache(maxsize=4096)
def _shape(tokens: int, output: int, images: int, cached: int, image_tokens: int) -> RequestShape:
    """Requests of one shape share one ``RequestShape`` (a read-only snapshot), built and validated once."""
    return RequestShape(tokens, output, images, cached, image_tokens=images * image_tokens,
                        image_tokens_cached=cached * image_tokens)
