"""Placement, admission and failure policy: the chapter's decisions, computed."""

from __future__ import annotations

import pytest

from runtime.policy.cost_model import CostModel
from runtime.policy.failure_policy import on_transfer_failure
from runtime.policy.loads import (
    DecodeWorkerLoad,
    EncoderLoad,
    LinkLoad,
    PrefillWorkerLoad,
    Pressure,
    RequestShape,
    StageLoads,
)
from runtime.policy.placement_policy import MIN_RETRY_MS, REASONS, admit, choose_placement, link_share

CM = CostModel()
LONG = RequestShape(6000, 400)
SHORT = RequestShape(500, 400)


def loads(*decode: DecodeWorkerLoad, prefill: tuple[PrefillWorkerLoad, ...] = (PrefillWorkerLoad("p0"),)) -> StageLoads:
    return StageLoads(decode=decode, prefill=prefill)


def busy(name: str = "d0", running: int = 8, **kw: object) -> DecodeWorkerLoad:
    return DecodeWorkerLoad(name, running_seqs=running, free_slots=32 - running, **kw)  # type: ignore[arg-type]


# ---- estimates (as choose_placement reports them) ----------------------------------


def local(shape: RequestShape, worker: DecodeWorkerLoad, **kw: object) -> dict[str, float]:
    """The colocated estimate on ``worker`` alone (mode colocated: no remote option evaluated)."""
    decision = choose_placement(shape, loads(worker, prefill=()), CM, "colocated", 600.0, 150.0, **kw)  # type: ignore[arg-type]
    assert decision is not None and decision.placement == "colocated"
    return decision.estimates


def remote(shape: RequestShape, prefill: PrefillWorkerLoad, decode: DecodeWorkerLoad, **kw: object) -> dict[str, float]:
    """The remote estimate for ``prefill`` -> ``decode`` (mode disaggregated)."""
    decision = choose_placement(shape, loads(decode, prefill=(prefill,)), CM, "disaggregated", 600.0, 150.0, **kw)  # type: ignore[arg-type]
    assert decision is not None and decision.placement == "disaggregated"
    return decision.estimates


def test_local_estimate_counts_the_stall_on_every_neighbour() -> None:
    est = local(LONG, busy(running=8))
    assert est["local_ttft_ms"] == pytest.approx(230.0)
    assert est["local_gap_ms"] == pytest.approx(275.0)  # 230 ms prefill + one 45 ms step
    assert est["local_interference_ms"] == pytest.approx(8 * 230.0)
    assert est["local_breached"] == 8
    idle = local(LONG, busy(running=0))
    assert (idle["local_interference_ms"], idle["local_breached"]) == (0.0, 0)


def test_local_chunked_prefill_keeps_gaps_under_the_slo() -> None:
    est = local(LONG, busy(running=8), local_chunk_tokens=512)
    assert est["local_gap_ms"] < 150.0
    assert est["local_interference_ms"] == 0.0 and est["local_breached"] == 0
    assert est["local_ttft_ms"] > 230.0  # chunks share iterations with decode steps


def test_remote_estimate_is_the_chapters_370_ms() -> None:
    est = remote(LONG, PrefillWorkerLoad("p0"), busy())
    assert est["remote_ttft_ms"] == pytest.approx(370.2, abs=0.1)
    assert est["remote_transfer_ms"] == pytest.approx(95.2, abs=0.1)
    chunked = remote(LONG, PrefillWorkerLoad("p0"), busy(), transfer_chunk_tokens=2000)
    assert chunked["remote_ttft_ms"] == pytest.approx(314.7, abs=0.1)


def test_remote_estimate_adds_queues() -> None:
    base = remote(LONG, PrefillWorkerLoad("p0"), busy())["remote_ttft_ms"]
    queued = remote(LONG, PrefillWorkerLoad("p0", queue_wait_ms=100.0), busy())["remote_ttft_ms"]
    assert queued == pytest.approx(base + 100.0)
    full = DecodeWorkerLoad("d0", running_seqs=32, free_slots=0, slot_wait_ms=2000.0)
    assert remote(LONG, PrefillWorkerLoad("p0"), full)["remote_ttft_ms"] == pytest.approx(2045.0)


