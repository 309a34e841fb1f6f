"""``epd serve``: the whole stack on one machine, as separate processes talking gRPC.

Starts encoder, prefill and decode workers (each ``epd <role>`` in its own
process, exactly as in a deployment), waits until each reports SERVING on the
gRPC health service, then starts the gateway pointed at them. Ctrl-C or SIGTERM
stops the gateway first, then drains the workers; children are also bound to
this process's life (Linux parent-death signal), so none is orphaned.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PR_SET_PDEATHSIG = 1


def _bind_to_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the signal handlers below still stop the children


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    role: str
    address: str
    proc: subprocess.Popen


def _serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="epd serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("EPD_MODEL", "models/demo-vlm"), help="model folder or hub id")
    p.add_argument("--served-model-name", default=os.environ.get("EPD_SERVED_MODEL_NAME", "demo-vlm"))
    p.add_argument("--device", choices=["cpu", "cuda"], default=os.environ.get("EPD_DEVICE", "cpu"))
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--prefills", type=int, default=1)
    p.add_argument("--decodes", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("EPD_PORT", "8000")))
    p.add_argument("--redis-url", default=os.environ.get("EPD_REDIS_URL"), help="shared encoder cache + discovery; embedded cache when absent")
    p.add_argument("--placement", choices=["conditional", "colocated", "disaggregated"],
                   default=os.environ.get("EPD_PLACEMENT", "conditional"))
    args = p.parse_args(argv)
    for name in ("encoders", "decodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.prefills < 0:
        p.error("--prefills must be >= 0")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from runtime.supported_models import UnsupportedModel, check_checkpoint
    try:
        check_checkpoint(args.model)   # before any child: one line and a non-zero exit, not N failing workers
    except (UnsupportedModel, OSError) as exc:
        print("epd serve: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2
    children: list[Child] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    model_procs = args.encoders + args.prefills + args.decodes
    threads = str(max(1, (os.cpu_count() or 1) // model_procs)) if args.device == "cpu" else "1"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", threads)
    if args.redis_url:
        env["EPD_REDIS_URL"] = args.redis_url
    else:
        env.pop("EPD_REDIS_URL", None)
    exe = [sys.executable, "-m", "launcher.cli"]

    # every worker's port first: each child gets the peer lists it may dial (runtime/peers.py)
    plan = [(role, _free_port(args.host)) for role, count in (("encoder", args.encoders), ("prefill", args.prefills),
                                                              ("decode", args.decodes)) for _ in range(count)]
    for role in ("encoder", "prefill", "decode"):
        env[f"EPD_{role.upper()}_ADDRS"] = ",".join(f"{args.host}:{port}" for r, port in plan if r == role)

    def spawn(role: str, port: int, extra: list[str]) -> Child:
        cmd = [*exe, role, "--model", args.model, "--host", args.host, "--port", str(port), *extra]
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_bind_to_parent)
        child = Child(role, f"{args.host}:{port}", proc)
        children.append(child)
        return child

    try:
        for role, port in plan:
            spawn(role, port, ["--device", args.device])
        deadline = time.monotonic() + 300
        for child in children:
            while not _serving(child.address):
                if stopping or child.proc.poll() is not None or time.monotonic() > deadline:
                    print(f"epd serve: {child.role} worker at {child.address} did not start", file=sys.stderr)
                    return 1
                time.sleep(0.2)
        addrs = {role: ",".join(c.address for c in children if c.role == role) for role in ("encoder", "prefill", "decode")}
        gw_cmd = [*exe, "gateway", "--model", args.model, "--served-model-name", args.served_model_name,
                  "--host", args.host, "--port", str(args.port), "--placement", args.placement,
                  "--encoder-addrs", addrs["encoder"], "--decode-addrs", addrs["decode"]]
        if addrs["prefill"]:
            gw_cmd += ["--prefill-addrs", addrs["prefill"]]
        gateway = Child("gateway", f"{args.host}:{args.port}", subprocess.Popen(gw_cmd, env=env, preexec_fn=_bind_to_parent))
        children.append(gateway)
        _print_table(args, children)
        while not stopping:
            for child in children:
                if child.proc.poll() is not None:
                    print(f"epd serve: {child.role} at {child.address} exited with {child.proc.returncode}; stopping",
                          file=sys.stderr)
                    return 1
            time.sleep(0.3)
        return 0
    finally:
        _shutdown(children)


def _print_table(args: argparse.Namespace, children: list[Child]) -> None:
    print(f"\nepd serving {args.served_model_name} ({args.model}) on {args.device}")
    print(f"OpenAI API: http://{args.host}:{args.port}/v1   (status: http://{args.host}:{args.port}/status)\n")
    print(f"{'role':<9}{'address':<24}pid")
    for c in children:
        print(f"{c.role:<9}{c.address:<24}{c.proc.pid}")
    print("\nCtrl-C to stop.", flush=True)


def _shutdown(children: list[Child]) -> None:
    """Gateway first (no new work), then workers drain; anything left after the grace is killed."""
    for group in (["gateway"], ["encoder", "prefill", "decode"]):
        members = [c for c in children if c.role in group and c.proc.poll() is None]
        for c in members:
            c.proc.send_signal(signal.SIGTERM)
        for c in members:
            try:
                c.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
