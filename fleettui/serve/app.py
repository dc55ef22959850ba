"""Provides `FleetServer`: the OpenAI-compatible Starlette app over a `ServedFleet` (sessions,
queue, metrics)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleettui.runtime.chat_format import ChatTemplateError
from fleettui.runtime.generation import Generation, GenerationParams, TokenLogprob
from fleettui.runtime.limits import RequestError as LimitError
from fleettui.runtime.limits import validate_request
from fleettui.runtime.session_pool import SessionPool
from fleettui.serve.admission import Admission, QueueFull, Ticket
from fleettui.serve.fleet import ServedFleet
from fleettui.serve.live import LiveRequest, LiveRequests
from fleettui.serve.metrics import ServerMetrics
from fleettui.serve.replies import StreamedReply, final_reply
from fleettui.serve.responses import (
    KEEPALIVE,
    Envelope,
    Logprobs,
    error_body,
    model_card,
    paced,
    sse,
)
from fleettui.serve.schema import CompletionRequest, RequestError, parse_request
from fleettui.serve.security import KeyChecker
from fleettui.serve.structured import Structure, checked_constraint
from fleettui.text_input import TextError, decode

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 * 2**20
KEEPALIVE_SECONDS = 15.0  # a stream that waits this long for its next token sends an SSE comment
Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Choice:
    """One of a request's `n` choices: its parameters (its own seed), its admission ticket, its
    live entry."""

    params: GenerationParams
    ticket: Ticket
    live: LiveRequest


# a choice's next text and its log-probs (None: it ended)
Piece = tuple[int, str | None, list[TokenLogprob]]


@dataclass(frozen=True)
class Outcome:
    generation: Generation
    prompt_tokens: int
    reused_tokens: int


def error_response(
    message: str, status: int, param: str | None = None, code: str | None = None, **headers: str
) -> JSONResponse:
    shown = message.encode(
        "utf-8", "backslashreplace"
    ).decode()  # a refused lone surrogate is quoted, not sent
    return JSONResponse(
        error_body(shown, status, param, code), status_code=status, headers=headers or None
    )


class FleetServer:
    """One HTTP front of a fleet: validation, admission, the session pool, generation jobs and
    metrics."""

    def __init__(
        self,
        fleet: ServedFleet,
        api_keys: tuple[str, ...] = (),
        max_sessions: int = 4,
        max_queued: int = 16,
        max_idle: int = 8,
    ) -> None:
        self.fleet = fleet
        self.model = fleet.model_info()
        self.defaults: GenerationParams = fleet.defaults()
        self.keys = KeyChecker(api_keys)
        self.admission = Admission(max_sessions, max_queued)
        self.pool = SessionPool(
            fleet.open_session, fleet.close_session, max_idle, max_open=max_sessions
        )
        self.metrics = ServerMetrics(fleet.stage_telemetry)
        self.jobs: set[asyncio.Task[Outcome]] = set()
        self.live = LiveRequests()  # who asks what, shown live by the TUI's API panel
        routes = [
            Route(
                "/v1/chat/completions", self._guard("chat", self.chat_completions), methods=["POST"]
            ),
            Route(
                "/v1/completions", self._guard("completions", self.completions), methods=["POST"]
            ),
            Route("/v1/models", self._guard("models", self.models), methods=["GET"]),
            Route(
                "/v1/models/{model:path}", self._guard("models", self.model_detail), methods=["GET"]
            ),
            Route("/metrics", self._guard("metrics", self.metrics_text), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ]
        handlers: dict[Any, Any] = {HTTPException: self._http_error, Exception: self._server_error}
        self.app = Starlette(routes=routes, exception_handlers=handlers)

    # -- plumbing
    # -----------------------------------------------------------------------------------
    def _client(self, request: Request) -> str:
        """Who asks, for the fair queue: the API key (a digest of it) when keys are required,
        else the address."""
        if self.keys.required:  # (only allowed keys get here)
            token = self.keys.presented(request.headers.get("authorization"))
            return "key:" + hashlib.sha256(token).hexdigest()[:16]
        return "host:" + (request.client.host if request.client else "?")

    def _guard(self, endpoint: str, handler: Handler) -> Handler:
        """Key check, OpenAI-style errors for anything unexpected, and the per-status request
        counter."""

        async def guarded(request: Request) -> Response:
            if not self.keys.allows(request.headers.get("authorization")):
                response: Response = error_response(
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    401,
                    code="invalid_api_key",
                    **{"WWW-Authenticate": "Bearer"},
                )
            else:
                try:
                    response = await handler(request)
                except RequestError as error:
                    response = error_response(error.message, error.status, error.param, error.code)
                except QueueFull as error:
                    response = error_response(
                        str(error),
                        429,
                        code="queue_full",
                        **{"Retry-After": str(error.retry_after)},
                    )
            self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        return guarded

    async def _http_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        # 405's Allow
        return error_response(str(error.detail), error.status_code, **(error.headers or {}))

    async def _server_error(self, request: Request, error: Exception) -> Response:
        log.exception("request %s failed", request.url.path, exc_info=error)
        return error_response(f"internal error: {type(error).__name__}", 500)

    async def _body(self, request: Request) -> Any:
        """The JSON body, refused with 413 as soon as it is known to exceed MAX_BODY_BYTES (never
        read whole)."""
        too_large = RequestError(
            f"the request body is larger than {MAX_BODY_BYTES} bytes", None, 413
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise too_large
            chunks.append(chunk)
        # the one text rule: strict UTF-8 (JSON's encoding), naming the first bad byte's offset
        try:
            text = decode(b"".join(chunks), "the request body", hint="JSON is UTF-8")
        except TextError as error:
            raise RequestError(str(error), None) from None
        try:
            return json.loads(text)
        except ValueError as error:
            raise RequestError(f"malformed JSON in the request body: {error}", None) from None

    def _update_gauges(self) -> None:
        self.metrics.active.set(self.admission.active)
        self.metrics.queued.set(self.admission.queued)
        self.metrics.pooled.set(self.pool.idle)

    # -- endpoints
    # ----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        stages = await self.fleet.stage_health()
        ready = bool(stages) and all(stage.up for stage in stages)
        body = {
            "status": "ok" if ready else "unavailable",
            "model": self.model.name,
            "stages": [{"name": s.name, "up": s.up, "detail": s.detail} for s in stages],
            "active": self.admission.active,
            "queued": self.admission.queued,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def openapi(self, request: Request) -> Response:
        from fleettui.serve.openapi import openapi_document

        return JSONResponse(openapi_document(self.model, self.keys.required))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(self.model)]})

    async def model_detail(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model.name:
            raise RequestError(
                f"The model '{name}' does not exist", "model", 404, "model_not_found"
            )
        return JSONResponse(model_card(self.model))

    async def metrics_text(self, request: Request) -> Response:
        self._update_gauges()
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        body = await self._body(request)
        parsed = parse_request(
            body, chat, self.model.name, self.defaults, self.model.context_length
        )
        structure = parsed.structure
        if parsed.messages is not None:
            # a base model (no template) or a template's own raise_exception: 400, never a made-up
            # prompt
            try:
                prompt = self.fleet.encode_chat(list(parsed.messages), structure.tools)
            except ChatTemplateError as error:
                raise RequestError(str(error), "messages", code="chat_template") from None
            field = "messages"
        else:
            assert parsed.prompt is not None
            prompt = self.fleet.encode_text(parsed.prompt)
            field = "prompt"
        room = self.model.context_length - len(prompt)
        if room <= 0:
            raise RequestError(
                f"the prompt is {len(prompt)} tokens; this model's context is "
                f"{self.model.context_length}",
                field,
                code="context_length_exceeded",
            )
        constraint = await checked_constraint(structure, self.fleet)
        params = replace(
            parsed.sampling.params(self.defaults.max_tokens, room), constraint=constraint
        )
        try:  # the coordinator's own edge check, so the API and the CLI refuse the same requests
            validate_request(params, len(prompt), self.model.context_length)
        except LimitError as error:
            raise RequestError(str(error), error.field) from None
        client = self._client(request)
        tickets: list[Ticket] = []
        try:  # QueueFull -> 429 before any byte of the response, for every choice or none
            tickets += [self.admission.admit(client) for _ in range(parsed.n)]
        except QueueFull:
            for ticket in tickets:
                ticket.release()
            raise
        address = f"{request.client.host}:{request.client.port}" if request.client else "?"
        asked = parsed.messages[-1].content if parsed.messages else (parsed.prompt or "")
        choices = [
            Choice(
                replace(params, seed=params.seed + index),
                ticket,
                self.live.begin(
                    address,
                    "chat" if chat else "completions",
                    asked,
                    len(prompt),
                    constraint.label if constraint else "",
                ),
            )
            for index, ticket in enumerate(tickets)
        ]
        if parsed.stream:
            return self._stream(parsed, prompt, choices, chat)
        return await self._answer(request, prompt, choices, chat, structure)

    # -- generation
    # ---------------------------------------------------------------------------------
    def _start_job(
        self,
        prompt: list[int],
        params: GenerationParams,
        ticket: Ticket,
        on_delta: Callable[[str, list[TokenLogprob]], None],
        live: LiveRequest,
    ) -> asyncio.Task[Outcome]:
        job = asyncio.get_running_loop().create_task(
            self._generate(prompt, params, ticket, on_delta, live)
        )
        self.jobs.add(job)
        job.add_done_callback(self.jobs.discard)
        # A job cancelled before it ever ran skips its own `finally`: release its slot and entry
        # here too.
        job.add_done_callback(lambda _: self._forget(ticket, live))
        return job

    def _forget(self, ticket: Ticket, live: LiveRequest) -> None:
        ticket.release()
        self.live.end(live, "stopped")

    async def _generate(
        self,
        prompt: list[int],
        params: GenerationParams,
        ticket: Ticket,
        on_delta: Callable[[str, list[TokenLogprob]], None],
        live: LiveRequest,
    ) -> Outcome:
        """Wait for a slot, lease a session, generate; the session goes back to the pool only if
        all went well."""
        admitted = time.perf_counter()
        lease = None
        completed = False
        try:
            self._update_gauges()
            await ticket.wait()
            live.state = "generating"
            self._update_gauges()
            lease = await self.pool.acquire(prompt, params.seed)
            last: list[float] = []
            # log-probs of tokens whose text is not out yet wait for it
            session, unsent = (
                lease.session,
                0,
            )

            def on_tokens(tokens: list[int], delta: str) -> None:
                nonlocal unsent
                now = time.perf_counter()
                if tokens:
                    live.tokens += len(tokens)
                    if live.first_token is None:
                        live.first_token = time.monotonic()
                    if last:
                        self.metrics.inter_token.observe(now - last[0])
                    else:
                        self.metrics.ttft.observe(now - admitted)
                    last[:] = [now]
                if delta:
                    on_delta(delta, session.logprobs[unsent:])
                    unsent = len(session.logprobs)

            started = time.perf_counter()
            generation = await self.fleet.generate(lease.session, prompt, params, on_tokens)
            self.admission.record(time.perf_counter() - started)
            completed = True
            self._record(generation, len(prompt))
            return Outcome(generation, len(prompt), lease.reused_tokens)
        finally:
            ticket.release()
            self.live.end(live, "done" if completed else "stopped")
            if lease is not None:
                # A cancelled or failed step may have reached the stages without the ledger knowing:
                # such a session is closed on every stage, never reused.
                try:
                    await self.pool.release(lease.session, reusable=completed)
                except Exception as error:
                    log.warning("could not release session %d: %s", lease.session.id, error)
            self._update_gauges()

    def _record(self, generation: Generation, prompt_tokens: int) -> None:
        stats = generation.stats
        self.metrics.tokens.labels("prompt").inc(prompt_tokens)
        self.metrics.tokens.labels("completion").inc(stats.tokens)
        if stats.acceptance_rate is not None:
            self.metrics.acceptance.set(stats.acceptance_rate)
        self.metrics.mean_k.set(stats.mean_k)

    async def _answer(
        self,
        request: Request,
        prompt: list[int],
        choices: list[Choice],
        chat: bool,
        structure: Structure,
    ) -> Response:
        jobs = [
            self._start_job(prompt, c.params, c.ticket, lambda _delta, _logprobs: None, c.live)
            for c in choices
        ]
        everything = asyncio.ensure_future(asyncio.wait(jobs))
        watcher = asyncio.get_running_loop().create_task(_disconnected(request))
        try:
            await asyncio.wait({everything, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            everything.cancel()
            # the client left (or this handler was cancelled)
            left = [job for job in jobs if not job.done()]
            for job in left:
                job.cancel()
            if left:
                self.metrics.disconnects.inc()
        if any(job.cancelled() for job in jobs):
            return error_response("the client closed the connection", 499)
        for job in jobs:
            error = job.exception()
            if error is not None:
                return _generation_error(error)
        outcomes = [job.result() for job in jobs]
        answers = []
        for choice, outcome in zip(choices, outcomes, strict=True):
            generation, logprobs = outcome.generation, None
            if choice.params.logprobs is not None:
                logprobs = Logprobs(chat, self.fleet.token_bytes).of(generation.logprobs)
            reply = final_reply(
                generation.text, generation.stats, structure, self.fleet.tool_format()
            )
            choice.live.tool_calls += [call.name for call in reply.tool_calls]
            answers.append((reply, generation.stats, logprobs))
        envelope = Envelope(chat, self.model.name)
        return JSONResponse(
            envelope.complete(answers, outcomes[0].prompt_tokens, outcomes[0].reused_tokens)
        )

    def _stream(
        self, parsed: CompletionRequest, prompt: list[int], choices: list[Choice], chat: bool
    ) -> StreamingResponse:
        # (choice, text, log-probs); text None: that choice ended. (`paced` ends a queue at None:
        # never sent.)
        pieces: asyncio.Queue[Piece | None] = asyncio.Queue()
        jobs = []
        for index, choice in enumerate(choices):
            put = functools.partial(
                lambda i, text, entries: pieces.put_nowait((i, text, entries)), index
            )
            jobs.append(self._start_job(prompt, choice.params, choice.ticket, put, choice.live))
            jobs[-1].add_done_callback(
                functools.partial(lambda i, _: pieces.put_nowait((i, None, [])), index)
            )
        envelope = Envelope(chat, self.model.name)
        usage = parsed.include_usage
        wanted = choices[0].params.logprobs is not None
        logprobs = [Logprobs(chat, self.fleet.token_bytes) if wanted else None for _ in choices]
        tool_format = self.fleet.tool_format()
        replies = [
            StreamedReply(
                parsed.structure if chat else Structure(),
                tool_format,
                choice.live.tool_calls.append,
            )
            for choice in choices
        ]

        async def events() -> AsyncIterator[bytes]:
            try:
                for index in range(len(choices)):
                    yield sse(
                        envelope.chunk(
                            "" if chat else None, first=True, with_usage=usage, index=index
                        )
                    )
                sent, ended, failure = [0] * len(choices), 0, None
                waiting: list[list[TokenLogprob]] = [[] for _ in choices]
                async for piece in paced(pieces, KEEPALIVE_SECONDS):
                    if piece is None:
                        yield KEEPALIVE
                        continue
                    index, delta, entries = piece
                    shaper = logprobs[index]
                    if delta is not None:
                        waiting[index] += entries  # log-probs go out with the next chunk there is
                        for part in replies[index].push(delta) if chat else [{"text": delta}]:
                            sent[index] += len(waiting[index])
                            shown = shaper.of(waiting[index]) if shaper is not None else None
                            waiting[index] = []
                            text = part.get("text") if not chat else None
                            yield sse(
                                envelope.chunk(
                                    text,
                                    with_usage=usage,
                                    logprobs=shown,
                                    index=index,
                                    delta=part if chat else None,
                                )
                            )
                        continue
                    job = jobs[index]
                    error = asyncio.CancelledError() if job.cancelled() else job.exception()
                    if error is not None:
                        failure = _generation_error(error)
                        break
                    generation = job.result().generation
                    held, finish = replies[index].finish(generation.stats)
                    for part in held:
                        yield sse(envelope.chunk(None, with_usage=usage, index=index, delta=part))
                    rest = generation.logprobs[sent[index] :]
                    # text held back
                    shown = shaper.of(rest) if shaper is not None and rest else None
                    yield sse(
                        envelope.chunk(None, finish, with_usage=usage, logprobs=shown, index=index)
                    )
                    ended += 1
                    if ended == len(choices):
                        break
                if failure is not None:  # one choice failed: the stream ends with its error
                    yield sse(json.loads(bytes(failure.body)))
                elif usage:
                    outcome = jobs[0].result()
                    completion = sum(job.result().generation.stats.tokens for job in jobs)
                    yield sse(
                        envelope.usage_chunk(
                            completion, outcome.prompt_tokens, outcome.reused_tokens
                        )
                    )
                yield sse("[DONE]")
            finally:
                # Runs when the client disconnects too (Starlette cancels this generator): no
                # awaiting here, each job's own cleanup closes its session on every stage.
                left = [job for job in jobs if not job.done()]
                for job in left:
                    job.cancel()
                if left:
                    self.metrics.disconnects.inc()

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def close(self) -> None:
        """Cancel every generation, wait for their cleanup, close the pooled sessions."""
        for job in list(self.jobs):
            job.cancel()
        if self.jobs:
            await asyncio.gather(*self.jobs, return_exceptions=True)
        await self.pool.close_all()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _generation_error(error: BaseException) -> JSONResponse:
    from fleettui.runtime.transport import LinkError

    if isinstance(error, LinkError):
        return error_response(f"the fleet could not answer: {error}", 503, code="fleet_unavailable")
    if isinstance(error, asyncio.CancelledError):
        return error_response("the generation was cancelled (the server is stopping)", 503)
    log.error("generation failed: %r", error, exc_info=error)
    return error_response(f"generation failed: {type(error).__name__}: {error}", 500)
