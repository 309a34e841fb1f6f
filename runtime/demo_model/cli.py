"""``epd demo-model``: build the shipped demo VLM (trained), the bench config (random), or a tiny
random-weight checkpoint of another family (``--family qwen2_vl|qwen2_5_vl|qwen3_vl|llava_onevision|llava_next|idefics3|smolvlm|gemma3|gemma4|qwen3_5``,
for tests)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from transformers import LlavaForConditionalGeneration

from .build import build_config, build_processor
from .gemma3 import build_gemma3
from .gemma4 import build_gemma4
from .idefics3 import SplitFamily, build_idefics3
from .llava_anyres import AnyResFamily, build_llava_anyres
from .qwen3_5 import FAMILY as QWEN3_5, build_qwen3_5
from .qwen_vl import QwenFamily, build_qwen_vl
from .train import REQUIRED_ACCURACY, TrainPlan, train


def build(out: Path, *, bench: bool, seed: int = 0) -> float | None:
    """Write a standard HF checkpoint to ``out``; return the accuracy for the demo model."""
    torch.manual_seed(seed)
    processor = build_processor()
    config = build_config(processor.tokenizer, bench=bench)
    model = LlavaForConditionalGeneration(config)
    accuracy = None
    if not bench:
        accuracy = train(model, processor, TrainPlan(seed=seed))
        if accuracy < REQUIRED_ACCURACY:
            raise RuntimeError(f"demo model reached {accuracy:.1%} < {REQUIRED_ACCURACY:.0%}; not saved")
    model.eval()
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return accuracy


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epd demo-model", description=__doc__)
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default models/demo-vlm, or models/test-FAMILY for --family)")
    parser.add_argument("--bench", action="store_true", help="random-weight ~150M-parameter, 8k-context config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=["llava", *(f.value for f in QwenFamily), *(f.value for f in AnyResFamily),
                                              *(f.value for f in SplitFamily), "gemma3", "gemma4", QWEN3_5], default="llava",
                        help="llava: the demo model (trained) or --bench; others: a tiny random-weight test checkpoint")
    args = parser.parse_args(argv)
    if args.family != "llava" and args.bench:
        parser.error("--bench builds the LLaVA bench config; it cannot be combined with --family " + args.family)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.out is None:
        args.out = Path("models/demo-vlm" if args.family == "llava" else f"models/test-{args.family}")
    if args.family != "llava":
        builder = (build_llava_anyres if args.family in {f.value for f in AnyResFamily}
                   else build_gemma3 if args.family == "gemma3"
                   else build_gemma4 if args.family == "gemma4"
                   else build_idefics3 if args.family in {f.value for f in SplitFamily}
                   else build_qwen3_5 if args.family == QWEN3_5 else build_qwen_vl)
        builder(args.family, args.out, seed=args.seed)
        print(f"{args.family} test checkpoint (random weights) written to {args.out}")
        return 0
    accuracy = build(args.out, bench=args.bench, seed=args.seed)
    if accuracy is not None:
        print(f"demo model written to {args.out}: held-out accuracy {accuracy:.1%}")
    else:
        print(f"bench model written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
