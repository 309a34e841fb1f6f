"""One snapshot of worker stats, one policy: the gateway's admission and the simulator's decide alike.

``tests/data/worker_stats.json`` holds real ``WorkerStats`` messages recorded from a running stack
(``tests/data/record_worker_stats.py``: idle, and at the peak of a burst), with the gateway's own
count of requests on each worker. Each is fed to the gateway's admission path (its registry's
handles hold the messages) and to the simulator's placement step; both must give the same
verdict, placement, workers, reason and estimates, for short and long prompts, with and without
images, idle and loaded. The other way round, a simulator's snapshot taken mid-run, written as
``WorkerStats``, gives the gateway the decision the simulator takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from gateway.admission import CPU_PRIOR, GatewayAdmission, worker_report
from gateway.settings import GatewaySettings
from gateway.worker_registry import WorkerHandle, WorkerRegistry
from proto.epd.v1 import epd_pb2 as pb
from runtime.policy.cost_model import CostModel
from runtime.policy.loads import Pressure, RequestShape
from runtime.policy.placement_policy import Admission
from runtime.policy.worker_stats import Role, StatsSnapshot, WorkerReport, decode_load, stage_loads
from sim.config import SimConfig
from sim.distributions import parse_distribution
from sim.request import SimRequest
from sim.simulator import Simulator
from sim.workload import RequestMix, Workload

RECORDED = json.loads((Path(__file__).parent / "data" / "worker_stats.json").read_text())
SETTINGS = GatewaySettings.model_construct(**RECORDED["settings"])  # the recorded stack's gateway, no EPD_* read

SHAPES = {
    "short_text": RequestShape(30, 16),
    "long_text": RequestShape(4000, 64),
    "short_image": RequestShape(600, 16, n_images=1, image_tokens=576),
    "long_images": RequestShape(5000, 64, n_images=2, n_images_cached=1, image_tokens=1152, image_tokens_cached=576),
}
BUDGETS = {"roomy": (5000.0, 1000.0), "tight_itl": (5000.0, 20.0), "tight_ttft": (120.0, 1000.0)}  # (TTFT left, ITL SLO)


def registry(snapshot: dict) -> WorkerRegistry:
    """A gateway registry whose healthy handles hold the recorded ``WorkerStats``."""
    reg = WorkerRegistry({}, None)
    for w in snapshot["workers"]:
        stats = json_format.ParseDict(w["stats"], pb.WorkerStats())
        reg.workers[w["role"]][w["address"]] = WorkerHandle(w["role"], w["address"], None, None, healthy=True,
                                                            stats=stats, inflight=w["inflight"])
    return reg


def gateway(snapshot: dict, pressure_waiting: int = 0) -> GatewayAdmission:
    admission = GatewayAdmission(SETTINGS)
    admission.kv_transfers, admission.kv_bytes = snapshot["kv_transfers"], snapshot["kv_bytes"]
    if pressure_waiting:  # ten first tokens in the window, then a queue of requests still waiting
        for _ in range(10):
            admission.pressure.admitted()
            admission.pressure.left(got_first_token=True, overrun_ms=40.0)
        for _ in range(pressure_waiting):
            admission.pressure.admitted()
    return admission


def simulator(cm: CostModel, itl_slo_ms: float, **config: object) -> Simulator:
    """The simulator set up as the recorded gateway runs (one chunk size for KV and colocated prompts)."""
    chunk = SETTINGS.prefill_chunk_tokens
    return Simulator(SimConfig(placement=SETTINGS.placement, transfer="chunked", chunk_tokens=chunk, chunked_prefill=True,
                               local_chunk_tokens=chunk, itl_slo_ms=itl_slo_ms, admission=True, **config),  # type: ignore[arg-type]
                     cost_model=cm)


def outcome(verdict: Admission) -> tuple:
    d = verdict.decision
    placed = None if d is None else (d.placement, d.decode_worker, d.prefill_worker, d.estimates)
    return verdict.ok, verdict.reason, verdict.retry_after_s, placed


CASES = [(snap, shape, budget, waiting) for snap in RECORDED["snapshots"] for shape in SHAPES for budget in BUDGETS
         for waiting in (0, 23)]


@pytest.mark.parametrize("snap, shape, budget, waiting", CASES)
def test_a_recorded_snapshot_gets_one_decision_from_the_gateway_and_the_simulator(snap, shape, budget, waiting) -> None:
    recorded, request, (left_ms, itl_ms) = RECORDED["snapshots"][snap], SHAPES[shape], BUDGETS[budget]
    reg, gw = registry(recorded), gateway(recorded, waiting)
    by_gateway = gw.admit(request, reg, left_ms, itl_ms)
    sim = simulator(gw.cost_model, itl_ms)
    by_simulator = sim.decide(request, gw.snapshot(reg), left_ms, gw.pressure.inputs())
    assert outcome(by_simulator) == outcome(by_gateway)


def test_the_recorded_cases_cover_every_kind_of_decision() -> None:
    seen = set()
    for snap, shape, budget, waiting in CASES:
        recorded = RECORDED["snapshots"][snap]
        verdict = gateway(recorded, waiting).admit(SHAPES[shape], registry(recorded), *BUDGETS[budget])
        seen.add((verdict.decision.placement if verdict.ok else "refused", verdict.reason))  # type: ignore[union-attr]
    assert {p for p, _ in seen} == {"colocated", "disaggregated", "refused"}
    assert {"short_prompt_low_load", "long_prompt_busy_decoders", "ttft_deadline", "pipeline_backlog"} <= {r for _, r in seen}


def test_the_gateway_reads_the_recorded_stats_as_the_policys_record() -> None:
    loaded = RECORDED["snapshots"]["loaded"]
    snap = gateway(loaded).snapshot(registry(loaded))
    (decode,) = [w for w in snap.workers if w.role is Role.DECODE]
    stats = next(w for w in loaded["workers"] if w["role"] == "decode")
    assert (decode.running_seqs, decode.queue_depth, decode.in_flight) == (
        stats["stats"]["running_seqs"], stats["stats"]["queue_depth"], stats["inflight"])
    assert decode.max_batch == stats["stats"]["max_batch_configured"] == 64  # the configured batch, not the observed
    assert {w.role for w in snap.workers} == {Role.ENCODER, Role.PREFILL, Role.DECODE}
    assert StatsSnapshot.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap


def to_worker_stats(report: WorkerReport) -> pb.WorkerStats:
    """A simulated worker's report as the real worker would send it."""
    return pb.WorkerStats(role=str(report.role), address=report.address, serving=True, running_seqs=report.running_seqs,
                          queue_depth=report.queue_depth, queued_prefill_tokens=report.queued_prefill_tokens,
                          free_blocks=report.free_blocks or 0, total_blocks=report.total_blocks,
                          block_size=report.block_size, max_batch_configured=report.max_batch)


