"""The server's certificate authority, with real keys, real certificates and real TLS
handshakes: what it issues checks where it must, and everything else is refused by name."""

from __future__ import annotations

import base64
import ipaddress
import re
import socket
import ssl
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from capycommon import pki
from capycommon.authority import Authority
from capycommon.errors import (
    CertificateInvalid,
    CertificateRequestRefused,
    CredentialsUnusable,
    InvalidConfig,
)

HOUR = timedelta(hours=1)
HOST_ID = "01J9ZQ4Y5W6X7A8B9C0D1E2F3G"


def make_authority(folder: Path) -> Authority:
    return Authority.create(folder, "capyctl test authority")


def host_certificate(
    authority: Authority, name: str = "gpu-1", lifetime: timedelta = HOUR
) -> tuple[bytes, bytes]:
    """A host's key, made on its side, and the certificate the authority signs for it."""
    key = pki.new_private_key()
    request = pki.certificate_request(key, name)
    cert = authority.sign_request(
        request, kind="host", name=name, identity=HOST_ID, lifetime=lifetime
    )
    return cert, key


def test_an_authority_is_written_privately_once_and_loads_back(tmp_path: Path) -> None:
    folder = tmp_path / "pki"
    made = make_authority(folder)
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (folder / "ca.pem").stat().st_mode & 0o777 == 0o644
    assert (folder / "ca.pem").read_bytes() == made.certificate_pem
    assert re.fullmatch(r"[0-9a-f]{64}", made.fingerprint)
    assert "key=" not in repr(made)

    loaded = Authority.load(folder)
    assert loaded.fingerprint == made.fingerprint
    assert Authority.ensure(folder, "another name").fingerprint == made.fingerprint
    with pytest.raises(CredentialsUnusable, match=r"already holds a certificate authority"):
        make_authority(folder)
    assert Authority.load(folder).fingerprint == made.fingerprint

    ca = x509.load_pem_x509_certificate(made.certificate_pem)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert (constraints.critical, constraints.value.ca) == (True, True)
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert (usage.key_cert_sign, usage.crl_sign) == (True, True)
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert isinstance(ca.signature_hash_algorithm, hashes.SHA256)


def test_ensure_makes_an_authority_in_an_empty_folder(tmp_path: Path) -> None:
    made = Authority.ensure(tmp_path / "pki", "capyctl")
    assert Authority.ensure(tmp_path / "pki", "capyctl").fingerprint == made.fingerprint


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "pki"
    make_authority(folder)
    key = folder / "ca.key"
    key.chmod(0o644)
    with pytest.raises(CredentialsUnusable, match=rf"{key} .*mode 0644\); run `chmod 600 {key}`"):
        Authority.load(folder)
    with pytest.raises(CredentialsUnusable, match=r"mode 0644"):
        Authority.ensure(folder, "capyctl")


def test_a_key_that_is_not_the_certificates_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "pki"
    make_authority(folder)
    (folder / "ca.key").write_bytes(pki.new_private_key())
    with pytest.raises(CredentialsUnusable, match=r"ca.key is not the key of .*ca.pem"):
        Authority.load(folder)


def test_a_folder_with_one_of_the_two_files_is_refused_not_replaced(tmp_path: Path) -> None:
    folder = tmp_path / "pki"
    make_authority(folder)
    (folder / "ca.pem").unlink()
    key_before = (folder / "ca.key").read_bytes()
    with pytest.raises(CredentialsUnusable, match=r"ca.pem does not exist; restore .* delete"):
        Authority.ensure(folder, "capyctl")
    assert (folder / "ca.key").read_bytes() == key_before


