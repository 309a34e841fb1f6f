"""Cost model: the chapter's numbers, chunked helpers, online calibration, service-time files."""

from __future__ import annotations

import json
import math

import pytest

from runtime.policy import service_times as st
from runtime.policy.cost_model import CostModel
from runtime.policy.fits import LinearFit, QuadraticFit
from runtime.policy.service_times import GIB, MeasuredTables, ServiceTimes, ServiceTimesError, ServiceTimesFile


@pytest.fixture
def cm() -> CostModel:
    return CostModel()


# ---- the worked example's numbers --------------------------------------------------


def test_prefill_kv_and_transfer_match_the_chapter(cm: CostModel) -> None:
    assert cm.prefill_ms(6000) == pytest.approx(230.0)
    assert cm.kv_bytes(6000) == 6000 * 320 * 1024
    assert cm.kv_bytes(6000) / GIB == pytest.approx(1.83, abs=0.005)
    assert cm.transfer_ms(cm.kv_bytes(6000)) == pytest.approx(95.2, abs=0.1)
    assert cm.decode_step_ms(1) == cm.decode_step_ms(32) == 45.0


def test_remote_ttft_serial_and_chunked(cm: CostModel) -> None:
    assert cm.remote_ttft_ms(6000) == pytest.approx(370.2, abs=0.1)
    assert cm.remote_ttft_ms(6000, chunk_tokens=2000) == pytest.approx(314.7, abs=0.1)
    # chunking never makes the last byte land later, and is a no-op for one chunk
    assert cm.transfer_done_ms(1500, 2000) == pytest.approx(cm.prefill_ms(1500) + cm.transfer_ms(cm.kv_bytes(1500)))


def test_rates_per_worker(cm: CostModel) -> None:
    assert cm.prefill_rate_per_worker(6000) == pytest.approx(4.35, abs=0.01)
    assert cm.decode_rate_per_worker(400) == pytest.approx(32 / 18.0)
    assert cm.prefill_rate_per_worker(6000) / cm.decode_rate_per_worker(400) == pytest.approx(2.45, abs=0.01)


def test_chunk_helpers(cm: CostModel) -> None:
    assert cm.chunk_sizes(6000, 2000) == [2000, 2000, 2000]
    assert cm.chunk_sizes(4500, 2000) == [2000, 2000, 500]
    assert cm.chunk_sizes(0, 2000) == []
    # the fixed 20 ms is paid once: chunks are ready at 90, 160, 230 ms
    assert cm.chunk_ready_ms(6000, 2000) == pytest.approx([90.0, 160.0, 230.0])
    assert cm.transfer_done_ms(6000, 2000) == pytest.approx(230.0 + 12.0 + cm.kv_bytes(2000) * 1000 / (22 * GIB))
    with pytest.raises(ValueError):
        cm.chunk_sizes(10, 0)


def test_chunk_times_are_memoized_but_follow_a_refit() -> None:
    cm = CostModel(window=64, min_points=2)
    first = cm.chunk_times(4500, 2000)
    assert first == (cm.chunk_ms(0, 2000), cm.chunk_ms(2000, 2000), cm.chunk_ms(4000, 500))
    assert cm.chunk_times(4500, 2000) is first  # served from the memo
    cm.observe_prefill(100, 5.0 + 0.1 * 100)
    cm.observe_prefill(300, 5.0 + 0.1 * 300)  # refit: 5 + 0.1 x tokens
    assert cm.chunk_times(4500, 2000) == pytest.approx((5.0 + 200.0, 200.0, 50.0))
    with pytest.raises(ValueError):
        cm.chunk_times(10, 0)


def test_chunk_overhead_is_paid_per_chunk() -> None:
    cm = CostModel(ServiceTimes(prefill_chunk_overhead_ms=5.0))
    assert cm.chunk_ready_ms(6000, 2000) == pytest.approx([95.0, 170.0, 245.0])


