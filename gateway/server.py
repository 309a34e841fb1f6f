"""``epd gateway``: the OpenAI-compatible HTTP gateway process."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from runtime.model.supported_models import UnsupportedModel, check_checkpoint
from runtime.worker.log_format import configure_logging
from runtime.worker.tracing import setup_tracing, shutdown_tracing

from .app import create_app
from .orchestrator import Orchestrator
from .settings import GatewaySettings


def parse_gateway_args(argv: list[str]) -> GatewaySettings:
    p = argparse.ArgumentParser(prog="epd gateway", description=__doc__)
    p.add_argument("--model", help="model folder (the gateway reads its processor and config, never its weights)")
    p.add_argument("--served-model-name")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--redis-url", help="discover workers registered in Redis")
    p.add_argument("--encoder-addrs", help="comma-separated host:port of encoder workers")
    p.add_argument("--prefill-addrs", help="comma-separated host:port of prefill workers")
    p.add_argument("--decode-addrs", help="comma-separated host:port of decode workers")
    p.add_argument("--placement", choices=["conditional", "colocated", "disaggregated"])
    p.add_argument("--prefill-chunk-tokens", type=int)
    p.add_argument("--limit-images-per-request", type=int, help="images one request may carry (more: 400)")
    p.add_argument("--ttft-slo-ms", type=float)
    p.add_argument("--itl-slo-ms", type=float)
    p.add_argument("--log-format", choices=["text", "json"], help="log lines as text or one JSON object each")
    p.add_argument("--otlp-traces-endpoint", metavar="URL", help="export OpenTelemetry traces over OTLP/HTTP to URL")
    sec = p.add_argument_group("security", "see docs/deploy.md; each flag overrides its EPD_* variable")
    sec.add_argument("--api-key", action="append", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1/* (repeat for several keys; env EPD_API_KEY=k1,k2)")
    sec.add_argument("--open-metrics-and-status", action="store_true", default=None,
                     help="with API keys: serve /metrics and /status without a key")
    sec.add_argument("--cache-salt-per-api-key", action=argparse.BooleanOptionalAction,
                     help="with API keys: each key gets its own encoder-cache namespace (default on)")
    sec.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                     help="fetch image URLs only from these hostnames (space- or comma-separated)")
    sec.add_argument("--allow-private-media-urls", action="store_true", default=None,
                     help="allow image URLs on loopback/private addresses (on-prem media servers)")
    args = p.parse_args(argv)
    if args.allowed_media_domains is not None:
        args.allowed_media_domains = ",".join(args.allowed_media_domains)
    return GatewaySettings(**{k: v for k, v in vars(args).items() if v is not None})


def main(argv: list[str]) -> int:
    settings = parse_gateway_args(argv)
    try:
        check_checkpoint(settings.model)   # one line and exit status 2, not a traceback from the app factory
    except (UnsupportedModel, OSError) as exc:
        print("epd gateway: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2
    configure_logging(settings.log_format)
    setup_tracing("epd-gateway", settings.otlp_traces_endpoint)   # before the app and its channels
    app = create_app(settings, Orchestrator(settings), freeze_heap=True)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning",
                    timeout_graceful_shutdown=int(settings.drain_timeout_s))
    finally:
        shutdown_tracing()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
