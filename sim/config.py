"""Simulator configuration: placement, pool sizes, SLOs, failure injection.

Hardware budget: every placement gets ``prefill_workers + decode_workers``
language workers. ``colocated`` runs that many workers that each prefill and
decode; ``disaggregated`` and ``conditional`` run the two pools (in
``conditional`` the decode workers may also prefill short prompts locally).
The encoder pool and the KV link(s) are the same for every placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from runtime.policy.placement_policy import MODES
from runtime.policy.service_times import ServiceTimes

TRANSFERS = ("serial", "chunked")


class ConfigError(ValueError):
    """A simulator setting is out of range."""


@dataclass(slots=True, frozen=True)
class SimConfig:
    placement: str = "disaggregated"
    prefill_workers: int = 1
    decode_workers: int = 2
    encoder_workers: int = 1
    kv_links: int = 1  # independent link pipes
    link_concurrency: int = 1  # transfers moving at once per pipe (FIFO queue behind); 0 = all share it
    transfer: str = "serial"  # serial: send after prefill; chunked: send each chunk when ready
    chunk_tokens: int = 2000  # transfer chunk size
    chunked_prefill: bool = False  # local (colocated) prefill interleaves chunks with decode steps
    local_chunk_tokens: int = 512
    ttft_slo_ms: float = 600.0  # also each request's TTFT deadline
    itl_slo_ms: float = 150.0  # a request meets it when no inter-token gap exceeds it
    failure_prob: float = 0.0  # per transfer attempt
    max_transfer_attempts: int = 3
    reservation_held_on_failure: bool = True
    admission: bool = False  # refuse requests the policy predicts will miss the TTFT deadline
    decode_kv_tokens: int | None = None  # KV capacity per decode worker in tokens (None: slots only)
    samples: int = 200  # queue-depth samples over the run
    seed: int = 0
    service: ServiceTimes = field(default_factory=ServiceTimes)

    def __post_init__(self) -> None:
        if self.placement not in MODES:
            raise ConfigError(f"placement must be one of {MODES}, got {self.placement!r}")
        if self.transfer not in TRANSFERS:
            raise ConfigError(f"transfer must be one of {TRANSFERS}, got {self.transfer!r}")
        for name in ("prefill_workers", "encoder_workers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("decode_workers", "kv_links", "chunk_tokens", "local_chunk_tokens", "max_transfer_attempts", "samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.link_concurrency < 0:
            raise ConfigError(f"link_concurrency must be >= 0 (0: unlimited), got {self.link_concurrency}")
        if self.placement != "colocated" and self.prefill_workers < 1:
            raise ConfigError(f"placement {self.placement} needs prefill_workers >= 1")
        if self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            raise ConfigError("SLOs must be > 0 ms")
        if not 0.0 <= self.failure_prob < 1.0:
            raise ConfigError(f"failure_prob must be in [0, 1), got {self.failure_prob}")
        if self.decode_kv_tokens is not None and self.decode_kv_tokens < 1:
            raise ConfigError(f"decode_kv_tokens must be >= 1, got {self.decode_kv_tokens}")

    @property
    def language_workers(self) -> int:
        return self.prefill_workers + self.decode_workers

    def with_(self, **changes: object) -> SimConfig:
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ConfigError(f"unknown setting(s) {sorted(unknown)}")
        return replace(self, **changes)
