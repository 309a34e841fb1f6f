"""Token sampling edge cases: what a client can send must never make sampling fail."""

import pytest
import torch

from proto.epd.v1 import epd_pb2 as pb
from runtime.model.sampling import (SEED_MAX, SEED_MIN, SamplingContext, SamplingParams, greedy_tokens, sample,
                                    sample_token)
from runtime.worker.wire import sampling_from_pb, sampling_to_pb


@pytest.mark.parametrize("temperature", [0.0, 1.1125369292536007e-308, 5e-324, 1e-6])
def test_tiny_temperatures_are_greedy_not_nan(temperature):
    logits = torch.tensor([-3.4, 0.6, 11.07, -3.2])
    assert sample_token(logits, SamplingParams(temperature=temperature), position=5) == 2


def test_real_temperature_samples_reproducibly_with_a_seed():
    logits = torch.zeros(50)
    params = SamplingParams(temperature=1.0, seed=3)
    draws = [sample_token(logits, params, position=p) for p in range(20)]
    assert draws == [sample_token(logits, params, position=p) for p in range(20)]
    assert len(set(draws)) > 1


# -- the whole accepted range works, in process and through the wire (issue 15, defect 4) --------
TEMPERATURES = [0.0, 5e-324, 1e-300, 9.99e-6, 1e-5, 1.0000001e-5, 0.7, 1.999999999, 2.0]
TOP_PS = [5e-324, 1e-300, 4.9e-7, 1e-6, 0.123456789, 1 - 1e-16, 1.0]
SEEDS = [None, 0, -1, 2**53 + 1, SEED_MIN, SEED_MAX]


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("top_p", TOP_PS)
def test_sampling_params_cross_the_wire_exactly(temperature, top_p):
    for seed in SEEDS:
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
        sent = pb.SamplingParams.FromString(sampling_to_pb(params).SerializeToString())
        assert sampling_from_pb(sent) == params


def test_an_unset_wire_message_is_greedy_with_top_p_one():
    assert sampling_from_pb(pb.SamplingParams()) == SamplingParams(temperature=0.0, top_p=1.0, seed=None)


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-45, 4.9e-7])
def test_a_tiny_top_p_keeps_only_the_top_token(top_p):
    logits = torch.tensor([0.5, 0.4, 0.3, 0.1] * 8)   # the top token has ~4% of the mass
    logits[13] = 0.9
    for position in range(20):
        assert sample_token(logits, SamplingParams(temperature=2.0, top_p=top_p, seed=position), position) == 13


def test_top_p_is_compared_at_double_precision():
    """Two tokens of 0.5 each: top_p just above 0.5 keeps both, exactly 0.5 keeps one."""
    logits = torch.zeros(2)
    drawn = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.5 + 1e-12, seed=s), 0) for s in range(40)}
    assert drawn == {0, 1}
    kept = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=s), 0) for s in range(40)}
    assert len(kept) == 1


@pytest.mark.parametrize("field, value", [("seed", SEED_MAX + 1), ("seed", SEED_MIN - 1), ("top_p", 0.0), ("top_p", -0.0),
                                          ("top_p", 1.0000001), ("temperature", -1e-300), ("temperature", 2.0000001),
                                          ("temperature", float("nan")), ("top_p", float("nan"))])
def test_values_sampling_cannot_handle_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_every_sampling_field_and_the_logprobs_cross_the_wire_exactly():
    from runtime.model.sampling import SampledToken, TokenLogprob
    from runtime.worker.wire import logprobs_to_pb, sampled_from_pb

    params = SamplingParams(temperature=0.7, top_p=0.9, seed=-5, top_k=-1, min_p=1e-300, presence_penalty=-2.0,
                            frequency_penalty=1.999999, repetition_penalty=0.5, min_tokens=3, stop_token_ids=(7, 2),
                            ignore_eos=True, logprobs=0)
    assert sampling_from_pb(pb.SamplingParams.FromString(sampling_to_pb(params).SerializeToString())) == params
    sampled = SampledToken(4, -0.25, (TokenLogprob(4, -0.25), TokenLogprob(9, float("-inf"))))
    sent = pb.TokenLogprobs.FromString(logprobs_to_pb(sampled).SerializeToString())
    assert sampled_from_pb(4, sent) == sampled
    assert logprobs_to_pb(SampledToken(4)) is None and sampled_from_pb(4, None) == SampledToken(4)
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampling_from_pb(pb.SamplingParams(repetition_penalty=-1.0))


@pytest.mark.parametrize("params, plain", [
    (SamplingParams(), True),
    (SamplingParams(temperature=1e-6, top_p=0.5, top_k=3, min_p=0.2), True),   # greedy: the draw's filters change nothing
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(repetition_penalty=1.2), False),
    (SamplingParams(frequency_penalty=0.5), False),
    (SamplingParams(presence_penalty=-0.5), False),
    (SamplingParams(min_tokens=2), False),
    (SamplingParams(logprobs=0), False),
    (SamplingParams(grammar='{"type": "object"}'), False),
])
def test_plain_greedy_is_greedy_with_every_processor_neutral(params, plain):
    assert params.plain_greedy is plain


def test_greedy_tokens_are_the_tokens_sample_picks():
    """One argmax over many rows equals ``sample`` row by row, ties (the first maximum) included."""
    gen = torch.Generator().manual_seed(0)
    rows = list(torch.randn(12, 97, generator=gen))
    rows[3][[5, 40]] = rows[3].max() + 1.0            # a tie: the first index wins in both
    rows[7] = rows[7].to(torch.float16).float()       # coarse values, more ties
    expected = [sample(r, SamplingParams(), SamplingContext((), ()), 9).token_id for r in rows]
    assert greedy_tokens(rows) == expected
    assert greedy_tokens(rows)[3] == 5
