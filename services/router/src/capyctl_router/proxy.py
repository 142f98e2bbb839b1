"""One admitted request on its way through an engine, and its place settled after.

The router reads the engine's first event before it answers the client, so everything that
fails before it is a real HTTP error in the OpenAI envelope: the engine's own error status
(in whatever shape its family gives it), an error event the engine sent first after its 200
(vLLM does, for some validation errors), the deadline (503), a broken engine (500). After the
first event has gone to a streaming client, a failure is an error event and `[DONE]`. A
client that hangs up, at any point, closes the engine connection at once: one task a request
(`capycommon.hangup.Watch`) waits for the hang-up and cancels the request's own task wherever
it waits (a place, the engine, the client's socket). The place is settled once the answer's
last byte went out.

A streamed request that asked to see its model load (`CapyCTL-Progress: on`) and finds it not
ready gets its 200 and the stream's headers at once (`Early`), then SSE comment lines while it
waits (`capyctl_router.progress`), which clients ignore. Its status is then spent:
whatever fails before the first event comes as the error event (and `[DONE]`) that a failure
after the first event is, with the same code and message.

An engine on a joined host is reached through its host's ingress, over TLS, the same way.
A request the ingress never took (it could not be reached: refused, timed out, or presenting
a certificate that is not the host's; or it answered `409 stale_dispatch`, the instance
stopped or moved) left nothing running on an engine: its place is given back at once and it
is admitted again, once the routing table changed or a second passed, while more than a
second of its deadline is left.
So a request for a model on a host that just went away waits for the scheduler to mark the
host unreachable, then for the model's new placement, or gets the scheduler's refusal
(`503 host_unreachable`). Past its deadline it gets the last failure: `503
engine_unreachable` or `503 unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field, replace

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from capycommon.domain.desired import DeploymentRecord
from capycommon.engineclient import Answer, Engines, IngressUnreachable
from capycommon.errors import (
    ApiNotServed,
    CapyError,
    EngineError,
    EngineFailed,
    EngineRejected,
    StaleDispatch,
)
from capycommon.hangup import Watch, uncancel
from capycommon.service import wait_event
from capyctl_router.answers import shape_of
from capyctl_router.decisions import DecisionsRequest, MalformedAnswer, from_system_one
from capyctl_router.dispatch import Dispatcher
from capyctl_router.errors import envelope, retry_headers
from capyctl_router.failures import (
    FAILURES,
    READMIT_EVERY_S,
    Failure,
    NoAnswerInTime,
    Undelivered,
    failure,
)
from capyctl_router.progress import Progress
from capyctl_router.relay import (
    MAX_ANSWER,
    MAX_ERROR,
    Call,
    Events,
    JsonDict,
    api_refused,
    dumps,
    engine_failure,
    engine_request,
    event_failure,
    is_stale,
    loads,
)
from capyctl_router.table import Target

REQUEST_ID_HEADER = "X-CapyCTL-Request-Id"
# Outcomes after which the engine is done with the request (or never got it): its place is
# given back at once.
FINISHED = ("ok", EngineRejected.code, EngineError.code, StaleDispatch.code, ApiNotServed.code)
# Where the engines listen, from the router's side.
ENGINE_ADDRESS = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Raw:
    """An engine's whole answer that is not JSON, passed on as it came."""

    data: bytes
    media_type: str


