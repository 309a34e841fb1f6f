"""Sampled tokens' logprobs in the two shapes the API returns them (chat and legacy completions).

Each value is the workers' (``runtime.model.sampling``: log-softmax of the logits
the token was drawn from, after every processor); a token the processors
excluded (-inf) is reported as OpenAI does, -9999.0. A token's text is its
own decoding (``tokenizer.decode([id])``), its ``bytes`` that text's UTF-8.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from runtime.model.sampling import SampledToken, finite_logprob

from .openai_schema import ChoiceLogprobs, TokenLogprob, TopLogprob


class LogprobFormatter:
    def __init__(self, tokenizer: Any):
        self._text = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def text(self, token_id: int) -> str:
        return self._text(token_id)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.text(token_id)
        return TopLogprob(token=text, logprob=finite_logprob(logprob), bytes=list(text.encode()))

    def chat(self, samples: Sequence[SampledToken]) -> ChoiceLogprobs:
        content = []
        for s in samples:
            head = self._top(s.token_id, s.logprob if s.logprob is not None else float("-inf"))
            content.append(TokenLogprob(**head.model_dump(), top_logprobs=[self._top(e.token_id, e.logprob) for e in s.top]))
        return ChoiceLogprobs(content=content)

    def completion(self, samples: Sequence[SampledToken], text_offset: int = 0) -> dict[str, list]:
        """The legacy shape: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (dicts), ``text_offset``."""
        tokens, values, tops, offsets = [], [], [], []
        for s in samples:
            text = self.text(s.token_id)
            tokens.append(text)
            values.append(finite_logprob(s.logprob if s.logprob is not None else float("-inf")))
            tops.append({self.text(e.token_id): finite_logprob(e.logprob) for e in s.top})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