def test_encode_ms_counts_cache_hits_separately(cm: CostModel) -> None:
    assert cm.encode_ms(0) == 0.0
    assert cm.encode_ms(512) == pytest.approx(10.0 + 2 * 40.0)   # two 256-token images: one call
    assert cm.encode_ms(0, 2) == pytest.approx(2 * 1.0)  # all hits: no encoder pass
    assert cm.encode_ms(512, 1) == pytest.approx(1.0 + 10.0 + 2 * 40.0)
    assert cm.encode_added_ms(256) == pytest.approx(40.0)
    assert cm.encode_queue_ms(2, 512) == pytest.approx(2 * 10.0 + 2 * 40.0) and cm.encode_queue_ms(0, 0) == 0.0
    with pytest.raises(ValueError):
        cm.encode_ms(-1)


def test_transfer_with_a_share_of_the_link(cm: CostModel) -> None:
    nbytes = cm.kv_bytes(6000)
    assert cm.transfer_ms(nbytes, 0.5) - 12.0 == pytest.approx(2 * (cm.transfer_ms(nbytes) - 12.0))


# ---- online calibration ------------------------------------------------------------


def test_priors_until_enough_points_then_exact_fit() -> None:
    cm = CostModel(window=64, min_points=4)
    for tokens in (100, 200, 300):
        assert cm.observe_prefill(tokens, 5.0 + 0.1 * tokens)
    assert cm.prefill_ms(1000) == pytest.approx(20 + 0.035 * 1000)  # still the prior
    cm.observe_prefill(400, 5.0 + 0.1 * 400)
    assert cm.prefill_ms(1000) == pytest.approx(5.0 + 0.1 * 1000)
    assert cm.calibration()["prefill"]["fitted"] is True


def test_window_forgets_old_observations() -> None:
    cm = CostModel(window=8, min_points=4)
    for i in range(8):
        cm.observe_decode_step(1 + i, 100.0 + i)  # an old regime
    for i in range(8):
        cm.observe_decode_step(1 + i, 30.0 + 2.0 * (1 + i))  # the new one replaces it
    assert cm.decode_step_ms(10) == pytest.approx(50.0)
    assert cm.calibration()["decode_step"]["points"] == 8


def test_transfer_fit_recovers_setup_and_bandwidth() -> None:
    cm = CostModel(min_points=3)
    for gib in (0.5, 1.0, 2.0, 3.0):
        nbytes = gib * GIB
        cm.observe_transfer(int(nbytes), 5.0 + nbytes * 1000 / (10 * GIB))
    fitted = cm.service_times()
    assert fitted.link_setup_ms == pytest.approx(5.0)
    assert fitted.link_bytes_per_s == pytest.approx(10 * GIB, rel=1e-6)


def test_degenerate_x_keeps_the_prior_slope() -> None:
    cm = CostModel(min_points=3)
    for _ in range(5):
        cm.observe_prefill(1000, 100.0)  # no spread in x: slope is not identifiable
    assert cm.prefill.slope == pytest.approx(0.035)
    assert cm.prefill_ms(1000) == pytest.approx(100.0)  # intercept absorbs the level


def test_negative_slope_and_intercept_are_guarded() -> None:
    fit = LinearFit(20.0, 0.035, window=16, min_points=3)
    for x, y in ((100, 90.0), (200, 80.0), (300, 70.0)):  # decreasing: noise, not physics
        fit.observe(x, y)
    assert fit.slope == pytest.approx(0.035)
    assert fit.intercept >= 0
    fit = LinearFit(20.0, 0.035, window=16, min_points=3)
    for x, y in ((1000, 10.0), (2000, 30.0), (3000, 50.0)):  # exact line has intercept -10
        fit.observe(x, y)
    assert fit.intercept == 0.0
    assert fit.slope > 0


def test_bad_observations_are_rejected_and_counted() -> None:
    cm = CostModel(min_points=2)
    assert not cm.observe_prefill(100, math.nan)
    assert not cm.observe_prefill(-1, 5.0)
    assert not cm.observe_transfer(100, math.inf)
    assert not cm.observe_decode_step(0, 45.0)  # an empty batch is not a step
    assert cm.calibration()["prefill"]["rejected"] == 2
    assert cm.prefill_ms(100) == pytest.approx(23.5)


def test_linear_fit_rejects_bad_window() -> None:
    with pytest.raises(ValueError):
        LinearFit(0, 0, window=4, min_points=5)


# ---- service-time files ------------------------------------------------------------


