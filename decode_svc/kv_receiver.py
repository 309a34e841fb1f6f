"""Landing pushed KV chunks into reserved blocks, and deciding when a transfer is complete.

Outcome of one chunk (documented, tested):

=========================================  ===========  =========================
condition                                  chunk        attempt state
=========================================  ===========  =========================
unknown / released reservation             rejected     (none)
generation != current (stale sender)       rejected     unchanged, never written
attempt already SUCCESS, same index        duplicate    SUCCESS
attempt already FAILED                     rejected     FAILED
index already received                     duplicate    unchanged
checksum mismatch / bad shape or range     rejected     FAILED (retry or re-prefill)
valid                                      accepted     TRANSFERRING (or SUCCESS)
=========================================  ===========  =========================

A transfer is SUCCESS only when every chunk ``0..total-1`` is present, the chunks
cover prompt positions ``0..prompt_tokens`` exactly, and the final chunk's rope
delta (``runtime/worker/rope_delta.py``: absent is an error for M-RoPE models), token
digest and model fingerprint equal the reservation's. For a hybrid decoder the final chunk
also carries the linear-attention state parts, checked part by part against the
reservation's state slot (``runtime/worker/state_parts.py``) and landed in it before the
chunk counts; a mismatch rejects the chunk and fails the transfer. Out-of-order arrival is
fine. A chunk may leave out the older KV of sliding-window layers (``sliding_from``, never
past what decode needs: ``KVLayout.window_from`` of the reservation's prompt); its payload
is then ``KVLayout.wire_bytes`` long and lands layer by layer (``layer_from``), and the
reservation's blocks are never handed to the prefix cache. Payload bytes are copied once: from the message buffer into the pool (gRPC), or
from the socket straight into the pool (the bulk path uses ``admit`` / ``accept`` around
its own in-place receive). Each stream, on either path, keeps a ``StreamTally`` of
its chunks' outcomes and ends with its reply: the counts and the transfer state of
the last chunk's reservation (``PushKVResponse.state``, ``to_wire``).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from enum import Enum

import torch

from proto.epd.v1 import epd_pb2 as pb
from runtime.model.families import PositionKind
from runtime.model.kv_pool import KVBlockPool
from runtime.model.tensor_bytes import dtype_from_name, dtype_name
from runtime.model.state_slots import StateSlotPool
from runtime.worker import state_parts
from runtime.worker.rope_delta import RopeDeltaRule
from runtime.worker.transfer_state import TransferState, to_wire
from runtime.worker.wire import payload_checksum

from .reservations import Reservation, ReservationTable


class ChunkOutcome(Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    REJECTED = "rejected"


@dataclass(slots=True)
class ChunkResult:
    outcome: ChunkOutcome
    detail: str = ""


class KVReceiver:
    def __init__(self, table: ReservationTable, pool: KVBlockPool,
                 rope_delta: RopeDeltaRule = RopeDeltaRule(PositionKind.ONE_D), states: StateSlotPool | None = None):
        self.table = table
        self.pool = pool
        self.states = states         # hybrid decoders: where the final chunk's state parts land
        self.rope_delta = rope_delta   # what the final chunk's delta (or its absence) means for this model
        # chunks by outcome, over both paths (gRPC PushKV and bulk); exported as a counter
        self.outcomes: dict[str, int] = {o.value: 0 for o in ChunkOutcome}

    def count(self, result: ChunkResult) -> ChunkResult:
        """Record one finished chunk's outcome (each chunk exactly once, by its path's reader)."""
        self.outcomes[result.outcome.value] += 1
        return result

    def admit(self, chunk: pb.KVChunk, payload_bytes: int) -> tuple[Reservation | None, ChunkResult | None]:
        """Every check that needs only the header and the payload's size. ``(res, None)`` means
        the payload may land in ``res``'s blocks; otherwise the result says why not (and nothing
        is written)."""
        res = self.table.get(chunk.reservation.reservation_id)   # the table holds live reservations only
        if res is None:
            return None, ChunkResult(ChunkOutcome.REJECTED, "unknown or released reservation")
        attempt = res.attempt
        if chunk.reservation.generation != attempt.generation:
            return None, ChunkResult(ChunkOutcome.REJECTED,
                                     f"stale generation {chunk.reservation.generation} != {attempt.generation}")
        if attempt.state == TransferState.SUCCESS:
            return None, ChunkResult(ChunkOutcome.DUPLICATE, "transfer already complete")
        if attempt.state == TransferState.FAILED:
            return None, ChunkResult(ChunkOutcome.REJECTED, f"transfer failed: {attempt.detail}")
        if chunk.chunk_index in attempt.received or chunk.chunk_index in attempt.landing:
            return None, ChunkResult(ChunkOutcome.DUPLICATE, f"chunk {chunk.chunk_index} already landed")
        problem = self._validate_header(chunk, res.prompt_tokens)
        if not problem and payload_bytes != self.chunk_nbytes(chunk):
            problem = f"payload of {payload_bytes} bytes != {self.chunk_nbytes(chunk)} for the shape"
        if problem:
            return None, self.fail(res, problem)
        return res, None

    def land(self, chunk: pb.KVChunk, payload: bytes | memoryview | None = None) -> ChunkResult:
        """Land one whole chunk: over gRPC ``payload`` is the message's own field; the bulk path
        passes a staged buffer when the pool cannot be written in place (not on the CPU)."""
        if payload is None:
            # one read of the field: each read of a bytes field of a (upb) message is a fresh copy
            payload = chunk.payload
        res, refused = self.admit(chunk, len(payload))
        if refused is not None:
            return refused
        if payload_checksum(payload) != chunk.checksum:
            return self.fail(res, f"checksum mismatch on chunk {chunk.chunk_index}")
        with warnings.catch_warnings():  # read-only message buffer: we only copy out of it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(payload, dtype=torch.uint8)
        layer_from = self.layer_from(chunk)
        if layer_from is None:
            kv = flat.view(dtype_from_name(chunk.dtype)).view(tuple(chunk.shape))
            self.pool.write(res.blocks, chunk.token_start, kv, owner=res.attempt.owner,   # fenced by generation
                            rings=res.choice_rings(0))
        else:
            self.pool.write_wire(res.blocks, chunk.token_start, chunk.token_end, flat, layer_from, owner=res.attempt.owner,
                                 rings=res.choice_rings(0))
        return self.accept(res, chunk, len(payload))

    def payload_bound(self, chunk: pb.KVChunk) -> int:
        """The most payload bytes any chunk for ``chunk``'s reservation can carry: its prompt's
        KV when the reservation is known, else the whole pool. A larger declared size is never read."""
        res = self.table.get(chunk.reservation.reservation_id)
        tokens = res.prompt_tokens if res is not None else self.pool.num_blocks * self.pool.block_size
        return tokens * self.pool.layout.bytes_per_token

    @property
    def state_header_bytes(self) -> int:
        """What the final chunk's header may carry beyond a plain one: the state parts (0 without a state slot)."""
        return 0 if self.states is None else self.states.layout.slot_bytes() + 4096

    def chunk_nbytes(self, chunk: pb.KVChunk) -> int:
        return self.pool.layout.wire_bytes(chunk.token_start, chunk.token_end, chunk.sliding_from)

    def layer_from(self, chunk: pb.KVChunk) -> list[int] | None:
        """Per layer the first position the (admitted) chunk carries; ``None``: every layer, the whole span, as
        one dense tensor (layers of different sizes always travel in the per-layer form)."""
        if chunk.sliding_from <= chunk.token_start and self.pool.layout.uniform:
            return None
        return self.pool.layout.layer_from(chunk.token_start, chunk.token_end, chunk.sliding_from)

    def fail(self, res: Reservation, problem: str) -> ChunkResult:
        """The chunk is bad: the attempt fails (the gateway retries, re-prefills or gives up)."""
        res.attempt.set_state(TransferState.FAILED, problem)
        return ChunkResult(ChunkOutcome.REJECTED, problem)

    def accept(self, res: Reservation, chunk: pb.KVChunk, nbytes: int) -> ChunkResult:
        """The chunk's verified bytes are in ``res``'s blocks: record it, maybe complete the transfer."""
        attempt = res.attempt
        if chunk.last or chunk.state_parts:
            problem = ("state parts on a chunk that is not the last" if not chunk.last
                       else state_parts.land(self.states, res.state_slot, chunk.state_parts, res.prompt_tokens))
            if problem:
                return self.fail(res, problem)
            attempt.bytes_received += state_parts.wire_bytes(chunk.state_parts)
        now = time.monotonic()
        if attempt.first_chunk_at is None:
            attempt.first_chunk_at = now
            attempt.set_state(TransferState.TRANSFERRING)
        attempt.received[chunk.chunk_index] = (chunk.token_start, chunk.token_end)
        attempt.bytes_received += nbytes
        attempt.window_trimmed |= chunk.sliding_from > chunk.token_start
        if chunk.last:
            attempt.total_chunks = chunk.total_chunks
            attempt.first_token = chunk.first_token
            attempt.first_logprobs = chunk.first_logprobs if chunk.HasField("first_logprobs") else None
            attempt.choice_first_tokens = list(chunk.choice_first_tokens)
            attempt.choice_first_logprobs = list(chunk.choice_first_logprobs)
            attempt.token_digest = chunk.token_digest
            attempt.model_fingerprint = chunk.model_fingerprint
            attempt.rope_delta = self.rope_delta.read(chunk)
            attempt.prefill_ms = chunk.prefill_ms or None
        self._maybe_complete(res)
        return ChunkResult(ChunkOutcome.ACCEPTED)

    def _validate_header(self, chunk: pb.KVChunk, prompt_tokens: int) -> str:
        layout = self.pool.layout
        n = chunk.token_end - chunk.token_start
        if not (0 <= chunk.token_start < chunk.token_end <= prompt_tokens):
            return f"token range {chunk.token_start}..{chunk.token_end} outside prompt of {prompt_tokens}"
        if chunk.sliding_from > layout.window_from(prompt_tokens):
            return (f"sliding_from {chunk.sliding_from} leaves out KV decode needs (sliding layers from "
                    f"{layout.window_from(prompt_tokens)} of a {prompt_tokens}-token prompt)")
        first = min(chunk.token_end, max(chunk.token_start, chunk.sliding_from))
        if self.pool.groups.windowed and first < min(chunk.token_end, layout.window_from(prompt_tokens)):
            return (f"sliding layers from {first}: this worker keeps only the window (from "
                    f"{layout.window_from(prompt_tokens)} of a {prompt_tokens}-token prompt); send them trimmed")
        if (chunk.layer_start, chunk.layer_end) != (0, layout.layers):
            return f"layer range {chunk.layer_start}..{chunk.layer_end} != 0..{layout.layers}"
        if chunk.dtype != dtype_name(layout.dtype):
            return f"dtype {chunk.dtype} != cache dtype {dtype_name(layout.dtype)}"
        expected = [layout.layers, 2, n, layout.kv_heads, layout.head_dim]
        if list(chunk.shape) != expected:
            return f"shape {list(chunk.shape)} != {expected}"
        return ""

    def _maybe_complete(self, res) -> None:
        attempt = res.attempt
        if attempt.total_chunks is None or len(attempt.received) < attempt.total_chunks:
            return
        if set(attempt.received) != set(range(attempt.total_chunks)):
            attempt.set_state(TransferState.FAILED, "chunk indices do not match total_chunks")
            return
        covered = sorted(attempt.received.values())
        cursor = 0
        for start, end in covered:
            if start != cursor:
                attempt.set_state(TransferState.FAILED, f"token coverage gap or overlap at {cursor}")
                return
            cursor = end
        delta_problem = self.rope_delta.problem(res.rope_delta, attempt.rope_delta, "the prefill's final chunk")
        if cursor != res.prompt_tokens:
            attempt.set_state(TransferState.FAILED, f"chunks cover {cursor} of {res.prompt_tokens} tokens")
        elif delta_problem:
            attempt.set_state(TransferState.FAILED, delta_problem)
        elif attempt.token_digest != res.token_digest:
            attempt.set_state(TransferState.FAILED, "token digest mismatch between prefill and reservation")
        elif attempt.model_fingerprint != res.model_fingerprint:
            attempt.set_state(TransferState.FAILED, "model/cache fingerprint mismatch between prefill and decode")
        else:
            attempt.set_state(TransferState.SUCCESS)