def test_a_request_of_n_choices_waits_until_n_slots_are_free() -> None:
    """n sequences take n batch slots: one free slot serves n=1 at once; n=3 waits for the slot wait."""
    one_free = DecodeWorkerLoad("d0", running_seqs=31, free_slots=1, slot_wait_ms=2000.0)
    three = RequestShape(6000, 400, choices=3)
    assert remote(LONG, PrefillWorkerLoad("p0"), one_free)["remote_ttft_ms"] < 2000.0
    assert remote(three, PrefillWorkerLoad("p0"), one_free)["remote_ttft_ms"] == pytest.approx(
        2000.0 + CM.decode_step_ms(32))
    assert local(three, one_free)["local_ttft_ms"] > local(LONG, one_free)["local_ttft_ms"] + 1999.0


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
    shape = RequestShape(6000, 400, n_images=2, n_images_cached=1, image_tokens=512, image_tokens_cached=256)
    state = StageLoads(decode=(busy(running=0),), prefill=(PrefillWorkerLoad("p0"),), encoder=EncoderLoad(50.0))
    decision = choose_placement(shape, state, CM, "colocated", 600.0, 150.0)
    assert decision is not None
    assert decision.estimates["ttft_ms"] == pytest.approx(50.0 + CM.encode_ms(256, 1) + 230.0)


def test_an_encode_is_priced_by_its_images_tokens() -> None:
    """A large image costs the tower its patches: one image of 2,304 tokens (a 1344x1344 Qwen-VL
    image) is priced as nine of 256, not as one, and can miss a deadline a small one meets."""
    small = RequestShape(600, 16, n_images=1, image_tokens=256)
    large = RequestShape(2648, 16, n_images=1, image_tokens=2304)
    state = StageLoads(decode=(busy(running=0),), encoder=EncoderLoad(0.0))
    at = {s.image_tokens: choose_placement(s, state, CM, "colocated", 600.0, 150.0) for s in (small, large)}
    encode = {t: d.estimates["ttft_ms"] - CM.prefill_ms(p) for (t, d), p in zip(at.items(), (600, 2648))}
    assert encode[256] == pytest.approx(10.0 + 40.0) and encode[2304] == pytest.approx(10.0 + 9 * 40.0)
    with pytest.raises(ValueError):
        RequestShape(600, 16, n_images=2, image_tokens=1)     # every image has a token
    with pytest.raises(ValueError):
        RequestShape(600, 16, n_images=1, image_tokens=256, image_tokens_cached=300)


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
    assert verdict.retry_after_ms == pytest.approx(4200.0 + 370.0 - 600.0, abs=1.0)   # retry-after-ms: the wait itself
    assert verdict.estimated_ttft_ms == pytest.approx(4200.0 + 370.0, abs=1.0)   # the estimate it refused on


def test_admit_refuses_without_decode_capacity() -> None:
    full = DecodeWorkerLoad("d0", running_seqs=32, free_slots=0, free_blocks=0, slot_wait_ms=300.0)
    verdict = admit(SHORT, loads(full), CM, "disaggregated", 600.0, 150.0)
    assert (verdict.ok, verdict.reason, verdict.retry_after_s, verdict.retry_after_ms) == (False, "no_decode_capacity", 1, 300.0)
    none = admit(SHORT, StageLoads(decode=()), CM, "disaggregated", 600.0, 150.0)
    assert (none.reason, none.retry_after_s, none.retry_after_ms) == ("no_decode_workers", 1, 1000.0)


def test_admit_refuses_what_the_pipeline_backlog_would_delay_past_the_deadline() -> None:
    state = loads(busy(running=0))
    ttft = admit(LONG, state, CM, "conditional", 600.0, 150.0).decision.estimates["ttft_ms"]  # type: ignore[union-attr]
    calm = admit(LONG, state, CM, "conditional", 600.0, 150.0, pressure=Pressure(10, None, 0.0))
    assert calm.ok and calm.backlog_ms == 0.0  # no rate seen yet: the stage estimates decide alone
    queued = Pressure(waiting=20, first_token_rate_per_s=100.0, overrun_ms=50.0)  # 200 ms of backlog
    assert queued.backlog_ms() == pytest.approx(200.0)
    fits = admit(LONG, state, CM, "conditional", ttft + 251.0, 150.0, pressure=queued)
    assert fits.ok and (fits.backlog_ms, fits.overrun_ms) == (pytest.approx(200.0), 50.0)
    late = admit(LONG, state, CM, "conditional", ttft + 249.0, 150.0, pressure=queued)
    assert (late.ok, late.reason, late.retry_after_s) == (False, "pipeline_backlog", 1)
    # what it weighed, for the refused request's record
    assert (late.estimated_ttft_ms, late.backlog_ms, late.overrun_ms) == (pytest.approx(ttft), pytest.approx(200.0), 50.0)
    assert late.estimated_queue_ms == 0.0   # an idle worker reported no queue


