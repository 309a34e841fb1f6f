"""``epd encoder``: one encoder worker process."""

from __future__ import annotations

import asyncio
import sys

import torch

from cache import open_encoder_cache
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.faults import FaultInjector
from runtime.grpc_server import WorkerServer, configure_logging, run_until_signal
from runtime.model_adapter import VLMAdapter
from runtime.settings import WorkerSettings, parse_worker_args
from runtime.worker_metrics import serve_worker_metrics

from .batcher import EncodeBatcher
from .servicer import EncoderServicer


async def build(settings: WorkerSettings) -> tuple[WorkerServer, EncoderServicer]:
    adapter = await asyncio.to_thread(VLMAdapter.load, settings.model, device=settings.device, dtype=settings.dtype,
                                      max_images=settings.max_images)
    cache = open_encoder_cache(settings.redis_url, max_bytes=settings.cache_max_mb * 2**20, ttl_s=settings.cache_ttl_s)
    faults = FaultInjector(settings.faults)
    batcher = EncodeBatcher(adapter, max_batch=settings.encoder_max_batch, window_ms=settings.encoder_batch_window_ms,
                            stall_ms=faults.amount("stall_encoder_ms"))
    servicer = EncoderServicer(adapter, cache, batcher)
    server = WorkerServer("encoder", settings, "Encoder")
    pb_grpc.add_EncoderServicer_to_server(servicer, server.server)
    batcher.start()
    servicer.address = await server.start()
    return server, servicer


async def _serve(settings: WorkerSettings) -> None:
    server, servicer = await build(settings)
    serve_worker_metrics(settings.metrics_port, lambda: servicer)
    try:
        await run_until_signal(server, servicer.drain)
    finally:
        await servicer.batcher.stop()
        await servicer.cache.close()


def main(argv: list[str]) -> int:
    settings = parse_worker_args("encoder", argv)
    configure_logging()
    torch.set_grad_enabled(False)
    asyncio.run(_serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