class StreamTally:
    """One push stream's chunk outcomes (each also counted in ``KVReceiver.outcomes``) and its reply."""

    def __init__(self, receiver: KVReceiver):
        self._receiver = receiver
        self._counts = {o: 0 for o in ChunkOutcome}
        self._detail = ""              # the last rejection's reason
        self._reservation_id = ""      # the last chunk's: the reply reports its transfer state
        # that transfer's state as of the last chunk recorded: a transfer that succeeded may be inserted,
        # decoded to its end and released before the stream's end is read, and its reply must still say SUCCESS
        self._state: TransferState | None = None

    def saw(self, header: pb.KVChunk) -> None:
        self._reservation_id = header.reservation.reservation_id

    def record(self, result: ChunkResult) -> None:
        self._receiver.count(result)
        self._counts[result.outcome] += 1
        if result.outcome == ChunkOutcome.REJECTED:
            self._detail = result.detail
        res = self._receiver.table.get(self._reservation_id) if self._reservation_id else None
        self._state = None if res is None else res.attempt.state

    def reply(self) -> pb.PushKVResponse:
        res = self._receiver.table.get(self._reservation_id) if self._reservation_id else None
        state = self._state if res is None else res.attempt.state
        detail = self._detail
        if not detail and state is TransferState.FAILED:   # every chunk landed, the transfer's verification failed
            detail = res.attempt.detail
        return pb.PushKVResponse(accepted=self._counts[ChunkOutcome.ACCEPTED],
                                 duplicates=self._counts[ChunkOutcome.DUPLICATE],
                                 rejected=self._counts[ChunkOutcome.REJECTED], state=to_wire(state), detail=detail)
