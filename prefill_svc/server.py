"""``epd prefill``: one prefill worker process."""

from __future__ import annotations

import asyncio
import sys

from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from cache.embedding_fetch import EmbeddingFetcher
from runtime.worker.faults import FaultInjector
from runtime.worker.grpc_server import WorkerServer, run_worker
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter
from runtime.worker.settings import WorkerSettings

from .scheduler import PrefillScheduler
from .servicer import PrefillServicer


async def build(settings: WorkerSettings) -> tuple[WorkerServer, PrefillServicer]:
    adapter = await asyncio.to_thread(VLMAdapter.load, settings.model, device=settings.device, dtype=settings.dtype,
                                      max_images=settings.max_images_per_request)
    scratch = KVBlockPool.from_memory_budget(adapter.kv_layout, settings.kv_memory_mb * 2**20, settings.kv_block_size,
                                             device=settings.device)
    scheduler = PrefillScheduler(adapter, scratch, model_fingerprint=adapter.model_fingerprint,
                                 max_batch=settings.prefill_max_batch)
    servicer = PrefillServicer(adapter, scheduler, EmbeddingFetcher.for_settings(settings),
                               default_chunk_tokens=settings.prefill_chunk_tokens, faults=FaultInjector(settings.faults),
                               token=settings.internal_token)
    server = WorkerServer("prefill", settings, "Prefill")
    pb_grpc.add_PrefillServicer_to_server(servicer, server.server)
    scheduler.start()
    servicer.address = await server.start()
    return server, servicer


def main(argv: list[str]) -> int:
    return run_worker("prefill", argv, build)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
