"""``epd profile``: measure a running stack's service-time tables.

Drives a small, fixed load through the gateway (prompts of several lengths with
an image, then bursts of concurrent requests), and reads back the timing samples
every worker measured itself (``Stats``: prefill steps by tokens, decode steps by
batch size, KV transfers by bytes, encodes by images). The tables and their
linear fit are written in the service-time file format that ``epd simulate``,
``epd plan`` and the gateway's cost model read (``--service-times FILE``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import sys
import time

import grpc
import httpx

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime import service_times as st
from runtime.cost_model import CostModel
from runtime.demo_model.shapes import draw_shape
from runtime.wire import GRPC_OPTIONS

_STUBS = {"encoder": pb_grpc.EncoderStub, "prefill": pb_grpc.PrefillStub, "decode": pb_grpc.DecodeStub}
_FILLER = "the quick brown fox jumps over the lazy dog near a small house by the road".split()


async def _stats(role: str, address: str, since: int) -> pb.WorkerStats:
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as ch:
        return await _STUBS[role](ch).Stats(pb.StatsRequest(since_sample=since), timeout=5)


def _image_url(seed: int) -> str:
    buf = io.BytesIO()
    draw_shape(random.Random(seed)).image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _chat(client: httpx.AsyncClient, base: str, model: str, words: int, seed: int, max_tokens: int) -> dict:
    text = " ".join(_FILLER[i % len(_FILLER)] for i in range(words)) + " what is in the image ?"
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _image_url(seed)}}, {"type": "text", "text": text}]}]}
    r = await client.post(f"{base}/v1/chat/completions", json=body, headers={"x-ttft-slo-ms": "600000"})
    r.raise_for_status()
    breakdown = json.loads(r.headers.get("x-epd-ttft-breakdown", "{}") or "{}")
    return {"prompt_tokens": r.json()["usage"]["prompt_tokens"], "breakdown": breakdown}


async def profile(base: str, prompt_words: list[int], batches: list[int], repeats: int) -> st.ServiceTimesFile:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        workers = (await client.get(f"{base}/status")).json()
        roles = [(role, w["address"]) for role in _STUBS for w in workers.get(role, []) if w.get("healthy")]
        marks = {a: (await _stats(r, a, 0)).last_sample for r, a in roles}
        kv_per_token = []
        seed = random.randrange(1 << 30)  # fresh images: encodes are measured, not cache hits
        for words in prompt_words:
            for _ in range(repeats):
                seed += 1
                out = await _chat(client, base, model, words, seed, 4)
                if out["breakdown"].get("transfer_bytes"):
                    kv_per_token.append(out["breakdown"]["transfer_bytes"] / out["prompt_tokens"])
        for batch in batches:
            for _ in range(repeats):
                seed += batch
                await asyncio.gather(*(_chat(client, base, model, 8, seed + i, 16) for i in range(batch)))
    tables: dict[str, list[tuple[float, float]]] = {name: [] for name in st.TABLE_NAMES}
    for role, address in roles:
        for s in (await _stats(role, address, marks[address])).samples:
            if s.kind in tables:
                tables[s.kind].append((s.size, s.ms))
    measured = st.MeasuredTables(**{k: tuple(v) for k, v in tables.items()})
    prior = st.ServiceTimes()
    if kv_per_token:
        prior = prior.replace(kv_bytes_per_token=int(round(sum(kv_per_token) / len(kv_per_token))))
    fitted = CostModel.from_tables(prior, measured).service_times()
    return st.ServiceTimesFile(params=fitted, tables=measured,
                               source=f"epd profile against {base} ({model}) at {time.strftime('%Y-%m-%d %H:%M:%S')}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="epd profile", description=__doc__.splitlines()[0])
    p.add_argument("--base", default="http://127.0.0.1:8000", help="gateway base URL")
    p.add_argument("--out", default="service-times.json")
    p.add_argument("--prompt-words", default="0,100,400,1000", help="comma-separated filler lengths")
    p.add_argument("--batches", default="1,4,8", help="comma-separated concurrent request counts")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    try:
        words = [int(x) for x in args.prompt_words.split(",") if x]
        batches = [int(x) for x in args.batches.split(",") if x]
    except ValueError:
        p.error("--prompt-words and --batches take comma-separated integers")
    try:
        content = asyncio.run(profile(args.base.rstrip("/"), words, batches, max(1, args.repeats)))
    except (httpx.HTTPError, grpc.aio.AioRpcError) as exc:
        print(f"epd profile: the stack at {args.base} did not answer: {exc}", file=sys.stderr)
        return 1
    st.save(args.out, content)
    params = content.params
    print(f"wrote {args.out}: prefill_ms = {params.prefill_base_ms:.2f} + {params.prefill_ms_per_token:.4f} x tokens; "
          f"decode step = {params.decode_step_base_ms:.2f} + {params.decode_step_ms_per_seq:.3f} x batch ms; "
          f"link {params.link_setup_ms:.2f} ms + {params.link_bytes_per_s / 1e9:.2f} GB/s; "
          f"KV {params.kv_bytes_per_token} B/token; "
          + ", ".join(f"{k}: {len(getattr(content.tables, k))} points" for k in st.TABLE_NAMES))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
