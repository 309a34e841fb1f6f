"""The demo model's word-level vocabulary, special tokens and chat template."""

from __future__ import annotations

from .shapes import COLOURS, SHAPES

IMAGE_TOKEN = "<image>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
END_TOKEN = "<|end|>"  # end of a turn; also the model's EOS
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, END_TOKEN, IMAGE_TOKEN, *ROLE_TOKENS)

# Plain words: the task's words first, then common English so ordinary prompts
# (and the benchmark's long documents) tokenize to known words.
_TASK_WORDS = (
    "a an the what is in image picture photo do you see describe shown shape colour color "
    "there this of and ? . , ! : ' - yes no"
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

# Content parts of type "image" (transformers' own message format) and
# "image_url" (what OpenAI clients send) both become one image placeholder.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ ' ' + message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url'] %}{{ ' <image>' }}"
    "{% elif part['type'] == 'text' %}{{ ' ' + part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ ' <|end|> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
