"""What every role's servicer shares with the common runner: where it listens, whether it takes new work.

One ``ServingState`` per servicer, owned by it. The runner (``runtime/worker/runner.py``)
sets ``address`` once the gRPC server is bound and, on SIGTERM, calls ``drain``: from
then on ``serving`` is False (the servicer refuses new work and ``Stats`` says so) and
the drain waits until the servicer's ``busy()`` is falsy or the timeout passes. Every
``Stats`` reply starts from ``stats``: the same identity fields and timing samples for
every role, where it computes (``runtime/worker/host_cpu.py``: host, cores and how busy they
are), plus the role's own gauges.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from proto.epd.v1 import epd_pb2 as pb
from runtime.worker.host_cpu import HostCpu
from runtime.worker.timing_log import TimingLog


class ServingState:
    def __init__(self, role: str, timings: TimingLog, model_fingerprint: str, attention_kernel: str = "",
                 linear_kernel: str = "", device_type: str = "cpu"):
        self.role = role
        self.timings = timings                 # the samples every Stats reply carries (owned by the role's loop)
        self.model_fingerprint = model_fingerprint
        self.attention_kernel = attention_kernel  # prefill / decode: the kernel the adapter selected ("" elsewhere)
        self.linear_kernel = linear_kernel        # the kernel the adapter's linear layers run
        self.address = ""                      # set by the runner once the gRPC server is bound
        self.serving = True                    # False from the start of a drain
        self.host = HostCpu(device_type)       # the cores its model computes on (none on a GPU)

    async def drain(self, busy: Callable[[], object], timeout_s: float) -> None:
        """Refuse new work from now; return once ``busy()`` is falsy (accepted work finished) or after ``timeout_s``."""
        self.serving = False
        end = time.monotonic() + timeout_s
        while busy() and time.monotonic() < end:
            await asyncio.sleep(0.05)

    def stats(self, request: pb.StatsRequest, **gauges) -> pb.WorkerStats:
        """``WorkerStats`` with this worker's identity, serving flag and the samples after ``request.since_sample``."""
        samples = self.timings.since(request.since_sample)
        return pb.WorkerStats(
            role=self.role, address=self.address, serving=self.serving, model_fingerprint=self.model_fingerprint,
            attention_kernel=self.attention_kernel, linear_kernel=self.linear_kernel, samples=[pb.TimingSample(kind=s.kind, size=s.size, ms=s.ms) for s in samples],
            last_sample=self.timings.last_seq, host_id=self.host.host_id, cpus=self.host.cpus,
            cpus_busy=self.host.busy(), **gauges)
