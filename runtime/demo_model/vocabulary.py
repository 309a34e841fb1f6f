"""The demo model's special tokens, tokenizer corpus and chat template.

The tokenizer is byte-level BPE (``build.build_tokenizer``), so any text, JSON
and tool calls included, tokenizes without an unknown token; its merges are
learnt from ``tokenizer_corpus()``: the task's words, common English (so
ordinary prompts and the benchmark's long documents stay short), and the JSON
and tool-call text the model is trained to write.

The chat template is modelled on Qwen2.5's: with ``tools`` the system turn lists
each tool's JSON inside ``<tools></tools>`` and asks for calls as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``; an assistant
turn's ``tool_calls`` are rendered in that same form, and ``role: "tool"``
messages go back as ``<tool_response>`` blocks inside one user turn.
"""

from __future__ import annotations

from .shapes import COLOURS, SHAPES

IMAGE_TOKEN = "<image>"
PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
END_TOKEN = "<|end|>"  # end of a turn; also the model's EOS
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, END_TOKEN, IMAGE_TOKEN, *ROLE_TOKENS)
BPE_VOCAB = 2048

# Plain words: the task's words first, then common English.
_TASK_WORDS = (
    "a an the what is in image picture photo do you see describe shown shape colour color "
    "there this of and ? . , ! : ' - yes no json object reply answer with as tool call function"
).split()
_COMMON_WORDS = (
    "i me my we our it its he she they them their his her be am are was were been being have has had "
    "will would can could should may might must shall to for on at by with from about as into over under "
    "after before between through during without again then once here where when why how all any both each "
    "few more most other some such only own same so than too very just not or but if because while until "
    "one two three four five six seven eight nine ten first second last next new old good great small large "
    "big long short high low left right top bottom center middle up down out off near far inside outside "
    "time year day week way thing man woman child people world life hand part place case point group number "
    "system program question answer work company problem fact area water room story money book word line "
    "make take get give go come know think look want use find tell ask feel try leave call keep let begin "
    "seem help show hear play run move live believe hold bring happen write provide sit stand lose pay meet "
    "include continue set learn change lead understand watch follow stop create speak read allow add spend "
    "grow open walk win offer remember love consider appear buy wait serve die send expect build stay fall "
    "cut reach kill remain suggest raise pass sell require report decide pull model request token document "
    "please hello thanks thank quick brown fox jumps lazy dog cat sun sky tree house car road city light dark "
    "white black gray grey orange purple pink circle square triangle round corner edge background"
).split()
WORDS: tuple[str, ...] = tuple(dict.fromkeys([*_TASK_WORDS, *COLOURS, *SHAPES, *_COMMON_WORDS]))

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call>"
)

# Content parts of type "image" (transformers' own message format) and "image_url" (what
# OpenAI clients send) both become one image placeholder. A tool call's arguments may be a
# JSON string (OpenAI's wire form, rendered as is) or an object (rendered with tojson).
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}{%- for part in content -%}"
    "{%- if part['type'] in ['image', 'image_url'] -%}{{ '<image>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- if tools -%}"
    "{{ '<|system|>' }}"
    "{%- if messages[0]['role'] == 'system' -%}{{ render(messages[0]['content']) + '\n\n' }}{%- endif -%}"
    "{{ TOOLS_PREAMBLE }}"
    "{%- for tool in tools -%}{{ '\n' }}{{ tool | tojson }}{%- endfor -%}"
    "{{ TOOLS_POSTAMBLE }}<|end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|user|>' }}{%- endif -%}"
    "{{ '<tool_response>\n' }}{{ render(message['content']) }}{{ '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|end|>' }}{%- else -%}{{ '\n' }}{%- endif -%}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') -%}"
    "{{ '<|' + message['role'] + '|>' }}{{ render(message['content']) }}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{%- if not loop.first or message['content'] -%}{{ '\n' }}{%- endif -%}"
    "{{ '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string -%}{{ call['arguments'] }}{%- else -%}{{ call['arguments'] | tojson }}{%- endif -%}"
    "{{ '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
).replace("{{ TOOLS_PREAMBLE }}", "{{ " + repr(TOOLS_PREAMBLE) + " }}").replace(
    "{{ TOOLS_POSTAMBLE }}", "{{ " + repr(TOOLS_POSTAMBLE) + " }}")


def tokenizer_corpus() -> list[str]:
    """The texts the BPE merges are learnt from (no randomness: the tokenizer is a pure function of the code)."""
    from .tasks import corpus_examples

    return [" ".join(WORDS), " ".join(w.capitalize() for w in WORDS), TOOLS_PREAMBLE, TOOLS_POSTAMBLE,
            *corpus_examples()]
