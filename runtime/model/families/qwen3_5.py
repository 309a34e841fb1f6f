"""Qwen3.5: the Qwen3-VL vision side and M-RoPE, with a hybrid decoder.

The decoder interleaves Gated DeltaNet linear-attention layers with full-attention
layers (``text_config.layer_types``). Only the full-attention layers keep KV: the
KV pool holds those layers alone (``kv_layer_indices``; the pool's layer ``i`` is
the ``i``-th full-attention layer). Each linear-attention layer keeps, per
sequence, a recurrent state ``[linear_num_value_heads, linear_key_head_dim,
linear_value_head_dim]`` (float32) and a convolution state ``[conv_dim,
linear_conv_kernel_dim]`` (the model's dtype, ``conv_dim = 2 * key_dim +
value_dim``): the ``state_layout``, held in a state slot
(``runtime/model/state_slots.py``) and run through ``runtime/model/linear_attention.py``.

Vision: the tower returns projected features and no DeepStack levels; the
processor is ``Qwen3VLProcessor`` (what ``qwen3_5`` maps to), the positions are
the model's own ``get_rope_index``. The storage layout is the Qwen-VL one with
no extra levels: ``[1, t, h // merge, w // merge, hidden]``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3_5Model

from runtime.model.state_slots import StateLayout

from .qwen_vl import Qwen3VLFamily, QwenVLFamily

LINEAR = "linear_attention"
FULL = "full_attention"


class Qwen3_5Family(QwenVLFamily):
    name = "Qwen3.5"
    processor_class = Qwen3VLFamily.processor_class   # the real checkpoint's Qwen3VLProcessor (one class per process)
    model_class = Qwen3_5Model

    def _layer_types(self) -> list[str]:
        return list(self.config.get_text_config().layer_types)

    def kv_layer_indices(self) -> list[int]:
        return [i for i, t in enumerate(self._layer_types()) if t == FULL]

    def linear_layer_indices(self) -> list[int]:
        return [i for i, t in enumerate(self._layer_types()) if t == LINEAR]

    def state_layout(self, dtype: torch.dtype) -> StateLayout | None:
        layers = self.linear_layer_indices()
        if not layers:
            return None
        text: Any = self.config.get_text_config()
        key_dim = text.linear_num_key_heads * text.linear_key_head_dim
        value_dim = text.linear_num_value_heads * text.linear_value_head_dim
        return StateLayout(
            layers=tuple(layers),
            recurrent_shape=(int(text.linear_num_value_heads), int(text.linear_key_head_dim), int(text.linear_value_head_dim)),
            conv_shape=(int(2 * key_dim + value_dim), int(text.linear_conv_kernel_dim)),
            recurrent_dtype=torch.float32,
            conv_dtype=dtype,
        )
