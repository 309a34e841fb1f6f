"""``epd encoder``: one encoder worker process."""

from __future__ import annotations

import asyncio
import sys

from cache import open_encoder_cache_for_settings
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.worker.faults import FaultInjector
from runtime.worker.grpc_server import WorkerServer, run_worker
from runtime.model.model_adapter import VLMAdapter
from runtime.worker.settings import WorkerSettings

from .batcher import EncodeBatcher
from .servicer import EncoderServicer


async def build(settings: WorkerSettings) -> tuple[WorkerServer, EncoderServicer]:
    adapter = await asyncio.to_thread(VLMAdapter.load, settings.model, device=settings.device, dtype=settings.dtype,
                                      max_images=settings.max_images_per_request)
    cache = open_encoder_cache_for_settings(settings)
    faults = FaultInjector(settings.faults)
    batcher = EncodeBatcher(adapter, max_batch=settings.encoder_max_batch, window_ms=settings.encoder_batch_window_ms)
    servicer = EncoderServicer(adapter, cache, batcher, stall_ms=faults.amount("stall_encoder_ms"))
    server = WorkerServer("encoder", settings, "Encoder")
    pb_grpc.add_EncoderServicer_to_server(servicer, server.server)
    batcher.start()
    servicer.address = await server.start()
    return server, servicer


def main(argv: list[str]) -> int:
    return run_worker("encoder", argv, build)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
