"""Planner: Q = lambda W sizing, confirmation by simulation, and the split threshold."""

from __future__ import annotations

import json
import math

import pytest

from runtime.policy.cost_model import CostModel
from sim import plan_cli
from sim.distributions import fixed
from sim.planner import PlanInput, analytic, erlang_c_wait_ms, mix_stats, plan
from sim.split_threshold import split_threshold
from sim.workload import RequestMix

WORKED = RequestMix(fixed(6000), fixed(400))


def test_erlang_c() -> None:
    assert erlang_c_wait_ms(1, 1.0, 500.0) == pytest.approx(500.0)  # M/M/1 at rho 0.5: Wq = rho/(1-rho) x S
    assert erlang_c_wait_ms(2, 1.0, 500.0) < erlang_c_wait_ms(1, 1.0, 500.0)
    assert math.isinf(erlang_c_wait_ms(1, 2.0, 500.0))
    assert erlang_c_wait_ms(3, 0.0, 500.0) == 0.0


def test_analytic_sizing_is_littles_law() -> None:
    inp = PlanInput(WORKED, rate=4.0, sim_requests=0)
    stats = mix_stats(inp, samples=200)
    first = analytic(inp, stats)
    assert first["busy_prefill_workers"] == pytest.approx(4.0 * 0.230)  # lambda x 230 ms
    assert first["occupied_decode_slots"] == pytest.approx(4.0 * 18.0)  # lambda x 400 x 45 ms
    assert first["decode_workers"] == math.ceil(72 / (32 * 0.85))
    assert first["prefill_workers"] >= 2  # one worker would run at 92%
    assert first["encoder_workers"] == 0  # no images
    # the chapter's ratio: about two decode workers per prefill worker at this mix
    assert first["occupied_decode_slots"] / 32 / first["busy_prefill_workers"] == pytest.approx(2.45, abs=0.01)


def test_plan_is_confirmed_by_simulation() -> None:
    result = plan(PlanInput(WORKED, rate=3.0, sim_requests=300, seed=1))
    rec = result["recommended"]
    assert result["confirmed_by_simulation"] is True
    assert result["simulated"]["goodput_fraction"] >= 0.95
    assert rec["decode_workers"] >= 2 and rec["prefill_workers"] >= 1
    assert rec["decode_workers"] >= rec["prefill_workers"]  # decode residency dominates at this mix
    assert result["rounds"]  # every simulation is reported


def test_plan_sizes_the_encoder_pool_for_images() -> None:
    mix = RequestMix(fixed(1000), fixed(50), images=fixed(4, minimum=0), cache_hit_ratio=0.0)
    result = plan(PlanInput(mix, rate=8.0, sim_requests=0))
    assert result["recommended"]["encoder_workers"] >= 2  # 8/s x 170 ms = 1.36 busy encoders


def test_split_threshold_depends_on_load() -> None:
    cm = CostModel()
    kwargs = {"output_tokens": 400, "ttft_slo_ms": 600.0, "itl_slo_ms": 150.0}
    assert split_threshold(cm, neighbours=0, **kwargs) is None  # no interference to buy down
    busy = split_threshold(cm, neighbours=8, **kwargs)
    assert busy is not None and 2000 < busy < 3000  # where 20 + 0.035 L + 45 first breaches 150 ms
    # a busier prefill pool makes remote prefill less attractive for a lone neighbour
    assert split_threshold(cm, neighbours=1, prefill_wait_ms=400.0, **kwargs) > split_threshold(cm, neighbours=1, **kwargs)
    # a looser ITL SLO tolerates longer stalls
    assert split_threshold(cm, neighbours=8, output_tokens=400, ttft_slo_ms=600.0, itl_slo_ms=300.0) > busy


def test_plan_cli_json(capsys) -> None:
    assert plan_cli.main(["--rate", "2", "--sim-requests", "150", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["recommended"]) == {"encoder_workers", "prefill_workers", "decode_workers", "kv_links"}
    assert "split_threshold_tokens" in result
    assert plan_cli.main(["--rate", "0"]) == 2
