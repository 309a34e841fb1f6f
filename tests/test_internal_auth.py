"""The internal token's rules and the peer directory, without worker processes.

Token validation and the secure-by-default bind rule (runtime/internal_auth.py), the
bulk preamble's check, and which addresses the peer directory vouches for
(runtime/peers.py): static lists, a real Redis registry (refreshed on a miss), and
no discovery at all. The worker-process side is tests/test_worker_security.py.
"""

from __future__ import annotations

import uuid

import grpc
import pytest
from pydantic import SecretStr, ValidationError

from gateway.settings import GatewaySettings
from runtime.worker.discovery import WorkerRegistration
from runtime.worker.internal_auth import (BULK_PREAMBLE_BYTES, bulk_preamble, bulk_preamble_ok, exposure_problem,
                                   is_loopback, open_channel, server_interceptors, validate_token)
from runtime.worker.peers import PeerDirectory, PeerRole, UnknownPeerError
from runtime.worker.settings import WorkerSettings, parse_worker_args

REDIS_URL = "redis://127.0.0.1:6379/11"
TOKEN = "k" * 24


def test_token_is_a_secret_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("EPD_INTERNAL_TOKEN", f"  {TOKEN}\n")      # a file's trailing newline is not part of it
    monkeypatch.setenv("EPD_DECODE_ADDRS", "10.0.0.1:50053, 10.0.0.2:50053")
    monkeypatch.setenv("EPD_ENCODER_ADDRS", "10.0.0.3:50051")
    worker = WorkerSettings()
    gateway = GatewaySettings()
    assert worker.internal_token.get_secret_value() == gateway.internal_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(worker) and TOKEN not in str(worker) and TOKEN not in repr(gateway)
    assert worker.decode_addrs == ["10.0.0.1:50053", "10.0.0.2:50053"]
    assert worker.encoder_addrs == ["10.0.0.3:50051"]


def test_flags_give_the_peer_lists_and_the_opt_out(monkeypatch) -> None:
    monkeypatch.delenv("EPD_INTERNAL_TOKEN", raising=False)
    s = parse_worker_args("prefill", ["--encoder-addrs", "a:1,b:2", "--decode-addrs", "c:3", "--allow-unauthenticated"])
    assert (s.encoder_addrs, s.decode_addrs, s.allow_unauthenticated) == (["a:1", "b:2"], ["c:3"], True)
    assert parse_worker_args("prefill", []).allow_unauthenticated is False


@pytest.mark.parametrize("bad", ["short", "has a space in it!!!", "tab\tinside-the-token-x"])
def test_a_weak_or_malformed_token_is_refused_without_echoing_it(monkeypatch, bad: str) -> None:
    monkeypatch.setenv("EPD_INTERNAL_TOKEN", bad)
    for settings in (WorkerSettings, GatewaySettings):
        with pytest.raises(ValidationError) as err:
            settings()
        assert "EPD_INTERNAL_TOKEN must be at least 16" in str(err.value)
        assert bad not in str(err.value)


def test_empty_token_means_none() -> None:
    assert validate_token("") is None and validate_token("   ") is None and validate_token(None) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "localhost", "::1", "[::1]"])
def test_loopback_without_a_token_may_start(host: str) -> None:
    assert is_loopback(host)
    assert exposure_problem(host, None, False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "epd-decode"])
def test_beyond_loopback_needs_a_token_or_the_opt_out(host: str) -> None:
    problem = exposure_problem(host, None, False)
    assert problem and "EPD_INTERNAL_TOKEN" in problem and "EPD_ALLOW_UNAUTHENTICATED" in problem
    assert "\n" not in problem
    assert exposure_problem(host, SecretStr(TOKEN), False) is None
    assert exposure_problem(host, None, True) is None


def test_bulk_preamble_proves_the_token_and_only_that_token() -> None:
    right = bulk_preamble(SecretStr(TOKEN))
    assert len(right) == BULK_PREAMBLE_BYTES
    assert TOKEN.encode() not in right, "the token itself never goes on the bulk socket"
    assert bulk_preamble_ok(right, SecretStr(TOKEN))
    assert not bulk_preamble_ok(bulk_preamble(SecretStr("x" * 24)), SecretStr(TOKEN))
    assert not bulk_preamble_ok(bulk_preamble(None), SecretStr(TOKEN))
    assert not bulk_preamble_ok(right[:-1], SecretStr(TOKEN))
    assert not bulk_preamble_ok(b"XXXX" + right[4:], None), "the magic is checked even without a token"
    assert bulk_preamble_ok(bulk_preamble(None), None)


