"""Gateway settings: typed, from ``EPD_*`` environment variables (see docs/deploy.md).

Invalid values raise a clear ``pydantic.ValidationError`` at start-up, never later.
Lists (``EPD_ENCODER_ADDRS`` ...) are comma-separated: ``host:port,host:port``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime.worker.internal_auth import validate_token
from runtime.worker.settings import CommaList

MiB = 1 << 20



class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EPD_", extra="ignore", env_ignore_empty=True,
                                      hide_input_in_errors=True)   # errors never echo EPD_INTERNAL_TOKEN

    # model and listening address
    model: str = Field(default="models/demo-vlm", description="model directory (the gateway reads its processor and config, never its weights)")
    served_model_name: str = Field(default="demo-vlm", min_length=1, description="model name in the API")
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="gateway: HTTP port")

    # latency targets (per request overridable by x-ttft-slo-ms / x-itl-slo-ms)
    ttft_slo_ms: float = Field(default=5000.0, gt=0, description="gateway: time-to-first-token target, ms (x-ttft-slo-ms per request)")
    itl_slo_ms: float = Field(default=1000.0, gt=0, description="gateway: inter-token latency target, ms (x-itl-slo-ms per request)")
    deadline_grace_ms: float = Field(default=250.0, ge=0, description="gateway: waits this long past the TTFT deadline before its own 504")
    admission_quantile: float = Field(default=0.95, ge=0, le=1, description="gateway: admission's margin is this quantile of recent TTFT misprediction, about the share of admitted requests meant to meet the deadline")

    # request limits, all checked before any model work
    max_body_bytes: int = Field(default=20 * MiB, ge=1024, description="gateway: largest request body, bytes")
    max_image_bytes: int = Field(default=10 * MiB, ge=1, description="gateway: largest image, bytes")
    max_image_pixels: int = Field(default=4096 * 4096, ge=1, description="gateway: largest image, pixels")
    max_image_side: int = Field(default=16384, ge=1, description="gateway: longest image side, pixels")
    limit_images_per_request: int = Field(default=8, ge=0, description="images one request may carry, counted before any work: more is a 400 (`--limit-images-per-request` on serve, gateway and workers)")
    allow_remote_images: bool = Field(default=True, description="gateway: fetch http(s) image URLs (within the media URL policy)")
    remote_image_timeout_s: float = Field(default=5.0, gt=0, description="gateway: whole-fetch limit for one image URL, seconds")
    max_tokens_limit: int = Field(default=4096, ge=1, description="gateway: largest max_tokens a request may ask for")
    default_max_tokens: int = Field(default=256, ge=1, description="gateway: max_tokens when a request gives none")

    # orchestration (read by gateway.orchestrator)
    redis_url: str | None = Field(default=None, description="Redis for discovery and the shared encoder cache (unset: static lists, in-process cache)")
    encoder_addrs: CommaList = Field(default_factory=list, description="comma-separated host:port of the encoder workers (static discovery)")
    prefill_addrs: CommaList = Field(default_factory=list, description="comma-separated host:port of the prefill workers (static discovery)")
    decode_addrs: CommaList = Field(default_factory=list, description="comma-separated host:port of the decode workers (static discovery)")
    placement: Literal["conditional", "colocated", "disaggregated"] = Field(
        default="conditional", description="gateway: `conditional` (per request, by cost), `colocated` or `disaggregated`")
    prefill_chunk_tokens: int = Field(default=256, ge=1, description="prompt tokens per prefill chunk (and per KV chunk)")
    inline_embedding_bytes: int = Field(default=MiB, ge=0, le=64 * MiB, description="gateway: an encoded image's embedding of at most this many bytes comes back with Encode and rides inline on the Generate or Prefill that follows, so that worker need not fetch it (0: always fetched by key)")
    colocated_encode_max_ms: float = Field(default=15.0, ge=0, description="gateway: a colocated request whose images are all new goes to its decode worker with their bytes, and that worker encodes them itself (one hop less before the first token), when the cost model puts their encode, plus what is left of the encodes this gateway sent to that worker before, at most this many milliseconds: the stall it may put on that worker's other sequences (0: always the encoder)")
    generate_stream: bool = Field(default=True, description="gateway: send each request's Generate to its decode worker as a message on one stream kept open to that worker (Decode.GenerateMany), not as a gRPC call of its own: a new call costs about as much again as the message, on every request's first token (bench/request_hop.py); false: a call per request. With tracing on, each request has its own call anyway (its trace context rides in the call's metadata)")
    drain_timeout_s: float = Field(default=30.0, ge=0, description="graceful drain on SIGTERM, seconds")
    internal_token: SecretStr | None = Field(default=None, description="shared secret every worker RPC and bulk KV stream must carry")

    @field_validator("internal_token", mode="before")
    @classmethod
    def _token(cls, v: object) -> SecretStr | None:
        return validate_token(v)

    # security (gateway.auth, gateway.media_policy; docs/deploy.md "Security")
    api_key: CommaList = Field(default_factory=list, repr=False, description="gateway: comma-separated API keys; set, `/v1/*` needs `Authorization: Bearer KEY`")
    open_metrics_and_status: bool = Field(default=False, description="gateway, with keys: serve `/metrics` and `/status` without a key")
    cache_salt_per_api_key: bool = Field(default=True, description="gateway, with keys: each key is its own encoder-cache namespace")
    allowed_media_domains: CommaList = Field(default_factory=list, description="gateway: comma-separated hostnames image URLs may name (empty: any public host)")
    allow_private_media_urls: bool = Field(default=False, description="gateway: also fetch images from loopback and private addresses")

    # observability (gateway/dashboard/, gateway/request_journal.py, runtime/worker/tracing.py)
    log_format: Literal["text", "json"] = Field(default="text", description="log lines as `text` or one JSON object each (`--log-format json`; runtime/worker/log_format.py)")
    otlp_traces_endpoint: str | None = Field(default=None, description="OTLP/HTTP traces endpoint, e.g. `http://collector:4318/v1/traces` (`--otlp-traces-endpoint`; unset with no `OTEL_EXPORTER_OTLP_*` endpoint: tracing off)")

    # per-request caps and prompt building
    max_slo_ms: float = Field(default=120_000.0, gt=0, description="gateway: the largest x-ttft-slo-ms / x-itl-slo-ms a request may send")
    prompt_workers: int = Field(default=4, ge=1, description="gateway: prompts rendered and tokenized at once, each on its own processor copy")

    @field_validator("api_key")
    @classmethod
    def _keys_are_usable(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if not key.strip() or key != key.strip() or not key.isprintable():
                raise ValueError("an API key must be non-empty printable text without surrounding spaces")
        return keys

    @model_validator(mode="after")
    def _limits_agree(self) -> "GatewaySettings":
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) must not exceed max_tokens_limit ({self.max_tokens_limit})"
            )
        return self
