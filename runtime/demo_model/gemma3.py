"""A tiny random-weight Gemma 3 checkpoint built here, for tests (``epd demo-model --family gemma3``).

``build_gemma3(out)`` writes a standard Hugging Face checkpoint: the real
``Gemma3ForConditionalGeneration`` with a few small layers (a SigLIP tower on 64-pixel
images, the model's average pooling to 16 image tokens, a Gemma 3 decoder whose layers
interleave sliding-window and global attention with a window of ``WINDOW`` tokens, so
prompts longer than the window and image runs longer than it are the common case), a
``GemmaTokenizer`` (BPE with byte fallback) trained here with Gemma's special tokens
(``<start_of_turn>``, ``<end_of_turn>``, ``<start_of_image>``, ``<end_of_image>``,
``<image_soft_token>``, named as the processor reads them), the real image processor
(PIL backend, pan and scan off), the real ``Gemma3Processor`` and a chat template
modelled on Gemma 3's own (``<start_of_turn>user`` / ``model`` turns, a system prompt
folded into the first user turn, an image as ``<start_of_image>``, which the processor
expands to ``\\n\\n<start_of_image>`` + 16 soft tokens + ``<end_of_image>\\n\\n``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, trainers
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor, GemmaTokenizer

from .qwen_vl import INIT_RANGE
from .vocabulary import WORDS

IMAGE_SIZE = 64
PATCH = 8
IMAGE_TOKENS = 16          # (64 / 8)**2 patches, pooled 2 x 2
WINDOW = 12                # sliding-window layers see the last 12 positions
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
HIDDEN = 64
BPE_VOCAB = 400

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]     # ids 0..4, as in the real vocabulary
TURNS = ["<start_of_turn>", "<end_of_turn>"]
IMAGE_SPECIALS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] in ['image', 'image_url'] -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def build_tokenizer() -> GemmaTokenizer:
    """Gemma's tokenizer class over a BPE trained on the demo words (spaces as ``▁``, bytes as fallback)."""
    corpus = [" ".join(WORDS), "user model system You are a helpful assistant.", "\n\n"]
    backend = Tokenizer(models.BPE())
    fixed = [*SPECIALS, *TURNS, *(f"<0x{b:02X}>" for b in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB + len(fixed), special_tokens=fixed, show_progress=False)
    backend.train_from_iterator([line.replace(" ", "▁") for line in corpus] * 4, trainer)
    state = backend.get_vocab()
    merges = [tuple(m) if isinstance(m, (list, tuple)) else tuple(m.split(" "))
              for m in __import__("json").loads(backend.to_str())["model"]["merges"]]
    tokenizer = GemmaTokenizer(vocab=state, merges=merges, extra_special_tokens=IMAGE_SPECIALS, model_max_length=2048)
    tokenizer.add_special_tokens({"additional_special_tokens": [*TURNS, *IMAGE_SPECIALS.values()]},
                                 replace_extra_special_tokens=False)
    return tokenizer


def build_gemma3(family: str, out: Path, *, seed: int = 0, text_overrides: dict | None = None) -> Path:
    """Write the tiny Gemma 3 checkpoint to ``out`` (``family`` is ``"gemma3"``); seconds on a CPU.
    ``text_overrides``: decoder settings replaced (the bench's Gemma-shaped KV: layers, window, heads)."""
    if family != "gemma3":
        raise ValueError(f"not a Gemma family: {family}")
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                                image_seq_length=IMAGE_TOKENS)
    token = tokenizer.convert_tokens_to_ids
    text = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                sliding_window=WINDOW, vocab_size=len(tokenizer), max_position_embeddings=2048,
                initializer_range=INIT_RANGE, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=[1, token("<end_of_turn>")],
                bos_token_id=2)
    text.update(text_overrides or {})
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
                          boi_token_index=token("<start_of_image>"), eoi_token_index=token("<end_of_image>"),
                          image_token_index=token("<image_soft_token>"), initializer_range=INIT_RANGE)
    config.tie_word_embeddings = False
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():   # zeros at init would make every image the same: a random projection instead
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        proj.normal_(0.0, INIT_RANGE)
    model.generation_config.eos_token_id = [1, token("<end_of_turn>")]
    model.generation_config.pad_token_id = 0
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
