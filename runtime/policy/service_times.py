"""Service-time parameters of the E/P/D pipeline, and their JSON file format.

The defaults are the design chapter's worked example: ``prefill_ms = 20 +
0.035 x tokens``, a 45 ms decode step with 32 slots, 320 KiB of KV per token and
a KV link of 12 ms setup plus 22 GiB/s. The encoder defaults are assumptions (the
chapter gives none: 10 ms a call plus 40 ms for an image of 256 placeholder tokens);
measure them with ``epd profile``. An encode is priced by the images' placeholder tokens,
not per image: the tower's work grows with an image's patches.

File format (``--service-times FILE``; ``epd profile`` writes it)::

    {
      "format": "epd.service-times",
      "version": 2,
      "source": "free text: what produced this file",
      "params": {"prefill_base_ms": 20.0, ...},        # any subset of ServiceTimes fields
      "tables": {                                        # optional measured points [x, ms]
        "prefill":     [[tokens, ms], ...],
        "decode_step": [[batch_size, ms], ...],
        "transfer":    [[bytes, ms], ...],
        "encode":      [[image_tokens_encoded, ms], ...]   # one tower call each
      }
    }

``params`` missing from the file keep their defaults; unknown keys are errors.
``tables`` are raw measurements: ``runtime.policy.cost_model.CostModel.from_file`` fits
the linear coefficients to them (falling back to ``params`` where a table is too
small or degenerate). This module only parses and writes; it does no fitting.
Version 1 files priced an encode per image (``encode_ms_per_image``, tables of images):
they are refused, with a hint to profile again.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT = "epd.service-times"
VERSION = 2
TABLE_NAMES = ("prefill", "decode_step", "transfer", "encode")

KIB = 1024
GIB = 1024**3


class ServiceTimesError(ValueError):
    """A service-time file or parameter set is malformed."""


@dataclass(slots=True, frozen=True)
class ServiceTimes:
    """Service-time coefficients (linear, but for prefill's quadratic term); every duration in ms, every size in bytes.

    prefill_ms(tokens)     = prefill_base_ms + prefill_ms_per_token x tokens
                             + prefill_ms_per_token2 x tokens^2 (attention; the chapter: 0)
                             (+ prefill_chunk_overhead_ms per chunk when chunked)
    decode_step_ms(batch)  = decode_step_base_ms + decode_step_ms_per_seq x batch
    kv_bytes(tokens)       = kv_bytes_per_token x tokens
    transfer_ms(bytes)     = link_setup_ms + 1000 x bytes / link_bytes_per_s
    encode_ms(new, cached) = encode_base_ms + encode_ms_per_token x new
                             + encode_cache_hit_ms x cached   (0 when no images;
                             new: the placeholder tokens of the images to encode,
                             cached: the images the encoder cache holds)

    The gateway, per-request CPU and the host (0, the defaults, leave them out of the model):
    gateway_request_ms     = the gateway's CPU per request before its pipeline starts
                             (body, images, tokenizing, admission): a one-server stage
                             (one event loop) every request passes before encode
    gateway_finish_ms      = the rest of the gateway's CPU per request (RPCs, streaming,
                             release), charged to that stage when the request finishes
    encode_request_ms      = the encoder's CPU per request that encodes, beyond its timed
                             encodes (the encode RPC, cache writes)
    prefill_request_ms     = the prefill worker's CPU per request beyond its timed passes
                             (embedding fetch, RPCs, KV sends), before its first chunk
    decode_request_ms      = the decode worker's CPU per request beyond its timed steps and
                             passes (reserve, KV receive, its stream; a colocated request's
                             embedding fetch): on its RPC threads, before the first token (or
                             the local prefill), taking turns with the steps on a shared host
    decode_step_extra_ms   = the decode worker's CPU per step beyond the timed forward
                             (scheduling, sampling, sending the batch's tokens): on a shared
                             host the simulator runs it beside every step (CPU the cores must
                             do; the timed step already holds its effect on the step's length)
    hop_ms                 = a request's latency that is no stage's work: HTTP, RPC and thread
                             hand-offs between the processes (``epd profile``: idle TTFT less the
                             simulated idle TTFT). Taken as the request arrives; on a shared
                             host it waits for the cores like work but adds none
    host_cores             = N > 0: every stage's work shares N cores (``sim/host_cpu.py``,
                             processor sharing); 0: each worker has its own processor
    host_background_cores  = cores' worth of other work on that host (shares them too)
    """

    prefill_base_ms: float = 20.0
    prefill_ms_per_token: float = 0.035
    prefill_ms_per_token2: float = 0.0
    prefill_chunk_overhead_ms: float = 0.0
    decode_step_base_ms: float = 45.0
    decode_step_ms_per_seq: float = 0.0
    decode_slots: int = 32
    kv_bytes_per_token: int = 320 * KIB
    link_setup_ms: float = 12.0
    link_bytes_per_s: float = 22.0 * GIB
    encode_base_ms: float = 10.0
    encode_ms_per_token: float = 40.0 / 256
    encode_cache_hit_ms: float = 1.0
    gateway_request_ms: float = 0.0
    gateway_finish_ms: float = 0.0
    encode_request_ms: float = 0.0
    prefill_request_ms: float = 0.0
    decode_request_ms: float = 0.0
    decode_step_extra_ms: float = 0.0
    hop_ms: float = 0.0
    host_cores: int = 0
    host_background_cores: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ServiceTimesError(f"{f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ServiceTimesError(f"{f.name} must be finite and >= 0, got {value!r}")
        for name, least in (("decode_slots", 1), ("kv_bytes_per_token", 1), ("host_cores", 0)):
            value = getattr(self, name)
            if value < least or int(value) != value:
                raise ServiceTimesError(f"{name} must be an integer >= {least}, got {value!r}")
            object.__setattr__(self, name, int(value))  # 32.0 from JSON -> 32
        if self.link_bytes_per_s <= 0:
            raise ServiceTimesError("link_bytes_per_s must be > 0")
        if self.decode_step_base_ms + self.decode_step_ms_per_seq <= 0:
            raise ServiceTimesError("a decode step must take some time (base + per-seq > 0)")

    def replace(self, **changes: Any) -> ServiceTimes:
        """A copy with some fields changed (validated)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ServiceTimesError(f"unknown service-time parameter(s): {sorted(unknown)}")
        return ServiceTimes(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServiceTimes:
        if not isinstance(data, dict):
            raise ServiceTimesError(f"params must be an object, got {type(data).__name__}")
        return cls().replace(**data)


Point = tuple[float, float]


@dataclass(slots=True, frozen=True)
class MeasuredTables:
    """Raw (x, ms) measurements per stage; x is tokens, batch size, bytes or image tokens."""

    prefill: tuple[Point, ...] = ()
    decode_step: tuple[Point, ...] = ()
    transfer: tuple[Point, ...] = ()
    encode: tuple[Point, ...] = ()

    def __post_init__(self) -> None:
        for name in TABLE_NAMES:
            for point in getattr(self, name):
                if len(point) != 2 or not all(math.isfinite(v) and v >= 0 for v in point):
                    raise ServiceTimesError(f"tables.{name}: each point must be [x >= 0, ms >= 0], got {point!r}")

    def to_dict(self) -> dict[str, list[list[float]]]:
        return {name: [list(p) for p in getattr(self, name)] for name in TABLE_NAMES if getattr(self, name)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasuredTables:
        if not isinstance(data, dict):
            raise ServiceTimesError("tables must be an object")
        unknown = set(data) - set(TABLE_NAMES)
        if unknown:
            raise ServiceTimesError(f"unknown table(s) {sorted(unknown)}; expected {list(TABLE_NAMES)}")
        parsed: dict[str, tuple[Point, ...]] = {}
        for name, rows in data.items():
            if not isinstance(rows, list):
                raise ServiceTimesError(f"tables.{name} must be a list of [x, ms] pairs")
            try:
                parsed[name] = tuple((float(x), float(ms)) for x, ms in rows)
            except (TypeError, ValueError):
                raise ServiceTimesError(f"tables.{name} must be a list of [x, ms] pairs") from None
        return cls(**parsed)


@dataclass(slots=True, frozen=True)
class ServiceTimesFile:
    """Everything one service-time file holds."""

    params: ServiceTimes = field(default_factory=ServiceTimes)
    tables: MeasuredTables = field(default_factory=MeasuredTables)
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION, "source": self.source, "params": self.params.to_dict()}
        tables = self.tables.to_dict()
        if tables:
            out["tables"] = tables
        return out


def parse(data: dict[str, Any]) -> ServiceTimesFile:
    """Validate a decoded JSON document."""
    if not isinstance(data, dict):
        raise ServiceTimesError("a service-time file must hold a JSON object")
    if data.get("format") != FORMAT:
        raise ServiceTimesError(f"format must be {FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") == 1:
        raise ServiceTimesError("version 1 priced encodes per image; this build prices them per image token "
                                f"(version {VERSION}): run `epd profile` again")
    if data.get("version") != VERSION:
        raise ServiceTimesError(f"unsupported version {data.get('version')!r}; this build reads version {VERSION}")
    unknown = set(data) - {"format", "version", "source", "params", "tables"}
    if unknown:
        raise ServiceTimesError(f"unknown top-level key(s) {sorted(unknown)}")
    return ServiceTimesFile(
        params=ServiceTimes.from_dict(data.get("params", {})),
        tables=MeasuredTables.from_dict(data.get("tables", {})),
        source=str(data.get("source", "")),
    )


def load(path: str | Path) -> ServiceTimesFile:
    """Read and validate a service-time file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ServiceTimesError(f"cannot read service-time file {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ServiceTimesError(f"{path}: not valid JSON: {exc}") from None
    try:
        return parse(data)
    except ServiceTimesError as exc:
        raise ServiceTimesError(f"{path}: {exc}") from None


def save(path: str | Path, content: ServiceTimesFile) -> None:
    """Write ``content`` as a service-time file (pretty JSON, trailing newline)."""
    Path(path).write_text(json.dumps(content.to_dict(), indent=2) + "\n", encoding="utf-8")
