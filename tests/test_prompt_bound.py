"""The token lower bound never exceeds the real count, for each kind of tokenizer it claims to bound.

Tokenizers are built with the ``tokenizers`` library (no downloads): a
lowercasing word-level one, the demo model's byte-level BPE, a GPT-2/Qwen2-style byte-level BPE behind NFC, and a
Llama-style byte-fallback BPE; the property runs on text chosen to hurt
(combining marks that NFC composes, long unknown words, whitespace a tokenizer
and Python disagree on, special-token strings).
"""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.prompt import PromptBuilder
from gateway.prompt_bound import MAX_CANONICAL_DECOMPOSITION, Rule, TokenFloor
from inprocess_backend import demo_model_path

CORPUS = ["hello world the quick brown fox jumps over the lazy dog " * 40, "ééé naïve café 東京 ṩ ᾂ 한국어 " * 20]


def word_level() -> PreTrainedTokenizerFast:
    """A word-level tokenizer as small models ship them: lowercased, split at whitespace and punctuation."""
    from runtime.demo_model.vocabulary import WORDS

    vocab = {w: i for i, w in enumerate(["<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def byte_fallback_bpe() -> PreTrainedTokenizerFast:
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    merges = [("l", "l"), ("ll", "o"), ("h", "e"), ("he", "llo"), ("▁", "hello"), ("o", "r"), ("w", "or"), ("wor", "l"),
              ("worl", "d"), ("▁", "world")]
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", *("".join(m) for m in merges)]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True, unk_token=None))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def tokenizers_under_test(prompts) -> dict[str, PreTrainedTokenizerFast]:
    return {"word-level": word_level(), "demo-byte-level": prompts.tokenizer, "byte-level-nfc": byte_level_bpe(),
            "byte-fallback": byte_fallback_bpe()}


def test_each_tokenizer_gets_the_rule_that_holds_for_it(tokenizers_under_test):
    floors = {name: TokenFloor.of(tok) for name, tok in tokenizers_under_test.items()}
    assert floors["word-level"].rule is Rule.WORDS
    assert floors["demo-byte-level"].rule is Rule.CHARS
    assert floors["byte-level-nfc"].rule is Rule.CHARS
    assert floors["byte-fallback"].rule is Rule.CHARS and floors["byte-fallback"].chars_per_token == len("▁hello")


@pytest.mark.parametrize("change, rule", [
    ({"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}}, Rule.NONE),
    ({"normalizer": {"type": "StripAccents"}}, Rule.NONE),
    ({"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": ""}}, Rule.NONE),
    ({"pre_tokenizer": {"type": "Whitespace"}}, Rule.NONE),   # byte-level BPE loses the whitespace
    ({"added_tokens": [{"content": "<mask>", "lstrip": True, "rstrip": False}]}, Rule.NONE),
    ({"normalizer": {"type": "NFKC"}}, Rule.CHARS),
])
def test_a_spec_that_may_drop_characters_gets_no_character_rule(tokenizers_under_test, change, rule):
    spec = json.loads(tokenizers_under_test["byte-level-nfc"].backend_tokenizer.to_str())
    assert TokenFloor.from_spec({**spec, **change}).rule is rule


def test_a_word_level_tokenizer_with_whitespace_in_an_added_token_gets_no_rule():
    spec = json.loads(word_level().backend_tokenizer.to_str())
    spec["added_tokens"] = [*spec["added_tokens"], {"content": "two words", "lstrip": False, "rstrip": False}]
    assert TokenFloor.from_spec(spec).rule is Rule.NONE


def test_the_composition_bound_matches_unicode():
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000))
    assert longest <= MAX_CANONICAL_DECOMPOSITION


@pytest.mark.parametrize("splitter", [pre_tokenizers.Whitespace(), pre_tokenizers.WhitespaceSplit(),
                                      pre_tokenizers.BertPreTokenizer()], ids=lambda s: type(s).__name__)
def test_whitespace_runs_count_as_the_tokenizer_splits(splitter):
    """Python's str.split() also splits at U+001C..U+001F; the tokenizers do not, so the bound must not."""
    floor = TokenFloor(Rule.WORDS)
    for c in (chr(i) for i in range(0x110000)):
        if c.isspace():
            text = f"a{c}b"
            assert floor.tokens_at_least([text]) <= len(splitter.pre_tokenize_str(text)), repr(c)


def test_nfc_composition_is_accounted_for():
    """Decomposed input that NFC composes into the longest token: without the factor 4 the bound overshoots."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([" ᾂᾂᾂᾂ" * 50], trainer=trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    text = " " + "ᾂ" * 4   # one composed word: 17 characters in, one token out
    text *= 30
    real = len(fast(text, add_special_tokens=False)["input_ids"])
    floor = TokenFloor.of(fast)
    assert real == 30 and floor.rule is Rule.CHARS and floor.tokens_at_least([text]) <= real
    without_composition = TokenFloor(Rule.CHARS, floor.chars_per_token // MAX_CANONICAL_DECOMPOSITION)
    assert without_composition.tokens_at_least([text]) > real


HURTFUL = st.sampled_from(["e\u0301", "\u1100\u1161\u11a8", "\u03b1\u0313\u0300\u0345", "\x1c", "\x1f", "\u3000", "\xa0",
                           "\u200b", "<|im_start|>", "<image>", "<|user|>", "zzzzzzzzzzzzzzzzzzzz", "\t\n", "😀", "東京",
                           "hello", " world", "  ", "ﬁ", "\u00a8"])
TEXT = st.lists(HURTFUL | st.text(max_size=12), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(TEXT, min_size=1, max_size=4), glue=st.sampled_from(["", " ", "\n", "x"]))
def test_the_bound_never_exceeds_the_real_count(tokenizers_under_test, parts, glue):
    for name, tok in tokenizers_under_test.items():
        floor = TokenFloor.of(tok)
        whole = glue.join(parts)
        real = len(tok(whole, add_special_tokens=False)["input_ids"])
        assert floor.tokens_at_least([whole]) <= real, (name, whole)
        assert floor.tokens_at_least(parts) <= real, (name, parts)           # parts joined by a template
        assert floor.tokens_at_least([p.strip() for p in parts]) <= real, (name, parts)


def test_runs_are_counted_across_slices():
    floor = TokenFloor(Rule.WORDS)
    text = ("word " * 40_000) + "x" * 200_000 + " tail"   # runs straddle the 64 Ki-character slices
    assert floor.tokens_at_least([text]) == len(text.split())


def test_the_demo_prompt_builder_uses_its_tokenizers_rule():
    builder = PromptBuilder.from_pretrained(demo_model_path()[0])
    assert builder.floor.rule is Rule.CHARS   # byte-level BPE: every character ends up in a token
