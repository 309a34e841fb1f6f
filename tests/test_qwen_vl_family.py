"""The Qwen-VL family module (issue 17): processor without torchvision, placeholder rule, storage layout, checks.

On the code before issue 17 these fail: ``runtime.model.families`` did not exist,
the checkpoints were refused, and ``AutoProcessor`` (the only loader) raised
ImportError for every Qwen-VL checkpoint here.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)

from qwen_vl_cases import FAMILIES, build_checkpoint, noise_image
from runtime.model import families, tensor_bytes
from runtime.model.errors import ImagePlaceholderMismatch, InvalidImage, TooManyImages
from runtime.model.families import EmbeddingFormatError
from runtime.model.kv_pool import KVBlockPool
from runtime.model.model_adapter import DecodeInput, VLMAdapter
from runtime.model.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "models" / "demo-vlm"
PROCESSOR_CLASS = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}
SIZES = [(1, 1), (16, 16), (60, 40), (40, 60), (33, 77), (128, 128), (129, 127), (500, 300), (1000, 20),
         (3, 500), (2000, 2000)]
ONE_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory) -> Path:
    return build_checkpoint(family, tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def adapter(checkpoint) -> VLMAdapter:
    return VLMAdapter.load(checkpoint)


# -- the processor --------------------------------------------------------------------------
def test_processor_loads_without_torchvision(checkpoint, family, caplog):
    if importlib.util.find_spec("torchvision") is None:   # the failure this loader exists for
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(checkpoint)
    with caplog.at_level(logging.INFO, logger="epd.model"):
        processor = families.load_processor(checkpoint)
    assert isinstance(processor, PROCESSOR_CLASS[family])          # the family's real class
    assert "video_processor" not in processor.get_attributes() and not hasattr(processor, "video_processor")
    assert isinstance(processor.image_processor, Qwen2VLImageProcessorPil)
    assert processor.image_processor.size == {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}
    assert processor.chat_template == (checkpoint / "chat_template.jinja").read_text()
    assert any("without its video processor" in r.getMessage() for r in caplog.records)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                         add_generation_prompt=True)
    assert ONE_IMAGE in text and text.endswith("<|im_start|>assistant\n")
    out = processor(images=[noise_image(60, 40, 0)], text=text)
    assert out["input_ids"][0].count(processor.image_token_id) == 8 and out["image_grid_thw"].tolist() == [[1, 4, 8]]


def test_processor_loads_from_the_legacy_layout(checkpoint, tmp_path):
    """Published checkpoints: ``preprocessor_config.json`` + ``chat_template.json``, no processor_config.json."""
    legacy = tmp_path / "legacy"
    shutil.copytree(checkpoint, legacy)
    nested = json.loads((legacy / "processor_config.json").read_text())
    (legacy / "processor_config.json").unlink()
    flat = {**nested["image_processor"], "processor_class": nested["processor_class"]}
    (legacy / "preprocessor_config.json").write_text(json.dumps(flat))
    template = (legacy / "chat_template.jinja").read_text()
    (legacy / "chat_template.jinja").unlink()
    (legacy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    new, old = families.load_processor(checkpoint), families.load_processor(legacy)
    assert type(new) is type(old) and old.chat_template == template
    assert old.image_processor.to_dict() == new.image_processor.to_dict()
    image = noise_image(90, 50, 1)
    assert old(images=[image], text=ONE_IMAGE)["input_ids"] == new(images=[image], text=ONE_IMAGE)["input_ids"]


# -- dynamic resolution: the placeholder rule ---------------------------------------------------------
def test_placeholder_rule_is_the_processors(adapter):
    processor = adapter.processor
    for width, height in SIZES:
        image = Image.new("RGB", (width, height), (width % 256, height % 256, 90))
        out = processor(images=[image], text=ONE_IMAGE)
        grid = tuple(out["image_grid_thw"][0].tolist())
        assert adapter.family.image_grid(processor, width, height) == grid, (width, height)
        assert adapter.image_tokens(width, height) == out["input_ids"][0].count(adapter.image_token_id)
        (embedding,) = adapter.encode_images([image])
        assert embedding.grid == grid and embedding.tokens == adapter.image_tokens(width, height)
    tokens = [adapter.image_tokens(w, h) for w, h in SIZES]
    assert min(tokens) == 4 and max(tokens) <= 64 and len(set(tokens)) >= 5


def test_pixel_limits_change_the_grid_and_the_preprocessing_digest(checkpoint, adapter):
    """The encoder-cache key includes the image processor's settings: other limits, another key."""
    processor = families.load_processor(checkpoint)
    processor.image_processor.size = {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}
    smaller = VLMAdapter(adapter.model, processor)
    assert smaller.image_tokens(128, 128) == 16 < adapter.image_tokens(128, 128) == 64
    assert smaller.preprocess_digest != adapter.preprocess_digest


def test_extreme_aspect_ratio_is_a_client_error(adapter):
    with pytest.raises(InvalidImage, match="aspect ratio"):
        adapter.encode([Image.new("RGB", (201, 1))])
    (embedding,) = adapter.encode_images([Image.new("RGB", (200, 1))])
    assert embedding.tokens >= 4


