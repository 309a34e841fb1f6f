"""Placement, admission and failure policy: the chapter's decisions, computed."""

from __future__ import annotations

import pytest

from runtime.policy.cost_model import CostModel
from runtime.policy.placement_policy import (
    REASONS,
    DecodeWorkerLoad,
    EncoderLoad,
    LinkLoad,
    PrefillWorkerLoad,
    RequestShape,
    StageLoads,
    admit,
    choose_placement,
    estimate_local,
    estimate_remote,
    link_share,
    on_transfer_failure,
)

CM = CostModel()
LONG = RequestShape(6000, 400)
SHORT = RequestShape(500, 400)


def loads(*decode: DecodeWorkerLoad, prefill: tuple[PrefillWorkerLoad, ...] = (PrefillWorkerLoad("p0"),)) -> StageLoads:
    return StageLoads(decode=decode, prefill=prefill)


def busy(name: str = "d0", running: int = 8, **kw: object) -> DecodeWorkerLoad:
    return DecodeWorkerLoad(name, running_seqs=running, free_slots=32 - running, **kw)  # type: ignore[arg-type]


# ---- estimates ---------------------------------------------------------------------


def test_local_estimate_counts_the_stall_on_every_neighbour() -> None:
    est = estimate_local(LONG, busy(running=8), CM, 150.0)
    assert est.ttft_ms == pytest.approx(230.0)
    assert est.gap_ms == pytest.approx(275.0)  # 230 ms prefill + one 45 ms step
    assert est.interference_ms == pytest.approx(8 * 230.0)
    assert est.breached == 8
    idle = estimate_local(LONG, busy(running=0), CM, 150.0)
    assert (idle.interference_ms, idle.breached) == (0.0, 0)


def test_local_chunked_prefill_keeps_gaps_under_the_slo() -> None:
    est = estimate_local(LONG, busy(running=8), CM, 150.0, local_chunk_tokens=512)
    assert est.gap_ms < 150.0
    assert est.interference_ms == 0.0 and est.breached == 0
    assert est.ttft_ms > 230.0  # chunks share iterations with decode steps


def test_remote_estimate_is_the_chapters_370_ms() -> None:
    est = estimate_remote(LONG, PrefillWorkerLoad("p0"), busy(), LinkLoad(), CM)
    assert est.ttft_ms == pytest.approx(370.2, abs=0.1)
    assert est.transfer_ms == pytest.approx(95.2, abs=0.1)
    chunked = estimate_remote(LONG, PrefillWorkerLoad("p0"), busy(), LinkLoad(), CM, transfer_chunk_tokens=2000)
    assert chunked.ttft_ms == pytest.approx(314.7, abs=0.1)


def test_remote_estimate_adds_queues() -> None:
    base = estimate_remote(LONG, PrefillWorkerLoad("p0"), busy(), LinkLoad(), CM).ttft_ms
    queued = estimate_remote(LONG, PrefillWorkerLoad("p0", queue_wait_ms=100.0), busy(), LinkLoad(), CM).ttft_ms
    assert queued == pytest.approx(base + 100.0)
    full = DecodeWorkerLoad("d0", running_seqs=32, free_slots=0, slot_wait_ms=2000.0)
    assert estimate_remote(LONG, PrefillWorkerLoad("p0"), full, LinkLoad(), CM).ttft_ms == pytest.approx(2045.0)


def test_link_share() -> None:
    assert link_share(100.0, LinkLoad()) == 1.0
    assert link_share(100.0, LinkLoad(active_transfers=1, inflight_bytes=100.0)) == pytest.approx(0.5)
    assert link_share(100.0, LinkLoad(active_transfers=1, inflight_bytes=1e6)) == pytest.approx(0.5)  # capped by own size
    assert link_share(100.0, LinkLoad(queued_bytes=300.0)) == pytest.approx(0.25)  # FIFO: wait for all of it


# ---- choose_placement --------------------------------------------------------------


def test_long_prompt_beside_busy_decoders_goes_remote() -> None:
    decision = choose_placement(LONG, loads(busy(running=8)), CM, "conditional", 600.0, 150.0)
    assert decision is not None
    assert (decision.placement, decision.reason) == ("disaggregated", "long_prompt_busy_decoders")
    assert (decision.decode_worker, decision.prefill_worker) == ("d0", "p0")
    assert decision.estimates["local_interference_ms"] == pytest.approx(1840.0)
    assert decision.estimates["ttft_ms"] == decision.estimates["remote_ttft_ms"]


