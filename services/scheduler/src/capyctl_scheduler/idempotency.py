"""Idempotency-Keys of the management API's mutations: the first answer is kept for a day,
and a retry with the same key and body gets it again without acting twice."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from capycommon import management as wire
from capycommon.errors import IdempotencyConflict, InvalidRequest
from capycommon.state.stores import State

Answer = TypeVar("Answer", bound=wire.Versioned)


class Kept(BaseModel):
    """What an Idempotency-Key holds: the request's digest, and its answer once it has one."""

    model_config = ConfigDict(extra="forbid")

    digest: str | None
    answer: wire.JsonObject | None = None


class Idempotency:
    """Replays the recorded answer of a mutation retried with the same key."""

    def __init__(self, state: State) -> None:
        self.answers = state.answers

    async def begin(
        self, key: str | None, request: Request, body: bytes, answer: type[Answer]
    ) -> Answer | None:
        """The recorded answer, or None after claiming the key for this request."""
        if not key or len(key) > 200:
            raise InvalidRequest(
                "a mutation needs an Idempotency-Key header (up to 200 characters), e.g. a "
                "fresh UUID per command; a retry sends the same key"
            )
        digest = _digest(request, body)
        claim = Kept(digest=digest).model_dump_json()
        if await self.answers.claim(key, claim):
            return None
        raw = await self.answers.get(key)
        found = Kept.model_validate_json(raw) if raw else Kept(digest=None)
        if found.digest != digest:
            raise IdempotencyConflict(
                "this Idempotency-Key was used for a different request; use a new key"
            )
        if found.answer is None:
            raise IdempotencyConflict("a request with this Idempotency-Key is still running")
        return answer.model_validate(found.answer)

    async def finish(self, key: str, request: Request, body: bytes, answer: BaseModel) -> None:
        kept = Kept(digest=_digest(request, body), answer=answer.model_dump(mode="json"))
        await self.answers.keep(key, kept.model_dump_json())

    async def abandon(self, key: str) -> None:
        await self.answers.release(key)

    async def once(
        self,
        key: str | None,
        request: Request,
        body: bytes,
        answer: type[Answer],
        act: Callable[[], Awaitable[Answer]],
    ) -> Answer:
        """`act`'s answer, acting only for the first request with this key and body."""
        replay = await self.begin(key, request, body, answer)
        if replay is not None:
            return replay
        assert key is not None
        try:
            done = await act()
        except BaseException:
            await self.abandon(key)
            raise
        await self.finish(key, request, body, done)
        return done


def _digest(request: Request, body: bytes) -> str:
    return hashlib.sha256(request.method.encode() + request.url.path.encode() + body).hexdigest()
