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

**OneVision's multi-image form** (the layout variant ``MULTI_IMAGE``). Given one
conversation's images as one sample (``batch_num_images`` > 1, what
``apply_chat_template`` passes), the OneVision processor pads each image of a
multi-image prompt to a square (in the image mean's colour) and resizes it to one
tile, and the model keeps that tile's features plus one ``image_newline`` row:
``num_image_tokens + 1`` placeholders whatever the image's size (the processor's
``replace_image_token``). A prompt with one image tiles it as above. So an image's
encoding depends on its prompt's image count: ``layout_variant(n)`` is
``MULTI_IMAGE`` for ``n > 1``, and the variant is in the image's cache key (one
picture used alone and in a multi-image prompt is two cache entries) and on every
message naming it (``ImageRef.layout_variant``). ``encode_variants`` runs one
image-processor call and one ``get_image_features`` call as HF's batch of
samples: each single-form image a sample of its own, the multi-form images one
sample (a lone multi-form image goes with a copy of itself, whose output is
dropped: a sample of one image is the single form). Each multi-form image's
encoding is its own (square padding, one tile, its newline row), so the entry
serves that picture in any multi-image prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor, LlavaOnevisionProcessor

from .base import SINGLE_LAYOUT, ImageEmbedding
from .image_only_processor import image_only_class, load_image_only_processor
from .llava import LlavaStyleFamily


class LlavaNextFamily(LlavaStyleFamily):
    name = "LLaVA-NeXT"

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return AutoProcessor.from_pretrained(str(path))

    def encode(self, model: Any, processor: Any, images: Sequence[Image.Image], dtype: torch.dtype,
               device: torch.device) -> list[ImageEmbedding]:
        # a flat list: every image tiled (the single-image form; OneVision's other form: encode_variants)
        pixels = processor.image_processor(list(images), return_tensors="pt")
        out = model.get_image_features(pixel_values=pixels["pixel_values"].to(device, dtype),
                                       image_sizes=pixels["image_sizes"].to(device), return_dict=True)
        return [ImageEmbedding(f.contiguous()) for f in out.pooler_output]

    def encode_pixels(self, model: Any, pixel_values: torch.Tensor) -> list[ImageEmbedding]:
        raise NotImplementedError(f"{self.name} images need their sizes (tiles): use encode()")


MULTI_IMAGE = "multi-image"   # an image of a prompt with several: padded to a square, one tile


class LlavaOnevisionFamily(LlavaNextFamily):
    name = "LLaVA-OneVision"
    processor_class = image_only_class(LlavaOnevisionProcessor)
    layout_variants = (SINGLE_LAYOUT, MULTI_IMAGE)

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

    def layout_variant(self, n_images: int) -> str:
        return MULTI_IMAGE if n_images > 1 else SINGLE_LAYOUT

    def encode_variants(self, model: Any, processor: Any, images: Sequence[Image.Image], variants: Sequence[str],
                        dtype: torch.dtype, device: torch.device) -> list[ImageEmbedding]:
        single = [i for i, v in enumerate(variants) if v == SINGLE_LAYOUT]
        multi = [i for i, v in enumerate(variants) if v == MULTI_IMAGE]
        samples = [[images[i]] for i in single]
        if multi:   # one sample of several images: each padded to a square, one tile
            group = [images[i] for i in multi]
            samples.append(group if len(group) > 1 else group * 2)
        pixels = processor.image_processor(samples, return_tensors="pt")
        out = model.get_image_features(pixel_values=pixels["pixel_values"].to(device, dtype),
                                       image_sizes=pixels["image_sizes"].to(device),
                                       batch_num_images=pixels["batch_num_images"], return_dict=True)
        embeddings: list[ImageEmbedding | None] = [None] * len(images)
        for i, features in zip(single + multi, out.pooler_output):   # a lone multi-form image's copy: left over
            embeddings[i] = ImageEmbedding(features.contiguous())
        return embeddings

    def variant_image_tokens(self, processor: Any, width: int, height: int, variant: str) -> int:
        if variant == SINGLE_LAYOUT:
            return self.image_tokens(processor, width, height)
        # the processor's rule for an image of a multi-image sample (it does not read the image's size)
        return processor.replace_image_token({"batch_num_images": [2]}, image_idx=0).count(processor.image_token)
