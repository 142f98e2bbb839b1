"""The CLI's management client sends a request again, with its same Idempotency-Key, when
the API answers that Redis was away a moment (503 `redis_unreachable`, as while the
scheduler's client finds a new primary), and gives the error once its tries are spent; any
other error is given at once. Against a real HTTP server that answers as the API does."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import ClassVar

import httpx
import pytest

from capycommon import management as wire
from capycommon.errors import CapyError
from capyctl_cli.management import RETRIES, Management

OUTAGE = wire.ErrorBody(
    error=wire.ErrorDetail(code="redis_unreachable", message="Redis away", retryable=True)
).model_dump_json()
REFUSED = wire.ErrorBody(
    error=wire.ErrorDetail(code="not_found", message="no such deployment", retryable=False)
).model_dump_json()


class Api(http.server.BaseHTTPRequestHandler):
    answers: ClassVar[list[tuple[int, str]]] = []
    keys: ClassVar[list[str | None]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).keys.append(self.headers.get("Idempotency-Key"))
        status, body = type(self).answers.pop(0)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def api() -> Iterator[Management]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = Management.__new__(Management)  # its HTTP client alone: no role to find
    client.http = httpx.Client(base_url=f"http://127.0.0.1:{server.server_address[1]}")
    Api.answers, Api.keys = [], []
    try:
        yield client
    finally:
        client.http.close()
        server.shutdown()
        server.server_close()


def test_an_outage_is_ridden_out_with_the_same_key(api: Management) -> None:
    Api.answers = [(503, OUTAGE), (200, _revoked())]
    assert api.revoke("h").revoked
    assert len(Api.keys) == 2
    assert Api.keys[0] == Api.keys[1] is not None


def test_an_outage_that_lasts_is_said_and_a_refusal_at_once(api: Management) -> None:
    Api.answers = [(503, OUTAGE)] * RETRIES
    with pytest.raises(CapyError, match="Redis away"):
        api.revoke("h")
    assert len(Api.keys) == RETRIES
    Api.answers, Api.keys = [(404, REFUSED)], []
    with pytest.raises(CapyError, match="no such deployment"):
        api.revoke("h")
    assert len(Api.keys) == 1


def _revoked() -> str:
    return wire.RevokeAnswer(
        host_id="id", name="h", revoked=True, newly_revoked=True
    ).model_dump_json()
