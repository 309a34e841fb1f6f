"""Bad input to the model adapter raises the typed errors of ``runtime.model.errors`` before any model work.

Every error is an ``AdapterInputError`` (hence a ``ValueError``) with a stable
``code``: the gateway turns these into 400s, so none of them may surface as a
generic exception from deep inside torch or PIL.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runtime.demo_model.shapes import draw_shape
from runtime.model.errors import AdapterInputError, ImagePlaceholderMismatch, InvalidImage, PromptTooLong, TooManyImages
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import VLMAdapter

DEMO_MODEL = Path(__file__).resolve().parents[1] / "models" / "demo-vlm"
WORD = 20  # an ordinary word token of the demo vocabulary


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    return VLMAdapter.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def strict(adapter) -> VLMAdapter:
    """The same model behind tighter limits: at most 2 images of at most 64x64 pixels."""
    return VLMAdapter(adapter.model, adapter.processor, max_images=2, max_image_pixels=64 * 64)


@pytest.fixture(scope="module")
def image_embedding(adapter) -> torch.Tensor:
    (embedding,) = adapter.encode([draw_shape(random.Random(5)).image])
    return embedding


def prompt(adapter: VLMAdapter, tokens_per_image: int, images: int, words: int = 6) -> list[int]:
    ids = [WORD] * words
    for _ in range(images):
        ids += [adapter.image_token_id] * tokens_per_image + [WORD]
    return ids


def raises_before_work(adapter: VLMAdapter, error: type[AdapterInputError], ids, embeddings, max_new_tokens: int = 0):
    """``check_prompt``, ``embed`` and ``prefill`` all refuse; prefill takes no KV blocks and yields nothing."""
    with pytest.raises(error) as info:
        adapter.check_prompt(ids, embeddings, max_new_tokens)
    assert str(info.value) and isinstance(info.value.code, str) and info.value.code
    with pytest.raises(error):
        adapter.embed(ids, embeddings)
    pool = KVBlockPool(adapter.kv_layout, num_blocks=4, block_size=16)
    events = []
    with pytest.raises(error):
        for event in adapter.prefill(ids, embeddings, 7, pool=pool):
            events.append(event)
    assert events == [] and pool.free_blocks == pool.num_blocks
    return info.value


# -- the error types ------------------------------------------------------------------
def test_error_types_are_client_errors_with_distinct_codes():
    kinds = [ImagePlaceholderMismatch, InvalidImage, TooManyImages, PromptTooLong]
    assert all(issubclass(k, AdapterInputError) and issubclass(k, ValueError) for k in kinds)
    assert len({k.code for k in kinds} | {AdapterInputError.code}) == len(kinds) + 1


# -- placeholders vs images -------------------------------------------------------------
def test_valid_prompt_passes(adapter, image_embedding):
    n = image_embedding.shape[0]
    adapter.check_prompt(prompt(adapter, n, 1), [image_embedding], max_new_tokens=16)
    adapter.check_prompt(prompt(adapter, n, 2), [image_embedding, image_embedding])
    adapter.check_prompt([WORD] * 5, [])


@pytest.mark.parametrize(
    ("placeholder_images", "given_images"),
    [(1, 2), (2, 1), (1, 0), (0, 1), (3, 2)],
    ids=["1-placeholder-2-images", "2-placeholders-1-image", "placeholder-no-image", "image-no-placeholder", "3-placeholders-2-images"],
)
def test_wrong_number_of_images_for_placeholders(adapter, image_embedding, placeholder_images, given_images):
    ids = prompt(adapter, image_embedding.shape[0], placeholder_images)
    err = raises_before_work(adapter, ImagePlaceholderMismatch, ids, [image_embedding] * given_images)
    assert str(placeholder_images * image_embedding.shape[0]) in str(err)


def test_embedding_of_the_wrong_size_for_its_placeholders(adapter, image_embedding):
    """Right image count, wrong feature count (e.g. an embedding from another preprocessing)."""
    ids = prompt(adapter, image_embedding.shape[0], 1)
    raises_before_work(adapter, ImagePlaceholderMismatch, ids, [image_embedding[:-1]])
    raises_before_work(adapter, ImagePlaceholderMismatch, ids, [torch.cat([image_embedding, image_embedding[:1]])])


def test_processor_prompt_with_two_images_but_one_given(adapter, image_embedding):
    text = adapter.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what is this ?"}]}],
        add_generation_prompt=True,
    )
    image = draw_shape(random.Random(6)).image
    ids = adapter.processor(images=[image, image], text=text, return_tensors="pt")["input_ids"][0].tolist()
    raises_before_work(adapter, ImagePlaceholderMismatch, ids, [image_embedding])


# -- too many images ---------------------------------------------------------------------
def test_too_many_images(adapter, strict, image_embedding):
    n = image_embedding.shape[0]
    five = [image_embedding] * (adapter.max_images + 1)
    err = raises_before_work(adapter, TooManyImages, prompt(adapter, n, len(five)), five)
    assert str(adapter.max_images) in str(err)
    strict.check_prompt(prompt(strict, n, 2), [image_embedding] * 2)  # at the limit: fine
    raises_before_work(strict, TooManyImages, prompt(strict, n, 3), [image_embedding] * 3)
    # the image count is refused even when the placeholders do not match either
    raises_before_work(strict, TooManyImages, prompt(strict, n, 1), [image_embedding] * 3)


# -- prompt length -----------------------------------------------------------------------
def test_prompt_longer_than_the_context(adapter):
    ctx = adapter.context_length
    assert ctx == 4096
    adapter.check_prompt([WORD] * (ctx - 1), [], max_new_tokens=1)  # exactly fills the context
    err = raises_before_work(adapter, PromptTooLong, [WORD] * ctx, [])
    assert str(ctx) in str(err)
    raises_before_work(adapter, PromptTooLong, [WORD] * (ctx + 500), [])
    with pytest.raises(PromptTooLong):  # fits alone, but not with the tokens asked for
        adapter.check_prompt([WORD] * (ctx - 100), [], max_new_tokens=101)
    adapter.check_prompt([WORD] * (ctx - 100), [], max_new_tokens=100)


def test_empty_prompt_is_refused(adapter):
    # Any client error will do; today it is a PromptTooLong ("empty prompt", code
    # context_length_exceeded), which is a misleading code for an empty prompt.
    raises_before_work(adapter, AdapterInputError, [], [])


def test_bad_chunk_size_is_a_programming_error(adapter):
    with pytest.raises(ValueError):
        next(adapter.prefill([WORD] * 4, [], 0))


# -- images ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["F", "I;16", "I", "HSV"])
def test_image_of_an_unsupported_mode(adapter, mode):
    with pytest.raises(InvalidImage, match=mode.replace(";", ".")):
        adapter.encode([Image.new(mode, (32, 32))])


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "CMYK", "YCbCr"])
def test_images_of_supported_modes_encode(adapter, image_embedding, mode):
    image = draw_shape(random.Random(5)).image.convert(mode)
    (embedding,) = adapter.encode([image])
    assert embedding.shape == image_embedding.shape and torch.isfinite(embedding).all()


@pytest.mark.parametrize("size", [(0, 0), (0, 32), (32, 0)])
def test_empty_image(adapter, size):
    with pytest.raises(InvalidImage, match="outside"):
        adapter.encode([Image.new("RGB", size)])


def test_image_larger_than_max_image_pixels(strict):
    (embedding,) = strict.encode([Image.new("RGB", (64, 64), (200, 10, 10))])  # exactly the limit
    assert embedding.shape[0] > 0
    for size in [(65, 64), (64, 65), (4097, 1)]:
        with pytest.raises(InvalidImage, match=f"{size[0]}x{size[1]}"):
            strict.encode([Image.new("RGB", size)])


@pytest.mark.parametrize(
    "thing",
    [
        "not an image",
        b"\x89PNG\r\n\x1a\n",
        None,
        np.zeros((32, 32, 3), dtype=np.uint8),
        torch.zeros(3, 32, 32),
        {"url": "http://example.com/a.png"},
    ],
    ids=["str", "bytes", "None", "ndarray", "tensor", "dict"],
)
def test_non_image_object(adapter, thing):
    with pytest.raises(InvalidImage, match="expected a PIL image"):
        adapter.encode([thing])


def test_one_bad_image_rejects_the_whole_batch(adapter):
    good = draw_shape(random.Random(7)).image
    with pytest.raises(InvalidImage):
        adapter.encode([good, Image.new("F", (32, 32)), good])
    with pytest.raises(InvalidImage):
        adapter.encode([good, "oops"])
