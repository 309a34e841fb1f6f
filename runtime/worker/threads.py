"""A model worker's torch threads, fitted to its model once it is loaded.

``epd serve`` gives each decode worker the host's cores (``launcher/serve.py``,
``worker_threads``): on the 140M bench model two threads halve the decode step (memory-bound
fp32 GEMMs). A tiny model's ops are too small to split: each parallel region then costs more
in thread hand-offs than it saves, and its idle threads take cores the gateway and encoder
need (the 0.6M demo model served fewer requests/s with two decode threads than with one,
``bench/RESULTS.md``). So a worker whose weights are under ``SMALL_MODEL_BYTES`` runs on one
thread whatever ``OMP_NUM_THREADS`` says; a larger one keeps what it was given.

OpenMP's thread count is per calling thread: ``torch.set_num_threads`` on the event loop leaves
the torch thread, where the forwards run (``runtime/worker/torch_thread.py``), with its own count
and its own team, whose idle threads spin between steps (the demo model's decode worker had one
OpenMP thread busy half a core while serving). ``fit_worker_threads`` sets both threads.
"""

from __future__ import annotations

import logging

import torch

from runtime.worker import torch_thread

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


async def fit_worker_threads(model: torch.nn.Module) -> int:
    """``fit_threads`` on the torch thread, where the model's forwards run; the calling thread gets the same count."""
    threads = await torch_thread.run(fit_threads, model)
    torch.set_num_threads(threads)
    return threads
