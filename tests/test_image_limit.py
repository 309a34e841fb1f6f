"""``--limit-images-per-request`` (``EPD_LIMIT_IMAGES_PER_REQUEST``, issue 17): one setting for every process.

Default 8. The gateway counts a request's images before any work (before an image is
decoded or a prompt rendered): more is a 400 ``too_many_images``. ``epd serve`` hands
its value to every child, so workers and gateway agree. On the code before, the setting
was ``EPD_MAX_IMAGES_PER_REQUEST`` with a default of 4 and no flag: every test here fails.
"""

from __future__ import annotations

import pytest
from inprocess_backend import data_url, image_bytes, shape
from test_gateway_errors import MODEL, assert_error, make_app, open_client

from gateway.server import parse_gateway_args
from gateway.settings import GatewaySettings
from launcher import serve
from launcher.serve_settings import ServeSettings
from runtime.worker.settings import WorkerSettings, parse_worker_args

FLAG = "--limit-images-per-request"


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("EPD_"):
            monkeypatch.delenv(name)


def _children(argv: list[str]) -> list[list[str]]:
    worker, gateway, settings = serve._load_settings()
    args = serve.parse_args(argv, worker, gateway, settings)
    addrs = serve.plan_addresses(args)
    worker_env, gateway_env = serve.child_environments(args, addrs, {})
    specs = [*serve.worker_specs(args, worker, addrs, worker_env), serve.gateway_spec(args, gateway, gateway_env)]
    return [s.argv for s in specs]


def _flag(argv: list[str]) -> str | None:
    return argv[argv.index(FLAG) + 1] if FLAG in argv else None


def test_one_setting_default_eight_for_every_process(clean_env, monkeypatch):
    assert GatewaySettings().limit_images_per_request == WorkerSettings().limit_images_per_request == 8
    assert {_flag(argv) for argv in _children([])} == {"8"}       # encoder, prefill, decode and the gateway
    monkeypatch.setenv("EPD_LIMIT_IMAGES_PER_REQUEST", "3")
    assert GatewaySettings().limit_images_per_request == WorkerSettings().limit_images_per_request == 3
    assert {_flag(argv) for argv in _children([])} == {"3"}
    assert {_flag(argv) for argv in _children([FLAG, "5"])} == {"5"}    # the flag overrides the variable
    assert parse_gateway_args([FLAG, "2"]).limit_images_per_request == 2
    assert parse_worker_args("decode", [FLAG, "2"]).limit_images_per_request == 2
    with pytest.raises(SystemExit):
        serve.parse_args([FLAG, "-1"], WorkerSettings(), GatewaySettings(), ServeSettings())


def _request(urls: list[str]) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": MODEL, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "which ?"}]}],
            "max_tokens": 2}


async def test_one_image_over_the_limit_is_a_400_before_any_work(backend, prompts):
    good = [data_url(image_bytes(shape(seed).image)) for seed in range(8)]
    async for client in open_client(make_app(backend, prompts)):
        # undecodable data: counted before any image is looked at, so the count is what is refused
        r = await client.post("/v1/chat/completions", json=_request(["data:image/png;base64,!!"] * 9))
        assert_error(r, 400, "too_many_images", "messages")
        assert backend.jobs == []
        r = await client.post("/v1/chat/completions", json=_request(good))
        assert r.status_code == 200, r.text
        assert len(backend.jobs) == 1 and len(backend.jobs[0].images) == 8
