"""Per-sequence token sampling: greedy, temperature, top-p and a seed.

Randomness is a pure function of ``(seed, position)``: the token at a given
position draws from a generator seeded with both, so the same seed gives the
same output whichever worker (prefill or decode, colocated or not) samples it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy: dividing logits by a (possibly subnormal) tiny
# temperature overflows to inf and softmax turns it into NaN. vLLM draws the same line.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0   # 0 (or below GREEDY_BELOW_TEMPERATURE) => greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token for ``position`` from ``logits`` ``[vocab]``."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        probs = probs / probs.sum()
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed((params.seed * 1_000_003 + position) % (2**63))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
