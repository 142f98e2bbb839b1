"""The models' routes: list each host's models, and pull a pinned Hub source into a host's
store or remove one from it, with how each such store operation goes."""

from __future__ import annotations

from fastapi import APIRouter, Request

from capycommon import management as wire
from capycommon import requestbody
from capyctl_scheduler.idempotency import Idempotency
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.routes import mutation
from capyctl_scheduler.routes.mutation import Key


def routes(manager: Manager, idempotency: Idempotency) -> APIRouter:
    api = APIRouter()

    @api.get(f"{wire.PREFIX}/models")
    async def models(host: str | None = None) -> wire.ModelList:
        return wire.ModelList(models=await manager.models(host))

    @api.post(
        f"{wire.PREFIX}/models/pull",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.PullRequest),
    )
    async def pull(request: Request, idempotency_key: Key = None) -> wire.StoreOperationAnswer:
        return await mutation.once(
            idempotency,
            request,
            idempotency_key,
            wire.PullRequest,
            wire.StoreOperationAnswer,
            manager.pull,
        )

    @api.post(
        f"{wire.PREFIX}/models/remove",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.RemoveRequest),
    )
    async def remove(request: Request, idempotency_key: Key = None) -> wire.StoreOperationAnswer:
        return await mutation.once(
            idempotency,
            request,
            idempotency_key,
            wire.RemoveRequest,
            wire.StoreOperationAnswer,
            manager.remove,
        )

    @api.get(f"{wire.PREFIX}/hosts/{{host}}/store-operations/{{operation}}")
    async def store_operation(host: str, operation: str) -> wire.StoreOperationAnswer:
        return await manager.store_operation(host, operation)

    return api
