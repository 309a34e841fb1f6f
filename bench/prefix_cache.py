"""Multi-turn chat about one image, with the decode prefix cache and with ``--no-prefix-cache``.

    epd demo-model --bench --out /tmp/epd-bench-vlm        # once: random-weight bench model
    python -m bench.prefix_cache [--model /tmp/epd-bench-vlm] [--conversations 4] [--turns 4] [--words 300] [--rounds 2]

Each round starts ``epd serve`` (its defaults: 1 encoder, 1 prefill, 1 decode, conditional
placement) once per configuration, ``cache`` then ``no-cache`` (the order alternates per round,
so load on a shared host hits both alike), and runs the same conversations against each:
``--conversations`` at once, each about its own image, the first turn ``--words`` words of
text with the image, then ``--turns - 1`` short questions, each turn's prompt holding the
whole history (the answers the server gave). Every request streams (``temperature`` 0,
``max_tokens`` 16); turn k of every conversation is sent together, after turn k-1 finished.

Reported per configuration: TTFT p50 of turns 2..N (and of turn 1), the prefix-cache hit
rate over turns 2..N (cached prompt tokens / prompt tokens, from each request's TTFT
breakdown ``cached_tokens`` and ``usage.prompt_tokens``), and the placement of those turns.
The target: TTFT p50 of turns 2..N with the cache at most 0.5x without, hit rate >= 0.5.
Written to ``bench/results/prefix_cache.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness.host import host_basics
from bench.harness.paths import RESULTS
from bench.harness.report import finish_results, fmt, markdown_table, results_header
from bench.harness.servers import epd_serve, free_port, wait_http
from launcher.processes import stop_group
from runtime.demo_model.shapes import QUESTIONS, draw_shape

CONFIGS = {"cache": [], "no-cache": ["--no-prefix-cache"]}
FOLLOW_UPS = ("what shape is shown ?", "what do you see ?", "describe the image .", "what is in the image ?")
MAX_TOKENS = 16
# generous SLOs: this measures TTFT, it must not turn slow first turns on a shared host into 504s or 429s
SLO_HEADERS = {"x-ttft-slo-ms": "120000", "x-itl-slo-ms": "10000"}


def model_words(model: Path) -> list[str]:
    """The words of the model's tokenizer vocabulary (the bench model's is the demo model's)."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(w for w in vocab if w.isalpha())


def first_turn_text(words: int, rng: random.Random, vocab: list[str]) -> str:
    """``words`` words the tokenizer knows, drawn at random, then a question."""
    return " ".join(rng.choice(vocab) for _ in range(words)) + " . " + QUESTIONS[0]


def image_url(seed: int) -> str:
    buf = io.BytesIO()
    draw_shape(random.Random(seed)).image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Conversation:
    def __init__(self, index: int, words: int, seed: int, vocab: list[str]):
        rng = random.Random(seed)
        self.index = index
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url(seed)}},
            {"type": "text", "text": first_turn_text(words, rng, vocab)}]}]

    def body(self, model: str) -> dict[str, Any]:
        return {"model": model, "messages": self.messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}

    def next_turn(self, answer: str, turn: int) -> None:
        self.messages.append({"role": "assistant", "content": answer or "none"})
        self.messages.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})


async def stream_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: TTFT (send -> first content chunk), text, the final chunk's TTFT
    breakdown and ``usage.prompt_tokens``."""
    started, ttft, pieces, breakdown, prompt = time.perf_counter(), None, [], {}, None
    async with client.stream("POST", url, json=body, headers=SLO_HEADERS) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                ttft = time.perf_counter() - started if ttft is None else ttft
                pieces.append(delta["content"])
            breakdown = chunk.get("epd_ttft_breakdown") or breakdown
            if chunk.get("usage"):
                prompt = chunk["usage"]["prompt_tokens"]
    if ttft is None or prompt is None:
        raise RuntimeError("a turn ended without content or usage")
    return {"ttft_s": ttft, "text": "".join(pieces), "breakdown": breakdown, "prompt_tokens": int(prompt)}


async def run_conversations(base: str, model: str, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """Every turn of every conversation; one row per request."""
    vocab = model_words(args.model)
    convs = [Conversation(i, args.words, seed + i, vocab) for i in range(args.conversations)]
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        url = f"{base}/v1/chat/completions"
        for turn in range(args.turns):
            results = await asyncio.gather(*(stream_turn(client, url, c.body(model)) for c in convs))
            for c, got in zip(convs, results):
                rows.append({"conversation": c.index, "turn": turn + 1,
                             "cached_tokens": int(got["breakdown"].get("cached_tokens", 0)), **got})
                c.next_turn(got["text"], turn)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 1]
    first = [r for r in rows if r["turn"] == 1]
    return {
        "requests": len(rows),
        "ttft_p50_turn1_ms": 1000 * statistics.median(r["ttft_s"] for r in first),
        "ttft_p50_later_ms": 1000 * statistics.median(r["ttft_s"] for r in later),
        "hit_rate_later": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
        "colocated_later": sum("colocated_prefill_ms" in r["breakdown"] for r in later),
        "prompt_tokens_turn1_mean": statistics.mean(r["prompt_tokens"] for r in first),
    }


def run_config(name: str, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    port = free_port()
    proc = epd_serve(args.model, port, args.logs, "bench", CONFIGS[name]).start()
    try:
        wait_http(f"http://127.0.0.1:{port}/health", [proc], 600)
        return asyncio.run(run_conversations(f"http://127.0.0.1:{port}", "bench", args, seed))
    finally:
        stop_group([proc])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/epd-bench-vlm"))
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--words", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--logs", type=Path, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    args = p.parse_args(argv)
    if args.turns < 2 or args.conversations < 1 or args.rounds < 1:
        p.error("need --turns >= 2, --conversations >= 1, --rounds >= 1")
    args.logs = args.logs or Path(tempfile.mkdtemp(prefix="epd-prefix-bench-"))
    payload = {**results_header("prefix_cache", argv), "host": host_basics(), "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rounds": []}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    started = time.monotonic()
    for r in range(args.rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            got = run_config(name, args, seed=1000 * (r + 1))
            rows[name] += got
            payload["rounds"].append({"round": r, "config": name, "rows": got, "summary": summarize(got)})
            print(f"round {r} {name}: {summarize(got)}", flush=True)
    summary = {name: summarize(rs) for name, rs in rows.items()}
    summary["ratio_ttft_p50_later"] = summary["cache"]["ttft_p50_later_ms"] / summary["no-cache"]["ttft_p50_later_ms"]
    payload["summary"] = summary
    payload["wall_s"] = time.monotonic() - started
    finish_results(args.out, payload)
    table = [[name, fmt(s["ttft_p50_turn1_ms"], 0), fmt(s["ttft_p50_later_ms"], 0), fmt(s["hit_rate_later"], 3),
              f"{s['colocated_later']}/{s['requests'] * (args.turns - 1) // args.turns}"]
             for name, s in summary.items() if isinstance(s, dict)]
    print(markdown_table(["config", "TTFT p50 turn 1 ms", "TTFT p50 turns 2+ ms", "hit rate turns 2+",
                          "colocated turns 2+"], table))
    print(f"TTFT p50 turns 2+, cache / no cache: {summary['ratio_ttft_p50_later']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