def test_a_simulated_snapshot_sent_as_worker_stats_gets_the_simulators_decision() -> None:
    cm = CostModel()  # the chapter's numbers: the conditional split matters here
    sim = simulator(cm, 150.0, prefill_workers=2, decode_workers=2, decode_kv_tokens=400_000, ttft_slo_ms=3000.0)
    checked, kinds = [0], set()
    admit_next = sim._admit

    def check(req: SimRequest, now: float) -> None:
        snap = sim.snapshot(now)
        reg = WorkerRegistry({}, None)
        for r in snap.workers:
            reg.workers[str(r.role)][r.address] = WorkerHandle(str(r.role), r.address, None, None, healthy=True,
                                                               stats=to_worker_stats(r), inflight=r.in_flight)
        gw = GatewayAdmission(SETTINGS.model_copy(update={"placement": "conditional"}))
        gw.cost_model, gw.kv_transfers, gw.kv_bytes = cm, snap.kv_transfers, snap.kv_bytes
        pressure = sim.pressure.inputs(now)  # type: ignore[union-attr]
        gw.pressure.inputs = lambda: pressure  # type: ignore[method-assign]  # the simulator's, as data
        by_gateway = gw.admit(req.shape, reg, req.deadline - now, 150.0)
        assert outcome(sim.decide(req.shape, snap, req.deadline - now, pressure)) == outcome(by_gateway)
        kinds.add(by_gateway.decision.placement if by_gateway.ok else by_gateway.reason)  # type: ignore[union-attr]
        checked[0] += 1
        admit_next(req, now)

    sim._admit = check  # type: ignore[method-assign]
    mix = RequestMix(parse_distribution("mix:300@0.6,6000@0.4"), parse_distribution("uniform:20:200"))
    sim.run(Workload(mix, rate=6.0, requests=300, seed=4))
    assert checked[0] == 300 and {"colocated", "disaggregated"} <= kinds


