"""The interface a model family implements: everything family-specific the split needs.

``VLMAdapter`` is generic: it splices image features at the family's image token,
runs the decoder layers with attention redirected to the KV pool, and asks the
family (one ``ModelFamily`` per loaded model) for the rest:

* ``load_processor(path)``: the checkpoint's processor (tokenizer, image
  processor, chat template) as the gateway and the workers use it;
* ``encode(images)``: vision tower + projector for a batch of images, one
  ``ImageEmbedding`` per image (features, and what the language side needs:
  the image's grid for M-RoPE, DeepStack level features);
* ``to_tensor`` / ``from_tensor``: the embedding's one-tensor storage layout
  (what the encoder cache holds, see ``runtime.model.tensor_bytes``); the
  layout is stable and checked on the way back;
* ``image_grid`` / ``image_tokens``: the processor's real rule for how many
  placeholder tokens an image of a given size expands to (dynamic resolution);
* ``layout_variant(n_images)``: the **layout variant** of every image of a prompt
  holding ``n_images`` images, for the families whose processor encodes an image
  differently by its prompt's image count (LLaVA-OneVision: one square tile per
  image of a multi-image prompt). ``""`` (``SINGLE_LAYOUT``, every other family's
  only variant) is the image's form on its own; ``encode_variants`` and
  ``variant_image_tokens`` take the variant of each image. The variant is part of
  the image's cache key and travels on every message naming the image;
* ``check_placeholders``: that the prompt's placeholders match the images;
* ``position_plan(token_ids, grids)``: position ids of a prompt from its token ids
  and each image's grid (nothing else: the gateway, which has no weights and no
  embeddings, computes the same plan), once where the prompt is prepared: ``None`` for 1-D RoPE families (position =
  sequence index), ``[3, T]`` for M-RoPE, plus the per-sequence ``rope_delta``
  decode needs (a decode step at sequence position ``p`` uses 3-D position
  ``p + rope_delta`` on all three axes).

Invariants: a family never holds per-request state; the same inputs give the
same positions in every process (gateway, prefill, decode), which is what the
handoff verification compares.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image


SINGLE_LAYOUT = ""   # an image's layout variant on its own, and every image's in a family whose encoding never varies


class PositionKind(enum.IntEnum):
    """How a family's decoder numbers positions."""

    ONE_D = 1      # RoPE over the sequence index: position = KV slot index
    MROPE = 3      # 3-D (temporal, height, width) positions; text after an image continues at an offset


class EmbeddingFormatError(ValueError):
    """A stored image embedding does not have this model's layout (a stale or foreign cache entry)."""


@dataclass(frozen=True, slots=True)
class ImageEmbedding:
    """One image's encoder output, as the language side consumes it.

    ``features`` replace the image's placeholder tokens in order. ``grid`` is the
    vision grid ``(t, h, w)`` in patches, exactly the processor's ``image_grid_thw``
    row (M-RoPE families; ``None`` otherwise). ``deepstack`` (Qwen3-VL) holds one
    ``[tokens, hidden]`` level per early decoder layer, added to that layer's output
    at the image's positions.
    """

    features: torch.Tensor                     # [tokens, hidden]
    grid: tuple[int, int, int] | None = None
    deepstack: torch.Tensor | None = None      # [levels, tokens, hidden]

    @property
    def tokens(self) -> int:
        return int(self.features.shape[0])


@dataclass(frozen=True, slots=True)
class PositionPlan:
    """A prompt's positions: ``positions`` is ``None`` (1-D: the sequence index) or ``[3, T]`` long.

    ``rope_delta`` is what decode needs per sequence: the token at sequence position
    ``p >= T`` has position ``p + rope_delta`` (on all three axes for M-RoPE; always 0 for 1-D).
    """

    positions: torch.Tensor | None
    rope_delta: int


