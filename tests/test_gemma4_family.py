"""Gemma 4's family pieces (processor, tower, placeholder rule, per-layer input ids) against the model's own code.

The tiny random checkpoint (``epd demo-model --family gemma4``) holds what makes Gemma 4
different: sliding (window 12) and full layers interleaved, two attention shapes
(2 x 16 sliding, 1 x 32 full), KV-shared layers of both types, per-layer input
embeddings, bidirectional image spans, final logit soft-capping, variable-size images.
The reference is the loaded model's own ``generate()`` / forward on the processor's
output; these tests pin what the split's language side reproduces (``tests/test_gemma4_split.py``):
the spliced rows, the per-layer inputs, the masks.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers
from qwen_vl_cases import CASES, NEW_TOKENS, image_runs, noise_image
from transformers import AutoConfig, AutoModelForImageTextToText, Gemma4Config

from runtime.demo_model import cli
from runtime.demo_model.gemma4 import GLOBAL_HEAD_DIM, GLOBAL_KV_HEADS, HEAD_DIM, KV_HEADS, MAX_SOFT_TOKENS, WINDOW
from runtime.model import families, supported_models
from runtime.model.families import EmbeddingFormatError, ImageEmbedding
from runtime.model.families.gemma4 import Gemma4Family, ImageOnlyGemma4Processor, kv_sharing

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py

SIZES = [(60, 40), (100, 30), (33, 77), (128, 128), (200, 20), (84, 120), (1, 1), (1000, 3), (3, 1000), (640, 480)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "gemma4"
    assert cli.main(["--family", "gemma4", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def processor(checkpoint):
    return Gemma4Family.load_processor(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint):
    return AutoModelForImageTextToText.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def family(model):
    return families.family_for(model.config, model)


@pytest.fixture(scope="module")
def prompts(processor, model):
    """Per case: the processor's output, its ids and generate()'s greedy tokens (EOS disabled)."""
    out = {}
    for case in CASES:
        text = processor.apply_chat_template(case.messages, add_generation_prompt=True)
        inputs = processor(images=case.images or None, text=text, return_tensors="pt")
        with torch.inference_mode():
            generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        ids = inputs["input_ids"][0].tolist()
        out[case.name] = (inputs, ids, generated[0, len(ids):].tolist())
    return out


def language_model_inputs(model, inputs) -> dict:
    """What ``Gemma4Model.forward`` hands its language model: the spliced ``inputs_embeds``, ``per_layer_inputs``."""
    seen = {}

    def grab(module, args, kwargs):
        seen.update(kwargs)

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            seen["logits"] = model(**inputs).logits
    finally:
        hook.remove()
    return seen


# -- the processor ---------------------------------------------------------------------
def test_the_processor_is_the_real_class_assembled_without_torchvision(checkpoint, processor, tmp_path):
    assert isinstance(processor, transformers.Gemma4Processor) and type(processor) is ImageOnlyGemma4Processor
    assert type(processor.image_processor).__name__ == "Gemma4ImageProcessorPil"
    assert isinstance(processor.feature_extractor, transformers.Gemma4AudioFeatureExtractor)
    assert not hasattr(processor, "video_processor")
    assert processor.image_processor.max_soft_tokens == MAX_SOFT_TOKENS and processor.chat_template
    if importlib.util.find_spec("torchvision") is None:   # why the family assembles it: AutoProcessor cannot
        with pytest.raises(Exception):
            transformers.AutoProcessor.from_pretrained(checkpoint)
    processor.save_pretrained(tmp_path / "again")   # saved as the real class, loads the same way
    assert '"processor_class": "Gemma4Processor"' in (tmp_path / "again" / "processor_config.json").read_text()
    again = Gemma4Family.load_processor(tmp_path / "again")
    assert again.image_processor.to_dict() == processor.image_processor.to_dict()
    assert again.tokenizer.get_vocab() == processor.tokenizer.get_vocab()


def test_the_chat_template_follows_gemma4(processor):
    messages = [{"role": "system", "content": "be brief ."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it ?"}]},
                {"role": "assistant", "content": "<|channel>thought\nhmm<channel|>a circle"},
                {"role": "user", "content": "sure ?"}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == ("<bos><|turn>system\nbe brief .<turn|>\n<|turn>user\n\n\n<|image|>\n\nwhat is it ?<turn|>\n"
                    "<|turn>model\na circle<turn|>\n<|turn>user\nsure ?<turn|>\n<|turn>model\n")
    thinking = processor.apply_chat_template(messages[1:2], add_generation_prompt=True, enable_thinking=True)
    assert thinking.startswith("<bos><|turn>system\n<|think|><turn|>\n<|turn>user\n")


# -- the checkpoint --------------------------------------------------------------------
def test_the_checkpoint_has_what_makes_gemma4_different(model, processor):
    text = model.config.get_text_config()
    modes = text.kv_sharing_modes
    assert {"store", "reuse"} <= set(modes)
    reusing = {text.layer_types[i] for i, m in enumerate(modes) if m == "reuse"}
    assert reusing == {"sliding_attention", "full_attention"}, "both layer types reuse a producer's K/V"
    shapes = {(text.per_layer_config[i].num_key_value_heads, text.per_layer_config[i].head_dim): kind
              for i, kind in enumerate(text.layer_types)}
    assert shapes == {(KV_HEADS, HEAD_DIM): "sliding_attention", (GLOBAL_KV_HEADS, GLOBAL_HEAD_DIM): "full_attention"}
    assert text.hidden_size_per_layer_input > 0 and model.model.language_model.embed_tokens_per_layer is not None
    assert text.use_bidirectional_attention == "vision" and text.final_logit_softcapping
    assert text.sliding_window == WINDOW and text.layer_types[-1] == "full_attention"
    assert model.config.audio_config is None and model.model.audio_tower is None
    layers = model.model.language_model.layers
    assert all(not hasattr(layers[i].self_attn, "k_proj") for i, m in enumerate(modes) if m == "reuse")
    config, tokenizer = model.config, processor.tokenizer
    assert (config.image_token_id, config.video_token_id, config.audio_token_id) == (
        processor.image_token_id, processor.video_token_id, processor.audio_token_id)
    assert (config.boi_token_id, config.eoi_token_id) == tuple(tokenizer.convert_tokens_to_ids([processor.boi_token,
                                                                                               processor.eoi_token]))
    assert len(tokenizer) == text.vocab_size == text.vocab_size_per_layer_input   # the processor added no token


def test_the_checkpoint_is_the_gemma4_family_and_served(checkpoint, model):
    family = families.family_for(AutoConfig.from_pretrained(checkpoint))
    assert isinstance(family, Gemma4Family) and family.bidirectional_images
    assert family.bidirectional_layer_types == {"sliding_attention"}
    supported_models.check_checkpoint(checkpoint)
    assert "Gemma 4" in supported_models.supported_list()
    supported_models.check_config(Gemma4Config(vision_config={}))   # and the published models' default shape
    assert isinstance(families.load_processor(checkpoint), transformers.Gemma4Processor)


@pytest.mark.parametrize("text, why", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8},
     "mixture-of-experts"),
    ({"vocab_size": 1000, "vocab_size_per_layer_input": 500}, "vocab_size_per_layer_input"),
])
def test_gemma4_settings_the_split_does_not_honour_are_refused(text, why):
    config = Gemma4Config(text_config=text, vision_config={})
    config.architectures = ["Gemma4ForConditionalGeneration"]
    with pytest.raises(supported_models.UnsupportedModel, match=why):
        supported_models.check_config(config)


def test_generate_runs_greedy_on_every_case(prompts, processor, family):
    """One image, three of different sizes, multi-turn, system prompt, text only: prompts longer than the window,
    one placeholder run per image of the family's count, and a non-degenerate greedy continuation."""
    references = [tuple(r) for _, _, r in prompts.values()]
    assert all(len(r) == NEW_TOKENS for r in references)
    assert len(set(references)) == len(references) and all(len(set(r)) > 2 for r in references), references
    for case in CASES:
        _, ids, _ = prompts[case.name]
        assert len(ids) > 2 * WINDOW, case.name
        runs = image_runs(ids, family.image_token_id)
        assert [e - s for s, e in runs] == [family.image_tokens(processor, *im.size) for im in case.images]
    sizes = {e - s for _, ids, _ in prompts.values() for s, e in image_runs(ids, family.image_token_id)}
    assert len(sizes) > 2 and min(sizes) > WINDOW, f"images of different sizes give different runs: {sizes}"


