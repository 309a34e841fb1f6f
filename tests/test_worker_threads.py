"""A worker's torch threads fitted to its model (``runtime/worker/threads.py``)."""

from __future__ import annotations

import torch

from runtime.worker.threads import SMALL_MODEL_BYTES, fit_threads


def test_a_small_model_runs_on_one_thread_and_a_large_one_keeps_its_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        large = torch.nn.Linear(1024, SMALL_MODEL_BYTES // 4 // 1024 + 1, bias=False)
        assert fit_threads(large) == 2
        assert fit_threads(torch.nn.Linear(8, 8)) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
