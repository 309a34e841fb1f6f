"""Gateway settings: typed, from ``EPD_*`` environment variables (see docs/deploy.md).

Invalid values raise a clear ``pydantic.ValidationError`` at start-up, never later.
Lists (``EPD_ENCODER_ADDRS`` ...) are comma-separated: ``host:port,host:port``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from runtime.worker.internal_auth import validate_token

MiB = 1 << 20

AddressList = Annotated[list[str], NoDecode]
NameList = Annotated[list[str], NoDecode]   # comma-separated in the environment


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EPD_", extra="ignore", env_ignore_empty=True,
                                      hide_input_in_errors=True)   # errors never echo EPD_INTERNAL_TOKEN

    # model and listening address
    model: str = "models/demo-vlm"                  # processor + config are read from here; never the weights
    served_model_name: str = Field(default="demo-vlm", min_length=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)

    # latency targets (per request overridable by x-ttft-slo-ms / x-itl-slo-ms)
    ttft_slo_ms: float = Field(default=5000.0, gt=0)
    itl_slo_ms: float = Field(default=1000.0, gt=0)
    deadline_grace_ms: float = Field(default=250.0, ge=0)   # gateway waits this long past the TTFT deadline before its own 504
    # admission adds this quantile of recent (actual - predicted) TTFT: about the share of admitted requests meant to meet it
    admission_quantile: float = Field(default=0.95, ge=0, le=1)

    # request limits, all checked before any model work
    max_body_bytes: int = Field(default=20 * MiB, ge=1024)
    max_image_bytes: int = Field(default=10 * MiB, ge=1)
    max_image_pixels: int = Field(default=4096 * 4096, ge=1)
    max_image_side: int = Field(default=16384, ge=1)          # refuses 1 x 16M "images" the pixel limit lets through
    max_images_per_request: int = Field(default=4, ge=0)
    allow_remote_images: bool = True
    remote_image_timeout_s: float = Field(default=5.0, gt=0)
    max_tokens_limit: int = Field(default=4096, ge=1)
    default_max_tokens: int = Field(default=256, ge=1)

    # orchestration (read by gateway.orchestrator)
    redis_url: str | None = None
    encoder_addrs: AddressList = Field(default_factory=list)
    prefill_addrs: AddressList = Field(default_factory=list)
    decode_addrs: AddressList = Field(default_factory=list)
    placement: Literal["conditional", "colocated", "disaggregated"] = "conditional"
    prefill_chunk_tokens: int = Field(default=256, ge=1)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # sent on every worker RPC (runtime/internal_auth.py); the workers' EPD_INTERNAL_TOKEN
    internal_token: SecretStr | None = None

    @field_validator("internal_token", mode="before")
    @classmethod
    def _token(cls, v: object) -> SecretStr | None:
        return validate_token(v)

    # security (gateway.auth, gateway.media_fetch; docs/deploy.md "Security")
    api_key: NameList = Field(default_factory=list, repr=False)   # EPD_API_KEY=k1,k2: /v1/* then needs one
    open_metrics_and_status: bool = False       # with keys set: serve /metrics and /status without one
    cache_salt_per_api_key: bool = True         # with keys set: each key is its own encoder-cache namespace
    allowed_media_domains: NameList = Field(default_factory=list)   # empty: any public host
    allow_private_media_urls: bool = False      # fetch media from private/loopback addresses (on-prem)

    # per-request caps and prompt building (issue 15)
    max_slo_ms: float = Field(default=120_000.0, gt=0)   # x-ttft-slo-ms / x-itl-slo-ms above this are a 400
    prompt_workers: int = Field(default=4, ge=1)          # prompts rendered + tokenized at once, one processor copy each

    @field_validator("encoder_addrs", "prefill_addrs", "decode_addrs", "api_key", "allowed_media_domains", mode="before")
    @classmethod
    def _split_addresses(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

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
