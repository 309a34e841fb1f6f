"""``epd <role>``: the life of one worker process, the same for every role.

flags -> refuse a listener beyond loopback without a token, or a checkpoint the split
does not support (one line, exit status 2, nothing loaded) -> load the model -> the
role's ``build`` (its parts, their background loops started) -> the start-up heap frozen
(``gc_heap.py``) -> the gRPC server (health, reflection, the role's service; ``grpc_server.py``)
and the metrics port -> serve until SIGTERM/SIGINT -> drain -> stop -> the servicer's ``close``.

A role's ``server.py`` states only what is its own: one ``WorkerRole``.

The event loop is uvloop's where it is installed (``uvicorn[standard]`` brings it; the gateway runs on
it too), else asyncio's own: every token a decode step makes crosses from the torch thread to the
loop (``call_soon_threadsafe``) and out through gRPC, and uvloop makes those hand-offs cheaper. On
the demo model's decode path, one request at a time: first token 11.3 -> 11.0 ms and ITL p99 4.5
-> 4.1 ms; 16 at a time 196 -> 203 req/s (``bench/RESULTS.md``).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from runtime.worker import torch_thread
from runtime.worker.grpc_server import WorkerServer, run_until_signal
from runtime.worker.internal_auth import exposure_problem
from runtime.worker.log_format import configure_logging
from runtime.worker.tracing import setup_tracing, shutdown_tracing
from runtime.worker.serving_state import ServingState
from runtime.worker.settings import WorkerSettings

if TYPE_CHECKING:
    import grpc

    from runtime.model.kv_pool import KVBlockPool
    from runtime.model.model_adapter import VLMAdapter


class WorkerServicer(Protocol):
    """What every role's servicer offers the runner."""

    state: ServingState

    def busy(self) -> object: ...                  # what a drain waits for (truthy: work in flight)
    async def close(self) -> None: ...             # stop its loops, release what it holds, close its clients
    def local_stats(self) -> dict[str, int]: ...   # the metrics port's gauges and counters


@dataclass(frozen=True, slots=True)
class WorkerRole:
    name: str                                                   # "decode": flags, default port, registry, logs
    service: str                                                # "Decode": the proto service (health, reflection)
    add_servicer: Callable[[Any, grpc.aio.Server], None]        # the generated add_<Service>Servicer_to_server
    build: Callable[[WorkerSettings, VLMAdapter], Awaitable[WorkerServicer]]   # its parts, loops started


def kv_pool_for(adapter: VLMAdapter, settings: WorkerSettings, *, prefix_cache: bool = False) -> KVBlockPool:
    """The worker's KV block pool: ``EPD_KV_MEMORY_MB`` of blocks of ``EPD_KV_BLOCK_SIZE`` tokens, allocated once
    (``prefix_cache``: retired prompt blocks stay cached; decode passes ``EPD_PREFIX_CACHE``). A model with
    sliding-window layers keeps them in rings (``EPD_SLIDING_WINDOW_KV``): sized for the longest run one
    forward writes (a prompt chunk, or an image span the chunker keeps whole), with no prefix cache."""
    from runtime.model.kv_pool import KVBlockPool

    from runtime.model.kv_layout import PageGroups

    windowed = PageGroups.for_layout(adapter.kv_layout, settings.sliding_window_kv).windowed
    chunk = max(settings.prefill_chunk_tokens, adapter.longest_image_span) if windowed else None
    return KVBlockPool.from_memory_budget(adapter.kv_layout, settings.kv_memory_mb * 2**20, settings.kv_block_size,
                                          device=settings.device, prefix_cache=prefix_cache and not windowed,
                                          window_chunk=chunk)


def run_worker(role: WorkerRole, argv: list[str]) -> int:
    """``epd <role>``: parse flags, build the role's server, serve until a signal, drain, close."""
    import torch

    from runtime.model.supported_models import UnsupportedModel, check_checkpoint
    from runtime.worker.settings import parse_worker_args

    settings = parse_worker_args(role.name, argv)
    problem = exposure_problem(settings.host, settings.internal_token, settings.allow_unauthenticated)
    if problem:   # before loading anything: one clear line, exit status 2
        print(f"epd {role.name}: {problem}", file=sys.stderr)
        return 2
    try:
        check_checkpoint(settings.model)   # before loading anything: one line, not a traceback
    except (UnsupportedModel, OSError) as exc:
        print(f"epd {role.name}: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2
    configure_logging(settings.log_format)
    setup_tracing(f"epd-{role.name}", settings.otlp_traces_endpoint)   # before any server or channel
    torch.set_grad_enabled(False)
    try:
        run_event_loop(_serve(role, settings))
    finally:
        shutdown_tracing()
    return 0


def run_event_loop(main: Awaitable[None]) -> None:
    """``main`` to its end on uvloop's event loop, or asyncio's where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


async def _serve(role: WorkerRole, settings: WorkerSettings) -> None:
    from runtime.model.model_adapter import VLMAdapter
    from runtime.worker.gc_heap import freeze_startup_heap, install_pause_metric
    from runtime.worker.worker_metrics import serve_worker_metrics

    adapter = await torch_thread.run(VLMAdapter.load, settings.model, device=settings.device, dtype=settings.dtype,
                                      max_images=settings.limit_images_per_request)
    servicer = await role.build(settings, adapter)
    try:
        server = WorkerServer(role.name, settings, role.service)
        role.add_servicer(servicer, server.server)
        install_pause_metric()
        # the model, torch and gRPC stay out of every later full collection; before the server
        # reports itself serving, so the one collection here stalls no request
        freeze_startup_heap()
        servicer.state.address = await server.start()
        serve_worker_metrics(settings.metrics_port, lambda: servicer)
        await run_until_signal(server, lambda timeout_s: servicer.state.drain(servicer.busy, timeout_s))
    finally:
        await servicer.close()