class ModelFamily(ABC):
    """One family's pieces of the split; built from the model's config (and the loaded model, when there is one:
    a process without weights, like the gateway, passes ``model=None`` and gets the same answers)."""

    name: str
    position_kind: PositionKind = PositionKind.ONE_D
    bidirectional_images: bool = False   # image tokens see their whole run both ways (Gemma 3's token_type_ids mask)
    bidirectional_layer_types: frozenset[str] | None = None   # the layer types where they do (None: every layer)
    layout_variants: tuple[str, ...] = (SINGLE_LAYOUT,)   # every variant ``encode_variants`` accepts

    def longest_image_span(self, processor: Any) -> int:
        """The most placeholder tokens one bidirectional image run has (0: none; a chunk grows to it)."""
        return 0

    def __init__(self, config: Any, model: Any = None):
        self.config = config
        self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)
        self.hidden_size = int(config.get_text_config().hidden_size)

    # -- processor ------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def load_processor(cls, path: str | Path) -> Any:
        """The checkpoint's processor, loadable on a CPU-only host (no torchvision)."""

    # -- vision ---------------------------------------------------------------------
    @abstractmethod
    def encode(self, model: Any, processor: Any, images: Sequence[Image.Image], dtype: torch.dtype,
               device: torch.device) -> list[ImageEmbedding]:
        """Vision tower + projector for RGB ``images`` as one batch: one embedding per image, in order."""

    def layout_variant(self, n_images: int) -> str:
        """The layout variant of every image of a prompt holding ``n_images`` images (one of
        ``layout_variants``; the gateway decides it, the workers check the request's against it)."""
        return SINGLE_LAYOUT

    def encode_variants(self, model: Any, processor: Any, images: Sequence[Image.Image], variants: Sequence[str],
                        dtype: torch.dtype, device: torch.device) -> list[ImageEmbedding]:
        """``encode``, image ``i`` in layout variant ``variants[i]`` (each one of ``layout_variants``, checked by
        the caller). A family with one variant encodes the images as they are."""
        return self.encode(model, processor, images, dtype, device)

    def variant_image_tokens(self, processor: Any, width: int, height: int, variant: str) -> int:
        """``image_tokens`` of an image in layout variant ``variant``."""
        return self.image_tokens(processor, width, height)

    def encode_pixels(self, model: Any, pixel_values: torch.Tensor) -> list[ImageEmbedding]:
        """The tower on already preprocessed fixed-size pixels (families whose images need nothing else)."""
        raise NotImplementedError(f"{self.name} images need their grids: use encode()")

    def check_image(self, width: int, height: int) -> str | None:
        """Why an image of this size cannot be processed (a client error), or ``None``."""
        return None

    def image_grid(self, processor: Any, width: int, height: int) -> tuple[int, int, int] | None:
        """The vision grid ``(t, h, w)`` of an image of this size (M-RoPE families), else ``None``."""
        return None

    @abstractmethod
    def image_tokens(self, processor: Any, width: int, height: int) -> int:
        """How many placeholder tokens an image of ``width`` x ``height`` pixels expands to."""

    # -- storage layout -------------------------------------------------------------
    @abstractmethod
    def to_tensor(self, embedding: ImageEmbedding) -> torch.Tensor:
        """The embedding as one tensor (what the encoder cache stores)."""

    @abstractmethod
    def from_tensor(self, tensor: torch.Tensor) -> ImageEmbedding:
        """Inverse of ``to_tensor``; ``EmbeddingFormatError`` when the layout is not this model's."""

    # -- the prompt -----------------------------------------------------------------
    def check_placeholders(self, token_ids: Sequence[int], images: Sequence[ImageEmbedding]) -> str | None:
        """Why the prompt's placeholders do not match ``images`` (a client error), or ``None``."""
        placeholders = sum(1 for t in token_ids if t == self.image_token_id)
        features = sum(e.tokens for e in images)
        if placeholders != features:
            return f"prompt has {placeholders} image placeholder tokens but {len(images)} images give {features}"
        return None

    def position_plan(self, token_ids: Sequence[int], grids: Sequence[tuple[int, int, int] | None]) -> PositionPlan:
        """Positions of the prompt ``token_ids`` whose images have ``grids`` (placeholders already checked)."""
        return PositionPlan(None, 0)

    # -- hybrid decoders -------------------------------------------------------------
    def kv_layer_indices(self) -> list[int]:
        """The decoder layers whose attention reads the paged KV pool (all of them, unless the family is hybrid)."""
        return list(range(int(self.config.get_text_config().num_hidden_layers)))

    def state_layout(self, dtype: torch.dtype) -> Any:
        """The per-sequence fixed-size state of a hybrid decoder (a ``state_slots.StateLayout``), or ``None``."""
        return None

    def describe(self) -> str:
        return f"{self.name} ({self.position_kind.name} positions)"


def image_spans(token_ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every maximal run of ``token_id`` in ``token_ids``, in order."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(token_ids):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(token_ids)))
    return spans


def placeholder_runs(token_ids: Sequence[int], token_id: int) -> list[int]:
    """Lengths of the maximal runs of ``token_id`` in ``token_ids``, in order."""
    runs: list[int] = []
    previous = None
    for t in token_ids:
        if t == token_id:
            if previous != token_id:
                runs.append(0)
            runs[-1] += 1
        previous = t
    return runs
