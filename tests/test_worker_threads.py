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


def test_a_decode_worker_fits_the_thread_its_forwards_run_on():
    """OpenMP's thread count is per calling thread: fitting only the event loop's thread left the
    demo model's forwards on a two-thread team whose idle thread spun half a core between steps."""
    import asyncio

    from decode_svc.server import build
    from inprocess_backend import load_adapter
    from runtime.worker import torch_thread
    from runtime.worker.settings import WorkerSettings

    adapter, _ = load_adapter()
    before = torch.get_num_threads()
    forward_before = asyncio.run(torch_thread.run(torch.get_num_threads))

    async def build_and_read() -> int:
        await torch_thread.run(torch.set_num_threads, 2)   # what OMP_NUM_THREADS=2 gives the thread
        servicer = await build(WorkerSettings(kv_memory_mb=8, kv_transport="grpc"), adapter)
        try:
            return await torch_thread.run(torch.get_num_threads)
        finally:
            await servicer.close()

    try:
        assert asyncio.run(build_and_read()) == 1
    finally:
        torch.set_num_threads(before)
        asyncio.run(torch_thread.run(torch.set_num_threads, forward_before))
