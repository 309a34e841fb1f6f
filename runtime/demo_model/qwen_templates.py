"""Chat templates of the tiny Qwen-VL checkpoints, modelled on the real ones.

Qwen2-VL and Qwen2.5-VL: a default system turn ("You are a helpful assistant.")
when the conversation has none; each image part becomes
``<|vision_start|><|image_pad|><|vision_end|>`` (``add_vision_id`` prefixes
"Picture N: "); turns are ``<|im_start|>role\\n ... <|im_end|>\\n``. Qwen3-VL: no
default system turn, the same vision markers, assistant turns as in the real
template without its tool and reasoning branches. Parts of type ``image`` and
``image_url`` (what OpenAI clients send) are both images, as in the real ones.
"""

from __future__ import annotations

_QWEN2_VL = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or content['type'] == 'image_url' or 'image' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_QWEN3_VL = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or content['type'] == 'image_url' or 'image' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Picture ' + image_count.value|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif content['type'] == 'video' or 'video' in content -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in content -%}{{- content['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

CHAT_TEMPLATES: dict[str, str] = {"qwen2_vl": _QWEN2_VL, "qwen2_5_vl": _QWEN2_VL, "qwen3_vl": _QWEN3_VL}
