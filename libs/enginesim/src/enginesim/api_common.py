"""What the routes of the pooling, tokenizer and audio APIs share: running one request in the
engine, the versions each route appeared in, and llama-server's answer to a path it does not
serve (each reads its body as the family reads it, `Frontend.read_json`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesim.behaviour import version_tuple
from enginesim.engine import Work
from enginesim.serving import Frontend

AddRoute = Callable[..., object]  # FastAPI's `app.add_api_route`
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


async def run(front: Frontend, request: Request, rid: str, prompt_tokens: int) -> Work | Response:
    """One request with no tokens to make (a rerank, a score) in the engine, answered whole
    once it ends: it waits for a slot, counts as running, and a client that goes away aborts
    it as the family aborts a request."""
    refusal = await front.admit()
    if refusal is not None:
        return refusal
    work = Work(rid, prompt_tokens, [], "stop")
    failure = await front.run_whole(request, work)
    return work if failure is None else failure


def sse(data: object) -> str:
    return f"data: {json.dumps(data)}\n\n"


DONE = "data: [DONE]\n\n"
