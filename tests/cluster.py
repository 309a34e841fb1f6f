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

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "models" / "demo-vlm"
# set per cluster (or per worker through ``env``), never inherited from the shell running the tests
_SCRUBBED = ("EPD_INTERNAL_TOKEN", "EPD_ALLOW_UNAUTHENTICATED", "EPD_ENCODER_ADDRS", "EPD_PREFILL_ADDRS",
             "EPD_DECODE_ADDRS", "EPD_API_KEY", "EPD_REDIS_URL")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Worker:
    role: str
    address: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Gateway:
    base: str                      # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def worker_env(token: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a test worker process: the runner's, minus its security settings."""
    base = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    if token is not None:
        base["EPD_INTERNAL_TOKEN"] = token
    return {**base, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


@dataclass
class Cluster:
    tmp: Path
    workers: list[Worker] = field(default_factory=list)
    token: str | None = None       # EPD_INTERNAL_TOKEN of every worker started here
    gateways: list[Gateway] = field(default_factory=list)
    model: Path = DEMO_MODEL       # the checkpoint every process started here serves

    def peer_flags(self, role: str) -> list[str]:
        """Discovery for ``role``: the encoder / decode workers already started."""
        flags = []
        if role in ("prefill", "decode") and self.by_role("encoder"):
            flags += ["--encoder-addrs", ",".join(w.address for w in self.by_role("encoder"))]
        if role == "prefill" and self.by_role("decode"):
            flags += ["--decode-addrs", ",".join(w.address for w in self.by_role("decode"))]
        return flags

    def start(self, role: str, *extra: str, env: dict[str, str] | None = None) -> Worker:
        port = free_port()
        log_path = self.tmp / f"{role}-{port}.log"
        cmd = [sys.executable, "-m", "launcher.cli", role, "--model", str(self.model), "--host", "127.0.0.1",
               "--port", str(port), *self.peer_flags(role), *extra]
        full_env = worker_env(self.token, env)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=full_env)
        w = Worker(role, f"127.0.0.1:{port}", proc, log_path)
        self.workers.append(w)
        return w

    def start_gateway(self, *extra: str, env: dict[str, str] | None = None) -> Gateway:
        """An ``epd gateway`` process on a free port with every worker started so far; ``extra``
        are its flags (``--placement``, ``--prefill-chunk-tokens`` ...). Wait with ``wait_gateways``."""
        port = free_port()
        log_path = self.tmp / f"gateway-{port}.log"
        addrs = [a for role in ("encoder", "prefill", "decode") if self.by_role(role)
                 for a in (f"--{role}-addrs", ",".join(w.address for w in self.by_role(role)))]
        cmd = [sys.executable, "-m", "launcher.cli", "gateway", "--model", str(self.model), "--host", "127.0.0.1",
               "--port", str(port), *addrs, *extra]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                                env=worker_env(self.token, env))
        gateway = Gateway(f"http://127.0.0.1:{port}", proc, log_path)
        self.gateways.append(gateway)
        return gateway

    def wait_gateways(self, timeout_s: float = 60.0) -> None:
        """Until every gateway's ``/health`` is 200 (its workers are polled healthy)."""
        end = time.monotonic() + timeout_s
        for g in self.gateways:
            while True:
                if g.proc.poll() is not None:
                    raise RuntimeError(f"gateway exited early:\n{g.log()}")
                try:
                    if httpx.get(f"{g.base}/health", timeout=1, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > end:
                    raise TimeoutError(f"gateway at {g.base} not healthy:\n{g.log()}")
                time.sleep(0.2)

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        end = time.monotonic() + timeout_s
        for w in self.workers:
            while True:
                if w.proc.poll() is not None:
                    raise RuntimeError(f"{w.role} exited early:\n{w.log()}")
                if _serving(w.address):
                    break
                if time.monotonic() > end:
                    raise TimeoutError(f"{w.role} at {w.address} not healthy:\n{w.log()}")
                time.sleep(0.2)

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def stop(self) -> None:
        for g in self.gateways:    # first: a gateway must not outlive the workers it is draining into
            if g.proc.poll() is None:
                g.proc.terminate()
        for g in self.gateways:
            try:
                g.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                g.proc.kill()
                g.proc.wait()
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()


def _serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
