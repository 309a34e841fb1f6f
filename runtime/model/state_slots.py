"""Per-sequence fixed-size state of linear-attention layers, in slots beside the KV blocks.

A hybrid decoder (Qwen3.5: Gated DeltaNet layers between full-attention layers)
keeps, for every linear-attention layer, a recurrent state ``[v_heads, k_dim,
v_dim]`` (float32, as the model's own kernels return it) and a convolution state
``[conv_dim, kernel]`` (the last ``kernel`` inputs of the layer's short causal
convolution, in the model's dtype). Neither grows with the sequence, so a
sequence holds one **state slot** for its whole life, beside its KV blocks (which
only the full-attention layers use).

Lifecycle of a slot (one owner: whoever allocated it — the decode worker's
``ReservationTable``, the prefill worker's job, a private prefill)::

    allocate ──> HELD (position 0: no state yet) ──forward of tokens p..q──> HELD (position q)
             ──free──> FREE   (exactly once: a second free raises)

Invariant: a slot's ``position`` is how many leading tokens of its sequence the
state covers. A forward whose new tokens start at ``start > 0`` needs ``position ==
start`` (``StateMismatch`` otherwise: the state would be some other prefix's), so a
state is never applied at a position it was not computed for; one starting at 0
reads no state (it overwrites whatever the slot held). ``load`` (a handoff's
landed state) sets the position it was sent for.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class StateMismatch(RuntimeError):
    """A state slot does not hold the state of the positions a forward or a handoff expects."""


class StateKind(enum.IntEnum):
    """A state part's kind (its wire value: ``StatePart.kind``)."""

    RECURRENT = 1   # [v_heads, k_dim, v_dim]
    CONV = 2        # [conv_dim, kernel]


@dataclass(frozen=True, slots=True)
class StateLayout:
    """What one slot holds: ``layers`` (the decoder's layer indices with linear attention) and each kind's shape."""

    layers: tuple[int, ...]
    recurrent_shape: tuple[int, int, int]
    conv_shape: tuple[int, int]
    recurrent_dtype: torch.dtype
    conv_dtype: torch.dtype

    def shape(self, kind: StateKind) -> tuple[int, ...]:
        return self.recurrent_shape if kind == StateKind.RECURRENT else self.conv_shape

    def dtype(self, kind: StateKind) -> torch.dtype:
        return self.recurrent_dtype if kind == StateKind.RECURRENT else self.conv_dtype

    def slot_bytes(self) -> int:
        per_layer = sum(_numel(self.shape(k)) * torch.empty(0, dtype=self.dtype(k)).element_size() for k in StateKind)
        return per_layer * len(self.layers)

    def describe(self) -> str:
        return (f"state layers={list(self.layers)} recurrent={list(self.recurrent_shape)}:{self.recurrent_dtype} "
                f"conv={list(self.conv_shape)}:{self.conv_dtype}")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True, slots=True)
class StatePartData:
    """One layer's state of one kind, as it travels: ``tensor`` has ``layout.shape(kind)`` and its dtype."""

    layer: int
    kind: StateKind
    tensor: torch.Tensor


class StateSlotPool:
    """``num_slots`` slots of ``layout``, allocated once; ``allocate`` returns ``None`` when none is free."""

    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device | str = "cpu"):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        n = len(layout.layers)
        self.recurrent = torch.zeros((num_slots, n, *layout.recurrent_shape), dtype=layout.recurrent_dtype, device=device)
        self.conv = torch.zeros((num_slots, n, *layout.conv_shape), dtype=layout.conv_dtype, device=device)
        self._index = {layer: i for i, layer in enumerate(layout.layers)}
        self._free = list(range(num_slots - 1, -1, -1))
        self._position: dict[int, int] = {}     # held slot -> tokens its state covers

    # -- ownership ----------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A zeroed slot at position 0, or ``None`` when every slot is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.recurrent[slot].zero_()
        self.conv[slot].zero_()
        self._position[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._position:
            raise ValueError(f"state slot {slot} is not held (double free?)")
        del self._position[slot]
        self._free.append(slot)

    def held(self, slot: int) -> bool:
        return slot in self._position

    # -- positions ----------------------------------------------------------------
    def position(self, slot: int) -> int:
        if slot not in self._position:
            raise StateMismatch(f"state slot {slot} is not held")
        return self._position[slot]

    def expect(self, slot: int, start: int) -> None:
        """``StateMismatch`` unless the slot's state covers exactly the ``start`` tokens before a forward."""
        held = self.position(slot)
        if start and held != start:
            raise StateMismatch(f"state slot {slot} holds the state after {held} tokens, not {start}")

    def advance(self, slot: int, end: int) -> None:
        self._position[slot] = end

    def reset(self, slot: int) -> None:
        """Back to position 0, zeroed (a new transfer attempt into the same slot)."""
        self.position(slot)
        self.recurrent[slot].zero_()
        self.conv[slot].zero_()
        self._position[slot] = 0

    # -- per-layer views (the forward's hook) --------------------------------------
    def index(self, layer: int) -> int:
        return self._index[layer]

    # -- handoff --------------------------------------------------------------------
    def read(self, slot: int) -> list[StatePartData]:
        """The slot's state, one part per layer and kind (copies, on the host)."""
        self.position(slot)
        parts = []
        for i, layer in enumerate(self.layout.layers):
            parts.append(StatePartData(layer, StateKind.RECURRENT, self.recurrent[slot, i].detach().cpu().clone()))
            parts.append(StatePartData(layer, StateKind.CONV, self.conv[slot, i].detach().cpu().clone()))
        return parts

    def check_parts(self, parts: Sequence[StatePartData]) -> None:
        """``StateMismatch`` unless ``parts`` are exactly one of each kind per layer, each with its shape and dtype."""
        check_part_specs(self.layout, [(p.layer, p.kind, p.tensor.dtype, tuple(p.tensor.shape)) for p in parts])

    def load(self, slot: int, parts: Sequence[StatePartData], position: int) -> None:
        """Land a handoff's state in ``slot`` (checked first: nothing is written on a mismatch)."""
        self.position(slot)
        self.check_parts(parts)
        for p in parts:
            target = self.recurrent if p.kind == StateKind.RECURRENT else self.conv
            target[slot, self._index[p.layer]].copy_(p.tensor)
        self._position[slot] = position


def check_part_specs(layout: StateLayout, specs: Sequence[tuple[int, StateKind, torch.dtype, tuple[int, ...]]]) -> None:
    """The verification every receiver runs: each (layer, kind) once, each of the layout's shape and dtype."""
    seen = set()
    for layer, kind, dtype, shape in specs:
        if layer not in layout.layers:
            raise StateMismatch(f"state part for layer {layer}, which has no linear-attention state "
                                f"(state layers {list(layout.layers)})")
        try:
            kind = StateKind(kind)
        except ValueError:
            raise StateMismatch(f"state part of unknown kind {kind} for layer {layer}") from None
        if (layer, kind) in seen:
            raise StateMismatch(f"duplicate {kind.name} state part for layer {layer}")
        seen.add((layer, kind))
        if dtype != layout.dtype(kind):
            raise StateMismatch(f"{kind.name} state of layer {layer} is {dtype}, the reservation's is {layout.dtype(kind)}")
        if tuple(shape) != layout.shape(kind):
            raise StateMismatch(f"{kind.name} state of layer {layer} has shape {list(shape)}, the reservation's is "
                                f"{list(layout.shape(kind))}")
    missing = [(layer, k.name) for layer in layout.layers for k in StateKind if (layer, k) not in seen]
    if missing:
        raise StateMismatch(f"state parts missing: {missing}")
