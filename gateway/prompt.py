"""Validated chat messages -> prompt token ids, with the model's own processor.

    messages --(chat template)--> prompt text --(processor + images)--> token ids

Image parts become ``{"type": "image"}`` for the template, so it emits one
image placeholder per image; the processor then expands each placeholder to
the number of feature tokens the encoder will produce (which may depend on the
image's size), so ``len(token_ids)`` is the true prompt length. The processor
is given the conversation's images as one sample (``[images]``), as
``apply_chat_template`` gives them: a processor whose expansion depends on the
prompt's image count (LLaVA-OneVision's multi-image form) sees the count, and
each image's layout variant (``family.layout_variant``, ``BuiltPrompt.image_variants``)
names the form the encoder must produce.

Only the processor (tokenizer + image processor) and the config are loaded;
the gateway never loads model weights. The processor comes from the model's
family (``runtime.model.families.load_processor``: the Qwen-VL processors without
their video processor, which needs torchvision).

Positions (``build_prompt``): for M-RoPE families (Qwen-VL) the workers need each
image's vision grid and the sequence's rope delta. Both come from what the
gateway has, with no weights: the grid from the image processor's own resize rule
and pixel limits (``family.image_grid``: dynamic resolution), the delta from the
family's position plan of the token ids and grids (the model's own
``get_rope_index``). The gateway sends them with the request; prefill and decode
check theirs against them before a sequence is inserted.

Images of a size seen before skip the image processor: the processor's
pixels are thrown away here (the encoder computes its own), and only the
number of placeholder tokens per image matters. The first image of each
size and layout variant goes through the full processor, and its output is checked against
"tokenize the text, then repeat each placeholder N times"; once that holds,
N is remembered for the size and variant. If it ever does not hold (a processor that
expands placeholders into other tokens), the shortcut is off for good.

Length: a prompt that cannot fit the context is refused (400
``context_length_exceeded``) before the expensive work, from a lower bound on
its tokens that needs no tokenizer call (``gateway.prompt_bound``): first the
user messages' text (before rendering; templates may trim it, never drop it),
then the rendered prompt (catches long system or assistant turns). Only a
prompt that may fit is tokenized, and the exact count decides.

Threads: ``build`` runs in worker threads, each build on its own processor copy
(``gateway.processor_pool``), so one long prompt does not hold up the others.
Streaming detokenization on the event loop uses ``decode_tokenizer``, a copy
no other thread touches. The learnt placeholder counts are guarded by a lock.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from PIL import Image
import torch
from transformers import AutoConfig

from runtime.model import families, grammar, supported_models
from runtime.model.families import ModelFamily
from runtime.model.families.base import placeholder_runs

from . import offload
from .errors import ApiError
from .openai_schema import ChatMessage, ImagePart, TextPart
from .processor_pool import ProcessorPool
from .prompt_bound import TokenFloor

# OpenAI's "developer" role is the system prompt of newer models; templates know "system".
_TEMPLATE_ROLE = {"developer": "system"}


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    """A request's prompt as the workers need it."""

    token_ids: list[int]                                  # placeholders expanded
    image_grids: list[tuple[int, int, int] | None]        # one per image: (t, h, w) for M-RoPE families, else None
    rope_delta: int                                       # the position plan's per-sequence offset (0 for 1-D)
    image_tokens: list[int] = field(default_factory=list) # one per image: its placeholder tokens (prefix-cache keys)
    positions: Any = None                                 # M-RoPE: the plan's [3, T] positions (prefix-cache keys); 1-D: None
    image_variants: list[str] = field(default_factory=list)  # one per image: its layout variant ("" = its only form)


