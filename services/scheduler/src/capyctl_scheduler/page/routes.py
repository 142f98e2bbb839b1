"""The status page's routes on the management listener.

`GET /` shows the page to the admin (its login's cookie, or `Authorization: Bearer <admin
token>`), and the login form to anyone else; `POST /login` takes the token, opens a session
and sets its cookie; `POST /logout` ends the session (`session`); `GET /events` streams the
page's sections as server-sent events, each time the scheduler hears a notification (at most
once a second) and every REFRESH_S, until its session ends; the buttons ask
for confirmation (`GET /confirm`, or a dialog where scripts run) and post to `/actions`,
which calls the management API's own operation under an Idempotency-Key, as `capyctl park`
does. `/static/` serves the page's one stylesheet and one script from the package.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Literal
from urllib.parse import parse_qs, urlencode

from fastapi import FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)

from capycommon import management as wire
from capycommon import requestbody
from capycommon.credentials import Credentials
from capycommon.errors import CapyError, InvalidRequest
from capycommon.service import REDIS_ERRORS
from capycommon.state.pagesessions import PageSessions
from capyctl_scheduler.errorbody import error_response
from capyctl_scheduler.idempotency import Idempotency
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.page import render, session
from capyctl_scheduler.page.view import gather

# The least time between two updates of one page, and the most without one.
MIN_GAP_S = 1.0
REFRESH_S = 5.0
# A comment line on an idle stream this often, so a closed page is noticed.
KEEPALIVE_S = 15.0
MAX_FORM = 4096
STATIC = {"page.css": "text/css; charset=utf-8", "page.js": "text/javascript; charset=utf-8"}
# The page runs only its own script and stylesheet, and posts only to itself.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HTML_HEADERS = {"Content-Security-Policy": CSP, "Referrer-Policy": "no-referrer"}
Via = Literal["cookie", "header"]
TARGETS = {"deployment": ("park", "wake", "start", "stop"), "host": ("drain",)}
ACTIONS = {action for actions in TARGETS.values() for action in actions}


@dataclass(frozen=True)
class Gate:
    """Who is signed in, and the answers that say so."""

    credentials: Credentials
    sessions: PageSessions

    async def signed_in(self, request: Request) -> Via | None:
        token = self.credentials.admin_token
        if session.is_admin_header(request.headers.get("authorization"), token):
            return "header"
        opened = request.cookies.get(session.COOKIE)
        if await self.sessions.is_open(opened, session.mark(token)):
            return "cookie"
        return None

    def form_key(self, request: Request) -> str:
        cookie = request.cookies.get(session.COOKIE) or ""
        return session.form_key(self.credentials.admin_token, cookie)

    def form_key_valid(self, request: Request, given: str) -> bool:
        cookie = request.cookies.get(session.COOKIE) or ""
        return session.form_key_valid(given, self.credentials.admin_token, cookie)

    def login_page(self, message: str = "") -> HTMLResponse:
        answer = html(render.login(message), 401)
        answer.headers["WWW-Authenticate"] = 'Bearer realm="capyctl management"'
        return answer


def html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=HTML_HEADERS)


def install(
    app: FastAPI, credentials: Credentials, manager: Manager, idempotency: Idempotency
) -> None:
    gate = Gate(credentials, manager.state.page_sessions)

    @app.get("/", include_in_schema=False)
    async def page(request: Request, done: str = "", name: str = "") -> Response:
        if await gate.signed_in(request) is None:
            return gate.login_page()
        notice = f"Asked: {done} {name}." if done in ACTIONS and name else ""
        return html(render.page(await gather(manager), gate.form_key(request), notice))

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        return await _login(gate, request)

    @app.post("/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        await gate.sessions.close(request.cookies.get(session.COOKIE))
        answer = RedirectResponse("/", status_code=303)
        answer.delete_cookie(session.COOKIE, path="/", httponly=True, samesite="strict")
        return answer

    @app.get("/confirm", include_in_schema=False)
    async def confirm(
        request: Request, target: str = "", name: str = "", action: str = ""
    ) -> Response:
        if await gate.signed_in(request) is None:
            return gate.login_page()
        _check(target, name, action)
        key = secrets.token_hex(16)
        return html(render.confirm(target, name, action, gate.form_key(request), key))

    @app.post("/actions", include_in_schema=False)
    async def act(request: Request) -> Response:
        return await _act(gate, manager, idempotency, request)

    @app.get("/events", include_in_schema=False)
    async def events(request: Request) -> Response:
        if await gate.signed_in(request) is None:
            return error_response(401, "unauthenticated", "log in at / first")
        expires = time.time() + session.LIFETIME_S

        async def signed_in() -> bool:
            return time.time() < expires and await gate.signed_in(request) is not None

        return StreamingResponse(
            _stream(manager, signed_in),
            media_type="text/event-stream",
            headers={"X-Accel-Buffering": "no"},
        )

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC:
            return error_response(404, "not_found", f"no file {name!r} here")
        text = resources.files("capyctl_scheduler.page").joinpath("static", name).read_text()
        return Response(text, media_type=STATIC[name], headers={"Cache-Control": "no-cache"})


async def _login(gate: Gate, request: Request) -> Response:
    """The admin token sets the session cookie; anything else is refused, saying why."""
    given = (await _form(request)).get("token", "").strip()
    if not given:
        return gate.login_page("Give the admin token.")
    if session.is_token(given, gate.credentials.api_key):
        return gate.login_page(
            "That is the API key: it opens the inference endpoint, not this page. "
            "Give the admin token."
        )
    token = gate.credentials.admin_token
    if not session.is_token(given, token):
        return gate.login_page("That is not the admin token.")
    opened = await gate.sessions.open(session.mark(token), session.LIFETIME_S)
    answer = RedirectResponse("/", status_code=303)
    answer.set_cookie(
        session.COOKIE,
        opened,
        max_age=session.LIFETIME_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return answer


async def _act(
    gate: Gate, manager: Manager, idempotency: Idempotency, request: Request
) -> Response:
    """A button: the management API's operation, once per key; JSON for the page's script,
    else back to the page."""
    via = await gate.signed_in(request)
    wants_json = "application/json" in request.headers.get("accept", "")
    if via is None:
        if wants_json:
            return error_response(401, "unauthenticated", "log in again")
        return gate.login_page()
    body = await requestbody.read(request, MAX_FORM)
    try:
        fields = _fields(body)
        target, name = fields.get("target", ""), fields.get("name", "")
        action = fields.get("action", "")
        if via == "cookie" and not gate.form_key_valid(request, fields.get("form_key", "")):
            raise InvalidRequest("this form is not from this session's page; reload it")
        _check(target, name, action)
        run = _operation(manager, target, name, action)
        await idempotency.once(fields.get("key"), request, body, wire.Versioned, run)
    except CapyError as exc:
        if wants_json:
            return error_response(exc.http_status, exc.code, exc.message)
        notice = f"{exc.code}: {exc.message}"
        page = render.page(await gather(manager), gate.form_key(request), notice)
        return html(page, exc.http_status)
    if wants_json:
        return JSONResponse({"done": action, "name": name})
    return RedirectResponse("/?" + urlencode({"done": action, "name": name}), 303)


def _operation(
    manager: Manager, target: str, name: str, action: str
) -> Callable[[], Awaitable[wire.Versioned]]:
    """The management API's operation a button asks for: what its route calls."""
    if target == "host":
        return lambda: manager.drain(name)
    verb: wire.Action = "start" if action == "wake" else action  # type: ignore[assignment]
    return lambda: manager.act(name, verb)


