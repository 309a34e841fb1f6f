"""Pydantic models of ``POST /v1/completions`` (text prompts) and vLLM's ``/tokenize`` and ``/detokenize``.

The same rule as ``gateway.openai_schema``: a field we honour is declared here
(the sampling fields are chat's, ``gateway.sampling_fields``), a known field we
do not honour is accepted only at its no-op value (``COMPLETIONS`` below), and
anything else is refused by name. One prompt per request: a string, or a list
of token ids; a list of prompts would be several choices, refused like ``n`` > 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from runtime.model.sampling import INT32_MAX, MAX_TOP_LOGPROBS

from . import request_fields
from .openai_schema import MAX_CACHE_SALT_CHARS, ChatMessage, Usage, check_stop
from .request_fields import Refusal, first_refusal
from .sampling_fields import SamplingFields

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


def _one_prompt(value: Any) -> Any:
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) == 1:
            return value[0]
        raise ValueError("one prompt per request (a list of prompts would be several choices, which are not supported)")
    return value


class CompletionRequest(SamplingFields):
    model: str
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    max_tokens: int | None = Field(default=16, ge=1)   # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool = True       # vLLM's default for text prompts
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    _stop_shape = field_validator("stop", mode="before")(check_stop)
    _prompt_shape = field_validator("prompt", mode="before")(_one_prompt)

    def unsupported(self) -> Refusal | None:
        return next((r for r in self._refusals() if r is not None), None)

    def _refusals(self) -> Iterator[Refusal | None]:
        yield first_refusal(self, "", request_fields.COMPLETIONS)
        if self.stream_options is not None:
            if not self.stream:
                yield Refusal("stream_options", "stream_options is only allowed when stream is true",
                              request_fields.UNSUPPORTED)
            yield first_refusal(self.stream_options, "stream_options.", request_fields.STREAM_OPTIONS)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=lambda v: v is None)
    system_fingerprint: str | None = None
    epd_ttft_breakdown: dict[str, float] | None = Field(default=None, exclude_if=lambda v: v is None)


# -- /tokenize, /detokenize (vLLM) -------------------------------------------------------------
class _Tokenizing(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None


class TokenizeMessages(_Tokenizing):
    """A chat's prompt exactly as ``/v1/chat/completions`` builds it (template, image placeholders)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Literal[True] = True     # what the chat endpoint renders
    add_special_tokens: Literal[False] = False      # likewise: the template writes them
    return_token_strs: bool = False


class TokenizePrompt(_Tokenizing):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Tokenizing):
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
