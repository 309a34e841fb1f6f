"""One ``POST /v1/chat/completions`` request, from bytes to response.

Lifecycle (every refusal before step 6 costs no model work):

1. headers: ``x-ttft-slo-ms`` / ``x-itl-slo-ms`` parsed (400 when malformed or
   above ``max_slo_ms``);
2. body: JSON (size already bounded by ``BodyLimitMiddleware``, nesting by the
   parser), then ``ChatCompletionRequest`` (strict types);
3. request checks: model name, fields not honoured or unknown (400, see
   ``gateway.openai_schema``), ``max_tokens`` limit, image count, a lower bound
   on the prompt's tokens against the context (no tokenizer call);
4. images: fetched / decoded / checked (``gateway.images``);
5. prompt: chat template + processor -> token ids, at most ``prompt_workers``
   at once, in parallel; exact context length check;
6. ``backend.generate(job)``; the first event is awaited *before* any response
   is sent, so admission refusals and deadline misses get their real status
   (429/503/504) even for ``stream: true``. The gateway's own guard fires
   ``deadline_grace_ms`` after the TTFT deadline should the backend not;
7. tokens -> text (``IncrementalDetokenizer``) -> one JSON response or SSE chunks; with
   ``n`` > 1, per choice (``gateway.choices``): chunks interleaved by ``index`` as they arrive.

Ownership: from ``generate()`` on, the request's ``Generation`` holds the
backend's event generator and this module closes it (``aclose``) on every
path — finished, stop string, length, client gone (a disconnect watcher until
the response starts, then Starlette's), deadline, error. Closing is the
backend's cancel signal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from runtime.model.grammar import GrammarError
from runtime.policy.placement_policy import retry_wait_ms

from . import offload
from .auth import effective_cache_salt, request_tenant
from .chat_replies import BREAKDOWN_HEADER, ChatReplies  # noqa: F401 (BREAKDOWN_HEADER: read from here too)
from .chat_backend import AdmissionRefused, ChatBackend, ChatJob, PreparedImage, TokenEvent
from .choices import Choices
from .detokenize import IncrementalDetokenizer
from .errors import ApiError, from_exception, from_validation_error, internal_error_body
from .generation import Generation
from .http_io import SSEResponse, ClientDisconnected, read_json_object, sse_response, unless_disconnected
from .images import ImageLoader
from .logprobs import LogprobFormatter
from .loop_lag import LoopLagMonitor
from .http_metrics import HttpMetrics
from .openai_schema import ChatCompletionRequest, ImagePart
from .prompt import BuiltPrompt, PromptBuilder, message_texts
from .request_journal import RequestJournal, RequestRecord
from .sampling_fields import sampling_problem
from .settings import GatewaySettings
from .structured_output import OutputPlan, plan_output
from .tool_reply import ReplyShaper

log = logging.getLogger("epd.gateway")

TTFT_HEADER = "x-ttft-slo-ms"
ITL_HEADER = "x-itl-slo-ms"


def parse_slo_header(value: str | None, default_ms: float, name: str, max_ms: float) -> float:
    """A per-request SLO in milliseconds, in (0, ``max_ms``] (``settings.max_slo_ms``); else a 400 naming the header."""
    if value is None:
        return default_ms
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (0 < ms <= max_ms):
        raise ApiError.bad_request(f"header {name} must be a number of milliseconds in (0, {max_ms:g}]", name, "invalid_header")
    return ms


def failure_reason(error: ApiError) -> str:
    if error.status == 504:
        return "deadline"
    if error.status in (429, 503) and error.code == "admission_refused":
        return "refused"
    if error.status >= 500:
        return "backend"
    return "client_error"


class ChatHandler(ChatReplies):
    def __init__(self, settings: GatewaySettings, backend: ChatBackend, prompts: PromptBuilder,
                 images: ImageLoader, metrics: HttpMetrics, loop_lag: LoopLagMonitor | None = None,
                 journal: RequestJournal | None = None):
        self.settings = settings
        self.journal = journal or RequestJournal()
        self.loop_lag = loop_lag or LoopLagMonitor()   # not started: reads 0
        self.backend = backend
        self.prompts = prompts
        self.images = images
        self.metrics = metrics
        self._prompt_slots = asyncio.Semaphore(settings.prompt_workers)   # builds in flight, one processor copy each
        self.logprob_format = LogprobFormatter(prompts.decode_tokenizer)

    # -- steps 1-5: from request to job -------------------------------------------
    async def parse(self, request: Request) -> ChatCompletionRequest:
        document = await read_json_object(request)
        try:
            chat = ChatCompletionRequest.model_validate(document)
        except ValidationError as exc:
            raise from_validation_error(exc, document) from None
        self.check(chat)
        return chat

    def check(self, chat: ChatCompletionRequest) -> None:
        """Step 3: the request checks that need no tokenizer (400s naming the field)."""
        if chat.model != self.settings.served_model_name:
            raise ApiError.bad_request(
                f"model {chat.model!r} is not served here; this server serves {self.settings.served_model_name!r}",
                "model", "model_not_found",
            )
        refusal = chat.unsupported()
        if refusal is not None:
            raise ApiError.bad_request(refusal.message, refusal.param, refusal.code)
        requested = chat.requested_max_tokens
        if requested is not None and requested > self.settings.max_tokens_limit:
            param = "max_completion_tokens" if chat.max_completion_tokens is not None else "max_tokens"
            raise ApiError.bad_request(f"{param} must be at most {self.settings.max_tokens_limit}", param, "invalid_value")
        n_images = sum(len(m.image_parts()) for m in chat.messages)
        if n_images > self.settings.limit_images_per_request:
            raise ApiError.bad_request(
                f"{n_images} images; this server accepts at most {self.settings.limit_images_per_request} per request",
                "messages", "too_many_images",
            )

    async def load_images(self, chat: ChatCompletionRequest) -> list[PreparedImage]:
        parts = [
            (part.image_url.url, f"messages.{i}.content.{j}.image_url.url")
            for i, message in enumerate(chat.messages)
            if isinstance(message.content, list)
            for j, part in enumerate(message.content)
            if isinstance(part, ImagePart)
        ]
        if len(parts) <= 1:
            return [await self.images.load(url, param) for url, param in parts]
        share = offload.INLINE_MAX_PIXELS // len(parts)   # what all of them may hold the loop for, split
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.images.load(url, param, share)) for url, param in parts]
        except ExceptionGroup as group:  # report the first client mistake, the other loads were cancelled
            mistakes = group.subgroup(ApiError)
            if mistakes is None:
                raise
            raise mistakes.exceptions[0] from None
        return [t.result() for t in tasks]

    async def plan_output(self, chat: ChatCompletionRequest) -> OutputPlan:
        """The reply's grammar and tool parsing (``gateway.structured_output``): a grammar that does not
        compile is a 400 here, before any image is fetched or any worker is asked."""
        if not chat.tools and chat.response_format is None:
            return OutputPlan()

        def vocab():
            try:
                return self.prompts.grammar_vocabulary()
            except GrammarError as exc:
                param = "response_format" if chat.response_format is not None else "tool_choice"
                raise ApiError.bad_request(str(exc), param, "unsupported_parameter") from None

        plan = await asyncio.to_thread(plan_output, chat, vocab, self.prompts.chat_template)
        if plan.parser is not None and chat.logprobs:
            raise ApiError.bad_request("logprobs cannot be combined with tools the model may call", "logprobs",
                                       "unsupported_parameter")
        return plan

    async def build_job(self, request: Request, chat: ChatCompletionRequest, request_id: str, arrival_s: float,
                        plan: OutputPlan = OutputPlan()) -> ChatJob:
        ttft_slo_ms = self.slo(request, TTFT_HEADER, self.settings.ttft_slo_ms)
        itl_slo_ms = self.slo(request, ITL_HEADER, self.settings.itl_slo_ms)
        # a prompt that cannot fit loads no image
        await offload.run(offload.small_text(message_texts(chat.messages)), self.prompts.check_fits, chat.messages)
        images = await self.load_images(chat)
        prompt = await self.build_prompt(chat, images, plan.tools)
        token_ids = prompt.token_ids
        max_tokens = self.prompts.resolve_max_tokens(len(token_ids), chat.requested_max_tokens, self.settings.default_max_tokens)
        sampling = dataclasses.replace(chat.sampling_params(chat.requested_logprobs), grammar=plan.grammar)
        problem = sampling_problem(sampling, max_tokens, len(self.prompts.decode_tokenizer), self.prompts.forks_choices)
        if problem is not None:
            raise ApiError.bad_request(problem[1], problem[0], "invalid_value")
        return ChatJob(
            request_id=request_id,
            token_ids=token_ids,
            images=images,
            max_tokens=max_tokens,
            sampling=sampling,
            ttft_deadline_s=arrival_s + ttft_slo_ms / 1e3,
            itl_slo_ms=itl_slo_ms,
            arrival_s=arrival_s,
            cache_salt=effective_cache_salt(chat.cache_salt, request_tenant(request), self.settings.cache_salt_per_api_key),
            image_grids=prompt.image_grids,
            rope_delta=prompt.rope_delta,
            image_tokens=prompt.image_tokens,
            positions=prompt.positions,
            image_token_id=self.prompts.placeholder_id,
            image_variants=prompt.image_variants,
        )

    # -- steps 6-7 ----------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        return await self.serve(request, "chatcmpl", self._chat)

    async def _chat(self, request: Request, request_id: str, arrival_s: float) -> Response:
        chat = await self.parse(request)
        plan = await self.plan_output(chat)
        job = await self.build_job(request, chat, request_id, arrival_s, plan)
        generation, first = await self.start(request, job, chat.stop_sequences)
        if job.sampling.n > 1:
            choices = self.choices(request, generation, first, chat.stop_sequences)
            shapers = [ReplyShaper(plan.parser) for _ in range(choices.n)]
            if chat.stream:
                return sse_response(self.guarded_stream(choices, self._sse_n(chat, choices, shapers)), request_id)
            return await self._complete_n(request, chat, choices, shapers)
        shaper = ReplyShaper(plan.parser)
        if chat.stream:
            return sse_response(self.guarded_stream(generation, self._sse(chat, generation, first, shaper)), request_id)
        return await self._complete(request, chat, generation, first, shaper)

    async def start(self, request: Request, job: ChatJob, stops: list[str]) -> tuple[Generation, TokenEvent]:
        """Hand ``job`` to the backend and wait for its first event (see the module docstring, step 6)."""
        self.metrics.prompt_tokens.inc(len(job.token_ids))
        detok = IncrementalDetokenizer(self.prompts.decode_tokenizer, stops)
        generation = Generation(job, self.backend.generate(job), detok, self.metrics, time.monotonic())
        try:
            request.state.job, request.state.generation = job, generation   # for the request's record (serve)
            first = await unless_disconnected(request, generation.first_event(self.settings.deadline_grace_ms / 1e3))
        except BaseException:
            await generation.close()
            raise
        log.debug("request %s admitted: %d prompt tokens, %d images, max_tokens %d",
                  job.request_id, len(job.token_ids), len(job.images), job.max_tokens)
        return generation, first

    def choices(self, request: Request, generation: Generation, first: TokenEvent, stops: list[str]) -> Choices:
        """``n`` > 1: the started request's choices, each with its own detokenizer and stop strings."""
        detoks = [IncrementalDetokenizer(self.prompts.decode_tokenizer, stops) for _ in range(generation.job.sampling.n)]
        choices = Choices(generation, first, detoks, self.metrics, generation.submitted_s)
        request.state.generation = choices   # the request's record counts every choice
        return choices

    async def serve(self, request: Request, id_prefix: str,
                    work: Callable[[Request, str, float], Awaitable[Response]]) -> Response:
        """The envelope of every generating endpoint: the request id and its clock, the pre-body shed,
        and each failure counted and turned into its OpenAI error."""
        hidden_wait_s = self.loop_lag.recent_s()   # waited for this loop before this line ran
        arrival_s = time.monotonic() - hidden_wait_s
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        request.state.request_id = request_id
        request.state.job = request.state.generation = None
        try:
            self._shed_if_backlogged(request, hidden_wait_s)
            response = await work(request, request_id, arrival_s)
            generation = request.state.generation
            if generation is not None and not isinstance(response, SSEResponse):   # a stream records its own end
                self.journal_end(request_id, generation.job, generation, generation.finish_reason or "stop",
                                 response.status_code)
            return response
        except ClientDisconnected:
            self.metrics.failure.labels(reason="cancelled").inc()
            log.info("request %s: client disconnected, cancelled", request_id)
            self.journal_end(request_id, request.state.job, request.state.generation, "cancelled", 499)
            return Response(status_code=499)  # nobody is listening; for the access log
        except Exception as exc:
            error = self._count_failure(exc)
            self.journal_end(request_id, request.state.job, request.state.generation,
                             "internal" if error is None else failure_reason(error),
                             500 if error is None else error.status,
                             exc.terms if isinstance(exc, AdmissionRefused) else None)
            if error is None:
                raise
            error.headers.setdefault("x-request-id", request_id)
            raise error from None

    async def build_prompt(self, chat: ChatCompletionRequest, images: list[PreparedImage],
                           tools: list[dict[str, Any]] | None = None) -> BuiltPrompt:
        """Token ids (and images' grids, rope delta): here when the build is small (``cheap_build``), else in a
        worker thread; at most ``prompt_workers`` threaded builds run at once. A slot is held until its
        thread ends, even when the request is cancelled meanwhile (a thread cannot be)."""
        pictures = [im.image for im in images]
        if self.prompts.cheap_build(chat.messages, pictures, tools):
            return self.prompts.build_prompt(chat.messages, pictures, tools)
        async with self._prompt_slots:
            build = asyncio.ensure_future(asyncio.to_thread(self.prompts.build_prompt, chat.messages, pictures, tools))
            try:
                return await asyncio.shield(build)
            except asyncio.CancelledError:
                await asyncio.gather(build, return_exceptions=True)
                raise

    def slo(self, request: Request, header: str, default_ms: float) -> float:
        return parse_slo_header(request.headers.get(header), default_ms, header, self.settings.max_slo_ms)

    def _shed_if_backlogged(self, request: Request, hidden_wait_s: float) -> None:
        """Refuse before reading the body when the wait so far plus the admitted backlog already
        miss the deadline (cheap, so an overloaded gateway spends little on what it refuses)."""
        ttft_slo_ms = self.slo(request, TTFT_HEADER, self.settings.ttft_slo_ms)
        wait_ms = self.backend.shed_estimate_ms() + hidden_wait_s * 1000
        if wait_ms > ttft_slo_ms:   # retry once the excess has drained, as admission's refusals say
            raise AdmissionRefused(429, "request refused at admission: the pipeline backlog exceeds the TTFT deadline",
                                   retry_wait_ms(wait_ms - ttft_slo_ms) / 1000.0)

    def journal_end(self, request_id: str, job: ChatJob | None, generation: Generation | None, outcome: str,
                    status: int, refused: dict[str, float] | None = None) -> None:
        """The request's one record (``gateway.request_journal``): called once on every path. A refused
        request's breakdown is what admission weighed (``refused``: ``AdmissionRefused.terms``)."""
        breakdown = dict(generation.ttft_breakdown) if generation is not None else {}
        if refused and not breakdown:
            breakdown = {k: round(v, 3) for k, v in refused.items()}
        self.journal.ended(RequestRecord(
            request_id, outcome, status,
            placement=job.placement if job else "", placement_reason=job.placement_reason if job else "",
            prompt_tokens=len(job.token_ids) if job else 0, images=len(job.images) if job else 0,
            completion_tokens=generation.completion_tokens if generation else 0,
            ttft_ms=breakdown.get("ttft_ms"), breakdown=breakdown))

    def _count_failure(self, exc: BaseException) -> ApiError | None:
        """Count a failed request by reason; return its ``ApiError``, or ``None`` for a bug (500)."""
        error = from_exception(exc)
        self.metrics.failure.labels(reason="internal" if error is None else failure_reason(error)).inc()
        return error

    async def guarded_stream(self, generation: Generation | Choices, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``body``'s events, then ``[DONE]``; an error after the headers goes into the stream as an error
        object; every path closes ``generation`` and counts a stream the client left as cancelled."""
        outcome: str | None = None   # "finished" or a failure reason; None at the end means cancelled
        try:
            async for event in body:
                yield event
            outcome = "finished"
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # after the headers: the error goes into the stream
            error = self._count_failure(exc)
            outcome = "internal" if error is None else failure_reason(error)
            if error is None:
                log.exception("request %s failed mid-stream", generation.job.request_id)
            document = error.body() if error is not None else internal_error_body(generation.job.request_id)
            yield b"data: " + json.dumps(document).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if outcome is None and generation.finish_reason is None:
                self.metrics.failure.labels(reason="cancelled").inc()
                log.info("request %s: stream closed early (client gone), cancelled", generation.job.request_id)
            await body.aclose()   # type: ignore[attr-defined]  # always an async generator here
            await generation.close()
            ended = (generation.finish_reason or "stop") if outcome == "finished" else (
                outcome or ("cancelled" if generation.finish_reason is None else generation.finish_reason))
            self.journal_end(generation.job.request_id, generation.job, generation, ended, 200)
