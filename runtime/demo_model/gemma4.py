"""A tiny random-weight Gemma 4 checkpoint built here, for tests (``epd demo-model --family gemma4``).

``build_gemma4(out)`` writes a standard Hugging Face checkpoint of the real
``Gemma4ForConditionalGeneration`` holding, small, everything of Gemma 4 the split
must get right:

* decoder layers interleaving sliding-window (``WINDOW`` = 12 positions) and
  full attention (``LAYER_TYPES``), every test prompt longer than the window;
* two attention shapes: sliding layers ``KV_HEADS`` x ``HEAD_DIM``, full layers
  ``GLOBAL_KV_HEADS`` x ``GLOBAL_HEAD_DIM`` (``attention_k_eq_v``, which is what
  lets ``num_global_key_value_heads`` apply: the full layers' values are their
  keys' projection, normed without scale and without RoPE); proportional RoPE on
  the full layers (a quarter of the dimensions rotate);
* KV sharing: the last ``KV_SHARED`` layers have no K/V projections and reuse the
  K/V of the last earlier layer of their type (``kv_sharing_modes`` "store" /
  "reuse", both layer types);
* per-layer input embeddings (``hidden_size_per_layer_input``), a double-wide MLP
  on the KV-shared layers, final logit soft-capping;
* ``use_bidirectional_attention="vision"``: image tokens see their whole image on
  the sliding layers;
* a small vision tower (patches of 4 pixels pooled 3 x 3) and no audio tower.

The image processor is the real one (PIL backend) with the smallest budget it
accepts, ``max_soft_tokens`` 70: an image keeps its aspect ratio and gives up to
70 soft tokens (a square one 64, a 200 x 20 one 51), so images of different sizes
give different counts. The tokenizer is a ``GemmaTokenizer`` (BPE with byte
fallback) trained here with Gemma 4's special tokens (``<|turn>`` / ``<turn|>``,
``<|image>`` / ``<|image|>`` / ``<image|>``, the audio and video placeholders,
the thinking-channel tokens), named as the processor reads them; the processor is
the real ``Gemma4Processor`` without its video processor
(``families.gemma4.ImageOnlyGemma4Processor``). The chat template is modelled on
Gemma 4's own: ``<|turn>system`` / ``user`` / ``model`` turns closed by
``<turn|>``, ``<|think|>`` in the system turn when ``enable_thinking``, an image
as ``<|image|>`` (the processor expands it to ``<|image>`` + soft tokens +
``<image|>``), thinking stripped from earlier model turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, trainers
from transformers import Gemma4AudioFeatureExtractor, Gemma4Config, Gemma4ForConditionalGeneration, GemmaTokenizer
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from runtime.model.families.gemma4 import ImageOnlyGemma4Processor

from .qwen_vl import INIT_RANGE
from .vocabulary import WORDS

PATCH = 4
POOLING = 3
MAX_SOFT_TOKENS = 70       # the smallest budget Gemma4ImageProcessor accepts
WINDOW = 12
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]
KV_SHARED = 3              # layers 5..7 reuse layer 3's (sliding) and layer 4's (full) K/V
HIDDEN = 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
GLOBAL_KV_HEADS, GLOBAL_HEAD_DIM = 1, 32
PER_LAYER_INPUT = 8
SOFTCAP = 30.0
BPE_VOCAB = 400

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]     # ids 0..4, as in the real vocabulary
TURNS = ["<|turn>", "<turn|>"]
CHANNELS = ["<|think|>", "<|channel>", "<channel|>"]
MEDIA_SPECIALS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                  "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
VIDEO_TOKEN = "<|video|>"   # the processor adds it by this name

CHAT_TEMPLATE = (
    "{%- macro strip_thinking(text) -%}"
    "{%- set ns = namespace(out='') -%}"
    "{%- for part in text.split('<channel|>') -%}"
    "{%- if '<|channel>' in part -%}{%- set ns.out = ns.out + part.split('<|channel>')[0] -%}"
    "{%- else -%}{%- set ns.out = ns.out + part -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ns.out | trim -}}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- set loop_messages = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- '<|turn>system\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<|think|>' -}}{%- endif -%}"
    "{%- if messages[0]['content'] is string -%}{{- messages[0]['content'] | trim -}}"
    "{%- else -%}{%- for item in messages[0]['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{- item['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<turn|>\n' -}}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- elif enable_thinking is defined and enable_thinking -%}"
    "{{- '<|turn>system\n<|think|><turn|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\n' -}}"
    "{%- if message['content'] is string -%}"
    "{%- if role == 'model' -%}{{- strip_thinking(message['content']) -}}"
    "{%- else -%}{{- message['content'] | trim -}}{%- endif -%}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}"
    "{%- if role == 'model' -%}{{- strip_thinking(item['text']) -}}{%- else -%}{{- item['text'] | trim -}}{%- endif -%}"
    "{%- elif item['type'] in ['image', 'image_url'] -%}{{- '\n\n<|image|>\n\n' -}}"
    "{%- elif item['type'] == 'audio' -%}{{- '<|audio|>' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '\n\n<|video|>\n\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<turn|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}"
)


def build_tokenizer() -> GemmaTokenizer:
    """Gemma's tokenizer class over a BPE trained on the demo words (spaces as ``▁``, bytes as fallback)."""
    corpus = [" ".join(WORDS), "user model system You are a helpful assistant.", "\n\n"]
    backend = Tokenizer(models.BPE())
    media = [*MEDIA_SPECIALS.values(), VIDEO_TOKEN]
    fixed = [*SPECIALS, *TURNS, *CHANNELS, *media, *(f"<0x{b:02X}>" for b in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB + len(fixed), special_tokens=fixed, show_progress=False)
    backend.train_from_iterator([line.replace(" ", "▁") for line in corpus] * 4, trainer)
    merges = [tuple(m) if isinstance(m, (list, tuple)) else tuple(m.split(" "))
              for m in json.loads(backend.to_str())["model"]["merges"]]
    tokenizer = GemmaTokenizer(vocab=backend.get_vocab(), merges=merges, extra_special_tokens=MEDIA_SPECIALS,
                               model_max_length=4096)
    tokenizer.add_special_tokens({"additional_special_tokens": [*TURNS, *CHANNELS, *media]},
                                 replace_extra_special_tokens=False)
    return tokenizer


def build_processor() -> ImageOnlyGemma4Processor:
    tokenizer = build_tokenizer()
    image_processor = Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=POOLING,
                                              max_soft_tokens=MAX_SOFT_TOKENS)
    return ImageOnlyGemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor,
                                    tokenizer=tokenizer, video_processor=None, chat_template=CHAT_TEMPLATE,
                                    image_seq_length=MAX_SOFT_TOKENS)


