"""Simulated arrivals: Poisson at a rate, bursts at fixed times, or a trace file.

An arrival is a plain tuple ``(t_ms, prompt_tokens, output_tokens, images,
cached_images, image_tokens)``; ``image_tokens`` is each image's placeholder tokens (the
unit an encode is priced in), and ``prompt_tokens`` already includes ``images x image_tokens``.
``Workload.arrivals()`` yields them in time order, lazily, so a million requests
never sit in memory at once. Everything is a pure function of ``seed``.

Trace files: JSON lines, one request per line, fields ``t_s``, ``prompt_tokens``,
``output_tokens`` and optionally ``images``, ``cached_images`` and ``image_tokens`` (each image's; the
load's ``image_tokens`` when absent).
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sim.distributions import Distribution, fixed

Arrival = tuple[float, int, int, int, int, int]


class WorkloadError(ValueError):
    """A workload, burst or trace is malformed."""


@dataclass(slots=True, frozen=True)
class RequestMix:
    """Per-request distributions; each image adds ``image_tokens`` prompt tokens (and is encoded as that
    many) and is an encoder-cache hit with probability ``cache_hit_ratio``."""

    prompt_tokens: Distribution = field(default_factory=lambda: fixed(6000))
    output_tokens: Distribution = field(default_factory=lambda: fixed(400))
    images: Distribution = field(default_factory=lambda: fixed(0, minimum=0))
    image_tokens: int = 256
    cache_hit_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.image_tokens < 0:
            raise WorkloadError(f"image_tokens must be >= 0, got {self.image_tokens}")
        if not 0.0 <= self.cache_hit_ratio <= 1.0:
            raise WorkloadError(f"cache_hit_ratio must be in [0, 1], got {self.cache_hit_ratio}")


@dataclass(slots=True, frozen=True)
class Burst:
    """``count`` extra requests arriving at ``at_s`` (spread evenly over ``spread_s``);
    prompt/output lengths default to the mix."""

    at_s: float
    count: int
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    spread_s: float = 0.0

    def __post_init__(self) -> None:
        if self.at_s < 0 or self.count < 1 or self.spread_s < 0:
            raise WorkloadError(f"burst needs at_s >= 0, count >= 1, spread_s >= 0: {self}")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise WorkloadError(f"burst {name} must be >= 1, got {value}")

    @classmethod
    def parse(cls, spec: str) -> Burst:
        """``AT_S:COUNT[:PROMPT_TOKENS[:OUTPUT_TOKENS[:SPREAD_S]]]`` (empty fields: the mix)."""
        parts = spec.split(":")
        if not 2 <= len(parts) <= 5:
            raise WorkloadError(f"burst {spec!r}: expected AT_S:COUNT[:PROMPT[:OUTPUT[:SPREAD_S]]]")
        try:
            at, count = float(parts[0]), int(parts[1])
            prompt = int(parts[2]) if len(parts) > 2 and parts[2] else None
            output = int(parts[3]) if len(parts) > 3 and parts[3] else None
            spread = float(parts[4]) if len(parts) > 4 and parts[4] else 0.0
        except ValueError:
            raise WorkloadError(f"burst {spec!r}: fields must be numbers") from None
        return cls(at, count, prompt, output, spread)


@dataclass(slots=True, frozen=True)
class Workload:
    """Poisson background (``requests`` at ``rate`` per second) plus bursts, or a trace."""

    mix: RequestMix = field(default_factory=RequestMix)
    rate: float = 1.0
    requests: int = 1000
    bursts: tuple[Burst, ...] = ()
    trace: tuple[Arrival, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.trace is None and (self.rate <= 0 or self.requests < 0):
            raise WorkloadError(f"need rate > 0 and requests >= 0, got rate={self.rate}, requests={self.requests}")
        if self.total == 0:
            raise WorkloadError("the workload has no requests")

    @property
    def total(self) -> int:
        if self.trace is not None:
            return len(self.trace)
        return self.requests + sum(b.count for b in self.bursts)

    def span_ms(self) -> float:
        """Roughly when the last request arrives."""
        if self.trace is not None:
            return self.trace[-1][0] if self.trace else 0.0
        ends = [1000.0 * self.requests / self.rate] + [1000.0 * (b.at_s + b.spread_s) for b in self.bursts]
        return max(ends)

    def arrivals(self) -> Iterator[Arrival]:
        if self.trace is not None:
            return iter(self.trace)
        if not self.bursts:
            return self._poisson()
        return heapq.merge(self._poisson(), self._bursts())

    def _request(self, t_ms: float, prompt: int, output: int, n_images: int, rng: random.Random) -> Arrival:
        hit = self.mix.cache_hit_ratio
        cached = sum(1 for _ in range(n_images) if rng.random() < hit) if n_images and hit else 0
        return (t_ms, prompt + n_images * self.mix.image_tokens, output, n_images, cached, self.mix.image_tokens)

    def _poisson(self) -> Iterator[Arrival]:
        gaps = random.Random(f"epd-sim/{self.seed}/arrivals")
        rng = random.Random(f"epd-sim/{self.seed}/mix")
        prompt, output = self.mix.prompt_tokens.sampler(rng), self.mix.output_tokens.sampler(rng)
        images = self.mix.images.sampler(rng)
        mean_gap_ms = 1000.0 / self.rate
        uniform, log, t, request = gaps.random, math.log, 0.0, self._request
        for _ in range(self.requests):
            yield request(t, prompt(), output(), images(), rng)
            t += -log(1.0 - uniform()) * mean_gap_ms  # Exp(1) by inversion: what gaps.expovariate(1.0) draws

    def _bursts(self) -> Iterator[Arrival]:
        rng = random.Random(f"epd-sim/{self.seed}/bursts")
        prompt, output = self.mix.prompt_tokens.sampler(rng), self.mix.output_tokens.sampler(rng)
        images = self.mix.images.sampler(rng)
        rows = []
        for burst in self.bursts:
            for i in range(burst.count):
                t = 1000.0 * (burst.at_s + burst.spread_s * i / burst.count)
                p = burst.prompt_tokens if burst.prompt_tokens is not None else prompt()
                o = burst.output_tokens if burst.output_tokens is not None else output()
                rows.append(self._request(t, p, o, images(), rng))
        rows.sort(key=lambda r: r[0])
        return iter(rows)


def load_trace(path: str | Path, image_tokens: int = 256) -> tuple[Arrival, ...]:
    """Read a JSON-lines trace; rows are sorted by time."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc}") from None
    try:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: not JSON lines: {exc}") from None
    rows: list[Arrival] = []
    for n, rec in enumerate(records, 1):
        try:
            t, prompt, output = float(rec["t_s"]), int(rec["prompt_tokens"]), int(rec["output_tokens"])
            images, cached = int(rec.get("images") or 0), int(rec.get("cached_images") or 0)
            each = int(rec.get("image_tokens", image_tokens))
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"{path} row {n}: need t_s, prompt_tokens, output_tokens ({exc})") from None
        if t < 0 or prompt < 1 or output < 1 or not 0 <= cached <= images or (images and each < 1):
            raise WorkloadError(f"{path} row {n}: out of range: {rec}")
        rows.append((1000.0 * t, prompt + images * each, output, images, cached, each))
    if not rows:
        raise WorkloadError(f"{path}: empty trace")
    rows.sort(key=lambda r: r[0])
    return tuple(rows)
