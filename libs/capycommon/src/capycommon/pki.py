"""The server's own certificate authority, and the certificates it issues.

The server role keeps one authority (`ca.pem`, `ca.key`) in a private folder. It issues a
server certificate for its Redis TLS port and its bootstrap listener, and a certificate to
each host that joins (and to the router), bound to an identity by a SAN URI
`urn:capyctl:<kind>:<identity>`. A router's is a client certificate (clientAuth); a host's
is both a client's and a server's (clientAuth and serverAuth): the host presents it to the
server's Redis and as its own ingress's certificate (`capycommon.ingress`). A host makes its
private key itself and sends only a certificate request, so its key never leaves it. Keys
are EC P-256, signatures SHA-256.

This module is a library of values and files: it talks to no Redis and serves no HTTP.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import secrets
import ssl
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal, get_args

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from capycommon.errors import (
    CertificateInvalid,
    CertificateRequestRefused,
    CredentialsUnusable,
    InvalidConfig,
)
from capycommon.paths import ensure_private_dir, write_atomic
from capycommon.settingvalues import DNS_NAME

Kind = Literal["host", "router"]
KINDS: tuple[Kind, ...] = get_args(Kind)
CLIENT_AUTH = ExtendedKeyUsageOID.CLIENT_AUTH
SERVER_AUTH = ExtendedKeyUsageOID.SERVER_AUTH
# The extended key usages each kind of certificate is issued with.
USAGES: dict[Kind, tuple[x509.ObjectIdentifier, ...]] = {
    "host": (CLIENT_AUTH, SERVER_AUTH),
    "router": (CLIENT_AUTH,),
}

CERT_FILE = "ca.pem"
KEY_FILE = "ca.key"
AUTHORITY_LIFETIME = timedelta(days=3650)
# Issued certificates start a minute in the past, so a peer whose clock is a little behind
# the server's does not see a certificate that is not valid yet.
CLOCK_SKEW = timedelta(minutes=1)
MIN_RSA_BITS = 2048
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


@dataclass(frozen=True)
class Authority:
    """The server's certificate authority: its certificate and its private key, loaded from
    `folder`."""

    folder: Path
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey = field(repr=False)

    @classmethod
    def create(cls, folder: Path, name: str, lifetime: timedelta = AUTHORITY_LIFETIME) -> Authority:
        """Make a new authority in `folder` (created owner-only); refuse to replace one, as
        every certificate it issued would stop working."""
        _check_lifetime(lifetime)
        ensure_private_dir(folder)
        cert_path, key_path = folder / CERT_FILE, folder / KEY_FILE
        for path in (cert_path, key_path):
            if path.exists() or path.is_symlink():
                raise CredentialsUnusable(
                    f"{path} exists: {folder} already holds a certificate authority; load it "
                    f"instead, or delete {cert_path} and {key_path} to make a new one (every "
                    "host must then join again)"
                )
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        key_id = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                _key_usage(digital_signature=True, key_cert_sign=True, crl_sign=True),
                critical=True,
            )
            .add_extension(key_id, critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(key_id),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        # The key first: a folder left with a key and no certificate is refused by name,
        # never mistaken for an empty one and overwritten.
        write_atomic(key_path, _key_pem(key).decode(), mode=0o600)
        write_atomic(cert_path, _cert_pem(certificate).decode(), mode=0o644)
        return cls(folder=folder, certificate=certificate, key=key)

    @classmethod
    def load(cls, folder: Path) -> Authority:
        """Read the authority in `folder`; any doubt about its files refuses."""
        cert_path, key_path = folder / CERT_FILE, folder / KEY_FILE
        start_over = (
            f"restore {cert_path} and {key_path} from a backup, or delete both to make a new "
            "authority (every host must then join again)"
        )
        certificate_text = _read_file(cert_path, start_over)
        try:
            certificate = x509.load_pem_x509_certificate(certificate_text)
        except ValueError:
            raise CredentialsUnusable(
                f"{cert_path} is not a PEM certificate; {start_over}"
            ) from None
        if not _is_authority(certificate):
            raise CredentialsUnusable(
                f"{cert_path} is not a certificate authority's certificate; {start_over}"
            )
        key_text = _read_file(key_path, start_over)
        _check_private(key_path)
        try:
            key = serialization.load_pem_private_key(key_text, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise CredentialsUnusable(
                f"{key_path} is not an unencrypted PEM private key; {start_over}"
            ) from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise CredentialsUnusable(f"{key_path} is not an EC private key; {start_over}")
        if _public_der(key.public_key()) != _public_der(certificate.public_key()):
            raise CredentialsUnusable(
                f"{key_path} is not the key of {cert_path}: one of them was replaced; {start_over}"
            )
        return cls(folder=folder, certificate=certificate, key=key)

    @classmethod
    def ensure(cls, folder: Path, name: str) -> Authority:
        """Load the authority in `folder`, making it on first use. A folder with only one of
        the two files is refused (by `load`), not silently replaced."""
        if not any((folder / file).exists() for file in (CERT_FILE, KEY_FILE)):
            return cls.create(folder, name)
        return cls.load(folder)

    @property
    def certificate_pem(self) -> bytes:
        return _cert_pem(self.certificate)

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the certificate's DER, in hex: what a person compares by eye."""
        return self.certificate.fingerprint(hashes.SHA256()).hex()

    def issue_server(self, addresses: list[str], lifetime: timedelta) -> tuple[bytes, bytes]:
        """A server certificate and its new private key (both PEM) for the Redis TLS port and
        the bootstrap listener, valid for each of `addresses` (IP addresses or DNS names)."""
        if not addresses:
            raise InvalidConfig(
                "the server certificate needs at least one address; give the server's "
                "addresses (IP addresses or DNS names) that hosts connect to"
            )
        names = [_subject_alternative_name(address) for address in addresses]
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = self._issue(
            key.public_key(),
            common_name="capyctl server",
            names=names,
            usages=(SERVER_AUTH,),
            lifetime=lifetime,
        )
        return _cert_pem(certificate), _key_pem(key)

    def sign_request(
        self, csr_pem: bytes, *, kind: Kind, name: str, identity: str, lifetime: timedelta
    ) -> bytes:
        """A certificate (PEM) for the key in `csr_pem`, named `name`, bound to
        `urn:capyctl:<kind>:<identity>`, with the usages of its kind (`USAGES`). Only the
        request's key is taken from it: its subject must be `name`, and any extension it asks
        for is ignored."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        if not NAME_PATTERN.fullmatch(name):
            raise ValueError(f"name {name!r} does not match {NAME_PATTERN.pattern}")
        if not IDENTITY_PATTERN.fullmatch(identity):
            raise ValueError(f"identity {identity!r} does not match {IDENTITY_PATTERN.pattern}")
        try:
            request = x509.load_pem_x509_csr(csr_pem)
        except ValueError:
            raise CertificateRequestRefused(
                "the certificate request is not a PEM certificate signing request; send the "
                "one `capyctl join host` builds"
            ) from None
        try:
            signed = request.is_signature_valid
            public_key = request.public_key()
        except (UnsupportedAlgorithm, ValueError):
            raise CertificateRequestRefused(
                "the certificate request's key is of a kind CapyCTL does not accept; use an "
                f"EC P-256 key or an RSA key of at least {MIN_RSA_BITS} bits"
            ) from None
        if not signed:
            raise CertificateRequestRefused(
                "the certificate request's signature does not match its contents (it was "
                "altered, or signed with another key); build a new request"
            )
        common_names = request.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        asked = [attribute.value for attribute in common_names]
        if asked != [name]:
            raise CertificateRequestRefused(
                f"the certificate request names {asked or 'no common name'}, but the "
                f"invitation is for {name!r}; build the request with the invited name"
            )
        certificate = self._issue(
            _client_key(public_key),
            common_name=name,
            names=[x509.UniformResourceIdentifier(f"{URI_PREFIX}{kind}:{identity}")],
            usages=USAGES[kind],
            lifetime=lifetime,
        )
        return _cert_pem(certificate)

    def _issue(
        self,
        public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey,
        *,
        common_name: str,
        names: list[x509.GeneralName],
        usages: tuple[x509.ObjectIdentifier, ...],
        lifetime: timedelta,
    ) -> x509.Certificate:
        """An end-entity certificate for `public_key`, signed by this authority. It ends no
        later than the authority itself: a certificate outliving its issuer checks nowhere."""
        _check_lifetime(lifetime)
        now = datetime.now(UTC)
        not_after = min(now + lifetime, self.certificate.not_valid_after_utc)
        authority_key_id = self.certificate.extensions.get_extension_for_class(
            x509.SubjectKeyIdentifier
        ).value
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                # An RSA key may be used for RSA key exchange, which enciphers with it.
                _key_usage(
                    digital_signature=True,
                    key_encipherment=isinstance(public_key, rsa.RSAPublicKey),
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(authority_key_id),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )


def new_private_key() -> bytes:
    """A new EC P-256 private key, PEM (PKCS8, unencrypted): a host makes its own and keeps
    it in a private file."""
    return _key_pem(ec.generate_private_key(ec.SECP256R1()))


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
    return _public_der(key.public_key()) == _public_der(certificate.public_key())


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


def _check_lifetime(lifetime: timedelta) -> None:
    if lifetime <= timedelta(0):
        raise ValueError(f"a certificate's lifetime must be positive, not {lifetime}")


def _client_key(
    public_key: PublicKeyTypes,
) -> ec.EllipticCurvePublicKey | rsa.RSAPublicKey:
    """The request's key, if it is one CapyCTL accepts: EC P-256, or RSA of 2048 bits or
    more."""
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if isinstance(public_key.curve, ec.SECP256R1):
            return public_key
        raise CertificateRequestRefused(
            f"the certificate request's key is on curve {public_key.curve.name}; use an EC "
            f"P-256 (secp256r1) key or an RSA key of at least {MIN_RSA_BITS} bits"
        )
    if isinstance(public_key, rsa.RSAPublicKey):
        if public_key.key_size >= MIN_RSA_BITS:
            return public_key
        raise CertificateRequestRefused(
            f"the certificate request's RSA key has {public_key.key_size} bits; use at least "
            f"{MIN_RSA_BITS}, or an EC P-256 key"
        )
    raise CertificateRequestRefused(
        "the certificate request's key is neither EC nor RSA; use an EC P-256 key or an RSA "
        f"key of at least {MIN_RSA_BITS} bits"
    )


def _subject_alternative_name(address: str) -> x509.GeneralName:
    """An IP address as an IP SAN (a TLS client checks an IP against those only), anything
    else as a DNS name."""
    bare = address.strip()
    if bare.startswith("[") and bare.endswith("]"):
        bare = bare[1:-1]
    try:
        return x509.IPAddress(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if not DNS_NAME.fullmatch(bare):
        raise InvalidConfig(
            f"server address {address!r} is neither an IP address nor a DNS name; give "
            "an address like 192.0.2.10 or gpu-server.example.com, without port or scheme"
        )
    return x509.DNSName(bare.lower())


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


def _is_authority(certificate: x509.Certificate) -> bool:
    try:
        constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints)
    except x509.ExtensionNotFound:
        return False
    return constraints.value.ca


def _is_issued(certificate: x509.Certificate, kind: Kind) -> bool:
    """Not an authority, and a client certificate with at most the usages of its kind."""
    if _is_authority(certificate):
        return False
    usages = _usages(certificate)
    return CLIENT_AUTH in usages and usages <= set(USAGES[kind])


def _usages(certificate: x509.Certificate) -> set[x509.ObjectIdentifier]:
    try:
        usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    except x509.ExtensionNotFound:
        return set()
    return set(usage.value)


def _key_usage(
    *,
    digital_signature: bool = False,
    key_encipherment: bool = False,
    key_cert_sign: bool = False,
    crl_sign: bool = False,
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=key_encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _read_file(path: Path, fix: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CredentialsUnusable(f"{path} does not exist; {fix}") from None
    except OSError as exc:
        raise CredentialsUnusable(f"cannot read {path}: {exc.strerror}; {fix}") from None


def _check_private(path: Path) -> None:
    """Refuse a private key that is not this user's alone."""
    info = path.stat()
    if info.st_uid != os.getuid():
        raise CredentialsUnusable(
            f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}); "
            f"run `chown {os.getuid()} {path}`"
        )
    if info.st_mode & 0o077:
        raise CredentialsUnusable(
            f"{path} is readable or writable by group or others (mode "
            f"{info.st_mode & 0o777:04o}); run `chmod 600 {path}`"
        )


def _fingerprint(certificate: x509.Certificate) -> str:
    return certificate.fingerprint(hashes.SHA256()).hex()


def _cert_pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _public_der(public_key: PublicKeyTypes) -> bytes:
    """A public key's SubjectPublicKeyInfo DER, for comparing two keys of any type."""
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
