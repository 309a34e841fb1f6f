"""How many prompt tokens one decode step may carry beside running decodes.

Every running sequence's next token waits for the step, so a step that also prefills colocated
prompts is an inter-token gap for all of them. The policy (vLLM's token budget per step, priced
in time instead of tokens): while sequences decode, the prompt chunks mixed into a step may add
at most ``max(stretch x the decode step's own time, floor_ms)`` to it, priced from the measured
cost of one prompt token; at least ``min_tokens`` always go in (no prompt starves behind a
busy batch). With nothing decoding nobody's gap grows, so a step takes the full prefill budget,
and more once a prompt token's cost is known: as many tokens as ``SLACK_SHARE`` of the tightest
waiting prompt's time to its first-token deadline pays for, up to ``idle_tokens``: prompts that
queued while nothing decoded (a burst, or arrivals during a long prefill step) go in together, as
vLLM packs every waiting prompt into a step, and the weights are read once for all of them.

Deadlines beside running decodes: the gap rule spreads a burst one short prompt per step on the
140M bench model (16 26-token prompts: the last first token ~2 s after the first, against ~1.2 s
of their compute in one step), so at a 2 s TTFT target the gateway refused the burst's tail. When
some waiting prompt (in arrival order, each after the tokens queued before it) would miss its
first-token deadline at the gap rule's pace, the step grows up to ``GAP_SHARE`` of the running
sequences' tightest inter-token target (the request's ITL SLO, ``GenerateRequest.itl_slo_ms``):
the gap a running sequence was promised is spent before a waiting prompt's first token is lost.

Both costs are moving averages of the scheduler's own steps: ``decode_ms`` of steps that only
decode, ``token_ms`` of the prompt tokens in a step (steps that only prefill: their time per
token, which overstates it by the step's fixed cost, so it errs toward small chunks; mixed
steps: the time beyond ``decode_ms``, per token). Before the first sample of either, the full
budget applies. On a cheap model (the demo's ~3 ms steps) ``floor_ms`` leaves the budget at
the full prefill budget; on the 140M bench model it is about one short prompt per step.
"""

from __future__ import annotations

from collections.abc import Sequence

ALPHA = 0.3        # weight of the newest sample in each moving average
SLACK_SHARE = 0.8  # of the tightest first-token deadline's time left, what an idle step may spend
GAP_SHARE = 0.8    # of the running sequences' tightest inter-token target, what a step with late prompts may take


class StepBudget:
    def __init__(self, full_tokens: int, *, stretch: float = 1.0, floor_ms: float = 20.0, min_tokens: int = 16,
                 idle_tokens: int | None = None):
        self.full_tokens = full_tokens
        self.idle_tokens = max(full_tokens, idle_tokens if idle_tokens is not None else 4 * full_tokens)
        self.stretch = stretch
        self.floor_ms = floor_ms
        self.min_tokens = min(min_tokens, full_tokens)
        self.decode_ms: float | None = None   # a step of decodes alone
        self.token_ms: float | None = None    # one prompt token's share of a step

    def prefill_tokens(self, decoding: int, waiting: Sequence[tuple[int, float | None]] = (),
                       gap_ms: float | None = None) -> int:
        """The prompt tokens the next step may carry beside ``decoding`` running sequences. ``waiting``:
        each waiting prompt's tokens left and time to its first-token deadline (ms; None: no deadline),
        in the order they go into steps; ``gap_ms``: the running sequences' tightest inter-token target."""
        slacks = [s for _, s in waiting if s is not None]
        if not decoding:
            if not slacks or not self.token_ms:
                return self.full_tokens
            return max(self.full_tokens, min(self.idle_tokens, int(SLACK_SHARE * min(slacks) / self.token_ms)))
        if self.decode_ms is None or not self.token_ms:
            return self.full_tokens
        allowed_ms = max(self.stretch * self.decode_ms, self.floor_ms)
        tokens = max(self.min_tokens, min(self.full_tokens, int(allowed_ms / self.token_ms)))
        if not gap_ms or not self._late(tokens, waiting):
            return tokens
        return max(tokens, min(self.full_tokens, int((GAP_SHARE * gap_ms - self.decode_ms) / self.token_ms)))

    def _late(self, tokens: int, waiting: Sequence[tuple[int, float | None]]) -> bool:
        """Whether a waiting prompt's first token would come after its deadline at ``tokens`` per step."""
        step_ms = self.decode_ms + tokens * self.token_ms
        queued = 0
        for left, slack_ms in waiting:
            queued += left
            if slack_ms is not None and -(-queued // tokens) * step_ms > slack_ms:
                return True
        return False

    def observe(self, decoding: int, prompt_tokens: int, step_ms: float) -> None:
        """One finished step: ``decoding`` sequences decoded and ``prompt_tokens`` prompt tokens ran."""
        if decoding and not prompt_tokens:
            self.decode_ms = _mix(self.decode_ms, step_ms)
        elif prompt_tokens and not decoding:
            self.token_ms = _mix(self.token_ms, step_ms / prompt_tokens)
        elif prompt_tokens and self.decode_ms is not None:
            self.token_ms = _mix(self.token_ms, max(step_ms - self.decode_ms, 0.0) / prompt_tokens)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new
