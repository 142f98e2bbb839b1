"""The join file: what `capyctl invite host NAME` on the server hands a host, and `capyctl
join host --join-file F` reads there.

It holds where the server is (its bootstrap URL and its Redis TLS port), the server's
certificate authority (so the host trusts that server and no other), the host's name, and a
single-use invitation secret with its expiry. The secret is a credential: the file is
owner-only, and one that others can read is refused. The server keeps only the invitation
id, the SHA-256 of the secret's 32 bytes, so what it stores cannot be used to join.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Annotated, Self, TypeVar
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from capycommon import pki
from capycommon.errors import CertificateInvalid, CredentialsUnusable
from capycommon.paths import read_private, write_atomic
from capycommon.settingvalues import check_dial_host, split_dial_address

Document = TypeVar("Document", bound=BaseModel)

SECRET_BYTES = 32
HEX_PATTERN = re.compile(r"[0-9a-f]{64}")


def new_invitation_secret() -> tuple[str, str]:
    """A new invitation: its secret (32 random bytes, hex) and its id (hex)."""
    secret = secrets.token_hex(SECRET_BYTES)
    return secret, invitation_id(secret)


def invitation_id(secret: str) -> str:
    """The id of an invitation: SHA-256 of the secret's bytes, hex. The server stores and
    looks up this, never the secret."""
    return hashlib.sha256(bytes.fromhex(secret)).hexdigest()


def _check_hex(value: str) -> str:
    if not HEX_PATTERN.fullmatch(value):
        raise ValueError("must be 64 lower-case hex characters")
    return value


def _check_server_address(value: str) -> str:
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"{value!r} is not an https:// URL (for example https://10.0.0.5:7444)")
    if port == 0:
        raise ValueError(f"{value!r} has port 0")
    check_dial_host(parts.hostname)
    return value


def _check_redis_address(value: str) -> str:
    split_dial_address(value)
    return value


def _check_certificate(value: str) -> str:
    try:
        pki.read_certificate(value.encode())
    except (CertificateInvalid, UnicodeEncodeError):
        raise ValueError("is not a PEM certificate") from None
    return value


def _check_host_name(value: str) -> str:
    if not pki.NAME_PATTERN.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a host name (lower-case letters, digits and hyphens, at most "
            "63, starting with a letter or digit)"
        )
    return value


def _check_host_id(value: str | None) -> str | None:
    if value is not None and not pki.IDENTITY_PATTERN.fullmatch(value):
        raise ValueError(f"{value!r} is not a host id")
    return value


class JoinFile(BaseModel):
    """One invitation for one host, as the server wrote it. Fields the file has and this
    version does not know are ignored, so a newer server's file still reads here."""

    model_config = ConfigDict(frozen=True, strict=True)

    version: str = Field(min_length=1, description="The CapyCTL version of the server.")
    server_address: Annotated[str, AfterValidator(_check_server_address)] = Field(
        description="The server's bootstrap URL (https)."
    )
    redis_address: Annotated[str, AfterValidator(_check_redis_address)] = Field(
        description="HOST:PORT of the server's Redis TLS port."
    )
    server_ca: Annotated[str, AfterValidator(_check_certificate)] = Field(
        description="The server's certificate authority (PEM): the only one the host trusts."
    )
    invitation_id: Annotated[str, AfterValidator(_check_hex)]
    invitation_secret: Annotated[str, AfterValidator(_check_hex)] = Field(repr=False)
    host_name: Annotated[str, AfterValidator(_check_host_name)]
    expires_unix: int = Field(description="When the invitation expires, in unix seconds.")
    recover_host_id: Annotated[str | None, AfterValidator(_check_host_id)] = Field(
        default=None,
        description="The id of a host this invitation replaces the certificate of, if any.",
    )

    @model_validator(mode="after")
    def _id_is_the_secrets(self) -> Self:
        if invitation_id(self.invitation_secret) != self.invitation_id:
            raise ValueError("invitation_id is not the SHA-256 of invitation_secret")
        return self


def write(path: Path, join: JoinFile) -> None:
    """Write `join` to `path`, owner-only, through a rename (never half a file)."""
    write_atomic(path, join.model_dump_json(indent=2) + "\n", mode=0o600)


def read(path: Path) -> JoinFile:
    """Read and check the join file at `path`; anything wrong refuses, naming the field."""
    again = (
        "copy the join file again as the server wrote it, or make a new one with "
        "`capyctl invite host NAME` on the server"
    )
    missing = "give the join file `capyctl invite host NAME` wrote on the server"
    return read_document(path, JoinFile, missing, again)


def read_document(path: Path, model: type[Document], missing: str, again: str) -> Document:
    """An owner-only JSON file as `model` (a join file, a peer file): a file that is missing,
    open to others, not JSON or not one is refused, naming the problem and `again`, the
    fix."""
    text = read_private(path, missing=missing, fix=again)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CredentialsUnusable(
            f"{path} is not JSON (line {exc.lineno}: {exc.msg}); {again}"
        ) from None
    if not isinstance(data, dict):
        raise CredentialsUnusable(f"{path} is not a JSON object; {again}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise CredentialsUnusable(f"{path}: {first_problem(exc)}; {again}") from None


def expired(join: JoinFile, now: datetime) -> bool:
    """Whether the invitation has expired at `now` (an aware datetime)."""
    if now.tzinfo is None:
        raise ValueError("now must be an aware datetime")
    return now.timestamp() >= join.expires_unix


def first_problem(exc: ValidationError) -> str:
    """The first of pydantic's errors in plain words, naming the field (and never echoing
    the secret's value)."""
    error = exc.errors(include_url=False, include_input=False)[0]
    field = ".".join(str(part) for part in error["loc"])
    if error["type"] == "missing":
        return f"field {field} is missing"
    message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
    return f"field {field}: {message}" if field else message
