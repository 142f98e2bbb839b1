"""The router's client certificate, issued at each server start from the server's authority:
one owner-only file holding the certificate and its key, of kind router, under an identity
kept from the first start."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from capycommon import pki
from capycommon.authority import CERT_FILE, CLOCK_SKEW
from capycommon.errors import CredentialsUnusable
from capycommon.paths import StatePaths, ensure_private_dir
from capycommon.settings import ServerSettings
from capyctl_cli import serveridentity


def _state(root: Path) -> StatePaths:
    """A server's state dir, as `capyctl start` makes its folders before its identity."""
    paths = StatePaths(root)
    ensure_private_dir(paths.redis_dir)
    return paths


PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z ]+)-----.+?-----END \1-----\n", re.DOTALL)


def _blocks(path: Path) -> dict[str, bytes]:
    return {m.group(1).decode(): m.group(0) for m in PEM_BLOCK.finditer(path.read_bytes())}


def test_each_start_issues_the_router_a_certificate_under_one_identity(tmp_path: Path) -> None:
    paths = _state(tmp_path / "state")
    serveridentity.prepare(paths, ServerSettings())
    file = paths.router_certificate
    assert file.stat().st_mode & 0o777 == 0o600
    blocks = _blocks(file)
    assert set(blocks) == {"CERTIFICATE", "PRIVATE KEY"}
    ca = (paths.authority_dir / CERT_FILE).read_bytes()
    first = pki.verify_issued(blocks["CERTIFICATE"], ca, datetime.now(UTC))
    assert first.kind == "router"
    assert first.common_name == serveridentity.ROUTER_NAME
    assert first.identity == paths.router_id.read_text().strip()
    assert pki.key_matches(blocks["CERTIFICATE"], blocks["PRIVATE KEY"])
    lifetime = first.not_after - first.not_before
    assert lifetime == serveridentity.SERVER_CERTIFICATE_LIFETIME + CLOCK_SKEW

    serveridentity.prepare(paths, ServerSettings())
    again = _blocks(file)
    second = pki.verify_issued(again["CERTIFICATE"], ca, datetime.now(UTC))
    assert second.serial != first.serial, "issued anew"
    assert again["PRIVATE KEY"] != blocks["PRIVATE KEY"], "with a new key"
    assert second.identity == first.identity, "for the same router"
    assert file.stat().st_mode & 0o777 == 0o600


def test_a_damaged_router_identity_is_refused_by_name(tmp_path: Path) -> None:
    paths = _state(tmp_path / "state")
    serveridentity.prepare(paths, ServerSettings())
    paths.router_id.write_text("not an id!\n")
    with pytest.raises(CredentialsUnusable, match="router-id does not hold a router identity"):
        serveridentity.prepare(paths, ServerSettings())
