"""The gateway's HTTP app: an OpenAI-compatible chat API over a ``ChatBackend``.

Routes:

=============================  ==========================================================
``POST /v1/chat/completions``  chat, streaming (SSE) or not; see ``gateway.chat_handler``
``GET /v1/models``             the one served model
``GET /v1/models/{model}``     it, or 404
``GET /health``                200 when the backend is healthy, else 503
``GET /metrics``               Prometheus text format (``gateway.http_metrics``)
``GET /status``                the backend's ``status()`` as JSON
``GET /dashboard``             the live operator page; its data is ``/dashboard/data`` (``gateway.dashboard``)
=============================  ==========================================================

With API keys configured (``--api-key`` / ``EPD_API_KEY``), ``/v1/*`` (and, unless
``open_metrics_and_status``, ``/metrics``, ``/status`` and ``/dashboard/data``) need ``Authorization:
Bearer KEY``; see ``gateway.auth``. ``/health`` is always open.

Request headers: ``x-ttft-slo-ms`` and ``x-itl-slo-ms`` override the settings'
SLOs for one request. Response headers: ``x-request-id``; for non-streaming
chat ``x-epd-ttft-breakdown``: a JSON object of the backend's per-stage entries
(``*_ms`` milliseconds; see the orchestrator) plus ``gateway_ms``, the time spent
here before the backend got the request, and ``ttft_ms``, the time to first
token. Streaming responses carry the same object as ``epd_ttft_breakdown`` in
the chunk with ``finish_reason`` (headers are sent before the first token).

``create_app`` builds everything from its arguments (no module globals): the
processor is loaded once, here; the backend is started and closed by the
lifespan, together with the remote-image fetcher (``gateway.images``) and its HTTP client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.worker.gc_heap import freeze_startup_heap, install_pause_metric
from runtime.worker.tracing import instrument_app

from .auth import install_api_keys
from .chat_backend import ChatBackend
from .chat_handler import ChatHandler
from .completions_handler import CompletionsHandler
from .completions_schema import CompletionRequest, DetokenizeRequest, DetokenizeResponse, TokenizeResponse
from .dashboard import install_dashboard
from .errors import ApiError, error_body, install_error_handlers
from .images import ImageLimits, ImageLoader, RemoteImageFetcher
from .live_window import CounterHistory, read_counters
from .loop_lag import LoopLagMonitor
from .media_policy import MediaNetwork
from .http_metrics import HttpMetrics
from .openai_schema import ChatCompletionRequest, ModelCard, ModelList
from .prompt import PromptBuilder
from .request_journal import RequestJournal
from .settings import GatewaySettings
from .tokenize_handler import TokenizeHandler

log = logging.getLogger("epd.gateway")


class BodyLimitMiddleware:
    """Refuses bodies over ``max_bytes`` with 413: by ``Content-Length`` before reading, else while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            error = None
            if not declared.strip().isdigit():
                error = ApiError.bad_request("Content-Length header is not a number", None, "invalid_header")
            elif int(declared) > self.max_bytes:
                error = self._too_large()
            if error is not None:
                await error.response()(scope, receive, send)
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()  # surfaces from request.body(); the handlers answer 413
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body is larger than the limit of {self.max_bytes} bytes",
                        "invalid_request_error", None, "request_too_large")


COMPONENTS = "#/components/schemas/"


