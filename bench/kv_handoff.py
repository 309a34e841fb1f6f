"""KV handoff throughput between two processes: the real PushKV path vs a plain TCP socket.

    python -m bench.kv_handoff [--total-mib 256] [--chunk-mib 4,8,16] [--repeats 3]

What is timed (see bench/HANDOFF.md for results and analysis):

* ``grpc``: a real decode worker process (``epd decode``, KV pool sized for the
  transfer) receives one request's prompt KV as ``KVChunk`` messages on one
  ``Decode.PushKV`` client stream from this process. Per repeat: ``Reserve``
  (untimed), then the clock runs from the first send to the ``PushKVResponse``,
  which decode sends only after every chunk was checksummed, landed in the pool
  and the transfer verified (state ``SUCCESS``); then ``Release``. The chunks are
  framed beforehand, as the prefill worker frames each one (payload bytes +
  blake3 checksum) in the prefill step that computed it; that framing cost is
  reported separately.
* ``socket``: a plain TCP server process on loopback ``recv_into``s the same
  number of bytes into a preallocated buffer and answers one byte; the clock
  runs from the first ``sendall`` to that byte.
* ``grpc_raw`` (for the analysis): the same payload bytes on one stream-unary
  call to a bare ``grpc.aio`` server process (same channel options) that only
  counts them: gRPC's own transport cost in Python, without protobuf, checksum
  or pool.

All three run in the same invocation, interleaved repeat by repeat. An in-process
breakdown times each stage of the gRPC path on its own (``--no-breakdown`` skips it).
Results: printed, and written as JSON to ``bench/results/kv_handoff.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from bench.harness.host import host_basics
from bench.harness.report import finish_results, results_header
from bench.harness.servers import RESULTS, ROOT, Process, bench_process, free_port, wait_grpc, worker_cmd
from bench.kv_handoff_baselines import (
    MiB,
    baseline_processes,
    grpc_raw_push,
    grpc_raw_server,
    socket_send,
    socket_server,
    start_until_ready,
)
from launcher.processes import stop_group

DEFAULT_MODEL = ROOT / "models" / "demo-vlm"


def kv_shape(model: Path) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the model's KV cache, from its config alone."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return int(text.num_hidden_layers), int(text.num_key_value_heads or text.num_attention_heads), int(head_dim)


# -- the gRPC side ------------------------------------------------------------------------
def frame_chunks(kv, chunk_tokens: int, layout, fingerprint: str):
    """KVChunk messages as prefill_svc frames them: payload bytes + blake3, final-chunk fields."""
    import torch

    from proto.epd.v1 import epd_pb2 as pb
    from runtime.model.tensor_bytes import dtype_name
    from runtime.worker.wire import payload_checksum

    n = kv.shape[2]
    msgs, checksum_s, frame_s = [], 0.0, 0.0
    for index, start in enumerate(range(0, n, chunk_tokens)):
        end = min(n, start + chunk_tokens)
        t0 = time.perf_counter()
        payload = kv[:, :, start:end].contiguous().view(torch.uint8).numpy().tobytes()
        t1 = time.perf_counter()
        checksum = payload_checksum(payload)
        t2 = time.perf_counter()
        msgs.append(pb.KVChunk(request_id="bench", chunk_index=index, layer_start=0, layer_end=layout.layers,
                               token_start=start, token_end=end, dtype=dtype_name(layout.dtype),
                               shape=[layout.layers, 2, end - start, layout.kv_heads, layout.head_dim],
                               payload=payload, checksum=checksum))
        frame_s += (t1 - t0) + (time.perf_counter() - t2)
        checksum_s += t2 - t1
    last = msgs[-1]
    last.last, last.total_chunks, last.first_token = True, len(msgs), 0
    last.token_digest, last.model_fingerprint = "bench-digest", fingerprint
    return msgs, checksum_s, frame_s


async def grpc_push(stub, msgs, n_tokens: int, fingerprint: str) -> tuple[float, float | None]:
    """One timed handoff: (seconds first send -> PushKVResponse, decode's own transfer sample in s)."""
    from proto.epd.v1 import epd_pb2 as pb

    before = (await stub.Stats(pb.StatsRequest(), timeout=10)).last_sample
    res = await stub.Reserve(pb.ReserveRequest(request_id="bench", prompt_tokens=n_tokens, max_tokens=1,
                                               deadline_unix_ms=int((time.time() + 600) * 1000),
                                               token_digest="bench-digest", model_fingerprint=fingerprint), timeout=30)
    for m in msgs:
        m.reservation.CopyFrom(res.reservation)
    t0 = time.perf_counter()
    ack = await stub.PushKV(iter(msgs), timeout=600)
    elapsed = time.perf_counter() - t0
    if ack.state != "SUCCESS" or ack.accepted != len(msgs):
        raise RuntimeError(f"transfer not verified: {ack}")
    stats = await stub.Stats(pb.StatsRequest(since_sample=before), timeout=10)
    server = [s.ms / 1000 for s in stats.samples if s.kind == "transfer"]
    await stub.Release(pb.ReleaseRequest(request_id="bench", reservation=res.reservation, reason="bench"), timeout=30)
    return elapsed, (server[-1] if server else None)


async def bulk_push(stub, msgs, n_tokens: int, fingerprint: str) -> float:
    """One timed handoff over the bulk TCP path with the prefill worker's own ``KVSender``."""
    from prefill_svc.kv_sender import KVSender
    from proto.epd.v1 import epd_pb2 as pb
    from runtime.worker.faults import FaultInjector
    from runtime.worker.internal_auth import token_from_env

    res = await stub.Reserve(pb.ReserveRequest(request_id="bench", prompt_tokens=n_tokens, max_tokens=1,
                                               deadline_unix_ms=int((time.time() + 600) * 1000),
                                               token_digest="bench-digest", model_fingerprint=fingerprint), timeout=30)
    if not res.bulk_address:
        raise RuntimeError("decode worker has no bulk KV path (--kv-transport bulk)")
    sender = KVSender(stub, 600, FaultInjector(""), bulk_address=res.bulk_address, bulk_token=token_from_env())
    for m in msgs:
        header = pb.KVChunk()
        header.CopyFrom(m)
        payload = header.payload
        header.ClearField("payload")
        header.payload_bytes = len(payload)
        header.reservation.CopyFrom(res.reservation)
        sender.put(header, payload)
    sender.finish()
    t0 = time.perf_counter()
    sender.start()
    ack = await sender.wait()
    elapsed = time.perf_counter() - t0
    if ack.accepted != len(msgs):
        raise RuntimeError(f"bulk transfer not verified: {ack}")
    await stub.Release(pb.ReleaseRequest(request_id="bench", reservation=res.reservation, reason="bench"), timeout=30)
    return elapsed


# -- where the time goes: each stage of the gRPC path, in this process ---------------------
def breakdown(kv, msgs, layout, block_size: int = 16, reps: int = 3) -> dict[str, float]:
    """Seconds per stage for the whole transfer, each stage timed alone in this process (best of ``reps``)."""
    import torch

    from proto.epd.v1 import epd_pb2 as pb
    from runtime.model.kv_pool import KVBlockPool
    from runtime.model.tensor_bytes import dtype_from_name
    from runtime.worker.wire import payload_checksum

    n_tokens = kv.shape[2]
    out: dict[str, float] = {}

    def timed(name, fn):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t0)
            del result
        out[name] = best

    payloads = [m.payload for m in msgs]
    target = bytearray(max(len(p) for p in payloads))
    timed("reference: one copy into a fresh buffer (bytearray(p))", lambda: [bytearray(p) for p in payloads])

    def copy_into_preallocated():
        view = memoryview(target)
        for p in payloads:
            view[: len(p)] = p
    timed("reference: one copy into a preallocated buffer", copy_into_preallocated)
    timed("sender (client loop): SerializeToString", lambda: [m.SerializeToString() for m in msgs])
    wire = [m.SerializeToString() for m in msgs]
    timed("receiver: KVChunk.FromString (grpc deserializer)", lambda: [pb.KVChunk.FromString(w) for w in wire])
    parsed = [pb.KVChunk.FromString(w) for w in wire]
    del wire
    timed("receiver: read msg.payload once (a copy per read)", lambda: [m.payload for m in parsed])
    got = [m.payload for m in parsed]
    timed("receiver: blake3 checksum verify", lambda: [payload_checksum(p) for p in got])

    def frombuffer():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return [torch.frombuffer(p, dtype=torch.uint8).view(dtype_from_name(m.dtype)).view(tuple(m.shape))
                    for p, m in zip(got, parsed)]
    timed("receiver: torch.frombuffer + view (no copy)", frombuffer)
    views = frombuffer()
    pool = KVBlockPool(layout, -(-n_tokens // block_size) + 1, block_size)
    owner = pool.new_token()
    blocks = pool.allocate(n_tokens, owner)
    timed("receiver: pool.write (slots() + indexed copy)",
          lambda: [pool.write(blocks, m.token_start, v, owner=owner) for m, v in zip(parsed, views)])
    timed("  of which slots() index construction",
          lambda: [pool.slots(blocks, m.token_start, m.token_end) for m in parsed])
    flat = pool._flat

    def contiguous_copy():
        for m, v in zip(parsed, views):
            flat[:, :, m.token_start: m.token_end].copy_(v)
    timed("reference: the same landing as a slice copy_ (no index)", contiguous_copy)
    receiver = ("receiver: KVChunk.FromString (grpc deserializer)", "receiver: read msg.payload once (a copy per read)",
                "receiver: blake3 checksum verify", "receiver: torch.frombuffer + view (no copy)",
                "receiver: pool.write (slots() + indexed copy)")
    out["receiver total (sum of the stages above, no transport)"] = sum(out[k] for k in receiver)
    return out


# -- main ----------------------------------------------------------------------------------
async def run_grpc_side(address: str, args, results: dict, socket_port: int, raw_address: str) -> None:
    import grpc
    import torch

    from proto.epd.v1 import epd_pb2 as pb
    from proto.epd.v1 import epd_pb2_grpc as pb_grpc
    from runtime.worker.internal_auth import open_channel, token_from_env
    from runtime.model.kv_pool import KVLayout
    from runtime.worker.wire import GRPC_OPTIONS

    async with open_channel(address, token_from_env()) as ch, \
            grpc.aio.insecure_channel(raw_address, options=GRPC_OPTIONS) as raw_ch:
        stub = pb_grpc.DecodeStub(ch)
        stats = await stub.Stats(pb.StatsRequest(), timeout=10)
        fingerprint = stats.model_fingerprint
        layout = KVLayout(*kv_shape(args.model), torch.float32)
        per_token = layout.bytes_per_token
        n_tokens = args.total_mib * MiB // per_token
        total = n_tokens * per_token
        results.update(layout=layout.describe(), bytes_per_token=per_token, tokens=n_tokens, total_bytes=total,
                       pool_blocks=stats.total_blocks, block_size=stats.block_size)
        print(f"KV {layout.describe()}: {per_token} B/token; {n_tokens} tokens = {total / MiB:.2f} MiB per handoff")
        kv = torch.randn((layout.layers, 2, n_tokens, layout.kv_heads, layout.head_dim), dtype=torch.float32)
        raw = memoryview(kv.view(torch.uint8).numpy()).cast("B")
        assert len(raw) == total

        for chunk_mib in args.chunk_mib:
            chunk_tokens = max(1, int(chunk_mib * MiB) // per_token)
            msgs, checksum_s, frame_s = frame_chunks(kv, chunk_tokens, layout, fingerprint)
            row = dict(chunk_mib=chunk_mib, chunk_tokens=chunk_tokens, chunks=len(msgs),
                       chunk_bytes=chunk_tokens * per_token, sender_checksum_s=checksum_s, sender_frame_s=frame_s,
                       grpc_s=[], decode_transfer_sample_s=[], socket_s=[], grpc_raw_s=[], bulk_s=[])
            pieces = [m.payload for m in msgs]
            # warm-up: one untimed handoff (channel, HTTP/2 window growth, allocator)
            await grpc_push(stub, msgs, n_tokens, fingerprint)
            await asyncio.to_thread(socket_send, socket_port, raw, row["chunk_bytes"])
            await grpc_raw_push(raw_ch, pieces)
            await bulk_push(stub, msgs, n_tokens, fingerprint)
            for _ in range(args.repeats):
                row["bulk_s"].append(await bulk_push(stub, msgs, n_tokens, fingerprint))
                g, server = await grpc_push(stub, msgs, n_tokens, fingerprint)
                row["grpc_s"].append(g)
                row["decode_transfer_sample_s"].append(server)
                row["socket_s"].append(await asyncio.to_thread(socket_send, socket_port, raw, row["chunk_bytes"]))
                row["grpc_raw_s"].append(await grpc_raw_push(raw_ch, pieces))
            med = {k: statistics.median(row[f"{k}_s"]) for k in ("grpc", "socket", "grpc_raw", "bulk")}
            for k, v in med.items():
                row[f"{k}_gbps"] = total / v / 1e9
                row[f"{k}_best_gbps"] = total / min(row[f"{k}_s"]) / 1e9
            row["ratio"] = med["socket"] / med["grpc"]                 # PushKV throughput / socket throughput
            row["grpc_raw_ratio"] = med["socket"] / med["grpc_raw"]
            row["bulk_ratio"] = med["socket"] / med["bulk"]            # bulk KV path throughput / socket
            samples = [x for x in row["decode_transfer_sample_s"] if x is not None]
            print(f"chunk {chunk_mib:g} MiB x {len(msgs)}: BULK {row['bulk_gbps']:.3f} GB/s "
                  f"(best {row['bulk_best_gbps']:.3f}), bulk/socket {row['bulk_ratio']:.2f} | PushKV {row['grpc_gbps']:.3f} GB/s (best {row['grpc_best_gbps']:.3f}) | "
                  f"socket {row['socket_gbps']:.3f} (best {row['socket_best_gbps']:.3f}) | "
                  f"raw gRPC bytes {row['grpc_raw_gbps']:.3f} (best {row['grpc_raw_best_gbps']:.3f}) GB/s | "
                  f"PushKV/socket {row['ratio']:.2f}, raw gRPC/socket {row['grpc_raw_ratio']:.2f} "
                  f"[medians of {args.repeats}]\n    decode's own transfer sample (first chunk landed -> verified) "
                  f"{statistics.median(samples) if samples else float('nan'):.3f} s; "
                  f"sender framing {frame_s:.3f} s + checksum {checksum_s:.3f} s (in the prefill step, untimed)")
            results["runs"].append(row)
            if args.breakdown and chunk_mib == args.chunk_mib[-1]:
                stages = await asyncio.to_thread(breakdown, kv, msgs, layout)
                results["breakdown"] = dict(chunk_mib=chunk_mib, seconds=stages,
                                            gbps={k: total / v / 1e9 for k, v in stages.items() if v > 0})
                print(f"\nbreakdown, each stage alone in one process, {chunk_mib} MiB chunks, {total / MiB:.0f} MiB:")
                for k, v in stages.items():
                    print(f"  {k:<58} {v:7.3f} s  {total / v / 1e9 if v > 0 else float('inf'):8.2f} GB/s")
            del msgs, pieces


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_handoff", description=__doc__.split("\n")[0])
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--chunk-mib", type=lambda s: [float(x) for x in s.split(",")], default=[4.0, 8.0, 16.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    p.add_argument("--out", type=Path, default=RESULTS / "kv_handoff.json")
    p.add_argument("--socket-server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--socket-total", type=int, help=argparse.SUPPRESS)
    p.add_argument("--grpc-raw-server", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.grpc_raw_server:
        grpc_raw_server(args.grpc_raw_server)
        return 0
    if args.socket_server:
        socket_server(args.socket_server, args.socket_total)
        return 0

    kv_mb = args.total_mib + max(64, args.total_mib // 4)   # the transfer plus headroom for block rounding
    decode_port, sock_port, raw_port = free_port(), free_port(), free_port()
    logs = Path(tempfile.mkdtemp(prefix="kv_handoff-"))
    decode = bench_process("decode worker", worker_cmd("decode", args.model, decode_port, None,
                                                       ["--kv-memory-mb", str(kv_mb)]), logs / "decode.log")
    results: dict = dict(**results_header("kv_handoff", argv), host=host_basics(),
                         decode_kv_memory_mb=kv_mb, repeats=args.repeats, runs=[])
    helpers: list[Process] = []
    try:
        address = f"127.0.0.1:{decode_port}"
        decode.start()
        wait_grpc(address, [decode], 180)
        layers, kv_heads, head_dim = kv_shape(args.model)
        per_token = layers * 2 * kv_heads * head_dim * 4     # float32 cache
        total = (args.total_mib * MiB // per_token) * per_token
        helpers = baseline_processes(sock_port, total, raw_port, logs)
        for helper in helpers:
            start_until_ready(helper)
        asyncio.run(run_grpc_side(address, args, results, sock_port, f"127.0.0.1:{raw_port}"))
    finally:
        stop_group([decode, *helpers])
    finish_results(args.out, results, indent=2, allow_nan=True)
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