# -- the tower and the placeholder rule ------------------------------------------------
def test_encode_gives_the_rows_the_model_splices(model, processor, family, prompts):
    for case in CASES:
        if not case.images:
            continue
        inputs, ids, _ = prompts[case.name]
        spliced = language_model_inputs(model, inputs)["inputs_embeds"][0]
        with torch.inference_mode():
            embeddings = family.encode(model, processor, case.images, torch.float32, torch.device("cpu"))
        runs = image_runs(ids, family.image_token_id)
        assert [e.tokens for e in embeddings] == [e - s for s, e in runs], case.name
        for embedding, (s, e) in zip(embeddings, runs):
            assert embedding.features.shape == (e - s, family.hidden_size)
            torch.testing.assert_close(embedding.features, spliced[s:e], rtol=0, atol=0)
        with torch.inference_mode():   # an image's rows do not depend on the batch it is encoded in
            alone = [family.encode(model, processor, [im], torch.float32, torch.device("cpu"))[0] for im in case.images]
        for a, b in zip(alone, embeddings):
            torch.testing.assert_close(a.features, b.features, rtol=1e-5, atol=1e-6)


def test_the_placeholder_rule_is_the_processors(model, processor, family):
    counts = {}
    for k, (width, height) in enumerate(SIZES):
        image = noise_image(width, height, 100 + k)
        expanded = processor(images=[image], text="<|image|>", return_tensors="pt")
        placeholders = expanded["input_ids"][0].tolist().count(family.image_token_id)
        with torch.inference_mode():
            (embedding,) = family.encode(model, processor, [image], torch.float32, torch.device("cpu"))
        counts[(width, height)] = family.image_tokens(processor, width, height)
        assert counts[(width, height)] == placeholders == embedding.tokens, (width, height)
    assert len(set(counts.values())) >= 4, counts
    assert max(counts.values()) == family.longest_image_span(processor) == MAX_SOFT_TOKENS, counts


