"""LLaVA-OneVision's multi-image form through the split and the gateway's prompt: token-identical to transformers.

The reference is transformers' own way of running a conversation: the processor's
``apply_chat_template(..., tokenize=True)`` with the images in the messages (it hands
the processor the conversation's images as one sample, ``batch_num_images`` = their
count), then ``generate()`` on exactly its output. With several images the OneVision
processor pads each to a square and keeps one tile (``num_image_tokens + 1``
placeholders each, whatever the size), and the model packs one tile plus a newline row;
with one image it tiles it (a count that varies with the size). The split must follow:
the gateway's expansion, each image's layout variant (``family.layout_variant``), the
encoder's rows, the cache key. The checkpoint is ``epd demo-model --family
llava_onevision``'s (tiny, random weights).

On the code before layout variants every test here fails: epd handed the processor a
flat image list (every image tiled: 256 placeholders for ``three-images`` where
transformers puts 3 x 17) and had no variant to encode in (no ``layout_variants``).
"""

from __future__ import annotations

import pytest
import torch
from family_services import openai_messages
from qwen_vl_cases import CASES, NEW_TOKENS, Case, Prompt, noise_image, run_split, user

from cache.keys import image_content_key
from gateway.openai_schema import ChatCompletionRequest
from gateway.prompt import PromptBuilder
from runtime.demo_model.llava_anyres import build_llava_anyres
from runtime.model.errors import InvalidImage
from runtime.model.families import SINGLE_LAYOUT
from runtime.model.families.llava_anyres import MULTI_IMAGE
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter
from runtime.worker.wire import variant_problem

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py

BY_NAME = {c.name: c for c in CASES}
X, Y = noise_image(60, 40, 21), noise_image(90, 50, 22)
ALONE = Case("x-alone", [user(None, "what is in the image ?")], [X])
PAIR = Case("x-and-y", [user(None, None, "compare the two images .")], [X, Y])
SERVED = [BY_NAME["one-image"], BY_NAME["three-images"], BY_NAME["multi-turn"], ALONE, PAIR]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_llava_anyres("llava_onevision", tmp_path_factory.mktemp("ckpt") / "llava_onevision")


@pytest.fixture(scope="module")
def adapter(checkpoint) -> VLMAdapter:
    return VLMAdapter.load(checkpoint)


def hf_inputs(adapter: VLMAdapter, case: Case) -> dict:
    """transformers' conversation path: the images inside the messages, ``apply_chat_template`` tokenizes."""
    images = iter(case.images)
    messages = [{**m, "content": [{**p, "image": next(images)} if p["type"] == "image" else p for p in m["content"]]}
                if isinstance(m["content"], list) else m for m in case.messages]
    return adapter.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, return_tensors="pt")


@pytest.fixture(scope="module")
def references(adapter) -> dict[str, tuple[list[int], list[int]]]:
    """Per case: transformers' prompt ids and its greedy ``NEW_TOKENS`` tokens (EOS off)."""
    out = {}
    for case in SERVED:
        inputs = hf_inputs(adapter, case)
        ids = inputs["input_ids"][0].tolist()
        with torch.inference_mode():
            generated = adapter.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        out[case.name] = (ids, generated[0, len(ids):].tolist())
    replies = [tuple(r) for _, r in out.values()]
    assert len(set(replies)) == len(replies), f"random model too degenerate for an identity check: {replies}"
    return out


def test_transformers_encodes_a_multi_image_prompt_in_another_form(adapter):
    """What the split has to follow: one square tile (+ newline) per image of a multi-image prompt, whatever
    its size; the single-image tiling of the same pictures (a flat list) gives other counts."""
    per_image = adapter.processor.num_image_tokens + 1
    for case in (BY_NAME["three-images"], BY_NAME["multi-turn"], PAIR):
        inputs = hf_inputs(adapter, case)
        assert inputs["batch_num_images"].tolist() == [len(case.images)]
        assert inputs["input_ids"][0].tolist().count(adapter.image_token_id) == per_image * len(case.images)
        assert [adapter.image_tokens(*im.size) for im in case.images] != [per_image] * len(case.images)
    assert hf_inputs(adapter, ALONE)["input_ids"][0].tolist().count(adapter.image_token_id) == adapter.image_tokens(*X.size)


