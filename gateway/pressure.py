"""Little's-law pressure: how long a new request would queue before its first token.

Worker stats describe each stage's queue, but under overload the time also piles
up in places no worker reports (the gateway's own CPU, encoder batching, gRPC
queues). This tracker measures the whole pipeline from outside: requests admitted
and still waiting for a first token (L), and the rate at which first tokens come
out while any is waiting (lambda: the window's first tokens over the time in it
that L was above 0, ``runtime.policy.busy_time``; wall time would count idle
spells and read the arrival rate, not the rate a queue drains at).
``wait_ms = L / lambda`` is added to every TTFT estimate at admission, so a
backlog anywhere turns into early 429s. This module
keeps the state; the admission policy (``runtime.policy.placement_policy.admit``) reads
it as data (``inputs()``), as it reads the simulator's own equivalent.

It also keeps the estimate honest: for each first token, the *overrun* is the
TTFT the request really had (from admission) minus what the model predicted for
it (stage estimate + backlog, without the overrun term itself, so the target
does not chase its own correction). ``overrun_ms`` is a high quantile of the
recent overruns learnt behind a queue no deeper than the one a request arriving
now joins (``runtime.policy.depth_quantile``: a wave's requests teach one event
many times; 0 when they are negative or too few; the quantile is about the
share of admitted requests meant to make their deadline), and admission adds it
too: when the pipeline has been slower than the cost model says (stages that
share cores, a busy host), new requests are judged by how slow it really was,
so the ones admitted still meet their deadline. It fades out with the window.
A request admitted while others waited and no rate was trusted yet (the first
burst after start-up or an idle spell) teaches no overrun: its prediction had
no backlog term, so its lateness is the queue left out, and learning it would
count that queue twice once the rate is known (a 16-request burst on the demo
model taught 370 ms, and with the backlog beside it the gateway then refused 58%
of a load whose admitted requests had a TTFT p50 of 300 ms against a 1 s SLO).

Before a request's body is read, the gateway can refuse it cheaply; the
estimate for that check (``shed_estimate_ms``) adds the recent median *intake*
(arrival to admission decision: reading the body, loading images, tokenizing),
the part of TTFT a request spends before admission sees it. Under overload,
most refusals then happen there, and the CPU goes to admitted requests. With
nothing admitted waiting, the estimate is 0 and admission decides from the
stage estimates once the body is read: the intakes of a burst just over (280-360
ms for half of a demo-c16 round) shed every request of the idle gateway that
followed, at a 200 ms SLO, for the window's 5 s, since refusals teach no intake.

The rate a burst is judged by is the largest of the window's rate, the
highest rate seen in the last ``memory_s`` (checked at every first token): after
a quiet spell the window holds too few first tokens to trust at all, and the
rate the window's queues drained at (``runtime.policy.drain_fit``: the fitted
TTFT per request ahead at admission; in a closed loop that stays busy the
window's rate is the arrival rate, which prices a burst at up to twice its real
wait). The peak and the fit are what the pipeline was seen to do; if it no
longer can (a worker lost), the overrun term shows it within a window.
"""

from __future__ import annotations

import time
from collections import deque

from runtime.policy.busy_time import BusyClock
from runtime.policy.depth_quantile import DepthQuantile
from runtime.policy.drain_fit import DrainFit
from runtime.policy.loads import MIN_RATE_SPAN_S, Pressure
from runtime.policy.window_quantile import WindowQuantile


