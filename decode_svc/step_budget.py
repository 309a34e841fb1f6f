"""How many prompt tokens one decode step may carry beside running decodes.

Every running sequence's next token waits for the step, so a step that also prefills colocated
prompts is an inter-token gap for all of them. The policy (vLLM's token budget per step, priced
in time instead of tokens): while sequences decode, the prompt chunks mixed into a step may add
at most ``max(stretch x the decode step's own time x max(1, waiting / decoding), floor_ms)`` to
it, priced from the measured cost of one prompt token, and never more than the full budget; at
least ``min_tokens`` always go in (no prompt starves behind a busy batch). With nothing decoding
a step takes the full prefill budget (nobody's gap grows).

The ``waiting / decoding`` factor is for bursts: when more prompts wait for their first token
than sequences decode, every decode step between two prompt chunks makes each waiting prompt
wait a whole step longer, while a wider step stretches only the few running sequences' gap once.
A closed-loop burst of 16 short prompts on the bench model arrives staggered by intake and
encode, so the first few start decoding and, at one prompt per step beside them, the last of
the burst waited ~1.9 s for its first token (vLLM's one big step: ~0.95 s for all); admission
then rightly refused the tail of the next burst at a 2 s SLO, and every refusal's closed-loop
replacement too (13 of 48 served). Widened steps drain such a burst in ~1.3 s; in the steady
state, where fewer prompts wait than sequences decode, the budget is what it was.

Both costs are moving averages of the scheduler's own steps: ``decode_ms`` of steps that only
decode, ``token_ms`` of the prompt tokens in a step (steps that only prefill: their time per
token, which overstates it by the step's fixed cost, so it errs toward small chunks; mixed
steps: the time beyond ``decode_ms``, per token). Before the first sample of either, the full
budget applies. On a cheap model (the demo's ~3 ms steps) ``floor_ms`` leaves the budget at
the full prefill budget; on the 140M bench model it is about one short prompt per step.
"""

from __future__ import annotations

ALPHA = 0.3   # weight of the newest sample in each moving average


class StepBudget:
    def __init__(self, full_tokens: int, *, stretch: float = 1.0, floor_ms: float = 20.0, min_tokens: int = 16):
        self.full_tokens = full_tokens
        self.stretch = stretch
        self.floor_ms = floor_ms
        self.min_tokens = min(min_tokens, full_tokens)
        self.decode_ms: float | None = None   # a step of decodes alone
        self.token_ms: float | None = None    # one prompt token's share of a step

    def prefill_tokens(self, decoding: int, waiting: int = 0) -> int:
        """The prompt tokens the next step may carry beside ``decoding`` running sequences, with
        ``waiting`` prompts queued for their first token."""
        if not decoding or self.decode_ms is None or not self.token_ms:
            return self.full_tokens
        allowed_ms = max(self.stretch * self.decode_ms * max(1.0, waiting / decoding), self.floor_ms)
        return max(self.min_tokens, min(self.full_tokens, int(allowed_ms / self.token_ms)))

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
