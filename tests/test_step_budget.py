"""The decode step's prompt-token budget beside running decodes (``decode_svc/step_budget.py``)."""

from __future__ import annotations

from decode_svc.step_budget import StepBudget


def test_full_budget_until_both_costs_are_measured_and_whenever_nothing_decodes():
    b = StepBudget(256)
    assert b.prefill_tokens(16) == 256           # nothing measured yet
    b.observe(16, 0, 80.0)                        # a decode-only step
    assert b.prefill_tokens(16) == 256           # the token's cost is still unknown
    b.observe(0, 100, 200.0)                      # a prefill-only step: 2 ms per token (an overestimate)
    assert b.prefill_tokens(0) == 256            # nobody decodes: no gap to protect
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


def test_an_idle_step_takes_what_the_tightest_first_token_deadline_pays_for():
    b = StepBudget(256)                                    # idle_tokens: 4 x 256
    assert b.prefill_tokens(0, [(26, 2000.0)]) == 256      # a token's cost unknown: the full budget
    b.observe(0, 100, 300.0)                               # 3 ms a token
    assert b.prefill_tokens(0, [(26, None)]) == 256        # no deadline known
    assert b.prefill_tokens(0, [(26, 4000.0), (26, 1500.0)]) == 400   # 0.8 x the tightest 1500 ms at 3 ms a token
    assert b.prefill_tokens(0, [(26, 100.0)]) == 256       # never below the full budget
    assert b.prefill_tokens(0, [(26, 60_000.0)]) == 1024   # at most idle_tokens
    b.observe(16, 0, 80.0)
    assert b.prefill_tokens(16, [(26, 60_000.0)]) == 26    # decoding: the gap's budget (80 ms at 3 ms a token)
    assert StepBudget(256, idle_tokens=100).idle_tokens == 256   # never under the full budget


def test_prompts_that_would_miss_their_deadline_widen_the_step_up_to_the_gap_target():
    b = StepBudget(256)
    b.observe(16, 0, 80.0)                                 # decode step 80 ms
    b.observe(0, 100, 300.0)                               # 3 ms a prompt token: the gap rule allows 26 a step
    burst = [(26, 1800.0)] * 16                            # 16 prompts, 1.8 s left each
    assert b.prefill_tokens(16, burst) == 26               # no inter-token target known: the gap rule
    # at 26 tokens a 158 ms step, the 12th prompt's first token would come after 1.8 s: grow to
    # 0.8 x 500 ms - the 80 ms decode step, at 3 ms a token
    assert b.prefill_tokens(16, burst, gap_ms=500.0) == 106
    assert b.prefill_tokens(16, burst[:8], gap_ms=500.0) == 26    # 8 of them make it at the plain pace
    assert b.prefill_tokens(16, burst, gap_ms=90.0) == 26         # a gap target under the plain step: no growth
    assert b.prefill_tokens(16, burst, gap_ms=10_000.0) == 256    # at most the full budget
    assert b.prefill_tokens(16, [(26, None)] * 16, gap_ms=500.0) == 26   # no deadlines: never late
