"""Certificates of CapyCTL's own authority: what one says, whether it checks, when it is due
for renewal, and the key and request a host makes for one.

Each host that joins (and the router) gets a certificate from the server's authority
(`capycommon.authority`), bound to an identity by a SAN URI `urn:capyctl:<kind>:<identity>`.
A router's is a client certificate (clientAuth); a host's is both a client's and a server's
(clientAuth and serverAuth): the host presents it to the server's Redis and as its own
ingress's certificate (`capycommon.ingress`). A host makes its private key itself and sends
only a certificate request, so its key never leaves it. Keys are EC P-256, signatures
SHA-256.

This module is a library of values: it talks to no Redis, serves no HTTP and reads no file.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import ssl
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, get_args

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from capycommon.errors import CertificateInvalid

Kind = Literal["host", "router"]
KINDS: tuple[Kind, ...] = get_args(Kind)
CLIENT_AUTH = ExtendedKeyUsageOID.CLIENT_AUTH
SERVER_AUTH = ExtendedKeyUsageOID.SERVER_AUTH
# The extended key usages each kind of certificate is issued with.
USAGES: dict[Kind, tuple[x509.ObjectIdentifier, ...]] = {
    "host": (CLIENT_AUTH, SERVER_AUTH),
    "router": (CLIENT_AUTH,),
}

URI_PREFIX = "urn:capyctl:"
# A name a certificate is issued to: the pattern of a host name (settingvalues.HostName),
# which also keeps it within the 64 characters a common name may have.
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
# An identity in the SAN URI: plain URI-safe characters only (a host id is 26 of them).
IDENTITY_PATTERN = re.compile(r"[0-9A-Za-z][0-9A-Za-z-]{0,63}")
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


@dataclass(frozen=True)
class CertificateFacts:
    """What CapyCTL reads from a certificate. `kind` and `identity` come from its
    `urn:capyctl:<kind>:<identity>` SAN URI, None when it has none (a server or CA
    certificate). `server_auth`: whether it may serve TLS (its serverAuth usage); a host
    certificate of an earlier release has only clientAuth."""

    serial: str
    common_name: str | None
    kind: Kind | None
    identity: str | None
    not_before: datetime
    not_after: datetime
    fingerprint: str
    server_auth: bool


def new_private_key() -> bytes:
    """A new EC P-256 private key, PEM (PKCS8, unencrypted): a host makes its own and keeps
    it in a private file."""
    return pem_of_private_key(ec.generate_private_key(ec.SECP256R1()))


def certificate_request(key_pem: bytes, name: str) -> bytes:
    """A certificate signing request (PEM) for `key_pem`, with `name` as its common name."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ValueError("the key must be an EC or RSA private key")
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(serialization.Encoding.PEM)


def read_certificate(pem: bytes) -> CertificateFacts:
    """The facts of a PEM certificate; one that does not parse, or names two CapyCTL
    identities, is refused."""
    return _facts(_load_certificate(pem, "the certificate"))


def peer_facts(transport: asyncio.BaseTransport) -> CertificateFacts:
    """The facts of the certificate the peer of a TLS connection presented, which the
    handshake already checked against the authority its context trusts. CertificateInvalid,
    its message saying why (for a refusal), when the peer presented none or it does not
    read as a CapyCTL certificate."""
    tls = transport.get_extra_info("ssl_object")
    der = tls.getpeercert(binary_form=True) if isinstance(tls, ssl.SSLObject) else None
    if der is None:
        raise CertificateInvalid("it presented no certificate")
    return read_certificate(ssl.DER_cert_to_PEM_cert(der).encode())


def peer_of_kind(transport: asyncio.BaseTransport, kind: Kind) -> CertificateFacts:
    """`peer_facts`, when the certificate is a `kind`'s; CertificateInvalid saying whose it
    is otherwise. The ends of a connection between a host's ingress and the server's router
    each check the other so."""
    facts = peer_facts(transport)
    if facts.kind != kind:
        whose = "no CapyCTL identity" if facts.kind is None else f"a {facts.kind}'s"
        raise CertificateInvalid(
            f"its certificate ({facts.common_name!r}, {whose}) is not a {kind}'s"
        )
    return facts


