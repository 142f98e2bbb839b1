"""Settings: precedence, provenance and refusals, without any process."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from capycommon.errors import InvalidConfig
from capycommon.paths import resolve_state_dir
from capycommon.settings import (
    ROLES,
    HostSettings,
    StandaloneSettings,
    load_settings,
    locate_document,
    split_address,
    template,
)


def _sources(loaded: object) -> dict[str, str]:
    return {row.path: row.source for row in loaded.rows}  # type: ignore[attr-defined]


def test_precedence_is_flag_then_env_then_yaml_then_default(tmp_path: Path) -> None:
    doc = tmp_path / "standalone.yaml"
    path = "server.listeners.inference.bind"
    doc.write_text("server:\n  listeners:\n    inference:\n      bind: 127.0.0.1:1001\n")
    env = {"CAPYCTL_INFERENCE_ADDR": "127.0.0.1:1002"}
    flags = {"--listen": "127.0.0.1:1003"}

    def bind(**kwargs: object) -> tuple[str, str]:
        loaded = load_settings("standalone", **kwargs)  # type: ignore[arg-type]
        assert isinstance(loaded.settings, StandaloneSettings)
        return loaded.settings.server.listeners.inference.bind, _sources(loaded)[path]

    assert bind(document=None, env={}) == ("0.0.0.0:8443", "default")
    assert bind(document=doc, env={}) == ("127.0.0.1:1001", "yaml")
    assert bind(document=doc, env=env) == ("127.0.0.1:1002", "env")
    assert bind(document=doc, env=env, flags=flags) == ("127.0.0.1:1003", "flag")


def test_an_empty_variable_is_unset() -> None:
    loaded = load_settings("standalone", document=None, env={"CAPYCTL_LOG_LEVEL": ""})
    assert loaded.settings.log.level == "info"
    assert _sources(loaded)["log.level"] == "default"


def test_variables_of_other_roles_are_ignored() -> None:
    loaded = load_settings("host", document=None, env={"CAPYCTL_INFERENCE_ADDR": "junk"})
    assert isinstance(loaded.settings, HostSettings)


def test_a_malformed_value_never_falls_back_to_the_default() -> None:
    with pytest.raises(InvalidConfig) as caught:
        load_settings("standalone", document=None, env={"CAPYCTL_ENGINE_PORTS": "8100"})
    assert caught.value.message == (
        "CAPYCTL_ENGINE_PORTS sets host.engine_ports to '8100': "
        "'8100' is not START-END (for example 8100-8199)"
    )


def test_every_problem_is_named_at_once(tmp_path: Path) -> None:
    doc = tmp_path / "d.yaml"
    doc.write_text("log:\n  level: loud\n  colour: red\n")
    with pytest.raises(InvalidConfig) as caught:
        load_settings("standalone", document=doc, env={})
    assert f"{doc}: log.level = 'loud'" in caught.value.message
    assert f"{doc}: unknown key 'log.colour'" in caught.value.message


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("8443", "is not ADDR:PORT"),
        ("host:8443", "is not an IP address"),
        ("127.0.0.1:70000", "outside 1-65535"),
    ],
)
def test_listen_addresses_are_checked(value: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        split_address(value)


def test_addresses_parse() -> None:
    assert split_address("[::1]:7443") == ("::1", 7443)
    assert split_address("localhost:1") == ("localhost", 1)


@pytest.mark.parametrize("bind", ["127.0.0.1:7443", "127.0.0.9:1", "[::1]:7443", "localhost:7443"])
def test_management_accepts_loopback(bind: str) -> None:
    loaded = load_settings("server", document=None, env={"CAPYCTL_MANAGEMENT_ADDR": bind})
    assert loaded.settings.server.listeners.management.bind == bind  # type: ignore[union-attr]


def test_management_refuses_other_addresses() -> None:
    with pytest.raises(InvalidConfig, match="not a loopback address"):
        load_settings("server", document=None, env={"CAPYCTL_MANAGEMENT_ADDR": "0.0.0.0:7443"})


@pytest.mark.parametrize("role", ROLES)
def test_the_template_parses_to_the_defaults(tmp_path: Path, role: str) -> None:
    doc = tmp_path / f"{role}.yaml"
    doc.write_text(template(role))  # type: ignore[arg-type]
    loaded = load_settings(role, document=doc, env={})  # type: ignore[arg-type]
    assert set(_sources(loaded).values()) == {"default"}
    uncommented = "\n".join(line.replace("# ", "", 1) for line in doc.read_text().splitlines()[2:])
    doc.write_text(uncommented)
    explicit = load_settings(role, document=doc, env={})  # type: ignore[arg-type]
    assert explicit.settings == loaded.settings
    assert set(_sources(explicit).values()) == {"yaml"}
    assert yaml.safe_load(uncommented)["kind"] == role


def test_document_location(tmp_path: Path) -> None:
    implicit = tmp_path / "standalone.yaml"
    assert locate_document(None, {}, implicit) is None
    implicit.write_text("kind: standalone\n")
    assert locate_document(None, {}, implicit) == implicit
    other = tmp_path / "other.yaml"
    other.write_text("")
    assert locate_document(None, {"CAPYCTL_CONFIG": str(other)}, implicit) == other
    with pytest.raises(InvalidConfig, match="CAPYCTL_CONFIG names"):
        locate_document(None, {"CAPYCTL_CONFIG": str(tmp_path / "gone.yaml")}, implicit)


def test_state_dir_resolution(tmp_path: Path) -> None:
    assert resolve_state_dir(str(tmp_path), {"CAPYCTL_STATE_DIR": "/x"}) == (tmp_path, "flag")
    assert resolve_state_dir(None, {"CAPYCTL_STATE_DIR": str(tmp_path)}) == (tmp_path, "env")
    assert resolve_state_dir(None, {"XDG_STATE_HOME": str(tmp_path)}) == (
        tmp_path / "capyctl",
        "default",
    )
    assert resolve_state_dir(None, {})[0] == Path.home() / ".local" / "state" / "capyctl"
