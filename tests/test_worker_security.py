"""Workers are not an open door: real worker processes behind EPD_INTERNAL_TOKEN.

One token-protected cluster (encoder, decode, prefill on loopback):
- every RPC without the token, or with a wrong one, is UNAUTHENTICATED and does nothing;
  the standard health service (probes, ``epd healthcheck``) stays open;
- a bulk KV stream with a wrong token is closed with nothing written, and its chunk
  never counts; the same chunk with the right token lands;
- the gateway with the right token serves image requests colocated and disaggregated,
  the real HTTP gateway included; without it nothing is served;
- a request naming a decode worker, bulk address or encoder that discovery does not list
  is refused and the address is never dialled (a plain TCP listener sees no connection);
- a worker bound to 0.0.0.0 without a token refuses to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import struct
import subprocess
import sys
import time
import uuid

import grpc
import httpx
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import SecretStr

from cluster import DEMO_MODEL, ROOT, Cluster, free_port, worker_env
from gateway.orchestrator import Orchestrator
from gateway.settings import GatewaySettings
from prefill_svc.kv_sender import KVSender, TransferBroken
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.worker.faults import FaultInjector
from runtime.worker.internal_auth import bulk_preamble, open_channel
from runtime.model.model_adapter import VLMAdapter
from runtime.model.tensor_bytes import dtype_name
from runtime.worker.wire import payload_checksum
from test_faults import make_job, processor, run_job  # noqa: F401  (processor is a fixture)
from test_gateway_e2e import image_part

pytestmark = pytest.mark.timeout(300)

TOKEN = secrets.token_hex(16)
WRONG = secrets.token_hex(16)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("secured"), token=TOKEN)
    try:
        c.start("encoder")
        c.start("decode")        # told about the encoder
        c.start("prefill")       # told about the encoder and the decode worker, nothing else
        adapter = VLMAdapter.load(DEMO_MODEL)    # the KV layout and fingerprint, while the workers start
        c.wait_healthy()
        yield c, adapter
    finally:
        c.stop()


def addr(stack, role: str) -> str:
    return stack[0].by_role(role)[0].address


@contextlib.contextmanager
def listener():
    """A plain TCP port nobody should ever connect to; ``dialled()`` says whether anyone did."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)

    def dialled() -> bool:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return False
        conn.close()
        return True

    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", dialled
    finally:
        sock.close()


async def decode_stats(stack) -> pb.WorkerStats:
    async with open_channel(addr(stack, "decode"), TOKEN) as ch:
        return await pb_grpc.DecodeStub(ch).Stats(pb.StatsRequest(), timeout=5)


@pytest.fixture(autouse=True)
async def decode_holds_nothing_after(stack):
    yield
    end = time.monotonic() + 5.0
    while True:
        s = await decode_stats(stack)
        if (s.reservations_active, s.pending_chunks, s.running_seqs, s.free_blocks) == (0, 0, 0, s.total_blocks):
            return
        assert time.monotonic() < end, f"decode still holds state: {s}"
        await asyncio.sleep(0.05)


# -- the token ----------------------------------------------------------------------------------

def _reserve_request(adapter, tokens: int = 16, digest: str = "digest") -> pb.ReserveRequest:
    return pb.ReserveRequest(request_id=uuid.uuid4().hex, prompt_tokens=tokens, max_tokens=4,
                             deadline_unix_ms=int((time.time() + 3600) * 1000), token_digest=digest,
                             model_fingerprint=adapter.model_fingerprint)


