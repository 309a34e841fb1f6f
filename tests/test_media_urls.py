"""No server-side request forgery: which image URLs the gateway fetches, over real sockets.

A real HTTP server on 127.0.0.1 plays every host. Names are given addresses by a
resolver injected into the gateway's network backend (the seam where the address
check runs), and a "public" test address is routed to the local server by a small
NAT backend below the check, as a router would; httpx, httpcore and the sockets
are the real ones.
"""

from __future__ import annotations

import gzip
import ipaddress
import socket
import threading
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import httpcore
import httpx
import pytest
from inprocess_backend import demo_model_path, image_bytes, image_message, shape

from gateway.app import create_app
from gateway.errors import ApiError
from gateway.images import RemoteImageFetcher
from gateway.media_policy import AddressClass, MediaNetwork, MediaUrlPolicy, MediaUrlRefused, classify
from gateway.settings import GatewaySettings

PNG = image_bytes(shape(3).image)
PUBLIC_IP = "93.184.216.34"        # a global unicast address; the NAT below routes it to the local server
CLOSED_IP = "93.184.216.35"        # routed to a local port nobody listens on
NOT_ALLOWED = "image URL is not allowed by this server's media URL policy"


@dataclass
class ImageHost:
    """The local server: what it was asked for and how the endless body ended."""

    port: int
    hits: list[str] = field(default_factory=list)
    endless_written: int = 0
    endless_cut: threading.Event = field(default_factory=threading.Event)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    state = ImageHost(0)
    bomb = gzip.compress(b"\0" * (64 << 20), 9)   # 64 KB on the wire, 64 MiB inflated

    class Handler(BaseHTTPRequestHandler):   # HTTP/1.0: one connection per request
        def do_GET(self):
            url = urlparse(self.path)
            state.hits.append(url.path)
            if url.path == "/shape.png":
                self._send(200, PNG)
            elif url.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", parse_qs(url.query)["to"][0])
                self.end_headers()
            elif url.path == "/endless.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")   # no Content-Length: body until close
                self.end_headers()
                try:
                    while state.endless_written < (256 << 20):
                        self.wfile.write(b"\0" * 65536)
                        state.endless_written += 65536
                except OSError:
                    state.endless_cut.set()
            elif url.path == "/bomb.png":
                self.send_response(200)
                self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(bomb)))
                self.end_headers()
                self.wfile.write(bomb)
            else:
                self._send(404, b"no such image")

        def _send(self, status: int, body: bytes):
            self.send_response(status)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Nat(httpcore.AnyIOBackend):
    """Routes ``PUBLIC_IP`` to the local server and ``CLOSED_IP`` to a closed local port; others as they are."""

    def __init__(self, local_port: int):
        self.routes = {PUBLIC_IP: local_port, CLOSED_IP: closed_port()}
        self.connected: list[str] = []

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        self.connected.append(host)
        if host in self.routes:
            host, port = "127.0.0.1", self.routes[host]
        return await super().connect_tcp(host, port, timeout, local_address, socket_options)


def network(host: ImageHost, names: dict[str, list[str]]) -> tuple[MediaNetwork, Nat]:
    async def resolve(name: str, port: int) -> list[str]:
        answer = names.get(name)
        if answer is None:
            try:
                ipaddress.ip_address(name)
            except ValueError:
                raise OSError(f"unknown test host {name}") from None
            return [name]
        return answer

    nat = Nat(host.port)
    return MediaNetwork(resolve=resolve, connect=nat), nat


def fetcher(net: MediaNetwork, **overrides) -> RemoteImageFetcher:
    settings = GatewaySettings(model=str(demo_model_path()[0]), remote_image_timeout_s=5.0, **overrides)
    return RemoteImageFetcher.open(settings, net)


async def refused(f: RemoteImageFetcher, url: str) -> ApiError:
    with pytest.raises(ApiError) as caught:
        await f.fetch(url, "image_url")
    return caught.value


