"""LLaVA-style families (LLaVA, InternVL): one fixed-size feature tensor per image, 1-D RoPE.

The vision tower and projector run through the model's ``get_image_features``;
``pooler_output`` is one tensor per image (or ``[images, tokens, hidden]``).
Storage layout: the features themselves, ``[tokens, hidden]`` (unchanged from
before families existed, so existing encoder-cache entries stay valid).
Positions are the sequence index, so decode needs no per-sequence metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor

from .base import EmbeddingFormatError, ImageEmbedding, ModelFamily, PositionKind


class LlavaStyleFamily(ModelFamily):
    name = "LLaVA-style"
    position_kind = PositionKind.ONE_D

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return AutoProcessor.from_pretrained(str(path))

    def encode(self, model: Any, processor: Any, images: Sequence[Image.Image], dtype: torch.dtype,
               device: torch.device) -> list[ImageEmbedding]:
        pixel_values = processor.image_processor(list(images), return_tensors="pt")["pixel_values"]
        return self.encode_pixels(model, pixel_values.to(device, dtype))

    def encode_pixels(self, model: Any, pixel_values: torch.Tensor) -> list[ImageEmbedding]:
        """The tower on already preprocessed ``pixel_values`` ``[images, C, H, W]``."""
        features = model.get_image_features(pixel_values=pixel_values, return_dict=True).pooler_output
        return [ImageEmbedding(f.reshape(-1, f.shape[-1]).contiguous()) for f in features]

    def image_tokens(self, processor: Any, width: int, height: int) -> int:
        counts = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
        return int(counts["num_image_tokens"][0])

    def to_tensor(self, embedding: ImageEmbedding) -> torch.Tensor:
        return embedding.features

    def from_tensor(self, tensor: torch.Tensor) -> ImageEmbedding:
        if tensor.ndim != 2 or tensor.shape[-1] != self.hidden_size:
            raise EmbeddingFormatError(
                f"{self.name} image embedding must be [tokens, {self.hidden_size}], got {list(tensor.shape)}")
        return ImageEmbedding(tensor)