def test_the_backlog_and_the_reported_queue_are_one_wait_counted_once() -> None:
    """A burst the decode worker has reported queued is in the estimate already; the pressure's backlog
    (the same waiting requests over their first-token rate) adds only what it sees beyond that."""
    queued = loads(busy(running=0, queue_wait_ms=900.0))
    decision = admit(SHORT, queued, CM, "colocated", 60_000.0, 150.0).decision
    assert decision is not None and decision.estimates["queue_ms"] == pytest.approx(900.0)
    ttft = decision.estimates["ttft_ms"]
    burst = Pressure(waiting=10, first_token_rate_per_s=10.0, overrun_ms=100.0)   # 1000 ms of backlog
    fits = admit(SHORT, queued, CM, "colocated", ttft + 250.0, 150.0, pressure=burst)   # 1000 less the 900 estimated
    assert fits.ok and fits.backlog_ms == pytest.approx(1000.0)   # reported whole (the margin is learnt against it)
    late = admit(SHORT, queued, CM, "colocated", ttft + 150.0, 150.0, pressure=burst)
    assert (late.ok, late.reason) == (False, "pipeline_backlog")
    unreported = loads(busy(running=0))   # the worker has not reported the burst yet: the backlog counts whole
    ttft0 = admit(SHORT, unreported, CM, "colocated", 60_000.0, 150.0).decision.estimates["ttft_ms"]  # type: ignore[union-attr]
    assert admit(SHORT, unreported, CM, "colocated", ttft0 + 1150.0, 150.0, pressure=burst).ok
    assert not admit(SHORT, unreported, CM, "colocated", ttft0 + 1050.0, 150.0, pressure=burst).ok


def test_the_margin_corrects_the_backlog_not_a_reported_queue() -> None:
    """The margin is how much later than backlog and estimate recent first tokens came, mostly the queue
    of a burst its worker had not reported yet. Once the report holds that queue, the margin must not
    be added on top of it: the backlog plus its margin and the reported queue are one wait."""
    queued = loads(busy(running=0, queue_wait_ms=900.0))
    ttft = admit(SHORT, queued, CM, "colocated", 60_000.0, 150.0).decision.estimates["ttft_ms"]  # type: ignore[union-attr]
    after_lag = Pressure(waiting=2, first_token_rate_per_s=10.0, overrun_ms=600.0)   # 200 ms backlog + 600 margin
    fits = admit(SHORT, queued, CM, "colocated", ttft + 10.0, 150.0, pressure=after_lag)
    assert fits.ok and (fits.backlog_ms, fits.overrun_ms) == (pytest.approx(200.0), 600.0)
    more = Pressure(waiting=5, first_token_rate_per_s=10.0, overrun_ms=600.0)   # 500 + 600 = 200 beyond the queue
    assert admit(SHORT, queued, CM, "colocated", ttft + 210.0, 150.0, pressure=more).ok
    late = admit(SHORT, queued, CM, "colocated", ttft + 190.0, 150.0, pressure=more)
    assert (late.ok, late.reason, late.retry_after_s) == (False, "pipeline_backlog", 1)   # 10 ms over: the least
    assert late.retry_after_ms == MIN_RETRY_MS   # 10 ms: a retry that soon meets the same queue
    assert late.estimated_queue_ms == pytest.approx(900.0)   # in the refused request's record
    deep = Pressure(waiting=30, first_token_rate_per_s=10.0, overrun_ms=600.0)   # 3000 + 600: 2700 beyond the queue
    far = admit(SHORT, queued, CM, "colocated", ttft + 100.0, 150.0, pressure=deep)
    assert (far.reason, far.retry_after_s) == ("pipeline_backlog", 3)   # over by 2600 ms, not the whole 3600
    assert far.retry_after_ms == pytest.approx(2600.0, abs=20.0)
    unreported = loads(busy(running=0))   # nothing reported: backlog and margin count whole
    ttft0 = admit(SHORT, unreported, CM, "colocated", 60_000.0, 150.0).decision.estimates["ttft_ms"]  # type: ignore[union-attr]
    assert not admit(SHORT, unreported, CM, "colocated", ttft0 + 790.0, 150.0, pressure=after_lag).ok
    assert admit(SHORT, unreported, CM, "colocated", ttft0 + 810.0, 150.0, pressure=after_lag).ok