# -- the HTTP API -------------------------------------------------------------------------------
async def test_a_loopback_image_server_is_refused_by_default_and_served_with_the_opt_in(host, backend, prompts):
    async def post(app, url: str) -> httpx.Response:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
                return await client.post("/v1/chat/completions", json={
                    "model": "demo-vlm", "max_tokens": 2, "messages": image_message(url)})

    settings = GatewaySettings(model=str(demo_model_path()[0]))
    before = len(host.hits)
    for url in (f"{host.base}/shape.png", f"http://localhost:{host.port}/shape.png",
                f"http://[::ffff:127.0.0.1]:{host.port}/shape.png", f"http://0.0.0.0:{host.port}/shape.png",
                "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1:6379/"):
        r = await post(create_app(settings, backend, prompt_builder=prompts), url)
        assert r.status_code == 400, url
        assert r.json()["error"] == {"message": NOT_ALLOWED, "type": "invalid_request_error",
                                     "param": "messages.0.content.0.image_url.url", "code": "media_url_not_allowed"}
        assert str(host.port) not in r.text and "127.0.0" not in r.text
    assert len(host.hits) == before and backend.jobs == []   # no connection was made, no work was done
    opted_in = settings.model_copy(update={"allow_private_media_urls": True})
    r = await post(create_app(opted_in, backend, prompt_builder=prompts), f"{host.base}/shape.png")
    assert r.status_code == 200, r.text
    assert host.hits[-1] == "/shape.png" and len(backend.jobs) == 1
    # the metadata endpoint's link-local range stays refused even with the opt-in
    r = await post(create_app(opted_in, backend, prompt_builder=prompts), "http://169.254.169.254/latest/")
    assert r.status_code == 400 and r.json()["error"]["code"] == "media_url_not_allowed"


# -- the address check at connect time ----------------------------------------------------------
async def test_a_public_looking_name_that_resolves_to_loopback_is_refused_at_connect_time(host):
    before = len(host.hits)
    net, nat = network(host, {"images.example.com": ["127.0.0.1"], "mixed.example.com": [PUBLIC_IP, "127.0.0.1"],
                              "v6.example.com": ["::1"], "mapped.example.com": ["::ffff:10.1.2.3"]})
    f = fetcher(net)
    try:
        for name in ("images.example.com", "mixed.example.com", "v6.example.com", "mapped.example.com"):
            error = await refused(f, f"http://{name}:{host.port}/shape.png")
            assert (error.status, error.code, error.message) == (400, "media_url_not_allowed", NOT_ALLOWED), name
    finally:
        await f.aclose()
    assert nat.connected == [] and len(host.hits) == before
    # with the opt-in the same name is fetched, over a socket to the address the check saw
    f = fetcher(net, allow_private_media_urls=True)
    try:
        assert await f.fetch(f"http://images.example.com:{host.port}/shape.png") == PNG
    finally:
        await f.aclose()
    assert nat.connected == ["127.0.0.1"]


async def test_dns_rebinding_is_checked_on_every_connection(host):
    """Public when first resolved, loopback afterwards: the second connection is refused."""
    answers = iter([[PUBLIC_IP], ["127.0.0.1"]])

    async def rebinding(name: str, port: int) -> list[str]:
        return next(answers)

    nat = Nat(host.port)
    f = fetcher(MediaNetwork(resolve=rebinding, connect=nat))
    try:
        assert await f.fetch("http://rebind.example/shape.png") == PNG
        assert (await refused(f, "http://rebind.example/shape.png")).code == "media_url_not_allowed"
    finally:
        await f.aclose()
    assert nat.connected == [PUBLIC_IP]


async def test_a_redirect_to_a_private_address_is_refused(host):
    net, nat = network(host, {"cdn.example": [PUBLIC_IP], "internal.example": ["10.1.2.3"]})
    f = fetcher(net)
    try:
        assert await f.fetch("http://cdn.example/redirect?to=http://cdn.example/shape.png") == PNG
        for target in (f"{host.base}/shape.png", "http://internal.example/shape.png", "file:///etc/passwd"):
            before = list(host.hits)
            error = await refused(f, f"http://cdn.example/redirect?to={target}")
            assert (error.code, error.message) == ("media_url_not_allowed", NOT_ALLOWED), target
            assert host.hits[len(before):] == ["/redirect"]   # the redirect was read, its target never asked
    finally:
        await f.aclose()
    assert set(nat.connected) == {PUBLIC_IP}


async def test_allowed_media_domains_refuse_other_hosts_and_redirects_to_them(host):
    net, nat = network(host, {"cdn.example": [PUBLIC_IP], "other.example": [PUBLIC_IP]})
    f = fetcher(net, allowed_media_domains=["CDN.example."])
    try:
        assert await f.fetch("http://cdn.example/shape.png") == PNG
        before = len(host.hits)
        assert (await refused(f, "http://other.example/shape.png")).code == "media_url_not_allowed"
        assert (await refused(f, f"http://{PUBLIC_IP}/shape.png")).code == "media_url_not_allowed"
        assert len(host.hits) == before   # refused before connecting
        assert (await refused(f, "http://cdn.example/redirect?to=http://other.example/shape.png")).code == \
            "media_url_not_allowed"
        assert host.hits[before:] == ["/redirect"]
    finally:
        await f.aclose()


