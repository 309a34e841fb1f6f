"""The gateway's Little's-law backlog: no refusals from a rate it cannot trust yet."""

import pytest

from gateway.pressure import FirstTokenPressure


def test_no_backlog_without_enough_recent_first_tokens():
    p = FirstTokenPressure(min_samples=8)
    for _ in range(16):
        p.admitted()
    p.left(got_first_token=True)           # one first token: no rate yet
    assert p.wait_ms() == 0.0

def test_backlog_is_waiting_over_rate():
    p = FirstTokenPressure(window_s=5.0, min_samples=4)
    for _ in range(4):
        p.admitted()
        p.left(got_first_token=True)
    for _ in range(10):
        p.admitted()
    rate = p.rate_per_s()
    assert rate is not None and rate > 0
    assert abs(p.wait_ms() - 1000.0 * 10 / rate) < 1e-6

def test_a_burst_of_first_tokens_is_rated_over_a_quarter_second_at_least():
    from runtime.policy.loads import MIN_RATE_SPAN_S

    p = FirstTokenPressure(window_s=5.0, min_samples=4)
    for _ in range(8):           # one step's worth of first tokens, all at once
        p.admitted()
        p.left(got_first_token=True)
    assert MIN_RATE_SPAN_S == 0.25 and p.rate_per_s() == pytest.approx(8 / MIN_RATE_SPAN_S, rel=0.05)


def test_requests_that_end_without_a_token_leave_the_count():
    p = FirstTokenPressure()
    p.admitted()
    p.left(got_first_token=False)
    assert p.waiting == 0 and p.wait_ms() == 0.0


def test_a_burst_queues_against_the_highest_rate_seen_lately():
    p = FirstTokenPressure(window_s=5.0, min_samples=4, memory_s=60.0)
    for _ in range(8):
        p.admitted()
        p.left(got_first_token=True)
    peak = p.peak_rate_per_s()
    assert peak is not None and peak == p.rate_per_s()
    p.window_s = 0.0                       # a quiet spell: no first token in the window any more
    assert p.rate_per_s() is None
    for _ in range(40):                    # then a burst arrives at once
        p.admitted()
    assert abs(p.wait_ms() - 1000.0 * 40 / peak) < 1e-6
    p.memory_s = 0.0                       # long idle: nothing seen recently is trusted
    assert p.wait_ms() == 0.0


def test_overrun_is_a_high_quantile_of_recent_lateness_and_never_negative():
    p = FirstTokenPressure(window_s=5.0, min_samples=4, overrun_quantile=0.9)
    for overrun in (-50.0, -20.0, -10.0):
        p.admitted()
        p.left(got_first_token=True, overrun_ms=overrun)
    assert p.overrun_ms() == 0.0                       # too few samples to trust
    p.admitted()
    p.left(got_first_token=True, overrun_ms=-5.0)
    assert p.overrun_ms() == 0.0                       # early, not late: nothing to add
    for overrun in [100.0] * 8 + [900.0] * 2:
        p.admitted()
        p.left(got_first_token=True, overrun_ms=overrun)
    assert p.overrun_ms() == 900.0                     # 14 samples: the 90th percentile is one of the 900s
    p.window_s = 0.0                                   # the window has passed
    assert p.overrun_ms() == 0.0 and p.rate_per_s() is None


def test_the_shed_estimate_adds_the_median_intake_once_trusted():
    p = FirstTokenPressure(window_s=5.0, min_samples=4)
    for intake in (10.0, 20.0, 30.0):
        p.admitted(intake_ms=intake)
    assert p.intake_ms() == 0.0                        # too few to trust
    p.admitted(intake_ms=400.0)
    assert p.intake_ms() == 30.0                       # median of 10, 20, 30, 400
    assert p.shed_estimate_ms() == p.intake_ms() + p.wait_ms() + p.overrun_ms()


def test_the_shed_estimate_is_zero_when_nothing_waits():
    p = FirstTokenPressure(window_s=5.0, min_samples=4)
    for _ in range(6):           # a burst 300 ms later than estimated, each 250 ms in the gateway first
        p.admitted(intake_ms=250.0)
        p.left(got_first_token=True, overrun_ms=300.0)
    assert p.waiting == 0 and p.overrun_ms() == 300.0 and p.intake_ms() == 250.0
    assert p.shed_estimate_ms() == 0.0          # nothing queued ahead: admission judges it, body read
    p.admitted(intake_ms=250.0)
    assert p.shed_estimate_ms() == pytest.approx(250.0 + p.wait_ms() + 300.0)


