"""Start real worker processes on loopback for tests: each role is ``python -m launcher.cli <role>``.

Every process gets a free port, runs until ``stop()``, and is terminated with
SIGTERM (then SIGKILL) so no test leaves a process behind.

Peer discovery: a worker dials only the peers discovery lists (runtime/peers.py), so
``start`` passes every prefill/decode worker the encoders started before it
(``--encoder-addrs``) and every prefill worker the decode workers started before it
(``--decode-addrs``). Start encoders first, then decode, then prefill (or give the
workers ``--redis-url``). ``token`` is every worker's ``EPD_INTERNAL_TOKEN``; the
security variables of the test runner's own environment never leak into a worker.

``start_gateway`` runs a real ``epd gateway`` process (HTTP) in front of the workers
started so far (static address lists); ``stop`` ends gateways before workers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import openai

from launcher.processes import Process, ProcessSpec, child_env, free_port, grpc_serving, stop_group, wait_serving

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "models" / "demo-vlm"
# set per cluster (or per worker through ``env``), never inherited from the shell running the tests
_SCRUBBED = ("EPD_INTERNAL_TOKEN", "EPD_ALLOW_UNAUTHENTICATED", "EPD_ENCODER_ADDRS", "EPD_PREFILL_ADDRS",
             "EPD_DECODE_ADDRS", "EPD_API_KEY", "EPD_REDIS_URL")

__all__ = ["DEMO_MODEL", "PLACEMENTS", "ROOT", "Cluster", "Gateway", "Worker", "free_port", "openai_clients", "placement_pair",
           "worker_env"]
PLACEMENTS = ("colocated", "disaggregated")


@dataclass
class Worker:
    role: str
    address: str
    process: Process

    @property
    def proc(self):
        """The OS process (``subprocess.Popen``) of its latest start."""
        return self.process.popen

    @property
    def log_path(self) -> Path:
        return self.process.spec.log_path

    def log(self) -> str:
        return self.process.log()


@dataclass
class Gateway:
    base: str                      # http://127.0.0.1:PORT
    process: Process

    @property
    def proc(self):
        return self.process.popen

    def log(self) -> str:
        return self.process.log()


def worker_env(token: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a test worker process: the runner's, minus its security settings."""
    overlay = {"OMP_NUM_THREADS": "1", **({"EPD_INTERNAL_TOKEN": token} if token is not None else {}), **(extra or {})}
    return child_env(overlay, drop=_SCRUBBED)


def _spec(name: str, cmd: list[str], env: dict[str, str], log_path: Path, stop_timeout_s: float) -> ProcessSpec:
    # bind_to_parent off: a test may start a worker from an executor thread that ends before it
    return ProcessSpec(name, cmd, env, log_path, ROOT, stop_timeout_s=stop_timeout_s, bind_to_parent=False)


