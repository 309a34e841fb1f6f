"""Pydantic models of the OpenAI chat API subset the gateway serves.

Requests are validated strictly (``"max_tokens": "10"`` is a 400, not 10), and
every field of the request, at every level, falls under one rule:

* a field we honour is declared here, with exactly the range the workers
  handle (the sampling fields, shared with completions, are
  ``gateway.sampling_fields``, bounded by ``runtime.model.sampling``;
  ``logprobs`` / ``top_logprobs`` up to 20; an image part's ``detail`` "auto"
  or "high", since the processor always uses the model's full resolution);
* a known OpenAI or vLLM field we do not honour is accepted only at its no-op
  value (``n: 1``, ``logprobs: false``, penalties 0, ``logit_bias: {}`` ...;
  the table is ``gateway.request_fields``), else 400
  ``unsupported_parameter`` naming it;
* any other field is refused, 400 ``unknown_parameter``: "Unrecognized request
  argument supplied: X", as OpenAI does.

So no 200 ever ignores what the client asked for. ``response_format``
(``json_object``, ``json_schema``), ``tools``, ``tool_choice``,
``parallel_tool_calls``, assistant ``tool_calls`` and ``role: "tool"`` messages
are honoured (``gateway.structured_output``, ``gateway.tool_parsers``). ``cache_salt`` (vLLM's
tenant-isolation field, at most 256 characters) and ``user`` are accepted.

epd extension: the final ``chat.completion.chunk`` of a stream (the one with
``finish_reason``) carries ``epd_ttft_breakdown`` — the same per-stage
milliseconds that a non-streaming response returns in the
``x-epd-ttft-breakdown`` header. Clients ignore unknown fields; with the
``openai`` package read it as ``chunk.model_extra["epd_ttft_breakdown"]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from runtime.model.sampling import MAX_TOP_LOGPROBS

from . import request_fields
from .request_fields import Refusal, first_refusal
from .sampling_fields import SamplingFields

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_TOOLS = 128                                   # OpenAI's limit
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"   # OpenAI's rule for function and schema names


class _Strict(BaseModel):
    """Strict types; fields outside the schema are kept (``model_extra``) for ``unsupported()`` to judge."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


# -- request ----------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None   # "low" is refused by unsupported()


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def _content_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "<string>"
    if isinstance(value, list):
        return "<parts>"
    if value is None:
        return "<null>"
    return None


def _content(parts: Any) -> Any:
    """A message's ``content``: a string or a list of ``parts``, with one clear error otherwise."""
    return Annotated[
        Union[Annotated[str, Tag("<string>")], Annotated[list[parts], Tag("<parts>")]],
        Discriminator(
            _content_kind,
            custom_error_type="invalid_content",
            custom_error_message="content must be a string or a list of content parts",
        ),
    ]


def _part_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind == "text" else None


TextOnlyPart = Annotated[
    Union[Annotated[TextPart, Tag("text")]],
    Discriminator(_part_type, custom_error_type="invalid_part",
                  custom_error_message="only text parts are allowed here: image_url parts only in user messages"),
]
TextContent = _content(TextOnlyPart)
UserContent = _content(ContentPart)


class _Message(_Strict):
    def image_parts(self) -> list[ImagePart]:
        content = getattr(self, "content", None)
        if isinstance(content, list):
            return [p for p in content if isinstance(p, ImagePart)]
        return []


class SystemMessage(_Message):
    role: Literal["system"]
    content: TextContent


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: TextContent


class UserMessage(_Message):
    role: Literal["user"]
    content: UserContent           # the only role that may carry images


class CalledFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    arguments: str               # JSON text, as OpenAI sends it back


class AssistantToolCall(_Strict):
    id: str = Field(min_length=1)
    type: Literal["function"]
    function: CalledFunction


class AssistantTurn(_Message):
    """An earlier assistant turn of the conversation (content may be null when it called tools)."""

    role: Literal["assistant"]
    content: TextContent | None = None
    tool_calls: list[AssistantToolCall] | None = None


class ToolMessage(_Message):
    """A tool's result, rendered back into the chat template (``<tool_response>`` for the demo model)."""

    role: Literal["tool"]
    content: TextContent
    tool_call_id: str = Field(min_length=1)


def _role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return role if role in ("system", "developer", "user", "assistant", "tool") else None


# One model per role, as in OpenAI's own schema: what each role may carry is in the published
# OpenAPI document (content required but for the assistant, images only from the user).
ChatMessage = Annotated[
    Union[Annotated[SystemMessage, Tag("system")], Annotated[DeveloperMessage, Tag("developer")],
          Annotated[UserMessage, Tag("user")], Annotated[AssistantTurn, Tag("assistant")],
          Annotated[ToolMessage, Tag("tool")]],
    Discriminator(
        _role,
        custom_error_type="invalid_role",
        custom_error_message="role must be one of 'system', 'developer', 'user', 'assistant', 'tool'",
    ),
]


