"""Hosts joining a server: invitations, the bootstrap listener, revocation, certificate
renewal, and the joined hosts' rows in `list hosts`.

Authority over a host comes from Redis alone: a joined host's Redis user may write only under
its own prefix, so a certificate request found there is that host's. The server's records
of hosts (`capycommon.state.identities`) are keys no host can touch.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from datetime import timedelta

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capycommon import joinfile, pki, requestbody
from capycommon import management as wire
from capycommon.authority import Authority
from capycommon.domain.hosts import HostIdentity, Invitation
from capycommon.domain.notifications import Notification
from capycommon.enrollment import (
    JOIN_PATH,
    JoinAnswer,
    JoinRequest,
    dial_addresses,
    incompatibility,
)
from capycommon.errorcodes import http_code_for
from capycommon.errors import (
    CapyError,
    CertificateRequestRefused,
    HostNotRevoked,
    HostVersionIncompatible,
    IdentityConflict,
    InvitationRefused,
    NotFound,
)
from capycommon.paths import StatePaths
from capycommon.service import REDIS_ERRORS, until_stop, wait_event
from capycommon.settings import ServerSettings, host_name
from capycommon.state import acl, identities
from capycommon.state.stores import State
from capycommon.version import __version__
from capyctl_scheduler.errorbody import error_response
from capyctl_scheduler.status import gpus_of

log = logging.getLogger(__name__)

MAX_JOIN_BODY = 64 << 10
# How often pending renewals are looked for besides the hosts' announcements of them
# (pub/sub drops messages while disconnected).
RENEWAL_SWEEP_S = 60.0


class Enrollment:
    def __init__(self, state: State, paths: StatePaths, settings: ServerSettings):
        self.state = state
        self.paths = paths
        self.settings = settings
        self.lifetime = timedelta(seconds=settings.enrollment.certificate_lifetime)
        self._authority: Authority | None = None

    @property
    def authority(self) -> Authority:
        if self._authority is None:
            self._authority = Authority.load(self.paths.authority_dir)
        return self._authority

    async def invite(self, request: wire.InvitationRequest) -> wire.InvitationAnswer:
        """A join file for `request.host_name`, valid once, until it expires."""
        name = request.host_name
        if name == host_name(self.settings):
            raise IdentityConflict(
                f"host {name!r} is this server's embedded host (host.embedded: on); a joined "
                "host needs a name of its own"
            )
        bootstrap, control = dial_addresses(self.settings)
        existing = await self.state.identities.get(name)
        if request.recover:
            if existing is None:
                raise NotFound(f"no host named {name!r} has joined; invite it without --recover")
            if existing.revoked_at is None:
                raise HostNotRevoked(
                    f"host {name!r} (id {existing.host_id}) is not revoked; a recovery replaces "
                    f"a revoked host's certificate: run `capyctl revoke host {name}` first"
                )
        elif existing is not None:
            raise IdentityConflict(
                f"host {name!r} already joined (id {existing.host_id}); a name never replaces "
                f"an identity: revoke it and invite it with --recover, or choose another name"
            )
        ttl = request.lifetime_seconds or int(self.settings.enrollment.invitation_ttl)
        secret, invitation_id = joinfile.new_invitation_secret()
        expires = int(time.time()) + ttl
        recover_id = existing.host_id if request.recover and existing is not None else None
        invitation = Invitation(host_name=name, expires_unix=expires, recover_host_id=recover_id)
        await self.state.identities.invite(secret, invitation, ttl)
        join = joinfile.JoinFile(
            version=__version__,
            server_address=f"https://{bootstrap}",
            redis_address=control,
            server_ca=self.authority.certificate_pem.decode(),
            invitation_id=invitation_id,
            invitation_secret=secret,
            host_name=name,
            expires_unix=expires,
            recover_host_id=recover_id,
        )
        log.info(
            "invited a host", extra={"host": name, "expires": expires, "recover": bool(recover_id)}
        )
        return wire.InvitationAnswer(join=join.model_dump(mode="json"))

    async def join(self, request: JoinRequest) -> JoinAnswer:
        """Sign the host's certificate and make its Redis user, once per invitation."""
        invitation, existing = await self._admitted(request)
        name = invitation.host_name
        recovery = invitation.recover_host_id is not None
        host_id = invitation.recover_host_id or pki.new_identity()
        certificate = self.authority.sign_request(
            request.certificate_request.encode(),
            kind="host",
            name=name,
            identity=host_id,
            lifetime=self.lifetime,
        )
        # Taken only now, so a refused request leaves the invitation to a corrected one; and
        # taken atomically, so two joins racing with one invitation cannot both pass.
        if await self.state.identities.take_invitation(request.invitation_secret) is None:
            raise InvitationRefused("the invitation was used a moment ago; ask for a new one")
        password = secrets.token_urlsafe(32)
        user = acl.host_user(name)
        facts = pki.read_certificate(certificate)
        now = time.time()
        identity = HostIdentity(
            name=name,
            host_id=host_id,
            serial=facts.serial,
            not_after=facts.not_after.timestamp(),
            version=request.version,
            joined_at=existing.joined_at if existing is not None else now,
            renewed_at=now if existing is not None else None,
        )
        try:
            await self.state.host_users.set(name, password)
            await self.state.identities.put(identity)
            await self.state.host_info.join(name)
        except BaseException:
            # The host got nothing: its invitation stands for another try.
            left = int(invitation.expires_unix - time.time())
            if left > 0:
                await self.state.identities.invite(request.invitation_secret, invitation, left)
            raise
        log.info("a host joined", extra={"host": name, "host_id": host_id, "recover": recovery})
        _, control = dial_addresses(self.settings)
        return JoinAnswer(
            host_id=host_id,
            host_name=name,
            certificate=certificate.decode(),
            server_version=__version__,
            redis_address=control,
            redis_user=user,
            redis_password=password,
            topology=await self.state.topology.read(),
        )

    async def _admitted(self, request: JoinRequest) -> tuple[Invitation, HostIdentity | None]:
        """The invitation `request` holds, and the host's identity if it has one, once every
        check passed; nothing is changed here."""
        invitation = await self.state.identities.peek_invitation(request.invitation_secret)
        if invitation is None:
            raise InvitationRefused(
                "the invitation is unknown, already used or expired; ask the server's operator "
                "for a new one (`capyctl invite host NAME`)"
            )
        name = invitation.host_name
        if invitation.expires_unix <= time.time():
            raise InvitationRefused(
                f"the invitation for host {name!r} expired; ask for a new one "
                f"(`capyctl invite host {name}`)"
            )
        if request.host_name != name:
            raise InvitationRefused(
                f"the invitation is for host {name!r}, but this host is {request.host_name!r}; "
                f"join with the join file written for {request.host_name!r} (capyctl invite "
                f"host {request.host_name})"
            )
        recovery = invitation.recover_host_id is not None
        if request.recover != recovery:
            raise InvitationRefused(
                "this is a recovery invitation: join with --recover"
                if recovery
                else "this invitation is not a recovery: join without --recover"
            )
        reason = incompatibility(__version__, request.version)
        if reason is not None:
            raise HostVersionIncompatible(reason)
        existing = await self.state.identities.get(name)
        if not recovery and existing is not None:
            raise IdentityConflict(f"host {name!r} already joined (id {existing.host_id})")
        return invitation, existing

    async def revoke(self, name: str) -> wire.RevokeAnswer:
        """Cut a host off for good: its certificate's serial revoked (never renewed, and refused
        wherever the server checks certificates), its Redis user gone and
        its connections closed. Every key it wrote stays as it was. Safe to repeat."""
        existing = await self.state.identities.get(name)
        if existing is None:
            raise NotFound(f"no host named {name!r} has joined; list them with capyctl list hosts")
        newly = existing.revoked_at is None
        await self.state.identities.revoke_serial(existing.serial)
        if newly:
            revoked = existing.model_copy(update={"revoked_at": time.time()})
            await self.state.identities.put(revoked)
        await self.state.host_users.remove(name)
        # Routers send it nothing from now on (the plan would mark it within a tick).
        await self.state.host_marks.mark_unreachable(name, time.time())
        if newly:
            log.warning("revoked a host", extra={"host": name, "host_id": existing.host_id})
        return wire.RevokeAnswer(
            host_id=existing.host_id, name=name, revoked=True, newly_revoked=newly
        )

    async def renew(self, name: str) -> bool:
        """Sign the renewal a joined host asked for, if any; True when one was issued."""
        request = await self.state.identities.certificate_request(name)
        if request is None:
            return False
        existing = await self.state.identities.get(name)
        if existing is None or existing.revoked_at is not None:
            await self.state.identities.drop_certificate_request(name)
            log.warning("refused a renewal: the host is not joined", extra={"host": name})
            return False
        try:
            certificate = self.authority.sign_request(
                request, kind="host", name=name, identity=existing.host_id, lifetime=self.lifetime
            )
        except CertificateRequestRefused as exc:
            await self.state.identities.drop_certificate_request(name)
            log.warning("refused a renewal: %s", exc.message, extra={"host": name})
            return False
        facts = pki.read_certificate(certificate)
        renewed = existing.model_copy(
            update={
                "serial": facts.serial,
                "not_after": facts.not_after.timestamp(),
                "renewed_at": time.time(),
            }
        )
        await self.state.identities.issue_certificate(renewed, certificate)
        log.info("renewed a host's certificate", extra={"host": name, "serial": facts.serial})
        return True

    async def watch_renewals(self, stop: asyncio.Event) -> None:
        """Sign renewals as hosts announce them, and sweep for any announcement missed."""
        while not stop.is_set():
            try:
                async with self.state.identities.hosts_announcing() as pubsub:
                    await self._sweep()
                    due = time.monotonic() + RENEWAL_SWEEP_S
                    while not stop.is_set():
                        wait = max(0.0, due - time.monotonic())
                        getting = asyncio.ensure_future(
                            pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                        )
                        await until_stop(getting, stop)
                        if not getting.done():
                            getting.cancel()
                            return
                        note = _notification((getting.result() or {}).get("data"))
                        if note is not None and note.kind == identities.REQUEST_KIND:
                            await self.renew(note.id)
                        if time.monotonic() >= due:
                            await self._sweep()
                            due = time.monotonic() + RENEWAL_SWEEP_S
            except REDIS_ERRORS as exc:
                log.warning("renewals: lost Redis; trying again: %s", exc)
                await wait_event(stop, 1.0)

    async def _sweep(self) -> None:
        for name in sorted(await self.state.host_info.hosts()):
            await self.renew(name)

    async def rows(self, planned: list[wire.HostRow]) -> list[wire.HostRow]:
        """The planner's rows, each joined host's told what the server knows of it (its id,
        version, heartbeat, engines, certificate)."""
        rows = {row.name: row for row in planned}
        for name in sorted(await self.state.host_info.hosts()):
            identity = await self.state.identities.get(name)
            if identity is None:
                continue
            beat, reading, engines = await asyncio.gather(
                self.state.heartbeats.get("hostd", name),
                self.state.memory.reading(name),
                self.state.engines.get(name),
            )
            revoked = identity.revoked_at is not None
            connected = beat is not None and not revoked
            if revoked:
                state = "revoked"
            elif connected:
                state = "ready" if reading is not None else "unobserved"
            else:
                state = "down"
            row = rows.get(name)
            rows[name] = (
                row or wire.HostRow(name=name, state=state, gpus=[], domains=[])
            ).model_copy(
                update={
                    "state": row.state if row is not None else state,
                    "gpus": gpus_of(reading),
                    "joined": True,
                    "host_id": identity.host_id,
                    "version": beat.version if beat is not None else identity.version,
                    "connected": connected,
                    "last_heartbeat": beat.last_seen if beat is not None else None,
                    "engines": sorted(p.name for p in engines.profiles) if engines else [],
                    "revoked": revoked,
                    "certificate_expires": identity.not_after,
                }
            )
        return [rows[name] for name in sorted(rows)]


def _notification(data: object) -> Notification | None:
    if not isinstance(data, bytes | str):
        return None
    try:
        return Notification.model_validate_json(data)
    except ValueError:
        return None


def bootstrap_app(enrollment: Enrollment) -> FastAPI:
    """The bootstrap listener's one route: a host joins with its invitation. It is served
    over TLS with the server's certificate, which the host checks against the authority in
    its join file; the invitation secret is the host's credential."""
    app = requestbody.new_app(FastAPI, "CapyCTL bootstrap")

    @app.exception_handler(CapyError)
    async def capy_error(_: Request, exc: CapyError) -> JSONResponse:
        return error_response(exc.http_status, exc.code, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, http_code_for(exc.status_code), str(exc.detail))

    @app.post(JOIN_PATH, response_model_exclude_none=True)
    async def join(request: Request) -> JoinAnswer:
        body = await requestbody.read(request, MAX_JOIN_BODY)
        found = requestbody.validated(JoinRequest, requestbody.parse_object(body or b"{}"))
        return await enrollment.join(found)

    return app