def test_service_times_validation() -> None:
    with pytest.raises(ServiceTimesError):
        ServiceTimes(prefill_ms_per_token=-1)
    with pytest.raises(ServiceTimesError):
        ServiceTimes(decode_slots=0)
    with pytest.raises(ServiceTimesError):
        ServiceTimes(link_bytes_per_s=0)
    with pytest.raises(ServiceTimesError):
        ServiceTimes().replace(no_such_field=1)
    assert ServiceTimes.from_dict({"decode_slots": 16.0}).decode_slots == 16


def test_file_round_trip(tmp_path) -> None:
    tables = MeasuredTables(prefill=((100.0, 10.0), (200.0, 20.0)))
    content = ServiceTimesFile(ServiceTimes(decode_step_base_ms=30.0), tables, "unit test")
    path = tmp_path / "st.json"
    st.save(path, content)
    data = json.loads(path.read_text())
    assert data["format"] == "epd.service-times" and data["version"] == 2
    assert st.load(path) == content


def test_file_errors_are_clear(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "epd.service-times", "version": 3}))
    with pytest.raises(ServiceTimesError, match="version"):
        st.load(path)
    path.write_text(json.dumps({"format": "epd.service-times", "version": 1, "params": {"encode_ms_per_image": 40}}))
    with pytest.raises(ServiceTimesError, match="per image token.*epd profile"):   # encodes priced per image before
        st.load(path)
    path.write_text(json.dumps({"format": "epd.service-times", "version": 2, "params": {"bogus": 1}}))
    with pytest.raises(ServiceTimesError, match="bogus"):
        st.load(path)
    path.write_text(json.dumps({"format": "epd.service-times", "version": 2, "tables": {"prefill": [[1, -2]]}}))
    with pytest.raises(ServiceTimesError, match="prefill"):
        st.load(path)
    path.write_text("{not json")
    with pytest.raises(ServiceTimesError, match="JSON"):
        st.load(path)
    with pytest.raises(ServiceTimesError, match="cannot read"):
        st.load(tmp_path / "missing.json")


def test_cost_model_fits_the_measured_tables(tmp_path) -> None:
    path = tmp_path / "profile.json"
    tables = MeasuredTables(
        prefill=tuple((t, 10.0 + 0.05 * t) for t in (128, 512, 2048, 8192)),
        decode_step=tuple((b, 20.0 + 0.5 * b) for b in (1, 8, 16, 32)),
        transfer=((GIB, 8.0 + 1000 / 16), (2 * GIB, 8.0 + 2000 / 16)),
        encode=((64, 50.0), (128, 80.0), (256, 140.0)),
    )
    st.save(path, ServiceTimesFile(ServiceTimes(decode_slots=64), tables, "epd profile"))
    fitted = CostModel.from_file(path).service_times()
    assert fitted.prefill_base_ms == pytest.approx(10.0)
    assert fitted.prefill_ms_per_token == pytest.approx(0.05)
    assert fitted.decode_step_base_ms == pytest.approx(20.0)
    assert fitted.decode_step_ms_per_seq == pytest.approx(0.5)
    assert fitted.link_setup_ms == pytest.approx(8.0)
    assert fitted.link_bytes_per_s == pytest.approx(16 * GIB, rel=1e-6)
    assert fitted.encode_base_ms == pytest.approx(20.0)
    assert fitted.encode_ms_per_token == pytest.approx(30.0 / 64)
    assert fitted.decode_slots == 64  # not fitted: from params


def test_sliding_window_fit_matches_batch_least_squares() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    fit = LinearFit(5.0, 0.1, window=32, min_points=2)
    xs = rng.uniform(0, 8192, 500)
    ys = 3.0 + 0.02 * xs + rng.normal(0, 1.0, 500)
    for x, y in zip(xs, ys):
        fit.observe(float(x), float(y))
    slope, intercept = np.polyfit(xs[-32:], ys[-32:], 1)
    assert fit.slope == pytest.approx(slope, rel=1e-9)
    assert fit.intercept == pytest.approx(intercept, rel=1e-9)


# ---- prefill's quadratic term --------------------------------------------------------


