"""One Hugging Face vision-language model as the three stage functions of E/P/D.

    encode(images)                      -> one embedding tensor per image
    prefill(token_ids, embeddings, n)   -> KV chunk per n tokens ..., then the first token
    decode_step(pool, batch)            -> one next token per sequence

Nothing of the model is re-implemented: the vision tower and projector run
through the model's own ``get_image_features``, the splice uses its image token
id, and the decoder layers run as they are with only attention redirected to the
KV block pool (see ``paged_attention``). Supported families and what a new one
needs are listed in ARCHITECTURE.md; ``load`` refuses anything else before
reading weights (``runtime.model.supported_models``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from runtime.model import paged_attention, supported_models
from runtime.model.errors import AdapterInputError, ImagePlaceholderMismatch, InvalidImage, PromptTooLong, TooManyImages
from runtime.model.kv_pool import KVBlockPool, KVLayout
from runtime.model.paged_attention import PagedBatch, SequenceSpan
from runtime.model.sampling import SamplingParams, sample_token

ACCEPTED_IMAGE_MODES = {"RGB", "RGBA", "L", "LA", "P", "CMYK", "YCbCr"}


@dataclass(slots=True)
class PackedItem:
    """One sequence's share of a packed forward: new tokens at ``start..start+len``."""

    embeds: torch.Tensor     # [q_len, hidden]
    start: int               # position of the first new token
    blocks: list[int]        # block table covering at least start+q_len positions
    want_logits: bool = True


@dataclass(slots=True)
class KVChunk:
    """KV of prompt positions ``start..end`` for every layer: ``[layers, 2, end-start, kv_heads, head_dim]``."""

    index: int
    start: int
    end: int
    kv: torch.Tensor


@dataclass(slots=True)
class FirstToken:
    token_id: int


@dataclass(slots=True)
class DecodeInput:
    token_id: int            # the last sampled token, whose KV is written this step
    position: int            # its position in the sequence
    blocks: list[int]
    sampling: SamplingParams


