"""Where the gateway may fetch media from: no server-side request forgery.

A client's image URL must not make the gateway reach what the client cannot:
the loopback interface, the private network, the cloud metadata endpoint.

Two checks, both always on:

* **URL** (``MediaUrlPolicy.check_url``, on the original URL and on every
  redirect target): scheme ``http``/``https``; with ``allowed_media_domains``,
  the host must be one of them (exact match, case-insensitive).
* **Address** (``GuardedNetworkBackend.connect_tcp``, the httpcore seam where
  every TCP connection is opened): the host is resolved here, *every* address
  it resolves to is classified, and the connection goes to a checked address.
  One forbidden address refuses the host. Because the check sits where the
  socket is opened (and nowhere earlier), DNS rebinding (a name that resolves
  to a public address when checked and a private one when connected) and
  redirects cannot get around it. TLS still verifies and sends SNI for the
  URL's hostname (httpcore takes it from the request, not from the address).

Address classes (``classify``; embedded IPv4 of IPv4-mapped, 6to4 and NAT64
addresses is classified as IPv4):

=========  ===============================================================  ==============================
PUBLIC     global unicast                                                   fetched
PRIVATE    loopback, RFC 1918, CGNAT 100.64/10, IPv6 ULA and site-local      only with ``allow_private_media_urls``
FORBIDDEN  unspecified, link-local (169.254/16 holds cloud metadata),        never
           multicast, broadcast, reserved, documentation, benchmarking,
           IPv6 outside 2000::/3, Teredo
=========  ===============================================================  ==============================

A refusal raises ``MediaUrlRefused``, which carries nothing for the client: the
HTTP layer answers "not allowed" without the address, the port or any upstream
detail (see ``gateway.images``).
"""

from __future__ import annotations

import enum
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class AddressClass(enum.IntEnum):
    PUBLIC = 0
    PRIVATE = 1
    FORBIDDEN = 2


class MediaUrlRefused(Exception):
    """The media URL policy refused a URL or the address it resolved to (the reason is for logs only)."""


_V4 = ipaddress.IPv4Network
_V6 = ipaddress.IPv6Network
_V4_PRIVATE = tuple(_V4(n) for n in ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"))
_V4_FORBIDDEN = tuple(_V4(n) for n in (
    "0.0.0.0/8", "169.254.0.0/16", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4"))
_V6_PRIVATE = tuple(_V6(n) for n in ("::1/128", "fc00::/7", "fec0::/10", "64:ff9b:1::/48"))
_V6_FORBIDDEN = tuple(_V6(n) for n in (
    "::/128", "fe80::/10", "ff00::/8", "100::/64", "2001::/23", "2001:db8::/32", "3fff::/20"))
_V6_GLOBAL_UNICAST = _V6("2000::/3")
_NAT64 = _V6("64:ff9b::/96")


def classify(address: IPAddress) -> AddressClass:
    """The class of one address (see the module table)."""
    if isinstance(address, ipaddress.IPv6Address):
        address = ipaddress.IPv6Address(address.packed)   # drop a %scope
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(address.packed[-4:])
        if embedded is not None:
            return classify(embedded)
        if any(address in n for n in _V6_FORBIDDEN):
            return AddressClass.FORBIDDEN
        if any(address in n for n in _V6_PRIVATE):
            return AddressClass.PRIVATE
        return AddressClass.PUBLIC if address in _V6_GLOBAL_UNICAST else AddressClass.FORBIDDEN
    if any(address in n for n in _V4_FORBIDDEN):
        return AddressClass.FORBIDDEN
    if any(address in n for n in _V4_PRIVATE):
        return AddressClass.PRIVATE
    return AddressClass.PUBLIC


def _host_name(host: str) -> str:
    return host.strip().lower().rstrip(".")


@dataclass(frozen=True, slots=True)
class MediaUrlPolicy:
    allowed_domains: frozenset[str] = frozenset()   # empty: any host (the address check still applies)
    allow_private: bool = False

    @classmethod
    def from_settings(cls, domains: Iterable[str], allow_private: bool) -> "MediaUrlPolicy":
        return cls(frozenset(_host_name(d) for d in domains if d.strip()), allow_private)

    def check_url(self, url: httpx.URL) -> None:
        """Raise ``MediaUrlRefused`` unless ``url`` may be requested (before any connection)."""
        if url.scheme not in ("http", "https"):
            raise MediaUrlRefused(f"scheme {url.scheme!r}")
        if not url.host:
            raise MediaUrlRefused("no host")
        if self.allowed_domains and _host_name(url.host) not in self.allowed_domains:
            raise MediaUrlRefused(f"host {url.host!r} is not an allowed media domain")

    def address_allowed(self, address: IPAddress) -> bool:
        kind = classify(address)
        return kind == AddressClass.PUBLIC or (kind == AddressClass.PRIVATE and self.allow_private)


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (an IP literal resolves to itself)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True, slots=True)
class MediaNetwork:
    """How media fetches reach the network: the resolver and the backend that opens checked sockets.

    Both are seams for tests (a resolver that names test hosts; a backend that routes a public test
    address to a local server, as a NAT would); in production they are the system's.
    """

    resolve: Resolver = system_resolver
    connect: httpcore.AsyncNetworkBackend = field(default_factory=httpcore.AnyIOBackend)


class GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that connects only to addresses the policy allows."""

    def __init__(self, policy: MediaUrlPolicy, network: MediaNetwork):
        self.policy = policy
        self.network = network

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None, socket_options: Iterable[Any] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        try:
            with anyio.fail_after(timeout):
                resolved = await self.network.resolve(host, port)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host!r} timed out") from None
        except OSError as exc:
            raise httpcore.ConnectError(f"resolving {host!r} failed: {exc}") from None
        try:
            addresses = list(dict.fromkeys(ipaddress.ip_address(a.split("%", 1)[0]) for a in resolved))
        except ValueError as exc:
            raise httpcore.ConnectError(f"resolving {host!r} gave a non-address: {exc}") from None
        if not addresses:
            raise httpcore.ConnectError(f"{host!r} has no address")
        refused = [a for a in addresses if not self.policy.address_allowed(a)]
        if refused:
            raise MediaUrlRefused(f"{host!r} resolves to {refused[0]} ({classify(refused[0]).name})")
        failure: Exception = httpcore.ConnectError(f"{host!r}: no address connected")
        for address in addresses:   # each one checked above: the socket can only go to one of them
            try:
                return await self.network.connect.connect_tcp(str(address), port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        raise failure

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        raise MediaUrlRefused("unix sockets are never used for media")

    async def sleep(self, seconds: float) -> None:
        await self.network.connect.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a ``GuardedNetworkBackend``, with no proxy (a proxy would connect for us).

    httpx (pinned <0.29) has no public argument for the network backend, so the connection pool it
    builds is replaced by the same pool over the guarded backend.
    """

    def __init__(self, policy: MediaUrlPolicy, network: MediaNetwork, max_connections: int = 32):
        super().__init__(trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=max_connections,
            network_backend=GuardedNetworkBackend(policy, network),
        )
