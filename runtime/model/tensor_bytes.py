"""Tensors as raw bytes plus dtype and shape: the one wire/storage format.

No pickle and no JSON of floats. ``encode`` returns a C-contiguous little-endian
byte view; ``decode`` rebuilds the tensor without an intermediate copy where the
buffer allows it (the result may share memory with ``payload``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class TensorBytes(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    payload: bytes


class TensorFormatError(ValueError):
    """Bytes, dtype and shape do not describe a tensor."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TensorFormatError(f"unsupported dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise TensorFormatError(f"unsupported dtype {name!r}") from None


def encode(tensor: torch.Tensor) -> TensorBytes:
    t = tensor.detach().to("cpu").contiguous()
    name = dtype_name(t.dtype)
    # view as bytes without a numpy round trip (bfloat16 has no numpy dtype)
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return TensorBytes(name, tuple(t.shape), raw)


def decode(dtype: str, shape: tuple[int, ...] | list[int], payload: bytes | bytearray | memoryview) -> torch.Tensor:
    torch_dtype = dtype_from_name(dtype)
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        if s < 0:
            raise TensorFormatError(f"negative dimension in shape {shape}")
        numel *= s
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    if len(payload) != numel * itemsize:
        raise TensorFormatError(
            f"payload of {len(payload)} bytes does not match {dtype}{list(shape)} ({numel * itemsize} bytes)"
        )
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    flat = torch.frombuffer(bytearray(payload) if isinstance(payload, bytes) else payload, dtype=torch.uint8)
    return flat.view(torch_dtype).reshape(shape)
