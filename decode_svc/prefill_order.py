"""The order a decode step takes colocated prompts in: least remaining prefill first, unless a deadline is at risk.

A step fills its prompt-token budget from the prompts in this order, so the order decides whose
first token comes next. In arrival order, one long prompt holds every short prompt behind it for
all of its chunks: on the bench model, 26-token chat prompts waited 2-8 s for their first token
behind 427-token documents colocated on the same worker (bench-long), though each needed one
step. Least remaining work first is the order that minimises the mean wait for a first token.

It would let a stream of short prompts pass a long one for as long as the stream lasts, so a
prompt whose first-token deadline is at risk goes first: one that would miss it if every other
queued prompt went before it (its deadline is nearer than ``PREFILL_AT_RISK_FACTOR`` x all the
queued prompts' remaining prefill time). At-risk prompts go earliest deadline first, the rest least
remaining tokens first; equal keys keep arrival order (both sorts are stable). Before the
first prompt token has been priced (``token_ms`` None) the order is arrival order.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from runtime.policy.loads import PREFILL_AT_RISK_FACTOR

from .sequence import Sequence


def prefill_order(prefilling: Seq[Sequence], token_ms: float | None, now_s: float) -> list[Sequence]:
    """``prefilling`` (in arrival order) in the order the next step should take their chunks."""
    if not token_ms or len(prefilling) < 2:
        return list(prefilling)
    drain_s = PREFILL_AT_RISK_FACTOR * token_ms / 1000.0 * sum(s.prompt_len - s.prefilled for s in prefilling)
    at_risk = [s for s in prefilling if s.first_token_deadline_s - now_s < drain_s]
    rest = [s for s in prefilling if s.first_token_deadline_s - now_s >= drain_s]
    at_risk.sort(key=lambda s: s.first_token_deadline_s)
    rest.sort(key=lambda s: s.prompt_len - s.prefilled)
    return at_risk + rest
