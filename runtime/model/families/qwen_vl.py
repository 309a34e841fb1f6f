"""The Qwen-VL families: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (M-RoPE, dynamic resolution, DeepStack).

* **Dynamic resolution.** The image processor resizes each image to a multiple
  of ``patch_size * merge_size`` within ``[min_pixels, max_pixels]``
  (``smart_resize``); its vision grid ``(1, h, w)`` in patches gives
  ``h * w / merge_size**2`` placeholder tokens.
* **M-RoPE.** Position ids are ``[3, T]`` (temporal, height, width), computed by
  the model's own ``get_rope_index`` from the token ids and each image's grid.
  Text after an image continues from the image's largest position + 1, so a
  sequence's positions run ``rope_delta`` ahead of (usually behind) its index;
  decode at sequence position ``p`` uses ``p + rope_delta`` on all three axes.
* **DeepStack (Qwen3-VL).** The vision tower also returns one feature level per
  ``deepstack_visual_indexes`` entry; level ``i`` is added to decoder layer ``i``'s
  output at the image positions (the model's ``_deepstack_process``).

Storage layout of one image (``to_tensor``)::

    [1 + levels, t, h // merge, w // merge, hidden]

level 0 the projected features, levels 1.. the DeepStack features (none for
Qwen2/2.5-VL); tokens in raster order, which is the order of the placeholders.
The grid is the tensor's shape, so a cache entry carries it with no extra field.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import (
    Qwen2_5_VLModel,
    Qwen2_5_VLProcessor,
    Qwen2VLModel,
    Qwen2VLProcessor,
    Qwen3VLModel,
    Qwen3VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from .base import EmbeddingFormatError, ImageEmbedding, ModelFamily, PositionKind, PositionPlan, placeholder_runs
from .image_only_processor import image_only_class, load_image_only_processor

MAX_ASPECT_RATIO = 200   # smart_resize's own limit


class _RopeIndexOwner:
    """The model class's own ``get_rope_index`` bound to a config, for processes without weights (the gateway).

    ``get_rope_index`` and ``get_vision_position_ids`` read only ``self.config``; this
    calls the class's functions unchanged, so positions agree with the loaded model's.
    """

    def __init__(self, config: Any, model_class: type):
        self.config = config
        self._model_class = model_class

    def get_vision_position_ids(self, *args, **kwargs):
        return self._model_class.get_vision_position_ids(self, *args, **kwargs)

    def get_rope_index(self, *args, **kwargs):
        return self._model_class.get_rope_index(self, *args, **kwargs)


class QwenVLFamily(ModelFamily):
    name = "Qwen2-VL"
    position_kind = PositionKind.MROPE
    processor_class: type = image_only_class(Qwen2VLProcessor)
    model_class: type = Qwen2VLModel

    def __init__(self, config: Any, model: Any = None):
        super().__init__(config)
        vision = config.vision_config
        self.merge_size = int(vision.spatial_merge_size)
        self.video_token_id = int(config.video_token_id)
        self.deepstack_levels = len(getattr(vision, "deepstack_visual_indexes", None) or [])
        # the loaded model's own method when there is one; the class's function on the config otherwise
        self._rope = model.model if model is not None else _RopeIndexOwner(config, self.model_class)

    @classmethod
    def load_processor(cls, path: str | Path) -> Any:
        return load_image_only_processor(path, cls.processor_class)

    # -- vision ---------------------------------------------------------------------
    def encode(self, model: Any, processor: Any, images: Sequence[Image.Image], dtype: torch.dtype,
               device: torch.device) -> list[ImageEmbedding]:
        pixels = processor.image_processor(list(images), return_tensors="pt")
        grids = pixels["image_grid_thw"]
        out = model.get_image_features(pixel_values=pixels["pixel_values"].to(device, dtype),
                                       image_grid_thw=grids.to(device), return_dict=True)
        levels = self._levels(out)
        embeddings = []
        for i, features in enumerate(out.pooler_output):
            deepstack = torch.stack([level[i] for level in levels]) if levels else None
            grid = tuple(int(g) for g in grids[i])
            embeddings.append(ImageEmbedding(features.contiguous(), grid, deepstack))
        return embeddings

    def _levels(self, out: Any) -> list[Sequence[torch.Tensor]]:
        return []

    def check_image(self, width: int, height: int) -> str | None:
        if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            return f"image of {width}x{height} pixels has an aspect ratio above {MAX_ASPECT_RATIO}"
        return None

    def image_grid(self, processor: Any, width: int, height: int) -> tuple[int, int, int]:
        """The image processor's own resize rule and its current pixel limits."""
        ip = processor.image_processor
        h, w = smart_resize(height, width, factor=ip.patch_size * ip.merge_size,
                            min_pixels=ip.size["shortest_edge"], max_pixels=ip.size["longest_edge"])
        return 1, h // ip.patch_size, w // ip.patch_size

    def image_tokens(self, processor: Any, width: int, height: int) -> int:
        t, h, w = self.image_grid(processor, width, height)
        return t * h * w // processor.image_processor.merge_size ** 2

    # -- storage layout -------------------------------------------------------------
    def to_tensor(self, embedding: ImageEmbedding) -> torch.Tensor:
        t, h, w = embedding.grid
        levels = [embedding.features[None]]
        if embedding.deepstack is not None:
            levels.append(embedding.deepstack)
        stacked = torch.cat(levels) if len(levels) > 1 else levels[0]
        return stacked.reshape(stacked.shape[0], t, h // self.merge_size, w // self.merge_size, stacked.shape[-1])

    def from_tensor(self, tensor: torch.Tensor) -> ImageEmbedding:
        expected = f"[{1 + self.deepstack_levels}, t, h, w, {self.hidden_size}]"
        if tensor.ndim != 5 or tensor.shape[0] != 1 + self.deepstack_levels or tensor.shape[-1] != self.hidden_size:
            raise EmbeddingFormatError(f"{self.name} image embedding must be {expected}, got {list(tensor.shape)}")
        levels, t, h, w, hidden = tensor.shape
        flat = tensor.reshape(levels, t * h * w, hidden)
        grid = (int(t), int(h) * self.merge_size, int(w) * self.merge_size)
        return ImageEmbedding(flat[0], grid, flat[1:] if self.deepstack_levels else None)

    # -- the prompt -----------------------------------------------------------------
    def check_placeholders(self, token_ids: Sequence[int], images: Sequence[ImageEmbedding]) -> str | None:
        if self.video_token_id in token_ids:
            return "video inputs are not supported (the prompt holds video placeholder tokens)"
        runs = placeholder_runs(token_ids, self.image_token_id)
        wanted = [e.tokens for e in images]
        if runs != wanted:
            return (f"prompt has {sum(runs)} image placeholder tokens in {len(runs)} runs {runs} but "
                    f"{len(images)} images give {sum(wanted)} tokens {wanted}")
        return None

    def position_plan(self, token_ids: Sequence[int], grids: Sequence[tuple[int, int, int] | None]) -> PositionPlan:
        if any(g is None or len(g) != 3 for g in grids):
            raise ValueError(f"{self.name} positions need every image's (t, h, w) grid, got {list(grids)}")
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        token_types = (ids == self.image_token_id).int()
        image_grid_thw = torch.tensor([list(g) for g in grids], dtype=torch.long) if grids else None
        positions, delta = self._rope.get_rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=image_grid_thw)
        return PositionPlan(positions[:, 0].cpu(), int(delta.reshape(-1)[0]))


class Qwen25VLFamily(QwenVLFamily):
    name = "Qwen2.5-VL"
    processor_class = image_only_class(Qwen2_5_VLProcessor)
    model_class = Qwen2_5_VLModel


class Qwen3VLFamily(QwenVLFamily):
    name = "Qwen3-VL"
    processor_class = image_only_class(Qwen3VLProcessor)
    model_class = Qwen3VLModel

    def _levels(self, out: Any) -> list[Sequence[torch.Tensor]]:
        return list(out.deepstack_features)
