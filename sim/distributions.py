"""Integer-valued distributions for request mixes, parsed from short CLI specs.

Specs (every sample is rounded and clipped to ``>= minimum``):

    6000                   fixed value
    uniform:LO:HI          uniform integer in [LO, HI]
    normal:MEAN:STD        normal
    lognormal:MEDIAN:SIGMA log-normal with that median and log-space sigma
    exp:MEAN               exponential
    mix:500@0.8,6000@0.2   weighted choice of fixed values (weights need not sum to 1)
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "normal", "lognormal", "exp", "mix")


class DistributionError(ValueError):
    """A distribution spec does not parse."""


@dataclass(slots=True, frozen=True)
class Distribution:
    """``kind`` with its ``params``; for ``mix``, ``params`` alternates value, weight."""

    kind: str
    params: tuple[float, ...]
    minimum: int = 1
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DistributionError(f"unknown distribution kind {self.kind!r}; expected one of {KINDS}")
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}
        if self.kind in arity and len(self.params) != arity[self.kind]:
            raise DistributionError(f"{self.kind} takes {arity[self.kind]} parameter(s), got {len(self.params)}")
        if self.kind == "mix" and (not self.params or len(self.params) % 2):
            raise DistributionError("mix needs VALUE@WEIGHT pairs")
        if any(not math.isfinite(p) for p in self.params):
            raise DistributionError(f"parameters must be finite: {self.params}")
        p, k = self.params, self.kind
        if k == "fixed":
            bad = p[0] < self.minimum
        elif k == "uniform":
            bad = not self.minimum <= p[0] <= p[1]
        elif k == "normal":
            bad = p[1] < 0
        elif k == "lognormal":
            bad = p[0] <= 0 or p[1] < 0
        elif k == "exp":
            bad = p[0] <= 0
        else:
            bad = min(p[1::2]) < 0 or sum(p[1::2]) <= 0 or min(p[0::2]) < self.minimum
        if bad:
            raise DistributionError(f"invalid parameters for {self.kind}: {self.params} (minimum value {self.minimum})")

    def sampler(self, rng: random.Random) -> Callable[[], int]:
        """A zero-argument function drawing from ``rng`` (fast path for the simulator)."""
        lo, p = self.minimum, self.params
        if self.kind == "fixed":
            return itertools.repeat(int(round(p[0]))).__next__  # a constant, drawn without a Python call
        if self.kind == "uniform":
            a, b = int(p[0]), int(p[1])
            return lambda: rng.randint(a, b)
        if self.kind == "normal":
            return lambda: max(lo, int(round(rng.gauss(p[0], p[1]))))
        if self.kind == "lognormal":
            mu = math.log(p[0])
            return lambda: max(lo, int(round(rng.lognormvariate(mu, p[1]))))
        if self.kind == "exp":
            rate = 1.0 / p[0]
            return lambda: max(lo, int(round(rng.expovariate(rate))))
        values = [int(round(v)) for v in p[0::2]]
        cum = list(itertools.accumulate(p[1::2]))
        total = cum[-1]
        return lambda: values[bisect.bisect_right(cum, rng.random() * total)]

    def mean(self) -> float:
        """Expected value (ignoring clipping at ``minimum``)."""
        p = self.params
        if self.kind in ("fixed", "exp"):
            return p[0]
        if self.kind in ("uniform",):
            return (p[0] + p[1]) / 2
        if self.kind == "normal":
            return max(p[0], self.minimum)
        if self.kind == "lognormal":
            return p[0] * math.exp(p[1] ** 2 / 2)
        return sum(v * w for v, w in zip(p[0::2], p[1::2])) / sum(p[1::2])


def fixed(value: int, minimum: int = 1) -> Distribution:
    return Distribution("fixed", (float(value),), minimum, str(value))


def parse_distribution(spec: str | int, *, minimum: int = 1, name: str = "value") -> Distribution:
    """Parse a spec (see the module docstring); errors name ``name``."""
    text = str(spec).strip()
    try:
        if ":" not in text:
            return Distribution("fixed", (float(text),), minimum, text)
        kind, _, rest = text.partition(":")
        if kind == "mix":
            params: list[float] = []
            for item in rest.split(","):
                value, sep, weight = item.partition("@")
                params += [float(value), float(weight) if sep else 1.0]
            return Distribution("mix", tuple(params), minimum, text)
        return Distribution(kind, tuple(float(v) for v in rest.split(":")), minimum, text)
    except (ValueError, DistributionError) as exc:
        raise DistributionError(f"{name}: cannot parse distribution {text!r}: {exc}") from None
