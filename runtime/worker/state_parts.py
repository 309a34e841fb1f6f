"""Linear-attention state parts on the wire (``StatePart``), both ends.

The prefill worker sends its slot's state on the final chunk (``to_pb``); the
decode worker checks every part — layer, kind, dtype, shape (against its
reservation's ``StateLayout``), and each part's checksum — before a byte lands in
the reservation's state slot (``land``). Any mismatch is the chunk's rejection
and fails the transfer; nothing is written then.
"""

from __future__ import annotations

from collections.abc import Sequence

from proto.epd.v1 import epd_pb2 as pb
from runtime.model import tensor_bytes
from runtime.model.state_slots import StateKind, StateMismatch, StatePartData, StateSlotPool, check_part_specs
from runtime.model.tensor_bytes import TensorFormatError
from runtime.worker.wire import payload_checksum


def to_pb(parts: Sequence[StatePartData]) -> list[pb.StatePart]:
    out = []
    for p in parts:
        raw = tensor_bytes.encode(p.tensor)
        out.append(pb.StatePart(layer=p.layer, kind=int(p.kind), dtype=raw.dtype, shape=list(raw.shape),
                                data=raw.payload, checksum=payload_checksum(raw.payload)))
    return out


def wire_bytes(parts: Sequence[pb.StatePart]) -> int:
    return sum(len(p.data) for p in parts)


def land(states: StateSlotPool | None, slot: int | None, parts: Sequence[pb.StatePart], position: int) -> str:
    """Verify ``parts`` against the slot's layout and land them at ``position``; the problem, or ``""``."""
    if states is None or slot is None:
        return "state parts sent to a model without linear-attention state" if parts else ""
    try:
        specs = []
        for p in parts:
            specs.append((p.layer, p.kind, tensor_bytes.dtype_from_name(p.dtype), tuple(p.shape)))
        check_part_specs(states.layout, specs)
        data = []
        for p in parts:
            if payload_checksum(p.data) != p.checksum:
                return f"checksum mismatch on the {StateKind(p.kind).name} state of layer {p.layer}"
            data.append(StatePartData(p.layer, StateKind(p.kind), tensor_bytes.decode(p.dtype, p.shape, p.data)))
        states.load(slot, data, position)
    except (StateMismatch, TensorFormatError) as exc:
        return f"state part mismatch: {exc}"
    return ""
