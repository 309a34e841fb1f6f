"""The design chapter's worked example, computed by the cost model and the policy.

Nothing here is typed in: every number comes from ``CostModel`` (the same class
the gateway calibrates) and ``runtime.policy.placement_policy``. With the default
``ServiceTimes`` the chapter's figures come out: ~230 ms prefill, 1.83 GiB of KV,
~95 ms transfer, ~370 ms remote TTFT, ~315 ms with 2,000-token chunks, ~4.3
prefills/s and ~1.8 retirements/s per worker, about two decode workers per
prefill worker; and the failure walk-through: retry with the reservation held,
fail when it was released.
"""

from __future__ import annotations

from typing import Any

from runtime.policy.cost_model import CostModel
from runtime.policy.failure_policy import on_transfer_failure
from runtime.policy.loads import DecodeWorkerLoad, PrefillWorkerLoad, RequestShape, StageLoads
from runtime.policy.placement_policy import choose_placement
from runtime.policy.service_times import GIB, ServiceTimes
from sim.split_threshold import split_threshold

MIB = 1024**2


def worked_example(
    service: ServiceTimes | None = None,
    *,
    prompt_tokens: int = 6000,
    output_tokens: int = 400,
    chunk_tokens: int = 2000,
    ttft_budget_ms: float = 600.0,
    itl_slo_ms: float = 150.0,
    neighbours: int = 8,
    short_prompt_tokens: int = 500,
) -> dict[str, Any]:
    cm = CostModel(service)
    slots = cm.decode_slots
    prefill = cm.prefill_ms(prompt_tokens)
    kv = cm.kv_bytes(prompt_tokens)
    transfer = cm.transfer_ms(kv)
    step = cm.decode_step_ms(1)
    remote = cm.remote_ttft_ms(prompt_tokens)
    chunked = cm.remote_ttft_ms(prompt_tokens, chunk_tokens)
    first_chunk = cm.chunk_sizes(prompt_tokens, chunk_tokens)[0]
    prefill_rate = cm.prefill_rate_per_worker(prompt_tokens)
    decode_rate = cm.decode_rate_per_worker(output_tokens)
    ratio = prefill_rate / decode_rate

    shape = RequestShape(prompt_tokens, output_tokens)
    busy = StageLoads(
        decode=(DecodeWorkerLoad("decode-0", neighbours, slots - neighbours),),
        prefill=(PrefillWorkerLoad("prefill-0"),),
    )
    decision = choose_placement(shape, busy, cm, "conditional", ttft_budget_ms, itl_slo_ms)
    idle = StageLoads(decode=(DecodeWorkerLoad("decode-0", 0, slots),), prefill=(PrefillWorkerLoad("prefill-0"),))
    idle_decision = choose_placement(shape, idle, cm, "conditional", ttft_budget_ms, itl_slo_ms)
    left = ttft_budget_ms - remote  # the link drops as prefill finishes: ~370 ms committed
    alone = StageLoads(decode=(DecodeWorkerLoad("decode-0", 0, slots),), prefill=(PrefillWorkerLoad("prefill-0"),))
    kept = on_transfer_failure(left, 1, shape, cm, alone, "decode-0", reservation_held=True)
    lost = on_transfer_failure(left, 1, shape, cm, alone, "decode-0", reservation_held=False)
    short_kv = cm.kv_bytes(short_prompt_tokens)
    if decision is None or idle_decision is None:
        raise RuntimeError("a decode worker with free slots must always be placeable")
    return {
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "prefill_ms": round(prefill, 3),
        "kv_bytes": kv,
        "kv_gib": round(kv / GIB, 4),
        "transfer_ms": round(transfer, 3),
        "decode_step_ms": round(step, 3),
        "colocated_idle_ttft_ms": round(prefill, 3),
        "remote_ttft_ms": round(remote, 3),
        "chunk_tokens": chunk_tokens,
        "first_chunk_ready_ms": round(cm.chunk_ready_ms(prompt_tokens, chunk_tokens)[0], 3),
        "first_chunk_transfer_ms": round(cm.transfer_ms(cm.kv_bytes(first_chunk)), 3),
        "chunked_transfer_done_ms": round(cm.transfer_done_ms(prompt_tokens, chunk_tokens), 3),
        "chunked_remote_ttft_ms": round(chunked, 3),
        "chunked_saving_ms": round(remote - chunked, 3),
        "ttft_budget_ms": ttft_budget_ms,
        "queue_budget_ms": round(ttft_budget_ms - remote, 3),
        "prefill_rate_per_worker": round(prefill_rate, 3),
        "decode_residency_s": round(output_tokens * cm.decode_step_ms(slots) / 1000.0, 3),
        "decode_rate_per_worker": round(decode_rate, 3),
        "decode_workers_per_prefill_worker": round(ratio, 3),
        "decode_workers_per_prefill_worker_rounded": round(ratio),
        "link_transfers_per_s": round(1000.0 / transfer, 3),
        "colocated_stall_ms": round(prefill, 3),
        "neighbours": neighbours,
        "interference_ms": round(decision.estimates.get("local_interference_ms", 0.0), 3),
        "placement_busy": decision.placement,
        "placement_busy_reason": decision.reason,
        "placement_idle": idle_decision.placement,
        "placement_idle_reason": idle_decision.reason,
        "split_threshold_tokens": split_threshold(
            cm, neighbours=neighbours, output_tokens=output_tokens, ttft_slo_ms=ttft_budget_ms, itl_slo_ms=itl_slo_ms
        ),
        "failure_budget_left_ms": round(left, 3),
        "failure_action_reservation_held": kept.kind,
        "failure_action_reservation_released": lost.kind,
        "reprefill_cost_ms": round(prefill + transfer + step, 3),
        "short_prompt_tokens": short_prompt_tokens,
        "short_prefill_ms": round(cm.prefill_ms(short_prompt_tokens), 3),
        "short_kv_mib": round(short_kv / MIB, 3),
        "short_setup_share_of_prefill": round(cm.transfer.intercept / cm.prefill_ms(short_prompt_tokens), 3),
    }