# ---- the estimates stage_loads makes from the reports --------------------------------------


CM = CostModel()


def test_decode_slots_come_from_the_configured_batch_and_the_fresher_count() -> None:
    shape = RequestShape(100, 40)
    w = WorkerReport(Role.DECODE, "d", running_seqs=6, queue_depth=2, max_batch=10, in_flight=3)
    load = decode_load(w, shape, CM)
    assert (load.running_seqs, load.free_slots, load.slot_wait_ms) == (6, 2, 0.0)
    stale = WorkerReport(Role.DECODE, "d", running_seqs=0, queue_depth=0, max_batch=10, in_flight=7)  # placed since the poll
    assert (decode_load(stale, shape, CM).running_seqs, decode_load(stale, shape, CM).free_slots) == (7, 3)
    unknown = WorkerReport(Role.DECODE, "d", running_seqs=1)
    assert decode_load(unknown, shape, CM).free_slots == CM.decode_slots - 1  # no configured batch reported
    full = WorkerReport(Role.DECODE, "d", running_seqs=9, queue_depth=2, max_batch=10)
    # two more than the slots: the 2nd of 9 retirements spread over 40 tokens, 2 x 40 / 10 steps of the batch's step
    assert decode_load(full, shape, CM).slot_wait_ms == pytest.approx(2 * 40 / 10 * CM.decode_step_ms(9))


def test_a_request_of_n_choices_claims_n_decode_slots() -> None:
    """Two slots free: n=2 fits now; n=4 waits for the 2nd retirement of the 6 running (2 x 40 / 7 steps)."""
    w = WorkerReport(Role.DECODE, "d", running_seqs=6, queue_depth=2, max_batch=10)
    assert decode_load(w, RequestShape(100, 40, choices=2), CM).slot_wait_ms == 0.0
    assert decode_load(w, RequestShape(100, 40, choices=4), CM).slot_wait_ms == pytest.approx(
        2 * 40 / 7 * CM.decode_step_ms(6))
    placed = WorkerReport(Role.DECODE, "d", max_batch=10, in_flight=9)   # the gateway's count: one per choice
    assert decode_load(placed, RequestShape(100, 40, choices=2), CM).slot_wait_ms > 0.0


def test_queues_charge_the_fixed_prefill_cost_once_per_request() -> None:
    cm = CostModel(CM.service_times().replace(prefill_ms_per_token2=1e-5))
    loads = stage_loads(StatsSnapshot((WorkerReport(Role.PREFILL, "p", queue_depth=4, queued_prefill_tokens=4000),)),
                        RequestShape(10, 1), cm)
    assert loads.prefill[0].queue_wait_ms == pytest.approx(4 * cm.prefill_ms(1000))  # not prefill_ms(4000)
    assert cm.queued_prefill_ms(0, 3) == 0.0


def test_link_and_encoder_loads_from_the_snapshot() -> None:
    workers = (WorkerReport(Role.ENCODER, "e0", queue_depth=3, queued_image_tokens=48),
               WorkerReport(Role.ENCODER, "e1", queue_depth=1, queued_image_tokens=16), WorkerReport(Role.DECODE, "d"))
    loads = stage_loads(StatsSnapshot(workers, kv_transfers=2, kv_bytes=5e6), RequestShape(10, 1), CM)
    assert loads.encoder is not None and loads.encoder.queue_wait_ms == pytest.approx(CM.encode_ms(16))  # the shorter queue
    assert (loads.link.active_transfers, loads.link.inflight_bytes, loads.link.queued_bytes) == (2, 5e6, 0.0)
    assert stage_loads(StatsSnapshot((WorkerReport(Role.DECODE, "d"),)), RequestShape(10, 1), CM).encoder is None
    alone = StatsSnapshot(workers, kv_transfers=1, kv_bytes=5e6).less_transfer(5e6)
    assert (alone.kv_transfers, alone.kv_bytes) == (0, 0.0)


