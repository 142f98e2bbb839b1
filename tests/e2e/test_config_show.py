"""`capyctl config show`: every setting, its value and where it came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    data = _show("--state-dir", str(tmp_path), "--config", str(document),
                 "--listen", "127.0.0.1:9000", "--log-level", "warning", env=env)  # fmt: skip
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
    assert "host.name" not in rows, "the server role has no host settings"


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
