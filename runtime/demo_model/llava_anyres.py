"""Tiny random-weight any-resolution LLaVA checkpoints (LLaVA-OneVision, LLaVA-NeXT) built here, for tests.

``build_llava_anyres(family, out)`` writes a standard Hugging Face checkpoint:
the family's real model class with a few small layers, a byte-level BPE
tokenizer trained here (``Qwen2Tokenizer``, as the OneVision checkpoints use;
``<image>`` and ``<video>`` added after the vocabulary), the real image
processor (PIL backend) with 32-pixel tiles of 8-pixel patches (16 tokens a
tile) and a small ``image_grid_pinpoints`` list (up to 3 x 3 tiles), the real
processor class and a chat template modelled on the family's own.

* **LLaVA-OneVision** (``llava_onevision``): SigLIP tower, Qwen2 decoder,
  ``vision_feature_select_strategy="full"``, ``vision_aspect_ratio="anyres_max_4"``
  so large images exercise the model's down-sampling of the tile grid.
  ``processor_config.json`` is laid out as transformers 5 saves it, the video
  processor's settings included (what a downloaded checkpoint holds; loading it
  needs the torchvision-free path, ``families.image_only_processor``).
* **LLaVA-NeXT** (``llava_next``): CLIP tower (its CLS token dropped,
  ``vision_feature_select_strategy="default"``), Llama decoder, the
  ``[INST] ... [/INST]`` template of the Mistral-based LLaVA-NeXT.

Random weights make random tokens; what tests check is identity with ``generate()``.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

import torch
from transformers import (
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessorPil,
)

from .qwen_vl import INIT_RANGE, build_tokenizer

TILE = 32          # the vision tower's image size: one tile
PATCH = 8          # 16 tokens a tile
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32], [64, 96], [96, 64], [96, 96]]
HIDDEN = 64


class AnyResFamily(str, enum.Enum):
    LLAVA_ONEVISION = "llava_onevision"
    LLAVA_NEXT = "llava_next"


# Images first (in order), then the text, as the real OneVision template renders a turn.
ONEVISION_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ '\n' + message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] %}{% if content['type'] in ['image', 'image_url'] %}{{ '<image>' }}{% endif %}{% endfor %}"
    "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ '\n' + content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The Mistral-based LLaVA-NeXT template: images first in a user turn, each followed by a newline.
NEXT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set texts = [message['content']] %}{% set n_images = 0 %}"
    "{% else %}{% set texts = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | list %}"
    "{% set n_images = message['content'] | selectattr('type', 'in', ['image', 'image_url']) | list | length %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + texts | join('') + '\n<</SYS>>\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}{% for _ in range(n_images) %}{{ '<image>\n' }}{% endfor %}"
    "{{ texts | join('') }}{{ ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + texts | join('') + '<|endoftext|> ' }}{% endif %}"
    "{% endfor %}"
)


def _tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]},
                                 replace_extra_special_tokens=False)
    return tokenizer


def _text_config(tokenizer, model_type: str, eos: str) -> dict:
    return dict(model_type=model_type, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                max_position_embeddings=2048, initializer_range=INIT_RANGE, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(eos),
                pad_token_id=tokenizer.pad_token_id)


def _vision_config(model_type: str) -> dict:
    return dict(model_type=model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, image_size=TILE, patch_size=PATCH)


def build_llava_anyres(family: AnyResFamily | str, out: Path, *, seed: int = 0) -> Path:
    """Write the tiny checkpoint of ``family`` to ``out``; seconds on a CPU."""
    family = AnyResFamily(family)
    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    ids = dict(image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    common = dict(size={"height": TILE, "width": TILE}, crop_size={"height": TILE, "width": TILE},
                  do_center_crop=False, image_grid_pinpoints=PINPOINTS,
                  image_mean=[0.5] * 3, image_std=[0.5] * 3)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if family == AnyResFamily.LLAVA_ONEVISION:
        eos = "<|im_end|>"
        config = LlavaOnevisionConfig(text_config=_text_config(tokenizer, "qwen2", eos),
                                      vision_config=_vision_config("siglip_vision_model"),
                                      video_token_id=tokenizer.convert_tokens_to_ids("<video>"),
                                      image_grid_pinpoints=PINPOINTS, vision_feature_select_strategy="full",
                                      vision_feature_layer=-1, vision_aspect_ratio="anyres_max_4", **ids)
        config.tie_word_embeddings = False
        model = LlavaOnevisionForConditionalGeneration(config)
        image_processor = LlavaOnevisionImageProcessorPil(**common)
        tokenizer.save_pretrained(out)
        (out / "chat_template.jinja").write_text(ONEVISION_TEMPLATE)
        _write_onevision_processor_config(out, image_processor)
    else:
        eos = "<|endoftext|>"
        config = LlavaNextConfig(text_config=_text_config(tokenizer, "llama", eos),
                                 vision_config=_vision_config("clip_vision_model"),
                                 image_grid_pinpoints=PINPOINTS, vision_feature_select_strategy="default",
                                 vision_feature_layer=-1, **ids)
        config.tie_word_embeddings = False
        model = LlavaNextForConditionalGeneration(config)
        processor = LlavaNextProcessor(image_processor=LlavaNextImageProcessorPil(**common), tokenizer=tokenizer,
                                       patch_size=PATCH, vision_feature_select_strategy="default",
                                       num_additional_image_tokens=1, chat_template=NEXT_TEMPLATE)
        processor.save_pretrained(out)
    model.eval()
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(eos), tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    return out


def _write_onevision_processor_config(out: Path, image_processor: LlavaOnevisionImageProcessorPil) -> None:
    """``processor_config.json`` as transformers 5 saves the real processor (whose video part we cannot build)."""
    image = image_processor.to_dict()
    image["image_processor_type"] = "LlavaOnevisionImageProcessor"
    video = {"video_processor_type": "LlavaOnevisionVideoProcessor", "size": {"height": TILE, "width": TILE},
             "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_sample_frames": False}
    config = {"image_processor": image, "video_processor": video, "processor_class": "LlavaOnevisionProcessor",
              "num_image_tokens": (TILE // PATCH) ** 2, "vision_feature_select_strategy": "full",
              "vision_aspect_ratio": "anyres_max_4", "image_token": "<image>", "video_token": "<video>"}
    (out / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
