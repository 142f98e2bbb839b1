"""A joined host renews its certificate before it expires, without a restart.

Once two thirds of the certificate's lifetime has passed, hostd makes a new key, leaves a
certificate request under the host's Redis prefix and announces it; the server's scheduler
signs it and leaves the certificate there. hostd checks it against the server's authority
and its new key, then replaces the one file that holds both with a rename. Connections open
now keep working; every new connection (of hostd and memwatch alike) presents the new one,
and so does the host's ingress, which hostd tells to load it (`renewed`).

A host certificate of an earlier release cannot serve TLS (no serverAuth): it is renewed at
once, so the ingress presents one the server's router accepts. A server of an earlier
release signs another such certificate; that is said once, and the next renewal waits for
its usual time instead of asking again and again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from redis.exceptions import RedisError

from capycommon import pki
from capycommon.errors import CapyError
from capycommon.paths import write_atomic
from capycommon.service import REDIS_ERRORS, ServiceContext, wait_event

log = logging.getLogger(__name__)

# How long the server has to sign a request before hostd asks again.
ANSWER_WITHIN_S = 60.0
POLL_S = 0.5
# After a failed renewal, the next try (the certificate still has a third of its life).
RETRY_S = 10.0
# The longest hostd sleeps before looking at its certificate again.
LOOK_EVERY_S = 3600.0


async def keep_certificate(ctx: ServiceContext, renewed: Callable[[], None] = lambda: None) -> None:
    """Renew the host certificate whenever it is due, calling `renewed` after each renewal."""
    assert ctx.host is not None
    cannot_serve: str | None = None  # the serial of a renewal that still cannot serve TLS
    while not ctx.stop.is_set():
        try:
            facts = pki.read_certificate(ctx.paths.host_certificate.read_bytes())
        except (OSError, CapyError) as exc:
            log.error("cannot read the host certificate %s: %s", ctx.paths.host_certificate, exc)
            await wait_event(ctx.stop, RETRY_S)
            continue
        now = datetime.now(UTC)
        due = pki.renewal_time(facts)
        if not pki.renewal_due(facts, now) or (facts.serial == cannot_serve and now < due):
            await wait_event(ctx.stop, min(LOOK_EVERY_S, max(0.5, (due - now).total_seconds())))
            continue
        try:
            issued = await renew(ctx, ctx.host)
        except (*REDIS_ERRORS, RedisError, CapyError, TimeoutError, ValueError) as exc:
            log.warning("could not renew the host certificate; trying again: %s", exc)
            await wait_event(ctx.stop, RETRY_S)
            continue
        if issued is None:
            continue
        renewed()
        if not issued.server_auth:
            cannot_serve = issued.serial
            log.warning(
                "the server issued a host certificate without serverAuth (it runs an earlier "
                "release), so the server's router cannot reach this host's ingress; upgrade "
                "the server, then restart this host (or wait for its next renewal)"
            )


async def renew(ctx: ServiceContext, host: str) -> pki.CertificateFacts | None:
    """Ask the server for a new certificate, check it and put it in place; its facts, or None
    when stopped before the server answered."""
    key = pki.new_private_key()
    await ctx.state.identities.request_certificate(host, pki.certificate_request(key, host))
    deadline = time.monotonic() + ANSWER_WITHIN_S
    certificate = None
    while certificate is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not sign the renewal in {ANSWER_WITHIN_S:g} s")
        if await wait_event(ctx.stop, POLL_S):
            return None
        certificate = await ctx.state.identities.take_certificate(host)
    authority = ctx.paths.joined_authority.read_bytes()
    facts = pki.verify_issued(certificate, authority, datetime.now(UTC))
    if facts.common_name != host or not pki.key_matches(certificate, key):
        raise ValueError(f"the renewed certificate is not for host {host} and its new key")
    await asyncio.to_thread(
        write_atomic, ctx.paths.host_certificate, (certificate + key).decode(), 0o600
    )
    log.info(
        "renewed the host certificate",
        extra={"serial": facts.serial, "not_after": facts.not_after.isoformat()},
    )
    return facts
