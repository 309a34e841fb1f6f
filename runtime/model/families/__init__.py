"""Per-family pieces of the E/P/D split (see ``base.ModelFamily`` for the interface).

``family_for(config)`` picks the implementation for a checkpoint that passed
``runtime.model.supported_models``; ``load_processor(path)`` is the one way
every process (gateway, encoder, prefill, decode) loads a checkpoint's processor.
A new family: a ``ModelFamily`` subclass here, a ``Family`` entry in
``supported_models.FAMILIES`` with the same name, and identity tests
(docs/models.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from runtime.model import supported_models

from .base import (SINGLE_LAYOUT, EmbeddingFormatError, ImageEmbedding, ModelFamily, PositionKind, PositionPlan,
                   image_spans)
from .gemma3 import Gemma3Family
from .gemma4 import Gemma4Family
from .idefics3 import Idefics3Family, SmolVLMFamily
from .llava import LlavaStyleFamily
from .llava_anyres import LlavaNextFamily, LlavaOnevisionFamily
from .mistral3 import Mistral3Family
from .qwen3_5 import Qwen3_5Family
from .qwen_vl import Qwen3VLFamily, Qwen25VLFamily, QwenVLFamily

IMPLEMENTATIONS: dict[str, type[ModelFamily]] = {
    "LLaVA": LlavaStyleFamily,
    "InternVL": LlavaStyleFamily,
    "LLaVA-NeXT": LlavaNextFamily,
    "LLaVA-OneVision": LlavaOnevisionFamily,
    "Idefics3": Idefics3Family,
    "SmolVLM": SmolVLMFamily,
    "Mistral 3": Mistral3Family,
    "Gemma 3": Gemma3Family,
    "Gemma 4": Gemma4Family,
    "Qwen2-VL": QwenVLFamily,
    "Qwen2.5-VL": Qwen25VLFamily,
    "Qwen3-VL": Qwen3VLFamily,
    "Qwen3.5": Qwen3_5Family,
}

__all__ = ["SINGLE_LAYOUT", "EmbeddingFormatError", "ImageEmbedding", "ModelFamily", "PositionKind", "PositionPlan",
           "family_class", "family_for", "image_spans", "load_processor"]


def family_class(config: PretrainedConfig) -> type[ModelFamily]:
    """The implementation for ``config`` (``UnsupportedModel`` when no family fits)."""
    family = supported_models.family_of(config.to_dict())
    return IMPLEMENTATIONS[family.name]


def family_for(config: PretrainedConfig, model: Any = None) -> ModelFamily:
    """The family of ``config``, bound to the loaded ``model`` when there is one."""
    return family_class(config)(config, model)


def load_processor(path: str | Path) -> Any:
    """The checkpoint's processor, checked first (``UnsupportedModel``) and loadable without torchvision."""
    supported_models.check_checkpoint(path)
    config = supported_models.load_config(path)
    return family_class(config).load_processor(path)
