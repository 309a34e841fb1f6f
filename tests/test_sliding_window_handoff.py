"""Sliding-window layers in the KV handoff (issue 18): their KV older than the window is not sent.

Gemma 3's sliding layers read no key ``W`` or more positions back, so after a prompt of
``n`` tokens decode needs those layers' KV only from ``KVLayout.window_from(n) = n-W+1``.
Here the prefill side's wire form (``KVBlockPool.read_wire``) and both landing paths of
decode (``write_wire`` for gRPC, ``host_views`` for the bulk socket) agree byte for byte;
a real prompt's chunks trimmed to the window land through ``KVReceiver`` into a
reservation and decode exactly what ``generate()`` does, with fewer bytes; a chunk that
trims past the window, or trims on a model without sliding layers, fails the transfer;
and such a reservation's blocks are never cached.
"""

from __future__ import annotations

import time

import pytest
import torch
from qwen_vl_cases import GREEDY, prompts_for

from decode_svc.kv_receiver import ChunkOutcome, KVReceiver, StreamTally
from decode_svc.reservations import ReservationTable
from proto.epd.v1 import epd_pb2 as pb
from runtime.demo_model.gemma3 import WINDOW, build_gemma3
from runtime.model.kv_pool import KVBlockPool, KVLayout
from runtime.model.model_adapter import DecodeInput, KVChunk, VLMAdapter
from runtime.model.tensor_bytes import dtype_name
from runtime.worker.transfer_state import TransferState, from_wire
from runtime.worker.wire import payload_checksum

LAYOUT = KVLayout(layers=4, kv_heads=2, head_dim=4, dtype=torch.float32, sliding_layers=(0, 1, 3), sliding_window=5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


def test_wire_form_round_trips_on_both_landing_paths():
    src = KVBlockPool(LAYOUT, num_blocks=16, block_size=4)
    blocks = src.allocate(30)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(0)))
    start, end, sliding_from = 8, 20, LAYOUT.window_from(30)         # 26: sliding layers carry nothing of 8..20
    assert sliding_from == 26
    for s, e in ((8, 20), (20, 30)):
        layer_from = LAYOUT.layer_from(s, e, sliding_from)
        wire = src.read_wire(blocks, s, e, layer_from)
        assert wire.numel() == LAYOUT.wire_bytes(s, e, sliding_from) < (e - s) * LAYOUT.bytes_per_token
        for path in ("write_wire", "host_views"):
            dst = KVBlockPool(LAYOUT, num_blocks=16, block_size=4)
            table = list(reversed(dst.allocate(30)))      # another block order than the sender's
            owner = dst.owner_of(table[0])
            if path == "write_wire":
                dst.write_wire(table, s, e, wire, layer_from, owner=owner)
            else:
                views, offset = dst.host_views(table, s, e, owner=owner, layer_from=layer_from), 0
                raw = wire.numpy().tobytes()
                for view in views:
                    view[:] = raw[offset: offset + len(view)]
                    offset += len(view)
                assert offset == len(raw)
            got, want = dst.read(table, s, e), src.read(blocks, s, e)
            for layer in range(LAYOUT.layers):
                first = layer_from[layer] - s
                torch.testing.assert_close(got[layer, :, first:], want[layer, :, first:])
                assert not got[layer, :, :first].any(), "positions left out stay unwritten"
    assert src.read_wire(blocks, 0, 8, LAYOUT.layer_from(0, 8, 0)).numel() == 8 * LAYOUT.bytes_per_token


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> VLMAdapter:
    return VLMAdapter.load(build_gemma3("gemma3", tmp_path_factory.mktemp("ckpt") / "gemma3"))


def _chunks(adapter, p, reservation, chunk_tokens, sliding_from):
    """The prompt's chunks as prefill frames them, sliding layers from ``sliding_from``."""
    layout, n = adapter.kv_layout, len(p.ids)
    scratch = KVBlockPool(layout, num_blocks=64, block_size=8)
    blocks = scratch.allocate(n)
    prepared = adapter.prepare(p.ids, p.embeddings)
    msgs, start, first = [], 0, None
    while start < n:
        end = prepared.chunk_end(start, chunk_tokens)
        (logits,) = adapter.forward_packed(scratch, [prepared.item(start, end, blocks)])
        payload = scratch.read_wire(blocks, start, end, layout.layer_from(start, end, sliding_from)).numpy().tobytes()
        msgs.append(pb.KVChunk(request_id="r", reservation=reservation, chunk_index=len(msgs), layer_start=0,
                               layer_end=layout.layers, token_start=start, token_end=end, dtype=dtype_name(layout.dtype),
                               shape=[layout.layers, 2, end - start, layout.kv_heads, layout.head_dim],
                               payload=payload, checksum=payload_checksum(payload), sliding_from=sliding_from))
        start = end
        first = logits
    msgs[-1].last, msgs[-1].total_chunks, msgs[-1].first_token = True, len(msgs), int(first.argmax())
    msgs[-1].token_digest, msgs[-1].model_fingerprint = "digest", "fp"
    return msgs


