"""What a request asks of the reply's shape, as one ``OutputPlan``: the grammar and the tool-call parser.

=====================================  ===========================================  =========================
request                                grammar (``runtime.model.grammar``)          reply
=====================================  ===========================================  =========================
``response_format: text`` / absent     none                                         text
``json_object``                        any JSON object                              text (JSON)
``json_schema`` (``strict`` or not)    the schema                                   text (JSON)
``tools``, ``tool_choice: none``       none; the tools are not rendered             text
``tools``, ``auto`` (default)          none; the reply is parsed (``tool_parsers``)  text and/or tool calls
``tools``, ``required``                one call of any tool (several with           tool calls
                                       ``parallel_tool_calls``, the default)
``tool_choice`` a named function       one call of that function                    tool calls
=====================================  ===========================================  =========================

A forced call's arguments follow the function's ``parameters`` schema. Every
grammar is compiled against the model's tokenizer here, before any image is
fetched or any worker is asked: one the library cannot compile is a 400
naming the field and the library's message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.model import grammar

from .errors import ApiError
from .openai_schema import ChatCompletionRequest, JsonObjectFormat, JsonSchemaFormat, NamedToolChoice
from .tool_parsers import HermesToolParser, parser_for


@dataclass(frozen=True, slots=True)
class OutputPlan:
    grammar: str | None = None              # what every sampled token is masked with
    tools: list[dict[str, Any]] | None = None   # rendered by the chat template
    parser: HermesToolParser | None = None   # tool calls are read out of the reply (auto, required, named)
    forced_calls: bool = False              # the grammar allows nothing but tool calls


def plan_output(chat: ChatCompletionRequest, vocab: Callable[[], grammar.Vocabulary], template: str | None) -> OutputPlan:
    """The request's plan; ``ApiError`` (400) for a grammar that does not compile. ``vocab`` is asked
    for only when a grammar is needed."""
    choice = chat.tool_choice if chat.tool_choice is not None else "auto"
    if chat.tools and choice != "none":
        tools = [t.model_dump(mode="json", exclude_none=True, by_alias=True) for t in chat.tools]
        parser = parser_for(template)
        if parser is None:
            raise ApiError.bad_request("this model's chat template has no tool-call format the server can parse",
                                       "tools", "tools_not_supported")
        if choice == "auto":
            return OutputPlan(tools=tools, parser=parser)
        chosen = chat.tools
        param = "tools"
        if isinstance(choice, NamedToolChoice):
            chosen = [t for t in chat.tools if t.function.name == choice.function.name]
            param = f"tools.{chat.tools.index(chosen[0])}.function.parameters"
        specs = [grammar.ToolSpec(t.function.name, t.function.parameters or {"type": "object", "properties": {},
                                                                             "additionalProperties": False})
                 for t in chosen]
        parallel = chat.parallel_tool_calls is not False and not isinstance(choice, NamedToolChoice)
        text = _compiled(lambda: grammar.tool_call_grammar(specs, parallel=parallel), vocab, param)
        return OutputPlan(grammar=text, tools=tools, parser=parser, forced_calls=True)
    fmt = chat.response_format
    if isinstance(fmt, JsonObjectFormat):
        return OutputPlan(grammar=_compiled(grammar.json_object_grammar, vocab, "response_format"))
    if isinstance(fmt, JsonSchemaFormat):
        spec = fmt.json_schema
        if spec.json_schema is None:
            return OutputPlan(grammar=_compiled(grammar.json_object_grammar, vocab, "response_format"))
        return OutputPlan(grammar=_compiled(lambda: grammar.json_schema_grammar(spec.json_schema, strict=bool(spec.strict)),
                                            vocab, "response_format.json_schema.schema"))
    return OutputPlan()


def _compiled(build: Callable[[], str], vocab: Callable[[], grammar.Vocabulary], param: str) -> str:
    try:
        text = build()
        grammar.check(text, vocab())
    except grammar.GrammarError as exc:
        raise ApiError.bad_request(f"{param} cannot be compiled into a grammar: {exc}", param, "invalid_schema") from None
    return text
