"""A bounded log of stage timings a worker reports to the gateway for cost-model calibration.

Each sample gets a sequence number; the gateway asks for samples newer than the
last one it saw, so a sample is delivered at most once per poller in order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TimingSample:
    seq: int
    kind: str    # "encode" | "prefill" | "decode_step" | "transfer"
    size: float
    ms: float


class TimingLog:
    def __init__(self, capacity: int = 512):
        self._samples: deque[TimingSample] = deque(maxlen=capacity)
        self._seq = 0

    def record(self, kind: str, size: float, ms: float) -> None:
        self._seq += 1
        self._samples.append(TimingSample(self._seq, kind, float(size), float(ms)))

    @property
    def last_seq(self) -> int:
        return self._seq

    def since(self, seq: int, limit: int = 256) -> list[TimingSample]:
        return [s for s in self._samples if s.seq > seq][-limit:]
