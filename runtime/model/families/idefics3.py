"""Image-splitting families (Idefics3, SmolVLM): sub-images with row/column tokens, 1-D RoPE.

The image processor splits an image into a grid of sub-images of the tower's
size (plus one global image, when it splits at all); the processor writes, per
sub-image, ``<fake_token_around_image><row_R_col_C>`` then ``image_seq_len``
``<image>`` placeholders (the global one ``<global-img>``), so one image's
placeholders are several runs separated by ordinary text tokens. The model's
own ``get_image_features(pixel_values, pixel_attention_mask)`` runs the tower
and the pixel-shuffle connector on the sub-images and returns one tensor per
batch entry; the encoder hands the image processor one entry per image
(``[[image], [image], ...]``), so the stored embedding of an image is its
sub-images' features in order, ``[sub_images * image_seq_len, hidden]`` —
exactly what its placeholders take, in the order the model's ``inputs_merger``
places them. The placeholder count is the image processor's
``get_number_of_image_patches`` times ``image_seq_len``; the split settings
(``do_image_splitting``, ``max_image_size``, ``size``) are in the
preprocessing digest, so the cache key follows them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor, ProcessorMixin, SmolVLMProcessor

from .base import ImageEmbedding
from .image_only_processor import image_only_class, load_image_only_processor
from .llava import LlavaStyleFamily


class Idefics3Family(LlavaStyleFamily):
    name = "Idefics3"

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return AutoProcessor.from_pretrained(str(path))

    def encode(self, model: Any, processor: Any, images: Sequence[Image.Image], dtype: torch.dtype,
               device: torch.device) -> list[ImageEmbedding]:
        pixels = processor.image_processor([[im] for im in images], return_tensors="pt")   # one entry per image
        out = model.get_image_features(pixel_values=pixels["pixel_values"].to(device, dtype),
                                       pixel_attention_mask=pixels["pixel_attention_mask"].to(device),
                                       return_dict=True)
        return [ImageEmbedding(f.contiguous()) for f in out.pooler_output]

    def encode_pixels(self, model: Any, pixel_values: torch.Tensor) -> list[ImageEmbedding]:
        raise NotImplementedError(f"{self.name} images are split by size: use encode()")

    def image_tokens(self, processor: Any, width: int, height: int) -> int:
        sub_images, _, _ = processor.image_processor.get_number_of_image_patches(height, width)
        return int(sub_images) * int(processor.image_seq_len)


class ImageOnlySmolVLMProcessor(image_only_class(SmolVLMProcessor)):
    """SmolVLM's processor without its video processor. Its ``apply_chat_template`` only adds the video
    processor's frame defaults before the generic one; without videos (refused) the generic one is the same."""

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)


class SmolVLMFamily(Idefics3Family):
    name = "SmolVLM"
    processor_class = ImageOnlySmolVLMProcessor

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return load_image_only_processor(path, cls.processor_class)