class Exchange(Response):
    """A request whose body was read and checked, as the answer the client gets (an ASGI
    app of its own): a place on its deployment's engine, waited for within its deadline,
    then the engine's answer relayed (`Session`). A hang-up at any point cuts it."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        engines: Engines,
        call: Call,
        record: DeploymentRecord,
        arrived: float,
    ) -> None:  # no body and no status yet: they are the engine's
        self.background = None
        self.dispatcher = dispatcher
        self.engines = engines
        self.call = call
        self.record = record
        self.arrived = arrived

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = Watch(receive)
        try:
            await self._exchange(scope, receive, send, watch)
        finally:
            watch.stop()

    async def _exchange(self, scope: Scope, receive: Receive, send: Send, watch: Watch) -> None:
        dispatcher, name = self.dispatcher, self.record.name
        deadline = self.arrived + dispatcher.deadline_of(self.record)
        early = Early(send, self.call) if self.call.progress else None
        while True:
            try:
                await self._once(scope, receive, send, watch, deadline, early)
                return
            except Undelivered:
                left = deadline - time.monotonic()
                await wait_event(dispatcher.table.changed(name), min(READMIT_EVERY_S, left))

    async def _once(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        watch: Watch,
        deadline: float,
        early: Early | None,
    ) -> None:
        """Admit the request and relay it; Undelivered when the ingress never took it."""
        dispatcher, name = self.dispatcher, self.record.name
        try:
            progress = None if early is None else early.progress
            target = await dispatcher.acquire(self.record, deadline, progress)
        except CapyError as exc:
            dispatcher.metrics.outcome(name, exc.code, self.call.kind)
            watch.ending()
            if early is not None and early.started:
                await early.fail(exc.http_status, exc.code, exc.message)
                return
            headers = {REQUEST_ID_HEADER: self.call.request_id}
            headers.update(retry_headers(exc.code, exc.http_status))
            refusal = envelope(
                exc.http_status, exc.code, exc.message, headers, style=self.call.style
            )
            await refusal(scope, receive, send)
            return
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            uncancel()
            dispatcher.metrics.outcome(name, "client_gone", self.call.kind)  # nobody to answer
            return
        dispatcher.metrics.running.labels(name).inc()
        session = Session(
            dispatcher, self.engines, self.call, target, self.arrived, deadline, early
        )
        await session.respond(scope, receive, send, watch)


class Early:
    """A streamed answer begun before its model is ready: the 200 and the stream's headers
    with the first progress line, each line an SSE comment (and a blank line, so that no
    client's parser takes it for an event); a failure before the first event, the API's
    error event (and for chat `[DONE]`)."""

    def __init__(self, send: Send, call: Call) -> None:
        self.send = send
        self.request_id = call.request_id
        self.shape = shape_of(call)
        self.started = False
        self.progress = Progress(call.route, self.say)

    async def say(self, line: str) -> None:
        if not self.started:
            self.started = True
            head = _stream_head({REQUEST_ID_HEADER: self.request_id})
            await self.send({"type": "http.response.start", "status": 200, "headers": head})
        body = b": " + line.encode() + b"\n\n"
        await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def fail(self, status: int, code: str, message: str, param: str | None = None) -> None:
        error = self.shape.error(status, code, message, param)
        await self.send({"type": "http.response.body", "body": error, "more_body": True})
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


@dataclass
class Session:
    """One admitted request: relayed, then its place settled (once, however it ended)."""

    dispatcher: Dispatcher
    engines: Engines
    call: Call
    target: Target
    arrived: float
    deadline: float
    # The stream's head went out early, while the request waited (`Early`); None if not asked.
    early: Early | None = None
    outcome: str = "cancelled"
    response: Answer | None = None
    _events: Events | None = None
    _finished: bool = field(default=False, repr=False)

    async def respond(self, scope: Scope, receive: Receive, send: Send, watch: Watch) -> None:
        """Answer the client: a stream that begins with the engine's first event, or one JSON
        body; an HTTP error when anything failed before the first event. However it ends,
        the engine connection is closed and the place settled (after the answer went out)."""
        stopping = False
        try:
            await self._answer(scope, receive, send, watch)
        except asyncio.CancelledError:
            if not watch.gone:
                stopping = True  # the router is stopping: settled all the same, shielded
                raise
            uncancel()  # the client's hang-up: the request ends here, as a cut one
        finally:
            await (settled(self.finish()) if stopping else self.finish())

    async def _answer(self, scope: Scope, receive: Receive, send: Send, watch: Watch) -> None:
        headers = {REQUEST_ID_HEADER: self.call.request_id}
        streams = self.call.client_streams
        try:
            found = await (self._first() if streams else self._collect())
        except FAILURES as exc:
            failed = self._failure(exc)
            self.outcome = failed.outcome
            if self._undelivered(exc) and time.monotonic() + READMIT_EVERY_S < self.deadline:
                raise Undelivered from exc  # nothing was sent to the client yet
            watch.ending()
            if self.early is not None and self.early.started:
                await self.early.fail(failed.status, failed.code, failed.message, failed.param)
                return
            retry = retry_headers(failed.code, failed.status)
            answer = envelope(
                failed.status,
                failed.code,
                failed.message,
                {**headers, **retry},
                failed.param,
                self.call.style,
            )
            await answer(scope, receive, send)
            return
        if not streams:
            assert found is not None
            self.outcome = "ok"
            watch.ending()
            data, media_type = (
                (found.data, found.media_type)
                if isinstance(found, Raw)
                else (dumps(found), "application/json")
            )
            await Response(data, media_type=media_type, headers=headers)(scope, receive, send)
            return
        assert not isinstance(found, Raw)
        if self.early is None or not self.early.started:
            head = _stream_head(headers)
            await send({"type": "http.response.start", "status": 200, "headers": head})
        async with contextlib.aclosing(self.stream(found)) as pieces:
            async for piece in pieces:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        watch.ending()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def stream(self, first: JsonDict | None) -> AsyncGenerator[bytes, None]:
        """The client's stream from the first event on; a failure from here on is an error
        event, and every stream ends with `[DONE]`. The events at hand go out together, in
        one write: an engine's burst costs the client one wake, not one an event."""
        event = first
        ready: list[bytes] = []
        shape = shape_of(self.call)
        try:
            while event is not None:
                shown = shape.shown(event)
                if shown is not None:
                    ready.append(shape.sse(shown))
                if ready and not self._at_hand():
                    yield b"".join(ready)
                    ready.clear()
                event = await self._next()
            self.outcome = "ok"
        except FAILURES as exc:
            failed = self._failure(exc)
            self.outcome = failed.outcome
            ready.append(shape.error(failed.status, failed.code, failed.message, failed.param))
            yield b"".join(ready)
            return
        ready.append(shape.end())
        yield b"".join(ready)

    def _at_hand(self) -> bool:
        """Whether the engine's next event (or its end) is here already."""
        return self._events is not None and self._events.ready

    async def finish(self) -> None:
        """Close the engine connection (at once, if the client left), then settle the place:
        given back if the engine finished the request or never got it, else as a cut request
        settles."""
        if self._finished:
            return
        self._finished = True
        if self.response is not None:
            self.response.close()
        dispatcher = self.dispatcher
        dispatcher.metrics.running.labels(self.target.deployment).dec()
        dispatcher.metrics.outcome(self.target.deployment, self.outcome, self.call.kind)
        finished = self.outcome.split(":", 1)[0] in FINISHED
        if finished or self.response is None:  # done, or never sent
            await dispatcher.release(self.target)
        else:
            await dispatcher.cut(
                self.target, self.call.request_id, self.call.answered, self.call.decides
            )

    def _undelivered(self, exc: BaseException) -> bool:
        """Whether the ingress never took the request: it refused it as stale, or it could
        not be reached (no connection, so nothing was sent)."""
        unreached = isinstance(exc, IngressUnreachable) and self.response is None
        return unreached or isinstance(exc, StaleDispatch)

    def _failure(self, exc: BaseException) -> Failure:
        """The failure; when it is the router's account of it (the engine died, hung or
        broke its stream, not the engine's own error answer, relayed as it said it), its
        message names this request, as the client's headers and the engine's log do."""
        failed = failure(exc)
        if isinstance(exc, EngineFailed):
            return failed
        return replace(failed, message=f"{failed.message} (request {self.call.request_id})")

    # The engine's side ----------------------------------------------------------------------

    async def _open(self) -> Answer:
        """Send the request; the engine's error status raises as what it said."""
        body, headers, content_type = engine_request(self.call, self.target)
        ingress = self.target.ingress
        connection = await (
            self.engines.connect(ENGINE_ADDRESS, self.target.port)
            if ingress is None
            else self.engines.connect_ingress(ingress)
        )
        self.response = connection.post(self.call.path, body, headers, content_type)
        await self.response.head()
        status = self.response.status
        if status >= 400:
            raw = await self.response.read(MAX_ERROR)
            if ingress is not None and is_stale(status, raw):
                raise StaleDispatch(
                    f"deployment {self.target.deployment!r} stopped or moved on host "
                    f"{self.target.host} before the request reached it; retry"
                )
            raise api_refused(self.call, self.target, status, raw) or engine_failure(status, raw)
        return self.response

    async def _first(self) -> JsonDict | None:
        """The engine's first event (None if it ended without one), within the deadline."""
        try:
            async with asyncio.timeout(self._left()):  # no task of its own, as wait_for's
                response = await self._open()
        except TimeoutError:
            raise NoAnswerInTime("deadline") from None
        self._events = Events(response)
        return await self._next()

    async def _next(self) -> JsonDict | None:
        """The engine's next event, None at its end; bounded by the deadline until the first,
        then by the idle bound between events. An error event raises as what it said."""
        assert self._events is not None
        answered = self.call.answered
        until = (
            time.monotonic() + self.dispatcher.limits.stream_idle_s if answered else self.deadline
        )
        try:
            event = await self._events.next(until)
        except TimeoutError:
            raise NoAnswerInTime("stream idle" if answered else "deadline") from None
        if event is None:
            return None
        failure = event_failure(event)
        if failure is not None:
            raise failure
        self._first_output()
        return event

    async def _collect(self) -> JsonDict | Raw:
        """The whole answer, as one body: the engine's one answer where its API gives one
        (embeddings, rerank, a transcription, decisions...), else assembled from its stream."""
        if not self.call.streamed_from_engine or self.call.decides:
            try:
                async with asyncio.timeout(self._left()):
                    raw = await self._whole()
            except TimeoutError:
                raise NoAnswerInTime("deadline") from None
            self._first_output()
            return raw if isinstance(raw, Raw) else self._shown(raw)
        assembly = shape_of(self.call).assembly()
        event = await self._first()
        while event is not None:
            assembly.add(event)
            event = await self._next()
        return assembly.body()

    async def _whole(self) -> JsonDict | Raw:
        """The engine's answer: a JSON object, or a body of another type (a transcript as
        text, SRT or WebVTT) passed on as it came."""
        response = await self._open()
        raw = await response.read(MAX_ANSWER + 1)
        if len(raw) > MAX_ANSWER:
            raise EngineError("the engine's answer is over the router's limit (16 MiB)")
        media_type = response.headers.get("content-type", "application/json")
        if not self.call.decides and "json" not in media_type.lower():
            return Raw(raw, media_type)
        try:
            body = loads(raw)
        except ValueError:  # not JSON, not UTF-8
            raise EngineError("the engine's answer is not JSON") from None
        if isinstance(body, list) and not self.call.decides:
            return Raw(raw, media_type)  # a list (SGLang's rankings) names no model to rename
        if not isinstance(body, dict):
            raise EngineError("the engine's answer is not a JSON object")
        return body

    def _shown(self, body: JsonDict) -> JsonDict:
        """The engine's JSON answer as the client gets it: under the model it asked for, and
        an OpenAI decisions request's answer translated back from System One."""
        asked = self.call.asked
        if not isinstance(asked, DecisionsRequest):
            return {**body, "model": self.call.route} if "model" in body else body
        try:
            return from_system_one(asked, body, self.call.route)
        except MalformedAnswer as exc:
            raise EngineError(f"the engine's System One answer is malformed: {exc}") from None

    def _left(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def _first_output(self) -> None:
        if not self.call.answered:
            self.call.answered = True
            self.dispatcher.metrics.first_output(
                self.target.deployment, time.monotonic() - self.arrived
            )


def _stream_head(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    head = [(b"content-type", b"text/event-stream; charset=utf-8")]
    return head + [(name.lower().encode(), value.encode()) for name, value in headers.items()]


_settling: set[asyncio.Task[None]] = set()


async def settled(work: Awaitable[None]) -> None:
    """Run a request's settlement to its end even when the request's task is being
    cancelled (a client hang-up cancels the stream that is settling)."""
    task = asyncio.ensure_future(work)
    _settling.add(task)
    task.add_done_callback(_settling.discard)
    await asyncio.shield(task)
