"""Handoff bytes and time of a 4,000-token Gemma-style prompt, with and without the sliding-window saving.

    python -m bench.sliding_window_handoff [--tokens 4000] [--chunk-tokens 512] [--repeats 5]

Gemma 3 interleaves five sliding-window layers (window 1024) with one global layer. After
a prompt of ``n`` tokens decode needs a sliding layer's KV only from ``n - W + 1`` on
(``KVLayout.window_from``), so the prefill worker sends no older KV on those layers
(``KVChunk.sliding_from``; ``runtime/model/kv_pool.py``). Here a random-weight Gemma 3
checkpoint with that KV shape (12 layers, 10 sliding with W = 1024, 2 KV heads of 64,
float32; ``epd demo-model --family gemma3``'s builder with the decoder widened) is served
by a real ``epd decode`` process, and this process pushes one prompt's KV to it as the
prefill worker does: chunks read from a KV pool (``read`` dense, ``read_wire`` trimmed),
framed (checksum) beforehand, sent with the prefill worker's own ``KVSender`` over the
bulk TCP path and as ``Decode.PushKV`` messages: dense chunks to a decode worker started with
``--no-sliding-window-kv`` (every layer keeps every position), trimmed ones to one with the
default windowed pool (sliding layers in rings of about W positions). Beside the bytes sent, the
bytes kept: the blocks one reservation of the prompt takes on each worker. The clock runs from the first send to
decode's reply, which comes only after every chunk landed and the transfer verified
(``SUCCESS``). Dense and trimmed runs are interleaved repeat by repeat in one invocation;
the result is each one's bytes and median time and their ratios. JSON goes to
``bench/results/sliding_window_handoff.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness.host import host_basics
from bench.harness.report import finish_results, results_header
from bench.harness.servers import RESULTS, bench_process, free_port, wait_grpc, worker_cmd
from bench.kv_handoff import bulk_push, grpc_push
from launcher.processes import stop_group

MiB = 1 << 20
LAYERS = 12
WINDOW = 1024
GEMMA_STYLE = dict(num_hidden_layers=LAYERS, sliding_window=WINDOW, head_dim=64, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=8192,
                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(LAYERS)])


def frame(pool, blocks, n: int, chunk_tokens: int, fingerprint: str, trimmed: bool):
    """The prompt's ``KVChunk`` messages as the prefill worker frames them (dense, or sliding layers trimmed)."""
    from proto.epd.v1 import epd_pb2 as pb
    from runtime.model.tensor_bytes import dtype_name
    from runtime.worker.wire import payload_checksum

    layout = pool.layout
    sliding_from = layout.window_from(n) if trimmed else 0
    msgs = []
    for index, start in enumerate(range(0, n, chunk_tokens)):
        end = min(n, start + chunk_tokens)
        wire = pool.read_wire(blocks, start, end, layout.layer_from(start, end, sliding_from))
        payload = wire.numpy().tobytes()
        msgs.append(pb.KVChunk(request_id="bench", chunk_index=index, layer_start=0, layer_end=layout.layers,
                               token_start=start, token_end=end, dtype=dtype_name(layout.dtype),
                               shape=[layout.layers, 2, end - start, layout.kv_heads, layout.head_dim],
                               payload=payload, checksum=payload_checksum(payload), sliding_from=sliding_from))
    last = msgs[-1]
    last.last, last.total_chunks, last.first_token = True, len(msgs), 0
    last.token_digest, last.model_fingerprint = "bench-digest", fingerprint
    return msgs


async def kept_bytes(stub, layout, n: int, fingerprint: str) -> int:
    """What the decode worker holds for one ``n``-token prompt: the blocks a reservation takes (its free
    blocks before and after ``Reserve``) times one block's bytes there (a windowed pool's block holds
    the full-attention layers' share: ``PageGroups``)."""
    from proto.epd.v1 import epd_pb2 as pb
    from runtime.model.kv_layout import PageGroups

    before = await stub.Stats(pb.StatsRequest(), timeout=10)
    res = await stub.Reserve(pb.ReserveRequest(request_id="bench-kept", prompt_tokens=n, max_tokens=1,
                                               deadline_unix_ms=int((time.time() + 60) * 1000),
                                               token_digest="bench-digest", model_fingerprint=fingerprint), timeout=30)
    after = await stub.Stats(pb.StatsRequest(), timeout=10)
    await stub.Release(pb.ReleaseRequest(request_id="bench-kept", reservation=res.reservation, reason="bench"), timeout=30)
    page_layers = PageGroups.for_layout(layout, windowed=before.ring_groups > 0).page_layers
    page_bytes = page_layers * layout.layer_token_bytes * before.block_size
    return (before.free_blocks - after.free_blocks) * page_bytes


