"""Per-sequence token sampling: greedy, temperature, top-p and a seed.

Randomness is a pure function of ``(seed, position)``: the token at a given
position draws from a generator seeded with both, so the same seed gives the
same output whichever worker (prefill or decode, colocated or not) samples it.

Ranges: ``SamplingParams`` accepts exactly what sampling handles, and the
gateway's schema accepts exactly the same (it imports these bounds): every
``temperature`` in [0, 2], every ``top_p`` in (0, 1] (subnormals included) and
every ``seed`` in the int64 range (the wire's type; as in vLLM). The wire
carries temperature and top_p as doubles without rounding, so a worker samples
with exactly the client's values (``runtime.worker.wire``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy: dividing logits by a (possibly subnormal) tiny
# temperature overflows to inf and softmax turns it into NaN. vLLM draws the same line.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1   # int64: what the wire's seed field holds


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0   # 0 (or below GREEDY_BELOW_TEMPERATURE) => greedy
    top_p: float = 1.0
    seed: int | None = None
    grammar: str | None = None   # constrained decoding (runtime.model.grammar); the mask is ``allowed``

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int,
                 allowed: torch.Tensor | None = None) -> int:
    """Pick the token for ``position`` from ``logits`` ``[vocab]``; ``allowed`` (bool ``[vocab]``, the
    constrained-decoding hook) excludes every token it marks False before anything else.

    Probabilities are float64, so ``top_p`` is compared at the client's precision
    (a float32 comparison would turn a top_p below ~1e-45 into 0 and keep nothing).
    """
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        keep[0] = True   # the top token always stays, however small top_p is
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        probs = probs / probs.sum()
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed((params.seed * 1_000_003 + position) % (2**63))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