class PromptBuilder:
    def __init__(self, processor: Any, context_length: int, family: ModelFamily | None = None):
        """``family``: the checkpoint's (config only, no weights); ``None`` is a 1-D RoPE family whose
        images need no grid (what tests build around a bare processor)."""
        if context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {context_length}")
        self.processor = processor
        self.family = family
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.decode_tokenizer = copy.deepcopy(self.tokenizer)   # event-loop thread only
        # hybrid decoders keep per-sequence linear-attention state that a fork of choices cannot share
        self.forks_choices = family is None or family.state_layout(torch.float32) is None
        self.context_length = context_length
        self.logits_size = len(self.tokenizer)   # the model's, when built from a checkpoint
        self.floor = TokenFloor.of(self.tokenizer)
        self._processors = ProcessorPool(processor)
        self._learnt_lock = threading.Lock()   # guards _tokens_per_size and _shortcut_ok
        # the placeholder string the template emits per image; user text may not contain it
        self.image_token: str | None = getattr(processor, "image_token", None)
        self.accepts_images = getattr(processor, "image_processor", None) is not None
        self.image_token_id: int | None = (
            self.tokenizer.convert_tokens_to_ids(self.image_token) if self.image_token else None)
        self.video_token: str | None = getattr(processor, "video_token", None)   # videos are refused
        # ((width, height), layout variant) -> placeholder tokens per image, learnt from the full processor
        self._tokens_per_size: dict[tuple[tuple[int, int], str], int] = {}
        self._shortcut_ok = self.image_token_id is not None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "PromptBuilder":
        supported_models.check_checkpoint(path)   # the gateway refuses what the workers would
        processor = families.load_processor(path)
        config = AutoConfig.from_pretrained(path)
        builder = cls(processor, int(config.get_text_config().max_position_embeddings), families.family_for(config))
        builder.logits_size = int(config.get_text_config().vocab_size)
        return builder

    def grammar_vocabulary(self) -> grammar.Vocabulary:
        """The tokenizer as the grammar library sees it (built on first use), to compile grammars against."""
        return grammar.vocabulary_for(self, self.tokenizer, self.logits_size, [self.tokenizer.eos_token_id])

    @property
    def chat_template(self) -> str | None:
        return getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)

    # -- messages -> text -----------------------------------------------------------
    def template_messages(self, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
        """OpenAI messages in transformers' chat-template format."""
        out: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            role = _TEMPLATE_ROLE.get(message.role, message.role)
            content = message.content
            extra: dict[str, Any] = {}
            if getattr(message, "tool_calls", None):
                # arguments as the JSON object they hold, as Qwen's and most templates expect them
                extra["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments, f"messages.{i}.tool_calls.{k}")}}
                    for k, c in enumerate(message.tool_calls)]
            if getattr(message, "tool_call_id", None):
                extra["tool_call_id"] = message.tool_call_id
            if content is None:
                out.append({"role": role, "content": "", **extra})
            elif isinstance(content, str):
                self._check_text(content, f"messages.{i}.content")
                out.append({"role": role, "content": content, **extra})
            else:
                parts: list[dict[str, Any]] = []
                for j, part in enumerate(content):
                    if isinstance(part, TextPart):
                        self._check_text(part.text, f"messages.{i}.content.{j}.text")
                        parts.append({"type": "text", "text": part.text})
                    elif isinstance(part, ImagePart):
                        parts.append({"type": "image"})
                out.append({"role": role, "content": parts, **extra})
        return out

    def _check_text(self, text: str, param: str) -> None:
        if self.image_token and self.image_token in text:
            raise ApiError.bad_request(
                f"text must not contain the image placeholder {self.image_token!r}; send images as image_url parts",
                param,
                "invalid_value",
            )
        if self.video_token and self.video_token in text:
            raise ApiError.bad_request(
                f"text must not contain the video placeholder {self.video_token!r}; video inputs are not supported",
                param,
                "invalid_value",
            )

    def render(self, messages: Sequence[ChatMessage], processor: Any = None,
               tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The chat template's text (``tools`` rendered by the template); ``processor`` is a leased copy
        (default: the original, single-threaded use)."""
        try:
            return (processor or self.processor).apply_chat_template(
                self.template_messages(messages), add_generation_prompt=True, tokenize=False,
                **({"tools": list(tools)} if tools else {}))
        except jinja2.TemplateError as exc:  # e.g. a template that requires alternating roles
            raise ApiError.bad_request(f"messages do not fit the model's chat template: {exc}", "messages") from None

    # -- text + images -> token ids ---------------------------------------------------
    def tokenize(self, prompt: str, images: Sequence[Image.Image], processor: Any = None) -> list[int]:
        if images and not self.accepts_images:
            raise ApiError.bad_request("this model does not accept images", "messages", "images_not_supported")
        processor = processor or self.processor
        variants = self.image_variants(len(images))
        with self._learnt_lock:
            known = ([self._tokens_per_size.get((im.size, v)) for im, v in zip(images, variants)]
                     if self._shortcut_ok else [])
        if images and known and None not in known:
            expanded = self._expand(self._text_ids(prompt, processor), known)
            if expanded is not None:
                return expanded
        ids = self._process(prompt, images, processor)
        if images and self._shortcut_ok:
            self._learn(prompt, images, variants, ids, processor)
        return ids

    def image_variants(self, n_images: int) -> list[str]:
        """The layout variant of each image of a prompt holding ``n_images`` (the family's rule; "" without one)."""
        return [self.family.layout_variant(n_images) if self.family is not None else ""] * n_images

    @staticmethod
    def _text_ids(prompt: str, processor: Any) -> list[int]:
        tokenizer = getattr(processor, "tokenizer", processor)
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def _expand(self, text_ids: list[int], counts: list[int]) -> list[int] | None:
        """``text_ids`` with the i-th placeholder repeated ``counts[i]`` times; None if the placeholders do not match."""
        if text_ids.count(self.image_token_id) != len(counts):
            return None
        out: list[int] = []
        pending = iter(counts)
        for t in text_ids:
            if t == self.image_token_id:
                out.extend([t] * next(pending))
            else:
                out.append(t)
        return out

    _MAX_LEARNT_SIZES = 4096

    def _learn(self, prompt: str, images: Sequence[Image.Image], variants: Sequence[str], ids: list[int],
               processor: Any) -> None:
        """Record placeholder counts per image size and variant from a full processor run, or turn the shortcut off."""
        runs: list[int] = []
        previous = None
        for t in ids:
            if t == self.image_token_id:
                if previous != t:
                    runs.append(0)
                runs[-1] += 1
            previous = t
        if len(runs) != len(images):
            return  # adjacent placeholders merge into one run: nothing to learn from this prompt
        expands = self._expand(self._text_ids(prompt, processor), runs) == ids
        learnt: dict[tuple[tuple[int, int], str], int] = {}
        with self._learnt_lock:
            consistent = expands
            for im, v, n in zip(images, variants, runs):
                key = (im.size, v)
                consistent &= learnt.setdefault(key, n) == n and self._tokens_per_size.get(key, n) == n
            if not consistent:
                self._shortcut_ok = False
                self._tokens_per_size.clear()
            elif len(self._tokens_per_size) < self._MAX_LEARNT_SIZES:
                self._tokens_per_size.update(learnt)

    def _process(self, prompt: str, images: Sequence[Image.Image], processor: Any = None) -> list[int]:
        kwargs: dict[str, Any] = {"text": prompt, "add_special_tokens": False}
        if images:
            kwargs["images"] = [list(images)]   # one conversation, one sample (as apply_chat_template passes them)
        try:
            encoded = (processor or self.processor)(**kwargs)
        except ValueError as exc:  # the processor's own consistency checks on client content
            raise ApiError.bad_request(f"the prompt could not be processed: {exc}", "messages") from None
        ids = encoded["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]

    def build(self, messages: Sequence[ChatMessage], images: Sequence[Image.Image],
              tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids for ``messages``; CPU-bound, call it off the event loop unless ``cheap_build`` says it is
        small. Thread-safe: concurrent builds run in parallel, each on its own processor copy."""
        self.check_fits(messages)
        with self._processors.lease() as processor:
            prompt = self.render(messages, processor, tools)
            self._refuse_unless_fits(self.floor.tokens_at_least([prompt]), "the rendered prompt")
            return self.tokenize(prompt, images, processor)

    def cheap_build(self, messages: Sequence[ChatMessage], images: Sequence[Image.Image],
                    tools: Sequence[dict[str, Any]] | None = None) -> bool:
        """Whether ``build_prompt`` of these is small work (``gateway.offload``): short text, no tools, and
        every image's placeholder count already learnt (no processor run over its pixels)."""
        if tools or not offload.small_text(message_texts(messages)):
            return False
        if not images:
            return True
        variants = self.image_variants(len(images))
        with self._learnt_lock:
            return self._shortcut_ok and all((im.size, v) in self._tokens_per_size for im, v in zip(images, variants))

    def build_prompt(self, messages: Sequence[ChatMessage], images: Sequence[Image.Image],
                     tools: Sequence[dict[str, Any]] | None = None) -> BuiltPrompt:
        """``build``, with each image's grid and the sequence's rope delta (see the module docstring)."""
        token_ids = self.build(messages, images, tools)
        grids, plan = self.position_plan(token_ids, images)
        return BuiltPrompt(token_ids, grids, plan.rope_delta if plan else 0, self.image_tokens(token_ids, len(images)),
                           plan.positions if plan else None, self.image_variants(len(images)))

    @property
    def placeholder_id(self) -> int:
        """The image placeholder's token id (-1 when the processor has none)."""
        if self.image_token_id is not None:
            return int(self.image_token_id)
        return int(self.family.image_token_id) if self.family is not None else -1

    def image_tokens(self, token_ids: Sequence[int], n_images: int) -> list[int]:
        """Each image's placeholder count: its run of image tokens, or (adjacent images, whose runs
        merge) an even share of them (every image of a fixed-size family expands alike)."""
        if not n_images:
            return []
        runs = placeholder_runs(token_ids, self.placeholder_id)
        if len(runs) == n_images:
            return runs
        return [sum(runs) // n_images] * n_images

    def text_prompt(self, prompt: str | Sequence[int], add_special_tokens: bool) -> BuiltPrompt:
        """A completions prompt (text, or token ids) as the workers need it; no images. CPU-bound, thread-safe."""
        if isinstance(prompt, str):
            self._check_text(prompt, "prompt")
            self._refuse_unless_fits(self.floor.tokens_at_least([prompt]), "the prompt", "prompt")
            with self._processors.lease() as processor:
                tokenizer = getattr(processor, "tokenizer", processor)
                ids = [int(t) for t in tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]]
        else:
            ids = list(prompt)
            self.check_token_ids(ids, "prompt")
        return BuiltPrompt(ids, [], self.positions(ids, [])[1])

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """400 unless every id is in the vocabulary and none is an image placeholder (images come as image parts)."""
        vocab = len(self.tokenizer)
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise ApiError.bad_request(f"token ids {outside[:8]} are outside the vocabulary (0..{vocab - 1})", param,
                                       "invalid_value")
        if self.image_token_id is not None and self.image_token_id in ids:
            raise ApiError.bad_request(f"token id {self.image_token_id} is the image placeholder; prompts of token ids "
                                       "carry no images", param, "invalid_value")

    def positions(self, token_ids: Sequence[int],
                  images: Sequence[Image.Image]) -> tuple[list[tuple[int, int, int] | None], int]:
        """``(grids, rope_delta)`` of a prompt whose placeholders were expanded for ``images``."""
        grids, plan = self.position_plan(token_ids, images)
        return grids, plan.rope_delta if plan else 0

    def position_plan(self, token_ids: Sequence[int], images: Sequence[Image.Image]) -> tuple[list, Any]:
        """``(grids, the family's PositionPlan)``; ``None`` for the plan without a family."""
        if self.family is None:
            return [None] * len(images), None
        # every size here went through the full processor once (``tokenize``), which refuses what it cannot resize
        grids = [self.family.image_grid(self.processor, *image.size) for image in images]
        return grids, self.family.position_plan(token_ids, grids)

    # -- length -----------------------------------------------------------------------
    def check_fits(self, messages: Sequence[ChatMessage]) -> None:
        """400 ``context_length_exceeded`` when the user messages' text alone cannot fit; no tokenizer call."""
        texts = [part for m in messages if m.role == "user" for part in _texts(m)]
        self._refuse_unless_fits(self.floor.tokens_at_least(texts), "the messages' text")

    def _refuse_unless_fits(self, at_least: int, what: str, param: str = "messages") -> None:
        if at_least >= self.context_length:   # not even one new token would fit
            raise ApiError.bad_request(
                f"{what} needs at least {at_least} tokens; the model's context is {self.context_length} tokens",
                param,
                "context_length_exceeded",
            )

    def resolve_max_tokens(self, prompt_tokens: int, requested: int | None, default: int,
                           prompt_param: str = "messages") -> int:
        """The request's max new tokens; 400 when the prompt plus it does not fit the context."""
        room = self.context_length - prompt_tokens
        if requested is None:
            if room < 1:
                raise ApiError.bad_request(
                    f"prompt of {prompt_tokens} tokens leaves no room in the model's context of {self.context_length}",
                    prompt_param,
                    "context_length_exceeded",
                )
            return min(default, room)
        if requested > room:
            raise ApiError.bad_request(
                f"prompt of {prompt_tokens} tokens plus max_tokens {requested} exceeds the model's context of "
                f"{self.context_length} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        return requested


def _arguments(text: str, param: str) -> Any:
    """A tool call's ``arguments`` (JSON text on the wire) as the object the template renders."""
    try:
        return json.loads(text)
    except ValueError:
        raise ApiError.bad_request("tool call arguments must be JSON text", param + ".function.arguments",
                                   "invalid_value") from None


def message_texts(messages: Sequence[ChatMessage]) -> list[str]:
    """Every text part of ``messages``, in order."""
    return [text for m in messages for text in _texts(m)]


def _texts(message: ChatMessage) -> list[str]:
    if isinstance(message.content, str):
        return [message.content]
    if isinstance(message.content, list):
        return [p.text for p in message.content if isinstance(p, TextPart)]
    return []
