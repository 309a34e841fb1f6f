"""Built-in fault injection, off by default, switched on by tests through ``EPD_FAULTS``.

Spec: comma-separated ``name=value`` pairs, e.g. ``drop_chunk=0.3,seed=7``.

==================  ======  ==================================================
name                side    effect
==================  ======  ==================================================
drop_chunk=p        decode  a received KV chunk is discarded (never lands)
corrupt_chunk=p     decode  a received chunk's payload gets a flipped byte
dup_chunk=p         prefill a KV chunk is sent twice
delay_chunk_ms=x    prefill each chunk is delayed by x ms before sending
fail_transfer=p     prefill the KV stream is broken off before the last chunk
crash_prefill=p     prefill the prefill process exits mid-prefill (os._exit)
stall_encoder_ms=x  encoder each Encode call (a lookup by key too) waits x ms first
delay_step_ms=x     decode  each scheduler step (decode tokens, colocated prefill chunks)
                            waits x ms before its forward (a slow decode worker)
seed=n              all     seeds the coin flips (reproducible tests)
==================  ======  ==================================================
"""

from __future__ import annotations

import random

from proto.epd.v1 import epd_pb2 as pb

_KNOWN = {"drop_chunk", "corrupt_chunk", "dup_chunk", "delay_chunk_ms", "fail_transfer", "crash_prefill",
          "stall_encoder_ms", "delay_step_ms", "seed"}


class FaultSpecError(ValueError):
    pass


class FaultInjector:
    def __init__(self, spec: str):
        self.values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in (spec or "").split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in _KNOWN:
                raise FaultSpecError(f"bad fault spec {part!r}; known: {sorted(_KNOWN)}")
            try:
                self.values[name] = float(value)
            except ValueError:
                raise FaultSpecError(f"fault {name} needs a number, got {value!r}") from None
        self._rng = random.Random(int(self.values.get("seed", 0)))

    def coin(self, name: str) -> bool:
        p = self.values.get(name, 0.0)
        return p > 0 and self._rng.random() < p

    def amount(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def mangle_chunk(self, chunk: pb.KVChunk) -> pb.KVChunk | None:
        """Decode side: maybe drop or corrupt a received chunk."""
        if self.coin("drop_chunk"):
            return None
        if self.coin("corrupt_chunk") and chunk.payload:
            data = bytearray(chunk.payload)
            data[len(data) // 2] ^= 0xFF
            chunk.payload = bytes(data)
        return chunk

    def bulk_chunk_fate(self) -> str:
        """Decode side, bulk path, decided when a chunk's header arrives: ``"drop"`` (its bytes are
        read and discarded), ``"corrupt"`` (a byte is flipped as it arrives, before the checksum
        sees it, like damage on the wire) or ``""``."""
        if self.coin("drop_chunk"):
            return "drop"
        return "corrupt" if self.coin("corrupt_chunk") else ""
