"""``create_app(engine, settings)``: the OpenAI-compatible HTTP API over one engine."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from specdec.draft_vocab import head_size
from specdec.draft_window import window_of
from specdec.engine import Engine, Generation, GenerationResult
from specdec.runtime.native import kv_dtype_of
from specdec.server.errors import APIError, install_handlers
from specdec.server.guard import Guard
from specdec.server.observe import ServerMetrics
from specdec.server.requests import (
    chat_builder,
    check_chat_template,
    check_supported,
    choices,
    completion_builder,
    has_chat_template,
)
from specdec.server.responses import DONE, Reply, sse, summary
from specdec.server.scheduler import Done, Failed, Job, Prompt, Scheduler, Started, Step
from specdec.server.schemas import (
    MAX_N,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    _Common,
)
from specdec.server.settings import ServerSettings
from specdec.server.tools import tool_plan

log = logging.getLogger("specdec.server")
_API_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429)}


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving ``engine``; the scheduler's worker thread starts with the app (or the first request)."""
    settings = settings or ServerSettings()
    if settings.chat_template is not None:
        check_chat_template(engine.tokenizer, settings.chat_template)
    # The vocabulary prepared for output formats now, not by the first request that asks for one (in the worker's
    # step, which every request in flight waits on: ~40 ms for 8k tokens, about a second for 128k).
    why_not = engine.formats.prepare()
    if why_not is not None:
        log.warning("response_format will be refused: %s", why_not)
    scheduler = Scheduler(
        engine, max_active=settings.max_active, max_queue=settings.max_queue, max_batch=settings.max_batch
    )
    engine.prefill_in_step = settings.prefill_tokens_in_step
    engine.chain_plain = settings.chain_passes
    metrics = ServerMetrics(engine, scheduler)
    scheduler.on_step = metrics.observe_pass

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        metrics.threads.watch_current("event_loop")  # the lifespan runs on the event loop's thread
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(
        title="specdec", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan, version=_version()
    )
    app.state.engine = engine
    app.state.scheduler = scheduler
    app.state.settings = settings
    install_handlers(app)
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    api = _Api(engine, settings, scheduler)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Complete a prompt (string or token ids). ``stream: true`` answers with server-sent events."""
        api.check_request(body)
        rid = _request_id()
        return await api.serve(
            request,
            body,
            completion_builder(body, rid),
            Reply(f"cmpl-{rid}", _now(), settings.model_name, "completion", engine.tokenizer, echo=_echo(body)),
            rid,
        )

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Continue a conversation rendered with the model's chat template."""
        api.check_request(body)
        if not has_chat_template(engine.tokenizer, settings.chat_template):
            raise APIError(
                400,
                f"model {settings.model_name!r} has no chat template (its tokenizer defines none): "
                "use /v1/completions with a plain prompt, or start the server with --chat-template",
                "messages",
                "no_chat_template",
            )
        rid = _request_id()
        plan = tool_plan(body)  # the reply is tool calls: generated under their schema, answered as calls
        return await api.serve(
            request,
            body,
            chat_builder(body, rid, settings.chat_template, plan),
            Reply(f"chatcmpl-{rid}", _now(), settings.model_name, "chat", engine.tokenizer, tools=plan),
            rid,
        )

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        """The one model this server serves."""
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str) -> dict[str, Any]:
        """The served model's card (404 for any other id)."""
        api.check_model(model_id)
        return api.model_card()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness and load: requests running and waiting."""
        return {
            "status": "ok",
            "model": settings.model_name,
            # Whether one pass serves many requests (the native runtime's CPU kernel), or each runs its own.
            "batched_passes": engine.target.batches,
            "drafter": engine.drafter.name if engine.drafter is not None else None,  # "model", "bridge", ...
            "draft_head": head_size(
                getattr(engine.drafter, "runner", None)
            ),  # tokens the draft's output head computes (draft_vocab), or "full"
            # the latest tokens the draft attends to (draft_window), or "full"
            "draft_window": window_of(getattr(engine.drafter, "runner", None)),
            "costs": engine.costs_note,
            "prefill_in_step": engine.prefill_in_step,  # prompt tokens a batched step takes in, at most
            "chain_plain": engine.chain_plain,  # target passes a plain step chains
            "stream_interval": settings.stream_interval,  # tokens a streamed choice gathers before its text is sent
            "stream_interval_ms": settings.stream_interval_ms,  # and the milliseconds since its last chunk
            "runtime": getattr(engine.target, "backend", type(engine.target).__name__),
            # the KV caches' element type on the CPU kernel (kv_dtype): "bf16", "fp16", "fp32"; None elsewhere
            "kv_dtype": kv_dtype_of(engine.target),
            # the target's kept prefixes (--prefix-cache): size and hits; None when off
            "prefix_cache": None if engine.target.prefix_cache is None else engine.target.prefix_cache.describe(),
            **_compute_threads(),
            **scheduler.snapshot(),
        }

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text exposition of the speculative-decoding and server metrics."""
        return Response(metrics.render(), media_type=metrics.content_type)

    _mount_static(app, settings)
    return app