def _land(adapter, p, chunk_tokens, sliding_from, pool=None):
    pool = pool or KVBlockPool(adapter.kv_layout, num_blocks=64, block_size=8, prefix_cache=True)
    table = ReservationTable(pool)
    res = table.reserve("req", len(p.ids), 8, time.monotonic() + 30, "digest", "fp",
                        prefix_keys=[bytes([i]) * 8 for i in range(len(p.ids) // 8)])
    res.keys_verified = True
    receiver = KVReceiver(table, pool)
    msgs = _chunks(adapter, p, pb.Reservation(reservation_id=res.reservation_id, generation=1), chunk_tokens,
                   sliding_from)
    results = [receiver.land(m) for m in msgs]
    return pool, table, res, msgs, results


@pytest.mark.parametrize("chunk_tokens", [7, 64])
def test_trimmed_handoff_decodes_what_generate_does_with_fewer_bytes(adapter, chunk_tokens):
    prompts = prompts_for(adapter)
    for name, p in prompts.items():
        n = len(p.ids)
        assert n > WINDOW + 8, name
        sliding_from = adapter.kv_layout.window_from(n)
        pool, table, res, msgs, results = _land(adapter, p, chunk_tokens, sliding_from)
        assert all(r.outcome == ChunkOutcome.ACCEPTED for r in results), (name, [r.detail for r in results])
        assert res.attempt.state == TransferState.SUCCESS and res.attempt.window_trimmed
        dense = n * adapter.kv_layout.bytes_per_token
        assert res.attempt.bytes_received == sum(len(m.payload) for m in msgs) < dense
        tokens, position = [res.attempt.first_token], n
        while len(tokens) < len(p.reference):
            (t,) = adapter.decode_step(pool, [DecodeInput(tokens[-1], position, res.blocks, GREEDY)])
            tokens.append(t)
            position += 1
        assert tokens == p.reference, name
        table.release(res.reservation_id, cache_tokens=n)
        assert pool.cached_blocks == 0 and pool.free_blocks == pool.num_blocks, "trimmed KV must not be cached"


def test_trimming_past_the_window_fails_the_transfer(adapter):
    p = prompts_for(adapter)["three-images"]
    too_far = adapter.kv_layout.window_from(len(p.ids)) + 1
    pool, table, res, _, results = _land(adapter, p, 64, too_far)
    assert results[0].outcome == ChunkOutcome.REJECTED and "leaves out KV decode needs" in results[0].detail
    assert res.attempt.state == TransferState.FAILED
    table.release(res.reservation_id)
    assert pool.free_blocks == pool.num_blocks


def test_an_untrimmed_handoff_is_still_cached():
    """Without trimming (sliding_from 0) the same reservation's full prompt blocks go to the prefix cache."""
    layout = KVLayout(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
    pool = KVBlockPool(layout, num_blocks=8, block_size=4, prefix_cache=True)
    table = ReservationTable(pool)
    res = table.reserve("req", 8, 4, time.monotonic() + 30, "d", "fp", prefix_keys=[b"a" * 8, b"b" * 8])
    res.keys_verified = True
    receiver = KVReceiver(table, pool)
    payload = torch.zeros(layout.layers, 2, 8, 1, 4).view(torch.uint8).numpy().tobytes()
    chunk = pb.KVChunk(request_id="r", reservation=pb.Reservation(reservation_id=res.reservation_id, generation=1),
                       chunk_index=0, layer_start=0, layer_end=2, token_start=0, token_end=8, dtype="float32",
                       shape=[2, 2, 8, 1, 4], payload=payload, checksum=payload_checksum(payload), last=True,
                       total_chunks=1, token_digest="d", model_fingerprint="fp", sliding_from=3)
    refused = receiver.land(chunk)   # no sliding layers: any trimming leaves out KV decode needs
    assert refused.outcome == ChunkOutcome.REJECTED
    table.release(res.reservation_id)
    res = table.reserve("req", 8, 4, time.monotonic() + 30, "d", "fp", prefix_keys=[b"a" * 8, b"b" * 8])
    res.keys_verified = True
    chunk.reservation.reservation_id, chunk.sliding_from = res.reservation_id, 0
    assert receiver.land(chunk).outcome == ChunkOutcome.ACCEPTED and not res.attempt.window_trimmed
    table.release(res.reservation_id, cache_tokens=8)
    assert pool.cached_blocks == 2


def test_a_stream_reports_success_even_when_its_sequence_ended_before_the_streams_end(adapter):
    """A short prompt's one chunk verifies, decode inserts it, generates and releases it, and only then
    reads the stream's end: the reply still says SUCCESS (else prefill retries a finished request)."""
    p = prompts_for(adapter)["text-only"]
    pool = KVBlockPool(adapter.kv_layout, num_blocks=64, block_size=8)
    table = ReservationTable(pool)
    res = table.reserve("req", len(p.ids), 8, time.monotonic() + 30, "digest", "fp")
    receiver = KVReceiver(table, pool)
    tally = StreamTally(receiver)
    for m in _chunks(adapter, p, pb.Reservation(reservation_id=res.reservation_id, generation=1), 4096,
                     adapter.kv_layout.window_from(len(p.ids))):
        tally.saw(m)
        tally.record(receiver.land(m))
    assert table.release(res.reservation_id)       # the sequence ran to its end meanwhile
    reply = tally.reply()
    assert from_wire(reply.state) is TransferState.SUCCESS and reply.accepted == 1
