"""Constrained decoding with llguidance: a grammar compiled once, a matcher per sequence.

Why llguidance: it is what vLLM and SGLang use for structured output; its core is
Rust, computes a token mask in tens of microseconds from a token trie, compiles
JSON Schema itself (and Lark with inline ``%json`` for tool calls), and reports
a schema it cannot compile as a readable message, so the gateway can refuse it
(400) before any work.

A grammar travels as llguidance's own grammar text (``SamplingParams.grammar``
on the wire). Life of one constrained sequence:

* the gateway builds the grammar (``json_object_grammar``,
  ``json_schema_grammar``, ``tool_call_grammar``) and ``check``s it against the
  model's tokenizer: a compile error is a ``GrammarError``;
* whichever worker samples a token asks its ``Matcher`` for ``allowed()`` (a bool
  mask ``[vocab]``, the sampling hook) and then ``advance``s it with the token
  drawn. The prefill worker's matcher sees the first token only; the decode
  worker rebuilds its matcher from the output so far (the first token from
  prefill) and ``advance`` verifies it: a token the grammar refuses is an error,
  never a reply;
* once the grammar is complete only EOS is allowed, so the turn ends ``stop``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

# JSON as Python's json.dumps writes it (and as the chat templates render tool calls): no
# free whitespace, so a model cannot loop on spaces, and a reply is the same text every time.
JSON_FORMAT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's rule for function names
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A grammar (a schema, a tool's parameters) the library cannot compile; the message says why."""


class GrammarViolation(RuntimeError):
    """A token the sequence's grammar does not allow (a handoff's first token, say)."""


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The model's tokens as llguidance sees them (built once per process: ~1 s for a large vocabulary)."""

    tokenizer: Any            # llguidance.LLTokenizer
    size: int                 # the logits' length (may exceed the tokenizer's)
    eos_ids: tuple[int, ...]

    @classmethod
    def of(cls, hf_tokenizer: Any, size: int, eos_ids: Iterable[int]) -> "Vocabulary":
        eos = sorted(set(eos_ids)) or [hf_tokenizer.eos_token_id]
        try:
            ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=size, eos_token=eos)
        except ValueError as exc:   # e.g. a decoder llguidance cannot invert (WordPiece)
            raise GrammarError(f"this model's tokenizer cannot be constrained: {exc}") from None
        return cls(ll, size, tuple(eos))


_vocabularies: dict[int, Vocabulary] = {}
_vocab_lock = threading.Lock()


def vocabulary_for(owner: Any, hf_tokenizer: Any, size: int, eos_ids: Iterable[int]) -> Vocabulary:
    """One ``Vocabulary`` per owner (an adapter, a prompt builder), built on first use."""
    with _vocab_lock:
        vocab = _vocabularies.get(id(owner))
        if vocab is None:
            vocab = _vocabularies[id(owner)] = Vocabulary.of(hf_tokenizer, size, eos_ids)
        return vocab


# -- grammars ---------------------------------------------------------------------------
def _with_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": JSON_FORMAT}


def json_object_grammar() -> str:
    """``response_format: {"type": "json_object"}``: any JSON object."""
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_FORMAT)


def json_schema_grammar(schema: dict[str, Any], *, strict: bool = False) -> str:
    """``json_schema``: the reply follows the schema exactly, ``strict`` or not (enforcement is always
    strict here: the mask admits nothing the schema does not; ``strict`` is accepted for clients)."""
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_FORMAT)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]


def tool_call_grammar(tools: Sequence[ToolSpec], *, parallel: bool) -> str:
    """One or more Qwen-style calls, each ``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>``.

    ``A`` is constrained by that function's parameters schema; with ``parallel`` several
    calls may follow one another (one per line), else exactly one.
    """
    if not tools:
        raise GrammarError("no function to call")
    rules = []
    for i, tool in enumerate(tools):
        if not FUNCTION_NAME.match(tool.name):
            raise GrammarError(f"function name {tool.name!r} must match {FUNCTION_NAME.pattern}")
        head = json.dumps(f'<tool_call>\n{{"name": "{tool.name}", "arguments": ')
        tail = json.dumps("}\n</tool_call>")
        rules.append(f"call_{i}: {head} args_{i} {tail}\n"
                     f"args_{i}: %json {json.dumps(_with_format(tool.parameters or {'type': 'object'}))}\n")
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    start = f'start: call ("\\n" call)*\n' if parallel else "start: call\n"
    return start + f"call: {calls}\n" + "".join(rules)


def check(grammar: str, vocab: Vocabulary) -> None:
    """Raise ``GrammarError`` unless ``grammar`` compiles for ``vocab`` (what a worker's matcher will do)."""
    error = llguidance.LLMatcher.validate_grammar(grammar, vocab.tokenizer)
    if error:
        raise GrammarError(error)


# -- one sequence's matcher -------------------------------------------------------------
class Matcher:
    """The grammar's state after a sequence's output so far; ``allowed()`` then ``advance(token)`` per token."""

    def __init__(self, grammar: str, vocab: Vocabulary, output: Sequence[int] = ()):
        self.vocab = vocab
        self._m = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab.size)
        for token in output:
            self.advance(token)

    @property
    def done(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return self._m.is_stopped()

    def allowed(self) -> torch.Tensor:
        """Bool ``[vocab]``: the tokens the grammar allows next (EOS alone once it is complete)."""
        if self._m.is_stopped():
            mask = torch.zeros(self.vocab.size, dtype=torch.bool)
            mask[list(self.vocab.eos_ids)] = True
            return mask
        llguidance.torch.fill_next_token_bitmask(self._m, self._bitmask, 0)
        bits = (self._bitmask[0].unsqueeze(-1) >> _BITS) & 1
        return bits.bool().flatten()[: self.vocab.size]

    def advance(self, token: int) -> None:
        """Take ``token``; ``GrammarViolation`` when the grammar does not allow it."""
        if self._m.is_stopped():
            if token in self.vocab.eos_ids:
                return
            raise GrammarViolation(f"token {token} after the grammar was complete")
        if not self._m.consume_token(token):
            raise GrammarViolation(f"token {token} is not allowed by the grammar: {self._m.get_error()}")


def model_vocabulary(adapter: Any) -> Vocabulary:
    """The vocabulary of a loaded ``VLMAdapter`` (its tokenizer, logits length and EOS ids)."""
    tokenizer = getattr(adapter.processor, "tokenizer", adapter.processor)
    size = int(adapter.model.config.get_text_config().vocab_size)
    return vocabulary_for(adapter, tokenizer, size, adapter.eos_token_ids)
