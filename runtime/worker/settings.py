"""Worker settings: typed, from ``EPD_*`` environment variables, overridable by CLI flags.

The same variables configure ``epd serve``, docker compose and Kubernetes.
Invalid values raise a clear error at start-up, never later.
"""

from __future__ import annotations

import argparse
import socket
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from runtime.worker.internal_auth import validate_token

DEFAULT_PORTS = {"encoder": 50051, "prefill": 50052, "decode": 50053}

AddressList = Annotated[list[str], NoDecode]   # "host:port,host:port", as the gateway's lists


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EPD_", extra="ignore",
                                      hide_input_in_errors=True)   # errors never echo EPD_INTERNAL_TOKEN

    model: str = "models/demo-vlm"
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)           # 0 => the role's default
    advertise_host: str | None = None
    redis_url: str | None = None
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    heartbeat_s: float = Field(default=2.0, gt=0)
    # encoder
    encoder_max_batch: int = Field(default=16, ge=1)
    encoder_batch_window_ms: float = Field(default=3.0, ge=0)
    cache_max_mb: int = Field(default=256, ge=1)
    cache_ttl_s: int = Field(default=3600, ge=1)
    max_images: int = Field(default=4, ge=0)
    # prefill
    prefill_chunk_tokens: int = Field(default=256, ge=1)
    prefill_max_batch: int = Field(default=8, ge=1)
    # decode
    kv_memory_mb: int = Field(default=256, ge=1)
    kv_block_size: int = Field(default=16, ge=1)
    decode_max_batch: int = Field(default=64, ge=1)
    lease_margin_s: float = Field(default=10.0, ge=0)
    max_lease_s: float = Field(default=300.0, gt=0)        # cap on any lease, whatever deadline a caller sends
    kv_transport: Literal["bulk", "grpc"] = "bulk"   # bulk: raw TCP beside gRPC for KV bytes
    bulk_port: int = Field(default=0, ge=0, le=65535)   # 0: any free port (advertised in Reserve)
    bulk_idle_timeout_s: float = Field(default=30.0, gt=0)   # a bulk peer silent this long is closed
    # fault injection (off by default; see runtime/faults.py)
    faults: str = ""
    # security (runtime/internal_auth.py, runtime/peers.py): the token every worker RPC and bulk
    # stream must carry, and the only peers this worker dials (plus the Redis registry)
    internal_token: SecretStr | None = None
    allow_unauthenticated: bool = False
    encoder_addrs: AddressList = Field(default_factory=list)
    decode_addrs: AddressList = Field(default_factory=list)

    @field_validator("internal_token", mode="before")
    @classmethod
    def _token(cls, v: object) -> SecretStr | None:
        return validate_token(v)

    @field_validator("encoder_addrs", "decode_addrs", mode="before")
    @classmethod
    def _split_addresses(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("device")
    @classmethod
    def _cuda_available(cls, v: str) -> str:
        if v == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda requested but torch sees no CUDA device (install a CUDA build of torch)")
        return v

    def resolved_port(self, role: str) -> int:
        return self.port or DEFAULT_PORTS[role]

    def advertised_address(self, role: str, bound_port: int) -> str:
        host = self.advertise_host
        if not host:
            if self.host in ("0.0.0.0", "::", ""):
                try:
                    host = socket.gethostbyname(socket.gethostname())
                except OSError:
                    host = "127.0.0.1"
            else:
                host = self.host
        return f"{host}:{bound_port}"


def parse_worker_args(role: str, argv: list[str]) -> WorkerSettings:
    """CLI flags override environment; unknown flags are an error."""
    p = argparse.ArgumentParser(prog=f"epd {role}", description=f"run one {role} worker")
    p.add_argument("--model")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--advertise-host")
    p.add_argument("--redis-url")
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--kv-memory-mb", type=int)
    p.add_argument("--prefill-chunk-tokens", type=int)
    p.add_argument("--kv-transport", choices=["bulk", "grpc"], help="decode: accept KV over a raw TCP bulk path too")
    p.add_argument("--bulk-port", type=int)
    p.add_argument("--faults", help="fault injection spec, e.g. 'drop_chunk=0.2,seed=1' (tests only)")
    p.add_argument("--encoder-addrs", help="comma-separated host:port of the encoders this worker may fetch from")
    p.add_argument("--decode-addrs", help="comma-separated host:port of the decode workers this worker may push KV to")
    p.add_argument("--allow-unauthenticated", action="store_true", default=None,
                   help="listen beyond loopback without EPD_INTERNAL_TOKEN (trusted networks only)")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    return WorkerSettings(**overrides)
