"""Structured output and tools with the official ``openai`` client against the real stack.

One set of worker processes (encoder, decode, prefill) behind two gateway
processes, one colocated and one disaggregated, so every case runs through both
placements, streaming and not: ``json_schema`` replies validate for 20 random
images, ``json_object`` replies parse, a named tool call's arguments validate
against its parameters, ``auto`` reads the model's own ``<tool_call>``, tool
results go back through the template, and a schema the grammar library cannot
compile is a 400 before any work. After every test nothing stays held
(``tests/leaks.py``).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from cluster import PLACEMENTS, placement_pair
from leaks import LONG_LEASES, settled_after
from shape_images import shape_data_url
from runtime.demo_model.tasks import JSON_INSTRUCTION, REPORT_SHAPE_TOOL, SHAPE_SCHEMA

MODEL = "demo-vlm"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with placement_pair(tmp_path_factory.mktemp("structured"), "--prefill-chunk-tokens", "16",
                        decode_env=LONG_LEASES) as stack:
        yield stack


@pytest.fixture(autouse=True)
def nothing_leaks(served):
    with settled_after(*served):
        yield


def client(served, placement: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1][placement].base}/v1", api_key="unused", max_retries=0, timeout=60)


def image_question(seed: int, question: str = "what is in the image ?") -> tuple[list[dict], dict]:
    url, sample = shape_data_url(seed)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}]
    return messages, {"colour": sample.colour, "shape": sample.shape}


def complete(c: openai.OpenAI, stream: bool, **kw) -> tuple[str | None, list[dict], str]:
    """``(content, tool_calls, finish_reason)``, the stream's deltas accumulated as a client does."""
    if not stream:
        choice = c.chat.completions.create(model=MODEL, temperature=0, **kw).choices[0]
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                 for t in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(model=MODEL, temperature=0, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for t in choice.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = t.id or call["id"]
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_json_schema_replies_validate_for_20_random_images(served, placement):
    c = client(served, placement)
    fmt = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE_SCHEMA, "strict": True}}
    right = 0
    for i in range(20):
        messages, truth = image_question(7000 + i)
        content, calls, finish = complete(c, stream=i % 2 == 1, messages=messages, response_format=fmt, max_tokens=40)
        assert finish == "stop" and not calls
        reply = json.loads(content)
        jsonschema.validate(reply, SHAPE_SCHEMA)
        right += reply == truth
    assert right >= 18, f"only {right}/20 replies name the image's colour and shape"


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_object_replies_parse(served, placement, stream):
    messages, truth = image_question(11)
    messages = [{"role": "system", "content": JSON_INSTRUCTION}, *messages]   # as OpenAI asks of json_object
    content, _, finish = complete(client(served, placement), stream, messages=messages, max_tokens=40,
                                  response_format={"type": "json_object"})
    assert finish == "stop"
    assert json.loads(content) == truth


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_tool_call_validates_against_its_parameters(served, placement, stream):
    messages, truth = image_question(23)
    other = {"type": "function", "function": {"name": "count_sides", "parameters": {
        "type": "object", "properties": {"sides": {"type": "integer", "minimum": 0, "maximum": 8}},
        "required": ["sides"], "additionalProperties": False}}}
    content, calls, finish = complete(
        client(served, placement), stream, messages=messages, max_tokens=60, tools=[other, REPORT_SHAPE_TOOL],
        tool_choice={"type": "function", "function": {"name": "report_shape"}})
    assert finish == "tool_calls" and not content
    assert len(calls) == 1 and calls[0]["name"] == "report_shape" and calls[0]["id"].startswith("call_")
    arguments = json.loads(calls[0]["arguments"])
    jsonschema.validate(arguments, SHAPE_SCHEMA)
    assert arguments == truth


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_required_forces_a_call_of_a_tool_the_model_was_not_trained_on(served, placement):
    messages, _ = image_question(31)
    tool = {"type": "function", "function": {"name": "count_sides", "parameters": {
        "type": "object", "properties": {"sides": {"type": "integer", "minimum": 0, "maximum": 8}},
        "required": ["sides"], "additionalProperties": False}}}
    _, calls, finish = complete(client(served, placement), False, messages=messages, max_tokens=60,
                                tools=[tool], tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "count_sides"
    jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_reads_the_models_own_tool_call_and_the_result_goes_back(served, placement, stream):
    c = client(served, placement)
    messages, truth = image_question(41)
    content, calls, finish = complete(c, stream, messages=messages, max_tokens=60, tools=[REPORT_SHAPE_TOOL])
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "report_shape"
    assert json.loads(calls[0]["arguments"]) == truth
    followup = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function", "function": {"name": "report_shape",
                                                                     "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "reported"}]
    content, calls, finish = complete(c, stream, messages=followup, max_tokens=20, tools=[REPORT_SHAPE_TOOL],
                                      tool_choice="none")
    assert finish in ("stop", "length") and not calls and content


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_schema_the_library_cannot_compile_is_a_400_before_any_work(served, placement):
    messages, _ = image_question(5)
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}
    with pytest.raises(openai.BadRequestError) as err:
        client(served, placement).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    body = err.value.body
    assert body["param"] == "response_format.json_schema.schema" and body["code"] == "invalid_schema"
    assert "unclosed group" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client(served, placement).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, tool_choice="required",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}])
    assert err.value.body["param"] == "tools" and "nowhere" in err.value.body["message"]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_streamed_tool_call_arrives_as_openai_sends_it(served, placement):
    """The call's first delta: index, id, type, function.name and empty arguments; then its argument
    text with the index alone; accumulated (the openai client's way) it is the whole reply's call."""
    c = client(served, placement)
    messages, truth = image_question(43)
    pieces = [t for chunk in c.chat.completions.create(model=MODEL, temperature=0, stream=True, messages=messages,
                                                       max_tokens=60, tools=[REPORT_SHAPE_TOOL])
              for choice in chunk.choices for t in choice.delta.tool_calls or []]
    head, *rest = pieces
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "report_shape" and head.function.arguments == ""
    assert rest and all(t.index == 0 and t.id is None and t.function.name is None for t in rest)
    assert json.loads("".join(t.function.arguments for t in rest)) == truth
    _, whole, _ = complete(c, False, messages=messages, max_tokens=60, tools=[REPORT_SHAPE_TOOL])
    assert whole[0]["arguments"] == "".join(t.function.arguments for t in rest)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n2_constrained_choices_each_validate(served, placement, stream):
    """n=2 with a forced tool call and with json_schema: each choice has its own matcher and parser."""
    c = client(served, placement)
    messages, truth = image_question(47)
    kw = dict(model=MODEL, messages=messages, max_tokens=60, n=2, temperature=0,
              tools=[REPORT_SHAPE_TOOL], tool_choice={"type": "function", "function": {"name": "report_shape"}})
    fmt = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE_SCHEMA, "strict": True}}
    if not stream:
        reply = c.chat.completions.create(**kw)
        assert [ch.finish_reason for ch in reply.choices] == ["tool_calls"] * 2
        assert [json.loads(ch.message.tool_calls[0].function.arguments) for ch in reply.choices] == [truth] * 2
        reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, n=2, response_format=fmt,
                                          temperature=1.0, seed=5)
        for ch in reply.choices:
            jsonschema.validate(json.loads(ch.message.content), SHAPE_SCHEMA)
        return
    calls, finishes = {}, {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for t in choice.delta.tool_calls or []:
                calls.setdefault(choice.index, "")
                calls[choice.index] += t.function.arguments or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert [json.loads(calls[i]) for i in (0, 1)] == [truth] * 2


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_object"}, "tools": [REPORT_SHAPE_TOOL]}, "response_format"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
    ({"tools": [REPORT_SHAPE_TOOL], "tool_choice": "required", "stop": ["x"]}, "stop"),
    ({"tools": [REPORT_SHAPE_TOOL], "logprobs": True}, "logprobs"),
    ({"tools": [REPORT_SHAPE_TOOL], "logprobs": True, "n": 2}, "logprobs"),
])
def test_combinations_not_honoured_are_refused_by_name(served, extra, param):
    messages, _ = image_question(5)
    with pytest.raises(openai.BadRequestError) as err:
        client(served, "colocated").chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **extra)
    assert err.value.body["param"] == param