def _check(target: str, name: str, action: str) -> None:
    if target not in TARGETS or action not in TARGETS[target]:
        raise InvalidRequest(
            f"no button {action!r} for a {target!r}: a deployment has park, wake, start and "
            "stop, a host drain"
        )
    if not name or len(name) > 200:
        raise InvalidRequest("name the deployment or host the button acts on")


async def _form(request: Request) -> dict[str, str]:
    return _fields(await requestbody.read(request, MAX_FORM))


def _fields(body: bytes) -> dict[str, str]:
    """A form's fields (the first value of each)."""
    try:
        found = parse_qs(body.decode(), keep_blank_values=True, max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        raise InvalidRequest("the form is not URL-encoded UTF-8") from None
    return {k: v[0] for k, v in found.items()}


async def _stream(manager: Manager, signed_in: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
    """The page's sections: all at first, then each that changed, after each notification
    the scheduler heard (at most once every MIN_GAP_S) and every REFRESH_S; until the
    session ends (a logout, its expiry: seen at the next update) or the scheduler stops."""
    changes = manager.scheduler.changes
    sent: dict[str, str] = {}
    quiet_since = time.monotonic()
    yield "retry: 2000\n\n"
    while not changes.closed:
        seen = changes.count
        try:
            if not await signed_in():
                yield _event("ended", "the session ended; log in again")
                return
            parts = render.sections(await gather(manager))
        except REDIS_ERRORS as exc:
            yield _event("trouble", f"the scheduler cannot read Redis ({exc}); retrying")
            parts = sent
        for name, html in parts.items():
            if sent.get(name) != html:
                yield _event("section", {"id": name, "html": html})
                quiet_since = time.monotonic()
        sent = parts
        if time.monotonic() - quiet_since >= KEEPALIVE_S:
            yield ": keep-alive\n\n"
            quiet_since = time.monotonic()
        await asyncio.sleep(MIN_GAP_S)
        await changes.after(seen, REFRESH_S - MIN_GAP_S)


def _event(kind: str, data: object) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"
