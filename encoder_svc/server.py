"""``epd encoder``: one encoder worker process (the common life: ``runtime/worker/runner.py``)."""

from __future__ import annotations

from cache import open_encoder_cache_for_settings
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.model.model_adapter import VLMAdapter
from runtime.worker.faults import FaultInjector
from runtime.worker.runner import WorkerRole, run_worker
from runtime.worker.settings import WorkerSettings

from .batcher import EncodeBatcher
from .servicer import EncoderServicer


async def build(settings: WorkerSettings, adapter: VLMAdapter) -> EncoderServicer:
    """The encoder cache, the micro-batcher (started) and the servicer."""
    faults = FaultInjector(settings.faults)
    batcher = EncodeBatcher(adapter, max_batch=settings.encoder_max_batch, window_ms=settings.encoder_batch_window_ms)
    servicer = EncoderServicer(adapter, open_encoder_cache_for_settings(settings), batcher,
                               stall_ms=faults.amount("stall_encoder_ms"))
    batcher.start()
    return servicer


ROLE = WorkerRole("encoder", "Encoder", pb_grpc.add_EncoderServicer_to_server, build)


def main(argv: list[str]) -> int:
    """``epd encoder`` (launcher/cli.py)."""
    return run_worker(ROLE, argv)