def test_a_signed_request_is_a_host_certificate_bound_to_the_host(tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "pki")
    before = datetime.now(UTC).replace(microsecond=0)
    cert_pem, key_pem = host_certificate(authority)
    facts = pki.verify_issued(cert_pem, authority.certificate_pem, datetime.now(UTC))

    assert facts == pki.read_certificate(cert_pem)
    assert facts.common_name == "gpu-1"
    assert (facts.kind, facts.identity) == ("host", HOST_ID)
    assert before - timedelta(minutes=1) <= facts.not_before <= before
    assert facts.not_after - facts.not_before == HOUR + timedelta(minutes=1)
    assert facts.not_before.tzinfo is not None

    cert = x509.load_pem_x509_certificate(cert_pem)
    assert facts.serial == format(cert.serial_number, "x")
    assert facts.fingerprint == cert.fingerprint(hashes.SHA256()).hex()
    assert cert.issuer == x509.load_pem_x509_certificate(authority.certificate_pem).subject
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert (constraints.critical, constraints.value.ca) == (True, False)
    # A client's (the server's Redis) and a server's (the host's ingress).
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
    assert facts.server_auth
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert (usage.critical, usage.value.digital_signature) == (True, True)
    assert not usage.value.key_cert_sign
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        f"urn:capyctl:host:{HOST_ID}"
    ]
    assert cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier)
    assert cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)

    assert pki.key_matches(cert_pem, key_pem)
    assert not pki.key_matches(cert_pem, pki.new_private_key())

    second, _ = host_certificate(authority)
    assert pki.read_certificate(second).serial != facts.serial