async def test_failures_from_an_allowed_host_are_generic(host):
    net, _ = network(host, {"cdn.example": [PUBLIC_IP], "closed.example": [CLOSED_IP]})
    f = fetcher(net)
    try:
        missing = await refused(f, "http://cdn.example/missing.png")
        assert (missing.code, missing.message) == ("image_fetch_failed", "could not fetch the image: HTTP 404")
        # a refused connection: no error class, no address, no port (the old text named "ConnectError")
        closed = await refused(f, "http://closed.example:9/shape.png")
        assert (closed.code, closed.message) == ("image_fetch_failed", "could not fetch the image")
        unknown = await refused(f, "http://unknown.example/shape.png")   # the resolver does not know it
        assert (unknown.code, unknown.message) == ("image_fetch_failed", "could not fetch the image")
        two_hops = "http://cdn.example/redirect?to=http://cdn.example/redirect%3Fto%3Dhttp://cdn.example/shape.png"
        assert await f.fetch(two_hops) == PNG   # within the limit of 3 redirects
    finally:
        await f.aclose()


# -- the size limit while streaming -------------------------------------------------------------
async def test_an_endless_body_is_cut_at_the_limit(host):
    net, _ = network(host, {"cdn.example": [PUBLIC_IP]})
    f = fetcher(net, max_image_bytes=20_000)
    try:
        error = await refused(f, "http://cdn.example/endless.png")
    finally:
        await f.aclose()
    assert error.code == "image_too_large"
    assert host.endless_cut.wait(10), "the server kept writing: the gateway did not close the connection"
    assert host.endless_written < (256 << 20)


async def test_a_compressed_body_is_never_inflated(host):
    """64 KB of gzip that inflates to 64 MiB: refused without decompressing (the old fetcher held
    a whole inflated read, tens of MiB, before it compared the size)."""
    net, _ = network(host, {"cdn.example": [PUBLIC_IP]})
    f = fetcher(net, max_image_bytes=200_000)
    tracemalloc.start()
    try:
        error = await refused(f, "http://cdn.example/bomb.png")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await f.aclose()
    assert error.code in ("image_fetch_failed", "image_too_large")
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB while refusing a compressed body"


# -- the address classes ------------------------------------------------------------------------
@pytest.mark.parametrize("address, kind", [
    ("93.184.216.34", AddressClass.PUBLIC), ("2606:2800:220:1:248:1893:25c8:1946", AddressClass.PUBLIC),
    ("127.0.0.1", AddressClass.PRIVATE), ("10.0.0.1", AddressClass.PRIVATE), ("172.16.5.4", AddressClass.PRIVATE),
    ("192.168.1.1", AddressClass.PRIVATE), ("100.64.0.1", AddressClass.PRIVATE), ("::1", AddressClass.PRIVATE),
    ("fd00::1", AddressClass.PRIVATE), ("::ffff:127.0.0.1", AddressClass.PRIVATE),
    ("::ffff:93.184.216.34", AddressClass.PUBLIC), ("2002:7f00:1::1", AddressClass.PRIVATE),
    ("64:ff9b::a00:1", AddressClass.PRIVATE), ("0.0.0.0", AddressClass.FORBIDDEN), ("::", AddressClass.FORBIDDEN),
    ("169.254.169.254", AddressClass.FORBIDDEN), ("fe80::1", AddressClass.FORBIDDEN),
    ("224.0.0.1", AddressClass.FORBIDDEN), ("ff02::1", AddressClass.FORBIDDEN),
    ("255.255.255.255", AddressClass.FORBIDDEN), ("240.0.0.1", AddressClass.FORBIDDEN),
    ("192.0.2.1", AddressClass.FORBIDDEN), ("2001:db8::1", AddressClass.FORBIDDEN),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", AddressClass.FORBIDDEN),   # Teredo
    ("::127.0.0.1", AddressClass.FORBIDDEN),                            # IPv4-compatible (deprecated)
])
def test_address_classes(address, kind):
    assert classify(ipaddress.ip_address(address)) == kind


def test_policy_allows_by_class_and_checks_urls():
    strict, opted = MediaUrlPolicy(), MediaUrlPolicy(allow_private=True)
    loop, meta = ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("169.254.169.254")
    assert not strict.address_allowed(loop) and opted.address_allowed(loop)
    assert not opted.address_allowed(meta)
    domains = MediaUrlPolicy.from_settings([" Images.Example.com "], False)
    domains.check_url(httpx.URL("https://images.example.com./a.png"))
    for url in ("https://evil.example.com/a.png", "ftp://images.example.com/a.png"):
        with pytest.raises(MediaUrlRefused):
            domains.check_url(httpx.URL(url))