async def test_every_rpc_without_the_right_token_is_unauthenticated(stack) -> None:
    _, adapter = stack
    for token in (None, WRONG):
        async with open_channel(addr(stack, "decode"), token) as ch:
            d = pb_grpc.DecodeStub(ch)
            calls = {
                "Reserve": d.Reserve(_reserve_request(adapter), timeout=5),   # once took every block
                "Release": d.Release(pb.ReleaseRequest(request_id="x"), timeout=5),
                "Rearm": d.Rearm(pb.RearmRequest(request_id="x"), timeout=5),
                "Stats": d.Stats(pb.StatsRequest(), timeout=5),
                "PushKV": d.PushKV(iter([pb.KVChunk(request_id="x")]), timeout=5),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == UNAUTHENTICATED, name
                assert "internal token" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in d.Generate(pb.GenerateRequest(request_id="x"), timeout=5):
                    pass
            assert err.value.code() == UNAUTHENTICATED
        async with open_channel(addr(stack, "encoder"), token) as ch:
            e = pb_grpc.EncoderStub(ch)
            for call in (e.Encode(pb.EncodeRequest(request_id="x"), timeout=5),
                         e.Cached(pb.CachedRequest(cache_keys=["k"]), timeout=5), e.Stats(pb.StatsRequest(), timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == UNAUTHENTICATED
        async with open_channel(addr(stack, "prefill"), token) as ch:
            p = pb_grpc.PrefillStub(ch)
            for call in (p.Prefill(pb.PrefillRequest(request_id="x"), timeout=5), p.Stats(pb.StatsRequest(), timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == UNAUTHENTICATED
    stats = await decode_stats(stack)            # with the right token: served, and nothing was reserved
    assert stats.reservations_active == 0 and stats.free_blocks == stats.total_blocks
    async with open_channel(addr(stack, "encoder"), TOKEN) as ch:
        assert list((await pb_grpc.EncoderStub(ch).Cached(pb.CachedRequest(cache_keys=["k"]), timeout=5)).cached) == [False]


async def test_health_needs_no_token(stack) -> None:
    from launcher.healthcheck import main as healthcheck

    for role in ("encoder", "prefill", "decode"):
        async with grpc.aio.insecure_channel(addr(stack, role)) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert await asyncio.to_thread(healthcheck, [f"grpc://{addr(stack, role)}"]) == 0


# -- the bulk KV path ---------------------------------------------------------------------------

def _one_chunk(adapter, reservation: pb.Reservation, tokens: int, digest: str) -> tuple[pb.KVChunk, bytes]:
    layout = adapter.kv_layout
    kv = torch.randn((layout.layers, 2, tokens, layout.kv_heads, layout.head_dim)).to(layout.dtype)
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = pb.KVChunk(request_id="by-hand", reservation=reservation, chunk_index=0, layer_start=0,
                        layer_end=layout.layers, token_start=0, token_end=tokens, dtype=dtype_name(layout.dtype),
                        shape=list(kv.shape), checksum=payload_checksum(payload), last=True, total_chunks=1,
                        first_token=1, token_digest=digest, model_fingerprint=adapter.model_fingerprint,
                        payload_bytes=len(payload))
    return header, payload


async def test_bulk_stream_with_a_wrong_token_writes_nothing_and_lands_nothing(stack) -> None:
    _, adapter = stack
    async with open_channel(addr(stack, "decode"), TOKEN) as ch:
        stub = pb_grpc.DecodeStub(ch)
        reply = await stub.Reserve(_reserve_request(adapter, 16, "d1"), timeout=5)
        reservation, bulk = reply.reservation, reply.bulk_address
        assert bulk, "decode offers the bulk path by default"
        header, payload = _one_chunk(adapter, reservation, 16, "d1")
        try:
            for preamble in (bulk_preamble(SecretStr(WRONG)), bulk_preamble(None), b""):
                host, port = bulk.rsplit(":", 1)
                reader, writer = await asyncio.open_connection(host, int(port))
                head = header.SerializeToString()
                writer.write(preamble + struct.pack("<I", len(head)) + head + payload + struct.pack("<I", 0))
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                try:
                    answer = await asyncio.wait_for(reader.read(), 5)
                except ConnectionResetError:
                    answer = b""
                writer.close()
                assert answer == b"", "a refused stream gets no reply at all"
            stats = await stub.Stats(pb.StatsRequest(), timeout=5)
            assert stats.pending_chunks == 0

            # the prefill worker's own sender: a wrong token breaks the transfer, the right one completes it
            wrong = KVSender(stub, 5, FaultInjector(""), bulk_address=bulk, bulk_token=SecretStr(WRONG))
            wrong.put(header, payload)
            wrong.finish()
            wrong.start()
            with pytest.raises(TransferBroken):
                await wrong.wait()
            right = KVSender(stub, 5, FaultInjector(""), bulk_address=bulk, bulk_token=SecretStr(TOKEN))
            right.put(header, payload)
            right.finish()
            right.start()
            ack = await right.wait()
            # the same chunk is new to decode: none of the refused streams' bytes ever counted
            assert (ack.state, ack.accepted, ack.duplicates, ack.rejected) == ("SUCCESS", 1, 0, 0)
        finally:
            await stub.Release(pb.ReleaseRequest(request_id="by-hand", reservation=reservation, reason="test"),
                               timeout=5)


# -- the gateway through the protected cluster --------------------------------------------------

def _gateway_settings(stack, placement: str, token: str | None) -> GatewaySettings:
    c, _ = stack
    addrs = {f"{r}_addrs": [w.address for w in c.by_role(r)] for r in ("encoder", "prefill", "decode")}
    return GatewaySettings(**addrs, placement=placement, prefill_chunk_tokens=8, internal_token=token)


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
async def test_the_gateway_with_the_token_serves_end_to_end(stack, processor, placement: str) -> None:
    orch = Orchestrator(_gateway_settings(stack, placement, TOKEN))
    await orch.start()
    try:
        assert orch.healthy()
        job, answer = make_job(processor, 7, 30.0)
        outcome, text, _ = await run_job(orch, processor, job)
        assert (outcome, text) == ("ok", answer)
    finally:
        await orch.close()


async def test_a_gateway_without_the_token_serves_nothing(stack, processor) -> None:
    orch = Orchestrator(_gateway_settings(stack, "disaggregated", None))
    await orch.start()
    try:
        assert not orch.healthy(), "every Stats poll is refused, so no worker counts as healthy"
        job, _ = make_job(processor, 8, 10.0)
        assert (await run_job(orch, processor, job))[0] == "refused"   # no healthy worker: 503 before any work
    finally:
        await orch.close()


def test_the_http_gateway_reads_the_token_from_its_environment(stack, tmp_path) -> None:
    c, _ = stack
    port = free_port()
    log = tmp_path / "gateway.log"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "gateway", "--model", str(DEMO_MODEL), "--port", str(port),
         "--encoder-addrs", addr(stack, "encoder"), "--prefill-addrs", addr(stack, "prefill"),
         "--decode-addrs", addr(stack, "decode"), "--placement", "disaggregated", "--prefill-chunk-tokens", "8"],
        cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=worker_env(TOKEN))
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            assert gateway.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.3)
        part, answer = image_part(404)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        reply = client.chat.completions.create(model="demo-vlm", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [part, {"type": "text", "text": "What is in the image?"}]}])
        assert reply.choices[0].message.content.strip() == answer
        assert TOKEN not in log.read_text()
    finally:
        gateway.terminate()
        gateway.wait(timeout=20)
    for w in c.workers:
        assert TOKEN not in w.log(), f"{w.role} logged the token"