def test_the_family_decides_the_variant_from_the_image_count(adapter):
    family = adapter.family
    assert [family.layout_variant(n) for n in (0, 1, 2, 3, 8)] == ["", "", MULTI_IMAGE, MULTI_IMAGE, MULTI_IMAGE]
    assert adapter.layout_variants(1) == [SINGLE_LAYOUT] and adapter.layout_variants(2) == [MULTI_IMAGE] * 2
    assert adapter.image_tokens(*X.size, MULTI_IMAGE) == adapter.image_tokens(*Y.size, MULTI_IMAGE) == 17
    assert adapter.image_tokens(*X.size) != adapter.image_tokens(*X.size, MULTI_IMAGE)
    with pytest.raises(InvalidImage, match="layout variant 'square'"):
        adapter.encode([X], ["square"])


def test_the_gateway_prompt_is_transformers_prompt(checkpoint, adapter, references):
    """Each case twice (the second from the learnt placeholder counts): X learnt in a pair never expands
    X alone with the pair's count, nor the other way round."""
    builder = PromptBuilder.from_pretrained(checkpoint)
    for _ in range(2):
        for case in (PAIR, ALONE, *SERVED):
            chat = ChatCompletionRequest.model_validate({"model": "m", "messages": openai_messages(case)})
            prompt = builder.build_prompt(chat.messages, case.images)
            assert prompt.token_ids == references[case.name][0], case.name
            assert prompt.image_variants == adapter.layout_variants(len(case.images)), case.name


@pytest.mark.parametrize("chunk_size", (5, None), ids=("chunk-5", "chunk-whole"))
def test_the_split_is_token_identical_to_transformers(adapter, references, chunk_size):
    pool = KVBlockPool(adapter.kv_layout, num_blocks=128, block_size=8)
    for case in SERVED:
        ids, reply = references[case.name]
        variants = adapter.layout_variants(len(case.images))
        embeddings = adapter.encode(case.images, variants)
        assert [e.shape[0] for e in embeddings] == [adapter.image_tokens(*im.size, v)
                                                    for im, v in zip(case.images, variants)]
        assert run_split(adapter, pool, Prompt({}, ids, embeddings, reply), chunk_size) == reply, case.name
    assert pool.free_blocks == pool.num_blocks


def test_one_picture_alone_and_in_a_pair_is_two_encodings_and_two_keys(adapter):
    """X's single-image encoding (tiles) and its multi-image encoding (one square tile) are different
    tensors under different keys; the multi-image one does not depend on X's companions."""
    alone, = adapter.encode([X])
    in_pair = adapter.encode([X, Y], [MULTI_IMAGE] * 2)[0]
    in_three = adapter.encode([noise_image(33, 77, 3), X, Y], [MULTI_IMAGE] * 3)[1]
    assert alone.shape[0] == adapter.image_tokens(*X.size) and in_pair.shape[0] == 17
    assert torch.equal(in_pair, in_three) and torch.equal(in_pair, adapter.encode([X], [MULTI_IMAGE])[0])
    mixed = adapter.encode([X, X], [SINGLE_LAYOUT, MULTI_IMAGE])   # one batch of both forms
    assert torch.equal(mixed[0], alone) and torch.equal(mixed[1], in_pair)
    keys = {v: image_content_key(X, "fp", "digest", "", v) for v in adapter.family.layout_variants}
    assert keys[SINGLE_LAYOUT] == image_content_key(X, "fp", "digest") != keys[MULTI_IMAGE]


def test_the_workers_refuse_refs_whose_variant_is_not_the_family_rule(adapter):
    from proto.epd.v1 import epd_pb2 as pb

    one, two = [pb.ImageRef(cache_key="a")], [pb.ImageRef(cache_key="a"), pb.ImageRef(cache_key="b")]
    assert variant_problem(adapter.family, one) is None
    assert "encodes every image of a prompt of 2 images as 'multi-image'" in variant_problem(adapter.family, two)
    for ref in two:
        ref.layout_variant = MULTI_IMAGE
    assert variant_problem(adapter.family, two) is None
    one[0].layout_variant = MULTI_IMAGE
    assert variant_problem(adapter.family, one) is not None
