"""What the demo model is trained to answer: one shape question, in three forms.

``PLAIN``  the question alone -> ``a red circle``;
``JSON``   a system turn asking for JSON -> ``{"colour": "red", "shape": "circle"}``
           (``SHAPE_SCHEMA``; compact separators, as ``json.dumps`` writes them);
``TOOL``   the ``report_shape`` tool offered -> a Qwen-style call
           ``<tool_call>\\n{"name": "report_shape", "arguments": {...}}\\n</tool_call>``.

So the shipped model shows structured output and tool calls on its own task; the
grammar (``runtime.model.grammar``) is what guarantees a reply's shape whatever
the model writes.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from .shapes import COLOURS, QUESTIONS, SHAPES

SHAPE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": list(COLOURS)},
                   "shape": {"type": "string", "enum": list(SHAPES)}},
    "required": ["colour", "shape"],
    "additionalProperties": False,
}
REPORT_SHAPE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "report_shape", "description": "Report the colour and shape seen in the image.",
                 "parameters": SHAPE_SCHEMA},
}
JSON_INSTRUCTION = "Reply with a json object with the keys colour and shape."


class Task(enum.Enum):
    PLAIN = "plain"
    JSON = "json"
    TOOL = "tool"


def messages(task: Task, question: str) -> list[dict[str, Any]]:
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    if task is Task.JSON:
        return [{"role": "system", "content": JSON_INSTRUCTION}, user]
    return [user]


def tools(task: Task) -> list[dict[str, Any]] | None:
    return [REPORT_SHAPE_TOOL] if task is Task.TOOL else None


def answer(task: Task, colour: str, shape: str) -> str:
    if task is Task.PLAIN:
        return f"a {colour} {shape}"
    arguments = json.dumps({"colour": colour, "shape": shape})
    if task is Task.JSON:
        return arguments
    return f'<tool_call>\n{{"name": "report_shape", "arguments": {arguments}}}\n</tool_call>'


def corpus_examples() -> list[str]:
    """Every answer and instruction, for the tokenizer's merges."""
    texts = [*QUESTIONS, JSON_INSTRUCTION, json.dumps(REPORT_SHAPE_TOOL)]
    for colour in COLOURS:
        for shape in SHAPES:
            texts += [answer(t, colour, shape) for t in Task]
    return texts
