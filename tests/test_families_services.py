"""LLaVA-OneVision, LLaVA-NeXT, Idefics3, SmolVLM, Gemma 3 and Gemma 4 through the services (issue 18): real processes, real gRPC.

Per family (a module-scoped stack, torn down before the next family's): the tiny
random checkpoint (``epd demo-model --family``'s builder), one encoder, one decode
and one prefill worker (``epd <role> --model DIR``). Requests go through the
gateway's own ``PromptBuilder`` (the chat template, the processor's any-resolution
placeholder expansion) and ``Orchestrator`` in this process, over gRPC, both
placements, with chunk sizes that cut image spans and with the whole prompt. The
reference is ``generate()`` of the same checkpoint loaded here (greedy, cut at the
first EOS, which ends the services' stream) on the processor given the conversation's
images as one sample, as ``apply_chat_template`` does (OneVision: the multi-image form
for the three-image and the two-image multi-turn cases). After every test nothing is held
(``tests/leaks.py``).

On the code before issue 18 no worker starts: these architectures were refused at
start-up ("multi-crop (anyres) image features", "multi-crop image splitting").
"""

from __future__ import annotations

import pytest
from family_services import Stack, family_stack, orchestrator, run, run_choices
from leaks import LeakCheck
from qwen_vl_cases import image_runs

from runtime.demo_model.gemma3 import build_gemma3
from runtime.demo_model.gemma4 import build_gemma4
from runtime.demo_model.idefics3 import SplitFamily, build_idefics3
from runtime.demo_model.llava_anyres import AnyResFamily, build_llava_anyres

pytestmark = pytest.mark.timeout(300)

BUILDERS = {**{f.value: build_llava_anyres for f in AnyResFamily}, **{f.value: build_idefics3 for f in SplitFamily},
            "gemma3": build_gemma3, "gemma4": build_gemma4}


@pytest.fixture(scope="module", params=list(BUILDERS))
def stack(request, tmp_path_factory) -> Stack:
    with family_stack(tmp_path_factory.mktemp(f"family-services-{request.param}"), request.param,
                      BUILDERS[request.param]) as s:
        yield s


@pytest.fixture
async def leaks(stack):
    check = LeakCheck.of_cluster(stack.cluster).begin()
    yield check
    await check.settled()


@pytest.mark.parametrize("placement, chunk_tokens", [("disaggregated", 7), ("disaggregated", 4096),
                                                     ("colocated", 5), ("colocated", 4096)],
                         ids=["disagg-chunk-7", "disagg-whole", "coloc-chunk-5", "coloc-whole"])
async def test_output_is_token_identical_to_generate(stack, leaks, placement, chunk_tokens):
    async with orchestrator(stack, placement, chunk_tokens, leaks) as o:
        got = {name: await run(o, stack, r) for name, r in stack.requests.items()}
    assert got == {name: (r.expected, r.finish) for name, r in stack.requests.items()}
    if chunk_tokens < 4096:    # the plain boundaries really cut image spans
        three = stack.requests["three-images"].ids
        runs = image_runs(three, stack.adapter.image_token_id)
        assert any(s < b < e for s, e in runs for b in range(chunk_tokens, len(three), chunk_tokens))


async def test_sliding_models_keep_the_window_only(stack, leaks):
    """A sliding-window model's decode worker (Gemma 3, Gemma 4) keeps its sliding layers in rings (``EPD_SLIDING_WINDOW_KV`` on by default):
    it reports them, has no prefix cache, and a long prompt's reservation takes fewer blocks than dense."""
    if not stack.adapter.kv_layout.sliding_layers:
        pytest.skip("the sliding-window pool is for models with sliding layers (Gemma 3 and 4)")
    from runtime.policy.placement_policy import kv_blocks_needed

    stats = leaks._stats("decode", stack.worker("decode"))
    assert stats.ring_groups >= 1 and stats.ring_blocks >= 1 and not stats.prefix_cache
    prompt, new = 4000, 16
    dense_pages = -(-(prompt + new) // stats.block_size)
    windowed = kv_blocks_needed(prompt, new, 1, stats.block_size, stats.ring_groups, stats.ring_blocks)
    layout = stack.adapter.kv_layout
    full_layers = layout.layers - len(layout.sliding_layers)
    # bytes: a windowed page holds the full layers only; dense pages hold every layer
    assert windowed * full_layers < dense_pages * layout.layers / 2


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
async def test_sliding_models_choices_fork_their_rings(stack, leaks, placement):
    """n = 2 greedy on Gemma 3 and Gemma 4: each choice forks the prompt's KV, its own copy of the rings included
    (a ring is written by every step, so sharing one would mix the choices): two copies of generate()."""
    if not stack.adapter.kv_layout.sliding_layers:
        pytest.skip("the sliding-window pool is for models with sliding layers (Gemma 3 and 4)")
    async with orchestrator(stack, placement, 7, leaks) as o:
        for name in ("one-image", "three-images"):
            r = stack.requests[name]
            assert await run_choices(o, stack, r, 2) == [(r.expected, r.finish)] * 2, name
