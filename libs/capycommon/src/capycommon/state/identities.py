"""The server's records of hosts: pending invitations and joined hosts' identities.

Both live under the control plane's keys, which no host's Redis user can touch. An
invitation is kept by its id (sha256 of its secret; the secret itself is never stored) and
expires with it; taking it is one atomic GETDEL, so it works once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from capycommon.domain.hosts import HostIdentity, Invitation
from capycommon.domain.notifications import Notification
from capycommon.joinfile import invitation_id
from capycommon.state import keys, quarantine

# Renewal: the host leaves a certificate request under its prefix and announces it; the
# scheduler signs it, leaves the certificate there and announces that.
REQUEST_KIND = "certificate-request"
ISSUED_KIND = "certificate"


class IdentityStore:
    """Invitations, joined hosts' identities and their certificates' renewal."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def invite(self, secret: str, invitation: Invitation, ttl: int) -> None:
        key = keys.invitation(invitation_id(secret))
        await self.client.set(key, invitation.model_dump_json(), ex=ttl)

    async def take_invitation(self, secret: str) -> Invitation | None:
        """The invitation of `secret`, gone from then on; None when it is unknown, already
        used or expired."""
        key = keys.invitation(invitation_id(secret))
        raw = await self.client.getdel(key)
        return None if raw is None else quarantine.parse(Invitation, raw, key)

    async def peek_invitation(self, secret: str) -> Invitation | None:
        """The invitation of `secret`, left in place (checks come before it is taken)."""
        key = keys.invitation(invitation_id(secret))
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(Invitation, raw, key)

    async def get(self, host: str) -> HostIdentity | None:
        key = keys.host_identity(host)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(HostIdentity, raw, key)

    async def put(self, identity: HostIdentity) -> None:
        await self.client.set(keys.host_identity(identity.name), identity.model_dump_json())

    async def revoke_serial(self, serial: str) -> None:
        await self.client.sadd(keys.revoked_serials(), serial)

    async def set_server_version(self, version: str) -> None:
        await self.client.set(keys.server_version(), version)

    async def server_version(self) -> str | None:
        raw = await self.client.get(keys.server_version())
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)

    async def request_certificate(self, host: str, request: bytes) -> None:
        note = Notification(kind=REQUEST_KIND, id=host, version=0)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(keys.certificate(host))
            pipe.set(keys.certificate_request(host), request)
            pipe.publish(keys.host_notifications(host), note.model_dump_json())
            await pipe.execute()

    async def certificate_request(self, host: str) -> bytes | None:
        raw = await self.client.get(keys.certificate_request(host))
        return raw if isinstance(raw, bytes) else None

    async def drop_certificate_request(self, host: str) -> None:
        await self.client.delete(keys.certificate_request(host))

    async def issue_certificate(self, identity: HostIdentity, certificate: bytes) -> None:
        """Leave the renewed certificate for the host, with its new serial on record."""
        note = Notification(kind=ISSUED_KIND, id=identity.name, version=0)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(keys.certificate(identity.name), certificate)
            pipe.delete(keys.certificate_request(identity.name))
            pipe.set(keys.host_identity(identity.name), identity.model_dump_json())
            pipe.publish(keys.host_notifications(identity.name), note.model_dump_json())
            await pipe.execute()

    async def take_certificate(self, host: str) -> bytes | None:
        """The renewed certificate the scheduler left, gone from then on."""
        raw = await self.client.getdel(keys.certificate(host))
        return raw if isinstance(raw, bytes) else None

    @asynccontextmanager
    async def hosts_announcing(self) -> AsyncIterator[PubSub]:
        """A subscription to every host's announcements (the scheduler's, for renewals)."""
        async with self.client.pubsub() as pubsub:
            await pubsub.psubscribe(keys.host_notifications("*"))
            yield pubsub