def _publish_body_schemas(app: FastAPI, models: list[type[BaseModel]], served_model: str) -> None:
    """Put the request models the handlers parse themselves into the OpenAPI document's components,
    with their nested definitions, so every ``$ref`` in ``/openapi.json`` resolves. A ``model``
    field names the one model served here."""
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template=COMPONENTS + "{model}")
        schemas.update(schema.pop("$defs", {}))
        if "model" in schema.get("properties", {}):
            schema["properties"]["model"]["enum"] = [served_model]
        schemas[model.__name__] = schema
    for schema in schemas.values():
        # the models keep unknown fields only to refuse them by name (gateway.request_fields): to a
        # client, a field outside the schema is not accepted (no-op values of known ones aside)
        if schema.get("additionalProperties") is True:
            schema["additionalProperties"] = False
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    settings: GatewaySettings,
    orchestrator: ChatBackend,
    *,
    prompt_builder: PromptBuilder | None = None,
    registry: CollectorRegistry | None = None,
    media_network: MediaNetwork | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """The gateway app.

    ``prompt_builder`` and ``media_network`` are for injection (tests); by default the first is built
    from ``settings`` and remote images go through the system's resolver and sockets (always behind
    the media URL policy, ``gateway.media_policy``).
    ``registry`` holds the HTTP metrics (default: a new one per app); ``/metrics`` renders it
    followed by prometheus_client's process-wide ``REGISTRY``, where module-level metrics such as
    the pipeline's (``gateway.pipeline_metrics``) live.
    ``freeze_heap`` (the ``epd gateway`` process, not tests that build many apps in one process):
    the heap as it stands when start-up ends is frozen out of later collections (``gc_heap``).
    """
    prompts = prompt_builder or PromptBuilder.from_pretrained(settings.model)
    metrics = HttpMetrics(registry)
    limits = ImageLimits(settings.max_image_bytes, settings.max_image_pixels, settings.max_image_side)
    images = ImageLoader(limits, fetcher=None)
    loop_lag = LoopLagMonitor(on_sample=metrics.loop_lag.set)
    journal = RequestJournal()
    history = CounterHistory(lambda: read_counters([metrics.registry, *metrics.extra]))
    handler = ChatHandler(settings, orchestrator, prompts, images, metrics, loop_lag, journal)
    completions = CompletionsHandler(handler)
    tokenizing = TokenizeHandler(handler)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await orchestrator.start()
        fetcher = RemoteImageFetcher.open(settings, media_network) if settings.allow_remote_images else None
        images.fetcher = fetcher
        loop_lag.start()
        sampler = asyncio.create_task(history.run(), name="dashboard-counter-history")
        log.info("gateway serving %s from %s", settings.served_model_name, settings.model)
        install_pause_metric()
        if freeze_heap:
            freeze_startup_heap()
        try:
            yield
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            await loop_lag.stop()
            images.fetcher = None
            try:
                await orchestrator.close()
            finally:
                if fetcher is not None:
                    await fetcher.aclose()

    app = FastAPI(title="epd gateway", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.prompts = prompts
    app.state.loop_lag = loop_lag
    install_error_handlers(app)
    instrument_app(app)   # HTTP server spans, when tracing is on (runtime/worker/tracing.py)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:   # added last: the outermost middleware, so nothing runs before the key check
        install_api_keys(app, settings.api_key, settings.open_metrics_and_status, metrics.registry)

    @app.post(
        "/v1/chat/completions",
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"{COMPONENTS}ChatCompletionRequest"}}}}},
        summary="OpenAI chat completions (stream true or false)",
    )
    async def chat_completions(request: Request) -> Response:
        return await handler.handle(request)

    def model_card() -> ModelCard:
        return ModelCard(id=settings.served_model_name, created=created)

    @app.post(
        "/v1/completions",
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"{COMPONENTS}CompletionRequest"}}}}},
        summary="OpenAI (legacy) text completions (stream true or false)",
    )
    async def text_completions(request: Request) -> Response:
        return await completions.handle(request)

    @app.post("/tokenize", summary="vLLM: a chat's (messages) or a text's (prompt) token ids; no model work")
    async def tokenize(request: Request) -> TokenizeResponse:
        return await tokenizing.tokenize(request)

    @app.post("/detokenize", summary="vLLM: token ids back to text",
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": {"$ref": f"{COMPONENTS}DetokenizeRequest"}}}}})
    async def detokenize(request: Request) -> DetokenizeResponse:
        return await tokenizing.detokenize(request)

    _publish_body_schemas(app, [ChatCompletionRequest, CompletionRequest, DetokenizeRequest], settings.served_model_name)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        if model != settings.served_model_name:
            raise ApiError(404, f"model {model!r} is not served here", "invalid_request_error", "model", "model_not_found")
        return model_card()

    install_dashboard(app, settings, orchestrator, metrics, history, journal)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            ok = orchestrator.healthy()
        except Exception:
            log.exception("health check raised")
            ok = False
        if ok:
            return JSONResponse({"status": "ok"})
        body = error_body("no healthy worker serves every stage", "server_error", None, "unhealthy")
        return JSONResponse({"status": "unavailable", **body}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    @app.get("/status")
    async def status() -> dict:
        return orchestrator.status()

    return app