# -- structured output and tools (gateway.structured_output turns them into a grammar) ---------
class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")   # absent: any JSON object
    strict: bool | None = None


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class FunctionDef(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON Schema; absent: no arguments ({})
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


def check_stop(value: Any) -> Any:
    """``stop``: a string or at most ``MAX_STOP_SEQUENCES`` of them, each 1..``MAX_STOP_CHARS`` characters."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"each stop sequence must be 1..{MAX_STOP_CHARS} characters")
    return value


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    _stop_shape = field_validator("stop", mode="before")(check_stop)

    def unsupported(self) -> Refusal | None:
        """The first field the gateway does not honour at the value sent (see the module docstring), else ``None``."""
        return next((r for r in self._refusals() if r is not None), None)

    def _refusals(self) -> Iterator[Refusal | None]:
        yield first_refusal(self, "", request_fields.TOP_LEVEL)
        if self.top_logprobs and not self.logprobs:
            yield Refusal("top_logprobs", "top_logprobs requires logprobs to be true", "invalid_value")
        if self.stream_options is not None:
            if not self.stream:
                yield Refusal("stream_options", "stream_options is only allowed when stream is true",
                              request_fields.UNSUPPORTED)
            yield first_refusal(self.stream_options, "stream_options.", request_fields.STREAM_OPTIONS)
        yield from self._format_refusals()
        for i, message in enumerate(self.messages):
            yield first_refusal(message, f"messages.{i}.", request_fields.MESSAGE)
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                prefix = f"messages.{i}.content.{j}."
                yield first_refusal(part, prefix, request_fields.NONE)
                if isinstance(part, ImagePart):
                    yield first_refusal(part.image_url, prefix + "image_url.", request_fields.NONE)
                    if part.image_url.detail == "low":
                        yield Refusal(prefix + "image_url.detail", 'image detail "low" is not supported: images are '
                                      'always processed at the model\'s full resolution (use "auto" or "high")',
                                      request_fields.UNSUPPORTED)

    def _format_refusals(self) -> Iterator[Refusal | None]:
        """Combinations that ask for nothing we can do: every one is a 400 naming the field."""
        nested = [(self.response_format, "response_format.")]
        nested += [(tool, f"tools.{i}.") for i, tool in enumerate(self.tools or [])]
        nested += [(tool.function, f"tools.{i}.function.") for i, tool in enumerate(self.tools or [])]
        if isinstance(self.response_format, JsonSchemaFormat):
            nested.append((self.response_format.json_schema, "response_format.json_schema."))
        if isinstance(self.tool_choice, NamedToolChoice):
            nested += [(self.tool_choice, "tool_choice."), (self.tool_choice.function, "tool_choice.function.")]
        for model, prefix in nested:
            if model is not None:
                yield first_refusal(model, prefix, request_fields.NONE)
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            yield Refusal("tools", "tool function names must be unique", "invalid_value")
        if self.tool_choice in ("required",) or isinstance(self.tool_choice, NamedToolChoice):
            if not self.tools:
                yield Refusal("tool_choice", "tool_choice requires tools", "invalid_value")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            yield Refusal("tool_choice.function.name",
                          f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools",
                          "invalid_value")
        calls_tools = bool(self.tools) and self.tool_choice != "none"
        if calls_tools and self.response_format is not None and not isinstance(self.response_format, TextFormat):
            yield Refusal("response_format", "response_format json_object / json_schema cannot be combined with "
                          "tools the model may call (tool calls have their own format); use tool_choice \"none\"",
                          request_fields.UNSUPPORTED)

        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        constrained = forced or isinstance(self.response_format, (JsonObjectFormat, JsonSchemaFormat))
        if constrained and self.stop_sequences:
            yield Refusal("stop", "stop sequences cannot be combined with a response_format or a forced tool "
                          "call: cutting the reply at a stop string would break its JSON", request_fields.UNSUPPORTED)

    # -- resolved values ------------------------------------------------------------
    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens`` when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        """``None`` without ``logprobs``; else how many alternatives per token (``top_logprobs``, default 0)."""
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses --------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


FinishReason = Literal["stop", "length", "tool_calls"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str


class ToolCallDelta(BaseModel):
    """A piece of one tool call in a stream, as OpenAI sends them: the call's first delta carries its
    ``id``, ``type``, ``function.name`` and empty ``arguments``; the next ones (``index`` only) the
    argument text, which clients append."""

    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = Field(default=None, exclude_if=lambda v: v is None)   # the last chunk's delta is {}
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = Field(default=None, exclude_if=lambda v: v is None)
    system_fingerprint: str | None = None
    epd_ttft_breakdown: dict[str, float] | None = Field(default=None, exclude_if=lambda v: v is None)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "epd"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