class VLMAdapter:
    """Owns the loaded model and processor; all methods are inference-only."""

    def __init__(self, model, processor, *, device: str = "cpu", max_images: int = 4, max_image_pixels: int = 4096 * 4096):
        self.model = model.eval()
        self.processor = processor
        self.device = torch.device(device)
        self.max_images = max_images
        self.max_image_pixels = max_image_pixels
        text_config = model.config.get_text_config()
        self.text_config = text_config
        self.context_length = int(text_config.max_position_embeddings)
        self.image_token_id = int(getattr(model.config, "image_token_id", None) or model.config.image_token_index)
        self.hidden_size = int(text_config.hidden_size)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self.kv_layout = KVLayout(
            layers=int(text_config.num_hidden_layers),
            kv_heads=int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads),
            head_dim=int(head_dim),
            dtype=next(model.parameters()).dtype,
        )
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else text_config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        paged_attention.register()
        text_config._attn_implementation = paged_attention.ATTN_IMPLEMENTATION
        self._decoder = model.model.language_model if hasattr(model.model, "language_model") else model.get_decoder()
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
        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa").to(device)
        adapter = cls(model, processor, device=device, **kwargs)
        adapter.model_fingerprint = model_fingerprint(Path(path), adapter.kv_layout)
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
        return image.convert("RGB") if image.mode != "RGB" else image

    @torch.inference_mode()
    def encode(self, images: Sequence[Image.Image]) -> list[torch.Tensor]:
        """Preprocess + vision tower + projector, batched: one ``[tokens, hidden]`` tensor per image."""
        if not images:
            return []
        rgb = [self.validate_image(im) for im in images]
        pixel_values = self.processor.image_processor(rgb, return_tensors="pt")["pixel_values"]
        return self.encode_pixels(pixel_values)

    @torch.inference_mode()
    def encode_pixels(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        out = self.model.get_image_features(pixel_values=pixel_values.to(self.device, self.kv_layout.dtype), return_dict=True)
        features = out.pooler_output
        return [f.reshape(-1, f.shape[-1]).contiguous() for f in features]

    # -- the splice -------------------------------------------------------------
    def check_prompt(self, token_ids: Sequence[int], image_embeddings: Sequence[torch.Tensor], max_new_tokens: int = 0) -> None:
        """Raise a typed error when the prompt cannot run: placeholders, image count, length."""
        if len(image_embeddings) > self.max_images:
            raise TooManyImages(f"{len(image_embeddings)} images; this server accepts at most {self.max_images} per request")
        placeholders = sum(1 for t in token_ids if t == self.image_token_id)
        features = sum(int(e.shape[0]) for e in image_embeddings)
        if placeholders != features:
            raise ImagePlaceholderMismatch(
                f"prompt has {placeholders} image placeholder tokens but {len(image_embeddings)} images give {features}"
            )
        if not token_ids:
            raise AdapterInputError("empty prompt")
        if len(token_ids) + max(max_new_tokens, 1) > self.context_length:
            raise PromptTooLong(
                f"prompt of {len(token_ids)} tokens plus {max_new_tokens} new tokens exceeds the context of {self.context_length}"
            )

    @torch.inference_mode()
    def embed(self, token_ids: Sequence[int], image_embeddings: Sequence[torch.Tensor]) -> torch.Tensor:
        """Token embeddings with image features spliced into the placeholders: ``[T, hidden]``."""
        self.check_prompt(token_ids, image_embeddings)
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        embeds = self._embed_tokens(ids)
        if image_embeddings:
            features = torch.cat([e.to(self.device, embeds.dtype) for e in image_embeddings])
            mask = (ids == self.image_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, features)
        return embeds

    def embed_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self._embed_tokens(torch.tensor(list(token_ids), dtype=torch.long, device=self.device))

    # -- the forward ------------------------------------------------------------
    @torch.inference_mode()
    def forward_packed(self, pool: KVBlockPool, items: Sequence[PackedItem]) -> list[torch.Tensor | None]:
        """Run all items' new tokens as one packed row; write their KV; return last-token logits."""
        spans, new_slots, positions, offset = [], [], [], 0
        for item in items:
            q_len = item.embeds.shape[0]
            end = item.start + q_len
            context = pool.runs(item.blocks, 0, end)
            spans.append(SequenceSpan(offset, q_len, [(slot, length) for _, slot, length in context]))
            for pos, slot, length in context:   # the new tokens' own slots: the context's tail
                if pos + length > item.start:
                    new_slots.extend(range(slot + max(0, item.start - pos), slot + length))
            positions.extend(range(item.start, end))
            offset += q_len
        slot_mapping = torch.tensor(new_slots, dtype=torch.long, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        batch = PagedBatch(pool.kv, slot_mapping, spans)
        embeds = torch.cat([i.embeds for i in items]).unsqueeze(0)
        with paged_attention.paged_forward():
            hidden = self._decoder(
                inputs_embeds=embeds, position_ids=position_ids.unsqueeze(0), use_cache=False, epd_batch=batch
            ).last_hidden_state[0]
        wanted = [i for i, item in enumerate(items) if item.want_logits]
        results: list[torch.Tensor | None] = [None] * len(items)
        if wanted:
            last = hidden[[spans[i].q_offset + spans[i].q_len - 1 for i in wanted]]
            logits = self._lm_head(last).float()
            for row, i in enumerate(wanted):
                results[i] = logits[row]
        return results

    def prefill(
        self,
        token_ids: Sequence[int],
        image_embeddings: Sequence[torch.Tensor],
        chunk_size: int,
        sampling: SamplingParams = SamplingParams(),
        pool: KVBlockPool | None = None,
    ) -> Iterator[KVChunk | FirstToken]:
        """Chunked prefill of one prompt: yields each chunk's KV as soon as it is computed, then the first token.

        With no ``pool`` given a private one sized for the prompt is used and dropped after.
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        embeds = self.embed(token_ids, image_embeddings)
        n = len(token_ids)
        pool = pool or KVBlockPool(self.kv_layout, num_blocks=-(-n // 16), block_size=16, device=self.device)
        blocks = pool.allocate(n)
        if blocks is None:  # a capacity problem of this worker, not the client's mistake
            raise MemoryError(f"prompt of {n} tokens does not fit the free KV blocks ({pool.free_blocks} free)")
        try:
            for index, start in enumerate(range(0, n, chunk_size)):
                end = min(n, start + chunk_size)
                (logits,) = self.forward_packed(pool, [PackedItem(embeds[start:end], start, blocks, want_logits=end == n)])
                yield KVChunk(index, start, end, pool.read(blocks, start, end).clone())
            yield FirstToken(sample_token(logits, sampling, n))
        finally:
            pool.free(blocks)

    def decode_step(self, pool: KVBlockPool, batch: Sequence[DecodeInput]) -> list[int]:
        """One token for every sequence in ``batch`` (any lengths), as one packed forward."""
        embeds = self.embed_tokens([b.token_id for b in batch])
        items = [PackedItem(embeds[i: i + 1], b.position, b.blocks) for i, b in enumerate(batch)]
        logits = self.forward_packed(pool, items)
        return [sample_token(l, b.sampling, b.position + 1) for l, b in zip(logits, batch)]


def model_fingerprint(path: Path, layout: KVLayout) -> str:
    """Identity of weights + cache format; prefill and decode must agree on it before a handoff.

    Hashes config.json and each weight file's name, size and first MiB, so it is
    cheap for multi-GB checkpoints yet changes with any re-export.
    """
    h = blake3.blake3()
    h.update(layout.describe().encode())
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
