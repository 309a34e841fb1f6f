"""The pipeline's service-time model, calibrated online from measured stage timings.

``CostModel`` answers "how long will this take" for every stage (prefill, chunked
prefill, KV size and transfer, decode step, encode) from four linear fits:

    prefill_ms(tokens)    = a_p + b_p x tokens
    decode_step_ms(batch) = a_d + b_d x batch
    transfer_ms(bytes)    = a_t + b_t x bytes        (a_t: link setup, 1 / b_t: bandwidth)
    encode_ms(images)     = a_e + b_e x images_encoded

Prefill is defined per request: ``prefill_ms(tokens)`` is one prompt's whole
prefill on an idle worker, however many passes (chunks) it takes, so ``a_p`` is
paid once per request and a chunked prefill charges it to the first chunk
(``chunk_ms``). ``epd profile`` fits exactly this: it sums each profiled request's
prefill passes into one (prompt tokens, ms) point. (A worker's per-pass timing
samples, which the gateway observes online, are the same thing for prompts that
fit in one chunk.)

Each fit starts at the prior (a ``ServiceTimes``) and is refit by least squares
from a bounded window of recent observations once it holds ``min_points``
points. Invariants: coefficients are always finite and >= 0 (the transfer slope
and the decode step are > 0); degenerate data (all x equal, negative slope)
never replaces a prior slope with garbage. The simulator, the planner and the
gateway all use this one class. Not thread-safe (the gateway is one asyncio loop).
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path

from runtime import service_times as st
from runtime.service_times import ServiceTimes


class LinearFit:
    """``y = intercept + slope x x`` least-squares over the last ``window`` points.

    Until ``min_points`` observations are held, the prior is returned. With too
    little spread in x only the intercept is refit (the prior slope is kept); a
    negative slope (or a non-positive one when ``positive_slope``) also keeps the
    prior slope; a negative intercept is clamped to 0 and the slope refit through
    the origin. Each observation costs O(1): the window keeps running sums of
    shifted values (recomputed exactly every ``window`` observations, so rounding
    never accumulates).
    """

    __slots__ = (
        "prior_intercept", "prior_slope", "intercept", "slope", "min_points", "positive_slope", "rejected",
        "_points", "_kx", "_ky", "_sx", "_sy", "_sxx", "_sxy", "_since_exact",
    )

    def __init__(self, intercept: float, slope: float, *, window: int, min_points: int, positive_slope: bool = False) -> None:
        if window < 1 or min_points < 1 or min_points > window:
            raise ValueError(f"need 1 <= min_points <= window, got min_points={min_points}, window={window}")
        self.prior_intercept = self.intercept = float(intercept)
        self.prior_slope = self.slope = float(slope)
        self.min_points = min_points
        self.positive_slope = positive_slope
        self.rejected = 0
        self._points: deque[tuple[float, float]] = deque(maxlen=window)
        self._kx = self._ky = 0.0  # shift: sums are of (x - kx), (y - ky)
        self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._since_exact = 0

    @property
    def points(self) -> int:
        return len(self._points)

    @property
    def fitted(self) -> bool:
        return len(self._points) >= self.min_points

    def observe(self, x: float, y: float) -> bool:
        """Add one point; False (and counted in ``rejected``) when it is not finite and >= 0."""
        if not (math.isfinite(x) and math.isfinite(y) and x >= 0 and y >= 0):
            self.rejected += 1
            return False
        x, y = float(x), float(y)
        points = self._points
        if len(points) == points.maxlen:
            self._add(*points[0], sign=-1.0)  # the oldest point leaves the window
        points.append((x, y))
        self._since_exact += 1
        if self._since_exact >= points.maxlen or len(points) == 1:  # type: ignore[operator]
            self._exact_sums()
        else:
            self._add(x, y, sign=1.0)
        self._refit()
        return True

    def _add(self, x: float, y: float, sign: float) -> None:
        dx, dy = x - self._kx, y - self._ky
        self._sx += sign * dx
        self._sy += sign * dy
        self._sxx += sign * dx * dx
        self._sxy += sign * dx * dy

    def _exact_sums(self) -> None:
        n = len(self._points)
        self._kx = sum(p[0] for p in self._points) / n
        self._ky = sum(p[1] for p in self._points) / n
        self._sx = self._sy = 0.0
        self._sxx = sum((p[0] - self._kx) ** 2 for p in self._points)
        self._sxy = sum((p[0] - self._kx) * (p[1] - self._ky) for p in self._points)
        self._since_exact = 0

    def _refit(self) -> None:
        n = len(self._points)
        if n < self.min_points:
            self.intercept, self.slope = self.prior_intercept, self.prior_slope
            return
        dmx, dmy = self._sx / n, self._sy / n  # means of the shifted values
        sxx = self._sxx - n * dmx * dmx  # centered sums
        sxy = self._sxy - n * dmx * dmy
        mx, my = self._kx + dmx, self._ky + dmy
        spread_ok = sxx > 1e-12 * n * max(1.0, mx * mx)
        slope = sxy / sxx if spread_ok else self.prior_slope
        if slope < 0 or (self.positive_slope and slope <= 0):
            slope = self.prior_slope
        intercept = my - slope * mx
        if intercept < 0:
            intercept = 0.0
            sum_xx = sxx + n * mx * mx  # raw sums, for the fit through the origin
            sum_xy = sxy + n * mx * my
            if sum_xx > 0:
                through_origin = sum_xy / sum_xx
                if through_origin > 0 or (through_origin == 0 and not self.positive_slope):
                    slope = through_origin
        self.intercept, self.slope = intercept, slope

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


class CostModel:
    """Service-time estimates for every stage, from a prior plus online observations."""

    __slots__ = ("prefill", "decode_step", "transfer", "encode", "_prior", "_chunk_times")

    _CHUNK_CACHE = 1024  # memoized chunk-time lists kept (see ``chunk_times``)

    def __init__(self, prior: ServiceTimes | None = None, *, window: int = 256, min_points: int = 8) -> None:
        p = prior if prior is not None else ServiceTimes()
        self._prior = p
        self._chunk_times: dict[tuple[int, int, float, float], tuple[float, ...]] = {}
        self.prefill = LinearFit(p.prefill_base_ms, p.prefill_ms_per_token, window=window, min_points=min_points)
        self.decode_step = LinearFit(p.decode_step_base_ms, p.decode_step_ms_per_seq, window=window, min_points=min_points)
        self.transfer = LinearFit(
            p.link_setup_ms, 1000.0 / p.link_bytes_per_s, window=window, min_points=min_points, positive_slope=True
        )
        self.encode = LinearFit(p.encode_base_ms, p.encode_ms_per_image, window=window, min_points=min_points)

    @classmethod
    def from_file(cls, path: str | Path, *, window: int = 256, min_points: int = 2) -> CostModel:
        """Load a service-time file; its measured tables (if any) are fitted over its params."""
        content = st.load(path)
        return cls.from_tables(content.params, content.tables, window=window, min_points=min_points)

    @classmethod
    def from_tables(
        cls, params: ServiceTimes, tables: st.MeasuredTables, *, window: int = 256, min_points: int = 2
    ) -> CostModel:
        window = max(window, min_points, *(len(getattr(tables, n)) for n in st.TABLE_NAMES))
        model = cls(params, window=window, min_points=min_points)
        for fit, points in (
            (model.prefill, tables.prefill),
            (model.decode_step, tables.decode_step),
            (model.transfer, tables.transfer),
            (model.encode, tables.encode),
        ):
            for x, ms in points:
                fit.observe(x, ms)
        return model

    # ---- calibration -------------------------------------------------------------

    def observe_prefill(self, tokens: int, ms: float) -> bool:
        """A worker prefilled ``tokens`` (not counting cached prefix) in ``ms``."""
        return self.prefill.observe(tokens, ms)

    def observe_decode_step(self, batch: int, ms: float) -> bool:
        """One decode step over ``batch`` running sequences took ``ms`` (> 0)."""
        if batch < 1 or not ms > 0:
            self.decode_step.rejected += 1
            return False
        return self.decode_step.observe(batch, ms)

    def observe_transfer(self, nbytes: int, ms: float) -> bool:
        """One KV transfer of ``nbytes`` took ``ms`` end to end (setup included)."""
        return self.transfer.observe(nbytes, ms)

    def observe_encode(self, n_images: int, ms: float) -> bool:
        """The encoder encoded ``n_images`` (cache misses only) in ``ms``."""
        if n_images < 1:
            self.encode.rejected += 1
            return False
        return self.encode.observe(n_images, ms)

    def service_times(self) -> ServiceTimes:
        """The current coefficients as a ``ServiceTimes`` (non-fitted fields from the prior)."""
        return self._prior.replace(
            prefill_base_ms=self.prefill.intercept,
            prefill_ms_per_token=self.prefill.slope,
            # a step always takes time: keep base + slope > 0 even for a degenerate fit
            decode_step_base_ms=max(self.decode_step.intercept, 1e-6 if self.decode_step.slope == 0 else 0.0),
            decode_step_ms_per_seq=self.decode_step.slope,
            link_setup_ms=self.transfer.intercept,
            link_bytes_per_s=1000.0 / self.transfer.slope,
            encode_base_ms=self.encode.intercept,
            encode_ms_per_image=self.encode.slope,
        )

    def calibration(self) -> dict[str, dict[str, float | int | bool]]:
        """Per-stage fit state, for metrics and logs."""
        fits = {"prefill": self.prefill, "decode_step": self.decode_step, "transfer": self.transfer, "encode": self.encode}
        return {
            name: {"points": f.points, "fitted": f.fitted, "intercept": f.intercept, "slope": f.slope, "rejected": f.rejected}
            for name, f in fits.items()
        }

    # ---- stage estimates ---------------------------------------------------------

    @property
    def decode_slots(self) -> int:
        return self._prior.decode_slots

    def prefill_ms(self, tokens: int) -> float:
        """Whole-prompt prefill of ``tokens`` new tokens on an idle worker."""
        return self.prefill.intercept + self.prefill.slope * tokens

    @staticmethod
    def chunk_sizes(tokens: int, chunk_tokens: int) -> list[int]:
        """``tokens`` split into chunks of ``chunk_tokens`` (the last one may be shorter)."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        full, rest = divmod(max(tokens, 0), chunk_tokens)
        return [chunk_tokens] * full + ([rest] if rest else [])

    def chunk_ms(self, chunk: int, first: bool) -> float:
        """Compute time of one prefill chunk; the fixed prefill cost is paid by the first."""
        return (self.prefill.intercept if first else 0.0) + self.prefill.slope * chunk + self._prior.prefill_chunk_overhead_ms

    def chunk_times(self, tokens: int, chunk_tokens: int) -> tuple[float, ...]:
        """``chunk_ms`` of each chunk of ``chunk_sizes(tokens, chunk_tokens)``.

        Memoized: the key includes the prefill fit's current coefficients, so a refit
        never returns stale times (the cache is cleared when it reaches ``_CHUNK_CACHE``).
        """
        fit = self.prefill
        key = (tokens, chunk_tokens, fit.intercept, fit.slope)
        times = self._chunk_times.get(key)
        if times is None:
            if len(self._chunk_times) >= self._CHUNK_CACHE:
                self._chunk_times.clear()
            sizes = self.chunk_sizes(tokens, chunk_tokens)
            times = self._chunk_times[key] = tuple(self.chunk_ms(c, i == 0) for i, c in enumerate(sizes))
        return times

    def chunk_ready_ms(self, tokens: int, chunk_tokens: int) -> list[float]:
        """When each chunk's KV is ready, in ms after a chunked prefill starts."""
        ready, t = [], 0.0
        for c in self.chunk_times(tokens, chunk_tokens):
            t += c
            ready.append(t)
        return ready

    def kv_bytes(self, tokens: int) -> int:
        return self._prior.kv_bytes_per_token * tokens if tokens > 0 else 0

    def transfer_ms(self, nbytes: float, link_share: float = 1.0) -> float:
        """Setup plus payload time, with ``link_share`` (0, 1] of the link's bandwidth."""
        return self.transfer.intercept + self.transfer.slope * nbytes / link_share

    def transfer_done_ms(self, tokens: int, chunk_tokens: int | None = None, link_share: float = 1.0) -> float:
        """When the last KV byte lands, in ms after prefill starts.

        Serial: prefill, then one transfer. Chunked: each chunk is sent when it is
        ready (setup per chunk) and chunks queue behind each other on the link.
        """
        if chunk_tokens is None or chunk_tokens >= tokens:
            return self.prefill_ms(tokens) + self.transfer_ms(self.kv_bytes(tokens), link_share)
        link_free = 0.0
        for ready, chunk in zip(self.chunk_ready_ms(tokens, chunk_tokens), self.chunk_sizes(tokens, chunk_tokens)):
            link_free = max(ready, link_free) + self.transfer_ms(self.kv_bytes(chunk), link_share)
        return link_free

    def decode_step_ms(self, batch: int) -> float:
        """One decode step over ``batch`` running sequences (>= 1)."""
        return self.decode_step.intercept + self.decode_step.slope * (batch if batch > 1 else 1)

    def encode_ms(self, n_images: int, n_cached: int = 0) -> float:
        """Encoder time for a request's images, ``n_cached`` of them encoder-cache hits."""
        if n_cached < 0 or n_cached > n_images:
            raise ValueError(f"need 0 <= n_cached <= n_images, got {n_cached} of {n_images}")
        new = n_images - n_cached
        hits = self._prior.encode_cache_hit_ms * n_cached
        return hits + (self.encode.intercept + self.encode.slope * new if new else 0.0)

    def remote_ttft_ms(self, tokens: int, chunk_tokens: int | None = None, batch: int = 1) -> float:
        """Idle-pipeline TTFT of remote prefill: prefill + transfer (+ overlap) + one decode step."""
        return self.transfer_done_ms(tokens, chunk_tokens) + self.decode_step_ms(batch)

    def prefill_rate_per_worker(self, tokens: float) -> float:
        """Requests per second one prefill worker completes at this prompt length."""
        return 1000.0 / self.prefill_ms(tokens)

    def decode_rate_per_worker(self, output_tokens: float, batch: int | None = None) -> float:
        """Requests per second one decode worker retires with ``batch`` (default: all) slots busy."""
        b = self.decode_slots if batch is None else batch
        return b * 1000.0 / (max(output_tokens, 1) * self.decode_step_ms(b))
