"""The inference endpoints are declared once (`capyctl_router.endpoints`), and the router's two
sides are built from that declaration: the OpenAPI document describes every endpoint the fast
path serves, and no other, each with the same method and body. The check is also shown to
catch each way the two could part."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from capycommon.credentials import generate
from capycommon.engineclient import Engines
from capycommon.state.stores import State
from capyctl_router.app import Router, RouterApp, create_app
from capyctl_router.bodies import CompletionBody
from capyctl_router.dispatch import Dispatcher
from capyctl_router.endpoints import ENDPOINTS, Endpoint, serving
from capyctl_router.metrics import Metrics
from capyctl_router.relay import DECISION_KINDS
from capyctl_router.table import Table

CREDENTIALS = generate()
SCHEMAS = "#/components/schemas/"
Document = dict[str, Any]
Proxied = dict[str, Endpoint]


def _app() -> RouterApp:
    """The router's app over a Redis client that never connects (building it reads nothing)."""
    idle = State(aioredis.Redis())
    router = Router(Dispatcher(idle, Table(idle, set()), Metrics()), Engines())
    app = create_app(CREDENTIALS, router)
    assert isinstance(app, RouterApp)
    return app


@pytest.fixture(scope="module")
def served() -> tuple[Document, Proxied]:
    """The document as GET /openapi.json serves it, and the fast path's table."""
    app = _app()
    with TestClient(app) as http:
        document = http.get("/openapi.json").json()
    return document, app.proxied


def _bodies(document: Document, paths: set[str]) -> dict[tuple[str, str], str | None]:
    """What the document says of `paths`: each operation's body model, by method and path."""
    described: dict[tuple[str, str], str | None] = {}
    for path in paths & set(document["paths"]):
        for method, operation in document["paths"][path].items():
            content = operation.get("requestBody", {}).get("content", {})
            body = content.get("application/json") or content.get("multipart/form-data") or {}
            schema = body.get("schema", {})  # a form: its fields' model and its file parts
            parts = [schema, *schema.get("allOf", [])]
            ref = next((part["$ref"] for part in parts if "$ref" in part), "")
            model = ref.removeprefix(SCHEMAS)
            known = ref.startswith(SCHEMAS) and model in document["components"]["schemas"]
            described[method.upper(), path] = model if known else None
    return described


def disagreements(document: Document, proxied: Mapping[str, Endpoint]) -> list[str]:
    """Where the declaration, the OpenAPI document and the fast path's table part: an
    endpoint one of them lacks, or gives another method or body model."""
    declared = {(e.method, e.path): e.body.__name__ for e in ENDPOINTS}
    paths = {path for _, path in declared} | set(proxied)
    sides: dict[str, Mapping[tuple[str, str], str | None]] = {
        "declared": declared,
        "the fast path": {(e.method, path): e.body.__name__ for path, e in proxied.items()},
        "the document": _bodies(document, paths),
    }
    found = []
    for key in sorted(set().union(*sides.values())):
        said = {side: bodies.get(key, "nothing") for side, bodies in sides.items()}
        if len(set(said.values())) > 1:
            found.append(f"{' '.join(key)}: " + ", ".join(f"{s} {b}" for s, b in said.items()))
    return found


def test_the_document_and_the_fast_path_serve_the_declared_endpoints(
    served: tuple[Document, Proxied],
) -> None:
    document, proxied = served
    assert disagreements(document, proxied) == []
    assert list(proxied.values()) == list(ENDPOINTS)
    for endpoint in ENDPOINTS:
        operation = document["paths"][endpoint.path][endpoint.method.lower()]
        assert operation["summary"] == endpoint.summary
        assert "security" not in operation, "each takes the document's bearer key"


Corruption = Callable[[Document, Proxied], None]


def _unserved(document: Document, proxied: Proxied) -> None:
    del proxied["/v1/embeddings"]


def _undescribed(document: Document, proxied: Proxied) -> None:
    del document["paths"]["/v1/systemone"]


def _served_only(document: Document, proxied: Proxied) -> None:
    proxied["/v1/responses"] = dataclasses.replace(ENDPOINTS[0], path="/v1/responses")


def _other_body(document: Document, proxied: Proxied) -> None:
    chat = proxied["/v1/chat/completions"]
    proxied[chat.path] = dataclasses.replace(chat, body=CompletionBody)


def _other_method(document: Document, proxied: Proxied) -> None:
    operations = document["paths"]["/v1/decisions"]
    operations["put"] = operations.pop("post")


@pytest.mark.parametrize(
    ("corrupt", "named"),
    [
        (_unserved, "POST /v1/embeddings"),
        (_undescribed, "POST /v1/systemone"),
        (_served_only, "POST /v1/responses"),
        (_other_body, "POST /v1/chat/completions"),
        (_other_method, "POST /v1/decisions"),
    ],
)
def test_the_check_finds_a_side_that_parts(
    served: tuple[Document, Proxied], corrupt: Corruption, named: str
) -> None:
    document, proxied = copy.deepcopy(served[0]), dict(served[1])
    corrupt(document, proxied)
    found = disagreements(document, proxied)
    assert [line for line in found if line.startswith(f"{named}:")], found


def test_the_fast_path_requires_the_api_key_and_the_declared_method() -> None:
    with TestClient(_app()) as http:
        for endpoint in ENDPOINTS:
            refused = http.request(endpoint.method, endpoint.path, json={})
            assert refused.status_code == 401, endpoint.path
            assert refused.json()["error"]["code"] == "unauthenticated"
            assert http.get(endpoint.path).status_code == 405, endpoint.path


def test_the_decision_endpoints_are_the_kinds_relayed_to_system_one() -> None:
    assert {e.kind for e in ENDPOINTS if e.api == "decisions"} == set(DECISION_KINDS)
    assert serving("chat").startswith("POST /v1/chat/completions, /v1/completions, ")
    assert serving("chat").endswith(", /detokenize or /v1/audio/transcriptions")
    assert serving("decisions") == "POST /v1/decisions or /v1/systemone"
