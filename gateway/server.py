"""``epd gateway``: the OpenAI-compatible HTTP gateway process."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

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
    p.add_argument("--ttft-slo-ms", type=float)
    p.add_argument("--itl-slo-ms", type=float)
    args = p.parse_args(argv)
    return GatewaySettings(**{k: v for k, v in vars(args).items() if v is not None})


def main(argv: list[str]) -> int:
    settings = parse_gateway_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = create_app(settings, Orchestrator(settings))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning",
                timeout_graceful_shutdown=int(settings.drain_timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
