"""Handoff bytes of a hybrid decoder (Qwen3.5) vs the same-size all-attention model, in one run.

Both checkpoints are built here with the same sizes (``runtime/demo_model/qwen3_5.py``:
8 layers; hybrid = the released pattern, three Gated DeltaNet layers then one full
attention, twice; the comparison = all 8 layers full attention). One prompt of
``--tokens`` tokens runs through each model's real chunked prefill; every chunk is
framed as the prefill worker frames it (``ChunkFraming``: header, KV payload, and on
the last chunk the linear layers' state parts) and landed through the decode
worker's ``KVReceiver`` into a reservation, which must end ``SUCCESS``. The bytes
counted are the serialized headers plus the payloads: what crosses the link.

Also printed, computed from the layouts alone (no weights, no run): the same sum for
the default ``Qwen3_5Config`` sizes.

    python -m bench.hybrid_handoff [--tokens 4000] [--chunk 512]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3_5Config

from bench.harness.host import host_basics
from bench.harness.paths import RESULTS
from bench.harness.report import finish_results, fmt, markdown_table, results_header
from decode_svc.kv_receiver import ChunkOutcome, KVReceiver
from decode_svc.reservations import ReservationTable
from prefill_svc.kv_sender import ChunkFraming, FinalChunk, ReadyChunk
from proto.epd.v1 import epd_pb2 as pb
from runtime.demo_model.qwen3_5 import build_qwen3_5
from runtime.model.families.qwen3_5 import Qwen3_5Family
from runtime.model.kv_pool import KVBlockPool, KVLayout
from runtime.model.model_adapter import FirstToken, KVChunk, VLMAdapter
from runtime.model.sampling import SamplingParams
from runtime.worker import state_parts
from runtime.worker.rope_delta import RopeDeltaRule
from runtime.worker.transfer_state import TransferState

LAYERS = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.hybrid_handoff", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS / "hybrid_handoff.json")
    return parser.parse_args(argv)


def measure(adapter: VLMAdapter, tokens: int, chunk: int) -> dict[str, Any]:
    """Prefill ``tokens`` text tokens, frame and land every chunk; the wire bytes by part."""
    ids = [int(t) for t in torch.randint(0, 400, (tokens,), generator=torch.Generator().manual_seed(0))]
    events = list(adapter.prefill(ids, [], chunk, SamplingParams()))
    chunks, first = [e for e in events if isinstance(e, KVChunk)], events[-1]
    assert isinstance(first, FirstToken)
    pool = KVBlockPool(adapter.kv_layout, num_blocks=-(-(tokens + 4) // 16), block_size=16)
    states = adapter.new_state_slots(1)
    table = ReservationTable(pool, states=states)
    receiver = KVReceiver(table, pool, RopeDeltaRule(adapter.family.position_kind), states=states)
    res = table.reserve("bench", tokens, 4, 1e12, "digest", adapter.model_fingerprint, first.rope_delta)
    framing = ChunkFraming("bench", pb.Reservation(reservation_id=res.reservation_id, generation=res.generation),
                           adapter.kv_layout, "digest", adapter.model_fingerprint)
    kv_bytes = state_bytes = header_bytes = 0
    for c in chunks:
        payload = memoryview(c.kv.contiguous().view(torch.uint8).numpy()).cast("B")
        parts = tuple(state_parts.to_pb(c.state)) if c.state else ()
        final = FinalChunk(len(chunks), first.sampled, 0.0, first.rope_delta, parts) if c.end == tokens else None
        header = framing.header(ReadyChunk(c.index, c.start, c.end, payload, final))
        state_bytes += state_parts.wire_bytes(header.state_parts)
        header_bytes += len(header.SerializeToString()) - state_parts.wire_bytes(header.state_parts)
        kv_bytes += len(payload)
        header.payload = bytes(payload)
        assert receiver.land(header).outcome is ChunkOutcome.ACCEPTED
    assert res.attempt.state is TransferState.SUCCESS, res.attempt.detail
    table.release(res.reservation_id)
    return {"kv_layers": adapter.kv_layout.layers, "state_layers": len(adapter.state_layout.layers) if adapter.hybrid else 0,
            "kv_bytes": kv_bytes, "state_bytes": state_bytes, "header_bytes": header_bytes,
            "total_bytes": kv_bytes + state_bytes + header_bytes, "chunks": len(chunks)}


def default_sizes(tokens: int) -> dict[str, Any]:
    """The same sum from layouts alone, for the default ``Qwen3_5Config`` (bf16 KV and conv, fp32 recurrent)."""
    config = Qwen3_5Config()
    family = Qwen3_5Family(config)
    text = config.get_text_config()
    layout = family.state_layout(torch.bfloat16)
    kv = KVLayout(len(family.kv_layer_indices()), text.num_key_value_heads, text.head_dim, torch.bfloat16)
    full = KVLayout(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, torch.bfloat16)
    hybrid = kv.bytes_per_token * tokens + layout.slot_bytes()
    return {"layers": text.num_hidden_layers, "kv_layers": kv.layers, "hybrid_bytes": hybrid,
            "all_attention_bytes": full.bytes_per_token * tokens, "ratio": hybrid / (full.bytes_per_token * tokens)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    payload = {**results_header("hybrid_handoff", argv), "host": host_basics(),
               "settings": {"tokens": args.tokens, "chunk": args.chunk, "layers": LAYERS}}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, all_attention in (("hybrid", False), ("all_attention", True)):
            path = build_qwen3_5("qwen3_5", Path(tmp) / name, all_attention=all_attention, layers=LAYERS,
                                 max_positions=max(2048, args.tokens + 64), full_attention_interval=4)
            runs[name] = measure(VLMAdapter.load(path), args.tokens, args.chunk)
    payload["runs"] = runs
    payload["ratio"] = runs["hybrid"]["total_bytes"] / runs["all_attention"]["total_bytes"]
    payload["default_config"] = default_sizes(args.tokens)
    finish_results(args.out, payload)
    rows = [[name, str(r["kv_layers"]), str(r["state_layers"]), f"{r['kv_bytes']:,}", f"{r['state_bytes']:,}",
             f"{r['header_bytes']:,}", f"{r['total_bytes']:,}"] for name, r in runs.items()]
    print(markdown_table(["model", "KV layers", "state layers", "KV bytes", "state bytes", "header bytes", "total"], rows))
    print(f"\nhybrid / all-attention handoff bytes for {args.tokens} tokens: {fmt(payload['ratio'], 3)}")
    rc = payload["default_config"]
    print(f"default Qwen3_5Config sizes (computed from layouts): {rc['hybrid_bytes']:,} vs "
          f"{rc['all_attention_bytes']:,} bytes, ratio {fmt(rc['ratio'], 3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
