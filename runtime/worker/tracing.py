"""OpenTelemetry traces: off by default, and free when off.

On when ``--otlp-traces-endpoint URL`` (vLLM's flag, ``EPD_OTLP_TRACES_ENDPOINT``) is set,
or one of the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``
variables is (the exporter then reads them and the other ``OTEL_EXPORTER_OTLP_*`` variables
itself: headers, timeout, compression). ``setup_tracing`` runs once per process at start-up,
before any server or channel exists: an SDK ``TracerProvider`` whose resource names the
process (``service.name``: ``epd-gateway``, ``epd-encoder``, ``epd-prefill``, ``epd-decode``),
a batch exporter over OTLP/HTTP protobuf, and the OpenTelemetry gRPC aio instrumentation for
servers and clients, which carries the W3C trace context in each call's metadata. The gateway
adds the FastAPI instrumentation to its app (``instrument_app``).

``span(name, **attributes)`` is the one way epd code opens a span: with tracing off it is
``contextlib.nullcontext()`` and epd imports nothing of OpenTelemetry. Work that runs later on a
scheduler loop, outside its RPC's context, keeps ``current_context()`` (``None`` when off) and
passes it as ``parent``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class _Tracing:
    """The process's tracing state; set once by ``setup_tracing`` (OpenTelemetry's provider is
    process-wide too), read by ``span``."""

    tracer: Any = None
    provider: Any = None


_STATE = _Tracing()


def tracing_wanted(endpoint: str | None) -> bool:
    return bool(endpoint) or any(os.environ.get(v) for v in ENDPOINT_VARIABLES)


def setup_tracing(service_name: str, endpoint: str | None) -> bool:
    """Turn tracing on for this process when an endpoint is configured; True when on."""
    if not tracing_wanted(endpoint) or _STATE.tracer is not None:
        return _STATE.tracer is not None
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    GrpcAioInstrumentorServer().instrument(tracer_provider=provider)
    GrpcAioInstrumentorClient().instrument(tracer_provider=provider)
    _STATE.provider = provider
    _STATE.tracer = provider.get_tracer("epd")
    return True


def tracing_on() -> bool:
    return _STATE.tracer is not None


def instrument_app(app: Any) -> None:
    """The gateway's HTTP server spans (FastAPI instrumentation); a no-op with tracing off."""
    if _STATE.tracer is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, tracer_provider=_STATE.provider, excluded_urls="health,metrics,dashboard")


def current_context() -> Any:
    """The active trace context, to parent work that runs later elsewhere; ``None`` when off."""
    if _STATE.tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


@contextlib.contextmanager
def _span(name: str, parent: Any, attributes: dict[str, Any]) -> Iterator[Any]:
    clean = {k: v for k, v in attributes.items() if v is not None}
    with _STATE.tracer.start_as_current_span(name, context=parent, attributes=clean) as s:
        yield s


def span(name: str, parent: Any = None, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span around a block (``epd.*`` attribute names by convention); nothing at all when off.
    The yielded span (``None`` when off) takes more attributes with ``set_attribute``."""
    if _STATE.tracer is None:
        return contextlib.nullcontext()
    return _span(name, parent, attributes)


def annotate(**attributes: Any) -> None:
    """Attributes on the current span (the HTTP or RPC server span); a no-op when off."""
    if _STATE.tracer is None:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    for key, value in attributes.items():
        if value is not None:
            current.set_attribute(key, value)


def record_span(name: str, parent: Any, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A finished span over ``[start_ns, end_ns]`` (``time.time_ns``) under ``parent``: work done for
    several requests at once (one batched forward) recorded once per request; a no-op when off."""
    if _STATE.tracer is None:
        return
    clean = {k: v for k, v in attributes.items() if v is not None}
    _STATE.tracer.start_span(name, context=parent, attributes=clean, start_time=start_ns).end(end_time=end_ns)


def shutdown_tracing() -> None:
    """Flush what is buffered (at process exit); a no-op with tracing off."""
    if _STATE.provider is not None:
        with contextlib.suppress(Exception):
            _STATE.provider.shutdown()
