"""What structured output costs per decode step: the grammar's token mask, as a ratio to an unconstrained step.

    python -m bench.structured_output [--model models/demo-vlm] [--batches 1,32] [--context 128] [--steps 32] [--rounds 4]

For each batch size, ``bench.decode_throughput.Batch`` runs the decode worker's
unconstrained step (one packed forward and greedy sampling per sequence,
``VLMAdapter.decode_step``); right after each step, in the same run, every
sequence's llguidance matcher (``runtime.model.grammar.Matcher``) computes its
allowed-token mask, the mask is applied to a logits row, the masked argmax is
taken and the matcher advanced: exactly the work constrained decoding adds to
a step (the token's values do not change the cost of a mask). The grammar is a
JSON Schema (an array of objects with a bounded string and an integer) whose
replies can be long; a matcher whose grammar completes starts over, so every
timed mask is a real one. Steps of all batch sizes are interleaved in rounds.
Reported: median ms of the unconstrained step, median ms of the masks of one
step (the whole batch), and their ratio. Written to
``bench/results/structured_output.json``; numbers in bench/RESULTS.md.
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

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"}},
    "required": ["name", "count"], "additionalProperties": False}}


class ConstrainedBatch:
    """``Batch``'s sequences, each with a matcher; ``mask_step`` is the grammar's share of one step."""

    def __init__(self, batch, grammar_text: str, vocab, seed: int):
        import torch

        from runtime.model import grammar

        self.batch, self.grammar_text, self.vocab = batch, grammar_text, vocab
        self.matchers = [grammar.Matcher(grammar_text, vocab) for _ in batch.seqs]
        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.randn((64, vocab.size), generator=gen)
        self.step_ms: list[float] = []
        self.mask_ms: list[float] = []
        self.restarts = 0
        self._n = 0

    def step(self, timed: bool = True) -> None:
        import torch

        from runtime.model import grammar

        t0 = time.perf_counter()
        self.batch.step(timed=False)
        t1 = time.perf_counter()
        for i, m in enumerate(self.matchers):
            row = self.logits[(self._n + i) % len(self.logits)]
            token = int(torch.argmax(row.masked_fill(~m.allowed(), float("-inf"))))
            if m.done:   # only EOS was allowed: the reply is complete, start another
                self.matchers[i] = grammar.Matcher(self.grammar_text, self.vocab)
                self.restarts += 1
            else:
                m.advance(token)
        t2 = time.perf_counter()
        self._n += 1
        if timed:
            self.step_ms.append((t1 - t0) * 1000)
            self.mask_ms.append((t2 - t1) * 1000)

    def result(self) -> dict:
        step, mask = statistics.median(self.step_ms), statistics.median(self.mask_ms)
        return dict(batch=self.batch.batch, context=self.batch.context, steps=len(self.step_ms),
                    step_ms_median=step, mask_ms_median=mask, mask_ms_per_sequence=mask / self.batch.batch,
                    mask_to_step_ratio=mask / step, grammar_restarts=self.restarts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.structured_output", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/demo-vlm"))
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--out", type=Path, default=RESULTS / "structured_output.json")
    args = p.parse_args(argv)

    import torch

    from bench.decode_throughput import Batch
    from runtime.model import grammar
    from runtime.model.model_adapter import VLMAdapter

    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = VLMAdapter.load(args.model)
    vocab = grammar.model_vocabulary(adapter)
    text = grammar.json_schema_grammar(SCHEMA)
    grammar.check(text, vocab)
    print(f"model {args.model}: vocabulary {vocab.size}, torch threads {torch.get_num_threads()}, "
          f"load avg {os.getloadavg()[0]:.2f}")
    runs = [ConstrainedBatch(Batch(adapter, b, args.context, args.warmup + args.steps, 16), text, vocab, b)
            for b in args.batches]
    for r in runs:
        for _ in range(args.warmup):
            r.step(timed=False)
    per_round = -(-args.steps // max(1, args.rounds))
    for _ in range(max(1, args.rounds)):
        for r in runs:
            for _ in range(min(per_round, args.steps - len(r.step_ms))):
                r.step()
    results = dict(**results_header("structured_output", argv), model=str(args.model), vocab_size=vocab.size,
                   schema=SCHEMA, torch_threads=torch.get_num_threads(), host=host_basics(),
                   runs=[r.result() for r in runs])
    for row in results["runs"]:
        print(f"batch {row['batch']:>3}: unconstrained step {row['step_ms_median']:.2f} ms, masks {row['mask_ms_median']:.2f} ms "
              f"({row['mask_ms_per_sequence']:.3f} ms per sequence) -> ratio {row['mask_to_step_ratio']:.3f} "
              f"({row['steps']} steps, {row['grammar_restarts']} replies completed)")
    finish_results(args.out, results, indent=2, allow_nan=True)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
