"""A joined host's ingress, through real roles: a server, and a host joined to it that says
in its host info where its ingress listens. That address answers TLS with the host's own
certificate to a router's certificate of the server's authority, and refuses the host's.
A host certificate of an earlier release (clientAuth only, which cannot serve TLS) is
renewed as the host starts, and the ingress then presents the renewed one."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from capycommon import ingress, pki
from capycommon.authority import Authority
from capycommon.domain.hosts import HostInfo
from capycommon.state import keys
from support import Role, join_host, short_dir, start_host, start_role, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[Role]:
    role = start_role("server")
    try:
        yield role
    finally:
        role.stop()
        shutil.rmtree(role.state_dir.parent, ignore_errors=True)


@pytest.fixture
def folder() -> Iterator[Path]:
    made = short_dir()
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _host_info(server: Role, name: str) -> HostInfo | None:
    control = server.control()
    try:
        raw = control.get(keys.host_info(name))
    finally:
        control.close()
    return None if raw is None else HostInfo.model_validate_json(raw)


def _client_context(server: Role, folder: Path, kind: pki.Kind) -> ssl.SSLContext:
    """A TLS client presenting a certificate of `kind` from the server's authority, checking
    the ingress's certificate (its serverAuth purpose included) but not its name."""
    authority = Authority.load(server.state_dir / "identity" / "ca")
    key = pki.new_private_key()
    cert = authority.sign_request(
        pki.certificate_request(key, kind),
        kind=kind,
        name=kind,
        identity=pki.new_identity(),
        lifetime=timedelta(hours=1),
    )
    (folder / f"{kind}.pem").write_bytes(cert + key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=authority.certificate_pem.decode())
    context.check_hostname = False
    context.load_cert_chain(folder / f"{kind}.pem")
    return context


def _exchange(address: str, context: ssl.SSLContext) -> tuple[bytes, pki.CertificateFacts]:
    """One request that names an instance the host does not run: the answer, and the facts
    of the certificate the ingress presented."""
    host, port = address.rsplit(":", 1)
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: ingress\r\nConnection: close\r\n"
        f"{ingress.DEPLOYMENT_HEADER}: nothing\r\n{ingress.INSTANCE_HEADER}: 0\r\n"
        f"{ingress.GENERATION_HEADER}: 1\r\nContent-Type: application/json\r\n"
        "Content-Length: 2\r\n\r\n{}"
    )
    got = b""
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        tls.sendall(request.encode())
        try:
            while chunk := tls.recv(4096):
                got += chunk
        except (ssl.SSLError, OSError):
            pass
    return got, pki.read_certificate(ssl.DER_cert_to_PEM_cert(der).encode())


def test_a_joined_host_serves_its_ingress_where_its_host_info_says(
    server: Role, folder: Path
) -> None:
    state = folder / "gpu-i"
    join_host(server, "gpu-i", state)
    host = start_host(state)
    try:
        bind = host.env["CAPYCTL_HOST_INGRESS_BIND"]
        info = wait_for(
            lambda: _host_info(server, "gpu-i"), timeout=15, what="the host's host info"
        )
        assert info.ingress == bind, "a loopback bind is dialled as it is"

        answer, presented = _exchange(bind, _client_context(server, folder, "router"))
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 409 "), answer
        assert json.loads(body)["error"]["code"] == ingress.STALE_CODE
        joined = json.loads((state / "identity" / "joined.json").read_text())
        assert (presented.kind, presented.identity) == ("host", joined["host_id"])
        assert presented.server_auth

        refused, _ = _exchange(bind, _client_context(server, folder, "host"))
        assert refused == b"", "a host's certificate gets nothing"
        log = state / "logs" / "hostd.log"
        wait_for(
            lambda: "refused a connection from 127.0.0.1" in log.read_text(),
            timeout=10,
            what="hostd to log the refused certificate",
        )
        assert host.stop() == 0
    finally:
        host.stop()


def test_a_host_certificate_that_cannot_serve_is_renewed_as_the_host_starts(
    server: Role, folder: Path
) -> None:
    state = folder / "gpu-j"
    join_host(server, "gpu-j", state)
    pem = state / "identity" / "host.pem"
    earlier = _without_server_auth(server, pem.read_bytes())
    pem.write_bytes(earlier)
    assert not pki.read_certificate(earlier).server_auth
    host = start_host(state)
    try:

        def renewed() -> pki.CertificateFacts | None:
            facts = pki.read_certificate(pem.read_bytes())
            return facts if facts.server_auth else None

        facts = wait_for(renewed, timeout=30, what="the host to renew its certificate")
        bind = host.env["CAPYCTL_HOST_INGRESS_BIND"]
        context = _client_context(server, folder, "router")

        def presents_it() -> bool:
            try:
                _, presented = _exchange(bind, context)
            except ssl.SSLCertVerificationError:  # the earlier one: not a server's
                return False
            return presented.serial == facts.serial

        wait_for(presents_it, timeout=10, what="the ingress to present the renewed certificate")
        assert host.stop() == 0
    finally:
        host.stop()


def _without_server_auth(server: Role, host_pem: bytes) -> bytes:
    """The host's certificate as an earlier release issued it (clientAuth only), for the
    same key, name and identity, from the server's authority; with its key, as host.pem
    holds them."""
    authority = Authority.load(server.state_dir / "identity" / "ca")
    current = x509.load_pem_x509_certificate(host_pem)
    key = serialization.load_pem_private_key(host_pem, password=None)
    now = datetime.now(UTC)
    names = current.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(current.subject)
        .issuer_name(authority.certificate.subject)
        .public_key(current.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(names, critical=False)
        .sign(authority.key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM) + key_pem
