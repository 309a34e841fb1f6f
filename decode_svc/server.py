"""``epd decode``: one decode worker process (the common life: ``runtime/worker/runner.py``)."""

from __future__ import annotations

import logging

from cache.embedding_fetch import EmbeddingFetcher
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.model.model_adapter import VLMAdapter
from runtime.worker.faults import FaultInjector
from runtime.worker.runner import WorkerRole, kv_pool_for, run_worker
from runtime.worker.settings import WorkerSettings
from runtime.worker.threads import fit_worker_threads

from .bulk_receiver import BulkKVServer
from .servicer import DecodeServicer

log = logging.getLogger("epd.decode")


async def build(settings: WorkerSettings, adapter: VLMAdapter) -> DecodeServicer:
    """The KV pool, the servicer (reservations, receiver, scheduler, lease reaper) and the bulk KV path."""
    threads = await fit_worker_threads(adapter.model)
    # hybrid decoders keep no prefix cache: a cached block has KV but no linear-attention state saved with it
    pool = kv_pool_for(adapter, settings, prefix_cache=settings.prefix_cache and not adapter.hybrid)
    servicer = DecodeServicer(adapter, pool, fetcher=EmbeddingFetcher.for_settings(settings), max_batch=settings.decode_max_batch,
                              prefill_chunk_tokens=settings.prefill_chunk_tokens, lease_margin_s=settings.lease_margin_s,
                              max_lease_s=settings.max_lease_s, faults=FaultInjector(settings.faults))
    servicer.start()
    if settings.kv_transport == "bulk":
        bulk = BulkKVServer(servicer.receiver, servicer.faults, idle_timeout_s=settings.bulk_idle_timeout_s,
                            token=settings.internal_token)
        port = await bulk.start(settings.host, settings.bulk_port)
        servicer.add_bulk_path(settings.advertised_address("decode", port), bulk.stop)
        log.info("bulk KV path on %s", servicer.bulk_address)
    log.info("decode KV pool: %d blocks of %d tokens (%s), prefix cache %s, %d torch threads", pool.num_blocks,
             pool.block_size, adapter.kv_layout.describe(), "on" if pool.prefix_cache else "off", threads)
    return servicer


ROLE = WorkerRole("decode", "Decode", pb_grpc.add_DecodeServicer_to_server, build)


def main(argv: list[str]) -> int:
    """``epd decode`` (launcher/cli.py)."""
    return run_worker(ROLE, argv)
