"""The logits processors sampling runs, in order, on one sequence's next-token logits.

Each processor is a pure function ``(logits [vocab] float64, context) -> logits``
(a new tensor; the input is never changed in place) that is a no-op at its
neutral value, so the pipeline only runs what a request asked for:

    1. repetition_penalty   prompt + output tokens: positive logits / p, negative x p (HF, vLLM)
    2. frequency/presence   output tokens: logit - frequency x count - presence x (count > 0) (OpenAI)
    3. min_tokens           EOS and stop_token_ids at -inf while fewer than min_tokens were output
    4. ALLOWED-TOKEN MASK   the one hook for constrained decoding (see ``apply_allowed_mask``)
    5. temperature          logits / T (skipped when greedy)
    6. top_k, top_p, min_p  tokens outside the kept set at -inf

``sampling.sample`` draws from (or takes the argmax of) the result, and the
logprobs it reports are ``log_softmax`` of the same result: the distribution
the token was actually drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class SamplingContext:
    """What the processors read about the sequence besides the logits.

    ``prompt_ids`` may be empty where the sampler does not hold the prompt; it is only read by
    ``repetition_penalty`` (the workers carry the ids whenever that penalty is set).
    ``output_ids`` are the tokens this sequence has emitted so far (the first token: none).
    """

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()


def _token_counts(ids: Sequence[int], vocab: int) -> torch.Tensor:
    if not ids:
        return torch.zeros(vocab, dtype=torch.float64)
    t = torch.tensor(list(ids), dtype=torch.int64)
    t = t[(t >= 0) & (t < vocab)]
    return torch.bincount(t, minlength=vocab).to(torch.float64)


def repetition_penalty(logits: torch.Tensor, penalty: float, ctx: SamplingContext) -> torch.Tensor:
    """Every token seen in the prompt or the output: a positive logit divided by ``penalty``, a negative one multiplied."""
    if penalty == 1.0:
        return logits
    seen = (_token_counts(ctx.prompt_ids, logits.numel()) + _token_counts(ctx.output_ids, logits.numel())) > 0
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def frequency_presence_penalty(logits: torch.Tensor, frequency: float, presence: float,
                               ctx: SamplingContext) -> torch.Tensor:
    """OpenAI's rule on the output so far: ``logit - frequency * count - presence * (count > 0)``."""
    if frequency == 0.0 and presence == 0.0:
        return logits
    counts = _token_counts(ctx.output_ids, logits.numel())
    return logits - frequency * counts - presence * (counts > 0).to(torch.float64)


def min_tokens(logits: torch.Tensor, minimum: int, stop_token_ids: Sequence[int], ctx: SamplingContext) -> torch.Tensor:
    """While fewer than ``minimum`` tokens were output, EOS and every stop token cannot be drawn."""
    if len(ctx.output_ids) >= minimum:
        return logits
    banned = [t for t in (*ctx.eos_token_ids, *stop_token_ids) if 0 <= t < logits.numel()]
    if not banned:
        return logits
    out = logits.clone()
    out[banned] = NEG_INF
    return out


def apply_allowed_mask(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """THE allowed-token hook: constrained decoding (a grammar's matcher) plugs in here.

    ``allowed`` is a bool tensor ``[vocab]`` (the logits' length; True = the token may be
    sampled), or ``None`` for no constraint. It is applied after the penalties and
    ``min_tokens`` and before temperature and the truncations, so a disallowed token has
    probability exactly 0 and its logprob is -inf. A mask that allows nothing is a bug of
    the constraint, not the client's: it raises rather than sampling an arbitrary token.
    """
    if allowed is None:
        return logits
    if allowed.dtype != torch.bool or allowed.shape != logits.shape:
        raise ValueError(f"allowed-token mask must be bool {tuple(logits.shape)}, got {allowed.dtype} {tuple(allowed.shape)}")
    if not bool(allowed.any()):
        raise ValueError("allowed-token mask allows no token")
    return logits.masked_fill(~allowed.to(logits.device), NEG_INF)


def temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    return logits / t


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits (ties at the k-th value all stay); ``k <= 0`` or ``>= vocab`` keeps all."""
    if k <= 0 or k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches ``p``; the top token always stays.

    Compared in float64, so a tiny ``p`` keeps exactly the top token (never nothing).
    """
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    keep_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p
    keep_sorted[0] = True
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    return logits.masked_fill(~keep, NEG_INF)


def min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``p`` times the top token's."""
    if p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p * probs.max(), NEG_INF)