@dataclass
class Cluster:
    tmp: Path
    workers: list[Worker] = field(default_factory=list)
    token: str | None = None       # EPD_INTERNAL_TOKEN of every worker started here
    gateways: list[Gateway] = field(default_factory=list)
    _restarts: int = 0
    model: Path = DEMO_MODEL       # the checkpoint every process started here serves

    def peer_flags(self, role: str) -> list[str]:
        """Discovery for ``role``: the encoder / decode workers already started."""
        flags = []
        if role in ("prefill", "decode") and self.by_role("encoder"):
            flags += ["--encoder-addrs", ",".join(w.address for w in self.by_role("encoder"))]
        if role == "prefill" and self.by_role("decode"):
            flags += ["--decode-addrs", ",".join(w.address for w in self.by_role("decode"))]
        return flags

    def start(self, role: str, *extra: str, env: dict[str, str] | None = None, port: int | None = None) -> Worker:
        """A worker process on a free port, or on ``port`` (a replacement on a dead worker's address)."""
        if port is None:
            port = free_port()
            log_path = self.tmp / f"{role}-{port}.log"
        else:
            self._restarts += 1
            log_path = self.tmp / f"{role}-{port}-restart{self._restarts}.log"
        cmd = [sys.executable, "-m", "launcher.cli", role, "--model", str(self.model), "--host", "127.0.0.1",
               "--port", str(port), *self.peer_flags(role), *extra]
        process = Process(_spec(role, cmd, worker_env(self.token, env), log_path, 15.0)).start()
        w = Worker(role, f"127.0.0.1:{port}", process)
        self.workers.append(w)
        return w

    def start_gateway(self, *extra: str, env: dict[str, str] | None = None) -> Gateway:
        """An ``epd gateway`` process on a free port with every worker started so far; ``extra``
        are its flags (``--placement``, ``--prefill-chunk-tokens`` ...). Wait with ``wait_gateways``."""
        port = free_port()
        addrs = [a for role in ("encoder", "prefill", "decode") if self.by_role(role)
                 for a in (f"--{role}-addrs", ",".join(w.address for w in self.by_role(role)))]
        cmd = [sys.executable, "-m", "launcher.cli", "gateway", "--model", str(self.model), "--host", "127.0.0.1",
               "--port", str(port), *addrs, *extra]
        process = Process(_spec("gateway", cmd, worker_env(self.token, env), self.tmp / f"gateway-{port}.log", 20.0))
        gateway = Gateway(f"http://127.0.0.1:{port}", process.start())
        self.gateways.append(gateway)
        return gateway

    def wait_gateways(self, timeout_s: float = 60.0) -> None:
        """Until every gateway's ``/health`` is 200 (its workers are polled healthy)."""
        end = time.monotonic() + timeout_s
        for g in self.gateways:
            _wait(partial(_health_ok, g.base), g.process, end, f"gateway at {g.base}")

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        end = time.monotonic() + timeout_s
        for w in self.workers:
            _wait(partial(grpc_serving, w.address), w.process, end, f"{w.role} at {w.address}")

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def stop(self) -> None:
        """Gateways first (a gateway must not outlive the workers it is draining into), then workers."""
        stop_group([g.process for g in self.gateways])
        stop_group([w.process for w in self.workers])


@contextmanager
def encoder_and_decode(tmp: Path, decode_env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """One encoder and one decode worker (the demo model), healthy; stopped on exit."""
    cluster = Cluster(tmp)
    try:
        cluster.start("encoder")
        cluster.start("decode", env=decode_env)
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.stop()


def _health_ok(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(probe, process: Process, end: float, what: str) -> None:
    """``wait_serving`` with the whole log in the error (a test failure should show everything)."""
    wait_serving(probe, [process], max(0.0, end - time.monotonic()), what, poll_s=0.2, log_lines=10**6)


@contextmanager
def placement_pair(tmp: Path, *gateway_flags: str, decode_env: dict[str, str] | None = None
                   ) -> Iterator[tuple[Cluster, dict[str, Gateway]]]:
    """One encoder, decode and prefill process behind two gateways, one per placement in
    ``PLACEMENTS`` (each with ``gateway_flags``): every case can run through both placements on
    the same workers. Everything is stopped on exit."""
    c = Cluster(tmp)
    try:
        c.start("encoder")
        c.start("decode", env=decode_env)
        c.start("prefill")
        c.wait_healthy()
        gateways = {p: c.start_gateway("--placement", p, *gateway_flags) for p in PLACEMENTS}
        c.wait_gateways()
        yield c, gateways
    finally:
        c.stop()


def openai_clients(gateways: dict[str, Gateway]) -> dict[str, openai.OpenAI]:
    """One official ``openai`` client per gateway (no retries: a test sees every failure)."""
    return {p: openai.OpenAI(base_url=f"{g.base}/v1", api_key="unused", max_retries=0, timeout=60)
            for p, g in gateways.items()}
