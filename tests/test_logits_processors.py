"""Each logits processor against a case computed by hand, and the pipeline's order and hook."""

import math

import pytest
import torch

from runtime.model import logits_processors as lp
from runtime.model.sampling import SamplingContext, SamplingParams, process, sample

INF = float("-inf")


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    ctx = SamplingContext(prompt_ids=[0], output_ids=[1, 1])
    out = lp.repetition_penalty(t(2.0, -1.0, 3.0), 2.0, ctx)
    assert out.tolist() == [1.0, -2.0, 3.0]            # token 0 (prompt): 2/2; token 1 (output): -1*2; token 2 unseen


def test_frequency_and_presence_penalties_follow_openais_formula():
    ctx = SamplingContext(prompt_ids=[2, 2, 2], output_ids=[0, 0, 0, 1])   # the prompt does not count
    out = lp.frequency_presence_penalty(t(1.0, 1.0, 1.0), frequency=0.5, presence=0.25, ctx=ctx)
    assert out.tolist() == [1.0 - 0.5 * 3 - 0.25, 1.0 - 0.5 * 1 - 0.25, 1.0]
    negative = lp.frequency_presence_penalty(t(1.0, 1.0, 1.0), frequency=-1.0, presence=0.0, ctx=ctx)
    assert negative.tolist() == [4.0, 2.0, 1.0]        # a negative penalty encourages repeats


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = t(1.0, 2.0, 3.0, 4.0)
    early = SamplingContext((), [5], eos_token_ids=frozenset({3}))
    assert lp.min_tokens(logits, 2, [1], early).tolist() == [1.0, INF, 3.0, INF]
    reached = SamplingContext((), [5, 6], eos_token_ids=frozenset({3}))
    assert lp.min_tokens(logits, 2, [1], reached).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_top_k_keeps_the_k_largest():
    assert lp.top_k(t(0.1, 0.4, 0.3, 0.2), 2).tolist() == [INF, 0.4, 0.3, INF]
    assert lp.top_k(t(0.1, 0.4), 0).tolist() == [0.1, 0.4]
    assert lp.top_k(t(0.1, 0.4), -1).tolist() == [0.1, 0.4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(t(0.5, 0.3, 0.15, 0.05))
    kept = lp.top_p(logits, 0.7)                       # 0.5 < 0.7, 0.5+0.3 >= 0.7: two tokens
    assert [math.isfinite(v) for v in kept.tolist()] == [True, True, False, False]
    assert [math.isfinite(v) for v in lp.top_p(logits, 1e-300).tolist()] == [True, False, False, False]


def test_min_p_drops_tokens_below_p_times_the_top_probability():
    logits = torch.log(t(0.5, 0.3, 0.15, 0.05))
    kept = lp.min_p(logits, 0.4)                       # threshold 0.2: keeps 0.5 and 0.3
    assert [math.isfinite(v) for v in kept.tolist()] == [True, True, False, False]


def test_the_allowed_mask_hook_zeroes_disallowed_tokens_and_checks_its_shape():
    out = lp.apply_allowed_mask(t(5.0, 1.0, 0.0), torch.tensor([False, True, True]))
    assert out.tolist() == [INF, 1.0, 0.0]
    with pytest.raises(ValueError, match="allows no token"):
        lp.apply_allowed_mask(t(5.0, 1.0), torch.tensor([False, False]))
    with pytest.raises(ValueError, match="bool"):
        lp.apply_allowed_mask(t(5.0, 1.0), torch.tensor([1, 0]))


def test_greedy_with_a_mask_takes_the_best_allowed_token():
    params = SamplingParams(logprobs=2)
    s = sample(t(5.0, 1.0, 0.0), params, SamplingContext((), ()), 0, allowed=torch.tensor([False, True, True]))
    assert s.token_id == 1
    assert s.top[0].token_id == 1 and s.top[0].logprob == s.logprob
    assert s.logprob == pytest.approx(1.0 - math.log(math.e + 1.0))


def test_penalties_run_before_temperature_and_the_truncations():
    """repetition 2 turns token 0's logit 4 into 2; temperature 0.5 then doubles everything; top_k 1 keeps token 1."""
    params = SamplingParams(temperature=0.5, top_k=1, repetition_penalty=2.0)
    x = process(t(4.0, 3.0, 1.0), params, SamplingContext([0], []))
    assert x.tolist() == [INF, 6.0, INF]


def test_logprobs_come_from_the_processed_distribution():
    params = SamplingParams(temperature=0.5, seed=1, logprobs=3)
    s = sample(t(1.0, 0.0, -1.0), params, SamplingContext((), ()), 0)
    expected = torch.log_softmax(t(2.0, 0.0, -2.0), dim=-1).tolist()
    assert [e.logprob for e in s.top] == pytest.approx(expected)
    assert s.logprob == pytest.approx(expected[s.token_id])


def test_greedy_logprob_is_the_maximum_of_the_top_logprobs():
    s = sample(torch.randn(50), SamplingParams(logprobs=5), SamplingContext((), ()), 3)
    assert s.logprob == max(e.logprob for e in s.top) and s.top[0].token_id == s.token_id
    assert len(s.top) == 5 and sample(torch.randn(50), SamplingParams(), SamplingContext((), ()), 3).logprob is None


def test_a_penalty_changes_the_greedy_choice():
    ctx = SamplingContext((), [0])
    assert sample(t(2.0, 1.5), SamplingParams(), ctx, 1).token_id == 0
    assert sample(t(2.0, 1.5), SamplingParams(presence_penalty=1.0), ctx, 1).token_id == 1


@pytest.mark.parametrize("field, value", [("top_k", -2), ("min_p", 1.5), ("presence_penalty", 2.5),
                                          ("frequency_penalty", -2.1), ("repetition_penalty", 0.0),
                                          ("min_tokens", -1), ("stop_token_ids", (-1,)), ("logprobs", 21)])
def test_out_of_range_parameters_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
