"""Shared by the Qwen3.5 (hybrid decoder) tests: the split driven as the workers drive it, state slots included.

The prompts are ``qwen_vl_cases.CASES`` (images of several grids, multi-turn,
text-only); the reference is the loaded model's own ``generate()``.
"""

from __future__ import annotations

from pathlib import Path

from qwen_vl_cases import GREEDY, NEW_TOKENS, Prompt
from runtime.demo_model.qwen3_5 import build_qwen3_5
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import DecodeInput, FirstToken, KVChunk, VLMAdapter
from runtime.model.state_slots import StateSlotPool


def build_checkpoint(root: Path) -> Path:
    return build_qwen3_5("qwen3_5", root / "qwen3_5")


def land_prefill(adapter: VLMAdapter, pool: KVBlockPool, blocks: list[int], states: StateSlotPool, slot: int,
                 prompt: Prompt, chunk_size: int) -> FirstToken:
    """Chunked prefill on its own scratch (as the prefill worker), every chunk's KV landed in ``blocks`` and
    the last chunk's state parts in ``slot`` (as the decode worker lands a handoff)."""
    events = list(adapter.prefill(prompt.ids, prompt.embeddings, chunk_size, GREEDY, pool=pool))
    chunks, first = events[:-1], events[-1]
    assert isinstance(first, FirstToken) and all(isinstance(c, KVChunk) for c in chunks)
    assert all(c.state is None for c in chunks[:-1]) and chunks[-1].state, "state parts ride the last chunk only"
    for c in chunks:
        pool.write(blocks, c.start, c.kv, owner=pool.owner_of(blocks[0]))
    states.load(slot, chunks[-1].state, len(prompt.ids))
    return first


def run_split(adapter: VLMAdapter, pool: KVBlockPool, states: StateSlotPool, prompt: Prompt, chunk_size: int | None,
              new_tokens: int = NEW_TOKENS) -> list[int]:
    blocks = pool.allocate(len(prompt.ids) + new_tokens)
    slot = states.allocate()
    assert blocks is not None and slot is not None, "test pools too small"
    try:
        first = land_prefill(adapter, pool, blocks, states, slot, prompt, chunk_size or len(prompt.ids))
        tokens, position = [first.token_id], len(prompt.ids)
        while len(tokens) < new_tokens:
            (token,) = adapter.decode_step(pool, [DecodeInput(tokens[-1], position, blocks, GREEDY, first.rope_delta,
                                                              state_slot=slot)], states)
            tokens.append(token)
            position += 1
    finally:
        pool.free(blocks)
        states.free(slot)
    return tokens
