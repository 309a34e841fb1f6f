"""The reply's text as OpenAI shapes it: content, or tool calls read by the request's parser.

Without a parser (no tools, or ``tool_choice: "none"``) the text is the content, piece
by piece. With one, ``message()`` splits the whole text into content and
``tool_calls``; ``deltas()`` does the same while streaming: content deltas as the
text comes, and each tool call in OpenAI's shape once its block is complete: a first
delta with its ``index``, ``id``, ``type`` and ``function.name`` and empty
``arguments``, then the argument text (clients append the fragments). The block is
read whole before anything of it is sent, since a block that is not a call stays in
the content as written (the parser cannot know that before the block closes). A reply with calls that ended on its own finishes
``"tool_calls"``; one cut by ``max_tokens`` stays ``"length"``.
"""

from __future__ import annotations

from collections.abc import Iterator

from .openai_schema import AssistantMessage, Delta, FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from .tool_parsers import HermesToolParser, ParsedCall


class ReplyShaper:
    def __init__(self, parser: HermesToolParser | None):
        self.parser = parser
        self._stream = parser.stream() if parser is not None else None
        self.calls = 0

    def message(self, text: str) -> AssistantMessage:
        if self.parser is None:
            return AssistantMessage(content=text)
        parsed = self.parser.parse(text)
        self.calls = len(parsed.calls)
        if not parsed.calls:
            return AssistantMessage(content=parsed.content)
        return AssistantMessage(content=parsed.content.strip() or None, tool_calls=[_call(c) for c in parsed.calls])

    def deltas(self, text: str) -> Iterator[Delta]:
        if not text:
            return
        if self._stream is None:
            yield Delta(content=text)
            return
        yield from self._deltas(*self._stream.feed(text))

    def end_deltas(self) -> Iterator[Delta]:
        if self._stream is not None:
            yield from self._deltas(*self._stream.finish())

    def _deltas(self, content: str, calls: list[ParsedCall]) -> Iterator[Delta]:
        if content:
            yield Delta(content=content)
        for call in calls:
            yield Delta(tool_calls=[ToolCallDelta(index=self.calls, id=call.id, type="function",
                                                  function=FunctionCallDelta(name=call.name, arguments=""))])
            yield Delta(tool_calls=[ToolCallDelta(index=self.calls, function=FunctionCallDelta(arguments=call.arguments))])
            self.calls += 1

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason


def _call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
