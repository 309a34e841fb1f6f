"""Placement with a decode worker's cached prefix: the inputs, the price, the decision.

``cached_prefix_tokens`` goes through the one policy-input builder (``worker_stats.stage_loads``)
the gateway and the simulator share; a colocated prefill there is priced as the uncached suffix
against the whole context (``CostModel.suffix_prefill_ms``), with no encode of the images
inside the prefix, and a mostly cached request goes there, colocated.
"""

from __future__ import annotations

import pytest

from runtime.policy.cost_model import CostModel
from runtime.policy.loads import EncoderLoad, RequestShape
from runtime.policy.placement_policy import choose_placement
from runtime.policy.service_times import ServiceTimes
from runtime.policy.worker_stats import Role, StatsSnapshot, WorkerReport, stage_loads

CM = CostModel(prior=ServiceTimes(prefill_base_ms=5.0, prefill_ms_per_token=0.5, prefill_ms_per_token2=1e-4,
                                  decode_step_base_ms=5.0, decode_step_ms_per_seq=0.5, encode_base_ms=20.0,
                                  encode_ms_per_token=30.0 / 576))
SHAPE = RequestShape(2000, 16, n_images=1, image_tokens=576)


def snapshot(cached: int, images: int = 0) -> StatsSnapshot:
    return StatsSnapshot((
        WorkerReport(Role.ENCODER, "e0"),
        WorkerReport(Role.PREFILL, "p0"),
        WorkerReport(Role.DECODE, "d-cold", max_batch=8),
        WorkerReport(Role.DECODE, "d-warm", max_batch=8, cached_prefix_tokens=cached, cached_images=images),
    ))


def test_the_suffix_is_priced_against_the_whole_context():
    a, b, c = CM.prefill.intercept, CM.prefill.slope, CM.prefill.curve
    assert CM.suffix_prefill_ms(0, 2000) == pytest.approx(CM.prefill_ms(2000))
    assert CM.suffix_prefill_ms(1900, 2000) == pytest.approx(a + b * 100 + c * (2000**2 - 1900**2))
    assert CM.suffix_prefill_ms(1900, 2000) > CM.prefill_ms(100)          # the context costs attention
    chunks = CM.suffix_chunk_times(1900, 2000, 64)
    assert len(chunks) == 2 and sum(chunks) == pytest.approx(CM.suffix_prefill_ms(1900, 2000) + 2 * CM._prior.prefill_chunk_overhead_ms)


def test_stage_loads_carries_the_cached_prefix_and_caps_it_below_the_prompt():
    loads = stage_loads(snapshot(5000, 1), SHAPE, CM)
    warm = next(w for w in loads.decode if w.address == "d-warm")
    cold = next(w for w in loads.decode if w.address == "d-cold")
    assert (warm.cached_prefix_tokens, warm.cached_images) == (SHAPE.prompt_tokens - 1, 1)
    assert (cold.cached_prefix_tokens, cold.cached_images) == (0, 0)


def test_a_mostly_cached_request_runs_its_suffix_colocated_where_the_prefix_is():
    cached = 1920
    loads = stage_loads(snapshot(cached, 1), SHAPE, CM)
    loads.encoder = EncoderLoad(0.0)
    decision = choose_placement(SHAPE, loads, CM, "conditional", 10_000.0, 1_000.0)
    assert (decision.placement, decision.decode_worker) == ("colocated", "d-warm")
    # exactly the suffix on an idle worker: no encode (the image is inside the prefix), no transfer
    assert decision.estimates["ttft_ms"] == pytest.approx(CM.suffix_prefill_ms(cached, SHAPE.prompt_tokens))
    # without the cache the same request pays the encode and the whole prompt
    cold = stage_loads(snapshot(0), SHAPE, CM)
    cold.encoder = EncoderLoad(0.0)
    plain = choose_placement(SHAPE, cold, CM, "conditional", 10_000.0, 1_000.0)
    assert plain.estimates["ttft_ms"] > 3 * decision.estimates["ttft_ms"]


def test_a_prefix_that_stops_inside_the_images_still_pays_their_encode():
    loads = stage_loads(snapshot(100, 0), SHAPE, CM)
    loads.encoder = EncoderLoad(0.0)
    decision = choose_placement(SHAPE, loads, CM, "colocated", 10_000.0, 1_000.0)
    assert decision.decode_worker == "d-warm"
    assert decision.estimates["ttft_ms"] == pytest.approx(CM.encode_ms(576) + CM.suffix_prefill_ms(100, SHAPE.prompt_tokens))
