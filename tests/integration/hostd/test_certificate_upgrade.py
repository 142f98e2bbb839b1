"""hostd's renewal of a host certificate that cannot serve TLS (clientAuth only, as an
earlier release issued them), against a real Redis with a server of an earlier release in
the test's place: it signs each request the way it always did. The host asks at once, takes
what it gets, says once that its ingress cannot be reached, and does not ask again before
the certificate's usual renewal time."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from capycommon import pki
from capycommon.authority import Authority
from capycommon.domain.hosts import HostIdentity
from capycommon.paths import StatePaths, ensure_private_dir, write_atomic
from capycommon.service import ServiceContext, redis_client
from capycommon.settings import HostSettings
from capyctl_hostd import renewal

HOST = "gpu-1"
HOST_ID = "01J9ZQ4Y5W6X7A8B9C0D1E2F3G"


def earlier_release(authority: Authority, public_key: PublicKeyTypes) -> bytes:
    """What a server of an earlier release signs for the host: clientAuth only."""
    assert isinstance(public_key, ec.EllipticCurvePublicKey)
    now = datetime.now(UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)]))
        .issuer_name(authority.certificate.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"urn:capyctl:host:{HOST_ID}")]
            ),
            critical=False,
        )
        .sign(authority.key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )


def test_a_server_of_an_earlier_release_is_asked_once(
    redis_socket: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    authority = Authority.create(tmp_path / "ca", "capyctl test authority")
    paths = StatePaths(tmp_path / "host")
    ensure_private_dir(paths.identity_dir)
    key = pki.new_private_key()
    public = serialization.load_pem_private_key(key, password=None).public_key()
    write_atomic(paths.host_certificate, (earlier_release(authority, public) + key).decode())
    write_atomic(paths.joined_authority, authority.certificate_pem.decode())
    first = pki.read_certificate(paths.host_certificate.read_bytes())

    async def run() -> tuple[int, int]:
        client = redis_client(f"unix://{redis_socket}")
        stop = asyncio.Event()
        settings = HostSettings.model_validate({"host": {"name": HOST}})
        ctx = ServiceContext("hostd", "host", settings, paths, None, HOST, client, stop)
        renewals: list[float] = []
        keeping = asyncio.create_task(
            renewal.keep_certificate(ctx, renewed=lambda: renewals.append(time.time()))
        )
        requests = 0
        deadline = time.monotonic() + 4
        try:
            while time.monotonic() < deadline:
                request = await ctx.state.identities.certificate_request(HOST)
                if request is not None:
                    requests += 1
                    csr = x509.load_pem_x509_csr(request)
                    signed = earlier_release(authority, csr.public_key())
                    facts = pki.read_certificate(signed)
                    identity = HostIdentity(
                        name=HOST,
                        host_id=HOST_ID,
                        serial=facts.serial,
                        not_after=facts.not_after.timestamp(),
                        version="0.1.0",
                        joined_at=time.time(),
                    )
                    await ctx.state.identities.issue_certificate(identity, signed)
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await keeping
            await client.aclose()
        return requests, len(renewals)

    with caplog.at_level(logging.WARNING, logger="capyctl_hostd.renewal"):
        requests, renewals = asyncio.run(run())
    assert (requests, renewals) == (1, 1)
    now = pki.read_certificate(paths.host_certificate.read_bytes())
    assert now.serial != first.serial
    assert not now.server_auth
    warned = [r.getMessage() for r in caplog.records if "without serverAuth" in r.getMessage()]
    assert len(warned) == 1
    assert "upgrade the server" in warned[0]