def test_check_placeholders_and_the_storage_layout(family):
    image = ImageEmbedding(torch.randn(5, family.hidden_size))
    ids = [2, 7, *[family.image_token_id] * 5, 8]
    assert family.check_placeholders(ids, [image]) is None
    assert "6 image placeholder tokens" in family.check_placeholders([*ids, family.image_token_id], [image])
    for kind, token in (("video", family.video_token_id), ("audio", family.audio_token_id)):
        assert kind in family.check_placeholders([*ids, token], [image])
    assert torch.equal(family.from_tensor(family.to_tensor(image)).features, image.features)
    with pytest.raises(EmbeddingFormatError):
        family.from_tensor(torch.randn(5, family.hidden_size + 1))


# -- what the language side must reproduce ---------------------------------------------
def test_per_layer_inputs_look_up_placeholders_as_pad(model, family, prompts):
    """The token-identity part of the per-layer inputs: ``per_layer_token_ids`` (placeholders -> pad); the
    context part is projected from the spliced embeddings. With both, the language model alone gives the
    model's logits: the recipe the split's prefill follows."""
    language = model.model.language_model
    inputs, ids, _ = prompts["three-images"]
    seen = language_model_inputs(model, inputs)
    lookup_ids = family.per_layer_token_ids(ids)
    assert lookup_ids.count(family.pad_token_id) >= ids.count(family.image_token_id) > 0
    with torch.inference_mode():
        ours = language.get_per_layer_inputs(torch.tensor([lookup_ids]))
        raw = language.get_per_layer_inputs(torch.tensor([ids]))
        torch.testing.assert_close(ours, seen["per_layer_inputs"], rtol=0, atol=0)
        assert not torch.allclose(raw, seen["per_layer_inputs"]), "looking up the image token itself differs"
        out = model(inputs_embeds=seen["inputs_embeds"], per_layer_inputs=ours,
                    mm_token_type_ids=inputs["mm_token_type_ids"], attention_mask=inputs["attention_mask"])
    torch.testing.assert_close(out.logits, seen["logits"], rtol=1e-5, atol=1e-5)


