"""The hybrid handoff's typed state parts, at the decode worker's receiver (in process, real protos).

A reservation of a hybrid model holds KV blocks (the full-attention layers) and a
state slot (the linear-attention layers). The prefill side's chunks are framed as
the prefill worker frames them (``ChunkFraming``: the last chunk carries one
``StatePart`` per linear layer and kind); ``KVReceiver`` lands them. A good
transfer puts the prompt's exact state in the slot; any part whose layer, kind,
dtype, shape or checksum does not match the reservation — or a missing part, or
parts on a chunk that is not the last — rejects the chunk and fails the
transfer, with nothing written into the slot. Releasing frees the blocks and the
slot exactly once; a hybrid reservation never reuses a cached prefix.
"""

from __future__ import annotations

import pytest
import torch

from proto.epd.v1 import epd_pb2 as pb
from qwen3_5_cases import build_checkpoint
from qwen_vl_cases import GREEDY, prompts_for
from decode_svc.kv_receiver import ChunkOutcome, KVReceiver
from decode_svc.reservations import ReservationTable
from prefill_svc.kv_sender import ChunkFraming, FinalChunk, ReadyChunk
from runtime.model.families import PositionKind
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import FirstToken, KVChunk, VLMAdapter
from runtime.worker import state_parts
from runtime.worker.rope_delta import RopeDeltaRule
from runtime.worker.transfer_state import TransferState


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> VLMAdapter:
    torch.set_num_threads(1)
    return VLMAdapter.load(build_checkpoint(tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def prefilled(adapter):
    p = prompts_for(adapter)["three-images"]
    events = list(adapter.prefill(p.ids, p.embeddings, 16, GREEDY))
    return p, [e for e in events if isinstance(e, KVChunk)], events[-1]


def _decode_side(adapter):
    pool = KVBlockPool(adapter.kv_layout, num_blocks=32, block_size=8, prefix_cache=True)
    states = adapter.new_state_slots(2)
    table = ReservationTable(pool, states=states)
    return pool, states, table, KVReceiver(table, pool, RopeDeltaRule(PositionKind.MROPE), states=states)


def _headers(adapter, res, chunks: list[KVChunk], first: FirstToken):
    framing = ChunkFraming("req", pb.Reservation(reservation_id=res.reservation_id, generation=res.generation),
                           adapter.kv_layout, "digest", adapter.model_fingerprint)
    out = []
    for c in chunks:
        payload = memoryview(c.kv.contiguous().view(torch.uint8).numpy()).cast("B")
        final = None
        if c.state is not None:
            final = FinalChunk(len(chunks), first.sampled, 1.0, first.rope_delta, tuple(state_parts.to_pb(c.state)))
        header = framing.header(ReadyChunk(c.index, c.start, c.end, payload, final))
        header.payload = bytes(payload)
        out.append(header)
    return out


def _reserve(table, adapter, prompt, first):
    return table.reserve("req", len(prompt.ids), 4, 1e12, "digest", adapter.model_fingerprint, first.rope_delta)


def test_a_good_handoff_lands_the_exact_state(adapter, prefilled):
    prompt, chunks, first = prefilled
    pool, states, table, receiver = _decode_side(adapter)
    res = _reserve(table, adapter, prompt, first)
    assert res.state_slot is not None and states.free_slots == 1
    results = [receiver.land(h) for h in _headers(adapter, res, chunks, first)]
    assert all(r.outcome is ChunkOutcome.ACCEPTED for r in results), [r.detail for r in results]
    assert res.attempt.state is TransferState.SUCCESS
    assert states.position(res.state_slot) == len(prompt.ids)
    for part in chunks[-1].state:
        target = states.recurrent if part.kind == 1 else states.conv
        assert torch.equal(target[res.state_slot, states.index(part.layer)], part.tensor)
    assert table.release(res.reservation_id) and not table.release(res.reservation_id)
    assert states.free_slots == states.num_slots and pool.free_blocks == pool.num_blocks


def _wrong_layer(parts):
    parts[0].layer = 1            # a full-attention layer: it has no state


def _wrong_kind(parts):
    parts[0].CopyFrom(parts[1])   # two CONV parts for layer 0, no RECURRENT one


def _wrong_dtype(parts):
    parts[1].dtype = "float16"


def _wrong_shape(parts):
    parts[0].shape[0] = 8


def _missing(parts):
    del parts[-1]


def _corrupt(parts):
    data = bytearray(parts[2].data)
    data[0] ^= 1
    parts[2].data = bytes(data)


@pytest.mark.parametrize("tamper, detail", [
    (_wrong_layer, "layer 1, which has no linear-attention state"),
    (_wrong_kind, "duplicate CONV"),
    (_wrong_dtype, "float16"),
    (_wrong_shape, "has shape [8, 16, 16]"),
    (_missing, "state parts missing"),
    (_corrupt, "checksum mismatch on the RECURRENT state of layer 2"),
], ids=["layer", "kind", "dtype", "shape", "missing", "checksum"])
def test_a_state_part_mismatch_fails_the_handoff(adapter, prefilled, tamper, detail):
    prompt, chunks, first = prefilled
    pool, states, table, receiver = _decode_side(adapter)
    res = _reserve(table, adapter, prompt, first)
    headers = _headers(adapter, res, chunks, first)
    tamper(headers[-1].state_parts)
    results = [receiver.land(h) for h in headers]
    assert results[-1].outcome is ChunkOutcome.REJECTED and detail in results[-1].detail
    assert res.attempt.state is TransferState.FAILED
    assert states.position(res.state_slot) == 0 and not states.conv[res.state_slot].any(), "nothing landed"
    assert table.release(res.reservation_id)
    assert states.free_slots == states.num_slots and pool.free_blocks == pool.num_blocks


def test_state_parts_only_on_the_last_chunk(adapter, prefilled):
    prompt, chunks, first = prefilled
    _, states, table, receiver = _decode_side(adapter)
    res = _reserve(table, adapter, prompt, first)
    headers = _headers(adapter, res, chunks, first)
    headers[0].state_parts.extend(headers[-1].state_parts)
    result = receiver.land(headers[0])
    assert result.outcome is ChunkOutcome.REJECTED and "not the last" in result.detail
    table.release(res.reservation_id)
    assert states.free_slots == states.num_slots


def test_slots_bound_reservations_and_failures_take_nothing(adapter, prefilled):
    prompt, _, first = prefilled
    pool, states, table, _ = _decode_side(adapter)
    a, b = _reserve(table, adapter, prompt, first), _reserve(table, adapter, prompt, first)
    assert a and b and states.free_slots == 0
    blocks_free = pool.free_blocks
    assert _reserve(table, adapter, prompt, first) is None, "no slot: no reservation"
    assert pool.free_blocks == blocks_free, "a refused reservation takes no blocks"
    for r in (a, b):
        table.release(r.reservation_id)
    assert states.free_slots == 2 and pool.free_blocks == pool.num_blocks


def test_a_hybrid_reservation_never_reuses_or_caches_a_prefix(adapter, prefilled):
    """Cached KV at a block boundary has no linear state saved with it: reusing it would continue from a wrong
    state. A hybrid reservation asked to reuse a cached chain takes none of it and caches nothing on release."""
    prompt, _, first = prefilled
    pool, states, table, _ = _decode_side(adapter)
    keys = [bytes([i]) * 16 for i in range(len(prompt.ids) // pool.block_size)]
    res = table.reserve("req", len(prompt.ids), 4, 1e12, "digest", adapter.model_fingerprint, first.rope_delta,
                        prefix_keys=keys, reuse_prefix=True)
    assert res.prefix_keys == [] and res.shared == 0 and res.cached_tokens == 0
    res.keys_verified = True
    table.release(res.reservation_id, cache_tokens=len(prompt.ids))
    assert pool.cached_blocks == 0 and pool.free_blocks == pool.num_blocks
    again = table.reserve("req", len(prompt.ids), 4, 1e12, "digest", adapter.model_fingerprint, first.rope_delta,
                          prefix_keys=keys, reuse_prefix=True)
    assert again.shared == 0 and states.position(again.state_slot) == 0
    table.release(again.reservation_id)


def test_a_retry_resets_the_slot_and_lands_again(adapter, prefilled):
    """A failed attempt's state never survives a re-arm: the slot is back at position 0, and the retry's
    own last chunk lands the state again."""
    prompt, chunks, first = prefilled
    _, states, table, receiver = _decode_side(adapter)
    res = _reserve(table, adapter, prompt, first)
    headers = _headers(adapter, res, chunks, first)
    headers[-1].token_digest = "another prompt"          # the state lands, then verification fails
    for h in headers:
        receiver.land(h)
    assert res.attempt.state is TransferState.FAILED and states.position(res.state_slot) == len(prompt.ids)
    res = table.rearm(res.reservation_id)
    assert states.position(res.state_slot) == 0 and not states.recurrent[res.state_slot].any()
    for h in _headers(adapter, res, chunks, first):
        assert receiver.land(h).outcome is ChunkOutcome.ACCEPTED
    assert res.attempt.state is TransferState.SUCCESS and states.position(res.state_slot) == len(prompt.ids)
    table.release(res.reservation_id)
    assert states.free_slots == states.num_slots


def test_choices_are_refused_for_a_hybrid_model(adapter, tmp_path):
    """``n`` > 1 forks a sequence's KV; a hybrid decoder's linear-attention state lives in one slot per
    sequence, so the gateway refuses ``n`` by name and decode never reserves choices for it."""
    from gateway.prompt import PromptBuilder
    from gateway.sampling_fields import sampling_problem
    from runtime.model.sampling import SamplingParams
    from decode_svc.reservations import Fit

    builder = PromptBuilder.from_pretrained(adapter.model.name_or_path)
    assert not builder.forks_choices
    problem = sampling_problem(SamplingParams(n=2), 8, 100, builder.forks_choices)
    assert problem is not None and problem[0] == "n"
    assert sampling_problem(SamplingParams(n=1), 8, 100, builder.forks_choices) is None
    _, _, table, _ = _decode_side(adapter)
    assert table.can_reserve(10, 8, choices=2) is Fit.NEVER
    assert table.can_reserve(10, 8) is Fit.NOW
