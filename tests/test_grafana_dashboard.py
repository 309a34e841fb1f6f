"""``deploy/grafana/epd-dashboard.json`` reads only metrics the processes really export.

The real stack (encoder, prefill, decode with their metrics ports, and the gateway) serves a
few image requests (a miss and a hit, disaggregated); then every ``/metrics`` is scraped and
each metric a panel's query names must be among what was scraped. The board's own shape is
checked too: unique panel ids, every panel on the Prometheus datasource variable, every query
a PromQL expression over ``epd:`` metrics, and the same panels as ``/dashboard`` (stages'
health, queues, KV blocks, encoder cache, rates, refusals, TTFT / ITL percentiles, KV
transfer, cache hit rate, cost model fit vs measured).
"""

from __future__ import annotations

import base64
import io
import json
import random
import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import ROOT, Cluster, free_port
from runtime.demo_model.shapes import draw_shape

BOARD = ROOT / "deploy" / "grafana" / "epd-dashboard.json"
METRIC = re.compile(r"\bepd:[a-z_:]+")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("_sum", "_count")}


def exported_names(text: str) -> set[str]:
    """Every series name a Prometheus server would store from this page (a family declared but
    still without samples, such as a labelled counter never incremented, counts too)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
    return names


def board() -> dict:
    return json.loads(BOARD.read_text())


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> set[str]:
    c = Cluster(tmp_path_factory.mktemp("grafana"))
    ports = {role: free_port() for role in ("encoder", "decode", "prefill")}
    try:
        for role in ("encoder", "decode", "prefill"):
            c.start(role, env={"EPD_METRICS_PORT": str(ports[role])})
        c.wait_healthy()
        gateway = c.start_gateway("--placement", "disaggregated", "--prefill-chunk-tokens", "8")
        c.wait_gateways()
        buf = io.BytesIO()
        draw_shape(random.Random(3)).image.save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        with openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            for _ in range(2):   # a miss, then a hit
                client.chat.completions.create(model="demo-vlm", max_tokens=3, temperature=0, messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What shape is this?"}]}])
        pages = [httpx.get(f"{gateway.base}/metrics", timeout=10).text]
        pages += [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text for port in ports.values()]
        return set().union(*(exported_names(page) for page in pages))
    finally:
        c.stop()


def test_every_metric_the_board_queries_is_exported(scraped):
    queried = {name for panel in board()["panels"] for target in panel["targets"] for name in METRIC.findall(target["expr"])}
    assert queried, "the board queries no epd metric"
    missing = sorted(queried - scraped)
    assert not missing, f"the board queries metrics no process exports: {missing}"


def test_the_board_is_well_formed_and_covers_the_dashboard():
    b = board()
    ids = [p["id"] for p in b["panels"]]
    assert len(ids) == len(set(ids))
    assert b["uid"] and b["templating"]["list"][0]["type"] == "datasource"
    for panel in b["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(METRIC.search(t["expr"]) for t in panel["targets"]), panel["title"]
        for t in panel["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    queried = " ".join(t["expr"] for p in b["panels"] for t in p["targets"])
    for name in ("epd:healthy_workers", "epd:queue_depth", "epd:worker_in_flight", "epd:worker_running_seqs",
                 "epd:worker_free_blocks", "epd:worker_reservations_active", "epd:worker_pending_chunks",
                 "epd:worker_encoder_cache_hits_total", "epd:worker_encoder_computes_total",
                 "epd:request_success_total", "epd:admission_rejected_total",
                 "epd:time_to_first_token_seconds_bucket", "epd:inter_token_latency_seconds_bucket",
                 "epd:kv_transfer_bytes_total", "epd:gateway_image_cache_checks_total",
                 "epd:cost_model_fit_ms", "epd:cost_model_measured_ms", "epd:worker_cached_blocks",
                 "epd:prefix_cache_hits_total", "epd:prefix_cache_queries_total", "epd:gc_pause_seconds_bucket"):
        assert name in queried, name


def test_deploy_docs_say_how_to_load_it():
    for doc in (ROOT / "docs" / "deploy.md", ROOT / "deploy" / "grafana" / "README.md"):
        text = Path(doc).read_text()
        assert "deploy/grafana/epd-dashboard.json" in text, doc
