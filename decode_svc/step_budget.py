"""How many prompt tokens one decode step may carry beside running decodes.

Every running sequence's next token waits for the step, so a step that also prefills colocated
prompts is an inter-token gap for all of them. The policy (vLLM's token budget per step, priced
in time instead of tokens): while fewer prompts wait for their first token than sequences
decode, the prompt chunks mixed into a step may add at most ``max(stretch x the decode step's
own time, floor_ms)`` to it, priced from the measured cost of one prompt token, and never more
than the full budget; at least ``min_tokens`` always go in (no prompt starves behind a busy batch).

A step with at least as many prompts waiting as sequences decoding (nothing decoding included)
*refills* the batch and takes the refill budget, ``refill_tokens`` (twice the full budget unless
given; each prompt still at most a chunk of the full budget, and the chunks of prompts the step
does not finish, and of prompts longer than a chunk to their last token, together within the usual
budget, ``stretch_tokens``): a burst then starts decoding
together, and the steps after it carry no prompt beside its decoders. Spread one prompt per step
instead, a closed-loop burst of 16 short prompts on the bench model put a prompt beside the
decoders in a third of all steps, each ~2x a decode step, and the groups it started stayed
staggered for every burst after (bench/RESULTS.md); the refill step stretches only the few
sequences already decoding, once. (The scheduler also waits briefly, before a refill step, for
colocated prompts already on their way: ``scheduler.REFILL_WAIT_STEPS``.)

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
    def __init__(self, full_tokens: int, *, refill_tokens: int | None = None, stretch: float = 1.0,
                 floor_ms: float = 20.0, min_tokens: int = 16):
        self.full_tokens = full_tokens
        self.refill_tokens = max(refill_tokens or 2 * full_tokens, full_tokens)
        self.stretch = stretch
        self.floor_ms = floor_ms
        self.min_tokens = min(min_tokens, full_tokens)
        self.decode_ms: float | None = None   # a step of decodes alone
        self.token_ms: float | None = None    # one prompt token's share of a step

    def prefill_tokens(self, decoding: int, waiting: int = 0) -> int:
        """The prompt tokens the next step may carry beside ``decoding`` running sequences, with
        ``waiting`` prompts queued for their first token."""
        return self.refill_tokens if waiting >= decoding else self.stretch_tokens(decoding)

    def stretch_tokens(self, decoding: int) -> int:
        """The prompt tokens a step may carry beside ``decoding`` running sequences outside a refill,
        and in a refill for a prompt longer than a chunk and the prompts it does not finish."""
        if not decoding or self.decode_ms is None or not self.token_ms:
            return self.full_tokens
        allowed_ms = max(self.stretch * self.decode_ms, self.floor_ms)
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
