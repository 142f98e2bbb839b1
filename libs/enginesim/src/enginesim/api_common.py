"""What the routes of the pooling, tokenizer and audio APIs share: reading a body as the
family reads it, running one request in the engine, the versions each route appeared in, and
llama-server's answer to a path it does not serve."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesim.behaviour import version_tuple
from enginesim.engine import Work
from enginesim.serving import Frontend, explain

AddRoute = Callable[..., object]  # FastAPI's `app.add_api_route`
Body = TypeVar("Body", bound=BaseModel)
LLAMA_NOT_FOUND = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}


def at_least(version: str, first: str) -> bool:
    """Whether `version` is `first` or later, a `.postN` release after its base release
    (`0.5.3.post1` > `0.5.3`)."""
    return _release(version) >= _release(first)


def _release(version: str) -> tuple[tuple[int, ...], int]:
    numbers = version_tuple(version)
    _, _, post = version.partition(".post")
    return numbers + (0,) * (4 - len(numbers)), int(post) if post.isdigit() else 0


async def llama_not_found(request: Request) -> Response:
    """llama-server's 404 for a path it has no handler for (its HTTP layer's error handler)."""
    return JSONResponse(LLAMA_NOT_FOUND, status_code=404)


def request_base(request: Request) -> str:
    """vLLM's base of a request id: the `X-Request-Id` header, else a random one."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


async def read_json(
    front: Frontend,
    request: Request,
    model: type[Body],
    invalid: Callable[[object, str], Response] | None = None,
) -> Body | Response:
    """The body as `model`, or the family's 400 (after its own checks of the request);
    `invalid` answers a body the API reads its own way (the parsed body, or None)."""
    refuse = invalid or (lambda _, message: front.error(400, message))
    refusal = front.precheck(request)
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


async def run(front: Frontend, request: Request, rid: str, prompt_tokens: int) -> Work | Response:
    """One request with no tokens to make (a rerank, a score) in the engine, answered whole
    once it ends: it waits for a slot, counts as running, and a client that goes away aborts
    it as the family aborts a request."""
    refusal = await front.admit()
    if refusal is not None:
        return refusal
    work = Work(rid, prompt_tokens, [], "stop")
    front.submit(work)
    await front._until_done(request, work, stream=False)
    if work.finish == "error":
        return front.error(500, work.error or "internal error", "InternalServerError")
    if work.finish == "abort":
        return front.error(500, "The request was aborted.", "InternalServerError")
    return work


def sse(data: object) -> str:
    return f"data: {json.dumps(data)}\n\n"


DONE = "data: [DONE]\n\n"