def test_an_encoder_queue_is_priced_by_its_images_tokens() -> None:
    """One large image waiting is more work than one small one; requests this gateway placed there since
    the report count at the queue's mean per image (or at this request's own when it reported none)."""
    shape = RequestShape(700, 8, n_images=1, image_tokens=576)
    small, large = (WorkerReport(Role.ENCODER, "e", queue_depth=1, queued_image_tokens=t) for t in (64, 2304))
    wait = {w.queued_image_tokens: stage_loads(StatsSnapshot((w,)), shape, CM).encoder.queue_wait_ms for w in (small, large)}
    assert wait[64] == pytest.approx(CM.encode_ms(64)) and wait[2304] == pytest.approx(CM.encode_ms(2304))
    assert wait[2304] > wait[64]
    placed = WorkerReport(Role.ENCODER, "e", queue_depth=1, queued_image_tokens=64, in_flight=3)
    assert stage_loads(StatsSnapshot((placed,)), shape, CM).encoder.queue_wait_ms == pytest.approx(CM.encode_queue_ms(3, 192))
    unreported = WorkerReport(Role.ENCODER, "e", in_flight=2)
    assert stage_loads(StatsSnapshot((unreported,)), shape, CM).encoder.queue_wait_ms == pytest.approx(
        CM.encode_queue_ms(2, 2 * 576))
    assert worker_report("encoder", "e", pb.WorkerStats(queue_depth=1, queued_image_tokens=64), 0).queued_image_tokens == 64


def test_images_inside_a_cached_prefix_leave_their_share_of_the_tokens() -> None:
    shape = RequestShape(2000, 8, n_images=3, n_images_cached=1, image_tokens=1200, image_tokens_cached=400)
    rest = shape.images_after(1)
    assert (rest.n_images, rest.n_images_cached, rest.image_tokens, rest.image_tokens_cached) == (2, 1, 800, 400)
    assert rest.new_image_tokens == 400 and shape.images_after(3).n_images == 0
    with pytest.raises(ValueError):
        WorkerReport(Role.DECODE, "d", running_seqs=-1)


def test_simulated_workers_report_as_real_ones_count() -> None:
    sim = simulator(CM, 150.0, decode_workers=1, prefill_workers=1, decode_kv_tokens=100_000)
    (decode,) = sim.decode
    assert decode.report().max_batch == CM.decode_slots and decode.report().free_blocks == 100_000
    req = SimRequest(0, (0.0, 600, 10, 0, 0, 0), 600.0)
    req.worker = decode
    req.prefill_ms, req.local_chunks = 10.0, [5.0, 5.0, 5.0]
    decode.claim_local(req)
    r = decode.report()
    assert (r.running_seqs, r.queue_depth, r.in_flight, r.queued_prefill_tokens) == (0, 1, 1, 600)
    (prefill,) = sim.prefill.servers
    for rid, tokens in ((1, 300), (2, 200)):
        queued = SimRequest(rid, (0.0, tokens, 5, 0, 0, 0), 600.0)
        queued.worker = decode
        prefill.submit(queued, 100.0, 0.0, tokens)
    p = prefill.report(50.0)  # half-way through the first: 150 of its tokens left, and the whole second
    assert (p.queue_depth, p.in_flight, p.queued_prefill_tokens) == (2, 2, 350)


def test_the_gateways_report_reads_the_configured_batch_field() -> None:
    stats = pb.WorkerStats(role="decode", running_seqs=3, max_batch=17, max_batch_configured=64, free_blocks=9,
                           block_size=0)
    report = worker_report("decode", "d:1", stats, in_flight=2)
    assert (report.max_batch, report.free_blocks, report.block_size, report.in_flight) == (64, 9, 1, 2)
    assert worker_report("prefill", "p:1", pb.WorkerStats(role="prefill", free_blocks=5), 0).free_blocks is None
    assert Pressure(3, 2.0).backlog_ms() == pytest.approx(1500.0)


