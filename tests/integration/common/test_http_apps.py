"""The router and management apps in process: who may open which listener."""

from __future__ import annotations

import httpx
import pytest

from capycommon.credentials import generate
from capyctl_router.app import create_app as router_app
from capyctl_scheduler.app import create_app as management_app

CREDENTIALS = generate()


def _client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")  # type: ignore[arg-type]


async def _get(app: object, path: str, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with _client(app) as client:
        return await client.get(path, headers=headers)


@pytest.mark.anyio
async def test_router_health_needs_no_key() -> None:
    response = await _get(router_app(CREDENTIALS), "/health")
    assert response.status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("token", "status"),
    [(CREDENTIALS.api_key, 200), (CREDENTIALS.admin_token, 401), (None, 401), ("x" * 43, 401)],
    ids=["api_key", "admin_token", "none", "wrong"],
)
async def test_router_models_need_the_api_key(token: str | None, status: int) -> None:
    response = await _get(router_app(CREDENTIALS), "/v1/models", token)
    assert response.status_code == status
    if status == 401:
        assert response.json()["error"]["code"] == "unauthenticated"
        assert response.headers["www-authenticate"] == "Bearer"
    else:
        assert response.json() == {"object": "list", "data": []}


@pytest.mark.anyio
async def test_router_unknown_path_is_an_openai_error() -> None:
    response = await _get(router_app(CREDENTIALS), "/v1/nothing", CREDENTIALS.api_key)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("token", "status"),
    [(CREDENTIALS.admin_token, 200), (CREDENTIALS.api_key, 401), (None, 401)],
    ids=["admin_token", "api_key", "none"],
)
async def test_management_needs_the_admin_token(token: str | None, status: int) -> None:
    response = await _get(management_app(CREDENTIALS), "/management/v1/health", token)
    assert response.status_code == status
    assert response.headers["x-content-type-options"] == "nosniff"
    if status == 401:
        body = response.json()
        assert body["api_version"] == "1"
        assert body["error"]["code"] == "unauthenticated"


@pytest.mark.anyio
async def test_malformed_authorization_headers_are_refused() -> None:
    async with _client(router_app(CREDENTIALS)) as client:
        for header in ("Basic abc", "Bearer", f"Token {CREDENTIALS.api_key}"):
            response = await client.get("/v1/models", headers={"Authorization": header})
            assert response.status_code == 401
