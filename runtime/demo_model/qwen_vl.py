"""Tiny random-weight Qwen-VL checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) built here, for tests.

``build_qwen_vl(family, out)`` writes a standard Hugging Face checkpoint of the
family: its real model class with a few small layers, a byte-level BPE
tokenizer trained here in milliseconds (the ``Qwen2Tokenizer`` class, the
family's special tokens after the vocabulary as in the real ones), the real
image processor with a small ``max_pixels`` (images give 4..64 tokens), the
real processor class named in the configs and a chat template modelled on the
family's own. The processor files are laid out as ``save_pretrained`` of
transformers 5 writes them (``processor_config.json`` with the sub-processors
nested, the video processor's settings included), so loading them exercises
the same path as a downloaded checkpoint. Random weights make random tokens;
what tests check is identity with ``generate()``.

``initializer_range`` is 0.2 (not 0.02) so the greedy continuations vary
instead of repeating one token, which would make identity checks trivial.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from .qwen_templates import CHAT_TEMPLATES
from .vocabulary import WORDS


class QwenFamily(str, enum.Enum):
    QWEN2_VL = "qwen2_vl"
    QWEN2_5_VL = "qwen2_5_vl"
    QWEN3_VL = "qwen3_vl"


SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
BPE_VOCAB = 480
PATCH_SIZE = 8
MERGE_SIZE = 2
MIN_PIXELS = 32 * 32          # at least 4 image tokens
MAX_PIXELS = 128 * 128        # at most 64 image tokens
HIDDEN = 64
INIT_RANGE = 0.2

_PROCESSOR_CLASS = {QwenFamily.QWEN2_VL: "Qwen2VLProcessor", QwenFamily.QWEN2_5_VL: "Qwen2_5_VLProcessor",
                    QwenFamily.QWEN3_VL: "Qwen3VLProcessor"}
_VIDEO_PROCESSOR_CLASS = {QwenFamily.QWEN2_VL: "Qwen2VLVideoProcessor", QwenFamily.QWEN2_5_VL: "Qwen2VLVideoProcessor",
                          QwenFamily.QWEN3_VL: "Qwen3VLVideoProcessor"}


def build_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE over the demo words and chat words; special tokens get the ids after the vocabulary."""
    corpus = [" ".join(WORDS), "system user assistant You are a helpful assistant.", "Picture 1: Picture 2: \n\n"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(corpus * 4, trainer)
    state = json.loads(backend.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=state["vocab"], merges=merges, unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", model_max_length=2048)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|im_end|>"]})
    tokenizer._tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def build_image_processor(family: QwenFamily) -> Qwen2VLImageProcessorPil:
    mean_std = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if family == QwenFamily.QWEN3_VL else {}
    return Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2,
                                    min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, **mean_std)


def build_config(family: QwenFamily, tokenizer: Qwen2Tokenizer, vision_overrides: dict | None = None):
    """The family's tiny config; ``vision_overrides`` replace vision-config fields (a benchmark's wider tower)."""
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=2048,
                initializer_range=INIT_RANGE, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)
    common_vision = dict(depth=2, num_heads=2, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
                         temporal_patch_size=2, initializer_range=INIT_RANGE)
    if family == QwenFamily.QWEN2_VL:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        vision = dict(common_vision, embed_dim=32, hidden_size=HIDDEN, mlp_ratio=2)
        vision.update(vision_overrides or {})
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    elif family == QwenFamily.QWEN2_5_VL:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        vision = dict(common_vision, hidden_size=32, intermediate_size=64, out_hidden_size=HIDDEN,
                      window_size=PATCH_SIZE * MERGE_SIZE * 2, fullatt_block_indexes=[1], tokens_per_second=2)
        vision.update(vision_overrides or {})
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    else:
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                  "mrope_section": [4, 2, 2], "mrope_interleaved": True})
        vision = dict(common_vision, depth=3, hidden_size=32, intermediate_size=64, out_hidden_size=HIDDEN,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
        vision.update(vision_overrides or {})
        config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    config.tie_word_embeddings = False
    return config


_MODEL_CLASS = {QwenFamily.QWEN2_VL: Qwen2VLForConditionalGeneration,
                QwenFamily.QWEN2_5_VL: Qwen2_5_VLForConditionalGeneration,
                QwenFamily.QWEN3_VL: Qwen3VLForConditionalGeneration}


def build_qwen_vl(family: QwenFamily | str, out: Path, *, seed: int = 0, vision_overrides: dict | None = None) -> Path:
    """Write the tiny checkpoint of ``family`` to ``out``; seconds on a CPU. ``vision_overrides``: vision-config
    fields to replace (``bench/encode_pricing.py`` widens the tower to a real model's width)."""
    family = QwenFamily(family)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    image_processor = build_image_processor(family)
    config = build_config(family, tokenizer, vision_overrides)
    model = _MODEL_CLASS[family](config).eval()
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATES[family.value])
    _write_processor_config(out, family, image_processor)
    return out


def _write_processor_config(out: Path, family: QwenFamily, image_processor: Qwen2VLImageProcessorPil) -> None:
    """``processor_config.json`` as transformers 5 saves the real processor (whose video part we cannot build)."""
    image = image_processor.to_dict()
    image["image_processor_type"] = "Qwen2VLImageProcessor"
    video = {key: image[key] for key in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std")}
    video.update(video_processor_type=_VIDEO_PROCESSOR_CLASS[family],
                 size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, fps=2.0, do_sample_frames=False)
    config = {"image_processor": image, "video_processor": video, "processor_class": _PROCESSOR_CLASS[family]}
    (out / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
