"""LLaVA-OneVision, LLaVA-NeXT, Idefics3 and SmolVLM through the split (issue 18): token-identical to ``generate()``.

Each family's tiny random checkpoint (``epd demo-model --family llava_onevision|llava_next|
idefics3|smolvlm``) is built once per module and loaded with ``VLMAdapter.load``. An
image becomes a variable number of tokens: any-resolution tiles (base tile, unpadded
tile grid, one newline row per grid row; OneVision also down-samples grids above
``anyres_max_4``), or sub-images (Idefics3, SmolVLM), each its own run of
placeholders between ``<fake_token_around_image><row_R_col_C>`` tags. The cases
(``qwen_vl_cases.CASES``: one image, three of different sizes, multi-turn, system
prompt, text only) run as the workers run them: ``encode`` to the cache's tensors,
chunked prefill through a paged pool (chunk boundaries inside image spans), each
chunk landed in decode's blocks, greedy decode steps. The reference is the same
loaded model's ``generate()`` on the processor's output, the conversation's images
handed to it as one sample (``qwen_vl_cases.hf_images``, as ``apply_chat_template``
does): OneVision's multi-image form (one square tile per image) for several images,
so its encoder runs in the prompt's layout variant (``adapter.layout_variants``).

On the code before issue 18 every test here fails at load: the architectures were
refused ("multi-crop (anyres) image features", "multi-crop image splitting"), and the
OneVision and SmolVLM ``AutoProcessor`` need torchvision (they build a video processor).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from qwen_vl_cases import CASES, image_runs, prompts_for, run_split

from runtime.demo_model.idefics3 import SplitFamily, build_idefics3
from runtime.demo_model.llava_anyres import AnyResFamily, build_llava_anyres
from runtime.model import supported_models
from runtime.model.errors import ImagePlaceholderMismatch
from runtime.model.families import PositionKind, load_processor
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import KVChunk, VLMAdapter

BUILDERS = {**{f.value: build_llava_anyres for f in AnyResFamily}, **{f.value: build_idefics3 for f in SplitFamily}}
NAMES = {"llava_onevision": ("LLaVA-OneVision", "LlavaOnevisionProcessor"), "llava_next": ("LLaVA-NeXT", "LlavaNextProcessor"),
         "idefics3": ("Idefics3", "Idefics3Processor"), "smolvlm": ("SmolVLM", "SmolVLMProcessor")}
CHUNK_SIZES = (1, 5, 16, None)   # None: the whole prompt as one chunk


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    return BUILDERS[family](family, tmp_path_factory.mktemp("ckpt") / family)


@pytest.fixture(scope="module")
def adapter(checkpoint) -> VLMAdapter:
    return VLMAdapter.load(checkpoint)


@pytest.fixture(scope="module")
def prompts(adapter):
    return prompts_for(adapter)


def test_the_checkpoint_is_served_as_its_family(adapter, family, checkpoint):
    supported_models.check_checkpoint(checkpoint)
    assert adapter.family.name == NAMES[family][0]
    assert adapter.family.position_kind == PositionKind.ONE_D
    processor = load_processor(checkpoint)
    assert isinstance(processor, getattr(transformers, NAMES[family][1]))
    if family.startswith("llava"):
        assert adapter.model.config.image_grid_pinpoints, "an any-resolution checkpoint"
    else:
        assert processor.image_processor.do_image_splitting, "a checkpoint that splits images"


def test_placeholders_encoder_output_and_the_processor_rule_agree(adapter, prompts):
    """Per image: the processor's expansion (placeholders in the prompt), the family's rule and the
    encoder's rows are one number, and it varies with the image's size (tiles and newlines, or sub-images)."""
    counts = set()
    for case in CASES:
        p = prompts[case.name]
        rows = [e.shape[0] for e in p.embeddings]
        rule = [adapter.image_tokens(*im.size, v) for im, v in zip(case.images, adapter.layout_variants(len(case.images)))]
        assert rows == rule, case.name
        assert sum(rows) == p.ids.count(adapter.image_token_id), case.name
        counts.update(rows)
    assert len(counts) >= 3, f"images of different sizes should give different token counts: {counts}"
    if not adapter.family.name.startswith("LLaVA"):   # one run per sub-image, between row/column tags
        runs = image_runs(prompts["three-images"].ids, adapter.image_token_id)
        assert len(runs) > 3 and len({e - s for s, e in runs}) == 1


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES, ids=lambda c: f"chunk-{c or 'whole'}")
def test_split_is_token_identical_to_generate(adapter, prompts, chunk_size):
    pool = KVBlockPool(adapter.kv_layout, num_blocks=128, block_size=8)   # shared by every case
    got = {name: run_split(adapter, pool, p, chunk_size) for name, p in prompts.items()}
    assert got == {name: p.reference for name, p in prompts.items()}
    assert pool.free_blocks == pool.num_blocks
    if chunk_size in (5, 16):   # the boundaries really cut image spans
        ids = prompts["three-images"].ids
        runs = image_runs(ids, adapter.image_token_id)
        assert any(s < b < e for s, e in runs for b in range(chunk_size, len(ids), chunk_size))


def test_chunked_prefill_kv_equals_transformers_cache(adapter, prompts):
    p = prompts["three-images"]
    with torch.inference_mode():
        cache = adapter.model(**p.inputs, use_cache=True).past_key_values
    hf = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]).permute(0, 1, 3, 2, 4)
    chunked = torch.cat([e.kv for e in adapter.prefill(p.ids, p.embeddings, 7) if isinstance(e, KVChunk)], dim=2)
    torch.testing.assert_close(chunked, hf, rtol=1e-4, atol=1e-5)


def test_an_embedding_of_another_size_does_not_fit_the_prompt(adapter, prompts):
    """The placeholder rule is checked: an image's embedding from another image size is refused."""
    one, three = prompts["one-image"], prompts["three-images"]
    with pytest.raises(ImagePlaceholderMismatch):
        adapter.prepare(one.ids, [three.embeddings[0]])