async def measure(addresses: dict[str, str], checkpoint: Path, args, results: dict) -> None:
    import torch

    from proto.epd.v1 import epd_pb2 as pb
    from proto.epd.v1 import epd_pb2_grpc as pb_grpc
    from runtime.model.kv_pool import KVBlockPool, KVLayout
    from runtime.model.model_adapter import sliding_layout
    from runtime.model.supported_models import load_config
    from runtime.worker.internal_auth import open_channel, token_from_env

    text = load_config(checkpoint).get_text_config()
    layout = KVLayout(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, torch.float32, **sliding_layout(text))
    n = args.tokens
    pool = KVBlockPool(layout, num_blocks=-(-n // 16), block_size=16)
    blocks = pool.allocate(n)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)))
    channels = {kind: open_channel(address, token_from_env()) for kind, address in addresses.items()}
    stubs = {kind: pb_grpc.DecodeStub(await ch.__aenter__()) for kind, ch in channels.items()}
    try:
        fingerprint = (await stubs["dense"].Stats(pb.StatsRequest(), timeout=10)).model_fingerprint
        runs = {kind: frame(pool, blocks, n, args.chunk_tokens, fingerprint, kind == "trimmed") for kind in ("dense", "trimmed")}
        sizes = {kind: sum(len(m.payload) for m in msgs) for kind, msgs in runs.items()}
        kept = {kind: await kept_bytes(stubs[kind], layout, n, fingerprint) for kind in runs}
        times: dict[str, list[float]] = {f"{kind}_{path}": [] for kind in runs for path in ("bulk", "grpc")}
        for kind, msgs in runs.items():        # warm-up, untimed
            await bulk_push(stubs[kind], msgs, n, fingerprint)
            await grpc_push(stubs[kind], msgs, n, fingerprint)
        for _ in range(args.repeats):
            for kind, msgs in runs.items():
                times[f"{kind}_bulk"].append(await bulk_push(stubs[kind], msgs, n, fingerprint))
                times[f"{kind}_grpc"].append((await grpc_push(stubs[kind], msgs, n, fingerprint))[0])
    finally:
        for ch in channels.values():
            await ch.__aexit__(None, None, None)
    med = {k: statistics.median(v) for k, v in times.items()}
    results.update(layout=layout.describe(), tokens=n, chunk_tokens=args.chunk_tokens, window=layout.sliding_window,
                   sliding_layers=len(layout.sliding_layers), window_from=layout.window_from(n), bytes=sizes,
                   bytes_ratio=sizes["trimmed"] / sizes["dense"], kept_bytes=kept,
                   kept_ratio=kept["trimmed"] / kept["dense"], seconds=times, median_s=med,
                   time_ratio_bulk=med["trimmed_bulk"] / med["dense_bulk"],
                   time_ratio_grpc=med["trimmed_grpc"] / med["dense_grpc"])
    print(f"KV {layout.describe()}; {n}-token prompt, {args.chunk_tokens}-token chunks, medians of {args.repeats}")
    for kind in runs:
        print(f"  {kind:<8} sent {sizes[kind] / MiB:8.2f} MiB   kept {kept[kind] / MiB:8.2f} MiB   "
              f"bulk {med[f'{kind}_bulk'] * 1000:8.1f} ms   PushKV {med[f'{kind}_grpc'] * 1000:8.1f} ms")
    print(f"  trimmed/dense: bytes sent {results['bytes_ratio']:.3f}, kept {results['kept_ratio']:.3f}, "
          f"time bulk {results['time_ratio_bulk']:.3f}, time PushKV {results['time_ratio_grpc']:.3f}")


def main(argv: list[str] | None = None) -> int:
    from runtime.demo_model.gemma3 import build_gemma3

    p = argparse.ArgumentParser(prog="python -m bench.sliding_window_handoff", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "sliding_window_handoff.json")
    args = p.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="sliding_window_handoff-"))
    checkpoint = build_gemma3("gemma3", logs / "gemma-style", text_overrides=GEMMA_STYLE)
    per_token = LAYERS * 2 * GEMMA_STYLE["num_key_value_heads"] * GEMMA_STYLE["head_dim"] * 4
    kv_mb = 2 * args.tokens * per_token // MiB + 64
    ports = {"dense": free_port(), "trimmed": free_port()}
    extra = {"dense": ["--no-sliding-window-kv"], "trimmed": []}   # the dense worker keeps every position
    workers = [bench_process(f"decode worker ({kind})", worker_cmd("decode", checkpoint, port, None,
                                                                    ["--kv-memory-mb", str(kv_mb), *extra[kind]]),
                             logs / f"decode-{kind}.log") for kind, port in ports.items()]
    results: dict = dict(**results_header("sliding_window_handoff", argv), host=host_basics(), repeats=args.repeats)
    try:
        for w in workers:
            w.start()
        addresses = {kind: f"127.0.0.1:{port}" for kind, port in ports.items()}
        for address in addresses.values():
            wait_grpc(address, workers, 180)
        started = time.perf_counter()
        asyncio.run(measure(addresses, checkpoint, args, results))
        results["wall_s"] = time.perf_counter() - started
    finally:
        stop_group(workers)
    finish_results(args.out, results, indent=2, allow_nan=True)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