def test_an_empty_pipeline_is_judged_by_its_stage_estimates_alone() -> None:
    """A burst's margin (recent first tokens much later than estimated) must not refuse a request
    that finds nothing waiting: refusals bring no first tokens to correct the margin, so a tight SLO
    right after a burst would refuse every request of an idle server until the window forgot."""
    state = loads(busy(running=0))
    ttft = admit(LONG, state, CM, "conditional", 600.0, 150.0).decision.estimates["ttft_ms"]  # type: ignore[union-attr]
    after_burst = Pressure(waiting=0, first_token_rate_per_s=100.0, overrun_ms=400.0)
    idle = admit(LONG, state, CM, "conditional", ttft + 10.0, 150.0, pressure=after_burst)
    assert idle.ok and idle.overrun_ms == 0.0
    one_waiting = Pressure(waiting=1, first_token_rate_per_s=100.0, overrun_ms=400.0)
    busy_now = admit(LONG, state, CM, "conditional", ttft + 10.0, 150.0, pressure=one_waiting)
    assert (busy_now.ok, busy_now.reason) == (False, "pipeline_backlog")


# ---- transfer failure --------------------------------------------------------------


def failure_loads(*, other_decode: bool = False, prefill_wait_ms: float = 0.0, link: LinkLoad | None = None) -> StageLoads:
    """The decode worker ``d0`` whose transfer failed, maybe another with room, one prefill worker."""
    decode = (busy("d0", 0),) + ((busy("d1", 0),) if other_decode else ())
    return StageLoads(decode, (PrefillWorkerLoad("p0", prefill_wait_ms),), link or LinkLoad())


def test_worked_example_failure_retry_when_reservation_held() -> None:
    left = 600.0 - CM.remote_ttft_ms(6000)  # ~230 ms of budget when the link drops
    action = on_transfer_failure(left, 1, LONG, CM, failure_loads(), "d0", reservation_held=True)
    assert (action.kind, action.reason) == ("retry", "reservation_held_retry_fits")
    assert action.cost_ms == pytest.approx(95.2 + 45.0, abs=0.1)


def test_worked_example_failure_fails_when_reservation_released() -> None:
    left = 600.0 - CM.remote_ttft_ms(6000)
    action = on_transfer_failure(left, 1, LONG, CM, failure_loads(), "d0", reservation_held=False)
    assert (action.kind, action.reason) == ("fail", "deadline_exhausted")  # re-prefill needs ~370 ms


def test_failure_other_decode_and_reprefill() -> None:
    action = on_transfer_failure(300.0, 1, LONG, CM, failure_loads(other_decode=True), "d0", reservation_held=False)
    assert action.kind == "other_decode"
    action = on_transfer_failure(1000.0, 1, LONG, CM, failure_loads(), "d0", reservation_held=False)
    assert action.kind == "reprefill" and action.cost_ms == pytest.approx(370.2, abs=0.1)
    busy_prefill = on_transfer_failure(500.0, 1, LONG, CM, failure_loads(prefill_wait_ms=200.0), "d0",
                                       reservation_held=False)
    assert busy_prefill.kind == "fail"
    no_prefill = on_transfer_failure(1000.0, 1, LONG, CM, StageLoads((busy("d0", 0),)), "d0", reservation_held=False)
    assert no_prefill.kind == "fail"  # no prefill worker left to re-prefill on


def test_a_lost_decode_worker_leaves_only_another_decode_worker() -> None:
    # its blocks died with it: neither a retry nor a re-prefill into them, however much time is left
    lost = on_transfer_failure(10_000.0, 1, LONG, CM, failure_loads(), "d0", decode_lost=True)
    assert (lost.kind, lost.reason) == ("fail", "decode_worker_lost_no_other")
    moved = on_transfer_failure(10_000.0, 1, LONG, CM, failure_loads(other_decode=True), "d0", decode_lost=True)
    assert (moved.kind, moved.reason) == ("other_decode", "decode_worker_lost")
    full = StageLoads((busy("d0", 0), busy("d1", 32)), (PrefillWorkerLoad("p0"),))
    assert on_transfer_failure(10_000.0, 1, LONG, CM, full, "d0", decode_lost=True).kind == "fail"  # d1 has no slot
    held = on_transfer_failure(10_000.0, 1, LONG, CM, failure_loads(), "d0")
    assert held.kind == "retry"


