"""One Hugging Face vision-language model as the three stage functions of E/P/D.

    encode(images)                      -> one embedding tensor per image (the encoder cache's form)
    prepare(token_ids, embeddings)      -> PreparedPrompt: spliced embeddings, positions, rope delta
    prefill(token_ids, embeddings, n)   -> KV chunk per n tokens ..., then the first token
    decode_step(pool, batch)            -> one next token per sequence

Nothing of the model is re-implemented: the vision tower and projector run
through the model's own ``get_image_features``, the splice uses its image token
id, M-RoPE positions come from the model's own ``get_rope_index``, DeepStack
features go through the decoder's own ``deepstack_visual_embeds``, and the
decoder layers run as they are with only attention redirected to the KV block
pool (see ``paged_attention``). What differs per family lives in
``runtime.model.families`` (docs/models.md); ``load`` refuses anything else
before reading weights (``runtime.model.supported_models``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from runtime.model import (attention_kernels, attention_reference, families, linear_attention, linear_kernels,
                           paged_attention, supported_models)
from runtime.model.errors import AdapterInputError, ImagePlaceholderMismatch, InvalidImage, PromptTooLong, TooManyImages
from runtime.model.families import ImageEmbedding, PositionKind
from runtime.model.decoder_kv import decoder_kv, sliding_layout  # noqa: F401 (sliding_layout: the bench reads it here)
from runtime.model.kv_pool import KVBlockPool, KVLayout
from runtime.model.packed_batch import DeepStackShare, PackedItem, pack
from runtime.model.paged_attention import PagedBatch
from runtime.model.prepared_prompt import PreparedPrompt
from runtime.model.sampling import SampledToken, SamplingContext, SamplingParams, sample
from runtime.model.state_slots import StateMismatch, StatePartData, StateSlotPool

__all__ = ["DecodeInput", "DeepStackShare", "FirstToken", "KVChunk", "PackedItem", "PreparedPrompt", "VLMAdapter"]

ACCEPTED_IMAGE_MODES = {"RGB", "RGBA", "L", "LA", "P", "CMYK", "YCbCr"}

ImageInput = torch.Tensor | ImageEmbedding   # a stored embedding (the encoder cache's tensor) or a decoded one


@dataclass(slots=True)
class KVChunk:
    """KV of prompt positions ``start..end`` for every layer: ``[layers, 2, end-start, kv_heads, head_dim]``, or,
    when layers differ in size (Gemma 4), the per-layer wire form (flat bytes, ``KVBlockPool.read_wire``)."""

    index: int
    start: int
    end: int
    kv: torch.Tensor
    state: list[StatePartData] | None = None   # hybrid decoders, on the last chunk: the linear layers' state at ``end``


@dataclass(slots=True)
class FirstToken:
    token_id: int
    rope_delta: int = 0      # what decode needs for this sequence (M-RoPE; 0 for 1-D families)
    sampled: SampledToken | None = None   # the token with its logprobs (when the sampling asked for them)


@dataclass(slots=True)
class DecodeInput:
    token_id: int            # the last sampled token, whose KV is written this step
    position: int            # its position in the sequence
    blocks: list[int]
    sampling: SamplingParams
    rope_delta: int | None = None   # M-RoPE: required (the prompt's delta); 1-D: None
    prompt_ids: Sequence[int] = ()  # what the sampling reads of the sequence (penalties): the prompt's ids
    output_ids: Sequence[int] = ()  # and the tokens emitted so far (``token_id`` included)
    state_slot: int | None = None   # hybrid decoders: the sequence's state slot (holding the state at ``position``)
    rings: list[list[int]] | None = None   # windowed pool: the sequence's ring pages (kv_pool)


class VLMAdapter:
    """Owns the loaded model and processor; all methods are inference-only."""

    def __init__(self, model, processor, *, device: str = "cpu", max_images: int = 8, max_image_pixels: int = 4096 * 4096,
                 attention_kernel: str = "auto", linear_kernel: str = "auto"):
        """``max_images``: a worker passes ``limit_images_per_request`` (default 8, the same as here).
        ``attention_kernel``: ``auto`` or one of ``attention_kernels.KERNELS``, fixed here at start-up
        (``self.attention_kernel`` names the choice; tests may set ``attention_reference.KERNEL``).
        ``linear_kernel``: ``auto`` or one of ``linear_kernels.KERNELS``, installed here into every
        linear layer of ``model`` (``generate()`` runs it too)."""
        self.model = model.eval()
        self.processor = processor
        self.device = torch.device(device)
        self.attention_kernel = attention_kernels.select_kernel(self.device, attention_kernel)
        kernel = linear_kernels.select_kernel(self.device, linear_kernel)
        # what the linear layers run: a model with none large enough for oneDNN keeps torch's
        self.linear_kernel = kernel if linear_kernels.install(self.model, kernel) else linear_kernels.TORCH
        self.max_images = max_images
        self.max_image_pixels = max_image_pixels
        self.family = families.family_for(model.config, model)
        text_config = model.config.get_text_config()
        self.text_config = text_config
        self.context_length = int(text_config.max_position_embeddings)
        self.image_token_id = self.family.image_token_id
        self.hidden_size = int(text_config.hidden_size)
        kv = decoder_kv(text_config, self.family.kv_layer_indices(), next(model.parameters()).dtype)
        self.kv_layout = kv.layout
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else text_config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.final_softcap = float(getattr(text_config, "final_logit_softcapping", None) or 0.0)
        paged_attention.register()
        text_config._attn_implementation = paged_attention.ATTN_IMPLEMENTATION
        self._decoder = model.model.language_model if hasattr(model.model, "language_model") else model.get_decoder()
        # hybrid decoders: the KV pool holds the full-attention layers only, the linear ones keep state slots
        self.state_layout = self.family.state_layout(self.kv_layout.dtype)
        types = list(getattr(text_config, "layer_types", None) or [])
        wide = self.family.bidirectional_layer_types   # layer types where images attend both ways (None: all)
        for layer, pool_layer in kv.pool_layer_of.items():
            attn = self._decoder.layers[layer].self_attn
            attn.epd_kv_layer, attn.epd_kv_reused = pool_layer, layer in kv.reused
            attn.epd_causal_images = wide is not None and layer < len(types) and types[layer] not in wide
        # Gemma 4: each layer also takes an embedding of the token ids (image positions: the pad id)
        self.per_layer_inputs = bool(getattr(text_config, "hidden_size_per_layer_input", 0))
        self.pad_token_id = getattr(text_config, "pad_token_id", None)
        if self.state_layout is not None:
            linear_attention.install(self._decoder.layers)
        self._embed_tokens = model.get_input_embeddings()
        self._lm_head = model.get_output_embeddings()
        self.model_fingerprint = "unset"
        self.preprocess_digest = blake3.blake3(
            json.dumps(processor.image_processor.to_dict(), sort_keys=True, default=str).encode()
        ).hexdigest()[:16]

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu", dtype: str | None = None, **kwargs) -> "VLMAdapter":
        supported_models.check_checkpoint(path)   # before any weights: UnsupportedModel, one line
        torch_dtype = getattr(torch, dtype) if dtype else "auto"
        processor = families.load_processor(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa").to(device)
        adapter = cls(model, processor, device=device, **kwargs)
        adapter.model_fingerprint = model_fingerprint(Path(path), adapter.kv_layout, adapter.state_layout)
        return adapter

    # -- encode -----------------------------------------------------------------
    def validate_image(self, image: object) -> Image.Image:
        if not isinstance(image, Image.Image):
            raise InvalidImage(f"expected a PIL image, got {type(image).__name__}")
        if image.mode not in ACCEPTED_IMAGE_MODES:
            raise InvalidImage(f"image mode {image.mode!r} is not supported (use RGB, RGBA, L or P)")
        w, h = image.size
        if w < 1 or h < 1 or w * h > self.max_image_pixels:
            raise InvalidImage(f"image of {w}x{h} pixels is outside 1..{self.max_image_pixels} pixels")
        problem = self.family.check_image(w, h)
        if problem is not None:
            raise InvalidImage(problem)
        return image.convert("RGB") if image.mode != "RGB" else image

    @torch.inference_mode()
    def encode(self, images: Sequence[Image.Image], variants: Sequence[str] | None = None) -> list[torch.Tensor]:
        """Preprocess + vision tower + projector, batched: one tensor per image in the family's storage
        layout (``[tokens, hidden]`` for LLaVA-style families; see ``families`` for the others).
        ``variants``: each image's layout variant (``family.layout_variant`` of its prompt's image count;
        ``None``: every image on its own, ``SINGLE_LAYOUT``)."""
        return [self.family.to_tensor(e) for e in self.encode_images(images, variants)]

    @torch.inference_mode()
    def encode_images(self, images: Sequence[Image.Image], variants: Sequence[str] | None = None) -> list[ImageEmbedding]:
        """Like ``encode``, as decoded ``ImageEmbedding`` records (features, grid, DeepStack levels)."""
        if not images:
            return []
        variants = [families.SINGLE_LAYOUT] * len(images) if variants is None else list(variants)
        if len(variants) != len(images):
            raise AdapterInputError(f"{len(variants)} layout variants for {len(images)} images")
        for v in variants:
            self.check_variant(v)
        rgb = [self.validate_image(im) for im in images]
        if all(v == families.SINGLE_LAYOUT for v in variants):
            return self.family.encode(self.model, self.processor, rgb, self.kv_layout.dtype, self.device)
        return self.family.encode_variants(self.model, self.processor, rgb, variants, self.kv_layout.dtype, self.device)

    def check_variant(self, variant: str) -> None:
        """``InvalidImage`` unless ``variant`` is one of this family's layout variants."""
        if variant not in self.family.layout_variants:
            raise InvalidImage(f"layout variant {variant!r} is not one of {self.family.name}'s "
                               f"{list(self.family.layout_variants)}")

    def layout_variants(self, n_images: int) -> list[str]:
        """The layout variant of each image of a prompt holding ``n_images`` images (the family's rule)."""
        return [self.family.layout_variant(n_images)] * n_images

    @torch.inference_mode()
    def encode_pixels(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """The tower on preprocessed fixed-size pixels (LLaVA-style families only)."""
        embeddings = self.family.encode_pixels(self.model, pixel_values.to(self.device, self.kv_layout.dtype))
        return [self.family.to_tensor(e) for e in embeddings]

    @property
    def longest_image_span(self) -> int:
        """The longest bidirectional image run a prompt can have (0: causal images): a chunk grows to it."""
        return self.family.longest_image_span(self.processor)

    def image_tokens(self, width: int, height: int, variant: str = families.SINGLE_LAYOUT) -> int:
        """Placeholder tokens of an image of this size in layout variant ``variant``: the processor's own rule."""
        return self.family.variant_image_tokens(self.processor, width, height, variant)

    # -- the splice -------------------------------------------------------------
    def embeddings(self, images: Sequence[ImageInput]) -> list[ImageEmbedding]:
        """Stored tensors (or records) as checked records; ``EmbeddingFormatError`` for a foreign layout."""
        return [e if isinstance(e, ImageEmbedding) else self.family.from_tensor(e) for e in images]

    def check_prompt(self, token_ids: Sequence[int], image_embeddings: Sequence[ImageInput], max_new_tokens: int = 0) -> None:
        """Raise a typed error when the prompt cannot run: image count, placeholders, length."""
        if len(image_embeddings) > self.max_images:
            raise TooManyImages(f"{len(image_embeddings)} images; this server accepts at most {self.max_images} per request")
        problem = self.family.check_placeholders(token_ids, self.embeddings(image_embeddings))
        if problem is not None:
            raise ImagePlaceholderMismatch(problem)
        if not token_ids:
            raise AdapterInputError("empty prompt")
        if len(token_ids) + max(max_new_tokens, 1) > self.context_length:
            raise PromptTooLong(
                f"prompt of {len(token_ids)} tokens plus {max_new_tokens} new tokens exceeds the context of {self.context_length}"
            )

    @torch.inference_mode()
    def prepare(self, token_ids: Sequence[int], image_embeddings: Sequence[ImageInput]) -> PreparedPrompt:
        """The prompt ready for chunked prefill: spliced embeddings, positions (and rope delta), DeepStack."""
        self.check_prompt(token_ids, image_embeddings)
        images = self.embeddings(image_embeddings)
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        embeds = self._embed_tokens(ids)
        mask = ids == self.image_token_id
        if images:
            features = torch.cat([e.features.to(self.device, embeds.dtype) for e in images])
            embeds = embeds.masked_scatter(mask.unsqueeze(-1), features)
        deepstack = None
        if images and images[0].deepstack is not None:
            deepstack = torch.cat([e.deepstack.to(self.device, embeds.dtype) for e in images], dim=1)
        plan = self.family.position_plan(token_ids, [e.grid for e in images])
        spans = tuple(families.image_spans(token_ids, self.image_token_id)) if self.family.bidirectional_images else ()
        layer_ids = None
        if self.per_layer_inputs:   # every placeholder looks up the pad token (Gemma4Model.forward)
            layer_ids = torch.tensor(self.family.per_layer_token_ids(token_ids), dtype=torch.long, device=self.device)
        return PreparedPrompt(embeds, plan, mask if deepstack is not None else None, deepstack, spans, layer_ids)

    @torch.inference_mode()
    def embed(self, token_ids: Sequence[int], image_embeddings: Sequence[ImageInput]) -> torch.Tensor:
        """Token embeddings with image features spliced into the placeholders: ``[T, hidden]``.

        Only for 1-D families, whose chunks need nothing else; the others must use ``prepare``.
        """
        if self.family.position_kind != PositionKind.ONE_D:
            raise TypeError(f"{self.family.describe()}: embeddings alone lose the positions; use prepare()")
        return self.prepare(token_ids, image_embeddings).embeds

    def embed_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self._embed_tokens(torch.tensor(list(token_ids), dtype=torch.long, device=self.device))

    # -- the forward ------------------------------------------------------------
    @property
    def hybrid(self) -> bool:
        """Whether sequences need a state slot beside their KV blocks (linear-attention layers)."""
        return self.state_layout is not None

    def new_state_slots(self, num_slots: int) -> StateSlotPool | None:
        """A state-slot pool for ``num_slots`` sequences (``None`` for a model without linear-attention layers)."""
        return None if self.state_layout is None else StateSlotPool(self.state_layout, num_slots, self.device)

    def _linear_batch(self, states: StateSlotPool | None, items: Sequence[PackedItem], spans) -> dict:
        if self.state_layout is None:
            return {}
        if states is None:
            raise StateMismatch("a hybrid model's forward needs the state slots of its sequences")
        linear = []
        for item, span in zip(items, spans):
            if item.state_slot is None:
                raise StateMismatch("a sequence of a hybrid model has no state slot")
            states.expect(item.state_slot, item.start)
            linear.append(linear_attention.LinearItem(span.q_offset, span.q_len, item.state_slot, item.start))
        return {"epd_linear": linear_attention.LinearBatch(states, linear)}

    @torch.inference_mode()
    def forward_packed(self, pool: KVBlockPool, items: Sequence[PackedItem],
                       states: StateSlotPool | None = None) -> list[torch.Tensor | None]:
        """Run all items' new tokens as one packed row; write their KV (and, for a hybrid decoder, update each
        item's state slot: ``states``); return last-token logits."""
        row = pack(pool, items, self.family.position_kind, self.device,
                   context_runs=self.attention_kernel == attention_reference.KERNEL)
        batch = PagedBatch(pool.layer_kv, row.slot_mapping, row.spans, row.groups, self.attention_kernel,
                           pool.groups if pool.groups.windowed else None, row.ring_slot_mappings)
        extra = self._linear_batch(states, items, row.spans)
        if self.per_layer_inputs:   # Gemma 4: the decoder adds an embedding of each token id to every layer
            if any(i.token_ids is None for i in items):
                raise ValueError("this model's forward needs every item's token ids (per-layer input embeddings)")
            ids = torch.cat([i.token_ids.to(self.device) for i in items])[None]
            extra["per_layer_inputs"] = self._decoder.get_per_layer_inputs(ids, row.embeds)
        if row.deepstack is not None:
            extra.update(visual_pos_masks=row.visual_mask, deepstack_visual_embeds=row.deepstack)
        with paged_attention.paged_forward():
            hidden = self._decoder(
                inputs_embeds=row.embeds, position_ids=row.position_ids, use_cache=False, epd_batch=batch, **extra
            ).last_hidden_state[0]
        if states is not None and self.state_layout is not None:
            for item in items:
                states.advance(item.state_slot, item.start + item.q_len)
        wanted = [i for i, item in enumerate(items) if item.want_logits]
        results: list[torch.Tensor | None] = [None] * len(items)
        if wanted:
            last = hidden[[row.spans[i].q_offset + row.spans[i].q_len - 1 for i in wanted]]
            logits = self._lm_head(last).float()
            if self.final_softcap:   # the model's own head does this after lm_head (Gemma)
                logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
            for r, i in enumerate(wanted):
                results[i] = logits[r]
        return results

    def prefill(
        self,
        token_ids: Sequence[int],
        image_embeddings: Sequence[ImageInput],
        chunk_size: int,
        sampling: SamplingParams = SamplingParams(),
        pool: KVBlockPool | None = None,
        states: StateSlotPool | None = None,
    ) -> Iterator[KVChunk | FirstToken]:
        """Chunked prefill of one prompt: yields each chunk's KV as soon as it is computed, then the first token.

        With no ``pool`` given a private one sized for the prompt is used and dropped after; a hybrid
        decoder's state is carried from chunk to chunk in one slot (of ``states``, or a private one) and
        read out on the last chunk (``KVChunk.state``).
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        prompt = self.prepare(token_ids, image_embeddings)
        n = len(prompt)
        pool = pool or KVBlockPool(self.kv_layout, num_blocks=-(-n // 16), block_size=16, device=self.device)
        chunk = max(chunk_size, prompt.longest_image_span)   # what one forward may write (chunk_end keeps spans whole)
        got = pool.allocate_sequence(n, chunk=chunk)
        if got is None:  # a capacity problem of this worker, not the client's mistake
            raise MemoryError(f"prompt of {n} tokens does not fit the free KV blocks ({pool.free_blocks} free)")
        blocks, rings = got
        pages = pool.owned_pages(blocks, rings)
        states = states if states is not None or not self.hybrid else self.new_state_slots(1)
        slot = states.allocate() if self.hybrid else None
        if self.hybrid and slot is None:
            pool.free(pages)
            raise MemoryError("no free state slot for the prompt's linear-attention state")
        try:
            index, start = 0, 0
            while start < n:
                end = prompt.chunk_end(start, chunk_size)   # never inside a bidirectional image span
                item = prompt.item(start, end, blocks, rings=rings)
                item.state_slot = slot
                (logits,) = self.forward_packed(pool, [item], states)
                state = states.read(slot) if slot is not None and end == n else None
                kv = (pool.read(blocks, start, end, rings) if self.kv_layout.uniform
                      else pool.read_wire(blocks, start, end, [start] * self.kv_layout.layers, rings))
                yield KVChunk(index, start, end, kv.clone(), state)
                index, start = index + 1, end
            first = sample(logits, sampling, SamplingContext(list(token_ids), (), self.eos_token_ids), n)
            yield FirstToken(first.token_id, prompt.rope_delta, first)
        finally:
            pool.free(pages)
            if slot is not None:
                states.free(slot)

    def decode_step(self, pool: KVBlockPool, batch: Sequence[DecodeInput], states: StateSlotPool | None = None) -> list[int]:
        """One token for every sequence in ``batch`` (any lengths), as one packed forward."""
        return [s.token_id for s in self.decode_sample(pool, batch, states)]

    def decode_sample(self, pool: KVBlockPool, batch: Sequence[DecodeInput],
                      states: StateSlotPool | None = None) -> list[SampledToken]:
        """``decode_step`` with each token's logprobs (when its sampling asks for them)."""
        ids = torch.tensor([b.token_id for b in batch], dtype=torch.long)
        embeds = self.embed_tokens(ids.tolist())
        items = [PackedItem(embeds[i: i + 1], b.position, b.blocks, rope_delta=b.rope_delta, state_slot=b.state_slot,
                            rings=b.rings, token_ids=ids[i: i + 1]) for i, b in enumerate(batch)]
        logits = self.forward_packed(pool, items, states)
        return [sample(l, b.sampling, SamplingContext(b.prompt_ids, b.output_ids, self.eos_token_ids), b.position + 1)
                for l, b in zip(logits, batch)]


def model_fingerprint(path: Path, layout: KVLayout, state=None) -> str:
    """Identity of weights + cache format; prefill and decode must agree on it before a handoff.

    Hashes config.json and each weight file's name, size and first MiB, so it is
    cheap for multi-GB checkpoints yet changes with any re-export.
    """
    h = blake3.blake3()
    h.update(layout.describe().encode())
    if state is not None:
        h.update(state.describe().encode())
    path = Path(path)
    if path.is_dir():
        for name in sorted(p.name for p in path.iterdir() if p.suffix in {".json", ".safetensors", ".bin"}):
            f = path / name
            h.update(name.encode())
            h.update(str(f.stat().st_size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
    else:
        h.update(str(path).encode())
    return h.hexdigest()[:24]
