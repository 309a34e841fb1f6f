"""The linear layers' kernel (``runtime/model/linear_kernels.py``): chosen once at start-up, run by every forward.

On this CPU ``auto`` picks oneDNN on reordered weights for layers large enough to win; the
shipped demo model has none, so here every layer is switched (``min_elements=0``) to put the
whole model on the oneDNN path. The split (chunked prefill into the pool, paged decode) must
still give exactly ``generate()``'s greedy tokens of the same loaded model, every layer's output
must be ``F.linear``'s within float rounding, and autograd falls back to the stock path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.model import linear_kernels
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter
from test_model_split import CASES, DEMO_MODEL, NEW_TOKENS, run_split

pytestmark = pytest.mark.skipif(not linear_kernels.onednn_available(), reason="this torch has no oneDNN")


@pytest.fixture(scope="module")
def switched() -> tuple[VLMAdapter, int]:
    adapter = VLMAdapter.load(DEMO_MODEL)
    return adapter, linear_kernels.install(adapter.model, linear_kernels.ONEDNN, min_elements=0)


def test_auto_picks_onednn_on_the_cpu_and_torch_elsewhere():
    assert linear_kernels.select_kernel(torch.device("cpu")) == linear_kernels.ONEDNN
    assert linear_kernels.select_kernel(torch.device("cpu"), "torch") == linear_kernels.TORCH
    assert linear_kernels.select_kernel(torch.device("cuda")) == linear_kernels.TORCH
    with pytest.raises(ValueError, match="needs the CPU"):
        linear_kernels.select_kernel(torch.device("cuda"), "onednn")
    with pytest.raises(ValueError, match="expected auto"):
        linear_kernels.select_kernel(torch.device("cpu"), "mkl")


def test_only_layers_large_enough_are_switched():
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(64, 64), nn.Linear(512, 512).to(torch.float16))
    assert linear_kernels.install(model, linear_kernels.ONEDNN) == 1
    assert [type(m) for m in model] == [linear_kernels.OneDNNLinear, nn.Linear, nn.Linear]
    assert linear_kernels.install(nn.Sequential(nn.Linear(512, 512)), linear_kernels.TORCH) == 0
    # the shipped demo model's layers are all small: auto leaves them on torch's kernel and says so
    assert VLMAdapter.load(DEMO_MODEL).linear_kernel == linear_kernels.TORCH


def test_every_layer_matches_f_linear_and_autograd_falls_back(switched):
    adapter, count = switched
    layers = [m for m in adapter.model.modules() if isinstance(m, nn.Linear)]
    assert count == len(layers) > 0 and all(type(m) is linear_kernels.OneDNNLinear for m in layers)
    gen = torch.Generator().manual_seed(0)
    for layer in layers:
        x = torch.randn(1, 5, layer.in_features, generator=gen)
        with torch.inference_mode():
            out = layer(x)
        torch.testing.assert_close(out, nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer = layers[0]
    x = torch.randn(3, layer.in_features, requires_grad=True)
    with torch.enable_grad():      # grad mode is per thread, and other tests turn it off in this one
        layer(x).sum().backward()  # the stock path: a gradient reaches the input
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, -1))


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_split_on_onednn_is_generate_exactly(switched, chunk):
    adapter, _ = switched
    pool = KVBlockPool(adapter.kv_layout, num_blocks=24, block_size=16)
    with torch.inference_mode():
        for case in CASES[:6]:
            text = adapter.processor.apply_chat_template(case.messages, add_generation_prompt=True)
            enc = adapter.processor(images=case.images or None, text=text, return_tensors="pt")
            ids = enc["input_ids"][0].tolist()
            ref = adapter.model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
            tokens = run_split(adapter, pool, ids, adapter.encode(case.images), chunk, NEW_TOKENS)
            assert tokens == ref[0, len(ids):].tolist(), case.name
