"""What to do after a KV transfer attempt failed: retry, another decode worker, re-prefill, fail.

Pure: the gateway and the simulator both call ``on_transfer_failure`` with the same
``StageLoads`` they admit from (``runtime.policy.worker_stats.stage_loads``), so a retry
is priced from the same link, prefill queue and decode batch on both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from runtime.policy.cost_model import CostModel
from runtime.policy.loads import RequestShape, StageLoads
from runtime.policy.placement_policy import has_capacity, link_share


@dataclass(slots=True)
class FailureAction:
    kind: Literal["retry", "other_decode", "reprefill", "fail"]
    reason: str
    cost_ms: float  # estimated time to first token of the chosen action (inf for fail)


def on_transfer_failure(
    remaining_ms: float,
    attempts: int,
    shape: RequestShape,
    cost_model: CostModel,
    loads: StageLoads,
    decode_worker: str,
    *,
    reservation_held: bool = True,
    decode_lost: bool = False,
    max_attempts: int = 3,
) -> FailureAction:
    """What to do after transfer attempt number ``attempts`` into ``decode_worker`` failed,
    ``remaining_ms`` before the deadline.

    In order: retry into the held reservation (costs a transfer, behind the link's load,
    plus a decode step of that worker's batch); re-reserve on another decode worker with a
    free slot and the blocks, and retry (same cost); re-prefill (the shortest prefill
    queue + prefill + transfer + step); otherwise fail. ``decode_lost``: the decode worker
    itself is gone, and its blocks with it: nothing can be retried or re-prefilled into
    them, so the only way on is another decode worker. Bounded: after ``max_attempts``
    transfer attempts the request fails. The caller releases what the action gives up.
    """
    if attempts < 1 or max_attempts < 1:
        raise ValueError(f"attempts and max_attempts must be >= 1, got {attempts}, {max_attempts}")
    if attempts >= max_attempts:
        return FailureAction("fail", "attempts_exhausted", math.inf)
    batch, other_decode = 1, False
    for w in loads.decode:
        if w.address == decode_worker:
            batch = w.running_seqs + 1
        elif w.free_slots > 0 and has_capacity(shape, w):
            other_decode = True
    nbytes = cost_model.kv_bytes(shape.prompt_tokens)
    retry_cost = cost_model.transfer_ms(nbytes, link_share(nbytes, loads.link)) + cost_model.decode_step_ms(batch)
    if reservation_held and not decode_lost and retry_cost <= remaining_ms:
        return FailureAction("retry", "reservation_held_retry_fits", retry_cost)
    if other_decode and retry_cost <= remaining_ms:
        return FailureAction("other_decode", "decode_worker_lost" if decode_lost else "retry_on_other_decode_fits",
                             retry_cost)
    if decode_lost:
        return FailureAction("fail", "decode_worker_lost_no_other" if not other_decode else "deadline_exhausted", math.inf)
    prefill_wait = min((p.queue_wait_ms for p in loads.prefill), default=math.inf)
    reprefill_cost = prefill_wait + cost_model.prefill_ms(shape.prompt_tokens) + retry_cost
    if reprefill_cost <= remaining_ms:
        return FailureAction("reprefill", "reprefill_fits", reprefill_cost)
    return FailureAction("fail", "deadline_exhausted", math.inf)
