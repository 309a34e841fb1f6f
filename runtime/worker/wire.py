"""Conversions between protobuf messages and runtime objects (tensors, sampling, digests)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import blake3
import torch
import xxhash

from proto.epd.v1 import epd_pb2 as pb

from runtime.model import tensor_bytes
from runtime.model.sampling import SampledToken, SamplingParams, TokenLogprob

# Explicit on both ends (the gRPC default of 4 MiB is too small for KV chunks).
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # a worker restarted on the same address is reconnected to within about a second
    # (gRPC's default reconnect backoff grows to 120 s while it is down)
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A worker's server owns its port: gRPC's default SO_REUSEPORT would let a second server bind a port
# another already listens on, and the kernel would then split new connections between the two
# (a decode worker's RPCs reaching an encoder half the time). Without it, that bind fails loudly.
#
# A gateway's GenerateMany stream stays open while no request is on it, and its channel pings every
# keepalive_time_ms; gRPC's server default accepts one ping per 5 minutes without data and answers
# more with GOAWAY "too_many_pings", which would fail every request on the stream. So a worker
# accepts them at half the keepalive interval.
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0), ("grpc.http2.min_ping_interval_without_data_ms", 5_000)]


def tensor_to_pb(t: torch.Tensor) -> pb.Tensor:
    enc = tensor_bytes.encode(t)
    return pb.Tensor(dtype=enc.dtype, shape=list(enc.shape), data=enc.payload)


def tensor_from_pb(msg: pb.Tensor) -> torch.Tensor:
    return tensor_bytes.decode(msg.dtype, tuple(msg.shape), msg.data)


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    """Lossless: the floats are doubles on the wire, the seed an int64 (``SamplingParams``'s ranges)."""
    msg = pb.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        min_tokens=s.min_tokens, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        grammar=s.grammar or "", n=s.n if s.n > 1 else 0,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.repetition_penalty != 1.0:
        msg.repetition_penalty = s.repetition_penalty
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """``sampling_from_pb(sampling_to_pb(p)) == p`` for every valid ``p``; an unset top_p (0) means 1,
    an unset repetition_penalty 1. Out-of-range values raise ``ValueError`` (``SamplingParams``)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        top_k=msg.top_k,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        grammar=msg.grammar or None,
        n=msg.n or 1,
    )


def logprobs_to_pb(s: SampledToken) -> pb.TokenLogprobs | None:
    """A sampled token's logprobs (``None`` when the request asked for none)."""
    if s.logprob is None:
        return None
    return pb.TokenLogprobs(logprob=s.logprob, top_ids=[e.token_id for e in s.top],
                            top_logprobs=[e.logprob for e in s.top])


def sampled_from_pb(token_id: int, msg: pb.TokenLogprobs | None) -> SampledToken:
    """``token_id`` with the logprobs ``msg`` carries (none for ``None``)."""
    if msg is None:
        return SampledToken(token_id)
    if len(msg.top_ids) != len(msg.top_logprobs):
        raise ValueError(f"{len(msg.top_ids)} top ids for {len(msg.top_logprobs)} top logprobs")
    top = tuple(TokenLogprob(int(i), float(v)) for i, v in zip(msg.top_ids, msg.top_logprobs))
    return SampledToken(token_id, float(msg.logprob), top)


def token_digest(token_ids: Sequence[int], image_keys: Sequence[str],
                 grids: Sequence[Sequence[int] | None] = (), rope_delta: int | None = 0) -> str:
    """What prefill and decode must agree on before a sequence is inserted: the token ids, each
    image's key and (M-RoPE families) grid, and the sequence's rope delta.

    A 1-D family's prompt (no grids, delta 0) digests exactly as before grids existed, so
    peers that send only ids and keys still agree. ``grids`` is empty or one per image.
    """
    if grids and len(grids) != len(image_keys):
        raise ValueError(f"{len(grids)} grids for {len(image_keys)} images")
    h = blake3.blake3()
    h.update(array("q", token_ids).tobytes())   # int64s, native order: a torch int64 tensor's bytes, at a tenth of the cost
    for i, key in enumerate(image_keys):
        h.update(b"|" + key.encode())
        if grids and grids[i]:
            h.update(b"#" + ",".join(str(int(g)) for g in grids[i]).encode())
    if rope_delta:
        h.update(b"@" + str(int(rope_delta)).encode())
    return h.hexdigest()[:32]


def variant_problem(family, images: Sequence[pb.ImageRef]) -> str | None:
    """Why the refs' layout variants are not what ``family`` (a ``ModelFamily``) encodes the images of a
    prompt of ``len(images)`` images in (a client error: the embeddings would be another form), or ``None``."""
    expected = family.layout_variant(len(images))
    for i, ref in enumerate(images):
        if ref.layout_variant != expected:
            return (f"image {i} has layout variant {ref.layout_variant!r}; {family.name} encodes every image of a "
                    f"prompt of {len(images)} images as {expected!r}")
    return None


def ref_grids(images: Sequence[pb.ImageRef]) -> list[tuple[int, ...] | None]:
    """Each ref's ``grid_thw`` (``None`` where it has none: a 1-D family's image)."""
    return [tuple(int(g) for g in ref.grid_thw) or None for ref in images]


def payload_checksum(payload: bytes | memoryview) -> str:
    """A KV chunk's checksum: XXH3-128, hex. It guards against damaged or mixed-up bytes,
    not against an adversary, and runs at memory speed (about 4x blake3 on one core), so
    it can hash each piece of a bulk payload as it arrives without slowing the link."""
    return xxhash.xxh3_128_hexdigest(payload)


def payload_hasher() -> xxhash.xxh3_128:
    """For a payload that arrives in pieces: ``update`` each piece, then ``checksum_digest``."""
    return xxhash.xxh3_128()


def checksum_digest(hasher: xxhash.xxh3_128) -> str:
    return hasher.hexdigest()
