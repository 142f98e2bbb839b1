"""`capyctl config show`: every setting, its value and where it came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from capycommon.settings import ROLES, Role, setting_specs
from support import capyctl, clean_env


def _show(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = capyctl("config", "show", "--json", *args, env=env)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _by_path(data: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    return {row["path"]: (row["value"], row["source"]) for row in data["settings"]}


def test_each_source_is_reported(tmp_path: Path) -> None:
    document = tmp_path / "standalone.yaml"
    document.write_text("kind: standalone\nhost:\n  name: gpu-box\n  engine_ports: 8100-8150\n")
    env = clean_env(CAPYCTL_ENGINE_PORTS="8200-8299", CAPYCTL_LOG_LEVEL="debug")
    data = _show(
        "--state-dir",
        str(tmp_path),
        "--config",
        str(document),
        "--listen",
        "127.0.0.1:9000",
        "--log-level",
        "warning",
        env=env,
    )
    assert data["role"] == "standalone"
    assert data["document"] == str(document)
    rows = _by_path(data)
    assert rows["state_dir"] == (str(tmp_path), "flag")
    assert rows["server.listeners.inference.bind"] == ("127.0.0.1:9000", "flag")
    assert rows["server.listeners.management.bind"] == ("127.0.0.1:7443", "default")
    assert rows["host.name"] == ("gpu-box", "yaml")
    assert rows["host.engine_ports"] == ("8200-8299", "env"), "env beats yaml"
    assert rows["log.level"] == ("warning", "flag"), "a flag beats env"
    assert rows["log.format"] == ("auto", "default")


def test_defaults_with_no_document(tmp_path: Path) -> None:
    env = clean_env(XDG_STATE_HOME=str(tmp_path))
    data = _show(env=env)
    assert data["document"] is None
    rows = _by_path(data)
    assert rows["state_dir"] == (str(tmp_path / "capyctl"), "default")
    assert rows["server.listeners.inference.bind"] == ("0.0.0.0:8443", "default")
    assert {source for _, source in list(rows.values())[1:]} == {"default"}
    assert not (tmp_path / "capyctl").exists(), "config show writes nothing"


def test_env_state_dir_and_document(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "server.yaml").write_text("kind: server\nlog:\n  format: json\n")
    env = clean_env(CAPYCTL_STATE_DIR=str(tmp_path))
    data = _show("--role", "server", env=env)
    rows = _by_path(data)
    assert rows["state_dir"] == (str(tmp_path), "env")
    assert rows["log.format"] == ("json", "yaml")
    assert rows["host.embedded"] == ("off", "default"), "a server has no host unless embedded"


def test_text_form_is_a_table(tmp_path: Path) -> None:
    result = capyctl("config", "show", "--state-dir", str(tmp_path), "--role", "host")
    assert result.returncode == 0
    header, *rows = result.stdout.splitlines()[1:]
    assert header.split() == ["SETTING", "VALUE", "SOURCE"]
    assert any(row.split()[:3] == ["host.engine_ports", "8100-8199", "default"] for row in rows)


def test_unknown_and_duplicate_keys_are_refused(tmp_path: Path) -> None:
    document = tmp_path / "doc.yaml"
    document.write_text(
        "kind: standalone\nserver:\n  listeners:\n    inferense: {bind: 1.2.3.4:5}\n"
    )
    result = capyctl("config", "show", "--config", str(document))
    assert result.returncode == 2
    assert result.stderr == (
        f"error [invalid_config]: {document}: unknown key 'server.listeners.inferense'; "
        "remove it or correct its spelling\n"
    )
    document.write_text("kind: standalone\nlog:\n  level: info\n  level: debug\n")
    result = capyctl("config", "show", "--config", str(document))
    assert result.returncode == 2
    assert f"{document}: duplicate key 'level' at line 4" in result.stderr


def test_malformed_values_name_who_stated_them(tmp_path: Path) -> None:
    document = tmp_path / "doc.yaml"
    document.write_text("kind: standalone\nhost:\n  engine_ports: 90-80\n")
    result = capyctl("config", "show", "--config", str(document))
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"error [invalid_config]: {document}: host.engine_ports = '90-80': '90-80' must satisfy"
    )

    result = capyctl("config", "show", env=clean_env(CAPYCTL_LOG_LEVEL="loud"))
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error [invalid_config]: CAPYCTL_LOG_LEVEL sets log.level to 'loud'"
    )

    result = capyctl("config", "show", "--listen", "localhost")
    assert result.returncode == 2
    assert "--listen sets server.listeners.inference.bind to 'localhost'" in result.stderr

    result = capyctl("config", "show", "--role", "host", "--listen", "127.0.0.1:1")
    assert result.returncode == 2
    assert "--listen does not apply to the host role" in result.stderr


def test_a_document_of_another_role_is_refused(tmp_path: Path) -> None:
    document = tmp_path / "doc.yaml"
    document.write_text("kind: host\n")
    result = capyctl("config", "show", "--config", str(document))
    assert result.returncode == 2
    assert "is a 'host' document; the standalone role needs kind: standalone" in result.stderr


def _nested(values: dict[str, str]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for path, value in values.items():
        node = document
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return document


@pytest.mark.parametrize("role", ROLES)
def test_every_setting_comes_from_yaml_a_flag_or_a_variable(tmp_path: Path, role: Role) -> None:
    """Walks the role's tree, so a new setting is covered as soon as it exists."""
    specs = setting_specs(role)
    base = ("--role", role, "--state-dir", str(tmp_path))
    defaults = _by_path(_show(*base))
    document = tmp_path / f"{role}.yaml"
    examples = {path: spec.example for path, spec in specs.items()}
    document.write_text(yaml.safe_dump({"kind": role, **_nested(examples)}))
    from_yaml = _by_path(_show(*base, "--config", str(document)))
    flags = [part for spec in specs.values() if spec.flag for part in (spec.flag, spec.example)]
    from_flags = _by_path(_show(*base, *flags))
    env = clean_env(**{spec.variable: spec.example for spec in specs.values()})
    from_env = _by_path(_show(*base, env=env))
    for path, spec in specs.items():
        value = from_yaml[path][0]
        assert from_yaml[path] == (value, "yaml"), path
        assert value != defaults[path][0], f"{path}: its example is its default"
        assert from_env[path] == (value, "env"), path
        if spec.secret:
            assert spec.flag is None
            assert from_flags[path] == defaults[path]
        else:
            assert from_flags[path] == (value, "flag"), path