def test_prefill_fit_finds_the_attention_term() -> None:
    """A prompt's prefill grows with its square (attention): the fit recovers the curve, so a
    short prompt is not charged a line through the long ones."""
    cm = CostModel(window=64, min_points=3)
    for tokens in (26, 126, 426, 1026, 26, 426):
        cm.observe_prefill(tokens, 5.0 + 0.02 * tokens + 5e-5 * tokens * tokens)
    fitted = cm.service_times()
    assert fitted.prefill_base_ms == pytest.approx(5.0)
    assert fitted.prefill_ms_per_token == pytest.approx(0.02)
    assert fitted.prefill_ms_per_token2 == pytest.approx(5e-5)
    assert cm.prefill_ms(26) == pytest.approx(5.0 + 0.52 + 0.0338)


def test_quadratic_chunks_add_up_to_the_whole_prompt() -> None:
    cm = CostModel(ServiceTimes(prefill_base_ms=5.0, prefill_ms_per_token=0.02, prefill_ms_per_token2=5e-5))
    chunks = cm.chunk_times(1000, 256)
    assert sum(chunks) == pytest.approx(cm.prefill_ms(1000))
    assert chunks[2] > chunks[1]  # later full chunks attend to more context
    assert cm.chunk_ready_ms(1000, 256)[-1] == pytest.approx(cm.prefill_ms(1000))


def test_quadratic_fit_never_goes_negative_and_prefers_a_line() -> None:
    fit = QuadraticFit(20.0, 0.035, window=16, min_points=2)
    fit.observe(100, 15.0)
    fit.observe(300, 35.0)  # two sizes: a line, not a guessed curve
    assert (fit.intercept, fit.slope, fit.curve) == pytest.approx((5.0, 0.1, 0.0))
    fit = QuadraticFit(20.0, 0.035, window=16, min_points=3)
    for x in (100, 200, 400, 800):  # concave: the best non-negative fit has no curve
        fit.observe(x, 10.0 * math.sqrt(x))
    assert fit.curve == 0.0 and fit.slope > 0 and fit.intercept > 0
    fit = QuadraticFit(20.0, 0.035, window=16, min_points=3)
    for x in (1000, 2000, 3000):  # exact line with intercept -10: clamped, the rest refit
        fit.observe(x, 0.02 * x - 10.0)
    assert fit.intercept == 0.0 and fit.slope >= 0 and fit.curve >= 0
    assert fit(2000) == pytest.approx(30.0, rel=0.2)


def test_quadratic_window_matches_batch_least_squares() -> None:
    import numpy as np

    rng = np.random.default_rng(1)
    fit = QuadraticFit(5.0, 0.1, window=32, min_points=3)
    xs = rng.uniform(0, 8192, 500)
    ys = 3.0 + 0.02 * xs + 4e-6 * xs * xs + rng.normal(0, 1.0, 500)
    for x, y in zip(xs, ys):
        fit.observe(float(x), float(y))
    curve, slope, intercept = np.polyfit(xs[-32:], ys[-32:], 2)
    assert fit.curve == pytest.approx(curve, rel=1e-6)
    assert fit.slope == pytest.approx(slope, rel=1e-6)
    assert fit.intercept == pytest.approx(intercept, rel=1e-6)


def test_quadratic_fit_keeps_the_prior_shape_when_times_fall() -> None:
    fit = QuadraticFit(20.0, 0.035, window=16, min_points=2)
    fit.observe(10, 50.0)
    fit.observe(60, 45.0)  # the longer prompt was faster: noise
    assert (fit.slope, fit.curve) == (0.035, 0.0)
    assert fit(100) > fit(10) > 0


def test_tables_are_fitted_on_their_medians_weighted_by_count() -> None:
    steps = [(1.0, 4.0)] * 6 + [(1.0, 20.0)] + [(8.0, 8.0)] * 3  # one preempted batch-1 step
    fitted = CostModel.from_tables(ServiceTimes(), MeasuredTables(decode_step=tuple(steps))).service_times()
    assert fitted.decode_step_base_ms + fitted.decode_step_ms_per_seq == pytest.approx(4.0)
    assert fitted.decode_step_base_ms + 8 * fitted.decode_step_ms_per_seq == pytest.approx(8.0)
    one_size = CostModel.from_tables(ServiceTimes(), MeasuredTables(encode=((16.0, 4.0), (16.0, 5.0), (16.0, 30.0))))
    assert one_size.encode_ms(16) == pytest.approx(5.0)  # enough points at one size: the level is refit, not the prior's
