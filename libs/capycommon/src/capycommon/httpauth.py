"""Bearer-token checks shared by the router and the management API."""

from __future__ import annotations

import hmac

from capycommon.errors import Unauthenticated


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def require(authorization: str | None, expected: str, what: str) -> None:
    """Accept only `expected`, compared in constant time; anything else is refused."""
    token = bearer_token(authorization)
    if token is None:
        raise Unauthenticated(f"missing bearer token; send Authorization: Bearer <{what}>")
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise Unauthenticated(f"invalid {what}")
