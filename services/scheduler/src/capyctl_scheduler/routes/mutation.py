"""What every mutation of the management API shares: its body read and parsed strictly into
its request model, then acted on once per Idempotency-Key (a retry with the same key and body
gets the kept answer)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from fastapi import Header, Request

from capycommon import management as wire
from capycommon import requestbody
from capyctl_scheduler.idempotency import Answer, Idempotency

MAX_BODY = 1 << 20
Body = TypeVar("Body", bound=wire.Request)
# A route's `idempotency_key` parameter: the Idempotency-Key header.
Key = Annotated[str | None, Header()]


async def parsed(request: Request, parse_as: type[Body]) -> tuple[bytes, Body]:
    """The body as sent (an empty one reads as `{}`), and parsed into `parse_as`."""
    body = await requestbody.read(request, MAX_BODY)
    return body, requestbody.validated(parse_as, requestbody.parse_object(body or b"{}"))


async def once(
    idempotency: Idempotency,
    request: Request,
    key: str | None,
    parse_as: type[Body],
    answer: type[Answer],
    act: Callable[[Body], Awaitable[Answer]],
) -> Answer:
    """Parse the body, then act once per Idempotency-Key (a retry gets the kept answer)."""
    body, found = await parsed(request, parse_as)
    return await idempotency.once(key, request, body, answer, lambda: act(found))
