"""How well an encode is priced per image against per image token, on images of several sizes.

    python -m bench.encode_pricing [--model DIR] [--sides 64,128,256,384,512] [--rounds 12]

The encoder's own call (``VLMAdapter.encode``: the image processor, the vision tower and the
projector) runs one image at a time, as for a lone request, the sizes shuffled in every round. The
first half of the rounds calibrates two fits of ``runtime.policy.fits.LinearFit`` as the gateway's
cost model calibrates online: the old unit (``a + b x images``, every call one image) and the new
one (``a + b x placeholder tokens``). The second half is predicted by each: per size, the median of
predicted / measured (1.0 is exact). Without ``--model`` a random-weight Qwen2-VL checkpoint is
built (``epd demo-model --family qwen2_vl``) with its image processor's pixel cap raised so that the
sides give 4 to 1,024 tokens, and its vision tower ``--vision-width`` wide (Qwen2-VL's own is 1280,
16 heads, 32 layers: at its width a layer's attention and linear work stand as in the real tower)
and ``--vision-depth`` deep. Results: ``bench/results/encode_pricing.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from bench.harness.host import host_info
from bench.harness.paths import RESULTS
from bench.harness.report import finish_results, markdown_table, results_header, settings_json
from runtime.policy.fits import LinearFit

MAX_SIDE_PIXELS = 512 * 512   # the built checkpoint's cap: a 512x512 image gives 1,024 tokens


def build_model(out: Path, width: int, depth: int) -> Path:
    """The Qwen2-VL test checkpoint with a tower ``width`` wide (64-dim heads) and ``depth`` deep, its image
    processor allowed images up to ``MAX_SIDE_PIXELS``."""
    from runtime.demo_model.qwen_vl import build_qwen_vl

    build_qwen_vl("qwen2_vl", out, vision_overrides={"embed_dim": width, "num_heads": max(1, width // 64),
                                                     "depth": depth})
    path = out / "processor_config.json"
    config = json.loads(path.read_text())
    for part in ("image_processor", "video_processor"):
        sub = config[part]
        if "max_pixels" in sub:
            sub["max_pixels"] = MAX_SIDE_PIXELS
        if isinstance(sub.get("size"), dict) and "longest_edge" in sub["size"]:
            sub["size"]["longest_edge"] = MAX_SIDE_PIXELS
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def measure(adapter, sides: list[int], rounds: int, warmup: int, seed: int) -> list[tuple[int, int, int, float]]:
    """(round, side, tokens, ms) of every measured call; ``warmup`` rounds first, unrecorded."""
    rng = random.Random(seed)
    rows = []
    for r in range(warmup + rounds):
        order = sides[:]
        rng.shuffle(order)
        for side in order:
            image = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
            image.putpixel((0, 0), (r % 256, side % 256, 7))   # a new image every call
            t0 = time.perf_counter()
            (embedding,) = adapter.encode_images([image])
            ms = (time.perf_counter() - t0) * 1000
            if r >= warmup:
                rows.append((r - warmup, side, embedding.tokens, ms))
    return rows


def compare(rows: list[tuple[int, int, int, float]], rounds: int) -> dict[str, dict[str, float]]:
    """Per side: tokens, measured median ms, and each fit's median predicted / measured on the later half."""
    half = rounds // 2
    per_image, per_token = LinearFit(0.0, 0.0, window=10_000, min_points=2), LinearFit(0.0, 0.0, window=10_000, min_points=2)
    for r, _, tokens, ms in rows:
        if r < half:
            per_image.observe(1, ms)
            per_token.observe(tokens, ms)
    out: dict[str, dict[str, float]] = {}
    for side in sorted({s for _, s, _, _ in rows}):
        held = [(t, ms) for r, s, t, ms in rows if s == side and r >= half]
        tokens = held[0][0]
        out[str(side)] = {
            "tokens": tokens, "ms_p50": statistics.median(ms for _, ms in held),
            "per_image_over_measured": statistics.median(per_image(1) / ms for _, ms in held),
            "per_token_over_measured": statistics.median(per_token(tokens) / ms for _, ms in held),
        }
    out["fits"] = {"per_image_ms": per_image(1), "per_token_base_ms": per_token.intercept,
                   "per_token_ms_per_token": per_token.slope}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint (default: build the tiny Qwen2-VL)")
    ap.add_argument("--sides", default="64,128,256,384,512", help="square image sides, pixels")
    ap.add_argument("--vision-width", type=int, default=1280, help="the built tower's width (without --model)")
    ap.add_argument("--vision-depth", type=int, default=2, help="the built tower's layers (without --model)")
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds (the first half calibrates)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=RESULTS / "encode_pricing.json")
    args = ap.parse_args(argv)
    from runtime.model.model_adapter import VLMAdapter

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp) / "qwen2-vl", args.vision_width, args.vision_depth)
        adapter = VLMAdapter.load(model)
        rows = measure(adapter, [int(s) for s in args.sides.split(",")], args.rounds, args.warmup, args.seed)
    summary = compare(rows, args.rounds)
    fits = summary.pop("fits")
    print(f"## encode priced per image and per image token ({args.rounds} rounds, {time.monotonic() - started:.0f} s)\n")
    print(markdown_table(["side", "tokens", "measured ms p50", "per image / measured", "per token / measured"],
                         [[s, str(r["tokens"]), f"{r['ms_p50']:.2f}", f"{r['per_image_over_measured']:.2f}",
                           f"{r['per_token_over_measured']:.2f}"] for s, r in summary.items()]))
    print(f"\nfits: per image {fits['per_image_ms']:.2f} ms; per token {fits['per_token_base_ms']:.2f} ms + "
          f"{fits['per_token_ms_per_token'] * 1000:.2f} us x tokens")
    out = {**results_header("encode_pricing", argv), "host": host_info(), "settings": settings_json(vars(args)),
           "by_side": summary, "fits": fits, "rows": rows}
    finish_results(args.json, out)
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
