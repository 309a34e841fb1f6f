"""The grammar layer on the demo tokenizer (no model): compile errors, masks, the decode worker's replay,
and the Hermes tool-call parser, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from gateway.tool_parsers import HermesToolParser
from runtime.demo_model.build import build_tokenizer
from runtime.demo_model.tasks import SHAPE_SCHEMA
from runtime.model import grammar


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok) -> grammar.Vocabulary:
    return grammar.Vocabulary.of(tok, len(tok) + 3, [tok.eos_token_id])   # logits longer than the tokenizer


def greedy_under_mask(g: str, vocab, logits_fn, limit: int = 80) -> list[int]:
    m = grammar.Matcher(g, vocab)
    out: list[int] = []
    for _ in range(limit):
        allowed = m.allowed()
        token = int(logits_fn(len(out)).masked_fill(~allowed, float("-inf")).argmax())
        m.advance(token)
        if token in vocab.eos_ids:
            return out
        out.append(token)
    raise AssertionError("the grammar did not end")


def test_any_logits_give_a_reply_that_validates(tok, vocab):
    g = grammar.json_schema_grammar(SHAPE_SCHEMA, strict=True)
    grammar.check(g, vocab)
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        ids = greedy_under_mask(g, vocab, lambda _: torch.randn(vocab.size, generator=gen))
        jsonschema.validate(json.loads(tok.decode(ids)), SHAPE_SCHEMA)


def test_the_mask_never_allows_ids_beyond_the_tokenizer(vocab, tok):
    allowed = grammar.Matcher(grammar.json_object_grammar(), vocab).allowed()
    assert allowed.shape == (vocab.size,) and not allowed[len(tok):].any() and allowed.any()


def test_decode_rebuilds_the_state_from_the_output_and_refuses_a_token_the_grammar_does_not_allow(tok, vocab):
    g = grammar.json_object_grammar()
    prefix = tok('{"a": ', add_special_tokens=False)["input_ids"]
    m = grammar.Matcher(g, vocab, prefix)
    assert not m.allowed()[tok.convert_tokens_to_ids("}")]
    with pytest.raises(grammar.GrammarViolation):
        grammar.Matcher(g, vocab, tok("hello", add_special_tokens=False)["input_ids"])


def test_only_eos_once_complete(tok, vocab):
    m = grammar.Matcher(grammar.json_object_grammar(), vocab, tok("{}", add_special_tokens=False)["input_ids"])
    assert m.done and m.allowed().nonzero().flatten().tolist() == [tok.eos_token_id]
    with pytest.raises(grammar.GrammarViolation):
        m.advance(5)


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "pattern": "(("}, "unclosed group"),
    ({"$ref": "#/nowhere"}, "nowhere"),
    ({"type": "frob"}, "frob"),
])
def test_uncompilable_schemas_name_the_problem(vocab, schema, words):
    with pytest.raises(grammar.GrammarError, match=words):
        grammar.check(grammar.json_schema_grammar(schema), vocab)


def test_a_forced_tool_call_has_the_format_the_parser_reads(tok, vocab):
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    g = grammar.tool_call_grammar([grammar.ToolSpec("count", params), grammar.ToolSpec("other", {"type": "object", "additionalProperties": False})], parallel=False)
    grammar.check(g, vocab)
    gen = torch.Generator().manual_seed(3)
    text = tok.decode(greedy_under_mask(g, vocab, lambda _: torch.randn(vocab.size, generator=gen)))
    parsed = HermesToolParser().parse(text)
    assert len(parsed.calls) == 1 and parsed.content == ""
    assert parsed.calls[0].name in ("count", "other")
    if parsed.calls[0].name == "count":
        jsonschema.validate(json.loads(parsed.calls[0].arguments), params)
    with pytest.raises(grammar.GrammarError, match="must match"):
        grammar.tool_call_grammar([grammar.ToolSpec("bad name", {})], parallel=True)


REPLY = ('I will check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
         '<tool_call>\n{"name": "g", "arguments": "{\\"y\\": [2]}"}\n</tool_call>')


def test_hermes_parser_whole_and_streamed_agree():
    parser = HermesToolParser()
    whole = parser.parse(REPLY)
    assert whole.content.strip() == "I will check."
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("f", {"x": 1}), ("g", {"y": [2]})]
    for size in (1, 3, 7):
        stream, content, calls = parser.stream(), "", []
        for i in range(0, len(REPLY), size):
            text, more = stream.feed(REPLY[i:i + size])
            content, calls = content + text, calls + more
        rest, more = stream.finish()
        assert (content + rest).strip() == "I will check."
        assert [(c.name, c.arguments) for c in calls + more] == [(c.name, c.arguments) for c in whole.calls]


def test_a_block_that_is_not_a_call_stays_content():
    text = "<tool_call>\nnot json\n</tool_call> and <tool_call>\n{\"name\": 3}"
    parsed = HermesToolParser().parse(text)
    assert parsed.calls == [] and parsed.content == text