# -- peers come from discovery, never from a request --------------------------------------------

def _prefill_request(decode_address: str, bulk_address: str = "", images=()) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=uuid.uuid4().hex, token_ids=[1, 2, 3], images=list(images),
                             decode_address=decode_address, decode_bulk_address=bulk_address,
                             reservation=pb.Reservation(reservation_id="r", generation=1))


def _image_ref(encoder_address: str) -> pb.ImageRef:
    return pb.ImageRef(cache_key=f"key-{uuid.uuid4().hex}", encoder_address=encoder_address)


async def _prefill(stack, request: pb.PrefillRequest) -> grpc.aio.AioRpcError:
    async with open_channel(addr(stack, "prefill"), TOKEN) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.PrefillStub(ch).Prefill(request, timeout=5)
    return err.value


async def test_prefill_refuses_an_undiscovered_decode_worker_and_never_dials_it(stack) -> None:
    with listener() as (stranger, dialled):
        err = await _prefill(stack, _prefill_request(stranger, stranger))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"unknown decode peer '{stranger}'" in err.details()
        await asyncio.sleep(0.2)
        assert not dialled()


async def test_prefill_dials_only_the_bulk_address_decode_reports_itself(stack) -> None:
    with listener() as (stranger, dialled):
        err = await _prefill(stack, _prefill_request(addr(stack, "decode"), stranger))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"bulk address '{stranger}' is not the one decode worker" in err.details()
        await asyncio.sleep(0.2)
        assert not dialled()


async def test_prefill_refuses_an_undiscovered_encoder_and_never_dials_it(stack) -> None:
    with listener() as (stranger, dialled):
        err = await _prefill(stack, _prefill_request(addr(stack, "decode"), images=[_image_ref(stranger)]))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"unknown encoder peer '{stranger}'" in err.details()
        await asyncio.sleep(0.2)
        assert not dialled()


async def test_colocated_decode_refuses_an_undiscovered_encoder_and_never_dials_it(stack) -> None:
    from runtime.worker.wire import token_digest

    _, adapter = stack
    with listener() as (stranger, dialled):
        ref = _image_ref(stranger)
        ids = [1, 2, 3, 4]
        async with open_channel(addr(stack, "decode"), TOKEN) as ch:
            stub = pb_grpc.DecodeStub(ch)
            res = (await stub.Reserve(_reserve_request(adapter, len(ids), token_digest(ids, [ref.cache_key])),
                                      timeout=5)).reservation
            try:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(pb.GenerateRequest(
                            request_id="x", reservation=res, max_tokens=2, colocated=True, token_ids=ids, images=[ref],
                            deadline_unix_ms=int((time.time() + 5) * 1000)), timeout=5):
                        pass
            finally:
                await stub.Release(pb.ReleaseRequest(request_id="x", reservation=res, reason="test"), timeout=5)
        assert f"unknown encoder peer '{stranger}'" in err.value.details()
        await asyncio.sleep(0.2)
        assert not dialled()


# -- secure by default ----------------------------------------------------------------------------

def test_a_worker_bound_beyond_loopback_without_a_token_refuses_to_start(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "decode", "--model", str(DEMO_MODEL), "--host", "0.0.0.0",
         "--port", str(free_port())], cwd=ROOT, env=worker_env(None), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to listen on 0.0.0.0 without an internal token" in lines[0]
    assert "EPD_INTERNAL_TOKEN" in lines[0] and "EPD_ALLOW_UNAUTHENTICATED" in lines[0]

