"""A model worker's torch threads, fitted to its model once it is loaded.

``epd serve`` gives each decode worker the host's cores (``launcher/serve.py``,
``worker_threads``): on the 140M bench model two threads halve the decode step (memory-bound
fp32 GEMMs). A tiny model's ops are too small to split: each parallel region then costs more
in thread hand-offs than it saves, and its idle threads take cores the gateway and encoder
need (the 0.6M demo model served fewer requests/s with two decode threads than with one,
``bench/RESULTS.md``). So a worker whose weights are under ``SMALL_MODEL_BYTES`` runs on one
thread whatever ``OMP_NUM_THREADS`` says; a larger one keeps what it was given.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("epd.worker")

SMALL_MODEL_BYTES = 16 << 20   # under this much weight data, one thread is faster


def fit_threads(model: torch.nn.Module) -> int:
    """Set (and return) this process's torch intra-op threads for ``model``."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if weight_bytes < SMALL_MODEL_BYTES and torch.get_num_threads() > 1:
        torch.set_num_threads(1)
        log.info("model weights %.1f MiB: one torch thread (a small model's ops are too small to split)",
                 weight_bytes / 2**20)
    return torch.get_num_threads()