def test_low_load_stays_colocated() -> None:
    decision = choose_placement(LONG, loads(busy(running=0)), CM, "conditional", 600.0, 150.0)
    assert decision is not None
    assert (decision.placement, decision.reason) == ("colocated", "short_prompt_low_load")
    assert decision.prefill_worker is None


def test_short_prompt_beside_busy_decoders_stays_colocated() -> None:
    decision = choose_placement(SHORT, loads(busy(running=20)), CM, "conditional", 600.0, 150.0)
    assert decision is not None and decision.placement == "colocated"
    assert decision.estimates["local_gap_ms"] < 150.0


def test_conditional_prefers_an_idle_decode_worker_for_local_prefill() -> None:
    decision = choose_placement(LONG, loads(busy("d0", 8), busy("d1", 0)), CM, "conditional", 600.0, 150.0)
    assert decision is not None
    assert (decision.placement, decision.decode_worker) == ("colocated", "d1")


def test_deadline_decides_when_only_one_option_meets_it() -> None:
    slow_prefill = (PrefillWorkerLoad("p0", queue_wait_ms=1000.0),)
    decision = choose_placement(LONG, loads(busy(running=0), prefill=slow_prefill), CM, "conditional", 600.0, 150.0)
    assert decision is not None and decision.placement == "colocated"
    backlog = busy(running=0, queue_wait_ms=900.0)
    decision = choose_placement(LONG, loads(backlog), CM, "conditional", 600.0, 150.0)
    assert decision is not None
    assert (decision.placement, decision.reason) == ("disaggregated", "local_misses_deadline")


def test_missing_own_deadline_is_better_than_breaching_many_neighbours() -> None:
    slow_prefill = (PrefillWorkerLoad("p0", queue_wait_ms=1000.0),)
    decision = choose_placement(LONG, loads(busy(running=8), prefill=slow_prefill), CM, "conditional", 600.0, 150.0)
    assert decision is not None and decision.placement == "disaggregated"


def test_forced_modes_and_fallbacks() -> None:
    state = loads(busy(running=8))
    colocated = choose_placement(LONG, state, CM, "colocated", 600.0, 150.0)
    remote = choose_placement(SHORT, loads(busy(running=0)), CM, "disaggregated", 600.0, 150.0)
    assert colocated is not None and (colocated.placement, colocated.reason) == ("colocated", "forced")
    assert remote is not None and (remote.placement, remote.reason) == ("disaggregated", "forced")
    no_prefill = choose_placement(LONG, loads(busy(), prefill=()), CM, "disaggregated", 600.0, 150.0)
    assert no_prefill is not None and (no_prefill.placement, no_prefill.reason) == ("colocated", "only_option")
    pure_decode = choose_placement(SHORT, loads(busy(accepts_local_prefill=False)), CM, "conditional", 600.0, 150.0)
    assert pure_decode is not None and (pure_decode.placement, pure_decode.reason) == ("disaggregated", "only_option")


def test_remote_spreads_over_decode_workers_with_free_slots() -> None:
    state = loads(busy("d0", 20), busy("d1", 4), busy("d2", 12))
    decision = choose_placement(SHORT, state, CM, "disaggregated", 600.0, 150.0)
    assert decision is not None and decision.decode_worker == "d1"


def test_no_decode_capacity_returns_none() -> None:
    full = DecodeWorkerLoad("d0", running_seqs=31, free_slots=1, free_blocks=10, block_size=16)
    assert choose_placement(LONG, loads(full), CM, "conditional", 600.0, 150.0) is None
    roomy = DecodeWorkerLoad("d1", free_blocks=10_000, block_size=16)
    decision = choose_placement(LONG, loads(full, roomy), CM, "conditional", 600.0, 150.0)
    assert decision is not None and decision.decode_worker == "d1"


def test_encoder_wait_counts_toward_ttft() -> None:
    shape = RequestShape(6000, 400, n_images=2, n_images_cached=1)
    state = StageLoads(decode=(busy(running=0),), prefill=(PrefillWorkerLoad("p0"),), encoder=EncoderLoad(50.0))
    decision = choose_placement(shape, state, CM, "colocated", 600.0, 150.0)
    assert decision is not None
    assert decision.estimates["ttft_ms"] == pytest.approx(50.0 + CM.encode_ms(2, 1) + 230.0)