def test_first_tokens_of_an_unpriced_queue_count_for_the_rate_and_teach_no_overrun():
    from sim.pressure import SimPressure

    p = FirstTokenPressure(window_s=5.0, min_samples=4)
    sim = SimPressure(window_ms=5000.0, min_samples=4)
    for i in range(6):           # a start-up burst: admitted with others waiting and no rate yet
        p.admitted()
        p.left(got_first_token=True, overrun_ms=None)
        sim.admitted(float(i))
        sim.left(float(i), got_first_token=True, overrun_ms=None)
    assert p.rate_per_s() is not None and p.overrun_ms() == 0.0
    assert sim.inputs(10.0).first_token_rate_per_s is not None and sim.inputs(10.0).overrun_ms == 0.0
    for i in range(4):           # then predictions that priced the queue, 300 ms late
        p.admitted()
        p.left(got_first_token=True, overrun_ms=300.0)
        sim.admitted(20.0 + i)
        sim.left(20.0 + i, got_first_token=True, overrun_ms=300.0)
    assert p.overrun_ms() == 300.0 and sim.inputs(30.0).overrun_ms == 300.0


def test_the_rate_is_over_the_time_something_waited_not_the_idle_gaps(monkeypatch):
    from sim.pressure import SimPressure

    sim = SimPressure(window_ms=5000.0, min_samples=4)
    for t in (0.0, 10.0, 20.0, 30.0):    # a warm-up: four requests, 10 ms each
        sim.admitted(t)
        sim.left(t + 10.0, got_first_token=True)
    for i in range(8):                   # 3 s idle, then 8 first tokens 20 ms apart from a queue of 8
        sim.admitted(3000.0)
    for i in range(8):
        sim.left(3020.0 + 20.0 * i, got_first_token=True)
    # 12 first tokens over 40 ms + 160 ms of waiting (the 250 ms floor), not over the 3.2 s of wall time
    assert sim.inputs(3200.0).first_token_rate_per_s == pytest.approx(12 / 0.25)

    now = [0.0]
    monkeypatch.setattr("gateway.pressure.time.monotonic", lambda: now[0])
    p = FirstTokenPressure(window_s=5.0, min_samples=4)
    for t in (0.0, 0.01, 0.02, 0.03):    # the same on the gateway's clock, in seconds
        now[0] = t
        p.admitted()
        now[0] = t + 0.01
        p.left(got_first_token=True)
    now[0] = 3.0
    for _ in range(8):
        p.admitted()
    for i in range(8):
        now[0] = 3.02 + 0.02 * i
        p.left(got_first_token=True)
    now[0] = 3.2
    assert p.rate_per_s() == pytest.approx(12 / 0.25)


def test_requests_ended_without_a_token_teach_how_long_past_the_estimate_they_waited():
    p = FirstTokenPressure(window_s=5.0, min_samples=4, overrun_quantile=0.5)
    for _ in range(4):           # cut at their deadline 800 ms past what admission predicted
        p.admitted()
        p.left(got_first_token=False, overrun_ms=800.0)
    assert p.waiting == 0 and p.rate_per_s() is None      # no first token: nothing for the rate
    assert p.overrun_ms() == 800.0
    for _ in range(4):           # a client that left early says nothing about lateness
        p.admitted()
        p.left(got_first_token=False, overrun_ms=-300.0)
    assert p.overrun_ms() == 800.0


def test_the_busy_clock_counts_only_waiting_time_and_keeps_one_horizon_of_spans():
    from runtime.policy.busy_time import BusyClock

    clock = BusyClock(horizon=10.0)
    clock.waiting_changed(0.0, 1)
    clock.waiting_changed(1.0, 2)        # still busy: the span runs on
    clock.waiting_changed(2.0, 0)
    clock.waiting_changed(5.0, 1)
    assert clock.busy_since(6.0, 0.0) == 3.0 and clock.busy_since(6.0, 1.5) == 1.5
    for t in range(100, 1100):           # an outage: a thousand requests that never get a token
        clock.waiting_changed(float(t), 1)
        clock.waiting_changed(t + 0.5, 0)
    assert len(clock._spans) <= 11 and clock.busy_since(1100.0, 1090.0) == 5.0


