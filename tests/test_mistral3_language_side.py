"""Mistral 3 (Pixtral tower) as far as this host can run it (issue 18).

Its processor, ``PixtralProcessor``, requires torchvision, which has no CPU build
here, so a Mistral 3 checkpoint is refused at start-up in one line naming that.
Everything else of the family is tested on a tiny random ``Mistral3ForConditionalGeneration``
(its real class, built in process): the Pixtral image processor (PIL backend, which
does not need torchvision), the model's own ``get_image_features`` for the
embeddings, prompts written the way ``PixtralProcessor`` writes them (per image,
rows of ``[IMG]`` each ending in ``[IMG_BREAK]``, the last in ``[IMG_END]``), then
the split (chunked prefill through the paged pool, chunk boundaries inside image
spans, decode steps), token-identical to ``generate()`` on the same ids and pixels.
"""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace

import pytest
import torch
from qwen_vl_cases import NEW_TOKENS, Prompt, image_runs, noise_image, run_split
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessorPil

from runtime.model.families.mistral3 import Mistral3Family
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter
from runtime.model.supported_models import UnsupportedModel, check_checkpoint

IMG, IMG_BREAK, IMG_END, VOCAB = 10, 11, 12, 300


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    torch.manual_seed(0)
    text = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=2048, sliding_window=None,
                initializer_range=0.2)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=64, patch_size=8, head_dim=16, initializer_range=0.2)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=IMG, spatial_merge_size=2,
                            vision_feature_layer=-1)
    config.tie_word_embeddings = False
    model = Mistral3ForConditionalGeneration(config).eval()
    processor = SimpleNamespace(image_processor=PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=8))
    return VLMAdapter(model, processor)


def _prompt(adapter: VLMAdapter, images, seed: int) -> Prompt:
    """Text ids around each image's placeholder block, as PixtralProcessor expands ``[IMG]``."""
    rng = random.Random(seed)
    ids = [1] + [rng.randrange(20, VOCAB) for _ in range(5)]
    for im in images:
        rows, columns = adapter.family.image_rows(adapter.processor, *im.size)
        for r in range(rows):
            ids += [IMG] * columns + [IMG_END if r == rows - 1 else IMG_BREAK]
        ids += [rng.randrange(20, VOCAB) for _ in range(4)]
    embeddings = adapter.encode(images)
    inputs = {"input_ids": torch.tensor([ids])}
    if images:
        pixels = adapter.processor.image_processor(images, return_tensors="pt")
        inputs.update(pixel_values=pixels["pixel_values"], image_sizes=pixels["image_sizes"])
    with torch.inference_mode():
        out = adapter.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    return Prompt(inputs, ids, embeddings, out[0, len(ids):].tolist())


@pytest.fixture(scope="module")
def prompts(adapter):
    torch.set_num_threads(1)
    return {"one-image": _prompt(adapter, [noise_image(60, 40, 1)], 1),
            "three-images": _prompt(adapter, [noise_image(100, 30, 2), noise_image(33, 77, 3), noise_image(64, 64, 4)], 2),
            "text-only": _prompt(adapter, [], 3)}


def test_a_checkpoint_is_refused_at_start_up_without_torchvision(tmp_path, adapter):
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the processor can load")
    adapter.model.config.architectures = ["Mistral3ForConditionalGeneration"]
    adapter.model.config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="its processor needs torchvision") as refused:
        check_checkpoint(tmp_path)
    assert "\n" not in str(refused.value)


def test_placeholders_are_the_encoder_rows(adapter, prompts):
    assert isinstance(adapter.family, Mistral3Family)
    for p in prompts.values():
        assert sum(e.shape[0] for e in p.embeddings) == p.ids.count(IMG)
    assert len({e.shape[0] for e in prompts["three-images"].embeddings}) == 3, "sizes give different token counts"


@pytest.mark.parametrize("chunk_size", (1, 5, None), ids=lambda c: f"chunk-{c or 'whole'}")
def test_the_language_side_is_token_identical_to_generate(adapter, prompts, chunk_size):
    pool = KVBlockPool(adapter.kv_layout, num_blocks=64, block_size=8)
    got = {name: run_split(adapter, pool, p, chunk_size) for name, p in prompts.items()}
    assert got == {name: p.reference for name, p in prompts.items()}
    assert len({tuple(p.reference) for p in prompts.values()}) == len(prompts)
    if chunk_size == 5:
        ids = prompts["three-images"].ids
        assert any(s < b < e for s, e in image_runs(ids, IMG) for b in range(5, len(ids), 5))