def test_cached_prefix_on_a_decode_worker_shortens_local_prefill() -> None:
    cached = DecodeWorkerLoad("d1", running_seqs=0, free_slots=32, cached_prefix_tokens=5000)
    decision = choose_placement(LONG, loads(busy("d0", 0), cached), CM, "colocated", 600.0, 150.0)
    assert decision is not None and decision.decode_worker == "d1"
    assert decision.estimates["ttft_ms"] == pytest.approx(CM.prefill_ms(1000))


def test_reasons_are_label_safe_and_known() -> None:
    for reason in REASONS:
        assert reason.replace("_", "").isalnum() and reason.islower()
    with pytest.raises(ValueError):
        choose_placement(LONG, loads(busy()), CM, "sideways", 600.0, 150.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RequestShape(0, 10)
    with pytest.raises(ValueError):
        RequestShape(10, 10, n_images=1, n_images_cached=2)


# ---- admission ---------------------------------------------------------------------


def test_admit_accepts_with_the_decision() -> None:
    verdict = admit(LONG, loads(busy(running=8)), CM, "conditional", 600.0, 150.0)
    assert verdict.ok and verdict.retry_after_s == 0
    assert verdict.decision is not None and verdict.reason == verdict.decision.reason


def test_admit_refuses_a_missed_deadline_with_retry_after() -> None:
    backlog = (PrefillWorkerLoad("p0", queue_wait_ms=4200.0),)
    verdict = admit(LONG, loads(busy(running=8, queue_wait_ms=5000.0), prefill=backlog), CM, "conditional", 600.0, 150.0)
    assert not verdict.ok and verdict.decision is None
    assert verdict.reason == "ttft_deadline"
    assert verdict.retry_after_s == 4  # (4200 + 370 - 600) ms of queue must drain


def test_admit_refuses_without_decode_capacity() -> None:
    full = DecodeWorkerLoad("d0", running_seqs=32, free_slots=0, free_blocks=0, slot_wait_ms=300.0)
    verdict = admit(SHORT, loads(full), CM, "disaggregated", 600.0, 150.0)
    assert (verdict.ok, verdict.reason, verdict.retry_after_s) == (False, "no_decode_capacity", 1)
    assert admit(SHORT, StageLoads(decode=()), CM, "disaggregated", 600.0, 150.0).reason == "no_decode_workers"


# ---- transfer failure --------------------------------------------------------------


def test_worked_example_failure_retry_when_reservation_held() -> None:
    left = 600.0 - CM.remote_ttft_ms(6000)  # ~230 ms of budget when the link drops
    action = on_transfer_failure(left, True, 1, LONG, CM, other_decode_available=False, prefill_free=True)
    assert (action.kind, action.reason) == ("retry", "reservation_held_retry_fits")
    assert action.cost_ms == pytest.approx(95.2 + 45.0, abs=0.1)


def test_worked_example_failure_fails_when_reservation_released() -> None:
    left = 600.0 - CM.remote_ttft_ms(6000)
    action = on_transfer_failure(left, False, 1, LONG, CM, other_decode_available=False, prefill_free=True)
    assert (action.kind, action.reason) == ("fail", "deadline_exhausted")  # re-prefill needs ~370 ms


def test_failure_other_decode_and_reprefill() -> None:
    action = on_transfer_failure(300.0, False, 1, LONG, CM, other_decode_available=True, prefill_free=True)
    assert action.kind == "other_decode"
    action = on_transfer_failure(1000.0, False, 1, LONG, CM, other_decode_available=False, prefill_free=True)
    assert action.kind == "reprefill" and action.cost_ms == pytest.approx(370.2, abs=0.1)
    busy_prefill = on_transfer_failure(
        500.0, False, 1, LONG, CM, other_decode_available=False, prefill_free=False, prefill_wait_ms=200.0
    )
    assert busy_prefill.kind == "fail"


def test_failure_retries_are_bounded_and_see_the_link_queue() -> None:
    assert on_transfer_failure(10_000.0, True, 3, LONG, CM, True, True, max_attempts=3).reason == "attempts_exhausted"
    queued = LinkLoad(queued_bytes=10 * CM.kv_bytes(6000))
    action = on_transfer_failure(230.0, True, 1, LONG, CM, False, True, link=queued)
    assert action.kind == "fail"  # ten transfers ahead: a retry cannot land in time
    with pytest.raises(ValueError):
        on_transfer_failure(100.0, True, 0, LONG, CM, False, True)