def test_a_start_up_burst_is_no_misprediction_to_learn_a_margin_from() -> None:
    """Admitted while others wait and before any rate is trusted, a request's prediction has no
    backlog term: its lateness is that queue, and learning it would count the queue twice (the
    margin beside the backlog) once the rate is known. Predictions that priced the queue teach it."""
    import time

    snap = RECORDED["snapshots"]["idle"]
    gw, reg, shape = gateway(snap), registry(snap), SHAPES["short_text"]

    def burst(late_s: float) -> None:
        tickets = []
        for _ in range(12):
            verdict = gw.admit(shape, reg, 5000.0, 1000.0)
            assert verdict.ok
            tickets.append(gw.admitted(verdict, shape, time.monotonic(), {}))
        for ticket in tickets:
            ticket._admitted_at -= late_s      # its first token came this much after admission
            ticket.left(got_first_token=True)

    burst(0.4)
    assert gw.pressure.rate_per_s() is not None     # the burst's first tokens count for the rate
    assert gw.pressure.overrun_ms(behind=11) == 0.0  # ... and teach no margin
    burst(3.0)                                      # now the rate prices the queue: lateness is learnt
    assert gw.pressure.overrun_ms(behind=11) > 1000.0   # (behind a queue as deep as the burst's)


def test_requests_cut_at_their_deadline_teach_the_margin_that_should_have_refused_them() -> None:
    import time

    snap = RECORDED["snapshots"]["idle"]
    gw, reg, shape = gateway(snap), registry(snap), SHAPES["short_text"]
    for _ in range(12):         # one at a time: nothing waits at admission, so every prediction priced
        verdict = gw.admit(shape, reg, 5000.0, 1000.0)
        ticket = gw.admitted(verdict, shape, time.monotonic(), {})
        ticket._admitted_at -= 3.0                  # still no first token 3 s after admission: cut
        ticket.left(got_first_token=False)
    assert gw.pressure.waiting == 0 and gw.pressure.overrun_ms() > 2000.0


def test_a_decode_worker_that_serves_the_least_remaining_prompt_first_is_priced_that_way() -> None:
    """A short chat prompt is not priced behind a colocated document the worker will pass it by
    (``decode_svc/prefill_order.py``); a prompt as long as the queued ones waits for all of them, and
    a worker that reports no per-prompt split (the simulator's) counts every queued token."""
    cm = CostModel(prior=CPU_PRIOR)
    srpt = WorkerReport(Role.DECODE, "d", queue_depth=2, queued_prefill_tokens=827, queued_prompts=(400, 427))
    fifo = WorkerReport(Role.DECODE, "d", queue_depth=2, queued_prefill_tokens=827)
    assert decode_load(srpt, RequestShape(26, 32), cm).queue_wait_ms == 0.0
    assert decode_load(srpt, RequestShape(400, 32), cm).queue_wait_ms == pytest.approx(cm.queued_prefill_ms(400, 1))
    assert decode_load(srpt, RequestShape(427, 32), cm).queue_wait_ms == pytest.approx(cm.queued_prefill_ms(827, 2))
    assert decode_load(fifo, RequestShape(26, 32), cm).queue_wait_ms == pytest.approx(cm.queued_prefill_ms(827, 2))
    stats = pb.WorkerStats(role="decode", queue_depth=2, queued_prefill_tokens=827, queued_prompt_tokens=[400, 427])
    assert worker_report("decode", "d", stats, 0).queued_prompts == (400, 427)
    snap = StatsSnapshot((srpt,))
    assert StatsSnapshot.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap
    with pytest.raises(ValueError):
        WorkerReport(Role.DECODE, "d", queued_prompts=(-1,))


