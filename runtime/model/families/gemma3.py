"""Gemma 3: one fixed-size SigLIP image per placeholder run, bidirectional inside it, 1-D RoPE.

The Gemma 3 image processor resizes every image to the tower's square size (pan
and scan off: ``supported_models`` refuses it), so an image is always
``mm_tokens_per_image`` placeholders between ``<start_of_image>`` and
``<end_of_image>``; the model's own ``get_image_features`` (SigLIP, average
pooling, soft-embedding norm, projection) gives ``[images, tokens, hidden]``.
Storage layout: the LLaVA-style ``[tokens, hidden]``.

What the split adds for it (``bidirectional_images``): the model's
``token_type_ids`` mask lets each image token attend to every token of its own
image, in both directions (full-attention layers: causal OR same image; sliding
layers: that AND the window, transformers' ``create_masks_for_vision_model``).
``VLMAdapter.prepare`` records the placeholder runs, the chunker never cuts one
(``PreparedPrompt.chunk_end``) and the attention groups widen each image query's
visible keys to its run's end (``attention_groups``). Text stays causal; decode
tokens are text. Gemma's sliding-window layers are the layout's
(``KVLayout.sliding_layers``), its norms and embedding scale run in the model's
own layers, and its final logit soft-capping (when set) in ``forward_packed``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoProcessor

from .llava import LlavaStyleFamily


class Gemma3Family(LlavaStyleFamily):
    name = "Gemma 3"
    bidirectional_images = True

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return AutoProcessor.from_pretrained(str(path))   # Gemma3Processor: no video processor

    def image_tokens(self, processor: Any, width: int, height: int) -> int:
        return int(processor.image_seq_length)

    def longest_image_span(self, processor: Any) -> int:
        return int(processor.image_seq_length)