def verify_issued(cert_pem: bytes, ca_pem: bytes, now: datetime) -> CertificateFacts:
    """The facts of `cert_pem` once it checks as a host's or a router's certificate that the
    authority `ca_pem` issued and that is valid at `now` (an aware datetime); refused
    otherwise, saying why. A host's certificate of an earlier release (clientAuth only)
    passes: it still reaches the server's Redis, and renewal replaces it (`renewal_due`)."""
    if now.tzinfo is None:
        raise ValueError("now must be an aware datetime")
    certificate = _load_certificate(cert_pem, "the certificate")
    authority = _load_certificate(ca_pem, "the authority's certificate")
    facts = _facts(certificate)
    try:
        certificate.verify_directly_issued_by(authority)
    except (ValueError, TypeError, InvalidSignature):
        raise CertificateInvalid(
            f"the certificate of {facts.common_name!r} was not issued by the server's "
            f"certificate authority (fingerprint {_fingerprint(authority)}); join the host "
            "to this server again"
        ) from None
    if now < facts.not_before:
        raise CertificateInvalid(
            f"the certificate of {facts.common_name!r} is not valid before "
            f"{facts.not_before.isoformat()} (now is {now.astimezone(UTC).isoformat()}); "
            "check this machine's clock"
        )
    if now > facts.not_after:
        raise CertificateInvalid(
            f"the certificate of {facts.common_name!r} expired at "
            f"{facts.not_after.isoformat()}; join the host to the server again"
        )
    if facts.kind is None or not _is_issued(certificate, facts.kind):
        raise CertificateInvalid(
            f"the certificate of {facts.common_name!r} is not a CapyCTL client certificate "
            "(not an authority, with a urn:capyctl: identity and the usages of its kind: "
            "clientAuth, and serverAuth for a host's); use the certificate the server issued "
            "when the host joined"
        )
    return facts


def key_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    """Whether `key_pem` is the private key of the certificate `cert_pem` (a ValueError if
    either does not parse)."""
    certificate = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    return der_of_public_key(key.public_key()) == der_of_public_key(certificate.public_key())


def renewal_due(facts: CertificateFacts, now: datetime) -> bool:
    """Whether a certificate should be renewed: once two thirds of its lifetime has passed
    (`renewal_time`), and at once for a host certificate that cannot serve TLS (issued by an
    earlier release, it cannot be the host's ingress's certificate)."""
    if facts.kind == "host" and not facts.server_auth:
        return True
    return now >= renewal_time(facts)


def renewal_time(facts: CertificateFacts) -> datetime:
    """When two thirds of a certificate's lifetime has passed, leaving a third for renewal to
    succeed through outages."""
    lifetime = facts.not_after - facts.not_before
    return facts.not_before + lifetime * 2 / 3


def new_identity() -> str:
    """A new host id: 26 Crockford base32 characters (48 bits of milliseconds, then 80
    random bits), so ids sort by when they were made and never collide in practice."""
    value = (time.time_ns() // 1_000_000 % (1 << 48)) << 80 | secrets.randbits(80)
    return "".join(CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


def _load_certificate(pem: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise CertificateInvalid(
            f"{what} is not a PEM certificate; use the file the server wrote"
        ) from None


def _facts(certificate: x509.Certificate) -> CertificateFacts:
    common_names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    common_name = common_names[0].value if common_names else None
    bound = _identities(certificate)
    if len(bound) > 1:
        raise CertificateInvalid(
            f"the certificate of {common_name!r} names {len(bound)} CapyCTL identities; a "
            "certificate the server issued names one"
        )
    kind, identity = bound[0] if bound else (None, None)
    return CertificateFacts(
        serial=format(certificate.serial_number, "x"),
        common_name=str(common_name) if common_name is not None else None,
        kind=kind,
        identity=identity,
        not_before=certificate.not_valid_before_utc,
        not_after=certificate.not_valid_after_utc,
        fingerprint=_fingerprint(certificate),
        server_auth=SERVER_AUTH in _usages(certificate),
    )


def _identities(certificate: x509.Certificate) -> list[tuple[Kind, str]]:
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    found: list[tuple[Kind, str]] = []
    for uri in names.value.get_values_for_type(x509.UniformResourceIdentifier):
        if not uri.startswith(URI_PREFIX):
            continue
        kind, _, identity = uri.removeprefix(URI_PREFIX).partition(":")
        for known in KINDS:
            if kind == known and IDENTITY_PATTERN.fullmatch(identity):
                found.append((known, identity))
    return found


def is_authority(certificate: x509.Certificate) -> bool:
    try:
        constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints)
    except x509.ExtensionNotFound:
        return False
    return constraints.value.ca


def _is_issued(certificate: x509.Certificate, kind: Kind) -> bool:
    """Not an authority, and a client certificate with at most the usages of its kind."""
    if is_authority(certificate):
        return False
    usages = _usages(certificate)
    return CLIENT_AUTH in usages and usages <= set(USAGES[kind])


def _usages(certificate: x509.Certificate) -> set[x509.ObjectIdentifier]:
    try:
        usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    except x509.ExtensionNotFound:
        return set()
    return set(usage.value)


def _fingerprint(certificate: x509.Certificate) -> str:
    return certificate.fingerprint(hashes.SHA256()).hex()


def pem_of_certificate(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def pem_of_private_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def der_of_public_key(public_key: PublicKeyTypes) -> bytes:
    """A public key's SubjectPublicKeyInfo DER, for comparing two keys of any type."""
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
