"""The server's own certificate authority: made once in a private folder, loaded with every
doubt about its files refused, and signing the certificates CapyCTL's peers present
(`capycommon.pki` reads and checks them).

The server role keeps one authority (`ca.pem`, `ca.key`). It issues a server certificate for
its Redis TLS port and its bootstrap listener, and signs the certificate request of each host
that joins (and of the router) with the usages of its kind (`pki.USAGES`).

This module keeps the authority's two files: it talks to no Redis and serves no HTTP.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import NameOID

from capycommon.errors import CertificateRequestRefused, CredentialsUnusable, InvalidConfig
from capycommon.paths import ensure_private_dir, write_atomic
from capycommon.pki import (
    CLIENT_AUTH,
    IDENTITY_PATTERN,
    KINDS,
    NAME_PATTERN,
    SERVER_AUTH,
    URI_PREFIX,
    USAGES,
    Kind,
    der_of_public_key,
    is_authority,
    pem_of_certificate,
    pem_of_private_key,
)
from capycommon.settingvalues import DNS_NAME

CERT_FILE = "ca.pem"
KEY_FILE = "ca.key"
AUTHORITY_LIFETIME = timedelta(days=3650)
# Issued certificates start a minute in the past, so a peer whose clock is a little behind
# the server's does not see a certificate that is not valid yet.
CLOCK_SKEW = timedelta(minutes=1)
MIN_RSA_BITS = 2048


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
        write_atomic(key_path, pem_of_private_key(key).decode(), mode=0o600)
        write_atomic(cert_path, pem_of_certificate(certificate).decode(), mode=0o644)
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
        if not is_authority(certificate):
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
        if der_of_public_key(key.public_key()) != der_of_public_key(certificate.public_key()):
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
        return pem_of_certificate(self.certificate)

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the certificate's DER, in hex: what a person compares by eye."""
        return self.certificate.fingerprint(hashes.SHA256()).hex()

    def issue_server(
        self, addresses: list[str], lifetime: timedelta, *, client: bool = False
    ) -> tuple[bytes, bytes]:
        """A server certificate and its new private key (both PEM) for the Redis TLS port and
        the bootstrap listener, valid for each of `addresses` (IP addresses or DNS names).

        `client`: also a client certificate. A server among replicated ones presents this same
        certificate when its Redis, its Sentinel and its services dial the other servers
        (Redis uses its one certificate both ways), and those check it as a client's."""
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
            usages=(SERVER_AUTH, CLIENT_AUTH) if client else (SERVER_AUTH,),
            lifetime=lifetime,
        )
        return pem_of_certificate(certificate), pem_of_private_key(key)

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
        return pem_of_certificate(certificate)

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
