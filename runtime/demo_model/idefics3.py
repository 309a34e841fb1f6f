"""Tiny random-weight image-splitting checkpoints (Idefics3, SmolVLM) built here, for tests.

``build_idefics3(family, out)`` writes a standard Hugging Face checkpoint: the
family's real model class with a few small layers (its SigLIP-style tower,
the pixel-shuffle connector with ``scale_factor=2``, a Llama decoder), a
byte-level BPE tokenizer trained here (``<global-img>`` and the
``<row_R_col_C>`` tags, ``<fake_token_around_image>``, ``<image>`` and
``<end_of_utterance>`` added, as in the real tokenizers), the real
image processor (PIL backend) splitting images into 32-pixel sub-images
(``max_image_size``) after resizing their longest edge to at most 96 pixels
(up to 3 x 3 sub-images plus the global one, 4 tokens each), the real
processor class and a chat template modelled on the family's own
(``User:<image>text<end_of_utterance>`` turns). SmolVLM's
``processor_config.json`` holds the video processor's settings as a
downloaded one does (loading it takes the torchvision-free path).
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

import torch
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessorPil,
)

from runtime.model.families.idefics3 import SmolVLMFamily

from .qwen_vl import INIT_RANGE, build_tokenizer

TILE = 32
PATCH = 8
SCALE = 2           # (32 / 8)**2 / 2**2 = 4 tokens a sub-image
LONGEST_EDGE = 96
HIDDEN = 64


class SplitFamily(str, enum.Enum):
    IDEFICS3 = "idefics3"
    SMOLVLM = "smolvlm"


def _template(bos: str) -> str:
    return (
        bos + "{% for message in messages %}{{ message['role'] | capitalize }}"
        "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
        "{% else %}{% if message['content'] and message['content'][0]['type'] in ['image', 'image_url'] %}{{ ':' }}"
        "{% else %}{{ ': ' }}{% endif %}"
        "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
        "{% elif line['type'] in ['image', 'image_url'] %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
        "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    )


def build_idefics3(family: SplitFamily | str, out: Path, *, seed: int = 0) -> Path:
    """Write the tiny checkpoint of ``family`` to ``out``; seconds on a CPU."""
    family = SplitFamily(family)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    tags = ["<global-img>", *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
    bos = "<|begin_of_text|>" if family == SplitFamily.IDEFICS3 else "<|im_start|>"
    image_tokens = ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]
    tokenizer.add_special_tokens({"additional_special_tokens": [bos, *image_tokens, *tags]},
                                 replace_extra_special_tokens=False)
    image_kwargs = dict(do_image_splitting=True, size={"longest_edge": LONGEST_EDGE},
                        max_image_size={"longest_edge": TILE}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    seq_len = (TILE // PATCH) ** 2 // SCALE ** 2
    if family == SplitFamily.IDEFICS3:
        processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**image_kwargs), tokenizer=tokenizer,
                                      image_seq_len=seq_len, chat_template=_template(bos))
    else:
        processor = SmolVLMFamily.processor_class(image_processor=SmolVLMImageProcessorPil(**image_kwargs),
                                                       tokenizer=tokenizer, video_processor=None, image_seq_len=seq_len,
                                                       chat_template=_template(bos))
    eos = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    text = dict(model_type="llama", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                max_position_embeddings=2048, initializer_range=INIT_RANGE, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=TILE, patch_size=PATCH, initializer_range=INIT_RANGE)
    ids = dict(image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=SCALE)
    if family == SplitFamily.IDEFICS3:
        config = Idefics3Config(text_config=text, vision_config=dict(vision, model_type="idefics3_vision"), **ids)
        config.tie_word_embeddings = False
        model = Idefics3ForConditionalGeneration(config)
    else:
        config = SmolVLMConfig(text_config=text, vision_config=dict(vision, model_type="smolvlm_vision"), **ids)
        config.tie_word_embeddings = False
        model = SmolVLMForConditionalGeneration(config)
    model.eval()
    model.generation_config.eos_token_id = [eos, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    if family == SplitFamily.SMOLVLM:
        _add_video_processor(out)
    return out


def _add_video_processor(out: Path) -> None:
    """The video processor's settings in ``processor_config.json``, as a downloaded SmolVLM holds them."""
    path = out / "processor_config.json"
    config = json.loads(path.read_text()) if path.exists() else {"processor_class": "SmolVLMProcessor"}
    config["video_processor"] = {"video_processor_type": "SmolVLMVideoProcessor", "size": {"longest_edge": LONGEST_EDGE},
                                 "max_image_size": {"longest_edge": TILE}, "fps": 1, "num_frames": 8,
                                 "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
