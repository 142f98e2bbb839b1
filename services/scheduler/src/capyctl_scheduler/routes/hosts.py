"""The hosts' routes: list them, drain and undrain one, and, on a server, invite a host to join
and revoke a joined one (`enroll`)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from capycommon import management as wire
from capycommon import requestbody
from capycommon.errors import NotFound
from capyctl_scheduler.enroll import Enrollment
from capyctl_scheduler.idempotency import Idempotency
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.routes import mutation
from capyctl_scheduler.routes.mutation import Key


def routes(manager: Manager, idempotency: Idempotency, enrollment: Enrollment | None) -> APIRouter:
    api = APIRouter()

    @api.post(
        f"{wire.PREFIX}/hosts/{{host}}/drain",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.DrainRequest, required=False),
    )
    async def drain(host: str, request: Request, idempotency_key: Key = None) -> wire.DrainAnswer:
        async def act(_: wire.DrainRequest) -> wire.DrainAnswer:
            return await manager.drain(host)

        return await mutation.once(
            idempotency, request, idempotency_key, wire.DrainRequest, wire.DrainAnswer, act
        )

    @api.post(
        f"{wire.PREFIX}/hosts/{{host}}/undrain",
        openapi_extra=requestbody.openapi_body(wire.DrainRequest, required=False),
    )
    async def undrain(
        host: str, request: Request, idempotency_key: Key = None
    ) -> wire.UndrainAnswer:
        async def act(_: wire.DrainRequest) -> wire.UndrainAnswer:
            return await manager.undrain(host)

        return await mutation.once(
            idempotency, request, idempotency_key, wire.DrainRequest, wire.UndrainAnswer, act
        )

    @api.get(f"{wire.PREFIX}/hosts")
    async def hosts() -> wire.HostList:
        rows = await manager.hosts()
        if enrollment is not None:
            rows = await enrollment.rows(rows)
        return wire.HostList(hosts=rows)

    @api.post(
        f"{wire.PREFIX}/host-invitations",
        status_code=201,
        openapi_extra=requestbody.openapi_body(wire.InvitationRequest),
    )
    async def invite(request: Request) -> wire.InvitationAnswer:
        # No Idempotency-Key: each call is a new single-use secret, and a lost answer is
        # simply asked for again.
        _, found = await mutation.parsed(request, wire.InvitationRequest)
        return await _joined_hosts(enrollment).invite(found)

    @api.post(
        f"{wire.PREFIX}/hosts/{{host}}/revoke",
        openapi_extra=requestbody.openapi_body(wire.RevokeRequest, required=False),
    )
    async def revoke(host: str, request: Request) -> wire.RevokeAnswer:
        await mutation.parsed(request, wire.RevokeRequest)
        return await _joined_hosts(enrollment).revoke(host)

    return api


def _joined_hosts(enrollment: Enrollment | None) -> Enrollment:
    """The server's enrollment; refused where the role takes no joined hosts."""
    if enrollment is None:
        raise NotFound(
            "hosts join a server role, not this one; to serve models here and on "
            "other machines, start a server with an embedded host (capyctl start server "
            "--embedded-host on) and invite hosts to it"
        )
    return enrollment
