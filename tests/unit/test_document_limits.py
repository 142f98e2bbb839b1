"""A document is refused, naming the file, before anything is built from it or sent: not
UTF-8, too large, an alias bomb, nested too deep, a value its tag cannot build, or a size no
machine holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from capycommon import credentials
from capycommon.deployments.load import load_deployment
from capycommon.engines import registry
from capycommon.errors import CredentialsUnusable, InvalidConfig
from capycommon.settingsources import load_settings
from capycommon.yamldoc import MAX_ALIASES, MAX_BYTES, MAX_DEPTH, load_yaml_document
from support import capyctl

DOCUMENT = "name: qwen\nengine: vllm\nmodel: Qwen3-4B\n"
# Nine aliases of nine aliases of ...: a few hundred bytes that build 9^9 strings.
BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)
# A thousand levels: PyYAML builds a document by recursion, and these ended in a
# RecursionError's traceback and exit 1.
DEEP = {
    "flow sequences": "[" * 1000 + "]" * 1000 + "\n",
    "flow mappings": "{a: " * 1000 + "1" + "}" * 1000 + "\n",
    "block mappings": "".join(" " * i + "a:\n" for i in range(1000)) + " " * 1000 + "1\n",
    "a deep setting": DOCUMENT + "engine_config: " + "[" * 1000 + "]" * 1000 + "\n",
}
# Values whose tag PyYAML resolves but cannot build: each ended in a ValueError or TypeError.
UNBUILDABLE = {
    "a: " + "1" * 5000: "the value '"
    + "1" * 40
    + "...' at line 1, column 4 is not a valid YAML int",
    "a: 2001-13-45": "the value '2001-13-45' at line 1, column 4 is not a valid YAML timestamp",
    "a: !!float abc": "the value 'abc' at line 1, column 4 is not a valid YAML float",
    "? [1]\n: 2": "the key at line 1, column 3 is a sequence; a key must be a plain value",
    "{a: 1}: 2": "the key at line 1, column 1 is a mapping; a key must be a plain value",
}


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


@pytest.mark.parametrize("text", DEEP.values(), ids=DEEP.keys())
def test_a_document_nested_too_deep_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    assert f"nested more than {MAX_DEPTH} levels deep at line " in _refused(path)


def test_nesting_up_to_the_limit_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "nested.yaml"
    path.write_text("[" * MAX_DEPTH + "]" * MAX_DEPTH + "\n")
    value = load_yaml_document(path)
    for _ in range(MAX_DEPTH - 1):
        value = value[0]
    assert value == []


@pytest.mark.parametrize("text", UNBUILDABLE, ids=range(len(UNBUILDABLE)))
def test_a_value_its_tag_cannot_build_is_refused_where_it_stands(tmp_path: Path, text: str) -> None:
    path = tmp_path / "value.yaml"
    path.write_text(text + "\n")
    assert f"{path}: {UNBUILDABLE[text]}" in _refused(path)


def test_an_ordinary_syntax_error_still_names_its_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "syntax.yaml"
    path.write_text(DOCUMENT + "engine_config: [a, b\n")
    message = _refused(path)
    assert f"{path} is not valid YAML: " in message
    assert "line 5, column 1" in message


def test_the_engines_document_and_the_credentials_have_the_same_limits(tmp_path: Path) -> None:
    deep = "[" * 1000 + "]" * 1000 + "\n"
    engines = tmp_path / "engines.yaml"
    engines.write_text(deep)
    with pytest.raises(InvalidConfig, match=rf"{engines}: nested more than {MAX_DEPTH} levels"):
        registry.read(engines)
    secret = tmp_path / "identity" / "credentials"
    secret.parent.mkdir(mode=0o700)
    secret.write_text(deep)
    secret.chmod(0o600)
    with pytest.raises(CredentialsUnusable, match="must hold exactly the keys"):
        credentials.load(secret)


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


@pytest.mark.parametrize(
    "content", [BOMB.encode(), b"name: \xff\n", DEEP["flow mappings"].encode()]
)
def test_the_cli_refuses_before_it_sends_anything(tmp_path: Path, content: bytes) -> None:
    """No role runs on this state dir: the refusal comes from reading the file."""
    path = tmp_path / "deployment.yaml"
    path.write_bytes(content)
    found = capyctl("deploy", "model", "--file", str(path), "--state-dir", str(tmp_path / "s"))
    assert found.returncode == 2
    assert found.stdout == ""
    assert f"error [invalid_config]: {path}" in found.stderr
    assert "Traceback" not in found.stderr


ROLE = "kind: standalone\nhost:\n  models_root: "
DEEP_ROLE = {
    "a setting of flow sequences": ROLE + DEEP["flow sequences"],
    "a setting of flow mappings": ROLE + DEEP["flow mappings"],
    "block mappings": DEEP["block mappings"],
}


@pytest.mark.parametrize("text", DEEP_ROLE.values(), ids=DEEP_ROLE.keys())
def test_the_cli_refuses_a_role_document_nested_too_deep(tmp_path: Path, text: str) -> None:
    path = tmp_path / "standalone.yaml"
    path.write_text(text)
    state = str(tmp_path / "s")
    for command in (["config", "show"], ["start", "standalone"]):
        found = capyctl(*command, "--config", str(path), "--state-dir", state)
        assert found.returncode == 2, found.stderr
        assert found.stderr.startswith(f"error [invalid_config]: {path}: nested more than 32 ")
        assert "Traceback" not in found.stderr
