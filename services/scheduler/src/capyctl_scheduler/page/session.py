"""Who may open the status page: the admin token, given once in the login form (which sets
a session cookie) or in the Authorization header.

The cookie holds no token: it is an expiry signed with the admin token (HMAC-SHA256), so a
new admin token ends every session, and nothing is kept on the server. It is HttpOnly (no
script reads it) and SameSite=Strict (no other site's page sends it). A form the page posts
carries a second value signed from the session, so only a page this scheduler rendered for
that session can act with it.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from capycommon import httpauth

COOKIE = "capyctl_session"
# How long a login lasts.
LIFETIME_S = 12 * 3600


def issue(admin_token: str, now: float | None = None) -> str:
    """A session value that expires LIFETIME_S from now."""
    expires = int((now if now is not None else time.time()) + LIFETIME_S)
    return f"v1.{expires}.{_sign(admin_token, f'session {expires}')}"


def valid(value: str | None, admin_token: str, now: float | None = None) -> bool:
    """Whether `value` is a session this admin token signed that has not expired."""
    if not value:
        return False
    version, _, rest = value.partition(".")
    expires, _, signature = rest.partition(".")
    if version != "v1" or not expires.isdigit():
        return False
    expected = _sign(admin_token, f"session {expires}")
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return False
    return int(expires) > (now if now is not None else time.time())


def form_key(admin_token: str, session: str) -> str:
    """The value a form of this session carries (a cross-site form cannot know it)."""
    return _sign(admin_token, f"form {session}")


def form_key_valid(given: str, admin_token: str, session: str) -> bool:
    return hmac.compare_digest(given.encode(), form_key(admin_token, session).encode())


def is_admin_header(authorization: str | None, admin_token: str) -> bool:
    """Whether the Authorization header carries the admin token."""
    token = httpauth.bearer_token(authorization)
    return token is not None and hmac.compare_digest(token.encode(), admin_token.encode())


def is_token(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _sign(admin_token: str, text: str) -> str:
    return hmac.new(admin_token.encode(), text.encode(), hashlib.sha256).hexdigest()
