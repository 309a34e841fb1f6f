"""``epd decode``: one decode worker process."""

from __future__ import annotations

import asyncio
import logging
import sys

from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from cache.embedding_fetch import EmbeddingFetcher
from runtime.worker.faults import FaultInjector
from runtime.worker.grpc_server import WorkerServer, run_worker
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter
from runtime.worker.settings import WorkerSettings

from .bulk_receiver import BulkKVServer
from .servicer import DecodeServicer

log = logging.getLogger("epd.decode")


async def build(settings: WorkerSettings) -> tuple[WorkerServer, DecodeServicer]:
    adapter = await asyncio.to_thread(VLMAdapter.load, settings.model, device=settings.device, dtype=settings.dtype,
                                      max_images=settings.max_images_per_request)
    pool = KVBlockPool.from_memory_budget(adapter.kv_layout, settings.kv_memory_mb * 2**20, settings.kv_block_size,
                                          device=settings.device)
    servicer = DecodeServicer(adapter, pool, fetcher=EmbeddingFetcher.for_settings(settings), max_batch=settings.decode_max_batch,
                              prefill_chunk_tokens=settings.prefill_chunk_tokens, lease_margin_s=settings.lease_margin_s,
                              max_lease_s=settings.max_lease_s, faults=FaultInjector(settings.faults))
    server = WorkerServer("decode", settings, "Decode")
    pb_grpc.add_DecodeServicer_to_server(servicer, server.server)
    servicer.start()
    servicer.address = await server.start()
    if settings.kv_transport == "bulk":
        bulk = BulkKVServer(servicer.receiver, servicer.faults, servicer.stream_ended,
                            idle_timeout_s=settings.bulk_idle_timeout_s, token=settings.internal_token)
        port = await bulk.start(settings.host, settings.bulk_port)
        servicer.bulk_address = f"{servicer.address.rsplit(':', 1)[0]}:{port}"
        servicer.on_stop(bulk.stop)
        log.info("bulk KV path on %s", servicer.bulk_address)
    log.info("decode KV pool: %d blocks of %d tokens (%s)", pool.num_blocks, pool.block_size, adapter.kv_layout.describe())
    return server, servicer


def main(argv: list[str]) -> int:
    return run_worker("decode", argv, build)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
