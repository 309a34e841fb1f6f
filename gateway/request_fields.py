"""Request fields the gateway knows but does not honour, and the values at which they change nothing.

The rule (also in ``gateway.openai_schema``): a field we honour is declared on
the schema; a field listed here is accepted only at one of its no-op values
(``logit_bias: {}``, ``logprobs: false`` ...), which
many clients always send; any other value is refused (400,
``unsupported_parameter``, naming the field); a field in neither place is
refused as unknown (400, ``unknown_parameter``), as OpenAI answers
"Unrecognized request argument supplied". Never a 200 that ignores what the
client asked for. A later issue that implements a field moves it from here
onto the schema.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

UNSUPPORTED = "unsupported_parameter"
UNKNOWN = "unknown_parameter"


@dataclass(frozen=True, slots=True)
class Refusal:
    param: str      # dotted path into the request, e.g. "messages.0.name"
    message: str
    code: str       # UNSUPPORTED or UNKNOWN


@dataclass(frozen=True, slots=True)
class NoOp:
    """The values of a not-honoured field that ask for nothing: literals, or a type (any value of it)."""

    values: tuple[Any, ...]

    def accepts(self, value: Any) -> bool:
        return any(_matches(value, allowed) for allowed in self.values)

    def message(self, param: str) -> str:
        shown = [_show(v) for v in self.values if v is not None]
        return f"{param} is not supported" + (f" (accepted only as {' or '.join(shown)})" if shown else "")


def _matches(value: Any, allowed: Any) -> bool:
    if isinstance(allowed, type):
        return isinstance(value, allowed) and (allowed is bool or not isinstance(value, bool))
    if allowed is None or isinstance(allowed, bool):
        return value is allowed
    if isinstance(allowed, (int, float)):   # 0 and 0.0 alike, but never True for 1
        return type(value) in (int, float) and value == allowed
    return type(value) is type(allowed) and value == allowed


def _show(value: Any) -> str:
    return f"any {value.__name__}" if isinstance(value, type) else json.dumps(value)


def _noop(*values: Any) -> NoOp:
    return NoOp((None, *values))


# -- the tables ------------------------------------------------------------------------
TOP_LEVEL: Mapping[str, NoOp] = {
    # OpenAI
    "logit_bias": _noop({}),
    "functions": _noop([]),
    "function_call": _noop("none", "auto"),
    "audio": _noop(),
    "modalities": _noop(["text"]),
    "prediction": _noop(),
    "store": _noop(False),
    "metadata": _noop({}),                    # only meaningful with store
    "reasoning_effort": _noop(),
    "verbosity": _noop(),
    "web_search_options": _noop(),
    "service_tier": _noop("auto", "default"),
    "prompt_cache_key": _noop(str),           # hints for abuse monitoring and cache routing:
    "safety_identifier": _noop(str),          # ignoring them changes no output
    # vLLM extensions
    "length_penalty": _noop(1),
    "bad_words": _noop([]),
    "allowed_token_ids": _noop(),
    "skip_special_tokens": _noop(True),
    "spaces_between_special_tokens": _noop(True),
    "include_stop_str_in_output": _noop(False),
    "echo": _noop(False),
    "add_generation_prompt": _noop(True),
    "continue_final_message": _noop(False),
    "add_special_tokens": _noop(False),
    "best_of": _noop(1),
    "use_beam_search": _noop(False),
    "prompt_logprobs": _noop(),
    "return_tokens_as_token_ids": _noop(False),
    "truncate_prompt_tokens": _noop(),
    "chat_template": _noop(),
    "chat_template_kwargs": _noop({}),
    "mm_processor_kwargs": _noop({}),
    "documents": _noop(),
    "structured_outputs": _noop(),
    "guided_json": _noop(),
    "guided_regex": _noop(),
    "guided_choice": _noop(),
    "guided_grammar": _noop(),
    "guided_decoding_backend": _noop(),
    "guided_whitespace_pattern": _noop(),
    "logits_processors": _noop(),
    "priority": _noop(0),
    "request_id": _noop(),
    "kv_transfer_params": _noop(),
    "vllm_xargs": _noop(),
}

# /v1/completions: what its OpenAI and vLLM schemas add, accepted only at the no-op value
COMPLETIONS: Mapping[str, NoOp] = {
    "best_of": _noop(1),
    "echo": _noop(False),
    "suffix": _noop(),
    "logit_bias": _noop({}),
    "length_penalty": _noop(1),
    "bad_words": _noop([]),
    "allowed_token_ids": _noop(),
    "skip_special_tokens": _noop(True),
    "spaces_between_special_tokens": _noop(True),
    "include_stop_str_in_output": _noop(False),
    "use_beam_search": _noop(False),
    "prompt_logprobs": _noop(),
    "return_tokens_as_token_ids": _noop(False),
    "truncate_prompt_tokens": _noop(),
    "response_format": _noop({"type": "text"}),
    "structured_outputs": _noop(),
    "guided_json": _noop(),
    "guided_regex": _noop(),
    "guided_choice": _noop(),
    "guided_grammar": _noop(),
    "priority": _noop(0),
    "request_id": _noop(),
    "logits_processors": _noop(),
    "kv_transfer_params": _noop(),
    "vllm_xargs": _noop(),
    "prompt_cache_key": _noop(str),
    "safety_identifier": _noop(str),
}

MESSAGE: Mapping[str, NoOp] = {
    "name": _noop(),            # chat templates do not see it: refusing beats dropping it
    "refusal": _noop(),
    "function_call": _noop(),
    "audio": _noop(),
    "annotations": _noop([]),
    "reasoning_content": _noop(),
}

STREAM_OPTIONS: Mapping[str, NoOp] = {
    "include_obfuscation": _noop(False),
}

NONE: Mapping[str, NoOp] = {}


def _clip(param: str, limit: int = 100) -> str:
    """A client-chosen field name may be huge; errors name it without echoing all of it."""
    return param if len(param) <= limit else param[: limit - 3] + "..."


def first_refusal(model: BaseModel, prefix: str, known: Mapping[str, NoOp]) -> Refusal | None:
    """The first field of ``model`` (parsed with ``extra="allow"``) outside its schema that asks for something."""
    for name, value in (model.model_extra or {}).items():
        param = _clip(f"{prefix}{name}")
        noop = known.get(name)
        if noop is None:
            return Refusal(param, f"Unrecognized request argument supplied: {param}", UNKNOWN)
        if not noop.accepts(value):
            return Refusal(param, noop.message(param), UNSUPPORTED)
    return None
