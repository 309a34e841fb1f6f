"""Worker settings: typed, from ``EPD_*`` environment variables, overridable by CLI flags.

The same variables configure ``epd serve``, docker compose and Kubernetes.
Invalid values raise a clear error at start-up, never later.
"""

from __future__ import annotations

import argparse
import socket
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from runtime.worker.internal_auth import validate_token

DEFAULT_PORTS = {"encoder": 50051, "prefill": 50052, "decode": 50053}

def split_commas(value: object) -> object:
    """``"a, b,,c"`` -> ``["a", "b", "c"]`` (from the environment); lists pass through."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


# a list setting, comma-separated in the environment ("host:port,host:port"); the gateway's too
CommaList = Annotated[list[str], NoDecode, BeforeValidator(split_commas)]


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EPD_", extra="ignore",
                                      hide_input_in_errors=True)   # errors never echo EPD_INTERNAL_TOKEN

    model: str = Field(default="models/demo-vlm", description="model directory (a Hugging Face checkpoint)")
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="`cpu` or `cuda`")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="weights and KV dtype (default: the checkpoint's)")
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=0, ge=0, le=65535,
                      description="listening port (workers: 0 means the role's default, encoder 50051, prefill 50052, decode 50053)")
    advertise_host: str | None = Field(default=None, description="address others reach this worker at (default: the bind host, or this host's IP when bound to 0.0.0.0)")
    redis_url: str | None = Field(default=None, description="Redis for discovery and the shared encoder cache (unset: static lists, in-process cache)")
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="worker Prometheus metrics port (unset: none)")
    drain_timeout_s: float = Field(default=30.0, ge=0, description="graceful drain on SIGTERM, seconds")
    cpu_cores: str | None = Field(default=None, pattern=r"^\d+(,\d+)*$", description="the cores this process runs on, comma-separated, bound before it starts any thread (unset: any core; `epd serve --cpu-bind auto` sets it for its workers)")
    model_cores: str | None = Field(default=None, pattern=r"^\d+(,\d+)*$", description="the cores this worker's model thread and its OpenMP team run on, comma-separated, apart from the process's other threads (event loop, gRPC), which stay on `EPD_CPU_CORES` (unset: the process's cores; `epd serve --cpu-bind reserve` sets it for its decode workers)")
    heartbeat_s: float = Field(default=2.0, gt=0, description="Redis registration heartbeat, seconds (the entry lives three)")
    # encoder
    encoder_max_batch: int = Field(default=16, ge=1, description="encoder: images per vision-tower batch")
    encoder_batch_window_ms: float = Field(default=3.0, ge=0, description="encoder: how long a batch waits for more images")
    cache_max_mb: int = Field(default=256, ge=1, description="encoder cache: in-process tier bound, MiB")
    cache_ttl_s: int = Field(default=3600, ge=1, description="encoder cache: entry lifetime since last use, seconds")
    limit_images_per_request: int = Field(default=8, ge=0, description="images one request may carry, counted before any work: more is a 400 (`--limit-images-per-request` on serve, gateway and workers)")
    # prefill
    prefill_chunk_tokens: int = Field(default=256, ge=1, description="prompt tokens per prefill chunk (and per KV chunk)")
    prefill_max_batch: int = Field(default=8, ge=1, description="prefill: prompts packed into one forward")
    prefill_step_tokens: int = Field(default=0, ge=0, description="prefill: prompt tokens one forward carries, its prompts' next chunks taken in arrival order (0: one chunk, `EPD_PREFILL_CHUNK_TOKENS`, on the CPU, where a forward is compute-bound from a few dozen tokens; 2048 on CUDA)")
    # decode
    kv_memory_mb: int = Field(default=256, ge=1, description="decode: KV block pool budget, MiB")
    kv_block_size: int = Field(default=16, ge=1, description="decode: tokens per KV block")
    decode_max_batch: int = Field(default=64, ge=1, description="decode: sequences per step")
    lease_margin_s: float = Field(default=10.0, ge=0, description="decode: a reservation's lease is its deadline plus this")
    max_lease_s: float = Field(default=300.0, gt=0,
                               description="decode: the longest a reservation may hold blocks before it is used, whatever deadline a caller sends")
    prefix_cache: bool = Field(default=True, description="decode: keep retired prompts' full KV blocks cached (keyed by tokens, images, model, positions and cache_salt) and reuse them for a later prompt with the same prefix; `--no-prefix-cache` on serve and decode turns it off")
    sliding_window_kv: bool = Field(default=True, description="decode and prefill: a sliding-window layer (Gemma 3) keeps only its last window of KV, in a ring per sequence sharing the pool's blocks (and the prefix cache is off for such a model); `--no-sliding-window-kv` keeps every position of every layer")
    kv_transport: Literal["bulk", "grpc"] = Field(
        default="bulk", description="decode: `bulk` accepts KV on a raw TCP path beside gRPC, `grpc` only over PushKV")
    bulk_port: int = Field(default=0, ge=0, le=65535, description="decode: bulk KV port (0: any free port, advertised in Reserve)")
    bulk_idle_timeout_s: float = Field(default=30.0, gt=0, description="decode: a bulk KV stream silent this long is closed")
    log_format: Literal["text", "json"] = Field(default="text", description="log lines as `text` or one JSON object each (`--log-format json`; runtime/worker/log_format.py)")
    otlp_traces_endpoint: str | None = Field(default=None, description="OTLP/HTTP traces endpoint, e.g. `http://collector:4318/v1/traces` (`--otlp-traces-endpoint`; unset with no `OTEL_EXPORTER_OTLP_*` endpoint: tracing off)")
    faults: str = Field(default="", description="fault injection spec, e.g. `drop_chunk=0.2,seed=1` (tests only; runtime/worker/faults.py)")
    # security (runtime/worker/internal_auth.py, runtime/worker/peers.py): the token every worker RPC
    # and bulk stream must carry, and the only peers this worker dials (plus the Redis registry)
    internal_token: SecretStr | None = Field(default=None, description="shared secret every worker RPC and bulk KV stream must carry")
    allow_unauthenticated: bool = Field(default=False, description="let a worker listen beyond loopback without a token (trusted networks only)")
    encoder_addrs: CommaList = Field(default_factory=list, description="comma-separated host:port of the encoder workers (static discovery)")
    decode_addrs: CommaList = Field(default_factory=list, description="comma-separated host:port of the decode workers (static discovery)")

    @field_validator("internal_token", mode="before")
    @classmethod
    def _token(cls, v: object) -> SecretStr | None:
        return validate_token(v)

    @field_validator("device")
    @classmethod
    def _cuda_available(cls, v: str) -> str:
        if v == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda requested but torch sees no CUDA device (install a CUDA build of torch)")
        return v

    def resolved_prefill_step_tokens(self) -> int:
        """``prefill_step_tokens``, its 0 resolved for this device."""
        if self.prefill_step_tokens:
            return self.prefill_step_tokens
        return 2048 if self.device == "cuda" else self.prefill_chunk_tokens

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
    p.add_argument("--limit-images-per-request", type=int, help="images one request may carry")
    p.add_argument("--kv-transport", choices=["bulk", "grpc"], help="decode: accept KV over a raw TCP bulk path too")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                   help="decode: keep no KV after a request ends (EPD_PREFIX_CACHE=false)")
    p.add_argument("--no-sliding-window-kv", dest="sliding_window_kv", action="store_false", default=None,
                   help="decode, prefill: keep every position of a sliding-window layer (EPD_SLIDING_WINDOW_KV=false)")
    p.add_argument("--bulk-port", type=int)
    p.add_argument("--log-format", choices=["text", "json"], help="log lines as text or one JSON object each")
    p.add_argument("--otlp-traces-endpoint", metavar="URL", help="export OpenTelemetry traces over OTLP/HTTP to URL")
    p.add_argument("--faults", help="fault injection spec, e.g. 'drop_chunk=0.2,seed=1' (tests only)")
    p.add_argument("--encoder-addrs", help="comma-separated host:port of the encoders this worker may fetch from")
    p.add_argument("--decode-addrs", help="comma-separated host:port of the decode workers this worker may push KV to")
    p.add_argument("--allow-unauthenticated", action="store_true", default=None,
                   help="listen beyond loopback without EPD_INTERNAL_TOKEN (trusted networks only)")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    return WorkerSettings(**overrides)
