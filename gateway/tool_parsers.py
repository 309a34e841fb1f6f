"""Reading tool calls out of a model's reply, one parser per format (``parser_for`` picks it).

``HermesToolParser``: Qwen's (and Hermes') format, each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>`` lines. Text outside the blocks is the message's content; a
block that is not such an object stays in the content, as written (a reply is
never dropped). ``stream()`` gives the same result piece by piece: content as it
comes (a tail that may be the start of ``<tool_call>`` waits for the next
piece), each call once its block closes.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str                      # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(slots=True)
class Parsed:
    content: str
    calls: list[ParsedCall]


class HermesToolParser:
    START = "<tool_call>"
    END = "</tool_call>"

    def parse(self, text: str) -> Parsed:
        stream = self.stream()
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        return Parsed(content + rest, calls + more)

    def stream(self) -> "HermesStream":
        return HermesStream(self)

    @staticmethod
    def call(block: str) -> ParsedCall | None:
        try:
            value = json.loads(block)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or set(value) - {"name", "arguments"}:
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesStream:
    """Incremental parsing: ``feed(text) -> (content, calls)``; ``finish()`` returns what is left."""

    def __init__(self, parser: HermesToolParser):
        self.parser = parser
        self._buffer = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content, calls = [], []
        start, end = self.parser.START, self.parser.END
        while True:
            at = self._buffer.find(start)
            if at < 0:
                keep = _partial_suffix(self._buffer, start)
                out = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(out):]
                content.append(self._content(out))
                break
            content.append(self._content(self._buffer[:at]))
            close = self._buffer.find(end, at)
            if close < 0:
                self._buffer = self._buffer[at:]
                break
            block = self._buffer[at + len(start): close]
            call = self.parser.call(block.strip())
            if call is None:
                content.append(self._buffer[at: close + len(end)])
            else:
                calls.append(call)
                self.calls += 1
            self._buffer = self._buffer[close + len(end):]
        return "".join(content), calls

    def _content(self, text: str) -> str:
        """Whitespace between and after calls is layout, not content."""
        return text if not self.calls or text.strip() else ""

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The end of the reply: an unclosed block is content as written."""
        rest, self._buffer = self._buffer, ""
        return self._content(rest), []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parser_for(chat_template: str | None) -> HermesToolParser | None:
    """The parser for the format a checkpoint's chat template asks tool calls in; ``None``: none we know."""
    if chat_template and HermesToolParser.START in chat_template:
        return HermesToolParser()
    return None
