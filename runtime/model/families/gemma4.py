"""Gemma 4: variable-size images (aspect ratio kept, a soft-token budget), bidirectional on sliding layers, 1-D RoPE.

The Gemma 4 image processor resizes an image, keeping its aspect ratio, to the
largest size whose sides are multiples of ``pooling_kernel_size * patch_size``
and that fits ``max_soft_tokens * pooling_kernel_size**2`` patches; the tower
pools each ``k x k`` patch square into one soft token. So an image is
``boi`` + a size-dependent number of ``<|image|>`` placeholders (at most
``max_soft_tokens``; any size fits: the resize never fails) + ``eoi``, and
``image_tokens`` is the processor's own rule
(``Gemma4Processor._get_num_multimodal_tokens``, the same
``get_aspect_ratio_preserving_size`` the image processor resizes with).
``encode`` runs the model's own ``get_image_features(pixel_values,
image_position_ids)`` (patch embedder, vision encoder, position-aware pooling,
the embedder's norm and projection) and keeps its per-image split: one
``[tokens, hidden]`` tensor per image, the rows the model splices at the image's
placeholders. Storage layout: that tensor (the LLaVA layout).

The processor is the real ``Gemma4Processor`` without its video processor
(``ImageOnlyGemma4Processor``): in transformers 5.23 ``Gemma4VideoProcessor``
cannot even be imported without torchvision. It is assembled from the image
processor (its PIL backend), the tokenizer, the audio feature extractor (the
class takes one; numpy only) and the scalar entries of ``processor_config.json``.

What differs from Gemma 3, for the language side (docs/models.md):

* bidirectional image spans (``use_bidirectional_attention == "vision"``) apply on
  the sliding-window layers only; the full-attention layers stay causal
  (``bidirectional_layer_types``; transformers' ``create_masks_for_vision_model``);
  with the setting unset, images are causal everywhere (``bidirectional_images`` False);
* per-layer input embeddings: the token-identity part is looked up with every
  image / audio / video placeholder replaced by the pad token
  (``per_layer_token_ids``), the context part is projected from the spliced
  embeddings;
* KV sharing between layers, two head sizes and KV-head counts (sliding vs full),
  attention scaling 1.0: all in the adapter and the KV layout.

Prompts holding audio or video placeholders are refused per request (no audio or
video tower runs here); what the split cannot serve is refused at start-up by
``supported_models``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import Gemma4Processor, ProcessorMixin

from .base import ImageEmbedding
from .image_only_processor import image_only_class, load_image_only_processor
from .llava import LlavaStyleFamily


class _WithoutVideo(ProcessorMixin):
    """Sits between ``Gemma4Processor`` and ``ProcessorMixin`` in the MRO: ``Gemma4Processor.__init__`` passes
    ``video_processor`` by keyword, which the image-only attribute list would reject; it is ``None`` here."""

    def __init__(self, *args, video_processor: Any = None, **kwargs):
        if video_processor is not None:
            raise ValueError("the image-only Gemma 4 processor takes no video processor")
        super().__init__(*args, **kwargs)


class ImageOnlyGemma4Processor(image_only_class(Gemma4Processor), _WithoutVideo):
    """``Gemma4Processor`` without its video processor: text, images (and the audio feature extractor it
    takes, unused: audio prompts are refused). Every method that runs is ``Gemma4Processor``'s own."""


class Gemma4Family(LlavaStyleFamily):
    name = "Gemma 4"
    processor_class = ImageOnlyGemma4Processor
    bidirectional_layer_types = frozenset({"sliding_attention"})

    def __init__(self, config: Any, model: Any = None):
        super().__init__(config, model)
        text = config.get_text_config()
        self.bidirectional_images = text.use_bidirectional_attention == "vision"
        self.pad_token_id = int(text.pad_token_id)
        self.video_token_id = _optional_id(config, "video_token_id")
        self.audio_token_id = _optional_id(config, "audio_token_id")
        # what Gemma4Model.get_placeholder_mask marks (multimodal_mask): replaced by pad for the per-layer inputs
        self.placeholder_ids = frozenset(t for t in (self.image_token_id, self.video_token_id, self.audio_token_id)
                                         if t is not None)

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return load_image_only_processor(path, cls.processor_class)

    # -- vision ---------------------------------------------------------------------
    def encode(self, model: Any, processor: Any, images: Sequence[Image.Image], dtype: torch.dtype,
               device: torch.device) -> list[ImageEmbedding]:
        pixels = processor.image_processor(list(images), return_tensors="pt")
        out = model.get_image_features(pixel_values=pixels["pixel_values"].to(device, dtype),
                                       image_position_ids=pixels["image_position_ids"].to(device), return_dict=True)
        features = list(out.pooler_output)
        expected = [int(n) for n in pixels["num_soft_tokens_per_image"]]
        if [f.shape[0] for f in features] != expected:   # the tower's split disagrees with the processor's count
            raise RuntimeError(f"{self.name} tower gave {[f.shape[0] for f in features]} soft tokens for images the "
                               f"processor expands to {expected}")
        return [ImageEmbedding(f.contiguous()) for f in features]

    def encode_pixels(self, model: Any, pixel_values: torch.Tensor) -> list[ImageEmbedding]:
        raise NotImplementedError(f"{self.name} images need their patch positions: use encode()")

    def longest_image_span(self, processor: Any) -> int:
        """The most placeholders one image can expand to: the image processor's ``max_soft_tokens``."""
        return int(processor.image_processor.max_soft_tokens)

    # -- the prompt -----------------------------------------------------------------
    def check_placeholders(self, token_ids: Sequence[int], images: Sequence[ImageEmbedding]) -> str | None:
        for kind, token in (("video", self.video_token_id), ("audio", self.audio_token_id)):
            if token is not None and token in token_ids:
                return f"{kind} inputs are not supported (the prompt holds {kind} placeholder tokens)"
        return super().check_placeholders(token_ids, images)

    def per_layer_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The ids the per-layer input embedding looks up: every image / video / audio placeholder is the pad
        token (``Gemma4Model.forward``: ``llm_input_ids`` with ``multimodal_mask`` set to ``pad_token_id``)."""
        placeholders, pad = self.placeholder_ids, self.pad_token_id
        return [pad if t in placeholders else int(t) for t in token_ids]


def kv_sharing(text_config: Any) -> dict[int, int]:
    """Each KV-sharing layer -> the layer whose K/V it attends over (``Gemma4TextConfig.kv_sharing_modes``).

    The last ``num_kv_shared_layers`` layers ("reuse") compute no K/V: each takes, through the
    forward's ``shared_kv_states[layer_type]``, the K/V of the last earlier layer of its own type
    (that layer is "store"), with its own query, window and mask. Empty when nothing is shared.
    """
    from runtime.model.decoder_kv import kv_producers

    return kv_producers(text_config, list(range(int(text_config.num_hidden_layers))))


def _optional_id(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return None if value is None else int(value)
