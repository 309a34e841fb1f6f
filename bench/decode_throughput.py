"""Decode throughput (tokens/s) at batch 1, 32 and 64 on the bench model, in process, for each attention kernel.

    epd demo-model --bench --out /tmp/bench-vlm        # once: random-weight bench model
    python -m bench.decode_throughput [--model /tmp/bench-vlm] [--batches 1,32,64] [--kernels batched,reference_loop]
                                      [--context 128] [--steps 16] [--rounds 4] [--threads 1]
                                      [--linear-kernels torch,onednn]

``--kernels``: ``batched`` is the kernel the adapter selects at start-up (one attention call per
layer for the whole batch); ``reference_loop`` is the per-sequence loop (one SDPA call per
sequence per layer) it replaced. Every (batch, kernel) pair is timed in the same run and the
step-time ratio loop / batched is printed per batch size. ``--linear-kernels``: the linear layers'
kernels to time (``runtime/model/linear_kernels.py``; default: the one ``auto`` installs), one
loaded copy of the model each, interleaved with the rest; the ratio torch / onednn is printed.

Each batch size gets its own ``KVBlockPool``; every sequence's prompt KV
(``--context`` tokens) is filled with random values (decode cost depends on the
context length, not on the values), then ``--warmup`` untimed and ``--steps``
timed calls of ``VLMAdapter.decode_step`` run: one packed forward producing one
greedy token per sequence, exactly the forward ``DecodeScheduler`` runs for its
running batch. The timed steps of all batch sizes are interleaved in
``--rounds`` rounds, so load changes on a shared host hit them alike.
tokens/s = batch x steps / seconds (also from the median and the best step). Results: printed, and written
as JSON to ``bench/results/decode_throughput.json`` (see bench/HANDOFF.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness.host import host_basics
from bench.harness.paths import RESULTS
from bench.harness.report import finish_results, results_header


def model_size(adapter) -> dict:
    model = adapter.model
    total = sum(p.numel() for p in model.parameters())
    text = sum(p.numel() for p in adapter._decoder.parameters())
    head = sum(p.numel() for p in adapter._lm_head.parameters())
    embed = sum(p.numel() for p in adapter._embed_tokens.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(params_total=total, params_decoder=text, params_lm_head=head, params_embed=embed,
                params_other=total - text - head, weight_bytes=nbytes, dtype=str(next(model.parameters()).dtype))


class Batch:
    """``batch`` sequences with ``context`` tokens of (random) KV each, in their own pool, ready to decode."""

    def __init__(self, adapter, batch: int, context: int, max_steps: int, block_size: int, kernel: str | None = None):
        import torch

        from runtime.model.kv_pool import KVBlockPool
        from runtime.model.model_adapter import DecodeInput
        from runtime.model.sampling import SamplingParams

        layout = adapter.kv_layout
        per_seq = context + max_steps + 1
        self.adapter, self.batch, self.context = adapter, batch, context
        self.kernel = kernel or adapter.attention_kernel
        self.linear_kernel = adapter.linear_kernel
        self.pool = KVBlockPool(layout, batch * -(-per_seq // block_size), block_size)
        gen = torch.Generator().manual_seed(batch)
        self.seqs = []
        for i in range(batch):
            owner = self.pool.new_token()
            blocks = self.pool.allocate(per_seq, owner)
            kv = torch.randn((layout.layers, 2, context, layout.kv_heads, layout.head_dim), generator=gen)
            self.pool.write(blocks, 0, kv.to(layout.dtype), owner=owner)
            self.seqs.append(DecodeInput(token_id=5 + i % 7, position=context, blocks=blocks, sampling=SamplingParams()))
        self.times: list[float] = []

    def step(self, timed: bool = True) -> None:
        self.adapter.attention_kernel = self.kernel
        t0 = time.perf_counter()
        tokens = self.adapter.decode_step(self.pool, self.seqs)
        elapsed = time.perf_counter() - t0
        for s, t in zip(self.seqs, tokens):
            s.token_id, s.position = t, s.position + 1
        if timed:
            self.times.append(elapsed)

    def result(self) -> dict:
        t = self.times
        return dict(batch=self.batch, kernel=self.kernel, linear_kernel=self.linear_kernel, context=self.context,
                    steps=len(t), seconds=sum(t),
                    step_ms_median=statistics.median(t) * 1000, step_ms_min=min(t) * 1000,
                    tokens_per_s=self.batch * len(t) / sum(t),
                    tokens_per_s_median_step=self.batch / statistics.median(t),
                    tokens_per_s_best_step=self.batch / min(t))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_throughput", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/bench-vlm"))
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 64])
    p.add_argument("--kernels", default="batched,reference_loop",
                   help="batched (the kernel selected at start-up), reference_loop, or a kernel name")
    p.add_argument("--context", type=int, default=128, help="prompt tokens already in each sequence's KV")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4, help="the timed steps of every batch size, interleaved in rounds")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: stable on a shared host; 0 = torch's default)")
    p.add_argument("--linear-kernels", default="auto", help="comma-separated: auto, torch, onednn (a model copy each)")
    p.add_argument("--out", type=Path, default=RESULTS / "decode_throughput.json")
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"no model at {args.model}; build it with: epd demo-model --bench --out {args.model}", file=sys.stderr)
        return 2

    import torch

    from runtime.model.model_adapter import VLMAdapter

    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    adapters = [VLMAdapter.load(args.model, linear_kernel=k.strip()) for k in args.linear_kernels.split(",") if k.strip()]
    adapter = adapters[0]
    size = model_size(adapter)
    print(f"model {args.model}: {size['params_total'] / 1e6:.1f} M parameters ({size['weight_bytes'] / 2**20:.0f} MiB "
          f"{size['dtype']}), decoder {size['params_decoder'] / 1e6:.1f} M, KV {adapter.kv_layout.describe()}; "
          f"torch threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}")
    results = dict(**results_header("decode_throughput", argv),
                   model=str(args.model), model_size=size, kv_layout=adapter.kv_layout.describe(),
                   torch_threads=torch.get_num_threads(), torch_version=torch.__version__,
                   host=host_basics(), runs=[])
    selected = adapter.attention_kernel
    kernels = [selected if k.strip() == "batched" else k.strip() for k in args.kernels.split(",") if k.strip()]
    results["selected_kernel"] = selected
    batches = [Batch(a, b, args.context, args.warmup + args.steps, args.block_size, k)
               for b in args.batches for k in kernels for a in adapters]
    for b in batches:
        for _ in range(args.warmup):
            b.step(timed=False)
    # interleaved rounds: a load change on a shared host hits every batch size alike
    rounds = max(1, args.rounds)
    per_round = -(-args.steps // rounds)
    for _ in range(rounds):
        for b in batches:
            for _ in range(min(per_round, args.steps - len(b.times))):
                b.step()
    for b in batches:
        row = b.result()
        results["runs"].append(row)
        print(f"batch {row['batch']:>3} {row['kernel']:<15} {row['linear_kernel']:<6}: {row['tokens_per_s']:8.1f} tokens/s  "
              f"(median step {row['step_ms_median']:.1f} ms "
              f"-> {row['tokens_per_s_median_step']:.1f} tokens/s; best step {row['step_ms_min']:.1f} ms; "
              f"{row['steps']} steps, context {args.context})")
    results["torch_over_onednn_step_ms"] = {}
    for b in args.batches:
        rows = {r["linear_kernel"]: r for r in results["runs"] if r["batch"] == b and r["kernel"] == selected}
        if {"torch", "onednn"} <= set(rows):
            x = rows["torch"]["step_ms_median"] / rows["onednn"]["step_ms_median"]
            results["torch_over_onednn_step_ms"][str(b)] = x
            print(f"batch {b:>3}: median step {rows['onednn']['step_ms_median']:.1f} ms onednn vs "
                  f"{rows['torch']['step_ms_median']:.1f} ms torch linear layers -> torch / onednn {x:.2f}x")
    results["loop_over_batched_step_ms"] = {}
    first = adapter.linear_kernel
    for b in args.batches:
        rows = {r["kernel"]: r for r in results["runs"] if r["batch"] == b and r["linear_kernel"] == first}
        if selected in rows and "reference_loop" in rows and selected != "reference_loop":
            x = rows["reference_loop"]["step_ms_median"] / rows[selected]["step_ms_median"]
            results["loop_over_batched_step_ms"][str(b)] = x
            print(f"batch {b:>3}: median step {rows[selected]['step_ms_median']:.1f} ms batched ({selected}) vs "
                  f"{rows['reference_loop']['step_ms_median']:.1f} ms loop -> loop / batched {x:.2f}x")
    base = next((r for r in results["runs"] if r["batch"] == 1 and r["kernel"] == selected), None)
    if base:
        for r in results["runs"]:
            for key in ("tokens_per_s", "tokens_per_s_median_step", "tokens_per_s_best_step"):
                r[key.replace("tokens_per_s", "speedup_vs_batch1")] = r[key] / base[key]
        print("tokens/s relative to batch 1 (all steps | median step | best step): " + ", ".join(
            f"batch {r['batch']} {r['speedup_vs_batch1']:.1f}x | {r['speedup_vs_batch1_median_step']:.1f}x | "
            f"{r['speedup_vs_batch1_best_step']:.1f}x" for r in results["runs"]))
    finish_results(args.out, results, indent=2, allow_nan=True)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