# -- the peer directory -----------------------------------------------------------------------

async def test_every_call_shape_carries_the_token_beside_the_callers_own_metadata() -> None:
    """``open_channel``'s calls, of each of gRPC's four shapes, pass a token-checking server and still
    carry the metadata the caller gave; the same calls without the token are refused."""
    seen: list[dict[str, str]] = []

    def note(context) -> bytes:
        seen.append({k: v for k, v in context.invocation_metadata()})
        return b"ok"

    async def unary_unary(request, context):
        return note(context)

    async def unary_stream(request, context):
        yield note(context)

    async def stream_unary(requests, context):
        async for _ in requests:
            pass
        return note(context)

    async def stream_stream(requests, context):
        async for _ in requests:
            yield note(context)

    shapes = {"UU": grpc.unary_unary_rpc_method_handler(unary_unary),
              "US": grpc.unary_stream_rpc_method_handler(unary_stream),
              "SU": grpc.stream_unary_rpc_method_handler(stream_unary),
              "SS": grpc.stream_stream_rpc_method_handler(stream_stream)}
    server = grpc.aio.server(interceptors=server_interceptors(SecretStr(TOKEN)))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", shapes),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    mine = (("x-epd-test", "mine"),)

    async def stream_stream_call(channel) -> bytes:   # written by the caller, as GenerateMany is
        stream = channel.stream_stream("/t.S/SS")(metadata=mine)
        await stream.write(b"x")
        reply = await stream.read()
        await stream.done_writing()
        return reply

    calls = [lambda ch: ch.unary_unary("/t.S/UU")(b"x", metadata=mine),
             lambda ch: ch.unary_stream("/t.S/US")(b"x", metadata=mine).read(),
             lambda ch: ch.stream_unary("/t.S/SU")(iter([b"x"]), metadata=mine),
             stream_stream_call]
    try:
        async with open_channel(f"127.0.0.1:{port}", TOKEN) as channel:
            assert [await call(channel) for call in calls] == [b"ok"] * 4
        assert len(seen) == 4
        assert all(md.get("authorization") == f"Bearer {TOKEN}" and md.get("x-epd-test") == "mine" for md in seen)
        async with open_channel(f"127.0.0.1:{port}", None) as channel:
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(channel)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert len(seen) == 4
    finally:
        await server.stop(0)


async def test_static_lists_vouch_for_their_addresses_only() -> None:
    peers = PeerDirectory({PeerRole.DECODE: ["10.0.0.1:50053"], PeerRole.ENCODER: ["10.0.0.3:50051"]}, None)
    try:
        await peers.require(PeerRole.DECODE, "10.0.0.1:50053")
        await peers.require(PeerRole.ENCODER, "10.0.0.3:50051")
        with pytest.raises(UnknownPeerError, match="unknown decode peer '10.0.0.3:50051'.*EPD_DECODE_ADDRS"):
            await peers.require(PeerRole.DECODE, "10.0.0.3:50051")   # an encoder is no decode worker
        with pytest.raises(UnknownPeerError, match="not dialled"):
            await peers.require(PeerRole.ENCODER, "127.0.0.1:1")
    finally:
        await peers.close()


async def test_without_discovery_every_named_peer_is_refused() -> None:
    peers = PeerDirectory({}, None)
    assert not peers.configured
    with pytest.raises(UnknownPeerError, match="no peer discovery configured.*EPD_DECODE_ADDRS or EPD_REDIS_URL"):
        await peers.require(PeerRole.DECODE, "127.0.0.1:50053")
    await peers.close()


async def test_redis_registry_is_read_again_on_a_miss() -> None:
    port = 20000 + uuid.uuid4().int % 40000
    early, late = f"198.51.100.7:{port}", f"198.51.100.8:{port}"
    first = WorkerRegistration(REDIS_URL, "decode", early, heartbeat_s=5)
    second = WorkerRegistration(REDIS_URL, "decode", late, heartbeat_s=5)
    peers = PeerDirectory({}, REDIS_URL, ttl_s=60.0)      # a long cache: only the miss can refresh it
    try:
        await first._beat_once()                                # one heartbeat: registered
        await peers.require(PeerRole.DECODE, early)
        with pytest.raises(UnknownPeerError, match="Redis registry"):
            await peers.require(PeerRole.DECODE, late)
        with pytest.raises(UnknownPeerError):
            await peers.require(PeerRole.ENCODER, early)       # registered as decode, not as encoder
        await second._beat_once()
        await peers.require(PeerRole.DECODE, late)             # registered a moment ago: found
    finally:
        await first.stop()
        await second.stop()
        await peers.close()
