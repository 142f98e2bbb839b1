"""The peer file: what `capyctl invite server` on a replicated server hands the next server,
and `capyctl start server --peer-file F` installs in that server's state dir.

Every server of one cluster holds the same secrets: the server certificate authority and its
key (each server issues its own certificate from it, and signs hosts' renewals), the control
plane's Redis password, the replication users' passwords, and the role's API key and admin
token (every router takes the same keys). The file carries them all, and the address of the
server that wrote it, which the new server replicates first. It is the most sensitive file
CapyCTL writes (with the authority's key, it can make a certificate for any name): it is
owner-only, one that others can read is refused, and it is deleted once used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Self

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from capycommon.credentials import TOKEN_PATTERN
from capycommon.joinfile import read_document
from capycommon.paths import write_atomic
from capycommon.pki import der_of_public_key, is_authority
from capycommon.replication import Secrets
from capycommon.settingvalues import check_dial_host


def _check_host(value: str) -> str:
    check_dial_host(value)
    return value


def _check_token(value: str) -> str:
    if not TOKEN_PATTERN.fullmatch(value):
        raise ValueError("must be 32-256 characters of [A-Za-z0-9._~+/=-]")
    return value


def _check_authority(value: str) -> str:
    try:
        certificate = x509.load_pem_x509_certificate(value.encode())
    except (ValueError, UnicodeEncodeError):
        raise ValueError("is not a PEM certificate") from None
    if not is_authority(certificate):
        raise ValueError("is not a certificate authority's certificate")
    return value


def _check_key(value: str) -> str:
    try:
        key = serialization.load_pem_private_key(value.encode(), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm, UnicodeEncodeError):
        raise ValueError("is not an unencrypted PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("is not an EC private key")
    return value


Token = Annotated[str, AfterValidator(_check_token)]


class PeerFile(BaseModel):
    """Everything a server needs to join the cluster of the server that wrote it. Fields the
    file has and this version does not know are ignored, so a newer server's file still
    reads here."""

    model_config = ConfigDict(frozen=True, strict=True)

    version: str = Field(min_length=1, description="The CapyCTL version of the server.")
    primary: Annotated[str, AfterValidator(_check_host)] = Field(
        description="The address (replication.advertise) of the server that wrote the file."
    )
    redis_port: int = Field(
        description="The servers' Redis TLS port (enrollment.control_bind's).", ge=1, le=65535
    )
    sentinel_port: int = Field(
        description="The servers' Sentinel port (replication.sentinel_port).", ge=1, le=65535
    )
    server_ca: Annotated[str, AfterValidator(_check_authority)] = Field(
        description="The servers' certificate authority (PEM)."
    )
    server_ca_key: Annotated[str, AfterValidator(_check_key)] = Field(
        repr=False, description="Its private key (PEM)."
    )
    redis_password: Token = Field(repr=False, description="The Redis user capyctl's password.")
    api_key: Token = Field(repr=False)
    admin_token: Token = Field(repr=False)
    replication: Secrets = Field(repr=False)

    @model_validator(mode="after")
    def _key_is_the_authoritys(self) -> Self:
        certificate = x509.load_pem_x509_certificate(self.server_ca.encode())
        key = serialization.load_pem_private_key(self.server_ca_key.encode(), password=None)
        if der_of_public_key(key.public_key()) != der_of_public_key(certificate.public_key()):
            raise ValueError("server_ca_key is not the key of server_ca")
        if self.api_key == self.admin_token:
            raise ValueError("api_key and admin_token are equal")
        return self

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the authority's certificate, in hex (as `Authority.fingerprint`)."""
        certificate = x509.load_pem_x509_certificate(self.server_ca.encode())
        return certificate.fingerprint(hashes.SHA256()).hex()


def write(path: Path, peer: PeerFile) -> None:
    """Write `peer` to `path`, owner-only, through a rename (never half a file)."""
    write_atomic(path, json.dumps(peer.model_dump(), indent=2) + "\n", mode=0o600)


def read(path: Path) -> PeerFile:
    """Read and check the peer file at `path`; anything wrong refuses, naming the field."""
    again = (
        "copy the peer file again as the server wrote it, or make a new one with "
        "`capyctl invite server --output FILE` on a running server"
    )
    missing = "give the peer file `capyctl invite server` wrote on a server"
    return read_document(path, PeerFile, missing, again)