class _Api:
    """Request handling shared by both generation endpoints."""

    def __init__(self, engine: Engine, settings: ServerSettings, scheduler: Scheduler) -> None:
        self.engine = engine
        self.settings = settings
        self.scheduler = scheduler
        self.started = _now()

    def model_card(self) -> dict[str, Any]:
        drafter = self.engine.drafter.name if self.engine.drafter is not None else None
        return {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "specdec",
            "max_context": self.engine.max_context,
            "drafter": drafter,
        }

    def check_request(self, body: _Common) -> None:
        self.check_model(body.model)
        check_supported(body)
        max_n = min(MAX_N, self.settings.max_batch, self.settings.max_active)
        if choices(body) > max_n:
            prompts = choices(body) // body.n
            many = f"{prompts} prompts × n={body.n}" if prompts > 1 else f"n={body.n}"
            raise APIError(
                400,
                f"{many} is more samples than this server runs together (at most {max_n}: "
                f"--max-batch {self.settings.max_batch}, --max-active {self.settings.max_active})",
                "n",
                "invalid_value",
            )

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist: this server serves {self.settings.model_name!r}",
                "model",
                "model_not_found",
            )

    async def serve(
        self, request: Request, body: _Common, build: Callable[[Engine], list[Generation]], reply: Reply, rid: str
    ) -> Response:
        want_steps = bool(body.speculative and body.speculative.steps)
        job = Job(
            request_id=rid,
            build=build,
            loop=asyncio.get_running_loop(),
            deadline=time.monotonic() + self.settings.request_timeout,
            want_steps=want_steps,
            n=choices(body),
            prompts=choices(body) // body.n,
            stream=bool(body.stream),
            stream_interval=self.settings.stream_interval,
            stream_wait=self.settings.stream_interval_ms / 1000.0,
        )
        self.scheduler.submit(job)
        messages = job.messages()
        # Until the response starts, watch for a client that hangs up (queued or mid-generation) ourselves.
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job, self.scheduler))
        streaming = False
        try:
            first = await anext(messages)
            if isinstance(first, Failed):
                raise first.error
            assert isinstance(first, Started)
            headers = {"X-Request-ID": rid}
            if not body.stream:
                return await self._collect(messages, reply, choices(body), first.prompt_tokens, want_steps, headers)
            streaming = True
        finally:
            if not streaming:
                watcher.cancel()
                self.scheduler.cancel(job)  # a no-op once the job finished
        # From here the watcher goes on: a client that hangs up cancels the job, whose stream then ends.
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _Events(reply, choices(body), first.prompt_tokens, want_steps, include_usage, first.prompts)
        return _EventStream(
            stream, job, self.scheduler, watcher, {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def _collect(
        self,
        messages: AsyncIterator[Any],
        reply: Reply,
        n: int,
        prompt_tokens: int,
        want_steps: bool,
        headers: dict[str, str],
    ) -> Response:
        """Wait for the whole result (all n samples)."""
        steps: list[dict[str, Any]] = []
        results: dict[int, GenerationResult] = {}
        async for msg in messages:
            if isinstance(msg, Step) and msg.detail is not None:
                steps.append(msg.detail)
            elif isinstance(msg, Failed):
                raise msg.error
            elif isinstance(msg, Done):
                results[msg.index] = msg.result
                if len(results) == n:
                    ordered = [results[j] for j in range(n)]
                    body = reply.response(ordered, prompt_tokens, steps if want_steps else None)
                    return JSONResponse(body, headers=headers)
        raise APIError(500, "the request ended without a result", None, "internal_error")


class _Events:
    """A streaming request's messages as SSE chunks: text as it is verified, then a closing chunk with the finish
    reason and stats, per choice (``index``); after the last choice's, the usage chunk (when asked) and ``[DONE]``.

    A request asking for logprobs gets them in the chunk of the step that committed the tokens (the text of a token
    can come in a later chunk: text is held back while it might be partial UTF-8 or a stop string's prefix)."""

    def __init__(
        self,
        reply: Reply,
        n: int,
        prompt_tokens: int,
        want_steps: bool,
        include_usage: bool,
        prompts: list[Prompt] | None = None,
    ) -> None:
        self.reply, self.n, self.prompt_tokens = reply, n, prompt_tokens
        self.want_steps, self.include_usage = want_steps, include_usage
        self.prompts = prompts or []  # each choice's prompt ids and scores (``Started``): an echo's first chunk
        self.results: dict[int, GenerationResult] = {}
        self.offsets = [0] * n  # completions' text_offset of each choice, across its chunks
        self.ended = False  # all n choices done, or the request failed

    def opening(self) -> bytes:
        """A stream's first chunks: a chat's each choice's role; a completion with ``echo`` each choice's prompt (with
        ``logprobs``, its tokens' scores), before its own text."""
        reply = self.reply
        if reply.kind == "chat":
            return b"".join(reply.chunk("", index=index, role=True) for index in range(self.n))
        if reply.echo is None:
            return b""
        out = []
        for index, prompt in enumerate(self.prompts):
            text = reply.echo_text(index, self.n, prompt.prompt_ids)
            logprobs = reply.logprobs([], 0, prompt=prompt) if prompt.prompt_logprobs is not None else None
            if logprobs is not None:
                self.offsets[index] += sum(len(t) for t in logprobs["tokens"])
            out.append(reply.chunk(text, index=index, logprobs=logprobs))
        return b"".join(out)

    def events(self, msg: Any) -> list[bytes]:
        reply = self.reply
        if isinstance(msg, Step):
            lps = msg.event.logprobs
            # A reply that is to be tool calls is held back: its calls go out whole when it ends (as text if cut).
            text = msg.event.text if reply.tools is None else None
            if text or self.want_steps or lps:
                extra = {"speculative": {"step": msg.detail}} if self.want_steps else None
                logprobs = reply.logprobs(lps, self.offsets[msg.index])
                if logprobs is not None and reply.kind == "completion":
                    self.offsets[msg.index] += sum(len(t) for t in logprobs["tokens"])
                return [reply.chunk(text, index=msg.index, extra=extra, logprobs=logprobs)]
        elif isinstance(msg, Done):
            self.results[msg.index] = msg.result
            extra = {"speculative": summary([msg.result])}
            out = []
            calls = reply.tool_calls(msg.result)
            if calls is not None:
                out.append(reply.chunk(None, "tool_calls", index=msg.index, extra=extra, tool_calls=calls))
            else:
                if reply.tools is not None and msg.result.text:  # held back, and not a whole call: its text
                    out.append(reply.chunk(msg.result.text, index=msg.index))
                out.append(reply.chunk(None, msg.result.finish_reason, index=msg.index, extra=extra))
            if len(self.results) == self.n:
                self.ended = True
                if self.include_usage:
                    out.append(reply.usage_chunk(self.prompt_tokens, list(self.results.values())))
                out.append(DONE)
            return out
        elif isinstance(msg, Failed):
            self.ended = True
            return [sse(msg.error.body()), DONE]  # headers are gone: report the failure in the stream
        return []


class _EventStream(Response):
    """The SSE response of a streaming request, written straight from its job's queue: each wake-up sends what has
    arrived (a request's last step comes with its end: one write for its text, its closing chunk, the usage, [DONE]
    and the end of the chunked body). Starlette's StreamingResponse adds a task group, a disconnect listener and two
    async generators to each request (0.2-0.3 ms of the event loop's CPU a request at 16 clients, on the cores the
    passes use); here the request's own watcher hears a disconnect and cancels the job, whose stream then ends with
    the worker's Failed."""

    media_type = "text/event-stream"

    def __init__(
        self, events: _Events, job: Job, scheduler: Scheduler, watcher: asyncio.Task[None], headers: dict[str, str]
    ) -> None:
        self.status_code = 200
        self.background = None
        self.events, self.job, self.scheduler, self.watcher = events, job, scheduler, watcher
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        events, queue = self.events, self.job.queue
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            head = events.opening()
            if head:
                await send({"type": "http.response.body", "body": head, "more_body": True})
            while not events.ended:
                out = events.events(await queue.get())
                while not events.ended and not queue.empty():  # what else arrived meanwhile: the same write
                    out += events.events(queue.get_nowait())
                if out or events.ended:  # the last chunks end the response in the same write
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": not events.ended})
        finally:
            self.watcher.cancel()
            self.scheduler.cancel(self.job)  # a no-op once the job finished


async def _cancel_on_disconnect(request: Request, job: Job, scheduler: Scheduler) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scheduler.cancel(job)
            return


def _mount_static(app: FastAPI, settings: ServerSettings) -> None:
    """The web playground at ``/``, when it is installed (after the API routes, so they win)."""
    static = settings.static_dir
    if static is None or not (static / "index.html").is_file():
        return
    from fastapi.staticfiles import StaticFiles
    from starlette.exceptions import HTTPException

    api_paths = _API_PATHS  # GET-only paths (/health, /metrics, /v1/models) never reach here: only wrong methods do

    class Playground(StaticFiles):
        """Static files; an API path asked with the wrong method is a 405, not a missing file."""

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] in api_paths:
                raise HTTPException(405, "Method Not Allowed")
            await super().__call__(scope, receive, send)

    app.mount("/", Playground(directory=str(static), html=True), name="playground")


def _now() -> int:
    return int(time.time())


def _request_id() -> str:
    """24 random hex digits (96 bits), as ``uuid.uuid4().hex[:24]`` gave, without building a UUID: made on the event
    loop for every request, where a server's loop profiled at 16 clients had ~3% of its samples in ``uuid4``."""
    return os.urandom(12).hex()


def _version() -> str:
    from specdec import __version__

    return __version__


def _echo(body: CompletionRequest) -> list[str | None] | None:
    """Each prompt's text a completion with ``echo`` puts before its choices': the prompt as sent; None for token ids,
    whose text the response decodes once the engine has checked them."""
    if not body.echo:
        return None
    return [p if isinstance(p, str) else None for p in body.prompts()]


def _compute_threads() -> dict[str, int]:
    """Threads of the model passes (``specdec serve --threads``) and of a step's lockstep draft."""
    from specdec.runtime.native_kernel import draft_threads, pass_threads

    return {"threads": pass_threads(), "draft_threads": draft_threads()}
