"""Which decoder layers keep KV in the pool, with what shape, and which read another layer's.

``decoder_kv(text_config, kv_layers, dtype)`` reads the decoder config alone:

* ``kv_layers``: the family's layers whose attention reads the paged pool (all of them, or a
  hybrid decoder's attention layers); a layer whose config says it **reuses** another's KV
  (Gemma 4's ``kv_sharing_modes``: the last ``num_kv_shared_layers`` layers take the K/V of the
  last earlier layer of the same type, its "store" layer) keeps none of its own: it reads its
  producer's pool layer and writes nothing (``KVPlan.reused``);
* per pool layer its ``(kv_heads, head_dim)`` (Gemma 4's ``per_layer_config``: global layers
  with ``global_head_dim`` and ``num_global_key_value_heads``), else the config's one shape;
* the sliding-window layers, as pool layer indices (``layer_types``, ``sliding_window``).

Invariant: ``pool_layer_of`` maps every layer in ``kv_layers`` to a pool layer, reused layers to
their producer's, and the layout has exactly one layer per producer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.model.kv_layout import KVLayout


@dataclass(frozen=True, slots=True)
class KVPlan:
    layout: KVLayout
    pool_layer_of: dict[int, int]   # decoder layer -> pool layer (a reused layer: its producer's)
    reused: frozenset[int]          # decoder layers that read another layer's KV and write none


def sliding_layout(text_config, layers: list[int] | None = None) -> dict:
    """``KVLayout``'s sliding-window fields (empty without sliding layers); ``layers``: the decoder
    layers the pool holds, in pool order (default: all), so indices are pool layers."""
    types = list(getattr(text_config, "layer_types", None) or [])
    layers = list(range(len(types))) if layers is None else layers
    sliding = tuple(i for i, layer in enumerate(layers) if layer < len(types) and types[layer] == "sliding_attention")
    window = getattr(text_config, "sliding_window", None)
    if not sliding or window is None:
        return {}
    return {"sliding_layers": sliding, "sliding_window": int(window)}


def kv_producers(text_config, kv_layers: list[int]) -> dict[int, int]:
    """Reusing decoder layer (of ``kv_layers``) -> the decoder layer whose KV it reads: the last earlier
    "store" layer of its type (``Gemma4TextConfig.kv_sharing_modes``); empty when nothing is shared."""
    modes = list(getattr(text_config, "kv_sharing_modes", None) or [])
    if "reuse" not in modes:
        return {}
    types = list(text_config.layer_types)
    store = {types[l]: l for l, mode in enumerate(modes) if mode == "store"}
    return {l: store[types[l]] for l in kv_layers if l < len(modes) and modes[l] == "reuse"}


def _attr(cfg, name: str):
    try:
        return getattr(cfg, name, None)
    except AttributeError:   # transformers' per-layer configs raise for an attribute neither level has
        return None


def _shape(text_config, layer: int) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of decoder layer ``layer``: its per-layer config's where one says, else the config's."""
    per_layer = _attr(text_config, "per_layer_config")
    cfgs = ([per_layer[layer]] if per_layer else []) + [text_config]
    heads = next((int(v) for c in cfgs if (v := _attr(c, "num_key_value_heads"))), None)
    dim = next((int(v) for c in cfgs if (v := _attr(c, "head_dim"))), None)
    return (heads or int(text_config.num_attention_heads),
            dim or int(text_config.hidden_size // text_config.num_attention_heads))


def decoder_kv(text_config, kv_layers: list[int], dtype: torch.dtype) -> KVPlan:
    producers = kv_producers(text_config, kv_layers)
    own = [l for l in kv_layers if l not in producers]
    pool_layer_of = {l: i for i, l in enumerate(own)}
    pool_layer_of.update({l: pool_layer_of[p] for l, p in producers.items()})
    shapes = tuple(_shape(text_config, l) for l in own)
    base = _shape(text_config, own[0]) if own else (1, 1)
    layout = KVLayout(len(own), base[0], base[1], dtype, **sliding_layout(text_config, own),
                      layer_shapes=() if all(s == base for s in shapes) else shapes)
    return KVPlan(layout, pool_layer_of, frozenset(producers))
