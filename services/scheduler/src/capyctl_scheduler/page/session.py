"""Who may open the status page: the admin token, given once in the login form (which opens
a session) or in the Authorization header.

A login opens a session kept on the server (`capycommon.state.pagesessions`): the cookie
holds only its random id, and a logout ends it there, so a copy of the cookie opens nothing
afterwards. Each session is opened under the admin token's mark, so a new admin token ends
every session. The cookie is HttpOnly (no script reads it) and SameSite=Strict (no other
site's page sends it). A form the page posts carries a second value signed from the session,
so only a page this scheduler rendered for that session can act with it.
"""

from __future__ import annotations

import hashlib
import hmac

from capycommon import httpauth

COOKIE = "capyctl_session"
# How long a login lasts.
LIFETIME_S = 12 * 3600


def mark(admin_token: str) -> str:
    """The mark a session is opened under: the admin token's, which does not reveal it."""
    return _sign(admin_token, "page sessions")


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