def test_image_spans_are_bidirectional_on_sliding_layers_only(model, family, prompts):
    """transformers' masks for Gemma 4 (``create_masks_for_vision_model``): an image token sees its whole span
    on the sliding layers (within the window backwards), and is causal on the full-attention layers."""
    inputs, ids, _ = prompts["one-image"]
    (s, e), = image_runs(ids, family.image_token_id)
    embeds = torch.zeros(1, len(ids), family.hidden_size)
    config = model.config
    config.get_text_config()._attn_implementation = "eager"   # explicit masks (sdpa may give None for causal)
    try:
        masks = model.create_masks_for_generate(config, embeds, inputs["attention_mask"], None,
                                                torch.arange(len(ids))[None], inputs["mm_token_type_ids"])
    finally:
        config.get_text_config()._attn_implementation = "sdpa"
    visible = {kind: (m[0, 0] == 0) if m.dtype != torch.bool else m[0, 0] for kind, m in masks.items()}
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    assert torch.equal(visible["full_attention"], causal)
    q = s + 1
    assert visible["sliding_attention"][q, e - 1] and not visible["sliding_attention"][q, e]
    assert not visible["sliding_attention"][e - 1, e - 1 - WINDOW]
    assert family.bidirectional_layer_types == {"sliding_attention"}
    causal_only = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}   # no block overlay at all
    with torch.inference_mode():
        assert not torch.allclose(model(**inputs).logits[0, -1], model(**causal_only).logits[0, -1]), "it matters"


def test_kv_sharing_layers_attend_over_their_producers_keys_and_values(model, prompts):
    """Through transformers' own attention call: a "reuse" layer gets exactly its producer's K/V; the K/V
    shapes are ``per_layer_config``'s (kv_heads, head_dim); the scaling passed is 1.0."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    calls = {}

    def probe(module, query, key, value, attention_mask, scaling=None, **kwargs):
        calls[module.layer_idx] = (key, value, scaling, kwargs.get("sliding_window"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("epd_gemma4_probe", probe)
    AttentionMaskInterface.register("epd_gemma4_probe", sdpa_mask)   # the masks sdpa gets
    text = model.config.get_text_config()
    inputs, _, _ = prompts["one-image"]
    text._attn_implementation = "epd_gemma4_probe"
    try:
        with torch.inference_mode():
            probed = model(**inputs).logits
    finally:
        text._attn_implementation = "sdpa"
    with torch.inference_mode():
        torch.testing.assert_close(probed, model(**inputs).logits, rtol=0, atol=0)
    sharing = kv_sharing(text)
    assert sharing == {5: 3, 6: 3, 7: 4} and all(text.kv_sharing_modes[p] == "store" for p in sharing.values())
    for layer, (key, value, scaling, window) in calls.items():
        shape = (text.per_layer_config[layer].num_key_value_heads, text.per_layer_config[layer].head_dim)
        assert (key.shape[1], key.shape[3]) == shape and value.shape == key.shape and scaling == 1.0
        assert window == (WINDOW if text.layer_types[layer] == "sliding_attention" else None)
        if layer in sharing:
            producer = calls[sharing[layer]]
            assert key is producer[0] and value is producer[1], f"layer {layer} reuses layer {sharing[layer]}"
    assert not torch.equal(calls[4][0], calls[4][1]), "attention_k_eq_v: values are normed keys without RoPE"
