"""Checkpoints the split cannot serve are refused at start-up with one line (issue 15, defect 8).

Tiny config-only checkpoints are written from transformers' config classes (no
downloads): reaching anything past the check (processor files, weights) would
fail differently, so a passing test also shows the check runs first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import (
    Gemma3Config,
    Idefics3Config,
    InternVLConfig,
    InternVLVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaNextConfig,
    LlavaOnevisionConfig,
    MistralConfig,
    MllamaConfig,
    PaliGemmaConfig,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
    SmolVLMConfig,
)

from gateway.prompt import PromptBuilder
from runtime.model.model_adapter import VLMAdapter
from runtime.model.supported_models import UnsupportedModel, check_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "models" / "demo-vlm"


def checkpoint(tmp_path: Path, config, architecture: str | None, preprocessor: dict | None = None) -> Path:
    if architecture is not None:
        config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    if preprocessor is not None:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return tmp_path


def tiny_internvl(**text) -> InternVLConfig:
    """The InternVL config of tests/test_model_split.py."""
    vision = InternVLVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  image_size=64, patch_size=8)
    text_config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=160, max_position_embeddings=512, **text)
    return InternVLConfig(vision_config=vision, text_config=text_config, image_token_id=151, downsample_ratio=0.5)


REFUSED = {
    "paligemma": (lambda: PaliGemmaConfig(), "PaliGemmaForConditionalGeneration", "bidirectional"),
    "mllama": (lambda: MllamaConfig(), "MllamaForConditionalGeneration", "cross-attention"),
}


def assert_one_line_refusal(message: str, architecture: str, model_type: str, why: str) -> None:
    assert "\n" not in message.strip(), message
    assert architecture in message and f"model_type '{model_type}'" in message and why in message
    assert "supported: LlavaForConditionalGeneration" in message and "InternVLForConditionalGeneration" in message


@pytest.mark.parametrize("name", REFUSED)
def test_adapter_and_prompt_builder_refuse_before_loading_anything(tmp_path, name):
    make, architecture, why = REFUSED[name]
    path = checkpoint(tmp_path, make(), architecture)
    model_type = make().model_type
    for load in (VLMAdapter.load, PromptBuilder.from_pretrained):
        with pytest.raises(UnsupportedModel) as refused:
            load(path)
        assert_one_line_refusal(str(refused.value), architecture, model_type, why)


@pytest.mark.parametrize("config, architecture, why", [
    (lambda: Qwen3VLMoeConfig(), "Qwen3VLMoeForConditionalGeneration", "mixture-of-experts"),
    (lambda: Qwen2VLConfig(), "Qwen2_5_VLForConditionalGeneration", "not a family"),   # architecture vs model_type
    (lambda: Qwen2VLConfig(text_config={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "mrope_section": [16, 24, 24]}}),
     "Qwen2VLForConditionalGeneration", "rope_type 'dynamic' is not supported with M-RoPE"),
    (lambda: Qwen2VLConfig(text_config={"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}),
     "Qwen2VLForConditionalGeneration", "sliding"),
    (lambda: LlamaConfig(), "LlamaForCausalLM", "not a family"),
    (lambda: LlavaConfig(text_config=MistralConfig().to_dict()), "LlavaForConditionalGeneration", "sliding-window"),
    (lambda: LlavaConfig(text_config=Qwen2Config(use_sliding_window=True, max_window_layers=1).to_dict()), None,
     "sliding_attention"),
    (lambda: LlavaConfig(text_config=LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}).to_dict()), None,
     "rope_type 'dynamic'"),
    (lambda: LlavaConfig(text_config=Qwen2Config(rope_scaling={"rope_type": "default", "mrope_section": [16, 24, 24]}).to_dict()),
     None, "M-RoPE"),
    (lambda: LlavaConfig(vision_config={"model_type": "pixtral"}), None, "vision tower 'pixtral'"),
    (lambda: LlavaConfig(text_config={"model_type": "gemma3_text"}), None, "decoder 'gemma3_text'"),
    (lambda: Gemma3Config(text_config={"attn_logit_softcapping": 50.0}), "Gemma3ForConditionalGeneration", "soft-capping"),
    (lambda: Gemma3Config(text_config={"layer_types": ["chunked_attention"] * 26}), "Gemma3ForConditionalGeneration",
     "chunked_attention"),
    (lambda: LlavaConfig(architectures=None, image_grid_pinpoints=[[336, 672]]), None, "anyres"),
])
def test_config_details_that_break_the_split_are_refused(tmp_path, config, architecture, why):
    path = checkpoint(tmp_path, config(), architecture)
    with pytest.raises(UnsupportedModel, match=why) as refused:
        check_checkpoint(path)
    assert "\n" not in str(refused.value) and "supported:" in str(refused.value)


def test_multi_tile_image_processing_is_refused(tmp_path):
    path = checkpoint(tmp_path, tiny_internvl(), "InternVLForConditionalGeneration",
                      {"image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": True, "max_patches": 12})
    with pytest.raises(UnsupportedModel, match="crop_to_patches"):
        check_checkpoint(path)


def test_the_demo_model_and_the_internvl_test_config_pass(tmp_path):
    check_checkpoint(DEMO_MODEL)
    check_checkpoint(checkpoint(tmp_path, tiny_internvl(), "InternVLForConditionalGeneration",
                                {"image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": False}))
    assert PromptBuilder.from_pretrained(DEMO_MODEL).context_length == 4096


@pytest.mark.parametrize("config, architecture", [
    (lambda: Qwen2VLConfig(text_config={"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}),
     "Qwen2VLForConditionalGeneration"),   # the legacy rope_scaling of the published Qwen2-VL checkpoints
    (lambda: Qwen2_5_VLConfig(), "Qwen2_5_VLForConditionalGeneration"),
    (lambda: Qwen3VLConfig(), "Qwen3VLForConditionalGeneration"),
], ids=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_qwen_vl_families_pass(tmp_path, config, architecture):
    """Issue 17: M-RoPE is accepted for the Qwen-VL families (and still refused for a LLaVA decoder, above)."""
    check_checkpoint(checkpoint(tmp_path, config(), architecture))


@pytest.mark.parametrize("config, architecture", [
    (lambda: LlavaNextConfig(), "LlavaNextForConditionalGeneration"),
    (lambda: LlavaOnevisionConfig(), "LlavaOnevisionForConditionalGeneration"),
    (lambda: Idefics3Config(), "Idefics3ForConditionalGeneration"),
    (lambda: SmolVLMConfig(), "SmolVLMForConditionalGeneration"),
    (lambda: Gemma3Config(), "Gemma3ForConditionalGeneration"),
], ids=["llava_next", "llava_onevision", "idefics3", "smolvlm", "gemma3"])
def test_the_tiling_and_splitting_families_pass(tmp_path, config, architecture):
    """Issue 18: image_grid_pinpoints (tiles) are accepted for LLaVA-NeXT and OneVision (still refused for LLaVA,
    above), and the image-splitting Idefics3 and SmolVLM."""
    check_checkpoint(checkpoint(tmp_path, config(), architecture))


@pytest.mark.parametrize("name", REFUSED)
def test_epd_serve_exits_with_the_one_line_before_spawning(tmp_path, name):
    make, architecture, why = REFUSED[name]
    path = checkpoint(tmp_path, make(), architecture)
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "serve", "--model", str(path), "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""   # no worker table: nothing was started
    assert done.stderr.startswith("epd serve: unsupported model")
    assert_one_line_refusal(done.stderr, architecture, make().model_type, why)


@pytest.mark.parametrize("role", ["encoder", "prefill", "decode", "gateway"])
def test_a_single_process_refuses_with_the_one_line(tmp_path, role):
    """``epd decode`` (or any one process) started by hand, as in compose and Kubernetes: the
    same one line and exit status 2, no traceback."""
    make, architecture, why = REFUSED["paligemma"]
    path = checkpoint(tmp_path, make(), architecture)
    done = subprocess.run([sys.executable, "-m", "launcher.cli", role, "--model", str(path), "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"epd {role}: unsupported model"), done.stderr
    assert "Traceback" not in done.stderr
    assert_one_line_refusal(done.stderr, architecture, make().model_type, why)
