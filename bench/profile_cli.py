"""``epd profile``: measure a running stack's service-time tables.

Drives a small, fixed load through the gateway and reads back the timing samples every
worker measured itself (``Stats``). Each table holds what the simulator uses, an idle
stage's service time, so the load is shaped to keep the stages out of each other's way:

1. one request at a time, fresh images, prompts of several lengths: encodes, transfers,
   batch-1 decode steps, and one prefill point per request -- the sum of its prefill
   passes at its prompt tokens, the per-request definition ``runtime.policy.cost_model`` uses
   (the fixed cost once per request however many chunks). Decode steps are kept from the
   shortest prompts only: a step over a long context is slower, and the table, like the bursts
   below, is by batch size at a short context. The gateway's own CPU seconds
   (its ``process_cpu_seconds_total``, less its idle rate) over these requests give its
   cost per request, split into the part before the pipeline (``gateway_ms`` of the TTFT
   breakdown) and the rest. On a local stack the workers' CPU seconds (their processes,
   found by listening port) give what each spends per request beyond the compute it times
   (RPCs, cache reads and writes, KV sends and receives, token streams):
   ``encode_request_ms``, ``prefill_request_ms``, ``decode_request_ms``. The decode worker's
   part is then split, with the bursts below, into a per-request and a per-step share
   (``decode_step_extra_ms``: scheduling, sampling and streaming around each timed forward),
   since a batched step shares that work among its requests;
2. bursts of concurrent requests sharing one image, already cached: ``encode_cache_hit_ms``,
   what a cache hit costs the encoder (its CPU per request here on a local stack -- the
   cache-check RPC --, else the encode time in their breakdowns), and decode steps at larger batches, kept only from the burst's largest batch on, when every
   prefill of the burst is done and nothing else competes for the cores.

The tables and their linear fit are written in the service-time file format that
``epd simulate``, ``epd plan`` and the gateway's cost model read (``--service-times FILE``),
with the simulator's shared-host model switched on when the stack runs here (a loopback
gateway address): ``host_cores`` = this machine's core count, ``host_background_cores`` = the
cores other work kept busy while the stack sat idle (``/proc/stat`` over the profile's idle
seconds). Else both 0 (unknown: a core per worker).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import sys
import time
from urllib.parse import urlsplit

import grpc
import httpx

from bench.harness.host import busy_cores, host_busy
from bench.harness.scrape import parse_prometheus
from bench.harness.usage import listener_cpu_seconds
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.policy import service_times as st
from runtime.policy.cost_model import CostModel
from runtime.demo_model.shapes import draw_shape
from runtime.worker.internal_auth import open_channel, token_from_env

_STUBS = {"encoder": pb_grpc.EncoderStub, "prefill": pb_grpc.PrefillStub, "decode": pb_grpc.DecodeStub}
_FILLER = "the quick brown fox jumps over the lazy dog near a small house by the road".split()


async def _stats(role: str, address: str, since: int) -> pb.WorkerStats:
    async with open_channel(address, token_from_env()) as ch:   # the stack's EPD_INTERNAL_TOKEN, if any
        return await _STUBS[role](ch).Stats(pb.StatsRequest(since_sample=since), timeout=5)


def _image_url(seed: int) -> str:
    buf = io.BytesIO()
    draw_shape(random.Random(seed)).image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _chat(client: httpx.AsyncClient, base: str, model: str, words: int, seed: int, max_tokens: int) -> dict:
    text = " ".join(_FILLER[i % len(_FILLER)] for i in range(words)) + " what is in the image ?"
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _image_url(seed)}}, {"type": "text", "text": text}]}]}
    r = await client.post(f"{base}/v1/chat/completions", json=body, headers={"x-ttft-slo-ms": "120000"})   # the gateway's default max_slo_ms
    r.raise_for_status()
    breakdown = json.loads(r.headers.get("x-epd-ttft-breakdown", "{}") or "{}")
    return {"prompt_tokens": r.json()["usage"]["prompt_tokens"], "breakdown": breakdown}


async def _gateway_cpu_s(client: httpx.AsyncClient, base: str) -> float | None:
    """The gateway process's CPU seconds so far (``process_cpu_seconds_total`` on its /metrics), if it reports them."""
    try:
        text = (await client.get(f"{base}/metrics")).text
    except httpx.HTTPError:
        return None
    return parse_prometheus(text, "process_cpu_seconds_total ").get("process_cpu_seconds_total")


