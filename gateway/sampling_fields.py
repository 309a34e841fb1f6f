"""The sampling and streaming fields chat and completions requests share, and their one conversion to ``SamplingParams``.

Every bound is ``runtime.model.sampling``'s (the schema accepts exactly what the
workers sample with). Defaults are OpenAI's: ``temperature`` 1, ``top_p`` 1,
penalties 0; vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``ignore_eos``; clients send them in
``extra_body``) are off unless given. What the schema cannot say alone is
checked in ``sampling_problem``: ``min_tokens`` above the request's max tokens,
a stop token id outside the vocabulary. ``n`` (choices of one prompt, up to
``MAX_CHOICES``) combines with every other field: each choice samples, stops,
is constrained and reports logprobs on its own (``gateway/choices.py``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from runtime.model.sampling import (
    INT32_MAX,
    MAX_CHOICES,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM: every chunk carries the usage so far


class SamplingFields(BaseModel):
    """Declared on both request models; a field here is honoured at every value it accepts."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)   # choices sharing the prompt's KV
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @property
    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, logprobs: int | None) -> SamplingParams:
        """The workers' parameters; ``logprobs``: ``None`` for none, else how many alternatives per token."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens or 0,
            stop_token_ids=tuple(dict.fromkeys(self.stop_token_ids or ())),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            n=self.n or 1,
        )


def sampling_problem(params: SamplingParams, max_tokens: int, vocab_size: int,
                     forks_choices: bool = True) -> tuple[str, str] | None:
    """``(param, message)`` for what only the resolved request shows, else ``None``. ``forks_choices``:
    the model's sequences can fork into ``n`` choices (a hybrid decoder's linear-attention state cannot)."""
    if params.n > 1 and not forks_choices:
        return "n", "n > 1 is not supported for this model (its linear-attention state is per sequence)"
    if params.min_tokens > max_tokens:
        return "min_tokens", f"min_tokens ({params.min_tokens}) must be at most max_tokens ({max_tokens})"
    outside = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        return "stop_token_ids", f"stop_token_ids {outside} are outside the vocabulary (0..{vocab_size - 1})"
    return None
