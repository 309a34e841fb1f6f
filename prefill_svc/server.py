"""``epd prefill``: one prefill worker process (the common life: ``runtime/worker/runner.py``)."""

from __future__ import annotations

from cache.embedding_fetch import EmbeddingFetcher
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.model.model_adapter import VLMAdapter
from runtime.worker.faults import FaultInjector
from runtime.worker.runner import WorkerRole, kv_pool_for, run_worker
from runtime.worker.settings import WorkerSettings

from .scheduler import PrefillScheduler
from .servicer import PrefillServicer


async def build(settings: WorkerSettings, adapter: VLMAdapter) -> PrefillServicer:
    """The scratch KV pool, the chunked-prefill scheduler (started) and the servicer."""
    scheduler = PrefillScheduler(adapter, kv_pool_for(adapter, settings), max_batch=settings.prefill_max_batch,
                                 step_tokens=settings.resolved_prefill_step_tokens())
    servicer = PrefillServicer(adapter, scheduler, EmbeddingFetcher.for_settings(settings),
                               default_chunk_tokens=settings.prefill_chunk_tokens, faults=FaultInjector(settings.faults),
                               token=settings.internal_token)
    scheduler.start()
    return servicer


ROLE = WorkerRole("prefill", "Prefill", pb_grpc.add_PrefillServicer_to_server, build)


def main(argv: list[str]) -> int:
    """``epd prefill`` (launcher/cli.py)."""
    return run_worker(ROLE, argv)
