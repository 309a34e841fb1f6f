"""vLLM's ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize`` takes ``messages`` (a chat, checked and built exactly as
``/v1/chat/completions`` builds it: the same refusals, the chat template, the
images fetched and their placeholders expanded) or ``prompt`` (text, as
``/v1/completions`` tokenizes it), and returns ``count``, ``tokens`` and
``max_model_len``; for a chat, ``count`` is that chat's ``usage.prompt_tokens``.
No model work is done. ``/detokenize`` turns token ids back into text.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from pydantic import BaseModel, ValidationError

from . import offload
from .chat_handler import ChatHandler
from .http_io import read_json_object
from .completions_schema import DetokenizeRequest, DetokenizeResponse, TokenizeMessages, TokenizePrompt, TokenizeResponse
from .errors import ApiError, from_validation_error
from .openai_schema import ChatCompletionRequest
from .prompt import message_texts


def _validated(model: type[BaseModel], document: dict) -> BaseModel:
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        raise from_validation_error(exc, document) from None


class TokenizeHandler:
    def __init__(self, chat: ChatHandler):
        self.chat = chat

    def _check_model(self, model: str | None) -> None:
        served = self.chat.settings.served_model_name
        if model is not None and model != served:
            raise ApiError.bad_request(f"model {model!r} is not served here; this server serves {served!r}",
                                       "model", "model_not_found")

    async def tokenize(self, request: Request) -> TokenizeResponse:
        document = await read_json_object(request)
        prompts = self.chat.prompts
        if ("messages" in document) == ("prompt" in document):
            raise ApiError.bad_request("send exactly one of messages and prompt", "messages", "invalid_value")
        if "messages" in document:
            tok = _validated(TokenizeMessages, document)
            self._check_model(tok.model)
            chat = _validated(ChatCompletionRequest, {"model": self.chat.settings.served_model_name,
                                                      "messages": document["messages"]})
            self.chat.check(chat)
            await offload.run(offload.small_text(message_texts(chat.messages)), prompts.check_fits, chat.messages)
            images = await self.chat.load_images(chat)
            ids = (await self.chat.build_prompt(chat, images)).token_ids
        else:
            tok = _validated(TokenizePrompt, document)
            self._check_model(tok.model)
            ids = (await asyncio.to_thread(prompts.text_prompt, tok.prompt, tok.add_special_tokens)).token_ids
        strs = prompts.decode_tokenizer.convert_ids_to_tokens(ids) if tok.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=prompts.context_length, tokens=ids, token_strs=strs)

    async def detokenize(self, request: Request) -> DetokenizeResponse:
        document = await read_json_object(request)
        req = _validated(DetokenizeRequest, document)
        self._check_model(req.model)
        vocab = len(self.chat.prompts.decode_tokenizer)
        outside = [t for t in req.tokens if t >= vocab]
        if outside:
            raise ApiError.bad_request(f"token ids {outside[:8]} are outside the vocabulary (0..{vocab - 1})",
                                       "tokens", "invalid_value")
        return DetokenizeResponse(prompt=self.chat.prompts.decode_tokenizer.decode(req.tokens))
