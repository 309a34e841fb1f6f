"""The decode step's prompt-token budget beside running decodes (``decode_svc/step_budget.py``)."""

from __future__ import annotations

from decode_svc.step_budget import StepBudget


def test_full_budget_until_both_costs_are_measured_and_a_refill_whenever_nothing_decodes():
    b = StepBudget(256)
    assert b.prefill_tokens(16) == 256           # nothing measured yet
    b.observe(16, 0, 80.0)                        # a decode-only step
    assert b.prefill_tokens(16) == 256           # the token's cost is still unknown
    b.observe(0, 100, 200.0)                      # a prefill-only step: 2 ms per token (an overestimate)
    assert b.prefill_tokens(0) == 512            # nobody decodes: no gap to protect, a refill
    assert b.prefill_tokens(16) == 40            # 80 ms beside an 80 ms decode step at 2 ms a token


def test_mixed_steps_price_the_tokens_beyond_the_decode_step():
    b = StepBudget(256, stretch=1.0, floor_ms=0.0, min_tokens=1)
    b.observe(16, 0, 100.0)
    b.observe(16, 50, 150.0)                     # 50 ms more for 50 tokens: 1 ms each
    assert b.prefill_tokens(16) == 100
    b.observe(16, 10, 90.0)                      # faster than decode alone: never a negative cost
    assert b.token_ms is not None and b.token_ms >= 0.0


def test_a_cheap_model_keeps_the_full_budget_and_a_prompt_never_starves():
    cheap = StepBudget(256, floor_ms=20.0)
    cheap.observe(16, 0, 3.0)
    cheap.observe(0, 200, 10.0)                  # 0.05 ms a token: the 20 ms floor allows 400
    assert cheap.prefill_tokens(16) == 256
    slow = StepBudget(256, floor_ms=1.0, min_tokens=16)
    slow.observe(16, 0, 10.0)
    slow.observe(0, 10, 1000.0)                  # 100 ms a token
    assert slow.prefill_tokens(16) == 16          # still one chunk of at least min_tokens


def test_as_many_prompts_waiting_as_sequences_decoding_refill_the_batch_in_one_step():
    """A burst: spread one prompt a step, its prompts would sit beside the first ones' decoders in
    step after step; a refill step stretches the few running sequences' gap once instead."""
    b = StepBudget(256, stretch=1.0, floor_ms=0.0, min_tokens=1)
    b.observe(4, 0, 80.0)                         # a decode-only step of 4 sequences
    b.observe(0, 100, 200.0)                      # 2 ms a prompt token
    assert b.prefill_tokens(4) == b.prefill_tokens(4, 3) == 40    # the steady state: one decode step's worth
    assert b.prefill_tokens(4, 4) == b.prefill_tokens(1, 15) == 512   # a refill: twice the full budget
    assert StepBudget(256, refill_tokens=1024).prefill_tokens(2, 2) == 1024
    assert StepBudget(256, refill_tokens=64).prefill_tokens(0) == 256   # never less than the full budget


def test_a_refill_widens_only_the_prompts_it_finishes():
    """A long prompt's chunk in a refill step stays within the usual budget (``stretch_tokens``), so
    the short prompts the refill starts are not held for a long chunk in the same step."""
    b = StepBudget(256, stretch=1.0, floor_ms=0.0, min_tokens=1)
    b.observe(4, 0, 80.0)
    b.observe(0, 100, 200.0)
    assert b.prefill_tokens(4, 8) == 512 and b.stretch_tokens(4) == 40
    assert b.stretch_tokens(0) == 256             # nothing decoding: a chunk of the full budget
