"""Linear-attention layers (Gated DeltaNet) inside a packed paged forward, state in slots.

The model's own layer runs unchanged: its projections, convolution and gated
delta rule are the model's code. What is ours is the cache object it is handed.
``install(decoder)`` wraps each linear-attention module's ``forward``: a call
without a ``LinearBatch`` (``generate()``, training) falls through unchanged; a
paged forward (``epd_linear=LinearBatch``) splits the packed row per sequence and
calls the layer's forward with a ``SlotState`` — a cache-like view of that
sequence's state slot that implements the few ``Cache`` methods the layer calls
(``get_conv_state``, ``get_recurrent_state``, ``update_conv_state``,
``update_recurrent_state``, ``is_recording_past``) with the same semantics as
transformers' ``LinearAttentionLayer``:

* a prompt chunk starting at position 0 has no previous state (the layer pads
  its convolution input itself, as in one-pass prefill); a later chunk continues
  from the slot's conv and recurrent state (chunked prefill carries them);
* the decodes of a step run as one batch ``[B, 1, hidden]``: their slots'
  states are gathered, updated by the layer's single-token path, and written
  back to each sequence's slot in place.

Full-attention layers in the same forward still go through ``paged_attention``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.model.state_slots import StateSlotPool


@dataclass(frozen=True, slots=True)
class LinearItem:
    q_offset: int     # first new token in the packed row
    q_len: int
    slot: int         # the sequence's state slot
    start: int        # sequence position of its first new token (0: no previous state)


@dataclass(slots=True)
class LinearBatch:
    states: StateSlotPool
    items: list[LinearItem]


class SlotState:
    """One or more sequences' state of one layer, as the layer's ``cache_params`` (batch order = ``slots``)."""

    def __init__(self, states: StateSlotPool, layer: int, slots: Sequence[int], has_previous: bool):
        self._states, self._slots, self._has_previous = states, list(slots), has_previous
        self._i = states.index(layer)
        index = torch.as_tensor(self._slots, device=states.conv.device)
        self._index = index
        self.conv = states.conv[index, self._i].clone()            # [B, conv_dim, K]
        self.recurrent = states.recurrent[index, self._i].clone()  # [B, H, Dk, Dv]

    # -- the Cache methods the layer calls -------------------------------------------
    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv if self._has_previous else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent if self._has_previous else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        kernel = self.conv.shape[-1]
        if not self._has_previous:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([self.conv, conv_states], dim=-1)
        self.conv.copy_(full[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.recurrent.copy_(recurrent_states)
        return self.recurrent

    def write_back(self) -> None:
        """The updated states into their slots (the conv state of a decode was updated in place above)."""
        self._states.conv[self._index, self._i] = self.conv
        self._states.recurrent[self._index, self._i] = self.recurrent


def _paged_linear_forward(module, original, hidden_states: torch.Tensor, batch: LinearBatch, kwargs) -> torch.Tensor:
    kwargs.pop("cache_params", None)
    kwargs.pop("attention_mask", None)
    layer = module.layer_idx
    out = torch.empty_like(hidden_states)
    decodes = [it for it in batch.items if it.q_len == 1 and it.start > 0]
    if decodes:
        rows = torch.as_tensor([it.q_offset for it in decodes], device=hidden_states.device)
        state = SlotState(batch.states, layer, [it.slot for it in decodes], has_previous=True)
        y = original(hidden_states[0, rows][:, None], cache_params=state, attention_mask=None, **kwargs)
        state.write_back()
        out[0, rows] = y[:, 0]
    for it in batch.items:
        if it.q_len == 1 and it.start > 0:
            continue
        state = SlotState(batch.states, layer, [it.slot], has_previous=it.start > 0)
        rows = slice(it.q_offset, it.q_offset + it.q_len)
        out[:, rows] = original(hidden_states[:, rows], cache_params=state, attention_mask=None, **kwargs)
        state.write_back()
    return out


def install(layers: Sequence[torch.nn.Module]) -> list[int]:
    """Wrap every decoder layer's ``linear_attn`` (idempotent); returns their layer indices."""
    found = []
    for i, layer in enumerate(layers):
        module = getattr(layer, "linear_attn", None)
        if module is None:
            continue
        found.append(i)
        if getattr(module, "_epd_linear_installed", False):
            continue
        original = module.forward

        def forward(hidden_states, cache_params=None, attention_mask=None, *, _m=module, _orig=original, **kwargs):
            batch = kwargs.pop("epd_linear", None)
            kwargs.pop("epd_batch", None)
            if batch is None:
                return _orig(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
            return _paged_linear_forward(_m, _orig, hidden_states, batch, kwargs)

        module.forward = forward
        module._epd_linear_installed = True
    return found
