"""The models' routes: list each host's models, and pull a pinned Hub source into a host's
store or remove one from it, with how each such store operation goes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request

from capycommon import management as wire
from capycommon import requestbody
from capyctl_scheduler.idempotency import Idempotency
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.routes import mutation
from capyctl_scheduler.routes.mutation import Body, Key


def routes(manager: Manager, idempotency: Idempotency) -> APIRouter:
    api = APIRouter()

    @api.get(f"{wire.PREFIX}/models")
    async def models(host: str | None = None) -> wire.ModelList:
        return wire.ModelList(models=await manager.models(host))

    _store_route(api, idempotency, "pull", wire.PullRequest, manager.pull)
    _store_route(api, idempotency, "remove", wire.RemoveRequest, manager.remove)

    @api.get(f"{wire.PREFIX}/hosts/{{host}}/store-operations/{{operation}}")
    async def store_operation(host: str, operation: str) -> wire.StoreOperationAnswer:
        return await manager.store_operation(host, operation)

    return api


def _store_route(
    api: APIRouter,
    idempotency: Idempotency,
    verb: str,
    parse_as: type[Body],
    act: Callable[[Body], Awaitable[wire.StoreOperationAnswer]],
) -> None:
    """`POST /models/<verb>`: a store operation begun once per Idempotency-Key, answered 202
    with the operation to follow."""

    async def endpoint(request: Request, idempotency_key: Key = None) -> wire.StoreOperationAnswer:
        return await mutation.once(
            idempotency, request, idempotency_key, parse_as, wire.StoreOperationAnswer, act
        )

    api.add_api_route(
        f"{wire.PREFIX}/models/{verb}",
        endpoint,
        methods=["POST"],
        status_code=202,
        openapi_extra=requestbody.openapi_body(parse_as),
        name=verb,
    )
