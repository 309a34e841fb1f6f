"""The gateway's Little's-law backlog: no refusals from a rate it cannot trust yet."""

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

def test_requests_that_end_without_a_token_leave_the_count():
    p = FirstTokenPressure()
    p.admitted()
    p.left(got_first_token=False)
    assert p.waiting == 0 and p.wait_ms() == 0.0


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
