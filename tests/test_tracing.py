"""OpenTelemetry traces across the real stack, received by a small OTLP/HTTP receiver in the test.

Every process exports to the receiver: the gateway, prefill and decode through
``--otlp-traces-endpoint``, the encoder through the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``.
One image request through disaggregated placement is one trace: the gateway's spans
(admission, placement), the encoder's (cache check, encode), prefill's (each chunk, each
send) and decode's (reserve, wait for KV, verify, insert, first step) share its trace id,
carried between processes by the gRPC instrumentation (W3C trace context); each process
names itself (``service.name``), and the request id and placement are attributes.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from cluster import Cluster, Gateway
from shape_images import shape_data_url


class OtlpReceiver:
    """``POST /v1/traces`` (OTLP/HTTP protobuf): keeps every span as (service, name, trace id, attributes)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str, dict]] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for resource_spans in request.resource_spans:
                        service = next((a.value.string_value for a in resource_spans.resource.attributes
                                        if a.key == "service.name"), "")
                        for scope in resource_spans.scope_spans:
                            for s in scope.spans:
                                attrs = {a.key: (a.value.string_value or a.value.int_value or a.value.bool_value)
                                         for a in s.attributes}
                                spans.append((service, s.name, s.trace_id.hex(), attrs))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, receiver) -> tuple[Cluster, Gateway]:
    c = Cluster(tmp_path_factory.mktemp("traced"))
    flag = ("--otlp-traces-endpoint", receiver.url)
    try:
        c.start("encoder", env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url})
        c.start("decode", *flag)
        c.start("prefill", *flag)
        c.wait_healthy()
        gateway = c.start_gateway("--placement", "disaggregated", "--prefill-chunk-tokens", "8", *flag)
        c.wait_gateways()
        yield c, gateway
    finally:
        c.stop()


def image_url(seed: int) -> str:
    return shape_data_url(seed)[0]


def test_one_request_is_one_trace_across_the_processes(served, receiver):
    _, gateway = served
    with openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="demo-vlm", max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(7)}},
                                                    {"type": "text", "text": "What shape is this?"}]}])
    request_id = raw.headers["x-request-id"]

    def trace_of_request() -> str | None:
        return next((t for svc, name, t, attrs in list(receiver.spans)
                     if svc == "epd-gateway" and name == "gateway.admission" and attrs.get("epd.request_id") == request_id),
                    None)

    wanted = {"epd-gateway": {"gateway.admission", "gateway.placement"},
              "epd-encoder": {"encoder.cache_check", "encoder.encode"},
              "epd-prefill": {"prefill.chunk", "prefill.send"},
              "epd-decode": {"decode.reserve", "decode.wait_for_kv", "decode.verify", "decode.insert", "decode.first_step"}}
    end = time.monotonic() + 30
    names: dict[str, set[str]] = defaultdict(set)
    while time.monotonic() < end:
        trace_id = trace_of_request()
        if trace_id is not None:
            names = defaultdict(set)
            for svc, name, t, _ in list(receiver.spans):
                if t == trace_id:
                    names[svc].add(name)
            if all(wanted[svc] <= names[svc] for svc in wanted):
                break
        time.sleep(0.2)
    assert trace_of_request() is not None, receiver.spans[:20]
    for svc, expected in wanted.items():
        assert expected <= names[svc], (svc, sorted(names[svc]))
    trace_id = trace_of_request()
    mine = [(svc, name, attrs) for svc, name, t, attrs in receiver.spans if t == trace_id]
    # a new image: the encoder computed it; the prompt of about 25 tokens went in chunks of 8
    assert sum(1 for svc, name, _ in mine if name == "prefill.chunk") >= 3
    assert sum(1 for svc, name, _ in mine if name == "prefill.send") >= 3
    placement = next(attrs for svc, name, attrs in mine if name == "gateway.placement")
    assert placement["epd.placement"] == "disaggregated" and placement["epd.request_id"] == request_id
    assert all(attrs.get("epd.request_id") == request_id for svc, name, attrs in mine
               if name.startswith(("prefill.", "decode.", "encoder."))), mine
    # the HTTP and RPC server spans of the instrumentation packages are in the same trace
    assert any(svc == "epd-gateway" and "chat/completions" in name for svc, name, _ in mine), sorted(n for _, n, _ in mine)
    assert any(svc == "epd-decode" and name.endswith("/Generate") for svc, name, _ in mine), sorted(n for _, n, _ in mine)
    # one request, one trace: no other trace carries its id
    others = {t for svc, name, t, attrs in receiver.spans if attrs.get("epd.request_id") == request_id} - {trace_id}
    assert not others
