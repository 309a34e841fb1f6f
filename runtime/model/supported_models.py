"""Which checkpoints epd can serve, decided from the config before any weights load.

A checkpoint the split does not support must never start: a PaliGemma model would
answer every request with wrong text (its image prefix needs bidirectional
attention the families marked ``bidirectional`` alone build), an Mllama model would
fail every request (cross-attention to the image). ``check_checkpoint`` reads only
``config.json`` (and the image processor's config) and raises
``UnsupportedModel`` with one line naming the architecture, its model_type,
what is wrong and the supported list. Called by every process that loads a
model or a processor (``VLMAdapter.load``, ``PromptBuilder.from_pretrained``)
and by ``epd serve`` before it spawns anything.

What the split needs (ARCHITECTURE.md "The split", docs/models.md), per family in ``FAMILIES``:

* the architecture and its ``model_type``, and an implementation of the same
  name in ``runtime.model.families`` (vision tower, storage layout, placeholder
  rule, positions);
* a vision tower of a ``vision_model_types`` type whose features the family
  turns into one embedding per image: one tile per image, or the model's own
  packing of any-resolution tiles for the families marked ``anyres``;
* a decoder of a ``text_model_types`` type: causal self-attention through
  transformers' attention interface over every layer — or, for the families
  marked ``hybrid``, over the full-attention layers with linear-attention layers
  (per-sequence state slots) between them (no cross-attention; no sliding window
  shorter than the context, nor bidirectional image tokens, except for the
  families marked ``sliding`` and ``bidirectional``, whose layers are
  ``full_attention`` / ``sliding_attention``, and whose decoder may set
  ``use_bidirectional_attention="vision"`` (image tokens only); no attention logit
  soft-capping), and RoPE with a static frequency table (no sequence-length-dependent
  "dynamic"/"longrope" scaling, whose frequencies would change with what else is
  packed into a step): 1-D for most families, M-RoPE (``mrope_section``, 3-D
  position ids) only for the families marked ``mrope``.

A new family adds a ``Family`` entry, its ``ModelFamily`` and its tests;
``KNOWN_UNSUPPORTED`` only gives a better reason for families we know we lack.
Video inputs are not served by any family (prompts holding video placeholders
are refused per request; video-only architectures are refused here).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig
from transformers.utils import cached_file


class UnsupportedModel(ValueError):
    """The checkpoint cannot be served by the E/P/D split; ``str()`` is one line."""


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    architecture: str
    model_type: str
    vision_model_types: frozenset[str]
    text_model_types: frozenset[str]
    mrope: bool = False      # 3-D M-RoPE positions (and a per-sequence rope delta) instead of 1-D RoPE
    anyres: bool = False     # any-resolution tiles (image_grid_pinpoints) packed by the model's own code
    processor_needs: str | None = None   # a package the checkpoint's processor imports (refused where missing)
    sliding: bool = False    # interleaved sliding-window layers (layer_types), honoured by the paged attention
    bidirectional: bool = False  # image tokens attend bidirectionally within their image (token_type_ids mask)
    hybrid: bool = False     # linear-attention layers (per-sequence state slots) beside full-attention ones

    def describe(self) -> str:
        return (f"{self.architecture} ({self.name}: {'/'.join(sorted(self.vision_model_types))} vision"
                f" + {'/'.join(sorted(self.text_model_types))} decoder)")


FAMILIES: tuple[Family, ...] = (
    Family("LLaVA", "LlavaForConditionalGeneration", "llava",
           frozenset({"clip_vision_model", "siglip_vision_model"}), frozenset({"llama", "mistral", "qwen2"})),
    Family("InternVL", "InternVLForConditionalGeneration", "internvl",
           frozenset({"internvl_vision"}), frozenset({"llama", "qwen2"})),
    Family("LLaVA-NeXT", "LlavaNextForConditionalGeneration", "llava_next",
           frozenset({"clip_vision_model", "siglip_vision_model"}), frozenset({"llama", "mistral", "qwen2"}),
           anyres=True),
    Family("LLaVA-OneVision", "LlavaOnevisionForConditionalGeneration", "llava_onevision",
           frozenset({"siglip_vision_model"}), frozenset({"qwen2"}), anyres=True),
    Family("Idefics3", "Idefics3ForConditionalGeneration", "idefics3",
           frozenset({"idefics3_vision"}), frozenset({"llama"})),
    Family("SmolVLM", "SmolVLMForConditionalGeneration", "smolvlm",
           frozenset({"smolvlm_vision"}), frozenset({"llama"})),
    Family("Mistral 3", "Mistral3ForConditionalGeneration", "mistral3",
           frozenset({"pixtral"}), frozenset({"mistral"}), processor_needs="torchvision"),
    Family("Gemma 3", "Gemma3ForConditionalGeneration", "gemma3",
           frozenset({"siglip_vision_model"}), frozenset({"gemma3_text"}), sliding=True, bidirectional=True),
    Family("Gemma 4", "Gemma4ForConditionalGeneration", "gemma4",
           frozenset({"gemma4_vision"}), frozenset({"gemma4_text"}), sliding=True, bidirectional=True),
    Family("Qwen2-VL", "Qwen2VLForConditionalGeneration", "qwen2_vl",
           frozenset({"qwen2_vl_vision"}), frozenset({"qwen2_vl_text"}), mrope=True),
    Family("Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl",
           frozenset({"qwen2_5_vl_vision"}), frozenset({"qwen2_5_vl_text"}), mrope=True),
    Family("Qwen3-VL", "Qwen3VLForConditionalGeneration", "qwen3_vl",
           frozenset({"qwen3_vl_vision"}), frozenset({"qwen3_vl_text"}), mrope=True),
    Family("Qwen3.5", "Qwen3_5ForConditionalGeneration", "qwen3_5",
           frozenset({"qwen3_5_vision"}), frozenset({"qwen3_5_text"}), mrope=True, hybrid=True),
)

# model_type -> why not (yet): only for a clearer message
KNOWN_UNSUPPORTED: Mapping[str, str] = {
    "paligemma": "the image prefix needs bidirectional attention",
    "llava_next_video": "video inputs",
    "qwen3_vl_moe": "mixture-of-experts decoder not tested through the split",
    "qwen2_5_omni": "audio and video inputs (thinker-talker)",
    "qwen3_omni_moe": "audio and video inputs (thinker-talker)",
    "video_llava": "video inputs",
    "mllama": "cross-attention to the image",
    "idefics2": "perceiver-resampled multi-crop images",
    "pixtral": "variable-size image features need image_sizes",
}

# "proportional" (Gemma 4's full layers): a static table in which only a fraction of the dimensions rotate
STATIC_1D_ROPE_TYPES = frozenset({"default", "linear", "llama3", "proportional", "yarn"})
MROPE_ROPE_TYPES = frozenset({"default", "mrope"})   # "mrope": the legacy rope_scaling type of Qwen2-VL


def supported_list() -> str:
    return "; ".join(f.describe() for f in FAMILIES)


def check_checkpoint(path: str | Path) -> None:
    """Raise ``UnsupportedModel`` unless the checkpoint at ``path`` (folder or hub id) can be served.

    Reads the raw config first, so an architecture transformers does not know is refused by
    name too; then the parsed config (defaults filled in) for the details.
    """
    raw, _ = PretrainedConfig.get_config_dict(str(path))
    family = family_of(raw)
    if family.processor_needs and importlib.util.find_spec(family.processor_needs) is None:
        raise UnsupportedModel(f"{_name(raw)}: its processor needs {family.processor_needs}, which is not installed on "
                               f"this host; supported: {supported_list()}")
    check_config(load_config(path), _image_processor_dict(path), family)


def load_config(path: str | Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(str(path))


def check_config(config: PretrainedConfig, image_processor: Mapping[str, Any] | None = None,
                 family: Family | None = None) -> None:
    """Raise ``UnsupportedModel`` unless ``config`` (and the image processor's settings) fit a family."""
    family = family or family_of(config.to_dict())
    problem = (_vision_problem(config, family) or _decoder_problem(config, family)
               or (_gemma4_problem(config) if family.model_type == "gemma4" else None))
    if problem is None and image_processor and image_processor.get("crop_to_patches"):
        problem = "image processor crop_to_patches=true (multi-tile images) is not supported; set it to false"
    if problem is None and image_processor and image_processor.get("do_pan_and_scan"):
        problem = "image processor do_pan_and_scan=true (extra crops per image) is not supported; set it to false"
    if problem is not None:
        raise UnsupportedModel(f"{_name(config.to_dict())}: {problem}; supported: {supported_list()}")


# -- the checks ------------------------------------------------------------------------
def _name(raw: Mapping[str, Any]) -> str:
    architectures = raw.get("architectures") or ["<no architectures>"]
    return f"unsupported model {','.join(architectures)} (model_type {raw.get('model_type')!r})"


def family_of(raw: Mapping[str, Any]) -> Family:
    """The family whose architecture and model_type ``raw`` (a config dict) has; ``UnsupportedModel`` otherwise."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    for family in FAMILIES:
        if model_type == family.model_type and all(a == family.architecture for a in architectures):
            return family
    why = KNOWN_UNSUPPORTED.get(str(model_type), "not a family the E/P/D split supports")
    raise UnsupportedModel(f"{_name(raw)}: {why}; supported: {supported_list()}")


def _vision_problem(config: PretrainedConfig, family: Family) -> str | None:
    vision = getattr(config, "vision_config", None)
    vision_type = getattr(vision, "model_type", None)
    if vision_type not in family.vision_model_types:
        return f"vision tower {vision_type!r} is not supported"
    if getattr(config, "image_grid_pinpoints", None) and not family.anyres:
        return "multi-crop (anyres image_grid_pinpoints) image features are not supported"
    return None


def _decoder_problem(config: PretrainedConfig, family: Family) -> str | None:
    text = config.get_text_config()
    if text.model_type not in family.text_model_types:
        return f"decoder {text.model_type!r} is not supported"
    if getattr(config, "cross_attention_layers", None) or getattr(text, "cross_attention_layers", None):
        return "cross-attention layers are not supported"
    if getattr(text, "attn_logit_softcapping", None):
        return "attention logit soft-capping is not supported"
    bidirectional = getattr(text, "use_bidirectional_attention", False)
    if bidirectional and not (bidirectional == "vision" and family.bidirectional):   # "vision": image tokens only
        return (f"bidirectional attention over text tokens (use_bidirectional_attention={bidirectional!r}) "
                "is not supported")
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    allowed = {"full_attention"}
    allowed |= {"sliding_attention"} if family.sliding else set()
    allowed |= {"linear_attention"} if family.hybrid else set()
    if not layer_types <= allowed or "full_attention" not in layer_types:
        return f"attention layer types {sorted(layer_types)} are not supported (only {'/'.join(sorted(allowed))})"
    window = getattr(text, "sliding_window", None)
    if (not family.sliding and window is not None and getattr(text, "use_sliding_window", True)
            and window < text.max_position_embeddings):
        return f"sliding-window attention ({window} < context {text.max_position_embeddings}) is not supported"
    ropes = [getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)]
    if family.sliding and isinstance(ropes[0], Mapping) and set(ropes[0]) <= {"full_attention", "sliding_attention"}:
        ropes = list(ropes[0].values())   # one RoPE per layer type
    for rope in ropes:
        if not rope:
            continue
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if family.mrope:
            if rope_type not in MROPE_ROPE_TYPES:
                return f"rope_type {rope_type!r} is not supported with M-RoPE (only {'/'.join(sorted(MROPE_ROPE_TYPES))})"
            continue
        if "mrope_section" in rope or "mrope" in str(rope_type):
            return "M-RoPE (mrope_section) position ids are not supported"
        if rope_type not in STATIC_1D_ROPE_TYPES:
            return f"rope_type {rope_type!r} is not supported (only {'/'.join(sorted(STATIC_1D_ROPE_TYPES))})"
    return None


def _gemma4_problem(config: PretrainedConfig) -> str | None:
    """What of a Gemma 4 checkpoint the split does not honour (beyond the generic decoder checks)."""
    text = config.get_text_config()
    if getattr(text, "enable_moe_block", False):
        return "mixture-of-experts decoder layers (enable_moe_block) are not tested through the split"
    if (getattr(text, "hidden_size_per_layer_input", 0)
            and int(getattr(text, "vocab_size_per_layer_input", text.vocab_size)) < int(text.vocab_size)):
        # the per-layer embedding is looked up with every token id: larger ids would fail the request
        return (f"vocab_size_per_layer_input {text.vocab_size_per_layer_input} < vocab_size {text.vocab_size} "
                "(tokens without a per-layer input embedding) is not supported")
    return None


def _image_processor_dict(path: str | Path) -> Mapping[str, Any] | None:
    """The image processor's settings, or ``None`` when the checkpoint has none (a config-only folder)."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        found = cached_file(str(path), name, _raise_exceptions_for_missing_entries=False)
        if found is None:
            continue
        settings = json.loads(Path(found).read_text())
        settings = settings.get(key) if key else settings
        if isinstance(settings, dict):
            return settings
    return None
