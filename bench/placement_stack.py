"""``placement_comparison``'s stacks: one placement's model workers pinned to their cores, the
encoder and the gateway unpinned, each a ``launcher.processes`` process.

Start order: every worker (each told its peers), wait for each to serve, then the gateway in
front of them, wait for its ``/health``. Stop order: the gateway first, then the workers.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from bench.harness.servers import EPD, Process, bench_process, free_port, wait_grpc, wait_http, worker_cmd
from launcher.processes import stop_group

PLACEMENTS = ("colocated", "disaggregated", "conditional")
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
START_TIMEOUT_S = 300.0


def topology(placement: str, cores: Sequence[int]) -> list[tuple[str, int]]:
    """(role, core) of each pinned model worker for a placement."""
    a, b = cores
    if placement == "colocated":
        return [("decode", a), ("decode", b)]
    if placement in ("disaggregated", "conditional"):
        return [("prefill", a), ("decode", b)]
    raise ValueError(f"unknown placement {placement!r}")


@dataclass
class Stack:
    """The processes of one placement configuration."""

    placement: str
    workers: list[Process]
    gateway: Process | None = None
    base: str = ""

    def stop(self) -> None:
        """The gateway first (no new work), then the workers."""
        stop_group([self.gateway] if self.gateway else [])
        stop_group(self.workers)


def start_stack(args: argparse.Namespace, placement: str) -> Stack:
    """Start and wait for one placement's stack; on any failure stop what was started (``StartError``)."""
    logs = args.logs / placement
    addrs: dict[str, list[str]] = {"encoder": [], "prefill": [], "decode": []}
    all_cores = ",".join(str(c) for c in args.core_list)
    workers = [("encoder", None), *topology(placement, args.core_list)]
    kv = ["--kv-memory-mb", str(args.kv_memory_mb)]
    ports = [free_port() for _ in workers]
    for (role, _), port in zip(workers, ports):
        addrs[role].append(f"127.0.0.1:{port}")
    # workers dial only the peers they are told about (runtime/peers.py)
    peers = ["--encoder-addrs", ",".join(addrs["encoder"])]
    if addrs["decode"]:
        peers += ["--decode-addrs", ",".join(addrs["decode"])]
    stack = Stack(placement, [])
    try:
        for i, ((role, core), port) in enumerate(zip(workers, ports)):
            extra = [*(kv if role == "decode" else []), *(peers if role != "encoder" else [])]
            cores = all_cores if core is None else str(core)
            stack.workers.append(bench_process(f"{role}@{cores}", worker_cmd(role, args.model, port, cores, extra),
                                               logs / f"{i}-{role}-{port}.log", THREADS).start())
        for proc, port in zip(stack.workers, ports):
            wait_grpc(f"127.0.0.1:{port}", [proc], START_TIMEOUT_S)
        gw_port = free_port()
        gw = [*EPD, "gateway", "--model", str(args.model.resolve()),
              "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(gw_port),
              "--placement", placement, "--encoder-addrs", ",".join(addrs["encoder"]),
              "--decode-addrs", ",".join(addrs["decode"]),
              "--ttft-slo-ms", str(args.gateway_ttft_slo_ms), "--itl-slo-ms", str(args.itl_slo_ms)]
        if addrs["prefill"]:
            gw += ["--prefill-addrs", ",".join(addrs["prefill"])]
        stack.gateway = bench_process("gateway", ["taskset", "-c", all_cores, *gw], logs / f"gateway-{gw_port}.log",
                                      THREADS).start()
        stack.base = f"http://127.0.0.1:{gw_port}"
        wait_http(f"{stack.base}/health", [*stack.workers, stack.gateway])
    except BaseException:
        stack.stop()
        raise
    return stack
