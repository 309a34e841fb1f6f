"""The decode workers a prefill worker pushes KV to: discovered ones only, bulk address from decode.

A ``PrefillRequest`` names the decode worker (``decode_address``) and, for the bulk
path, a TCP address (``decode_bulk_address``). Neither is trusted:

- the gRPC address must be a discovered decode worker (``runtime/worker/peers.py``);
- the bulk address dialled is the one that decode worker reports in its own ``Stats``
  (asked over the authenticated channel, cached per decode address). The request's value
  only says "use the bulk path" and must agree; on disagreement the decode worker is asked
  again once (it may have restarted on a new bulk port), then the request is refused. A
  decode worker that reports no bulk path (``--kv-transport grpc``, still starting it, or
  an older version during a rolling upgrade) gets the KV over ``PushKV`` on the same
  discovered channel instead.

So a prefill worker never opens a socket, or sends the bulk preamble, to an address
that only a request vouched for. Owns the decode channels; ``close()`` ends them.
"""

from __future__ import annotations

import grpc
from pydantic import SecretStr

from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
from runtime.worker.internal_auth import open_channel
from runtime.worker.peers import PeerDirectory, PeerRole, UnknownPeerError

from .kv_sender import TransferBroken

_NO_SAMPLES = 2**64 - 1     # StatsRequest.since_sample beyond any sample: the reply carries none


class DecodeLinks:
    def __init__(self, peers: PeerDirectory, token: SecretStr | None):
        self._peers = peers
        self._token = token
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._bulk: dict[str, str] = {}    # decode gRPC address -> bulk address it reported itself

    def _stub(self, address: str) -> pb_grpc.DecodeStub:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self._token)
        return pb_grpc.DecodeStub(self._channels[address])

    async def resolve(self, decode_address: str, requested_bulk: str, timeout_s: float) -> tuple[pb_grpc.DecodeStub, str]:
        """``(stub, bulk address or "")`` for a request. Raises ``UnknownPeerError`` for an address
        discovery does not vouch for, ``TransferBroken`` when decode cannot say its bulk address."""
        if not decode_address:
            raise UnknownPeerError("the request names no decode worker")
        await self._peers.require(PeerRole.DECODE, decode_address)
        stub = self._stub(decode_address)
        if not requested_bulk:
            return stub, ""
        if self._bulk.get(decode_address) != requested_bulk:
            self._bulk[decode_address] = await self._reported_bulk(stub, decode_address, timeout_s)
        bulk = self._bulk[decode_address]
        if not bulk:
            return stub, ""           # no bulk path there: PushKV to the discovered address
        if bulk != requested_bulk:
            raise UnknownPeerError(
                f"bulk address {requested_bulk!r} is not the one decode worker {decode_address} reports "
                f"({bulk or 'none'}); not dialled")
        return stub, bulk

    @staticmethod
    async def _reported_bulk(stub: pb_grpc.DecodeStub, address: str, timeout_s: float) -> str:
        try:
            stats = await stub.Stats(pb.StatsRequest(since_sample=_NO_SAMPLES), timeout=max(0.05, min(timeout_s, 5.0)))
        except grpc.aio.AioRpcError as exc:
            raise TransferBroken(f"decode worker {address} did not report its bulk address: "
                                 f"{exc.code().name}: {exc.details()}") from exc
        return stats.bulk_address

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
