"""Per-sequence token sampling: the request's parameters and one ``sample`` call per token.

``sample(logits, params, ctx, position, allowed=None)`` runs the logits processors
(``runtime.model.logits_processors``, in their documented order, each a no-op at
its neutral value), then takes the argmax (greedy) or draws from the result, and
reports the token's logprob and its ``params.logprobs`` most likely alternatives
from that same processed distribution. ``allowed`` is the one hook for
constrained decoding: a bool mask ``[vocab]`` applied after the penalties and
before temperature (``logits_processors.apply_allowed_mask``).

Randomness is a pure function of ``(seed, position)``: the token at a given
position draws from a generator seeded with both, so the same seed gives the
same output whichever worker (prefill or decode, colocated or not) samples it,
provided it sees the same history (the workers carry it: prompt ids where
``repetition_penalty`` needs them, the output so far, the first token from prefill).

Choices (``n`` > 1): each choice samples with ``for_choice(params, i)``. Choice 0 is the
request's own parameters (so its text is the ``n = 1`` text); choice ``i`` > 0 with a seed
draws from a seed derived from ``(seed, i)``, so choices differ, each reproducibly, and
the same on every worker; without a seed every draw is fresh anyway.

Ranges: ``SamplingParams`` accepts exactly what sampling handles, and the
gateway's schema accepts exactly the same (it imports these bounds): every
``temperature`` in [0, 2], every ``top_p`` in (0, 1] (subnormals included),
every ``seed`` in the int64 range (the wire's type; as in vLLM), penalties as
OpenAI and vLLM bound them. The wire carries the floats as doubles without
rounding, so a worker samples with exactly the client's values (``runtime.worker.wire``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from runtime.model import logits_processors as lp
from runtime.model.logits_processors import SamplingContext

__all__ = ["SampledToken", "SamplingContext", "SamplingParams", "TokenLogprob", "for_choice", "greedy_tokens", "sample",
           "sample_token"]

# Below this temperature sampling is greedy: dividing logits by a (possibly subnormal) tiny
# temperature overflows to inf and softmax turns it into NaN. vLLM draws the same line.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1   # int64: what the wire's seed field holds
INT32_MAX = 2**31 - 1
MAX_PENALTY = 2.0                          # presence / frequency: OpenAI's [-2, 2]
MAX_REPETITION_PENALTY = 2.0               # (0, 2]: 1 is off
MAX_TOP_LOGPROBS = 20                      # OpenAI's limit
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 16                           # n: choices sharing one prompt's KV


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0   # 0 (or below GREEDY_BELOW_TEMPERATURE) => greedy
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0             # 0 or -1 => off (vLLM's -1)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None   # None: no logprobs; n: the token's logprob and its n most likely alternatives
    grammar: str | None = None    # constrained decoding (runtime.model.grammar): its mask is ``allowed``
    n: int = 1                    # choices of the one prompt (each samples with ``for_choice``)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str, value: object) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"in [0, {MAX_TEMPERATURE:g}]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise bad("seed", f"in [{SEED_MIN}, {SEED_MAX}]", self.seed)
        if not -1 <= self.top_k <= INT32_MAX:
            raise bad("top_k", "-1, 0 (off) or a positive count", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise bad(name, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", getattr(self, name))
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"in (0, {MAX_REPETITION_PENALTY:g}]", self.repetition_penalty)
        if not 0 <= self.min_tokens <= INT32_MAX:
            raise bad("min_tokens", "a non-negative count", self.min_tokens)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} non-negative token ids", self.stop_token_ids)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad("logprobs", f"in [0, {MAX_TOP_LOGPROBS}]", self.logprobs)
        if not 1 <= self.n <= MAX_CHOICES:
            raise bad("n", f"in [1, {MAX_CHOICES}]", self.n)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def plain_greedy(self) -> bool:
        """Greedy with every processor neutral and no logprobs or grammar: the token is the logits' argmax
        (what ``greedy_tokens`` computes for many sequences at once)."""
        return (self.greedy and self.repetition_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0 and self.min_tokens == 0 and self.logprobs is None
                and self.grammar is None)

    @property
    def needs_prompt_ids(self) -> bool:
        """Whether sampling reads the prompt's ids (only ``repetition_penalty`` does)."""
        return self.repetition_penalty != 1.0


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: ``seed`` itself for choice 0, else a 64-bit hash of both (in the int64 range)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"epd-choice:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters choice ``index`` samples with (``params`` itself for choice 0 or without a seed)."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=choice_seed(params.seed, index))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float             # may be -inf: a token the processors excluded


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None              # set when the request asked for logprobs
    top: tuple[TokenLogprob, ...] = ()        # the ``params.logprobs`` most likely tokens, most likely first


def process(logits: torch.Tensor, params: SamplingParams, ctx: SamplingContext,
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The processed logits ``[vocab]`` (float64) that the token is drawn from; see ``logits_processors``."""
    x = logits.detach().to("cpu", torch.float64)
    x = lp.repetition_penalty(x, params.repetition_penalty, ctx)
    x = lp.frequency_presence_penalty(x, params.frequency_penalty, params.presence_penalty, ctx)
    x = lp.min_tokens(x, params.min_tokens, params.stop_token_ids, ctx)
    x = lp.apply_allowed_mask(x, allowed)          # the constrained-decoding hook
    if params.greedy:
        return x
    x = lp.temperature(x, params.temperature)
    x = lp.top_k(x, params.top_k)
    x = lp.top_p(x, params.top_p)
    return lp.min_p(x, params.min_p)


def sample(logits: torch.Tensor, params: SamplingParams, ctx: SamplingContext, position: int,
           allowed: torch.Tensor | None = None) -> SampledToken:
    """The token for ``position`` from ``logits`` ``[vocab]``, with its logprobs when asked for."""
    x = process(logits, params, ctx, allowed)
    if params.greedy:
        token = int(torch.argmax(x).item())
    else:
        generator = torch.Generator(device="cpu")
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed((params.seed * 1_000_003 + position) % (2**63))
        token = int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator).item())
    if params.logprobs is None:
        return SampledToken(token)
    logprobs = torch.log_softmax(x, dim=-1)
    top: tuple[TokenLogprob, ...] = ()
    if params.logprobs:
        values, ids = torch.topk(logprobs, min(params.logprobs, logprobs.numel()))
        top = tuple(TokenLogprob(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist()))
    return SampledToken(token, float(logprobs[token]), top)


def greedy_tokens(rows: Sequence[torch.Tensor]) -> list[int]:
    """``sample``'s token for each row ``[vocab]`` whose parameters are ``plain_greedy``, in one argmax call
    (the processors are neutral and float32 -> float64 keeps the order, so this is the same argmax)."""
    return torch.argmax(torch.stack(list(rows)), dim=-1).tolist()


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int,
                 allowed: torch.Tensor | None = None) -> int:
    """The token alone, for callers without history (the adapter's reference paths: no output yet);
    ``allowed`` is the constrained-decoding hook (``sample``'s)."""
    return sample(logits, params, SamplingContext((), ()), position, allowed).token_id


def finite_logprob(value: float) -> float:
    """A logprob as JSON can carry it: -inf (a token the processors excluded) as OpenAI's -9999.0."""
    return value if math.isfinite(value) else -9999.0