def test_failure_retries_are_bounded_and_see_the_link_queue() -> None:
    exhausted = on_transfer_failure(10_000.0, 3, LONG, CM, failure_loads(other_decode=True), "d0", max_attempts=3)
    assert exhausted.reason == "attempts_exhausted"
    queued = LinkLoad(queued_bytes=10 * CM.kv_bytes(6000))
    action = on_transfer_failure(230.0, 1, LONG, CM, failure_loads(link=queued), "d0")
    assert action.kind == "fail"  # ten transfers ahead: a retry cannot land in time
    with pytest.raises(ValueError):
        on_transfer_failure(100.0, 0, LONG, CM, failure_loads(), "d0")


def test_a_retry_costs_a_step_of_the_failed_workers_batch() -> None:
    state = StageLoads((busy("d0", 20),), (PrefillWorkerLoad("p0"),))
    service = CostModel(CM.service_times().replace(decode_step_ms_per_seq=1.0))
    action = on_transfer_failure(10_000.0, 1, LONG, service, state, "d0")
    assert action.cost_ms == pytest.approx(service.transfer_ms(service.kv_bytes(6000)) + service.decode_step_ms(21))


# ---- a prefill worker on the decode worker's own cores --------------------------------


def test_a_prefill_worker_on_the_decode_workers_busy_cores_is_charged_its_queue_beside_its_ttft() -> None:
    # a short prompt, the decode worker's colocated queue 100 ms deep: apart, remote is sooner
    queued = busy(running=4, queue_wait_ms=100.0)
    apart = choose_placement(SHORT, loads(queued, prefill=(PrefillWorkerLoad("p0"),)), CM, "conditional", 2000.0, 150.0)
    assert apart is not None and (apart.placement, apart.reason) == ("disaggregated", "local_queue_slower")
    assert apart.estimates["remote_shared_ms"] == 0.0
    # the same prefill worker on the decode worker's saturated cores: its prompt takes what that queue needs
    saturated = PrefillWorkerLoad("p0", shared_cores=(("d0", 1.0),))
    same = choose_placement(SHORT, loads(queued, prefill=(saturated,)), CM, "conditional", 2000.0, 150.0)
    assert same is not None and (same.placement, same.reason) == ("colocated", "short_prompt_low_load")
    assert same.estimates["remote_shared_ms"] == pytest.approx(100.0)
    # ... charged to the choice, not to the remote first token, which joins d0's next step whatever d0 has queued
    assert same.estimates["remote_ttft_ms"] == pytest.approx(apart.estimates["remote_ttft_ms"])
    # on shared cores that sit half idle, half the queue; on idle ones, none
    half = remote(SHORT, PrefillWorkerLoad("p0", shared_cores=(("d0", 0.5),)), queued)
    assert half["remote_shared_ms"] == pytest.approx(50.0) and half["ttft_ms"] == pytest.approx(apart.estimates["remote_ttft_ms"])
    idle = remote(SHORT, PrefillWorkerLoad("p0", shared_cores=(("d0", 0.0),)), queued)
    assert idle["remote_shared_ms"] == 0.0


def test_a_deep_colocated_queue_on_shared_cores_does_not_refuse_what_the_prefill_worker_serves_in_time() -> None:
    """A long prompt behind a decode worker's queue of long colocated prompts, its prefill worker on
    the same saturated cores: colocated misses the deadline, remote does not, so it goes remote and
    is admitted. Counted as a wait of its own, the shared queue made remote miss too, and the
    request was refused (bench-long: estimates of 20-26 s against 20 s left, while the remote
    prompts admitted beside it had first tokens in 1-3 s)."""
    deep = busy(running=10, queue_wait_ms=25_000.0)
    saturated = PrefillWorkerLoad("p0", queue_wait_ms=1_000.0, shared_cores=(("d0", 1.0),))
    verdict = admit(LONG, loads(deep, prefill=(saturated,)), CM, "conditional", 20_000.0, 2_000.0)
    assert verdict.ok and verdict.decision is not None
    assert (verdict.decision.placement, verdict.decision.reason) == ("disaggregated", "local_misses_deadline")
    assert verdict.decision.estimates["ttft_ms"] < 20_000.0 < verdict.decision.estimates["local_ttft_ms"]
    assert verdict.decision.estimates["queue_ms"] == pytest.approx(1_000.0)   # the prefill queue it waits out


