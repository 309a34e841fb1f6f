"""The conditional split threshold: the prompt length above which remote prefill wins.

Derived, not configured: it asks ``runtime.policy.placement_policy.choose_placement``
(mode ``conditional``, the gateway's own rule) about prompts of increasing length
on a decode worker carrying ``neighbours`` running sequences, with the given
queue waits, and returns the shortest prompt it sends to remote prefill. The
threshold falls as load (neighbours) rises and is absent at zero load, where
there is no interference for the transfer to buy down.
"""

from __future__ import annotations

from runtime.policy.cost_model import CostModel
from runtime.policy.loads import DecodeWorkerLoad, PrefillWorkerLoad, RequestShape, StageLoads
from runtime.policy.placement_policy import choose_placement


def split_threshold(
    cm: CostModel,
    *,
    neighbours: int,
    output_tokens: int,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    prefill_wait_ms: float = 0.0,
    local_wait_ms: float = 0.0,
    transfer_chunk_tokens: int | None = None,
    local_chunk_tokens: int | None = None,
    max_tokens: int = 131072,
    step_tokens: int = 16,
) -> int | None:
    """Smallest prompt length (to ``step_tokens``) placed remotely; None if none up to ``max_tokens``.

    Scans coarsely, then bisects the first switch, so it is exact to ``step_tokens``
    even where the decision is not monotone at very long prompts.
    """
    if neighbours < 0 or output_tokens < 1 or step_tokens < 1 or max_tokens < 1:
        raise ValueError("need neighbours >= 0, output_tokens >= 1, step_tokens >= 1, max_tokens >= 1")
    free = max(1, cm.decode_slots - neighbours)
    loads = StageLoads(
        decode=(DecodeWorkerLoad("decode", neighbours, free, None, 16, local_wait_ms),),
        prefill=(PrefillWorkerLoad("prefill", prefill_wait_ms),),
    )

    def remote(tokens: int) -> bool:
        decision = choose_placement(
            RequestShape(tokens, output_tokens), loads, cm, "conditional", ttft_slo_ms, itl_slo_ms,
            transfer_chunk_tokens=transfer_chunk_tokens, local_chunk_tokens=local_chunk_tokens,
        )
        return decision is not None and decision.placement == "disaggregated"

    coarse = max(step_tokens, 256)
    lo = 0  # a length known to stay local (0: none checked yet)
    tokens = coarse
    while tokens <= max_tokens and not remote(tokens):
        lo = tokens
        tokens += coarse
    if tokens > max_tokens:
        return None
    hi = tokens  # placed remotely
    while hi - lo > step_tokens:
        mid = (lo + hi) // 2
        if remote(mid):
            hi = mid
        else:
            lo = mid
    if lo == 0 and remote(1):
        return 1  # remote wins at every length (e.g. the local queue is long)
    return hi
