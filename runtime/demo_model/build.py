"""Assemble the demo VLM's parts from transformers' own classes.

``build_processor()`` makes a byte-level BPE tokenizer (merges learnt here, in
well under a second, from ``vocabulary.tokenizer_corpus()``) + CLIP image processor +
LLaVA processor with a chat template; ``build_config()`` makes a LLaVA config
(CLIP-style vision tower, projector, Llama-style decoder). Nothing here is
epd-specific: the saved folder is a standard Hugging Face checkpoint.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from .vocabulary import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    END_TOKEN,
    IMAGE_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    BPE_VOCAB,
    tokenizer_corpus,
)

IMAGE_SIZE = 32
PATCH_SIZE = 8


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE: every text tokenizes (no unknown token); special tokens come first (ids 0..6)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(tokenizer_corpus() * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=END_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=4096,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t.startswith("<|") or t == IMAGE_TOKEN]})
    return tokenizer


def build_processor() -> LlavaProcessor:
    image_processor = CLIPImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=False,
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=build_tokenizer(),
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )


def build_config(tokenizer: PreTrainedTokenizerFast, *, bench: bool = False) -> LlavaConfig:
    """Demo: ~1M parameters. Bench: ~150M parameters, 8k context, random weights."""
    if bench:
        vision = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                  num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
        text = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192,
                           vocab_size=len(tokenizer))
    else:
        vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
        text = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                           vocab_size=len(tokenizer))
    for cfg in (text,):
        cfg.bos_token_id = tokenizer.bos_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config
