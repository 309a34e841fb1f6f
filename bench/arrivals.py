"""Request arrival times, as ``vllm bench serve`` draws them.

Interarrival gaps are gamma distributed with ``shape = burstiness`` and
``scale = 1 / (rate * burstiness)``: the mean gap is always ``1 / rate``, and the
coefficient of variation is ``1 / sqrt(burstiness)``. ``burstiness = 1`` is a
Poisson process (exponential gaps); below 1 arrivals come in bursts, above 1
they are more evenly spaced. ``rate = inf`` sends every request at time 0 (a
``--concurrency`` cap then makes it a fixed-concurrency run).
"""

from __future__ import annotations

import math

import numpy as np


def send_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each of ``n`` requests is sent (first at 0).

    Request ``i + 1`` is sent one gap after request ``i``, like vLLM, which sends a
    request and then sleeps for the next gap.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (inf for all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    rng = np.random.default_rng([seed, 0])  # stream 0: arrivals (stream 1 is the request mix)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))
