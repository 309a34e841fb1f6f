"""Token sampling edge cases: what a client can send must never make sampling fail."""

import pytest
import torch

from runtime.sampling import SamplingParams, sample_token


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
