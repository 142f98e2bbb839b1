"""The HTTP front every family shares: chat and text completions, System One decisions, and
client hang-ups.

A family subclasses `Frontend` and fills in its hooks (error shape, ids, checks, what happens
before a request is admitted). A client that goes away, streamed or not, aborts its work at
once, after the family's lag (SGLang), or never (the `keep_generating_on_disconnect` fault,
and SGLang's decisions, which run to their end).

A decision (`POST /v1/systemone`, see `enginesim.decisions`) is one request in the engine
with no tokens: it waits for a slot, counts as running for the behaviour's
`decision_seconds` (its prefill), then is answered whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from enginesim import decisions
from enginesim.behaviour import Behaviour
from enginesim.engine import Engine, Finish, Token, Work
from enginesim.openai_chat import (
    Answer,
    ChatRequest,
    CompletionRequest,
    Dialect,
    EmbeddingRequest,
    GenerationRequest,
    JsonDict,
    ModelRequest,
    count_prompt_tokens,
    plan,
    random_id,
)
from enginesim.process import Process

if TYPE_CHECKING:
    from fastapi import FastAPI

RequestModel = TypeVar("RequestModel", bound=BaseModel)
Handler = Callable[[Request], Awaitable[Response]]


class HotPaths:
    """ASGI middleware of an instant engine: a POST to a generation route goes straight to
    its handler, past FastAPI's exception layer, routing and dependency injection, which
    would otherwise be most of what a short answer costs; every other request goes on.
    Added before the family's key check, so it runs inside it."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = None
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.routes.get(scope["path"])
        if handler is None:
            await self.app(scope, receive, send)
            return
        response = await handler(Request(scope, receive))
        if isinstance(response, StreamingResponse):
            # The handler watches for the client's hang-up itself and ends the work, which
            # ends the stream: no second listener and no task group for each answer.
            await response.stream_response(send)
        else:
            await response(scope, receive, send)


def generation_routes(front: Frontend, prefixes: Sequence[str]) -> dict[str, Handler]:
    """Chat and text completions at each of `prefixes`, chat's first."""
    generation = {"chat/completions": front.chat, "completions": front.completions}
    return {f"{prefix}/{path}": run for path, run in generation.items() for prefix in prefixes}


def add_generation(app: FastAPI, front: Frontend, prefixes: Sequence[str] = ("/v1",)) -> None:
    """The routes of chat and text completions (POST), at each of `prefixes`."""
    for path, run in generation_routes(front, prefixes).items():
        app.add_api_route(path, run, methods=["POST"])


def add_hot_paths(app: Starlette, front: Frontend, prefixes: Sequence[str] = ("/v1",)) -> None:
    """An instant engine's chat and text completions, at each of `prefixes`, on the lean path
    (`HotPaths`); a paced engine's go through FastAPI as every other route does."""
    if front.behaviour.instant:
        app.add_middleware(HotPaths, routes=generation_routes(front, prefixes))


