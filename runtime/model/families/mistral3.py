"""Mistral 3 (Pixtral tower): variable-size image features, 1-D RoPE.

The Pixtral image processor resizes an image to fit ``size.longest_edge`` in
multiples of the patch size (no tiles); the model's own
``get_image_features(pixel_values, image_sizes)`` returns, per image, its
``(h / (patch * merge)) * (w / (patch * merge))`` merged patch rows. In the
prompt each row of ``[IMG]`` placeholders ends with ``[IMG_BREAK]`` and the last
with ``[IMG_END]`` (ordinary tokens, embedded as text), so the stored embedding
``[tokens, hidden]`` is exactly what the ``[IMG]`` placeholders take.

The checkpoint's processor, ``PixtralProcessor``, requires torchvision, which has
no CPU build beside the torch used here: ``supported_models`` refuses a Mistral 3
checkpoint at start-up on a host without it (one line naming the reason). The
language side (the splice, chunked prefill, decode) is tested with embeddings
from the model's own ``get_image_features`` (``tests/test_mistral3_language_side.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor
from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

from .base import ImageEmbedding
from .llava import LlavaStyleFamily


class Mistral3Family(LlavaStyleFamily):
    name = "Mistral 3"

    def __init__(self, config: Any, model: Any = None):
        super().__init__(config, model)
        self.merge = int(config.spatial_merge_size)

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return AutoProcessor.from_pretrained(str(path))   # PixtralProcessor: needs torchvision

    def encode(self, model: Any, processor: Any, images: Sequence[Image.Image], dtype: torch.dtype,
               device: torch.device) -> list[ImageEmbedding]:
        pixels = processor.image_processor(list(images), return_tensors="pt")
        out = model.get_image_features(pixel_values=pixels["pixel_values"].to(device, dtype),
                                       image_sizes=pixels["image_sizes"].to(device), return_dict=True)
        return [ImageEmbedding(f.contiguous()) for f in out.pooler_output]

    def encode_pixels(self, model: Any, pixel_values: torch.Tensor) -> list[ImageEmbedding]:
        raise NotImplementedError(f"{self.name} images need their sizes: use encode()")

    def image_rows(self, processor: Any, width: int, height: int) -> tuple[int, int]:
        """``(rows, columns)`` of ``[IMG]`` placeholders: the image processor's own resize rule."""
        ip = processor.image_processor
        patch = ip.patch_size["height"] if isinstance(ip.patch_size, dict) else int(ip.patch_size)
        blank = Image.new("RGB", (width, height))
        h, w = get_resize_output_image_size(blank, size=(ip.size["longest_edge"],) * 2, patch_size=(patch, patch))
        step = patch * self.merge
        return h // step, w // step

    def image_tokens(self, processor: Any, width: int, height: int) -> int:
        rows, columns = self.image_rows(processor, width, height)
        return rows * columns