def test_the_busy_clock_reads_what_summing_its_spans_would():
    """The running total against the spans themselves, over random waiting counts, read as the
    pressure trackers read it: over the last window, whose start only moves forward."""
    import random

    from runtime.policy.busy_time import BusyClock

    rng = random.Random(7)
    clock, spans, since, now = BusyClock(horizon=5.0), [], None, 0.0
    for _ in range(3000):
        now += rng.expovariate(20.0)
        waiting = rng.choice((0, 0, 1, 2))
        clock.waiting_changed(now, waiting)
        if waiting and since is None:
            since = now
        elif not waiting and since is not None:
            spans.append((since, now))
            since = None
        if rng.random() < 0.3:
            start = now - 2.0
            expected = sum(max(0.0, end - max(begin, start)) for begin, end in spans)
            expected += now - max(since, start) if since is not None else 0.0
            assert abs(clock.busy_since(now, start) - expected) < 1e-9


def test_overrun_quantile_must_be_a_fraction():
    import pytest
    with pytest.raises(ValueError):
        FirstTokenPressure(overrun_quantile=1.5)


# -- the gateway's own event-loop lag (gateway/loop_lag.py) ------------------------------------
import asyncio
import time

from gateway.loop_lag import LoopLagMonitor


async def test_a_blocked_loop_shows_as_lag_and_the_lag_ages_out():
    seen = []
    monitor = LoopLagMonitor(interval_s=0.01, window_s=0.5, on_sample=seen.append)
    monitor.start()
    try:
        await asyncio.sleep(0.05)
        assert monitor.recent_s() < 0.1
        time.sleep(0.3)                    # a callback that hogs the loop, as a saturated gateway does
        await asyncio.sleep(0.05)
        assert monitor.recent_s() >= 0.25 and max(seen) >= 0.25
        await asyncio.sleep(0.7)           # past the window, with the loop free again
        assert monitor.recent_s() < 0.1
    finally:
        await monitor.stop()


def test_no_samples_reads_zero():
    assert LoopLagMonitor().recent_s() == 0.0


def test_the_window_quantile_is_the_sorted_windows_at_every_read():
    """The incremental structure the tracker reads (``runtime/policy/window_quantile.py``) against sorting the
    window's values at each read, over random samples, duplicates and expiries included."""
    import random

    from runtime.policy.window_quantile import WindowQuantile

    rng, w, kept = random.Random(7), WindowQuantile(), []
    for t in range(2000):
        value = float(rng.choice([rng.randint(-50, 50), 3]))
        w.add(float(t), value)
        kept.append((float(t), value))
        since = t - rng.randint(5, 60)
        w.expire(since)
        kept = [(s, v) for s, v in kept if s >= since]
        values = sorted(v for _, v in kept)
        for q in (0.0, 0.5, 0.95, 1.0):
            assert w.quantile(q, 4) == (values[min(len(values) - 1, int(q * len(values)))] if len(values) >= 4 else None)
    assert len(w) == len(kept)


def _closed_loop_burst(monkeypatch, p: FirstTokenPressure) -> None:
    """A busy closed loop on the bench model, as a refusal storm read it: 38 first tokens over 5 s
    of waiting (7.6/s), each TTFT 200 ms plus 75 ms per request that waited when it was admitted
    (its first tokens batch, so a queue drains at ~13/s), then a burst of 16 admitted at once."""
    now = [0.0]
    monkeypatch.setattr("gateway.pressure.time.monotonic", lambda: now[0])
    p.admitted()                           # one always waits: the busy clock runs the whole window
    for i in range(38):
        now[0] = i * 5.0 / 38
        p.admitted()
        ahead = i % 16
        now[0] += 0.01
        p.left(got_first_token=True, overrun_ms=0.0, ahead=ahead, ttft_ms=200.0 + 75.0 * ahead)
    now[0] = 5.0
    for _ in range(15):
        p.admitted()


