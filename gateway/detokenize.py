"""Incremental detokenization for streaming, with OpenAI ``stop`` strings.

Decoding each token on its own breaks words and multi-byte characters, and
re-decoding everything each step costs O(n^2). Instead two offsets move along
the ids: the text of ``ids[prefix:read]`` (already emitted) is compared with
the text of ``ids[prefix:]``; the difference is the new text. A difference
that ends in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.

Stop strings: the emitted text never includes a stop string or anything after
it. A tail of the text that could still become the start of a stop string is
held back until the next token decides; ``flush()`` releases it when
generation ends for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold_max = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix = 0       # ids[_prefix:_read] decode to text already taken into self.text
        self._read = 0
        self.text = ""         # decoded text so far (cut at the stop string once one matched)
        self._emitted = 0      # chars of self.text handed out
        self.stopped = False   # a stop string matched: generation must end

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full_text = self._decode(self.ids[self._prefix:])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith(_INCOMPLETE)):
            self.text += full_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the text that may be sent now (possibly "")."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        self._advance(final=False)
        return self._take(final=False)

    def flush(self) -> str:
        """Generation ended (EOS or length): the rest of the text, held-back tail included."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        match = self._first_stop()
        if match is not None:
            self.text = self.text[:match]
            self.stopped = True
            final = True
        end = len(self.text) if final else len(self.text) - self._partial_stop_len()
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def _first_stop(self) -> int | None:
        # A match cannot start in text already emitted: that text had no stop prefix held back.
        hits = [i for i in (self.text.find(s, self._emitted) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for k in range(min(self._hold_max, len(self.text) - self._emitted), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
