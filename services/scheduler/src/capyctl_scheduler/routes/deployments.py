"""The deployments' routes: declare one (or a new revision), act on one (start, park, stop,
delete), list them, show one, and read its engine's log."""

from __future__ import annotations

from fastapi import APIRouter, Request

from capycommon import management as wire
from capycommon import requestbody
from capycommon.errors import InvalidRequest
from capyctl_scheduler.idempotency import Idempotency
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.routes import mutation
from capyctl_scheduler.routes.mutation import Key

# The most lines of an engine's log one request may ask for.
MOST_LOG_LINES = 10_000


def routes(manager: Manager, idempotency: Idempotency) -> APIRouter:
    api = APIRouter()

    @api.post(
        f"{wire.PREFIX}/deployments",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.DeployRequest),
    )
    async def deploy(request: Request, idempotency_key: Key = None) -> wire.DeployAnswer:
        async def act(found: wire.DeployRequest) -> wire.DeployAnswer:
            return await manager.deploy(found.document, found.expected_revision)

        return await mutation.once(
            idempotency, request, idempotency_key, wire.DeployRequest, wire.DeployAnswer, act
        )

    @api.post(
        f"{wire.PREFIX}/deployments/{{name}}/actions",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.ActionRequest),
    )
    async def action(name: str, request: Request, idempotency_key: Key = None) -> wire.ActionAnswer:
        async def act(found: wire.ActionRequest) -> wire.ActionAnswer:
            return await manager.act(name, found.action)

        return await mutation.once(
            idempotency, request, idempotency_key, wire.ActionRequest, wire.ActionAnswer, act
        )

    @api.get(f"{wire.PREFIX}/deployments")
    async def deployments() -> wire.DeploymentList:
        return wire.DeploymentList(deployments=await manager.summaries())

    @api.get(f"{wire.PREFIX}/deployments/{{name}}")
    async def deployment(name: str) -> wire.DeploymentStatus:
        return await manager.status(name)

    @api.get(f"{wire.PREFIX}/deployments/{{name}}/engine-log")
    async def engine_log(name: str, lines: str = "100") -> wire.EngineLog:
        return await manager.engine_log(name, _count(lines, "lines", MOST_LOG_LINES))

    return api


def _count(value: str, name: str, most: int) -> int:
    """A query parameter that is a whole number from 1 to `most`; refused in the API's own
    error envelope, naming it, otherwise."""
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= most:
        raise InvalidRequest(f"{name} must be a whole number from 1 to {most}, not {value!r}")
    return int(value)