def test_a_router_certificate_names_its_kind(tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "pki")
    request = pki.certificate_request(pki.new_private_key(), "router")
    cert = authority.sign_request(
        request, kind="router", name="router", identity="router", lifetime=HOUR
    )
    facts = pki.verify_issued(cert, authority.certificate_pem, datetime.now(UTC))
    assert (facts.kind, facts.identity) == ("router", "router")
    # A client certificate only: it cannot serve TLS, and needs no renewal for that.
    eku = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(
        x509.ExtendedKeyUsage
    )
    assert list(eku.value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not facts.server_auth
    assert not pki.renewal_due(facts, datetime.now(UTC))


def issued_with(
    authority: Authority, kind: pki.Kind, usages: list[x509.ObjectIdentifier]
) -> tuple[bytes, bytes]:
    """A certificate of `kind` as the authority would sign it, but with `usages` (as an
    earlier release issued a host's, or as no release issues a router's); and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpu-1")]))
        .issuer_name(authority.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + HOUR)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"urn:capyctl:{kind}:{HOST_ID}")]
            ),
            critical=False,
        )
        .sign(authority.key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), private_pem(key)


def test_a_host_certificate_of_an_earlier_release_checks_and_is_renewed_at_once(
    tmp_path: Path,
) -> None:
    """Issued with clientAuth only, it still reaches the server's Redis; but it cannot be
    the ingress's server certificate, so it is due for renewal however young it is."""
    authority = make_authority(tmp_path / "pki")
    cert, _ = issued_with(authority, "host", [ExtendedKeyUsageOID.CLIENT_AUTH])
    facts = pki.verify_issued(cert, authority.certificate_pem, datetime.now(UTC))
    assert (facts.kind, facts.server_auth) == ("host", False)
    assert pki.renewal_due(facts, facts.not_before)


def test_a_router_certificate_that_could_serve_is_refused(tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "pki")
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
    cert, _ = issued_with(authority, "router", usages)
    with pytest.raises(CertificateInvalid, match=r"not a CapyCTL client certificate"):
        pki.verify_issued(cert, authority.certificate_pem, datetime.now(UTC))
    # Nor does a certificate without clientAuth pass, whatever its kind.
    cert, _ = issued_with(authority, "host", [ExtendedKeyUsageOID.SERVER_AUTH])
    with pytest.raises(CertificateInvalid, match=r"not a CapyCTL client certificate"):
        pki.verify_issued(cert, authority.certificate_pem, datetime.now(UTC))


def test_no_certificate_outlives_its_authority(tmp_path: Path) -> None:
    authority = Authority.create(tmp_path / "pki", "short", lifetime=timedelta(days=2))
    cert, _ = host_certificate(authority, lifetime=timedelta(days=30))
    assert pki.read_certificate(cert).not_after == authority.certificate.not_valid_after_utc


def test_a_certificate_from_another_authority_is_refused(tmp_path: Path) -> None:
    ours = make_authority(tmp_path / "ours")
    theirs = make_authority(tmp_path / "theirs")
    cert, _ = host_certificate(theirs)
    with pytest.raises(CertificateInvalid, match=r"'gpu-1' was not issued by the server's"):
        pki.verify_issued(cert, ours.certificate_pem, datetime.now(UTC))


def test_a_certificate_signed_by_a_key_with_the_same_authority_name_is_refused(
    tmp_path: Path,
) -> None:
    """An impostor authority of the same name: the signature, not the name, decides."""
    ours = make_authority(tmp_path / "ours")
    impostor = make_authority(tmp_path / "impostor")
    assert ours.certificate.subject == impostor.certificate.subject
    cert, _ = host_certificate(impostor)
    with pytest.raises(CertificateInvalid, match=r"not issued by"):
        pki.verify_issued(cert, ours.certificate_pem, datetime.now(UTC))


def test_a_certificate_outside_its_validity_is_refused(tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "pki")
    cert, _ = host_certificate(authority)
    now = datetime.now(UTC)
    with pytest.raises(CertificateInvalid, match=r"'gpu-1' expired at .*join the host"):
        pki.verify_issued(cert, authority.certificate_pem, now + 2 * HOUR)
    with pytest.raises(CertificateInvalid, match=r"not valid before .*check this machine's"):
        pki.verify_issued(cert, authority.certificate_pem, now - HOUR)
    # A minute of clock skew is allowed for.
    pki.verify_issued(cert, authority.certificate_pem, now - timedelta(seconds=50))


def test_a_server_certificate_is_not_a_client_certificate(tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "pki")
    cert, _ = authority.issue_server(["127.0.0.1"], HOUR)
    with pytest.raises(CertificateInvalid, match=r"not a CapyCTL client certificate"):
        pki.verify_issued(cert, authority.certificate_pem, datetime.now(UTC))
    with pytest.raises(CertificateInvalid, match=r"not a CapyCTL client certificate"):
        pki.verify_issued(authority.certificate_pem, authority.certificate_pem, datetime.now(UTC))


def test_what_is_not_a_certificate_is_refused() -> None:
    with pytest.raises(CertificateInvalid, match=r"the certificate is not a PEM certificate"):
        pki.read_certificate(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")


def test_a_request_for_another_name_is_refused(tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "pki")
    request = pki.certificate_request(pki.new_private_key(), "gpu-2")
    with pytest.raises(
        CertificateRequestRefused, match=r"names \['gpu-2'\], but the invitation is for 'gpu-1'"
    ):
        authority.sign_request(request, kind="host", name="gpu-1", identity=HOST_ID, lifetime=HOUR)


def test_a_tampered_request_is_refused(tmp_path: Path) -> None:
    """A request whose subject was changed after it was signed still parses; its signature
    gives it away."""
    authority = make_authority(tmp_path / "pki")
    request = x509.load_pem_x509_csr(pki.certificate_request(pki.new_private_key(), "gpu-1"))
    der = request.public_bytes(serialization.Encoding.DER)
    assert der.count(b"gpu-1") == 1
    altered = der.replace(b"gpu-1", b"gpu-2")
    pem = b"-----BEGIN CERTIFICATE REQUEST-----\n"
    pem += base64.encodebytes(altered) + b"-----END CERTIFICATE REQUEST-----\n"
    with pytest.raises(CertificateRequestRefused, match=r"signature does not match"):
        authority.sign_request(pem, kind="host", name="gpu-2", identity=HOST_ID, lifetime=HOUR)
    with pytest.raises(CertificateRequestRefused, match=r"not a PEM certificate signing"):
        authority.sign_request(
            b"garbage", kind="host", name="gpu-1", identity=HOST_ID, lifetime=HOUR
        )


def private_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def test_weak_or_unusual_keys_are_refused_and_rsa_2048_is_accepted(tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "pki")

    def sign(key_pem: bytes) -> bytes:
        request = pki.certificate_request(key_pem, "gpu-1")
        return authority.sign_request(
            request, kind="host", name="gpu-1", identity=HOST_ID, lifetime=HOUR
        )

    p384 = private_pem(ec.generate_private_key(ec.SECP384R1()))
    with pytest.raises(CertificateRequestRefused, match=r"curve secp384r1; use an EC P-256"):
        sign(p384)
    rsa_1024 = private_pem(rsa.generate_private_key(public_exponent=65537, key_size=1024))
    with pytest.raises(CertificateRequestRefused, match=r"RSA key has 1024 bits"):
        sign(rsa_1024)
    rsa_2048 = private_pem(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    cert = sign(rsa_2048)
    assert pki.key_matches(cert, rsa_2048)
    usage = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.value.key_encipherment


def test_a_server_certificate_names_each_address_by_its_kind(tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "pki")
    addresses = ["192.0.2.10", "2001:db8::1", "[::1]", "GPU-Server.example.com", "localhost"]
    cert_pem, key_pem = authority.issue_server(addresses, HOUR)
    cert = x509.load_pem_x509_certificate(cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("192.0.2.10"),
        ipaddress.ip_address("2001:db8::1"),
        ipaddress.ip_address("::1"),
    ]
    assert sans.get_values_for_type(x509.DNSName) == ["gpu-server.example.com", "localhost"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert pki.key_matches(cert_pem, key_pem)
    assert pki.read_certificate(cert_pem).kind is None

    with pytest.raises(InvalidConfig, match=r"'https://x:6380' is neither an IP address"):
        authority.issue_server(["https://x:6380"], HOUR)
    with pytest.raises(InvalidConfig, match=r"at least one address"):
        authority.issue_server([], HOUR)


def test_renewal_is_due_after_two_thirds_of_the_lifetime() -> None:
    start = datetime(2030, 1, 1, tzinfo=UTC)
    facts = pki.CertificateFacts(
        serial="1",
        common_name="gpu-1",
        kind="host",
        identity=HOST_ID,
        not_before=start,
        not_after=start + timedelta(days=30),
        fingerprint="00",
        server_auth=True,
    )
    assert pki.renewal_time(facts) == start + timedelta(days=20)
    assert not pki.renewal_due(facts, start + timedelta(days=19))
    assert pki.renewal_due(facts, start + timedelta(days=20))
    assert pki.renewal_due(facts, start + timedelta(days=40))
    # A host's that cannot serve TLS is due at once; a router's never serves.
    earlier = replace(facts, server_auth=False)
    assert pki.renewal_due(earlier, start)
    assert not pki.renewal_due(replace(earlier, kind="router"), start)


def test_host_ids_are_crockford_base32_and_sort_by_time() -> None:
    made = [pki.new_identity() for _ in range(200)]
    assert len(set(made)) == len(made)
    for identity in made:
        assert re.fullmatch(r"[0-9A-HJKMNP-TV-Z]{26}", identity)
        assert pki.IDENTITY_PATTERN.fullmatch(identity)
    # The first 10 characters are the time in milliseconds.
    stamp = 0
    for char in made[-1][:10]:
        stamp = stamp * 32 + pki.CROCKFORD.index(char)
    assert abs(stamp / 1000 - datetime.now(UTC).timestamp()) < 60
    assert made[0][:10] <= made[-1][:10]


# TLS: what the server's Redis TLS port (`tls-auth-clients yes`) does with these certificates.


def handshake(
    tmp_path: Path,
    authority: Authority,
    client_cert: bytes,
    client_key: bytes,
    server: tuple[bytes, bytes] | None = None,
) -> dict[str, object]:
    """One TLS connection from a client holding `client_cert` to a server that requires a
    client certificate from `authority`; what each side saw. The server presents `server`
    (a certificate and its key), else a server certificate for 127.0.0.1; a client of a
    `server` checks its certificate but not its name, as the router checks a host's."""
    server_cert, server_key = server or authority.issue_server(["127.0.0.1"], HOUR)
    files = {
        "ca.pem": authority.certificate_pem,
        "server.pem": server_cert,
        "server.key": server_key,
        "client.pem": client_cert,
        "client.key": client_key,
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.verify_mode = ssl.CERT_REQUIRED
    server_context.load_verify_locations(cafile=tmp_path / "ca.pem")
    server_context.load_cert_chain(tmp_path / "server.pem", tmp_path / "server.key")
    client_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_context.load_verify_locations(cadata=authority.certificate_pem.decode())
    client_context.check_hostname = server is None
    client_context.load_cert_chain(tmp_path / "client.pem", tmp_path / "client.key")

    seen: dict[str, object] = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(5)

        def serve() -> None:
            try:
                connection, _ = listener.accept()
                with connection, server_context.wrap_socket(connection, server_side=True) as tls:
                    seen["peer"] = tls.getpeercert()
                    tls.sendall(b"+OK\r\n")
            except (ssl.SSLError, OSError) as exc:
                seen["server_error"] = exc

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with (
                socket.create_connection(listener.getsockname(), timeout=5) as raw,
                client_context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                seen["answer"] = tls.recv(16)
        except (ssl.SSLError, OSError) as exc:
            seen["client_error"] = exc
        thread.join(10)
    assert not thread.is_alive()
    return seen


def test_a_host_certificate_opens_a_tls_connection_to_the_server(tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "pki")
    cert, key = host_certificate(authority)
    seen = handshake(tmp_path, authority, cert, key)
    assert seen.get("answer") == b"+OK\r\n", seen
    peer = seen["peer"]
    assert isinstance(peer, dict)
    assert ("URI", f"urn:capyctl:host:{HOST_ID}") in peer["subjectAltName"]


def test_a_client_certificate_from_another_authority_is_refused_by_tls(
    tmp_path: Path,
) -> None:
    authority = make_authority(tmp_path / "pki")
    stranger = make_authority(tmp_path / "stranger")
    cert, key = host_certificate(stranger)
    seen = handshake(tmp_path, authority, cert, key)
    assert not {"answer", "peer"} & seen.keys(), seen
    assert isinstance(seen["server_error"], ssl.SSLError)
    assert "unable to get local issuer certificate" in str(seen["server_error"])


def test_a_server_certificate_cannot_stand_in_for_a_client(tmp_path: Path) -> None:
    """The clientAuth usage is what lets a certificate in: the server's own does not."""
    authority = make_authority(tmp_path / "pki")
    cert, key = authority.issue_server(["127.0.0.1"], HOUR)
    seen = handshake(tmp_path, authority, cert, key)
    assert not {"answer", "peer"} & seen.keys(), seen
    assert "unsuitable certificate purpose" in str(seen["server_error"])


def test_a_host_certificate_serves_tls_and_a_router_certificate_does_not(
    tmp_path: Path,
) -> None:
    """The host's ingress presents the host's certificate to the router, which checks its
    purpose (serverAuth); a router's own certificate could not stand in for it."""
    authority = make_authority(tmp_path / "pki")
    router_key = pki.new_private_key()
    request = pki.certificate_request(router_key, "router")
    router = authority.sign_request(
        request, kind="router", name="router", identity="router", lifetime=HOUR
    )
    host = host_certificate(authority)
    seen = handshake(tmp_path, authority, router, router_key, server=host)
    assert seen.get("answer") == b"+OK\r\n", seen
    peer = seen["peer"]
    assert isinstance(peer, dict)
    assert ("URI", "urn:capyctl:router:router") in peer["subjectAltName"]

    seen = handshake(tmp_path, authority, *host, server=(router, router_key))
    assert "answer" not in seen, seen
    assert "unsuitable certificate purpose" in str(seen["client_error"])
