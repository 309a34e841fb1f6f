"""The kernel every ``nn.Linear`` of a loaded model runs, chosen once at start-up.

On the CPU, transformers' layers call ``F.linear``, which is MKL's sgemm on the weight as
stored. oneDNN's matmul on a weight reordered once into its own blocked layout is about twice
as fast at decode batch sizes on x86 (``bench.decode_throughput``: the bench model's step at
batch 16), and this is what vLLM's CPU backend does too. ``install`` reorders every linear
layer's weight once (a second copy beside the parameter, which stays what ``state_dict`` and
tied embeddings see) and switches the module's class to ``OneDNNLinear``. The layout is the one
oneDNN picks for ``REORDER_ROWS`` input rows (``_reorder_linear_weight``), not its default
blocked one (``to_mkldnn``): at decode batches of 8 to 64 the step is 1.1-1.5x faster (the bench
model at batch 16 on a 2-core AVX2 host: 53-63 ms against 81-90 ms), at batch 1 the same.
Only weights of at least ``MIN_ELEMENTS`` are switched: oneDNN's call costs about 10 us
more than ``F.linear``'s, which a small layer never wins back (the 0.6M-parameter demo model
keeps ``F.linear`` throughout; a 512 x 512 weight at 16 rows is 1.5x faster on oneDNN, at one
row 1.6x slower; 1024 x 2816 wins at every batch with two threads). The choice is per layer
and fixed, never per call, so a sequence runs the same kernel whatever it is batched with
(the kernel may still round a row differently at another row count, as ``F.linear`` does; the
greedy-identity tests run the split at several chunk sizes against ``generate()``).

Kernels (``KERNELS``): ``onednn`` (CPU, float32 or bfloat16 weights, a torch built with
oneDNN) and ``torch`` (``F.linear``: every other device, or asked for). ``auto`` picks
``onednn`` where it applies. Every forward of the model (the paged split and ``generate()``
alike) runs the chosen kernel, so greedy identity with ``generate()`` of the same loaded model
holds whichever is chosen. Weights are immutable once installed: a load-time step, never
undone (training or a weight update would need a fresh load).
"""

from __future__ import annotations

import torch
from torch import nn

ONEDNN = "onednn"
TORCH = "torch"
KERNELS = (ONEDNN, TORCH)
_DTYPES = (torch.float32, torch.bfloat16)
MIN_ELEMENTS = 1 << 18   # 512 x 512
REORDER_ROWS = 64        # the input rows the weight layout is chosen for (any row count runs on it)


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def select_kernel(device: torch.device, asked: str = "auto") -> str:
    """The kernel for ``device``: ``asked`` when it applies there (``ValueError`` otherwise)."""
    if asked not in ("auto", *KERNELS):
        raise ValueError(f"linear kernel {asked!r}: expected auto or one of {', '.join(KERNELS)}")
    usable = device.type == "cpu" and onednn_available()
    if asked == ONEDNN and not usable:
        raise ValueError(f"linear kernel onednn needs the CPU and a torch built with oneDNN (device {device})")
    if asked == "auto":
        return ONEDNN if usable else TORCH
    return asked


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs oneDNN on ``packed_weight`` (the weight reordered at install)."""

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or x.requires_grad:
            return nn.functional.linear(x, self.weight, self.bias)   # another dtype, autograd: the stock path
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def install(model: nn.Module, kernel: str, min_elements: int = MIN_ELEMENTS) -> int:
    """Switch every ``nn.Linear`` of ``model`` with a CPU weight of ``min_elements`` or more, float32 or
    bfloat16, to ``kernel``; the number switched."""
    if kernel != ONEDNN:
        return 0
    switched = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.dtype not in _DTYPES or module.weight.device.type != "cpu":
            continue
        if module.weight.numel() < min_elements:
            continue
        with torch.no_grad():
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), REORDER_ROWS)
        module.requires_grad_(False)   # inference only: the packed copy would not follow an update
        module.__class__ = OneDNNLinear
        switched += 1
    return switched
