"""The management API in process, over a real redis-server: every route answers its model
(`capycommon.management`), and what the CLI reads back is exactly what the API sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from capycommon import management as wire
from capycommon.credentials import generate
from capycommon.domain.models import HostModels, ModelFacts
from capycommon.engines.families import Family
from capycommon.engines.registry import EngineProfile, EnginesDocument, Registry
from capycommon.state.stores import State
from capyctl_scheduler.app import create_app
from capyctl_scheduler.loop import Scheduler
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.observe import Observer

CREDENTIALS = generate()
HOST = "local"
DOCUMENT: wire.JsonObject = {"name": "m", "engine": "vllm", "model": "m"}
M = TypeVar("M", bound=BaseModel)


@pytest.fixture
async def api(redis_socket: Path, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The management app of a scheduler whose one host has published a vLLM profile."""
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    model = ModelFacts(path=f"{tmp_path}/models/m", kind="folder", weights_bytes=1 << 30)
    models = HostModels(models_root=f"{tmp_path}/models", models={"m": model})
    await state.host_models.publish(HOST, models)
    profile = EngineProfile(
        name="vllm",
        family=Family.VLLM,
        version="0.29.0",
        executable=tmp_path / "python",
        install_path=tmp_path,
        fingerprint="0.29.0+sha256:00",
        verified=True,
        added_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    )
    registry = Registry(
        path=tmp_path / "engines.yaml",
        revision=1,
        document=EnginesDocument(profiles={"vllm": profile}),
    )
    await state.engines.publish(HOST, registry)
    manager = Manager(Scheduler(state, Observer(state, [HOST])))
    app = create_app(CREDENTIALS, manager)
    headers = {"Authorization": f"Bearer {CREDENTIALS.admin_token}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url=f"http://test{wire.PREFIX}", headers=headers
    ) as http:
        yield http
    await state.client.aclose()


def read(response: httpx.Response, model: type[M]) -> M:
    """The answer as the CLI reads it; its JSON must be the API's, field for field."""
    found = model.model_validate_json(response.content)
    assert found.model_dump(mode="json") == response.json()
    return found


async def post(http: httpx.AsyncClient, path: str, body: object, key: str) -> httpx.Response:
    return await http.post(path, json=body, headers={"Idempotency-Key": key})


@pytest.mark.anyio
async def test_every_route_answers_its_model(api: httpx.AsyncClient) -> None:
    assert read(await api.get("/health"), wire.Health).status == "ok"
    created = await post(api, "/deployments", {"document": DOCUMENT}, "k1")
    assert created.status_code == 202
    answer = read(created, wire.DeployAnswer)
    assert (answer.deployment, answer.revision, answer.change) == ("m", 1, "created")
    again = await post(api, "/deployments", {"document": DOCUMENT}, "k1")
    assert again.json() == created.json(), "a retry gets the kept answer"

    (row,) = read(await api.get("/deployments"), wire.DeploymentList).deployments
    assert (row.name, row.state, row.ready, row.routes) == ("m", "idle", "0/1", ["m"])
    status = read(await api.get("/deployments/m"), wire.DeploymentStatus)
    assert status.api_version == "1"
    (binding,) = (await api.get("/deployments/m")).json()["bindings"]
    assert binding["host"] == HOST
    absent = [key for key, value in binding.items() if value is None and key != "weights_bytes"]
    assert absent == [], "what does not apply to a host is left out, not null"
    assert status.document["name"] == "m"

    (host,) = read(await api.get("/hosts"), wire.HostList).hosts
    assert (host.name, host.state) == (HOST, "down"), "no hostd heartbeat"
    (engine,) = read(await api.get("/engines"), wire.EngineList).engines
    assert (engine.host, engine.name, engine.family) == (HOST, "vllm", "vllm")
    assert (await api.get("/engines")).json()["engines"][0]["added_at"] == "2026-01-02T03:04:05Z"

    stopped = read(
        await post(api, "/deployments/m/actions", {"action": "stop"}, "k2"), wire.ActionAnswer
    )
    assert (stopped.deployment, stopped.action) == ("m", "stop")
    drained = read(await post(api, f"/hosts/{HOST}/drain", {}, "k3"), wire.DrainAnswer)
    assert (drained.host, drained.stopping) == (HOST, [])


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "body", "status", "code", "says"),
    [
        ("/deployments", {"document": DOCUMENT, "force": True}, 400, "invalid_request", "force"),
        ("/deployments", {"document": {"name": "Bad!"}}, 400, "invalid_config", "name"),
        ("/deployments/m/actions", {"action": "restart"}, 400, "invalid_request", "action"),
        ("/deployments/none/actions", {"action": "stop"}, 404, "not_found", "none"),
        ("/hosts/elsewhere/drain", {}, 404, "not_found", "elsewhere"),
    ],
    ids=["unknown-field", "bad-document", "unknown-action", "no-deployment", "no-host"],
)
async def test_a_refusal_is_the_error_body(
    api: httpx.AsyncClient, path: str, body: object, status: int, code: str, says: str
) -> None:
    response = await post(api, path, body, f"key-{code}-{says}")
    assert response.status_code == status
    error = read(response, wire.ErrorBody).error
    assert (error.code, error.retryable) == (code, False)
    assert says in error.message


@pytest.mark.anyio
async def test_a_mutation_without_an_idempotency_key_is_refused(api: httpx.AsyncClient) -> None:
    response = await api.post("/deployments", json={"document": DOCUMENT})
    assert response.status_code == 400
    assert read(response, wire.ErrorBody).error.code == "invalid_request"
    assert read(await api.get("/deployments"), wire.DeploymentList).deployments == []