def overhead_ms(cpu: list[float | None], times: tuple[float, float, float, float], requests: int,
                timed_ms: float) -> float | None:
    """CPU ms per request beyond the ``timed_ms`` the role timed itself over ``requests`` requests.

    ``cpu`` and ``times`` are four readings: the first two around an idle stretch (the idle
    rate), the last two around the requests. None when a reading is missing; never below 0.
    """
    if None in cpu or not requests:
        return None
    c0, c1, c2, c3 = cpu  # type: ignore[misc]
    t0, t1, t2, t3 = times
    idle_rate = (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0
    busy_ms = (c3 - c2 - idle_rate * (t3 - t2)) * 1000.0
    return max(0.0, (busy_ms - timed_ms) / requests)


def from_peak(batches: list[float]) -> list[int]:
    """Indices of the steps from the first one at the largest batch on (the burst is all in, no prefill left)."""
    if not batches:
        return []
    peak = batches.index(max(batches))
    return list(range(peak, len(batches)))


def split_decode_overhead(seq_per_request: float, seq_requests: int, seq_steps: int, burst_per_request: float | None,
                          burst_requests: int, burst_steps: int) -> tuple[float, float] | None:
    """The decode worker's untimed CPU as ``r`` per request plus ``s`` per step, from two phases.

    One request at a time, every step is one request's own; in a burst, a step serves the
    whole batch, so per request the untimed CPU falls. Two phases, two unknowns:
    ``untimed = r x requests + s x steps``. None (keep the per-request figure) when a phase is
    missing or the solution is not >= 0 in both.
    """
    if burst_per_request is None or not (seq_requests and burst_requests):
        return None
    a1, b1, c1 = float(seq_requests), float(seq_steps), seq_per_request * seq_requests
    a2, b2, c2 = float(burst_requests), float(burst_steps), burst_per_request * burst_requests
    det = a1 * b2 - a2 * b1
    if abs(det) <= 1e-9 * max(1.0, abs(a1 * b2)):
        return None
    r, s = (c1 * b2 - c2 * b1) / det, (a1 * c2 - a2 * c1) / det
    return (r, s) if r >= 0 and s >= 0 else None


def is_local(base: str) -> bool:
    host = (urlsplit(base).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


class _Samples:
    """The workers' timing samples since the last read, by kind (each worker's cursor kept here)."""

    def __init__(self, roles: list[tuple[str, str]], marks: dict[str, int]) -> None:
        self.roles, self.marks = roles, marks

    async def read(self) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {name: [] for name in st.TABLE_NAMES}
        for role, address in self.roles:
            stats = await _stats(role, address, self.marks[address])
            for s in stats.samples:
                if s.kind in out:
                    out[s.kind].append((s.size, s.ms))
            self.marks[address] = max(self.marks[address], stats.last_sample)
        return out


async def profile(base: str, prompt_words: list[int], batches: list[int], repeats: int,
                  host_cores: int | None = None, api_key: str | None = None) -> st.ServiceTimesFile:
    tables: dict[str, list[tuple[float, float]]] = {name: [] for name in st.TABLE_NAMES}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=600, trust_env=False, headers=headers) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        workers = (await client.get(f"{base}/status")).json()
        roles = [(role, w["address"]) for role in _STUBS for w in workers.get(role, []) if w.get("healthy")]
        samples = _Samples(roles, {a: (await _stats(r, a, 0)).last_sample for r, a in roles})
        kv_per_token, gateway_ms = [], []
        seed = random.randrange(1 << 30)  # fresh images: encodes are measured, not cache hits
        # 1. one request at a time
        local = is_local(base)
        watched = [("gateway", None)] + [(r, a) for r, a in roles if r in ("encoder", "prefill", "decode") and local]
        remote_prefill = any(r == "prefill" for r, _ in roles)  # else the decode worker prefills

        async def cpu_now() -> dict[str, float | None]:
            """CPU seconds so far by role (the workers of a role summed; None if any is unreadable)."""
            got: dict[str, float | None] = {}
            for role, address in watched:
                value = await _gateway_cpu_s(client, base) if address is None else listener_cpu_seconds(address)
                prev = got.get(role, 0.0)
                got[role] = None if value is None or prev is None else prev + value
            return got

        cpu0, t0, host0 = await cpu_now(), time.monotonic(), host_busy()
        await asyncio.sleep(2.0)  # idle CPU rates (health checks, stats polling); other work's share of the host
        cpu1, t1, host1 = await cpu_now(), time.monotonic(), host_busy()
        await samples.read()
        sequential = sequential_steps = 0
        timed = {"encoder": 0.0, "prefill": 0.0, "decode": 0.0}
        shortest = min(prompt_words)
        for words in prompt_words:
            for _ in range(repeats * (4 if words == shortest else 1)):  # the step table's points come from these
                seed += 1
                out = await _chat(client, base, model, words, seed, 4)
                sequential += 1
                b = out["breakdown"]
                if b.get("transfer_bytes"):
                    kv_per_token.append(b["transfer_bytes"] / out["prompt_tokens"])
                if "gateway_ms" in b:
                    gateway_ms.append(b["gateway_ms"])
                got = await samples.read()
                timed["encoder"] += sum(ms for _, ms in got["encode"])
                passes = sum(ms for _, ms in got["prefill"])
                timed["prefill"] += passes + sum(ms for _, ms in got["transfer"])
                timed["decode"] += sum(ms for _, ms in got["decode_step"]) + (0.0 if remote_prefill else passes)
                sequential_steps += len(got["decode_step"])
                if got["prefill"]:  # this request's passes, summed: one per-request point
                    tables["prefill"].append((sum(x for x, _ in got["prefill"]), sum(ms for _, ms in got["prefill"])))
                for kind in ("transfer", "encode"):
                    tables[kind] += got[kind]
                if words == shortest:  # steps at the burst phase's short context (the table has no context term)
                    tables["decode_step"] += got["decode_step"]
        cpu2, t2 = await cpu_now(), time.monotonic()
        # 2. bursts on one cached image
        seed += 1
        await _chat(client, base, model, 8, seed, 16)  # caches the image
        await samples.read()
        hit_ms: list[float] = []
        cpu3, t3, bursts = await cpu_now(), time.monotonic(), 0
        burst_decode_timed, burst_steps = 0.0, 0
        for batch in batches:
            for _ in range(repeats):
                outs = await asyncio.gather(*(_chat(client, base, model, 8, seed, 16) for _ in range(batch)))
                bursts += batch
                hit_ms += [o["breakdown"]["encode_ms"] for o in outs if "encode_ms" in o["breakdown"]]
                got = await samples.read()
                steps = got["decode_step"]
                tables["decode_step"] += [steps[i] for i in from_peak([x for x, _ in steps])]
                burst_steps += len(steps)
                burst_decode_timed += sum(ms for _, ms in steps) + (0.0 if remote_prefill else sum(ms for _, ms in got["prefill"]))
        cpu4, t4 = await cpu_now(), time.monotonic()
    measured = st.MeasuredTables(**{k: tuple(v) for k, v in tables.items()})
    prior = st.ServiceTimes()
    changes: dict[str, float | int] = {}
    if kv_per_token:
        changes["kv_bytes_per_token"] = int(round(sum(kv_per_token) / len(kv_per_token)))
    per_request = {r: overhead_ms([cpu0[r], cpu1[r], cpu1[r], cpu2[r]], (t0, t1, t1, t2), sequential, timed.get(r, 0.0))
                   for r in cpu0}
    hit_cpu = overhead_ms([cpu0.get("encoder"), cpu1.get("encoder"), cpu3.get("encoder"), cpu4.get("encoder")],
                          (t0, t1, t3, t4), bursts, 0.0) if "encoder" in cpu0 else None
    if hit_cpu is not None:
        changes["encode_cache_hit_ms"] = hit_cpu
    elif hit_ms:
        changes["encode_cache_hit_ms"] = _median(hit_ms)
    if per_request["gateway"] is not None and gateway_ms:
        changes["gateway_request_ms"] = before = min(_median(gateway_ms), per_request["gateway"])
        changes["gateway_finish_ms"] = per_request["gateway"] - before
    for role, field_name in (("encoder", "encode_request_ms"), ("prefill", "prefill_request_ms"),
                             ("decode", "decode_request_ms")):
        if per_request.get(role) is not None:
            changes[field_name] = per_request[role]  # type: ignore[assignment]
    if per_request.get("decode") is not None and cpu3.get("decode") is not None:
        burst = overhead_ms([cpu0["decode"], cpu1["decode"], cpu3["decode"], cpu4["decode"]], (t0, t1, t3, t4),
                            bursts, burst_decode_timed)
        split = split_decode_overhead(per_request["decode"], sequential, sequential_steps, burst, bursts, burst_steps)
        if split is not None:
            changes["decode_request_ms"], changes["decode_step_extra_ms"] = split
    if host_cores is None:
        host_cores = (os.cpu_count() or 1) if local else 0
    changes["host_cores"] = host_cores
    if host_cores and local:  # what kept the cores busy while the stack sat idle is other work
        changes["host_background_cores"] = round(busy_cores(os.cpu_count() or 1, host0, host1), 3)
    fitted = CostModel.from_tables(prior.replace(**changes), measured).service_times()
    return st.ServiceTimesFile(params=fitted, tables=measured,
                               source=f"epd profile against {base} ({model}) at {time.strftime('%Y-%m-%d %H:%M:%S')}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="epd profile", description=__doc__.splitlines()[0])
    p.add_argument("--base", default="http://127.0.0.1:8000", help="gateway base URL")
    p.add_argument("--out", default="service-times.json")
    p.add_argument("--prompt-words", default="0,100,400,1000", help="comma-separated filler lengths")
    p.add_argument("--batches", default="1,4,8", help="comma-separated concurrent request counts")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--host-cores", type=int, help="cores the stack shares (default: this machine's when the gateway is local, else 0)")
    p.add_argument("--api-key", default=(os.environ.get("EPD_API_KEY") or "").split(",")[0].strip() or None,
                   help="the gateway's API key, when it has keys (default: the first of EPD_API_KEY); the workers' "
                        "Stats need the stack's EPD_INTERNAL_TOKEN in this process's environment")
    args = p.parse_args(argv)
    try:
        words = [int(x) for x in args.prompt_words.split(",") if x]
        batches = [int(x) for x in args.batches.split(",") if x]
    except ValueError:
        p.error("--prompt-words and --batches take comma-separated integers")
    try:
        content = asyncio.run(profile(args.base.rstrip("/"), words, batches, max(1, args.repeats), args.host_cores,
                                      args.api_key))
    except (httpx.HTTPError, grpc.aio.AioRpcError) as exc:
        print(f"epd profile: the stack at {args.base} did not answer: {exc}", file=sys.stderr)
        return 1
    st.save(args.out, content)
    params = content.params
    print(f"wrote {args.out}: prefill_ms = {params.prefill_base_ms:.2f} + {params.prefill_ms_per_token:.4f} x tokens + "
          f"{params.prefill_ms_per_token2:.2e} x tokens^2; "
          f"decode step = {params.decode_step_base_ms:.2f} + {params.decode_step_ms_per_seq:.3f} x batch ms; "
          f"link {params.link_setup_ms:.2f} ms + {params.link_bytes_per_s / 1e9:.2f} GB/s; "
          f"KV {params.kv_bytes_per_token} B/token; gateway {params.gateway_request_ms:.2f} + "
          f"{params.gateway_finish_ms:.2f} ms/request; host cores {params.host_cores}; "
          + ", ".join(f"{k}: {len(getattr(content.tables, k))} points" for k in st.TABLE_NAMES))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