def test_the_shared_cores_charge_of_a_long_prompt_is_at_most_its_own_prefill() -> None:
    """P's prompt holds the shared cores for its own prefill, so a prompt longer than a chunk takes at
    most that from the decode worker's queue: behind a queue of colocated long prompts it goes to an
    idle prefill worker on those cores. Charged the whole queue, it stayed colocated behind it (bench-long: first
    tokens in ~10 s colocated against ~2 s remote)."""
    deep = busy(running=10, queue_wait_ms=5_000.0)
    saturated = PrefillWorkerLoad("p0", shared_cores=(("d0", 1.0),))
    decision = choose_placement(LONG, loads(deep, prefill=(saturated,)), CM, "conditional", 20_000.0, 2_000.0,
                                local_chunk_tokens=512)
    assert decision is not None and (decision.placement, decision.reason) == ("disaggregated", "local_queue_slower")
    assert decision.estimates["remote_shared_ms"] == pytest.approx(CM.prefill_ms(LONG.prompt_tokens))
    # a queue shorter than the prompt's prefill is charged whole, in the share the cores are busy
    shallow = remote(LONG, PrefillWorkerLoad("p0", shared_cores=(("d0", 0.5),)), busy(running=10, queue_wait_ms=100.0),
                     local_chunk_tokens=512)
    assert shallow["remote_shared_ms"] == pytest.approx(50.0)
    # a prompt within a chunk rides the decode worker's next refill step with that queue: charged all of it
    short = remote(SHORT, saturated, deep, local_chunk_tokens=512)
    assert short["remote_shared_ms"] == pytest.approx(5_000.0)


def test_shared_cores_count_only_for_the_decode_worker_they_are_shared_with() -> None:
    queued = busy("d0", running=4, queue_wait_ms=100.0)
    other = busy("d1", running=4, queue_wait_ms=100.0)
    p = PrefillWorkerLoad("p0", shared_cores=(("d0", 1.0),))
    decision = choose_placement(SHORT, loads(queued, other, prefill=(p,)), CM, "disaggregated", 2000.0, 150.0)
    assert decision is not None and decision.decode_worker == "d1"   # d1's cores are not the prompt's


# ---- a prefill worker on cores apart from the decode worker's ------------------------


def test_on_cores_apart_a_short_prompt_beside_busy_decoders_spares_them_its_stall() -> None:
    """Within the ITL SLO a colocated stall costs nothing, unless the prefill worker computes on
    other cores: then the split removes the stall from every neighbour at the price of its transfer."""
    shared = choose_placement(SHORT, loads(busy(running=8)), CM, "conditional", 2000.0, 150.0)
    assert shared is not None and (shared.placement, shared.reason) == ("colocated", "short_prompt_low_load")
    assert shared.estimates["local_breached"] == 0     # 37.5 ms of prompt beside a 45 ms step: within 150 ms
    apart = (PrefillWorkerLoad("p0", apart_from=("d0",)),)
    split = choose_placement(SHORT, loads(busy(running=8), prefill=apart), CM, "conditional", 2000.0, 150.0)
    assert split is not None and (split.placement, split.reason) == ("disaggregated", "stall_on_busy_decoders")
    assert split.estimates["remote_ttft_ms"] > split.estimates["local_ttft_ms"]   # slower for itself, not for all
    # nobody decoding: nothing to spare, and the transfer buys nothing
    idle = choose_placement(SHORT, loads(busy(running=0), prefill=apart), CM, "conditional", 2000.0, 150.0)
    assert idle is not None and idle.placement == "colocated"
    # a prefill queue longer than the neighbours' whole stall (8 x 37.5 ms): colocated
    deep = (PrefillWorkerLoad("p0", queue_wait_ms=400.0, apart_from=("d0",)),)
    queued = choose_placement(SHORT, loads(busy(running=8), prefill=deep), CM, "conditional", 2000.0, 150.0)
    assert queued is not None and queued.placement == "colocated"
    # apart from another decode worker only: this one's neighbours still share the prompt's cores
    elsewhere = (PrefillWorkerLoad("p0", apart_from=("d9",)),)
    other = choose_placement(SHORT, loads(busy(running=8), prefill=elsewhere), CM, "conditional", 2000.0, 150.0)
    assert other is not None and other.placement == "colocated"
