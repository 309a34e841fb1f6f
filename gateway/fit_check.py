"""The cost model's fit beside what the workers measured: the last minute of timing samples.

The registry hands every worker ``TimingSample`` to ``Orchestrator.on_sample``, which feeds
the cost model (``gateway.admission``) and ``MeasuredTimings.add``. ``summary`` compares,
per kind (``encode``, ``prefill``, ``decode_step``, ``transfer``), the mean measured
milliseconds with the mean of the current fit evaluated at the same sizes: a fit that
tracks its stage shows the two close together.
"""

from __future__ import annotations

import time
from collections import deque

from runtime.policy.cost_model import CostModel

from .live_window import WINDOW_S

KINDS = ("encode", "prefill", "decode_step", "transfer")


class MeasuredTimings:
    def __init__(self, window_s: float = WINDOW_S, max_samples: int = 20_000):
        self.window_s = window_s
        self._samples: deque[tuple[float, str, float, float]] = deque(maxlen=max_samples)

    def add(self, kind: str, size: float, ms: float, now: float | None = None) -> None:
        if kind in KINDS:
            self._samples.append((time.monotonic() if now is None else now, kind, size, ms))

    def summary(self, cost_model: CostModel, now: float | None = None) -> dict[str, dict[str, float | int]]:
        t = time.monotonic() if now is None else now
        while self._samples and self._samples[0][0] < t - self.window_s:
            self._samples.popleft()
        fits = {"encode": cost_model.encode, "prefill": cost_model.prefill,
                "decode_step": cost_model.decode_step, "transfer": cost_model.transfer}
        out: dict[str, dict[str, float | int]] = {}
        for kind in KINDS:
            rows = [(size, ms) for _, k, size, ms in self._samples if k == kind]
            if not rows:
                out[kind] = {"samples": 0}
                continue
            n = len(rows)
            out[kind] = {"samples": n, "mean_size": round(sum(s for s, _ in rows) / n, 3),
                         "measured_ms": round(sum(ms for _, ms in rows) / n, 3),
                         "fitted_ms": round(sum(fits[kind](s) for s, _ in rows) / n, 3)}
        return out