def embedding_of(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()[:8]
    vector = [byte - 127.5 for byte in digest]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [round(v / norm, 6) for v in vector]


def explain(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"{where}: {first['msg']}"


class Frontend:
    dialect: Dialect
    force_usage = False  # vLLM --enable-force-include-usage
    decisions_run_to_end = False  # SGLang: a hang-up does not stop a decision

    def __init__(self, engine: Engine, behaviour: Behaviour, process: Process) -> None:
        self.engine = engine
        self.behaviour = behaviour
        self.process = process
        self._gone: weakref.WeakSet[Work] = weakref.WeakSet()

    # Hooks ------------------------------------------------------------------------------

    def error(self, status: int, message: str, kind: str = "BadRequestError") -> Response:
        raise NotImplementedError

    def fatal(self, reason: str) -> None:
        """The engine dies as the family shows it."""
        raise NotImplementedError

    def precheck(self, request: Request) -> Response | None:
        return None

    def check(self, body: GenerationRequest) -> Response | None:
        return None

    def request_ids(
        self, request: Request, body: GenerationRequest, prefix: str
    ) -> tuple[str, str]:
        """(the engine's request id, the response `id`): by default one random id for both."""
        rid = f"{prefix}{random_id(32)}"
        return rid, rid

    def response_headers(self, request: Request) -> dict[str, str]:
        return {}

    def model_name(self, body: ModelRequest) -> str:
        raise NotImplementedError

    def reasoning_on(self) -> bool:
        return False

    def tools_on(self) -> bool:
        return True

    def disconnect_lag(self, stream: bool) -> float:
        return 0.0

    async def admit(self) -> Response | None:
        """Before a request enters the engine: a refusal, or None to go on."""
        return None

    def submit(self, work: Work) -> None:
        """Hand a request to the engine (a family may keep its own state of it too)."""
        self.engine.submit(work)

    def abort_gone(self, work: Work) -> None:
        """Stop the work of a client that went away."""
        self.engine.abort(work)

    # Decision hooks ---------------------------------------------------------------------

    def decisions_unsupported(self) -> Response | None:
        """Before the body is read: the engine cannot answer decisions at all."""
        return None

    def decision_limits(self) -> decisions.Limits:
        return decisions.Limits()

    def decision_invalid(self, problems: list[decisions.Problem]) -> Response:
        """A request that is not a valid System One request, in the family's shape."""
        return self.error(400, "; ".join(problem.text() for problem in problems))

    def decision_refusal(self, body: decisions.DecisionRequest) -> Response | None:
        """A valid request the server refuses (its model name, its setup, its size)."""
        return None

    def decision_body(self, body: decisions.DecisionRequest, work: Work) -> JsonDict:
        """The answer to a decision that ran as `work`."""
        raise NotImplementedError

    def arm_death(self) -> None:
        """The `die_after_seconds` fault: the engine dies that long after it is up."""
        after = self.behaviour.faults.die_after_seconds
        if after is not None:
            self.process.later(after, lambda: self.fatal("died"))

    # Handlers ---------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await self.read_json(request, ChatRequest)
        if isinstance(body, Response):
            return body

        def planned() -> tuple[list[Token], Finish]:
            return self.plan_answer(self._tool(body), body.limit, bool(body.ignore_eos))

        return await self._generate(request, body, planned)

    async def completions(self, request: Request) -> Response:
        body = await self.read_json(request, CompletionRequest)
        if isinstance(body, Response):
            return body
        return await self._generate(
            request,
            body,
            lambda: plan(self.engine.answer(), "", None, body.max_tokens, bool(body.ignore_eos)),
        )

    async def embeddings(self, request: Request) -> Response:
        """One deterministic 8-dimension unit vector per input (a digest of its text)."""
        body = await self.read_json(request, EmbeddingRequest)
        if isinstance(body, Response):
            return body
        refusal = self.precheck(request)
        if refusal is not None:
            return refusal
        inputs = [body.input] if isinstance(body.input, str) else list(body.input)
        data = [
            {"object": "embedding", "index": i, "embedding": embedding_of(str(text))}
            for i, text in enumerate(inputs)
        ]
        tokens = sum(count_prompt_tokens(str(text)) for text in inputs)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": self.model_name(body),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def decide(self, request: Request) -> Response:
        """System One: checked, refused or admitted, held in the engine as one request for
        `decision_seconds`, then answered (never streamed)."""
        refusal = self.precheck(request) or self.decisions_unsupported()
        if refusal is not None:
            return refusal
        try:
            body = decisions.parse(await request.body(), self.decision_limits())
        except decisions.Invalid as exc:
            return self.decision_invalid(exc.problems)
        refusal = self.decision_refusal(body) or await self.admit()
        if refusal is not None:
            return refusal
        work = Work(
            f"systemone-{uuid.uuid4().hex}",
            decisions.prompt_tokens(body),
            [],
            "stop",
            prefill_seconds=self.behaviour.decision_seconds,
            runs_to_end=self.decisions_run_to_end,
        )
        failure = await self.run_whole(request, work)
        if failure is not None:
            return failure
        return JSONResponse(self.decision_body(body, work), headers=self.response_headers(request))

    async def run_whole(self, request: Request, work: Work) -> Response | None:
        """Hand admitted `work`, which makes no tokens (a decision, a rerank), to the engine
        and wait for its end: the family's 500 if it failed or was aborted, else None. A
        client that goes away meanwhile aborts it as the family aborts a request."""
        self.submit(work)
        await self._until_done(request, work, stream=False)
        if work.finish == "error":
            return self.error(500, work.error or "internal error", "InternalServerError")
        if work.finish == "abort":
            return self.error(500, "The request was aborted.", "InternalServerError")
        return None

    # Other APIs on the same engine (enginesim.responses_api, enginesim.messages_api) ------

    def plan_answer(
        self, tool: tuple[str, str] | None, limit: int | None, ignore_eos: bool = False
    ) -> tuple[list[Token], Finish]:
        """What a chat-like request gets: the reasoning where the family parses it, then the
        call of `tool`, or else the engine's answer by now (`openai_chat.plan`)."""
        reasoning = self.behaviour.reasoning if self.reasoning_on() else ""
        return plan(self.engine.answer(), reasoning, tool, limit, ignore_eos)

    def tool_for(self, body: ChatRequest) -> tuple[str, str] | None:
        """The call (name, JSON arguments) the model makes for a request in chat's terms,
        or None: another API's request is decided as its chat conversion would be."""
        return self._tool(body)

    # Plumbing ---------------------------------------------------------------------------

    async def read_json(
        self,
        request: Request,
        model: type[RequestModel],
        invalid: Callable[[object, str], Response] | None = None,
    ) -> RequestModel | Response:
        """The body as `model`, or the family's 400 (after its own checks of the request);
        `invalid` answers a body an API reads its own way (the parsed body, or None)."""
        refuse = invalid or (lambda _, message: self.error(400, message))
        refusal = self.precheck(request)
        if refusal is not None:
            return refusal
        try:
            data = json.loads(await request.body())
        except ValueError as exc:
            return refuse(None, f"The request body is not valid JSON: {exc}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            return refuse(data, explain(exc))

    async def _generate(
        self,
        request: Request,
        body: GenerationRequest,
        planned: Callable[[], tuple[list[Token], Finish]],
    ) -> Response:
        """Chat and text completions alike: refused, or planned once admitted (the answer is
        what the engine says by then), handed to the engine, and answered as it runs."""
        refusal = self.check(body) or await self.admit()
        if refusal is not None:
            return refusal
        tokens, finish = planned()
        chat = isinstance(body, ChatRequest)
        rid, response_id = self.request_ids(request, body, "chatcmpl-" if chat else "cmpl-")
        work = Work(rid, count_prompt_tokens(body.prompt_text()), tokens, finish)
        answer = Answer(
            work, response_id, self.model_name(body), self.dialect, self._include_usage(body)
        )
        self.submit(work)
        if chat:
            events, whole = answer.chat_events, answer.chat_body
        else:
            events, whole = answer.text_events, answer.text_body
        return await self.respond(request, work, bool(body.stream), events, whole)

    def _include_usage(self, body: GenerationRequest) -> bool:
        options = body.stream_options
        return self.force_usage or bool(options and options.include_usage)

    def _tool(self, body: ChatRequest) -> tuple[str, str] | None:
        if not body.tools or body.tool_choice == "none" or not self.tools_on():
            return None
        call = self.behaviour.tool_call
        forced = body.tool_choice == "required" or body.named_tool() is not None
        if call is None and not forced:
            return None
        first: JsonDict = body.tools[0].get("function") or {}
        name = body.named_tool() or (call.name if call else str(first.get("name", "tool")))
        return name, json.dumps(call.arguments if call else {})

    async def respond(
        self,
        request: Request,
        work: Work,
        stream: bool,
        events: Callable[[], AsyncIterator[str]],
        body: Callable[[], JsonDict],
    ) -> Response:
        """Answer `work`, handed to the engine, as it runs (`events` streamed, `body` whole):
        chat's timing and hang-up handling, in any API's wire format."""
        headers = self.response_headers(request)
        if not stream:
            await self._until_done(request, work, stream)
            if work.finish == "error":
                return self.error(500, work.error or "internal error", "InternalServerError")
            return JSONResponse(body(), headers=headers)
        # An answer made whole at admission (an instant engine) has no work left to stop.
        watcher = None if work.finish is not None else self._watch(request, work, stream)
        return StreamingResponse(
            self._stream(events(), work, watcher),
            media_type="text/event-stream",
            headers=headers,
        )

    async def _until_done(self, request: Request, work: Work, stream: bool) -> None:
        """Wait for the work's end, watching for the client's hang-up meanwhile (an answer
        made whole at admission, by an instant engine, has no work left to stop)."""
        watcher = None if work.finish is not None else self._watch(request, work, stream)
        try:
            await work.done.wait()
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _stream(
        self, events: AsyncIterator[str], work: Work, watcher: asyncio.Task[None] | None
    ) -> AsyncIterator[str]:
        try:
            if work.finish is not None:  # made whole at admission: sent in one write
                yield "".join([event async for event in events])
                return
            async for event in events:
                yield event
        finally:
            if watcher is not None:
                watcher.cancel()
            if work.finish is None:
                self.client_gone(work, stream=True)

    def _watch(self, request: Request, work: Work, stream: bool) -> asyncio.Task[None]:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.client_gone(work, stream)

        return self.process.spawn(watch())

    def client_gone(self, work: Work, stream: bool) -> None:
        """Noticed once per request (the stream's end and the disconnect watch both tell)."""
        if work in self._gone:
            return
        self._gone.add(work)
        keeps_on = work.runs_to_end or self.behaviour.faults.keep_generating_on_disconnect
        if work.finish is not None or keeps_on:
            return
        lag = self.disconnect_lag(stream)
        if lag <= 0:
            self.abort_gone(work)
        else:
            self.process.later(lag, lambda: self.abort_gone(work))
