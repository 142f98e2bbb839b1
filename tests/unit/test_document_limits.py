"""A document is refused, naming the file, before anything is built from it or sent: not
UTF-8, too large, an alias bomb, or a size no machine holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from capycommon.deployments.load import load_deployment
from capycommon.errors import InvalidConfig
from capycommon.settingsources import load_settings
from capycommon.yamldoc import MAX_ALIASES, MAX_BYTES, load_yaml_document
from support import capyctl

DOCUMENT = "name: qwen\nengine: vllm\nmodel: Qwen3-4B\n"
# Nine aliases of nine aliases of ...: a few hundred bytes that build 9^9 strings.
BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def _refused(path: Path) -> str:
    with pytest.raises(InvalidConfig) as caught:
        load_deployment(path)
    assert caught.value.exit_code == 2
    assert str(path) in caught.value.message
    return caught.value.message


def test_a_document_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(DOCUMENT.encode() + "# café\n".encode("latin-1"))
    assert "is not UTF-8 text (byte 45: b'\\xe9')" in _refused(path)


def test_a_document_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "large.yaml"
    path.write_text(DOCUMENT + "#" * MAX_BYTES + "\n")
    assert "larger than 1024 KiB" in _refused(path)


def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert f"more than {MAX_ALIASES} YAML aliases" in _refused(path)


def test_a_few_aliases_still_read(tmp_path: Path) -> None:
    path = tmp_path / "aliases.yaml"
    path.write_text("base: &base {a: 1}\none: *base\ntwo: *base\n")
    assert load_yaml_document(path) == {"base": {"a": 1}, "one": {"a": 1}, "two": {"a": 1}}


@pytest.mark.parametrize("size", ["99999999999TiB", "65TiB", "70000GiB"])
def test_a_size_no_machine_holds_is_refused(tmp_path: Path, size: str) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text(DOCUMENT + f"engine_config: {{memory: {{request: {size}}}}}\n")
    message = _refused(path)
    assert f"engine_config.memory.request: '{size}' is more than any machine holds" in message


def test_the_largest_size_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "large-request.yaml"
    path.write_text(DOCUMENT + "engine_config: {memory: {request: 64TiB}}\n")
    assert load_deployment(path).engine_config.memory.request == 64 << 40


def test_a_role_document_has_the_same_limits(tmp_path: Path) -> None:
    path = tmp_path / "standalone.yaml"
    path.write_bytes(b"kind: standalone\nhost: {models_root: /srv/\xe9}\n")
    with pytest.raises(InvalidConfig, match=r"standalone\.yaml is not UTF-8 text"):
        load_settings("standalone", document=path, env={})


@pytest.mark.parametrize("content", [BOMB.encode(), b"name: \xff\n"])
def test_the_cli_refuses_before_it_sends_anything(tmp_path: Path, content: bytes) -> None:
    """No role runs on this state dir: the refusal comes from reading the file."""
    path = tmp_path / "deployment.yaml"
    path.write_bytes(content)
    found = capyctl("deploy", "model", "--file", str(path), "--state-dir", str(tmp_path / "s"))
    assert found.returncode == 2
    assert found.stdout == ""
    assert f"error [invalid_config]: {path}" in found.stderr
    assert "Traceback" not in found.stderr
