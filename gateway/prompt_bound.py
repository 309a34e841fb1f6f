"""A lower bound on a text's token count that never calls the tokenizer.

Tokenizing a 4 MB prompt takes seconds; knowing it cannot fit the context takes
a length. ``TokenFloor.of(tokenizer)`` reads the fast tokenizer's spec once and
picks the rule that provably holds for it (never more tokens than the real
count, so it can never refuse a prompt that fits):

``CHARS``  every character of the text ends up inside some token, and a token
           covers at most ``L`` characters of the normalized text, ``L`` being
           the longest vocabulary or added-token string (a byte-level token of
           k bytes covers at most k characters). The normalizer may shrink the
           text by at most a factor ``s`` (1 for lowercasing, decomposition,
           prepending, replacing with no shorter text; 4 for NFC/NFKC, whose
           composites decompose to at most 4 code points). So
           ``tokens >= chars / (L * s)``. Holds for BPE that cannot lose a
           character (byte fallback, byte-level pre-tokenizer, or an unfused
           unknown token) behind pre-tokenizers that keep every character.
``WORDS``  a word-level tokenizer (WordLevel, WordPiece, BPE with an unknown
           token) behind a pre-tokenizer that splits at whitespace: one unknown
           token can stand for a word of any length, so no character bound
           exists, but every whitespace-separated run of characters gives at
           least one token. ``tokens >= runs`` (counted in slices, so the
           count never holds the GIL for long).
``NONE``   anything else (normalizers that strip or drop characters, added
           tokens that swallow whitespace, fused unknown tokens): the bound is
           0 and only the exact count after tokenizing decides.

``tokens_at_least(texts)`` bounds a prompt that contains every one of ``texts``
(a template may trim each): each text is counted without surrounding
whitespace, and with ``WORDS`` neighbouring texts may join into one run.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerFast

# max len(NFD(c)) over all code points (U+1F82 ... : 4); tests/test_prompt_bound.py checks it
MAX_CANONICAL_DECOMPOSITION = 4
_RUN_SLICE = 1 << 16
# Python's str.split() also splits at U+001C..U+001F; the tokenizers' whitespace (Unicode White_Space) does not
_NOT_TOKENIZER_WHITESPACE = re.compile("[\x1c-\x1f]")
_AS_LETTERS = str.maketrans({c: "x" for c in "\x1c\x1d\x1e\x1f"})

_KEEP_ALL = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
_SPLIT_AT_WHITESPACE = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}
_WORD_SPLITTERS = _SPLIT_AT_WHITESPACE | {"Digits", "UnicodeScripts", "Split", "Punctuation"}
_WORD_NORMALIZERS = {"Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Prepend"}


class Rule(enum.Enum):
    CHARS = "chars"
    WORDS = "words"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class TokenFloor:
    rule: Rule
    chars_per_token: int = 0   # CHARS: L * s

    @classmethod
    def of(cls, tokenizer: Any) -> "TokenFloor":
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            return cls(Rule.NONE)   # a slow tokenizer's behaviour is not inspectable
        return cls.from_spec(json.loads(tokenizer.backend_tokenizer.to_str()))

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> "TokenFloor":
        """The rule for a ``tokenizer.json`` document."""
        model = spec.get("model") or {}
        added = spec.get("added_tokens") or []
        pre = list(_flatten(spec.get("pre_tokenizer"), "pretokenizers"))
        normalizers = list(_flatten(spec.get("normalizer"), "normalizers"))
        shrink = _shrink(normalizers)
        keeps_every_char = all(p["type"] in _KEEP_ALL and p.get("behavior") != "Removed" for p in pre)
        absorbs_whitespace = any(a.get("lstrip") or a.get("rstrip") for a in added)
        if model.get("type") == "BPE" and shrink is not None and keeps_every_char and not absorbs_whitespace:
            if _bpe_covers_every_char(model, pre):
                strings = [*model.get("vocab", {}), *(a["content"] for a in added)]
                return cls(Rule.CHARS, max(1, max(map(len, strings), default=1)) * shrink)
        word_model = model.get("type") in ("WordLevel", "WordPiece") or (
            model.get("type") == "BPE" and (model.get("unk_token") is not None or _bpe_covers_every_char(model, pre)))
        if (word_model and pre and all(p["type"] in _WORD_SPLITTERS and p.get("behavior") != "Removed" for p in pre)
                and any(p["type"] in _SPLIT_AT_WHITESPACE for p in pre)
                and all(n["type"] in _WORD_NORMALIZERS for n in normalizers)
                and not any(re.search(r"\s", a["content"]) for a in added)):
            return cls(Rule.WORDS)
        return cls(Rule.NONE)

    def tokens_at_least(self, texts: Sequence[str]) -> int:
        if self.rule is Rule.CHARS:
            chars = sum(len(t.strip()) for t in texts)
            return -(-chars // self.chars_per_token)
        if self.rule is Rule.WORDS:
            runs = [_runs(t) for t in texts]
            joined = sum(1 for n in runs if n) - 1    # neighbours may merge at each boundary
            return max(0, sum(runs) - max(0, joined))
        return 0


# -- the spec ----------------------------------------------------------------------------
def _flatten(spec: dict[str, Any] | None, key: str) -> Iterable[dict[str, Any]]:
    if spec is None:
        return
    if spec["type"] == "Sequence":
        for part in spec[key]:
            yield from _flatten(part, key)
    else:
        yield spec


def _shrink(normalizers: list[dict[str, Any]]) -> int | None:
    """How many input characters at most become one normalized character; ``None`` when unbounded."""
    factor = 1
    for n in normalizers:
        kind = n["type"]
        if kind in ("NFC", "NFKC"):
            factor *= MAX_CANONICAL_DECOMPOSITION
        elif kind == "Replace" and "String" in n["pattern"]:
            pattern, content = n["pattern"]["String"], n["content"]
            if not content:
                return None
            factor *= max(1, -(-len(pattern) // len(content)))
        elif kind not in ("Lowercase", "NFD", "NFKD", "Prepend"):
            return None   # Strip, StripAccents, Bert, Precompiled, regex Replace ...: may delete characters
    return factor


def _byte_level_alphabet() -> set[str]:
    """GPT-2's byte -> printable character map: a byte-level vocabulary holds all 256 as tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {chr(b) for b in printable} | {chr(256 + i) for i, _ in enumerate(extra)}


def _bpe_covers_every_char(model: dict[str, Any], pre: list[dict[str, Any]]) -> bool:
    vocab = model.get("vocab") or {}
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    if any(p["type"] == "ByteLevel" for p in pre) and _byte_level_alphabet() <= vocab.keys():
        return True
    return model.get("unk_token") in vocab and not model.get("fuse_unk")   # one unknown token per character


def _runs(text: str) -> int:
    """Maximal runs of non-whitespace characters, counted slice by slice (the GIL is free between slices)."""
    count, previous_open = 0, False
    for start in range(0, len(text), _RUN_SLICE):
        piece = text[start: start + _RUN_SLICE]
        if _NOT_TOKENIZER_WHITESPACE.search(piece):
            piece = piece.translate(_AS_LETTERS)
        n = len(piece.split())
        if n and previous_open and not piece[0].isspace():
            n -= 1   # the run continues from the previous slice
        count += n
        previous_open = not piece[-1].isspace()
    return count