def test_a_burst_is_priced_at_the_rate_its_queue_drained_not_the_closed_loops_arrivals(monkeypatch):
    from runtime.policy.cost_model import CostModel
    from runtime.policy.loads import DecodeWorkerLoad, PrefillWorkerLoad, RequestShape, StageLoads
    from runtime.policy.placement_policy import admit

    p = FirstTokenPressure(window_s=5.0, min_samples=8)
    _closed_loop_burst(monkeypatch, p)
    assert p.rate_per_s() == pytest.approx(38 / 5.0, rel=0.05)      # what the storm was judged by
    assert p.drain_rate_per_s() == pytest.approx(1000.0 / 75.0)
    assert p.wait_ms() == pytest.approx(16 * 75.0)                  # not 16 / 7.6 s = 2.1 s
    # a bench-short request with 2 s to its deadline is admitted, as the TTFTs just seen say it should be
    state = StageLoads(decode=(DecodeWorkerLoad("d0", running_seqs=0),), prefill=(PrefillWorkerLoad("p0"),))
    verdict = admit(RequestShape(26, 32), state, CostModel(), "conditional", 2000.0, 500.0, pressure=p.inputs())
    assert verdict.ok and verdict.backlog_ms == pytest.approx(1200.0)


def test_the_drain_fit_is_trusted_only_with_enough_spread_and_reads_a_flat_ttft_as_no_queue():
    from runtime.policy.drain_fit import DrainFit

    one_at_a_time = DrainFit(window=5.0, min_samples=8)
    for i in range(20):
        one_at_a_time.add(i * 0.1, 0, 10.0 + i % 3)
    assert one_at_a_time.rate_per_s(2.0) is None                    # every request had 0 ahead: no slope
    flat = DrainFit(window=5.0, min_samples=8)
    for i in range(20):
        flat.add(i * 0.1, i % 8, 300.0 - i % 8)                      # the ones ahead served in the same step
    assert flat.rate_per_s(2.0) == pytest.approx(1000.0)            # waiting behind them costs nothing
    few = DrainFit(window=5.0, min_samples=8)
    for i in range(7):
        few.add(i * 0.1, i, 100.0 + 50.0 * i)
    assert few.rate_per_s(1.0) is None                              # too few samples
    few.add(0.7, 7, 450.0)
    assert few.rate_per_s(1.0) == pytest.approx(20.0)               # 50 ms a request ahead
    assert few.rate_per_s(5.75) is None                             # the first samples left the window
    assert few.rate_per_s(60.0) is None and few._n == 0 and few._sxy == 0.0


def test_the_simulator_prices_a_burst_at_the_rate_its_queue_drained():
    from sim.pressure import SimPressure

    sim = SimPressure(window_ms=5000.0, min_samples=8)
    sim.admitted(0.0)                      # one always waits
    for i in range(38):
        t = i * 5000.0 / 38
        sim.admitted(t)
        ahead = i % 16
        sim.left(t + 10.0, got_first_token=True, overrun_ms=0.0, ahead=ahead, ttft_ms=200.0 + 75.0 * ahead)
    for _ in range(15):
        sim.admitted(4990.0)
    assert sim.inputs(5000.0).backlog_ms() == pytest.approx(16 * 75.0)


def test_a_wave_served_in_one_step_is_not_priced_as_a_queue(monkeypatch):
    """Bench-short on a slow host: each closed-loop wave of 16 gets its first tokens in one refill
    step, 1.1-1.4 s after admission whatever the number ahead. The wait they share is the overrun
    margin's; priced again as a backlog of the window's rate, the wave's last requests were refused
    (estimate 208 ms, queue 21, backlog 679 and margin 1127 against 1988 ms left), though those
    admitted just before had TTFTs of ~1.1 s."""
    from runtime.policy.cost_model import CostModel
    from runtime.policy.loads import DecodeWorkerLoad, PrefillWorkerLoad, RequestShape, StageLoads
    from runtime.policy.placement_policy import admit

    clock = [100.0]
    monkeypatch.setattr("gateway.pressure.time.monotonic", lambda: clock[0])
    p = FirstTokenPressure(window_s=5.0, min_samples=8)
    for wave in range(3):                       # three waves, ~1.6 s apart, 1.1 s to their first tokens
        for ahead in range(16):
            p.admitted()
        clock[0] += 1.1
        for ahead in range(16):
            p.left(got_first_token=True, overrun_ms=900.0 + 20 * (15 - ahead), ahead=ahead,
                   ttft_ms=1130.0 - 3.0 * ahead)
        clock[0] += 0.5
    for _ in range(15):
        p.admitted()                            # the next wave: 15 already admitted, the 16th arrives
    state = StageLoads(decode=(DecodeWorkerLoad("d0", running_seqs=0),), prefill=(PrefillWorkerLoad("p0"),))
    verdict = admit(RequestShape(26, 32), state, CostModel(), "conditional", 1988.0, 500.0, pressure=p.inputs())
    assert verdict.ok, verdict
    assert p.drain_rate_per_s() == pytest.approx(1000.0)
    assert p.wait_ms() == pytest.approx(15.0)   # not 15 at the window's rate (under 25/s): 600 ms and more
    assert p.rate_per_s() < 25.0


