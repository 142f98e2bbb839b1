"""The join file a server hands a host: written owner-only, read back exactly, and every way
it can be wrong refused naming the file, the field and the fix."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from capycommon import joinfile, pki
from capycommon.authority import Authority
from capycommon.errors import CredentialsUnusable
from capycommon.version import __version__

AGAIN = r"copy the join file again .*`capyctl invite host NAME` on the server"


@pytest.fixture(scope="module")
def server_ca(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("pki") / "authority"
    return Authority.create(folder, "capyctl test authority").certificate_pem.decode()


def invitation(ca: str, /, **changes: Any) -> dict[str, Any]:
    secret, invitation_id = joinfile.new_invitation_secret()
    fields: dict[str, Any] = {
        "version": __version__,
        "server_address": "https://10.0.0.5:7444",
        "redis_address": "10.0.0.5:6380",
        "server_ca": ca,
        "invitation_id": invitation_id,
        "invitation_secret": secret,
        "host_name": "gpu-1",
        "expires_unix": 2_000_000_000,
        "recover_host_id": None,
    }
    fields.update(changes)
    return fields


def write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    path.chmod(0o600)
    return path


def test_a_new_secret_is_32_random_bytes_and_its_id_their_sha256() -> None:
    secret, invitation_id = joinfile.new_invitation_secret()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    assert invitation_id == hashlib.sha256(bytes.fromhex(secret)).hexdigest()
    assert joinfile.invitation_id(secret) == invitation_id
    assert joinfile.new_invitation_secret()[0] != secret


def test_a_join_file_is_written_owner_only_and_read_back(tmp_path: Path, server_ca: str) -> None:
    join = joinfile.JoinFile(**invitation(server_ca, recover_host_id=pki.new_identity()))
    path = tmp_path / "gpu-1.join"
    joinfile.write(path, join)
    assert path.stat().st_mode & 0o777 == 0o600
    assert joinfile.read(path) == join
    assert join.invitation_secret not in repr(join)
    assert json.loads(path.read_text())["version"] == __version__


def test_a_file_others_can_read_is_refused(tmp_path: Path, server_ca: str) -> None:
    path = tmp_path / "gpu-1.join"
    joinfile.write(path, joinfile.JoinFile(**invitation(server_ca)))
    path.chmod(0o644)
    with pytest.raises(CredentialsUnusable, match=rf"{path} .*mode 0644.*`chmod 600 {path}`"):
        joinfile.read(path)


def test_a_missing_file_or_one_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpu-1.join"
    with pytest.raises(CredentialsUnusable, match=rf"{path} does not exist; give the join file"):
        joinfile.read(path)
    path.write_text('{"version": "0.1.0",')
    path.chmod(0o600)
    with pytest.raises(CredentialsUnusable, match=rf"{path} is not JSON \(line 1: .*{AGAIN}"):
        joinfile.read(path)
    write_json(path, ["a", "list"])
    with pytest.raises(CredentialsUnusable, match=rf"{path} is not a JSON object"):
        joinfile.read(path)


def test_a_missing_field_is_named(tmp_path: Path, server_ca: str) -> None:
    data = invitation(server_ca)
    del data["redis_address"]
    path = write_json(tmp_path / "gpu-1.join", data)
    with pytest.raises(CredentialsUnusable, match=rf"{path}: field redis_address is missing; "):
        joinfile.read(path)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("invitation_secret", "ab" * 31, "must be 64 lower-case hex characters"),
        ("invitation_secret", "AB" * 32, "must be 64 lower-case hex characters"),
        ("invitation_id", "z" * 64, "must be 64 lower-case hex characters"),
        ("server_ca", "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n", "not a PEM"),
        ("server_address", "http://10.0.0.5:7444", "is not an https:// URL"),
        ("server_address", "https://0.0.0.0:7444", "names every interface"),
        ("redis_address", "10.0.0.5", "is not HOST:PORT"),
        ("redis_address", "10.0.0.5:70000", "is not HOST:PORT"),
        ("host_name", "GPU_1", "is not a host name"),
        ("expires_unix", "2000000000", "valid integer"),
        ("expires_unix", True, "valid integer"),
        ("recover_host_id", "not/an/id", "is not a host id"),
    ],
)
def test_a_wrong_field_is_named(
    tmp_path: Path, server_ca: str, field: str, value: object, says: str
) -> None:
    path = write_json(tmp_path / "gpu-1.join", invitation(server_ca, **{field: value}))
    with pytest.raises(CredentialsUnusable, match=rf"{path}: field {field}: .*{says}.*; copy"):
        joinfile.read(path)


def test_a_secret_is_never_echoed_in_a_refusal(tmp_path: Path, server_ca: str) -> None:
    leaked = "Z" + "0" * 63
    path = write_json(tmp_path / "gpu-1.join", invitation(server_ca, invitation_secret=leaked))
    with pytest.raises(CredentialsUnusable) as refused:
        joinfile.read(path)
    assert leaked not in str(refused.value)


def test_an_id_that_is_not_the_secrets_is_refused(tmp_path: Path, server_ca: str) -> None:
    other_id = joinfile.new_invitation_secret()[1]
    path = write_json(tmp_path / "gpu-1.join", invitation(server_ca, invitation_id=other_id))
    with pytest.raises(
        CredentialsUnusable, match=rf"{path}: invitation_id is not the SHA-256 of invitation_secret"
    ):
        joinfile.read(path)


def test_fields_a_newer_server_adds_are_ignored(tmp_path: Path, server_ca: str) -> None:
    data = invitation(server_ca, comment="from a newer server")
    path = write_json(tmp_path / "gpu-1.join", data)
    assert joinfile.read(path).host_name == "gpu-1"


def test_an_invitation_expires_at_its_time(server_ca: str) -> None:
    join = joinfile.JoinFile(**invitation(server_ca, expires_unix=2_000_000_000))
    assert not joinfile.expired(join, datetime.fromtimestamp(1_999_999_999, UTC))
    assert joinfile.expired(join, datetime.fromtimestamp(2_000_000_000, UTC))
    with pytest.raises(ValueError, match="aware"):
        joinfile.expired(join, datetime(2030, 1, 1))
