"""`epd healthcheck TARGET`: exit 0 when a worker or the gateway is healthy.

Used by the image's HEALTHCHECK, by docker compose health checks and by anyone
scripting against a running stack. Kubernetes probes the workers natively
(``grpc:`` probes) and the gateway with ``httpGet``, so they do not need it.

TARGET is one of:

    grpc://HOST:PORT[/SERVICE]   standard gRPC health service (grpc.health.v1.Health/Check);
                                 SERVICE defaults to "" = the whole server
    http://HOST:PORT/health      the gateway's health endpoint; HTTP 200 is healthy
    https://HOST:PORT/health     the same over TLS

The gRPC health service needs no internal token (``EPD_INTERNAL_TOKEN`` guards every
other worker RPC; probes cannot send metadata), so this command never needs one either.

Exit status: 0 healthy, 1 not healthy (not serving, wrong status, unreachable,
timed out), 2 usage error. One line goes to stdout when healthy and to stderr
otherwise, which is what ``docker inspect`` shows as the check's output.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

HEALTHY, UNHEALTHY, USAGE = 0, 1, 2
DEFAULT_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed TARGET: gRPC address + health service name, or an HTTP URL."""

    kind: Literal["grpc", "http"]
    address: str  # grpc: "host:port"; http: the full URL
    service: str = ""  # grpc only


def parse_target(text: str) -> Target:
    """Parse TARGET; raise ValueError with a readable message when it is malformed."""
    parts = urlsplit(text)
    if parts.scheme == "grpc":
        if not parts.hostname or parts.port is None:
            raise ValueError(f"grpc target needs host and port, e.g. grpc://127.0.0.1:50053 (got {text!r})")
        return Target("grpc", parts.netloc, service=parts.path.strip("/"))
    if parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise ValueError(f"http target needs a host, e.g. http://127.0.0.1:8000/health (got {text!r})")
        return Target("http", text)
    raise ValueError(f"target must start with grpc://, http:// or https:// (got {text!r})")


def check_grpc(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    """One Health/Check call. Connection errors fail fast (no wait_for_ready)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:  # UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND (unknown service), ...
            if isinstance(exc, grpc.Call):
                return False, f"{exc.code().name}: {exc.details()}"
            return False, repr(exc)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    """One GET; only 200 counts as healthy (a 503 while draining does not)."""
    import httpx

    try:
        response = httpx.get(url, timeout=timeout_s, follow_redirects=False)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return response.status_code == 200, f"HTTP {response.status_code}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd healthcheck",
        description="Exit 0 when a worker (gRPC health service) or the gateway (HTTP /health) is healthy, 1 if not.",
    )
    parser.add_argument("target", help="grpc://HOST:PORT[/SERVICE] or http://HOST:PORT/health")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=f"seconds to wait (default {DEFAULT_TIMEOUT_S:g})"
    )
    return parser


def main(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 0 for --help, 2 for bad usage
        return int(exc.code or 0)
    if args.timeout <= 0:
        print("epd healthcheck: --timeout must be > 0", file=sys.stderr)
        return USAGE
    try:
        target = parse_target(args.target)
    except ValueError as exc:
        print(f"epd healthcheck: {exc}", file=sys.stderr)
        return USAGE

    if target.kind == "grpc":
        ok, detail = check_grpc(target.address, target.service, args.timeout)
    else:
        ok, detail = check_http(target.address, args.timeout)
    line = f"{'healthy' if ok else 'unhealthy'}: {args.target} {detail}"
    print(line, file=sys.stdout if ok else sys.stderr)
    return HEALTHY if ok else UNHEALTHY


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
