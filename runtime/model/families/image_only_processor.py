"""Load a multimodal processor without its video processor (no torchvision needed).

In transformers 5.23 the Qwen-VL processors (and others, see issue 18) always
build a video processor, and every video processor needs torchvision, which
has no build that imports beside the CPU torch used here. Images do not need
it. ``load_image_only_processor`` loads the family's real processor class
with the video processor left out: the tokenizer, the image processor (its
PIL backend when torchvision is missing), the chat template and the scalar
entries of ``processor_config.json``, all through transformers' own loader.
The result is an instance of the real class (a subclass that only drops the
``video_processor`` attribute), so everything the image path does is the
class's own code; a video passed to it is ignored by the processor, and the
family refuses video placeholders in prompts.

torchvision is never a dependency: when it is importable this loader is still
used, so the CPU and GPU hosts build the same processor.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from transformers import ProcessorMixin

log = logging.getLogger("epd.model")

_DROPPED = "video_processor"


def image_only_class(processor_class: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """``processor_class`` without its video processor attribute (same behaviour for text and images).

    Call it once per class, where the family is defined (a module constant), so every load
    gives instances of one class.
    """

    base_attributes = [a for a in processor_class.get_attributes() if a != _DROPPED]
    # some classes (SmolVLM) take the video processor as a required argument: it is None here
    takes_video = _DROPPED in inspect.signature(processor_class.__init__).parameters

    def get_attributes(cls) -> list[str]:
        return list(base_attributes)

    def get_processor_dict(cls, pretrained_model_name_or_path, **kwargs):
        processor_dict, instantiation_kwargs = processor_class.get_processor_dict.__func__(
            cls, pretrained_model_name_or_path, **kwargs)
        # keep the scalar settings, the chat template and the sub-processors we load; drop the video's
        keep = {k: v for k, v in processor_dict.items()
                if k == "chat_template" or k in base_attributes or not isinstance(v, (dict, list))}
        if takes_video:
            keep[_DROPPED] = None
        return keep, instantiation_kwargs

    def to_dict(self) -> dict[str, Any]:
        out = processor_class.to_dict(self)
        out["processor_class"] = processor_class.__name__   # saved, it names the real class
        return out

    return type(f"ImageOnly{processor_class.__name__}", (processor_class,), {
        "__doc__": f"{processor_class.__name__} without a video processor (images and text only).",
        "__module__": __name__,
        "real_class": processor_class,
        "get_attributes": classmethod(get_attributes),
        "get_processor_dict": classmethod(get_processor_dict),
        "to_dict": to_dict,
    })


def load_image_only_processor(path: str | Path, image_only: type[ProcessorMixin]) -> Any:
    """The checkpoint's processor as ``image_only`` (from ``image_only_class``); logs that it did so."""
    processor = image_only.from_pretrained(str(path))
    log.info("loaded %s for %s without its video processor (needs torchvision; images and text only)",
             image_only.real_class.__name__, path)
    return processor