def test_short_names_and_their_agreement(tmp_path: Path) -> None:
    base = ("--state-dir", str(tmp_path))
    env = clean_env(CAPYCTL_DEEP_PARK="off", CAPYCTL_MODELS_ROOT="/srv/m")
    data = _show(*base, "--listen", "127.0.0.1:9001", "--engine-ports=8300-8399", env=env)
    origins = {row["path"]: (row["value"], row["origin"]) for row in data["settings"]}
    assert origins["server.listeners.inference.bind"] == ("127.0.0.1:9001", "--listen")
    assert origins["host.engine_ports"] == ("8300-8399", "--engine-ports")
    assert origins["host.deep_park"] == ("off", "CAPYCTL_DEEP_PARK")
    assert origins["host.models_root"] == ("/srv/m", "CAPYCTL_MODELS_ROOT")

    result = capyctl("config", "show", *base, "--deep-park", "off", "--host-deep-park", "on")
    assert result.returncode == 2
    assert result.stderr == (
        "error [invalid_config]: --host-deep-park and --deep-park both set host.deep_park, to "
        "'on' and 'off'; give one of them\n"
    )
    result = capyctl("config", "show", *base, env=clean_env(CAPYCTL_DEEP_PARK=""))
    assert result.returncode == 2
    assert result.stderr.startswith("error [invalid_config]: CAPYCTL_DEEP_PARK is set but empty")


def test_unknown_and_secret_flags_are_refused_by_name(tmp_path: Path) -> None:
    result = capyctl("config", "show", "--state-dir", str(tmp_path), "--max-parked", "3")
    assert result.returncode == 2
    assert result.stderr == (
        "error [invalid_config]: unknown flag --max-parked for the standalone role; did you "
        "mean --server-scheduling-max-parked? (--help lists every flag)\n"
    )
    result = capyctl("config", "show", "--redis-url=redis://u:p@h:1")
    assert result.returncode == 2
    assert "redis.url never comes from a flag" in result.stderr
    assert "u:p" not in result.stderr
    result = capyctl("start", "server", "--state-dir", str(tmp_path), "--deep-park", "off")
    assert result.returncode == 2
    assert result.stderr == (
        "error [invalid_config]: --deep-park sets host.deep_park, which applies to a server "
        "only with an embedded host; add --embedded-host on (host.embedded: on), or drop it\n"
    )


def test_a_password_in_a_url_is_not_shown(tmp_path: Path) -> None:
    env = clean_env(CAPYCTL_REDIS_URL="rediss://capy:s3cret@10.0.0.1:6380/0")
    data = _show("--role", "host", "--state-dir", str(tmp_path), env=env)
    assert _by_path(data)["redis.url"] == ("rediss://capy:***@10.0.0.1:6380/0", "env")


@pytest.mark.parametrize("role", ROLES)
def test_help_lists_every_flag(role: Role) -> None:
    result = capyctl("start", role, "--help", env=clean_env(COLUMNS="80"))
    assert result.returncode == 0
    for spec in setting_specs(role).values():
        for flag in spec.flags:
            assert f"  {flag} " in result.stdout, flag
    shown = capyctl("config", "show", "--help").stdout
    assert all(
        f"  {flag} " in shown for spec in setting_specs(role).values() for flag in spec.flags
    )
