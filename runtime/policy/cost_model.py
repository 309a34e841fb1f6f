"""The pipeline's service-time model, calibrated online from measured stage timings.

``CostModel`` answers "how long will this take" for every stage (prefill, chunked
prefill, KV size and transfer, decode step, encode) from four fits (``runtime.policy.fits``):

    prefill_ms(tokens)    = a_p + b_p x tokens + c_p x tokens^2   (c_p: attention; 0 in the chapter)
    decode_step_ms(batch) = a_d + b_d x batch
    transfer_ms(bytes)    = a_t + b_t x bytes        (a_t: link setup, 1 / b_t: bandwidth)
    encode_ms(tokens)     = a_e + b_e x image_tokens   (the placeholder tokens of the images a call encodes)

Prefill is defined per request: ``prefill_ms(tokens)`` is one prompt's whole
prefill on an idle worker, however many passes (chunks) it takes, so ``a_p`` is
paid once per request and a chunked prefill charges it to the first chunk
(``chunk_ms``); a chunk's quadratic share is that of its token range, so the chunks of a
prompt add up to ``prefill_ms`` (plus any per-chunk overhead). ``epd profile`` fits exactly this: it sums each profiled request's
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

from pathlib import Path

from runtime.policy import service_times as st
from runtime.policy.fits import LinearFit, QuadraticFit
from runtime.policy.service_times import ServiceTimes


def _medians_by_size(points: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """Each point's ms replaced by the median at its x (as many points as before, in order of x):
    a measured table is fitted on its medians, weighted by how often each size was seen, so one
    step preempted on a shared host (20 ms among 4 ms ones) does not move the line."""
    by_size: dict[float, list[float]] = {}
    for x, ms in points:
        by_size.setdefault(x, []).append(ms)
    out = []
    for x in sorted(by_size):
        values = sorted(by_size[x])
        n = len(values)
        out += [(x, (values[(n - 1) // 2] + values[n // 2]) / 2)] * n
    return out


class CostModel:
    """Service-time estimates for every stage, from a prior plus online observations."""

    __slots__ = ("prefill", "decode_step", "transfer", "encode", "_prior", "_chunk_times")

    _CHUNK_CACHE = 1024  # memoized chunk-time lists kept (see ``chunk_times``)

    def __init__(self, prior: ServiceTimes | None = None, *, window: int = 256, min_points: int = 8) -> None:
        p = prior if prior is not None else ServiceTimes()
        self._prior = p
        self._chunk_times: dict[tuple[int, int, float, float, float], tuple[float, ...]] = {}
        self.prefill = QuadraticFit(p.prefill_base_ms, p.prefill_ms_per_token, p.prefill_ms_per_token2,
                                    window=window, min_points=min_points)
        self.decode_step = LinearFit(p.decode_step_base_ms, p.decode_step_ms_per_seq, window=window, min_points=min_points)
        self.transfer = LinearFit(
            p.link_setup_ms, 1000.0 / p.link_bytes_per_s, window=window, min_points=min_points, positive_slope=True
        )
        self.encode = LinearFit(p.encode_base_ms, p.encode_ms_per_token, window=window, min_points=min_points)

    @classmethod
    def from_file(cls, path: str | Path, *, window: int = 256, min_points: int = 2) -> CostModel:
        """Load a service-time file; its measured tables (if any) are fitted over its params
        (each table by the median at each size)."""
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
            for x, ms in _medians_by_size(points):
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

    def observe_encode(self, image_tokens: int, ms: float) -> bool:
        """One tower call encoded images of ``image_tokens`` placeholder tokens in all (cache misses only) in ``ms``."""
        if image_tokens < 1:
            self.encode.rejected += 1
            return False
        return self.encode.observe(image_tokens, ms)

    def service_times(self) -> ServiceTimes:
        """The current coefficients as a ``ServiceTimes`` (non-fitted fields from the prior)."""
        return self._prior.replace(
            prefill_base_ms=self.prefill.intercept,
            prefill_ms_per_token=self.prefill.slope,
            prefill_ms_per_token2=self.prefill.curve,
            # a step always takes time: keep base + slope > 0 even for a degenerate fit
            decode_step_base_ms=max(self.decode_step.intercept, 1e-6 if self.decode_step.slope == 0 else 0.0),
            decode_step_ms_per_seq=self.decode_step.slope,
            link_setup_ms=self.transfer.intercept,
            link_bytes_per_s=1000.0 / self.transfer.slope,
            encode_base_ms=self.encode.intercept,
            encode_ms_per_token=self.encode.slope,
        )

    def calibration(self) -> dict[str, dict[str, float | int | bool]]:
        """Per-stage fit state, for metrics and logs."""
        fits = {"prefill": self.prefill, "decode_step": self.decode_step, "transfer": self.transfer, "encode": self.encode}
        out: dict[str, dict[str, float | int | bool]] = {
            name: {"points": f.points, "fitted": f.fitted, "intercept": f.intercept, "slope": f.slope, "rejected": f.rejected}
            for name, f in fits.items()
        }
        out["prefill"]["curve"] = self.prefill.curve
        return out

    # ---- stage estimates ---------------------------------------------------------

    @property
    def decode_slots(self) -> int:
        return self._prior.decode_slots

    def prefill_ms(self, tokens: int) -> float:
        """Whole-prompt prefill of ``tokens`` new tokens on an idle worker."""
        return self.prefill(tokens)

    def suffix_prefill_ms(self, cached: int, tokens: int) -> float:
        """Prefill of prompt positions ``cached..tokens`` whose first ``cached`` positions' KV is
        already there (a prefix-cache hit): the fixed cost once, the rest of the fit on the new
        tokens, the attention term on their context (``tokens^2 - cached^2``). ``prefill_ms`` at 0."""
        if cached <= 0:
            return self.prefill(tokens)
        fit, new = self.prefill, max(tokens - cached, 1)
        return fit.intercept + fit.slope * new + fit.curve * (tokens * tokens - cached * cached)

    def suffix_chunk_times(self, cached: int, tokens: int, chunk_tokens: int) -> tuple[float, ...]:
        """``chunk_ms`` of each chunk of the positions ``cached..tokens`` (the first pays the fixed cost)."""
        if cached <= 0:
            return self.chunk_times(tokens, chunk_tokens)
        sizes = self.chunk_sizes(tokens - cached, chunk_tokens)
        times = [self.chunk_ms(cached + i * chunk_tokens, c) for i, c in enumerate(sizes)]
        if times:
            times[0] += self.prefill.intercept
        return tuple(times)

    def queued_prefill_ms(self, tokens: int, prompts: int) -> float:
        """A queue of ``prompts`` prompts holding ``tokens`` tokens between them, prefilled one
        after another: the fixed cost once per prompt and the attention term per prompt (exact
        when the prompts are of equal length). 0 for an empty queue."""
        if tokens <= 0:
            return 0.0
        n, fit = max(1, prompts), self.prefill
        return n * fit.intercept + fit.slope * tokens + fit.curve * tokens * tokens / n

    @staticmethod
    def chunk_sizes(tokens: int, chunk_tokens: int) -> list[int]:
        """``tokens`` split into chunks of ``chunk_tokens`` (the last one may be shorter)."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        full, rest = divmod(max(tokens, 0), chunk_tokens)
        return [chunk_tokens] * full + ([rest] if rest else [])

    def chunk_ms(self, start: int, chunk: int) -> float:
        """Compute time of the prefill chunk of tokens ``[start, start + chunk)``: the fixed prefill
        cost is paid by the first (``start == 0``), and the quadratic term grows with the context."""
        fit, end = self.prefill, start + chunk
        return ((fit.intercept if start == 0 else 0.0) + fit.slope * chunk + fit.curve * (end * end - start * start)
                + self._prior.prefill_chunk_overhead_ms)

    def chunk_times(self, tokens: int, chunk_tokens: int) -> tuple[float, ...]:
        """``chunk_ms`` of each chunk of ``chunk_sizes(tokens, chunk_tokens)``.

        Memoized: the key includes the prefill fit's current coefficients, so a refit
        never returns stale times (the cache is cleared when it reaches ``_CHUNK_CACHE``).
        """
        fit = self.prefill
        key = (tokens, chunk_tokens, fit.intercept, fit.slope, fit.curve)
        times = self._chunk_times.get(key)
        if times is None:
            if len(self._chunk_times) >= self._CHUNK_CACHE:
                self._chunk_times.clear()
            sizes = self.chunk_sizes(tokens, chunk_tokens)
            starts = [i * chunk_tokens for i in range(len(sizes))]
            times = self._chunk_times[key] = tuple(self.chunk_ms(s, c) for s, c in zip(starts, sizes))
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

    def encode_ms(self, new_tokens: int, n_cached: int = 0) -> float:
        """Encoder time for a request's images: one tower call over the new ones (``new_tokens``
        placeholder tokens in all; 0: none to encode), and ``n_cached`` encoder-cache hits."""
        if new_tokens < 0 or n_cached < 0:
            raise ValueError(f"need new_tokens >= 0 and n_cached >= 0, got {new_tokens} and {n_cached}")
        hits = self._prior.encode_cache_hit_ms * n_cached
        return hits + (self.encode.intercept + self.encode.slope * new_tokens if new_tokens else 0.0)

    def encode_added_ms(self, new_tokens: int) -> float:
        """What images of ``new_tokens`` placeholder tokens add to a tower call that encodes others too:
        their per-token time alone."""
        return max(0.0, self.encode.slope) * new_tokens

    def encode_queue_ms(self, images: int, tokens: int) -> float:
        """An encoder's queue of ``images`` waiting images, ``tokens`` placeholder tokens in all, each
        image priced as a call of its own (a bound: a batch shares one call's fixed cost)."""
        if images <= 0:
            return 0.0
        return self.encode.intercept * images + max(0.0, self.encode.slope) * tokens

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
