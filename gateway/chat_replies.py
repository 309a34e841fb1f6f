"""A chat completion's reply, whole or streamed, for one choice or ``n`` (OpenAI's shapes).

Mixed into ``ChatHandler`` (``chat_handler.py``), which owns the request's life (validation,
admission, the stream's guard and journal): these methods only render what a ``Generation``
(one choice) or ``Choices`` (``n`` > 1, chunks by ``index`` in arrival order) yields, with tool
calls shaped by ``ReplyShaper`` and ``usage`` summed over the choices.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from .chat_backend import TokenEvent
from .choices import Choices
from .generation import Generation
from .http_io import sse_event, unless_disconnected
from .openai_schema import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Choice, ChunkChoice, Delta, Usage
from .tool_reply import ReplyShaper

BREAKDOWN_HEADER = "x-epd-ttft-breakdown"

class ChatReplies:
    """The reply renderers; ``ChatHandler`` sets what they read (``self.metrics`` and the rest)."""

    async def _complete(self, request: Request, chat: ChatCompletionRequest, generation: Generation,
                        first: TokenEvent, shaper: ReplyShaper = ReplyShaper(None)) -> JSONResponse:
        async def collect() -> str:
            return "".join([text async for text in generation.texts(first)])

        try:
            content = await unless_disconnected(request, collect())
        finally:
            await generation.close()
        logprobs = self.logprob_format.chat(generation.take_logprobs()) if chat.logprobs else None
        body = ChatCompletion(
            id=generation.job.request_id,
            created=int(time.time()),
            model=chat.model,
            choices=[Choice(message=shaper.message(content), finish_reason=shaper.finish_reason(generation.finish_reason),
                            logprobs=logprobs)],
            usage=self._usage(generation),
        )
        headers = {
            "x-request-id": generation.job.request_id,
            BREAKDOWN_HEADER: json.dumps(generation.ttft_breakdown, separators=(",", ":")),
        }
        return JSONResponse(body.model_dump(mode="json"), headers=headers)

    async def _complete_n(self, request: Request, chat: ChatCompletionRequest, choices: Choices,
                          shapers: list[ReplyShaper]) -> JSONResponse:
        try:
            contents = await unless_disconnected(request, choices.texts())
        finally:
            await choices.close()
        body = ChatCompletion(
            id=choices.job.request_id, created=int(time.time()), model=chat.model,
            choices=[Choice(index=i, message=shaper.message(content), finish_reason=shaper.finish_reason(gen.finish_reason),
                            logprobs=self.logprob_format.chat(gen.take_logprobs()) if chat.logprobs else None)
                     for i, (gen, shaper, content) in enumerate(zip(choices.gens, shapers, contents))],
            usage=self._usage(choices),
        )
        headers = {"x-request-id": choices.job.request_id,
                   BREAKDOWN_HEADER: json.dumps(choices.ttft_breakdown, separators=(",", ":"))}
        return JSONResponse(body.model_dump(mode="json"), headers=headers)

    async def _sse_n(self, chat: ChatCompletionRequest, choices: Choices,
                     shapers: list[ReplyShaper]) -> AsyncIterator[bytes]:
        """Each chunk carries one choice's delta with its ``index``, in arrival order; each choice's
        finish chunk comes when it finishes (the last one carries the TTFT breakdown)."""
        created = int(time.time())

        def chunk(index: int, delta: Delta, finish: str | None = None, logprobs: Any = None, **extra: Any) -> bytes:
            if chat.continuous_usage:
                extra.setdefault("usage", self._usage(choices))
            return sse_event(ChatCompletionChunk(
                id=choices.job.request_id, created=created, model=chat.model,
                choices=[ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)], **extra))

        for index in range(choices.n):
            yield chunk(index, Delta(role="assistant", content=""))
        async for index, text in choices.events():
            gen, shaper = choices.gens[index], shapers[index]
            samples = gen.take_logprobs()
            if shaper.parser is not None:
                for delta in shaper.deltas(text):
                    yield chunk(index, delta)
            elif text or samples:
                yield chunk(index, Delta(content=text), logprobs=self.logprob_format.chat(samples) if chat.logprobs else None)
            if gen.finish_reason is None:
                continue
            for delta in shaper.end_deltas():
                yield chunk(index, delta)
            last = choices.finish_reason is not None
            if last:
                await choices.close()   # release the backend's hold now, not after the last bytes are sent
            yield chunk(index, Delta(), shaper.finish_reason(gen.finish_reason),
                        **({"epd_ttft_breakdown": choices.ttft_breakdown} if last else {}))
        await choices.close()
        if chat.include_usage:
            yield sse_event(ChatCompletionChunk(id=choices.job.request_id, created=created, model=chat.model,
                                                choices=[], usage=self._usage(choices)))

    @staticmethod
    def _usage(generation: Generation | Choices) -> Usage:
        prompt = len(generation.job.token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=generation.completion_tokens,
                     total_tokens=prompt + generation.completion_tokens)

    async def _sse(self, chat: ChatCompletionRequest, generation: Generation, first: TokenEvent,
                   shaper: ReplyShaper = ReplyShaper(None)) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunk(delta: Delta, finish: str | None = None, logprobs: Any = None, **extra: Any) -> bytes:
            if chat.continuous_usage:
                extra.setdefault("usage", self._usage(generation))
            body = ChatCompletionChunk(id=generation.job.request_id, created=created, model=chat.model,
                                       choices=[ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)],
                                       **extra)
            return sse_event(body)

        # Each yield is one write through the ASGI stack: the events one token makes go out together, the
        # role chunk with the first token's (it is sent alone only when that token's text is held back),
        # the finish chunk with the usage chunk
        role: bytes | None = chunk(Delta(role="assistant", content=""))
        async for text in generation.texts(first):
            samples = generation.take_logprobs()
            if shaper.parser is not None:   # tool calls are read out of the text (no logprobs: refused with tools)
                out = [chunk(delta) for delta in shaper.deltas(text)]
            elif text or samples:
                out = [chunk(Delta(content=text), logprobs=self.logprob_format.chat(samples) if chat.logprobs else None)]
            else:
                out = []
            if role is not None:
                out.insert(0, role)
                role = None
            if out:
                yield b"".join(out)
        out = [role] if role is not None else []
        out += [chunk(delta) for delta in shaper.end_deltas()]
        await generation.close()  # release the backend's hold now, not after the last bytes are sent
        out.append(chunk(Delta(), shaper.finish_reason(generation.finish_reason),
                         epd_ttft_breakdown=generation.ttft_breakdown))
        if chat.include_usage:
            out.append(sse_event(ChatCompletionChunk(id=generation.job.request_id, created=created, model=chat.model,
                                                     choices=[], usage=self._usage(generation))))
        yield b"".join(out)
