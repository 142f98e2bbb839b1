"""The management API under fuzzing: the real app in process over a real redis-server.
Schemathesis draws requests from the API's own OpenAPI document (valid ones and ones breaking
it); hostile JSON goes to every mutation. Whatever comes in: no 5xx, every refusal in the
API's error body, no traceback logged."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import Case

from capycommon import management as wire
from capycommon.credentials import generate
from capycommon.state.stores import State
from capyctl_scheduler.app import create_app
from capyctl_scheduler.loop import Scheduler
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.observe import Observer
from hostile import BODIES, KINDS, fuzzing, openapi_cases, send

CREDENTIALS = generate()
AUTH = {"Authorization": f"Bearer {CREDENTIALS.admin_token}"}
HOST = "local"
MUTATIONS = ["/deployments", "/deployments/m/actions", f"/hosts/{HOST}/drain"]
FUZZ = fuzzing(100)


def _manager(client: aioredis.Redis) -> Manager:
    state = State(client)
    return Manager(Scheduler(state, Observer(state, [HOST])))


@pytest.fixture
async def api(
    redis_socket: Path, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[httpx.AsyncClient]:
    client = aioredis.Redis(unix_socket_path=str(redis_socket))
    transport = httpx.ASGITransport(
        app=create_app(CREDENTIALS, _manager(client)), raise_app_exceptions=False
    )
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http
    await client.aclose()
    tracebacks = [
        r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR
    ]
    assert tracebacks == []


def _refusal(response: httpx.Response) -> wire.ErrorDetail:
    """The error of a 4xx answer, read as the CLI reads it."""
    assert 400 <= response.status_code < 500, response.text
    return wire.ErrorBody.model_validate_json(response.content).error


async def _mutate(api: httpx.AsyncClient, path: str, body: bytes) -> httpx.Response:
    headers = {**AUTH, "Idempotency-Key": str(uuid.uuid4()), "Content-Type": "application/json"}
    return await api.post(f"{wire.PREFIX}{path}", content=body, headers=headers)


@pytest.mark.anyio
async def test_each_hostile_kind_is_a_400_naming_it(api: httpx.AsyncClient) -> None:
    for name, (body, _) in KINDS.items():
        error = _refusal(await _mutate(api, "/deployments", body))
        assert error.code == "invalid_request", name
    error = _refusal(await _mutate(api, "/deployments", b'{"document": {"name": "\\ud800"}}'))
    assert error.message.startswith("document.name: text holds a lone surrogate")


@pytest.mark.anyio
@FUZZ
@given(path=st.sampled_from(MUTATIONS), body=BODIES)
async def test_hostile_json_is_never_a_5xx(api: httpx.AsyncClient, path: str, body: bytes) -> None:
    response = await _mutate(api, path, body)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        _refusal(response)


@pytest.mark.anyio
async def test_the_openapi_document_is_behind_the_admin_token(api: httpx.AsyncClient) -> None:
    path = f"{wire.PREFIX}/openapi.json"
    assert (await api.get(path)).status_code == 401
    document = (await api.get(path, headers=AUTH)).json()
    operation = document["paths"][f"{wire.PREFIX}/deployments"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/DeployRequest"
    }
    assert "Idempotency-Key" in [p["name"].title() for p in operation["parameters"]]
    assert document["components"]["schemas"]["DeployRequest"]["additionalProperties"] is False


def _openapi_cases() -> st.SearchStrategy[Case[Any]]:
    """Requests drawn from the API's own OpenAPI document (it reads no state, so an app over
    a Redis client that never connects serves it)."""
    with TestClient(create_app(CREDENTIALS, _manager(aioredis.Redis()))) as http:
        return openapi_cases(http.get(f"{wire.PREFIX}/openapi.json", headers=AUTH).json())


@pytest.mark.anyio
@FUZZ
@given(case=st.deferred(_openapi_cases))
async def test_schemathesis_finds_no_5xx(api: httpx.AsyncClient, case: Case[Any]) -> None:
    response = await send(api, case, AUTH)
    assert response.status_code < 500, (case.body, response.text)
    if response.status_code >= 400:
        _refusal(response)