# -- the storage layout ------------------------------------------------------------------------------
def test_storage_layout_is_one_tensor_carrying_grid_and_levels(adapter):
    images = [noise_image(100, 30, 2), noise_image(33, 77, 3)]
    records = adapter.encode_images(images)
    levels = 1 + adapter.family.deepstack_levels
    for record, tensor in zip(records, adapter.encode(images)):
        t, h, w = record.grid
        assert tuple(tensor.shape) == (levels, t, h // 2, w // 2, adapter.hidden_size)
        stored = tensor_bytes.encode(tensor)                   # what the encoder cache writes
        back = adapter.family.from_tensor(tensor_bytes.decode(stored.dtype, stored.shape, stored.payload))
        assert back.grid == record.grid and torch.equal(back.features, record.features)
        assert (back.deepstack is None) == (record.deepstack is None)
        if record.deepstack is not None:
            assert torch.equal(back.deepstack, record.deepstack)
    tensor = adapter.encode(images[:1])[0]
    for wrong in (tensor[0].reshape(-1, adapter.hidden_size),           # a LLaVA-style [tokens, hidden] entry
                  tensor[..., :-1],                                   # another hidden size
                  torch.cat([tensor, tensor[:1]])):                   # another number of DeepStack levels
        with pytest.raises(EmbeddingFormatError):
            adapter.family.from_tensor(wrong)


def test_an_image_encodes_the_same_alone_or_in_a_batch(adapter):
    """The encoder batches images of different requests: an image's embedding must not depend on its batch."""
    images = [noise_image(100, 30, 2), noise_image(33, 77, 3), noise_image(128, 128, 4)]
    together = adapter.encode(images)
    for image, batched in zip(images, together):
        torch.testing.assert_close(adapter.encode([image])[0], batched, rtol=1e-4, atol=1e-5)   # float noise only


def test_llava_layout_refuses_a_qwen_entry():
    demo = families.family_for(VLMAdapter.load(DEMO_MODEL).model.config)
    with pytest.raises(EmbeddingFormatError):
        demo.from_tensor(torch.zeros(1, 1, 2, 4, demo.hidden_size))


# -- prompt checks ---------------------------------------------------------------------------------
def test_placeholders_must_match_each_image_in_order(adapter):
    wide, tall = noise_image(100, 30, 2), noise_image(33, 77, 3)
    a, b = adapter.encode([wide, tall])
    text = f"look {ONE_IMAGE} and {ONE_IMAGE} ?"
    ids = adapter.processor(images=[wide, tall], text=text)["input_ids"][0]
    adapter.check_prompt(ids, [a, b])
    assert adapter.family.from_tensor(a).tokens != adapter.family.from_tensor(b).tokens
    with pytest.raises(ImagePlaceholderMismatch, match="runs"):   # same total tokens, other order
        adapter.check_prompt(ids, [b, a])
    with pytest.raises(ImagePlaceholderMismatch):
        adapter.check_prompt(ids, [a])
    video = adapter.processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    with pytest.raises(ImagePlaceholderMismatch, match="video"):
        adapter.check_prompt([*ids, video], [a, b])
    with pytest.raises(TooManyImages):
        adapter.check_prompt(ids, [a] * (adapter.max_images + 1))


def test_llava_keeps_its_one_dimensional_path():
    demo = VLMAdapter.load(DEMO_MODEL)
    assert demo.family.position_kind == families.PositionKind.ONE_D
    (embedding,) = demo.encode([noise_image(60, 40, 0)])
    assert embedding.ndim == 2 and demo.image_tokens(60, 40) == embedding.shape[0] == 16
    ids = [20, demo.image_token_id] + [demo.image_token_id] * 15 + [20]
    prepared = demo.prepare(ids, [embedding])
    assert prepared.plan.positions is None and prepared.rope_delta == 0 and prepared.deepstack is None
    pool = KVBlockPool(demo.kv_layout, num_blocks=4, block_size=16)
    blocks = pool.allocate(len(ids) + 1)
    demo.forward_packed(pool, [prepared.item(0, len(ids), blocks)])
    with pytest.raises(ValueError, match="1-D"):
        demo.decode_step(pool, [DecodeInput(20, len(ids), blocks, SamplingParams(), rope_delta=3)])
    pool.free(blocks)


# -- the test checkpoints' command ------------------------------------------------------------------
def test_epd_demo_model_builds_each_family(tmp_path):
    for family in FAMILIES:
        out = tmp_path / family
        done = subprocess.run([sys.executable, "-m", "launcher.cli", "demo-model", "--family", family, "--out", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert done.returncode == 0, done.stderr
        model = AutoModelForImageTextToText.from_pretrained(out)
        assert type(model).__name__ == PROCESSOR_CLASS[family].__name__.replace("Processor", "ForConditionalGeneration")
        assert isinstance(families.load_processor(out), PROCESSOR_CLASS[family])
        assert sum(p.numel() for p in model.parameters()) < 500_000
    refused = subprocess.run([sys.executable, "-m", "launcher.cli", "demo-model", "--family", "qwen2_vl", "--bench"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--bench" in refused.stderr
