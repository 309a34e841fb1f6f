"""``POST /v1/completions``: a text prompt (or token ids) through the same pipeline as chat.

The request's envelope (id, clock, pre-body shed, errors), the backend hand-off
and the stream's guard are the chat handler's (``ChatHandler.serve``, ``start``,
``guarded_stream``), so admission, deadlines, cancellation and who closes the
backend's generator are exactly chat's. What differs: the prompt is tokenized
as is (``add_special_tokens``, default true as in vLLM) with no chat template
and no images, ``max_tokens`` defaults to 16 (OpenAI's), and ``logprobs`` is a
count in the legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``). ``n`` > 1 is chat's too (``gateway.choices``): one choice per ``index``,
streamed interleaved as the tokens arrive, ``usage`` summed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pydantic_core
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from .auth import effective_cache_salt, request_tenant
from .chat_backend import ChatJob, TokenEvent
from .choices import Choices
from .chat_handler import BREAKDOWN_HEADER, ITL_HEADER, TTFT_HEADER, ChatHandler
from .http_io import read_json_object, sse_event, sse_response, unless_disconnected
from .completions_schema import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from .errors import ApiError, from_validation_error
from .generation import Generation
from .openai_schema import Usage
from .sampling_fields import sampling_problem


class CompletionsHandler:
    def __init__(self, chat: ChatHandler):
        self.chat = chat

    async def handle(self, request: Request) -> Response:
        return await self.chat.serve(request, "cmpl", self._completion)

    async def parse(self, request: Request) -> CompletionRequest:
        document = await read_json_object(request)
        try:
            req = CompletionRequest.model_validate(document)
        except ValidationError as exc:
            raise from_validation_error(exc, document) from None
        settings = self.chat.settings
        if req.model != settings.served_model_name:
            raise ApiError.bad_request(f"model {req.model!r} is not served here; this server serves "
                                       f"{settings.served_model_name!r}", "model", "model_not_found")
        refusal = req.unsupported()
        if refusal is not None:
            raise ApiError.bad_request(refusal.message, refusal.param, refusal.code)
        if req.max_tokens is not None and req.max_tokens > settings.max_tokens_limit:
            raise ApiError.bad_request(f"max_tokens must be at most {settings.max_tokens_limit}", "max_tokens",
                                       "invalid_value")
        return req

    async def build_job(self, request: Request, req: CompletionRequest, request_id: str, arrival_s: float) -> ChatJob:
        chat, prompts = self.chat, self.chat.prompts
        ttft_slo_ms = chat.slo(request, TTFT_HEADER, chat.settings.ttft_slo_ms)
        itl_slo_ms = chat.slo(request, ITL_HEADER, chat.settings.itl_slo_ms)
        prompt = await asyncio.to_thread(prompts.text_prompt, req.prompt, req.add_special_tokens)
        max_tokens = prompts.resolve_max_tokens(len(prompt.token_ids), req.max_tokens, chat.settings.default_max_tokens,
                                                prompt_param="prompt")
        sampling = req.sampling_params(req.logprobs)
        problem = sampling_problem(sampling, max_tokens, len(prompts.decode_tokenizer), prompts.forks_choices)
        if problem is not None:
            raise ApiError.bad_request(problem[1], problem[0], "invalid_value")
        return ChatJob(
            request_id=request_id, token_ids=prompt.token_ids, images=[], max_tokens=max_tokens, sampling=sampling,
            ttft_deadline_s=arrival_s + ttft_slo_ms / 1e3, itl_slo_ms=itl_slo_ms, arrival_s=arrival_s,
            cache_salt=effective_cache_salt(req.cache_salt, request_tenant(request), chat.settings.cache_salt_per_api_key),
            image_grids=[], rope_delta=prompt.rope_delta,
        )

    async def _completion(self, request: Request, request_id: str, arrival_s: float) -> Response:
        req = await self.parse(request)
        job = await self.build_job(request, req, request_id, arrival_s)
        generation, first = await self.chat.start(request, job, req.stop_sequences)
        if job.sampling.n > 1:
            choices = self.chat.choices(request, generation, first, req.stop_sequences)
            if req.stream:
                return sse_response(self.chat.guarded_stream(choices, self._sse_n(req, choices)), request_id)
            return await self._complete_n(request, req, choices)
        if req.stream:
            return sse_response(self.chat.guarded_stream(generation, self._sse(req, generation, first)), request_id)
        return await self._complete(request, req, generation, first)

    def _logprobs(self, req: CompletionRequest, generation: Generation, offset: int) -> CompletionLogprobs | None:
        if req.logprobs is None:
            return None
        return CompletionLogprobs(**self.chat.logprob_format.completion(generation.take_logprobs(), offset))

    async def _complete(self, request: Request, req: CompletionRequest, generation: Generation,
                        first: TokenEvent) -> JSONResponse:
        async def collect() -> str:
            return "".join([text async for text in generation.texts(first)])

        try:
            text = await unless_disconnected(request, collect())
        finally:
            await generation.close()
        body = Completion(id=generation.job.request_id, created=int(time.time()), model=req.model,
                          choices=[CompletionChoice(text=text, logprobs=self._logprobs(req, generation, 0),
                                                    finish_reason=generation.finish_reason)],
                          usage=usage(generation))
        headers = {"x-request-id": generation.job.request_id,
                   BREAKDOWN_HEADER: pydantic_core.to_json(generation.ttft_breakdown).decode()}
        return JSONResponse(body.model_dump(mode="json"), headers=headers)

    async def _sse(self, req: CompletionRequest, generation: Generation, first: TokenEvent) -> AsyncIterator[bytes]:
        created, offset = int(time.time()), 0

        def chunk(choices: list[CompletionChoice], **extra) -> bytes:
            if req.continuous_usage:
                extra.setdefault("usage", usage(generation))
            return sse_event(Completion(id=generation.job.request_id, created=created, model=req.model,
                                        choices=choices, **extra))

        async for text in generation.texts(first):
            logprobs = self._logprobs(req, generation, offset)
            if text or (logprobs is not None and logprobs.tokens):
                yield chunk([CompletionChoice(text=text, logprobs=logprobs)])
            offset += len(text)
        await generation.close()   # release the backend's hold now, not after the last bytes are sent
        yield chunk([CompletionChoice(text="", finish_reason=generation.finish_reason)],
                    epd_ttft_breakdown=generation.ttft_breakdown)
        if req.include_usage:
            yield sse_event(Completion(id=generation.job.request_id, created=created, model=req.model, choices=[],
                                       usage=usage(generation)))


    async def _complete_n(self, request: Request, req: CompletionRequest, choices: Choices) -> JSONResponse:
        try:
            texts = await unless_disconnected(request, choices.texts())
        finally:
            await choices.close()
        body = Completion(id=choices.job.request_id, created=int(time.time()), model=req.model,
                          choices=[CompletionChoice(index=i, text=text, logprobs=self._logprobs(req, gen, 0),
                                                    finish_reason=gen.finish_reason)
                                   for i, (gen, text) in enumerate(zip(choices.gens, texts))],
                          usage=usage(choices))
        headers = {"x-request-id": choices.job.request_id,
                   BREAKDOWN_HEADER: pydantic_core.to_json(choices.ttft_breakdown).decode()}
        return JSONResponse(body.model_dump(mode="json"), headers=headers)

    async def _sse_n(self, req: CompletionRequest, choices: Choices) -> AsyncIterator[bytes]:
        created, offsets = int(time.time()), [0] * choices.n

        def chunk(choice: CompletionChoice, **extra) -> bytes:
            if req.continuous_usage:
                extra.setdefault("usage", usage(choices))
            return sse_event(Completion(id=choices.job.request_id, created=created, model=req.model,
                                        choices=[choice], **extra))

        async for index, text in choices.events():
            gen = choices.gens[index]
            logprobs = self._logprobs(req, gen, offsets[index])
            if text or (logprobs is not None and logprobs.tokens):
                yield chunk(CompletionChoice(index=index, text=text, logprobs=logprobs))
            offsets[index] += len(text)
            if gen.finish_reason is None:
                continue
            last = choices.finish_reason is not None
            if last:
                await choices.close()   # release the backend's hold now, not after the last bytes are sent
            yield chunk(CompletionChoice(index=index, text="", finish_reason=gen.finish_reason),
                        **({"epd_ttft_breakdown": choices.ttft_breakdown} if last else {}))
        await choices.close()
        if req.include_usage:
            yield sse_event(Completion(id=choices.job.request_id, created=created, model=req.model, choices=[],
                                       usage=usage(choices)))


def usage(generation: Generation | Choices) -> Usage:
    prompt = len(generation.job.token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=generation.completion_tokens,
                 total_tokens=prompt + generation.completion_tokens)
