"""The status page's login sessions, kept on the server as web frameworks keep theirs.

A login opens a session: a random id (256 bits) that only the browser's cookie holds. Redis
keeps the id's SHA-256, so one who reads Redis cannot use a session, with the mark of the
admin token it was opened under, and forgets it when it expires. A logout deletes it: the
cookie then opens nothing, wherever a copy of it went, while every other session stays open.
A new admin token ends every session, as the mark no longer matches.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import redis.asyncio as aioredis

from capycommon.state import keys

# The longest id a cookie may carry (an id is 43 characters): a longer one is no session.
MAX_ID = 64


class PageSessions:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def open(self, mark: str, lifetime_s: int) -> str:
        """A new session under `mark` (the admin token's), expiring after `lifetime_s`: its
        id, for the cookie."""
        session = secrets.token_urlsafe(32)
        await self.client.set(_key(session), mark, ex=lifetime_s)
        return session

    async def is_open(self, session: str | None, mark: str) -> bool:
        """Whether `session` is an id of an open session opened under `mark`."""
        if not session or len(session) > MAX_ID:
            return False
        found = await self.client.get(_key(session))
        if found is None:
            return False
        kept = found if isinstance(found, bytes) else found.encode()
        return hmac.compare_digest(kept, mark.encode())

    async def close(self, session: str | None) -> None:
        """End `session` (no session: nothing to end)."""
        if session and len(session) <= MAX_ID:
            await self.client.delete(_key(session))


def _key(session: str) -> str:
    return keys.page_session(hashlib.sha256(session.encode()).hexdigest())
