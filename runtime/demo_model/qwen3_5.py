"""Tiny random-weight Qwen3.5 checkpoint built here, for tests and the hybrid-state bench.

Qwen3.5 is a hybrid decoder: Gated DeltaNet linear-attention layers (a fixed-size
recurrent state and a short convolution state per sequence) interleaved with
full-attention layers (ordinary KV), behind the Qwen3-VL-style vision tower and
M-RoPE. ``build_qwen3_5(out)`` writes a standard Hugging Face checkpoint with the
real ``Qwen3_5ForConditionalGeneration`` class, the byte-level BPE tokenizer of
the Qwen-VL test checkpoints (``qwen_vl.build_tokenizer``), the real image
processor and the real processor class (``Qwen3VLProcessor``, which the
``qwen3_5`` model type maps to) and the Qwen3-VL chat template.

``all_attention=True`` writes the same model with every layer full attention
(the same sizes otherwise): the bench's comparison for handoff bytes.
``full_attention_interval`` (2 here: linear, full, ...) is 4 in the released
checkpoints (three linear layers, then one full).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from .qwen_templates import CHAT_TEMPLATES
from .qwen_vl import HIDDEN, INIT_RANGE, MERGE_SIZE, PATCH_SIZE, QwenFamily, _write_processor_config, build_image_processor, \
    build_tokenizer

FAMILY = "qwen3_5"
LAYERS = 4                 # linear, full, linear, full
FULL_ATTENTION_INTERVAL = 2


def build_config(tokenizer, *, layers: int = LAYERS, all_attention: bool = False, max_positions: int = 2048,
                 full_attention_interval: int = FULL_ATTENTION_INTERVAL) -> Qwen3_5Config:
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    layer_types = ["full_attention" if all_attention or (i + 1) % full_attention_interval == 0 else "linear_attention"
                   for i in range(layers)]
    text = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=max_positions,
                initializer_range=INIT_RANGE, rms_norm_eps=1e-6, bos_token_id=None, layer_types=layer_types,
                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=2, num_heads=2, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
                  hidden_size=32, intermediate_size=64, out_hidden_size=HIDDEN, num_position_embeddings=64,
                  initializer_range=INIT_RANGE)
    config = Qwen3_5Config(text_config=text, vision_config=vision, **ids)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.tie_word_embeddings = False
    return config


def build_qwen3_5(family: str, out: Path, *, seed: int = 0, all_attention: bool = False, layers: int = LAYERS,
                  max_positions: int = 2048, full_attention_interval: int = FULL_ATTENTION_INTERVAL) -> Path:
    """Write the tiny checkpoint to ``out``; seconds on a CPU (``family`` is ``qwen3_5``, as the CLI passes it)."""
    if family != FAMILY:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    image_processor = build_image_processor(QwenFamily.QWEN3_VL)
    model = Qwen3_5ForConditionalGeneration(
        build_config(tokenizer, layers=layers, all_attention=all_attention, max_positions=max_positions,
                     full_attention_interval=full_attention_interval)).eval()
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATES[QwenFamily.QWEN3_VL.value])
    _write_processor_config(out, QwenFamily.QWEN3_VL, image_processor)   # Qwen3VLProcessor, as the real checkpoint
    return out