class FirstTokenPressure:
    def __init__(self, window_s: float = 5.0, min_samples: int = 8, overrun_quantile: float = 0.95,
                 memory_s: float = 60.0):
        if not 0.0 <= overrun_quantile <= 1.0:
            raise ValueError(f"overrun_quantile must be in [0, 1], got {overrun_quantile}")
        self.window_s = window_s
        self.min_samples = min_samples         # below this, no rate is trusted (start-up, after idle)
        self.overrun_quantile = overrun_quantile
        self.memory_s = memory_s
        self._peak: tuple[float, float] | None = None   # (time, rate): highest window rate lately
        self.waiting = 0                       # admitted, no first token yet
        self._busy = BusyClock(window_s)       # when ``waiting`` was above 0 (the rate's denominator)
        self._firsts: deque[float] = deque()   # times of recent first tokens (the rate's count)
        self._drain = DrainFit(window_s, min_samples)  # TTFT against requests ahead at admission
        # ms late against the prediction, by the queue each was learnt behind: first tokens with a
        # priced prediction, and requests that ended tokenless (how long past it they still waited)
        self._overruns = DepthQuantile()
        self._intakes = WindowQuantile()       # intake ms of recent admissions

    def admitted(self, intake_ms: float = 0.0) -> None:
        self.waiting += 1
        now = time.monotonic()
        self._busy.waiting_changed(now, self.waiting)
        self._intakes.add(now, intake_ms)
        self._intakes.expire(now - self.window_s)

    def left(self, got_first_token: bool, overrun_ms: float | None = 0.0, *, ahead: int | None = None,
             ttft_ms: float = 0.0) -> None:
        """Exactly once per admitted request: at its first token (with its TTFT minus the
        admission estimate; None: the estimate could not price the queue, so the first token
        counts for the rate only), or when it ends without one (with how long past the estimate
        it was still waiting: a lower bound of its overrun, learnt when positive, so requests
        cut at their deadline are not left out of the margin that should have refused them).
        ``ahead``: how many waited when it was admitted (``waiting`` just before ``admitted``):
        the queue its overrun applies behind (``runtime.policy.depth_quantile``; None: any) and,
        with its ``ttft_ms`` from admission, a point of the drain fit."""
        self.waiting -= 1
        now = time.monotonic()
        self._busy.waiting_changed(now, self.waiting)
        if got_first_token:
            self._firsts.append(now)
            if ahead is not None:
                self._drain.add(now, ahead, ttft_ms)
            if overrun_ms is not None:
                self._overruns.add(now, overrun_ms, ahead)
            rate = self.rate_per_s()
            if rate is not None and (self._peak is None or rate >= self._peak[1] or now - self._peak[0] > self.memory_s):
                self._peak = (now, rate)
        elif overrun_ms is not None and overrun_ms > 0:
            self._overruns.add(now, overrun_ms, ahead)

    def _recent(self) -> deque[float]:
        """The window's first-token times (older ones dropped)."""
        since, firsts = time.monotonic() - self.window_s, self._firsts
        while firsts and firsts[0] < since:
            firsts.popleft()
        return firsts

    def rate_per_s(self) -> float | None:
        """The window's first tokens per second of the time something waited in it (the pipeline's
        service rate, ``runtime.policy.busy_time``); None when too few."""
        recent = self._recent()
        if len(recent) < self.min_samples:
            return None
        now = time.monotonic()
        return len(recent) / max(self._busy.busy_since(now, now - self.window_s), MIN_RATE_SPAN_S)

    def peak_rate_per_s(self) -> float | None:
        """The highest window rate seen in the last ``memory_s``; None when none was."""
        if self._peak is None or time.monotonic() - self._peak[0] > self.memory_s:
            return None
        return self._peak[1]

    def overrun_ms(self, behind: int | None = None) -> float:
        """How much later than estimated recent first tokens came, or unserved requests were still
        waiting, behind a queue no deeper than ``behind`` (default: the one a request arriving now
        joins, ``waiting``) (the quantile; 0 below ``min_samples`` of them); >= 0."""
        self._overruns.expire(time.monotonic() - self.window_s)
        depth = self.waiting if behind is None else behind
        return max(0.0, self._overruns.quantile(self.overrun_quantile, self.min_samples, depth) or 0.0)

    def intake_ms(self) -> float:
        """Median time from arrival to admission over the window; 0 when too few."""
        self._intakes.expire(time.monotonic() - self.window_s)
        return self._intakes.quantile(0.5, self.min_samples) or 0.0

    def shed_estimate_ms(self) -> float:
        """What a request arriving now would wait for its first token, before its own stages
        (0 while nothing admitted waits: an idle pipeline is judged at admission)."""
        if self.waiting <= 0:
            return 0.0
        return self.intake_ms() + self.wait_ms() + self.inputs().margin_ms()

    def drain_rate_per_s(self) -> float | None:
        """The rate the window's queues drained at (``DrainFit``); None when it cannot be trusted."""
        return self._drain.rate_per_s(time.monotonic())

    def inputs(self) -> Pressure:
        """This state as the admission policy reads it (``runtime.policy.loads.Pressure``): the
        rate is the highest of the window's, the recent peak and the drain fit's (None: no
        throughput seen yet, at start-up or after a long idle, and the stage estimates decide alone)."""
        return Pressure(self.waiting, self._judged_rate(), self.overrun_ms())

    def backlog_priced(self) -> bool:
        """``Pressure.backlog_priced`` of this state (without sorting the overruns ``inputs`` would)."""
        return Pressure(self.waiting, self._judged_rate()).backlog_priced()

    def _judged_rate(self) -> float | None:
        return max(self.rate_per_s() or 0.0, self.peak_rate_per_s() or 0.0, self.drain_rate_per_s() or 0.0) or None

    def wait_ms(self) -> float:
        """Expected queueing before a new request's first token; 0 while nothing waits."""
        if self.waiting <= 0:
            return 0.0
        return Pressure(self.waiting, self._judged_rate()).backlog_ms()
