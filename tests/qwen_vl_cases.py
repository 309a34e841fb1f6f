"""Shared by the Qwen-VL tests: tiny checkpoints built once, the prompts, and the split driven like the workers.

``CASES`` cover one image, three images of different sizes (three different
grids) in one turn, a multi-turn conversation with images in an earlier turn,
a system prompt and a text-only prompt. Images are seeded noise, so every image
token carries a different feature.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from runtime.demo_model.qwen_vl import QwenFamily, build_qwen_vl
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import DecodeInput, FirstToken, KVChunk, VLMAdapter
from runtime.model.sampling import SamplingParams

FAMILIES = [f.value for f in QwenFamily]
NEW_TOKENS = 8
GREEDY = SamplingParams()


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (width, height), bytes(rng.randrange(256) for _ in range(width * height * 3)))


def user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}


@dataclass
class Case:
    name: str
    messages: list[dict]
    images: list[Image.Image] = field(default_factory=list)


CASES: list[Case] = [
    Case("one-image", [user(None, "what is in the image ?")], [noise_image(60, 40, 1)]),
    Case("three-images", [user("compare", None, "and", None, "with", None, "please")],
         [noise_image(100, 30, 2), noise_image(33, 77, 3), noise_image(128, 128, 4)]),
    Case("multi-turn", [user(None, "what is in the image ?"), {"role": "assistant", "content": "a red circle"},
                        user("and in this one ?", None), {"role": "assistant", "content": "a blue square"},
                        user("which one is bigger ?")],
         [noise_image(48, 64, 5), noise_image(90, 50, 6)]),
    Case("system-prompt", [{"role": "system", "content": "answer in few words ."}, user(None, "describe the image .")],
         [noise_image(200, 20, 7)]),
    Case("text-only", [user("hello what do you see in the sky ?")]),
]


def hf_images(images: list[Image.Image]) -> list[list[Image.Image]] | None:
    """A conversation's images as transformers' ``apply_chat_template`` hands them to the processor: one
    sample holding them all (LLaVA-OneVision's processor reads the count: several images are its multi-image
    form; every other family's processor gives what a flat list gives)."""
    return [list(images)] if images else None


def build_checkpoint(family: str, root: Path) -> Path:
    return build_qwen_vl(family, root / family)


@dataclass
class Prompt:
    inputs: dict                 # the processor's output (the conversation's images as one sample), what generate() takes
    ids: list[int]
    embeddings: list[torch.Tensor]   # adapter.encode in the prompt's layout variants: the encoder cache's tensors
    reference: list[int]         # generate()'s greedy NEW_TOKENS tokens (EOS disabled)


def prompts_for(adapter: VLMAdapter) -> dict[str, Prompt]:
    out = {}
    for case in CASES:
        text = adapter.processor.apply_chat_template(case.messages, add_generation_prompt=True)
        inputs = adapter.processor(images=hf_images(case.images), text=text, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        with torch.inference_mode():
            generated = adapter.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        reference = generated[0, len(ids):].tolist()
        assert len(reference) == NEW_TOKENS, "EOS was not disabled in the reference"
        out[case.name] = Prompt(inputs, ids, adapter.encode(case.images, adapter.layout_variants(len(case.images))),
                                reference)
    references = [tuple(p.reference) for p in out.values()]
    assert len(set(references)) == len(references) and all(len(set(r)) > 2 for r in references), (
        f"random model too degenerate for a meaningful identity check: {references}")
    return out


def land_prefill(adapter: VLMAdapter, pool: KVBlockPool, blocks: list[int], prompt: Prompt, chunk_size: int,
                 sampling: SamplingParams = GREEDY) -> FirstToken:
    """Chunked prefill (scratch blocks from ``pool`` too), every chunk landed in ``blocks`` as decode does."""
    events = list(adapter.prefill(prompt.ids, prompt.embeddings, chunk_size, sampling, pool=pool))
    chunks, first = events[:-1], events[-1]
    assert isinstance(first, FirstToken) and all(isinstance(c, KVChunk) for c in chunks)
    assert chunks[0].start == 0 and chunks[-1].end == len(prompt.ids)
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
    if adapter.family.bidirectional_images:   # boundaries at image-span edges; a chunk longer than chunk_size holds a span
        spans = image_runs(prompt.ids, adapter.image_token_id)
        assert not any(s < c.end < e for c in chunks for s, e in spans), "a chunk cut a bidirectional image span"
        assert all(c.end - c.start <= chunk_size or any(c.start <= s < e <= c.end and e - s > chunk_size - (s - c.start)
                                                          for s, e in spans) for c in chunks)
    else:
        assert all(c.end - c.start <= chunk_size for c in chunks)
    for c in chunks:
        pool.write(blocks, c.start, c.kv, owner=pool.owner_of(blocks[0]))
    return first


def run_split(adapter: VLMAdapter, pool: KVBlockPool, prompt: Prompt, chunk_size: int | None,
              new_tokens: int = NEW_TOKENS, rope_delta: int | None = None) -> list[int]:
    """Prefill then single-sequence decode steps; ``rope_delta`` overrides the prompt's (to show it matters)."""
    free_before = pool.free_blocks
    blocks = pool.allocate(len(prompt.ids) + new_tokens)
    assert blocks is not None, "test pool too small"
    try:
        first = land_prefill(adapter, pool, blocks, prompt, chunk_size or len(prompt.ids))
        delta = first.rope_delta if rope_delta is None else rope_delta
        tokens, position = [first.token_id], len(prompt.ids)
        while len(tokens) < new_tokens:
            (token,) = adapter.decode_step(pool, [DecodeInput(tokens[-1], position, blocks, GREEDY, delta)])
            tokens.append(token)
            position += 1
    finally:
        pool.free(blocks)
    assert pool.free_blocks == free_before, "prefill or decode leaked KV blocks"
    return tokens


def image_runs(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every run of image placeholder tokens."""
    runs, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            runs.append((start, i))
            start = None
    return runs