def test_queued_prompts_that_share_a_step_are_priced_as_one_step_and_a_burst_stays_colocated() -> None:
    """A decode worker batches its queued colocated prompts into a step up to ``step_prompt_tokens``
    (``decode_svc/step_budget.py``): the queue ahead of a prompt that fits in the same step delays it
    by the queued tokens' time, not a whole prefill per queued prompt. Priced one prompt after another,
    a demo-model burst of three queued 26-token prompts made the split path look faster, and 40-60%
    of some 16-concurrent runs went through the prefill worker at ~25% less throughput."""
    from runtime.policy.placement_policy import COLOCATED, choose_placement

    demo = CostModel(prior=CPU_PRIOR.replace(prefill_base_ms=8.4, prefill_ms_per_token=0.05, decode_step_base_ms=5.5,
                                             decode_step_ms_per_seq=0.1, encode_base_ms=4.0, encode_ms_per_token=1 / 16,
                                             link_setup_ms=0.1))
    shape = RequestShape(26, 16, n_images=1, image_tokens=16)
    batched = WorkerReport(Role.DECODE, "d", running_seqs=6, queue_depth=3, queued_prefill_tokens=78,
                           queued_prompts=(26, 26, 26), step_prompt_tokens=2048)
    one_a_step = WorkerReport(Role.DECODE, "d", running_seqs=6, queue_depth=3, queued_prefill_tokens=78,
                              queued_prompts=(26, 26, 26), step_prompt_tokens=26)
    unreported = WorkerReport(Role.DECODE, "d", running_seqs=6, queue_depth=3, queued_prefill_tokens=78,
                              queued_prompts=(26, 26, 26))
    assert decode_load(batched, shape, demo).queue_wait_ms == pytest.approx(0.05 * 78)
    assert decode_load(one_a_step, shape, demo).queue_wait_ms == pytest.approx(demo.queued_prefill_ms(78, 3))
    assert decode_load(unreported, shape, demo).queue_wait_ms == pytest.approx(demo.queued_prefill_ms(78, 3))
    prefill = WorkerReport(Role.PREFILL, "p")
    encoder = WorkerReport(Role.ENCODER, "e")
    for report, placement in ((batched, COLOCATED), (unreported, "disaggregated")):
        loads = stage_loads(StatsSnapshot((report, prefill, encoder)), shape, demo)
        decision = choose_placement(shape, loads, demo, "conditional", 1000.0, 200.0)
        assert decision is not None and decision.placement == placement, decision
    stats = pb.WorkerStats(role="decode", step_prompt_tokens=2048)
    assert worker_report("decode", "d", stats, 0).step_prompt_tokens == 2048
    assert worker_report("prefill", "p", stats, 0).step_prompt_tokens == 0
    with pytest.raises(ValueError):
        WorkerReport(Role.DECODE, "d", step_prompt_tokens=-1)


def test_a_prefill_worker_shares_cores_with_the_decode_workers_it_overlaps_on_one_machine() -> None:
    def decode(name: str, host: str, cpus: tuple[int, ...], busy: float = -1.0) -> WorkerReport:
        return WorkerReport(Role.DECODE, name, host_id=host, cpus=cpus, cpus_busy=busy)

    prefill = WorkerReport(Role.PREFILL, "p", host_id="h1", cpus=(0, 1), cpus_busy=0.4)
    workers = (prefill, decode("same", "h1", (1,), 0.9), decode("apart", "h1", (2, 3), 1.0),
               decode("other-host", "h2", (0, 1), 1.0), decode("unmeasured", "h1", (0,)))
    loads = stage_loads(StatsSnapshot(workers), RequestShape(10, 1), CM)
    # the busier report of the two counts; not measured yet by either side: 0 (as if apart)
    assert loads.prefill[0].shared_cores == (("same", 0.9), ("unmeasured", 0.4))
    unknown = stage_loads(StatsSnapshot((WorkerReport(Role.PREFILL, "p", cpus=(0,)),
                                         WorkerReport(Role.DECODE, "d", cpus=(0,), cpus_busy=1.0))),
                          RequestShape(10, 1), CM)
    assert unknown.prefill[0].shared_cores == ()   # no machine named: nothing judged shared
    assert unknown.prefill[0].apart_from == ()     # ... nor apart


