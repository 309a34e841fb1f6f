"""Any-resolution LLaVA families (LLaVA-NeXT, LLaVA-OneVision): tiles and newline tokens, 1-D RoPE.

An image is resized to the best of the checkpoint's ``image_grid_pinpoints``
and cut into tiles of the tower's size, plus one base tile of the whole image.
The model's own ``get_image_features(pixel_values, image_sizes)`` runs the
tower on all tiles and packs them (``pack_image_features``): the base tile's
features, then the tile grid unpadded to the image's aspect ratio with one
``image_newline`` row after each row of features (OneVision also down-samples
a grid above ``vision_aspect_ratio``'s ``anyres_max_N`` tiles). The number of
placeholder tokens is the processor's ``_get_number_of_features`` rule, so it
varies with the image's size; the encoder output of one image is exactly that
many rows ``[tokens, hidden]``, and the cache key covers the rule's inputs
(the pinpoints and tile size are in the image processor's settings, the
preprocessing digest; ``vision_aspect_ratio`` is in ``config.json``, the
model fingerprint).

**OneVision's multi-image rule is not served.** Given one image list per
conversation (``batch_num_images`` > 1, as ``apply_chat_template`` passes them),
the OneVision processor pads each image of a multi-image prompt to a square and
uses one tile of it; given a flat list it tiles every image. epd hands the
processor a flat list (the gateway, the encoder, the tests' ``generate()``
references alike), so every image is tiled, whatever the prompt: one encoder
output and one cache entry per image. Serving the square-padded form would need
the prompt's image count in the cache key and on the wire (left for later).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor, LlavaOnevisionProcessor

from .base import ImageEmbedding
from .image_only_processor import image_only_class, load_image_only_processor
from .llava import LlavaStyleFamily


class LlavaNextFamily(LlavaStyleFamily):
    name = "LLaVA-NeXT"

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return AutoProcessor.from_pretrained(str(path))

    def encode(self, model: Any, processor: Any, images: Sequence[Image.Image], dtype: torch.dtype,
               device: torch.device) -> list[ImageEmbedding]:
        # a flat list: every image tiled (its stored form, whatever prompt it is used in)
        pixels = processor.image_processor(list(images), return_tensors="pt")
        out = model.get_image_features(pixel_values=pixels["pixel_values"].to(device, dtype),
                                       image_sizes=pixels["image_sizes"].to(device), return_dict=True)
        return [ImageEmbedding(f.contiguous()) for f in out.pooler_output]

    def encode_pixels(self, model: Any, pixel_values: torch.Tensor) -> list[ImageEmbedding]:
        raise NotImplementedError(f"{self.name} images need their sizes (tiles): use encode()")


class LlavaOnevisionFamily(LlavaNextFamily):
    name = "LLaVA-OneVision"
    processor_class = image_only_class(LlavaOnevisionProcessor)

    def __init__(self, config: Any, model: Any = None):
        super().__init__(config, model)
        self.video_token_id = int(config.video_token_id)

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return load_image_only_processor(path, cls.processor_class)

    def check_placeholders(self, token_ids: Sequence[int], images: Sequence[ImageEmbedding]) -> str | None:
        if self.video_token_id in token_ids:
            return "video inputs are not supported (the prompt holds video placeholder tokens)"
        return super().check_placeholders(token_ids, images)