def build_config(tokenizer: GemmaTokenizer) -> Gemma4Config:
    token = tokenizer.convert_tokens_to_ids
    eos = [1, token("<turn|>")]
    text = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                global_head_dim=GLOBAL_HEAD_DIM, num_global_key_value_heads=GLOBAL_KV_HEADS, attention_k_eq_v=True,
                num_kv_shared_layers=KV_SHARED, use_double_wide_mlp=True,
                hidden_size_per_layer_input=PER_LAYER_INPUT, vocab_size_per_layer_input=len(tokenizer),
                sliding_window=WINDOW, final_logit_softcapping=SOFTCAP, use_bidirectional_attention="vision",
                vocab_size=len(tokenizer), max_position_embeddings=4096, initializer_range=INIT_RANGE,
                rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=eos, bos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=PATCH, pooling_kernel_size=POOLING,
                  position_embedding_size=MAX_SOFT_TOKENS * POOLING + 16,   # the longest side, in patches, fits
                  initializer_range=INIT_RANGE)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                        image_token_id=token(MEDIA_SPECIALS["image_token"]), boi_token_id=token("<|image>"),
                        eoi_token_id=token("<image|>"), video_token_id=token(VIDEO_TOKEN),
                        audio_token_id=token("<|audio|>"), boa_token_id=token("<|audio>"),
                        eoa_token_index=token("<audio|>"), initializer_range=INIT_RANGE, tie_word_embeddings=False)


def build_gemma4(family: str, out: Path, *, seed: int = 0) -> Path:
    """Write the tiny Gemma 4 checkpoint to ``out`` (``family`` is ``"gemma4"``); seconds on a CPU."""
    if family != "gemma4":
        raise ValueError(f"not the Gemma 4 family: {family}")
    torch.manual_seed(seed)
    processor = build_processor()
    config = build_config(processor.tokenizer)
    model = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():   # ones at init would make every patch position alike: random tables instead
        model.model.vision_tower.patch_embedder.position_embedding_table.normal_(0.0, INIT_RANGE)
    model.generation_config.eos_token_id = list(config.text_config.eos_token_id)
    model.generation_config.pad_token_id = 0
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