def test_a_prefill_worker_computes_apart_from_the_decode_workers_whose_cores_it_never_uses() -> None:
    prefill = WorkerReport(Role.PREFILL, "p", host_id="h1", cpus=(1,))
    workers = (prefill, WorkerReport(Role.DECODE, "model-core", host_id="h1", cpus=(0,)),
               WorkerReport(Role.DECODE, "overlapping", host_id="h1", cpus=(0, 1)),
               WorkerReport(Role.DECODE, "other-host", host_id="h2", cpus=(1,)),
               WorkerReport(Role.DECODE, "gpu", host_id="h1", cpus=()))
    loads = stage_loads(StatsSnapshot(workers), RequestShape(10, 1), CM)
    assert loads.prefill[0].apart_from == ("model-core", "other-host")   # a GPU worker reports no cores: not known
    gpu_prefill = WorkerReport(Role.PREFILL, "p", host_id="h1", cpus=())
    assert stage_loads(StatsSnapshot((gpu_prefill, *workers[1:])), RequestShape(10, 1), CM).prefill[0].apart_from == ()


def test_the_gateway_reads_where_a_worker_computes_from_its_stats() -> None:
    stats = pb.WorkerStats(role="prefill", address="p:1", host_id="boot-1", cpus=[0, 1], cpus_busy=0.75)
    report = worker_report("prefill", "p:1", stats, 0)
    assert (report.host_id, report.cpus, report.cpus_busy) == ("boot-1", (0, 1), 0.75)


def test_a_refusal_on_time_carries_the_terms_admission_weighed() -> None:
    """The refused request's record names each term, the reported queue inside the estimate too: a
    refusal storm's cause is read from them (bench/RESULTS.md)."""
    refused = Admission(False, None, "pipeline_backlog", 2, backlog_ms=601.0, overrun_ms=956.0,
                        estimated_ttft_ms=1175.0, estimated_queue_ms=1044.0)
    error = GatewayAdmission.refusal(refused, 1995.0)
    assert (error.status, error.retry_after_s) == (429, 2)
    assert error.terms == {"estimated_ttft_ms": 1175.0, "estimated_queue_ms": 1044.0, "backlog_ms": 601.0,
                           "overrun_ms": 956.0, "remaining_ms": 1995.0}
    assert GatewayAdmission.refusal(Admission(False, None, "no_decode_capacity", 1), 1995.0).terms == {}
    precise = Admission(False, None, "ttft_deadline", 1, retry_after_ms=250.0)   # the policy's wait, to the millisecond
    assert GatewayAdmission.refusal(precise, 1995.0).retry_after_s == pytest.approx(0.25)