def test_a_wave_cut_at_its_deadline_refuses_the_next_only_behind_as_deep_a_queue(monkeypatch):
    """Bench-short on a slow host: a closed-loop wave of 16 served together crossed its 2 s deadline
    together, 16 requests were cut at once, and each taught the margin its ~700 ms past the
    prediction. Read as one pool for every new request, that margin refused the next wave's second
    request onwards, and the gateway let in one request at a time until the window forgot (47 of 48
    refused). A wave's lateness is evidence behind as deep a queue: the next wave is admitted up to
    the depth where enough of those overruns apply (8 learnt behind 0-7), and refused behind it.
    The simulator's tracker judges the same way."""
    from runtime.policy.cost_model import CostModel
    from runtime.policy.loads import DecodeWorkerLoad, PrefillWorkerLoad, RequestShape, StageLoads
    from runtime.policy.placement_policy import admit
    from sim.pressure import SimPressure

    clock = [100.0]
    monkeypatch.setattr("gateway.pressure.time.monotonic", lambda: clock[0])
    p, sim = FirstTokenPressure(window_s=5.0, min_samples=8), SimPressure(window_ms=5000.0, min_samples=8)
    for _ in range(16):
        p.admitted()
        sim.admitted(clock[0] * 1000.0)
    clock[0] += 2.0
    for ahead in range(16):                   # all cut at the deadline, 700 ms past the prediction
        p.left(got_first_token=False, overrun_ms=700.0, ahead=ahead)
        sim.left(clock[0] * 1000.0, got_first_token=False, overrun_ms=700.0, ahead=ahead)
    state = StageLoads(decode=(DecodeWorkerLoad("d0", running_seqs=0),), prefill=(PrefillWorkerLoad("p0"),))
    admitted = []
    for _ in range(16):                       # the next wave, into the emptied pipeline
        margin = sim.inputs(clock[0] * 1000.0).margin_ms()
        assert p.inputs().margin_ms() == margin
        if admit(RequestShape(26, 32), state, CostModel(), "conditional", 500.0, 500.0, pressure=p.inputs()).ok:
            admitted.append(p.waiting)
            p.admitted()
            sim.admitted(clock[0] * 1000.0)
    assert admitted == [0, 1, 2, 3]           # behind 4-7 the wave's eight overruns apply: refused there
    assert p.overrun_ms(behind=3) == 0.0 and p.overrun_ms(behind=4) == 700.0 and p.overrun_ms(behind=15) == 700.0


def test_an_overrun_applies_behind_queues_at_least_as_deep_as_the_one_it_was_learnt_behind():
    from runtime.policy.depth_quantile import DepthQuantile, depth_bucket

    assert [depth_bucket(a) for a in (0, 1, 2, 3, 4, 7, 8, 15, 16, 63, 64, 10_000)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 7]
    q = DepthQuantile()
    for _ in range(4):
        q.add(0.0, 900.0, ahead=12)           # behind a deep queue
        q.add(0.0, 10.0, ahead=0)             # behind none
        q.add(0.0, 50.0, ahead=None)          # unknown: applies behind any queue
    assert len(q) == 12
    assert q.quantile(1.0, 8, waiting=0) == 50.0 and q.quantile(1.0, 8, waiting=7) == 50.0
    assert q.quantile(1.0, 12, waiting=8) == 900.0 and q.quantile(0.5, 12, waiting=15) == 50.0
    assert q.quantile(1.0, 9, waiting=5) is None             # 8 apply behind 5: below min_samples
    q.expire(1.0)
    assert len(q) == 0 and q.quantile(0.5, 1, waiting=64) is None