def test_a_prompt_longer_than_a_chunk_is_priced_at_the_long_prompt_rate() -> None:
    """A decode worker refilling its batch carries twice a chunk a step for the prompts it finishes, but
    a prompt longer than a chunk drains at ``step_long_prompt_tokens``: a long prompt (with the caller's
    chunk given) waits out its queue at that rate; a short one, and any without a chunk, at the step's."""
    cm = CostModel(prior=CPU_PRIOR.replace(prefill_base_ms=10.0, prefill_ms_per_token=0.1))
    w = WorkerReport(Role.DECODE, "d", queue_depth=2, queued_prefill_tokens=800, queued_prompts=(400, 400),
                     step_prompt_tokens=512, step_long_prompt_tokens=256)
    shape = RequestShape(400, 32)
    steps_at = lambda per_step: -(-(800 + 400) // per_step)
    expected = lambda per_step: cm.queued_prefill_ms(1200, steps_at(per_step)) - cm.prefill_ms(400)
    assert decode_load(w, shape, cm, 256).queue_wait_ms == pytest.approx(expected(256))
    assert decode_load(w, shape, cm).queue_wait_ms == pytest.approx(expected(512))   # unchunked: as before
    assert decode_load(w, RequestShape(200, 32), cm, 256).queue_wait_ms == 0.0       # nothing as short ahead
    unreported = WorkerReport(Role.DECODE, "d", queue_depth=2, queued_prefill_tokens=800, queued_prompts=(400, 400),
                              step_prompt_tokens=512)
    assert decode_load(unreported, shape, cm, 256).queue_wait_ms == pytest.approx(expected(512))
    assert expected(256) > expected(512)
    stats = pb.WorkerStats(role="decode", step_prompt_tokens=512, step_long_prompt_tokens=256)
    assert worker_report("decode", "d", stats, 0).step_long_prompt_tokens == 256
    assert worker_report("prefill", "p", stats, 0).step_long_prompt_tokens == 0
    with pytest.raises(ValueError):
        WorkerReport(Role.DECODE, "d", step_long_prompt_tokens=-1)


def test_a_burst_placed_within_one_poll_is_priced_behind_the_prompts_placed_before_it() -> None:
    """Workers report their queue once a poll; a burst of long prompts admitted between two polls
    each saw the same report, so all were priced as if alone (bench-long: ~2 s estimated, 10-17 s
    served). The gateway's own prompts placed there and still without a first token are the queue
    where they add up to more than the report; a fresher report that holds more wins."""
    cm = CostModel(prior=CPU_PRIOR)
    shape = RequestShape(427, 32)
    stale = WorkerReport(Role.PREFILL, "p", placed_prompts=(427, 427))
    assert stage_loads(StatsSnapshot((stale,)), shape, cm).prefill[0].queue_wait_ms == \
        pytest.approx(cm.queued_prefill_ms(854, 2))
    fresh = WorkerReport(Role.PREFILL, "p", queue_depth=3, queued_prefill_tokens=1281, placed_prompts=(427,))
    assert stage_loads(StatsSnapshot((fresh,)), shape, cm).prefill[0].queue_wait_ms == \
        pytest.approx(cm.queued_prefill_ms(1281, 3))
    # a decode worker: its long colocated prompts placed since its report, least remaining first; the
    # short ones are no queue (a refill step carries a burst of them together)
    srpt = WorkerReport(Role.DECODE, "d", queued_prompts=(26,), queued_prefill_tokens=26, queue_depth=1,
                        placed_prompts=(26, 427, 427))
    assert decode_load(srpt, shape, cm, 256).queue_wait_ms == pytest.approx(cm.queued_prefill_ms(854, 2))
    assert decode_load(srpt, RequestShape(26, 32), cm, 256).queue_wait_ms == pytest.approx(cm.queued_prefill_ms(26, 1))
    fifo = WorkerReport(Role.DECODE, "d", placed_prompts=(427, 427))
    assert decode_load(fifo, RequestShape(26, 32), cm, 256).queue_wait_ms == \
        pytest.approx(cm.queued_prefill_ms(854, 2))
    wave = WorkerReport(Role.DECODE, "d", placed_prompts=(26,) * 15)
    assert decode_load(wave, RequestShape(26, 32), cm, 256).queue_wait_ms == 0.0
    with pytest.raises(ValueError):
        WorkerReport(Role.DECODE, "d", placed_prompts=(-1,))


def test_a_prompt_counts_on_the_worker_that_prefills_it_until_its_first_token() -> None:
    admission = GatewayAdmission(SETTINGS)
    reg = registry(RECORDED["snapshots"]["idle"])
    handle = next(iter(reg.workers["prefill"].values()))
    shape = RequestShape(427, 32)
    decision = admission.admit(shape, reg, 20_000.0, 2_000.0)
    assert decision.ok
    ticket = admission.admitted(decision, shape, 0.0, {}, handle, "r1", 427)
    assert handle.placed_prompts == {"r1": 427}
    assert [w.placed_prompts for w in admission.snapshot(reg).workers if w.address == handle.address] == [(427,)]
    ticket.left(got_first_token=True)
    ticket.left(got_first_token=False)
    assert handle.placed_prompts == {}


def test_a_prompt_a_recovery_moves_counts_on_the_worker_that_prefills_it_now() -> None:
    admission = GatewayAdmission(SETTINGS)
    reg = registry(RECORDED["snapshots"]["idle"])
    prefill = next(iter(reg.workers["prefill"].values()))
    decode = next(iter(reg.workers["decode"].values()))
    shape = RequestShape(427, 32)
    ticket = admission.admitted(admission.admit(shape, reg, 20_000.0, 2_000.0), shape, 0.0, {}, prefill, "r1", 427)
    ticket.moved(decode)                       # the prefill worker lost: the prompt goes colocated
    assert prefill.placed_prompts == {} and decode.placed_prompts == {"r1": 427}
    ticket.moved(decode)
    assert decode.placed_prompts == {"r1": 427}
    ticket.left(got_first_token=True)
    ticket.moved(prefill)                      # after its first token it counts nowhere
    assert prefill.placed_prompts == {} and decode.placed_prompts == {}
