"""Settings: precedence, provenance and refusals, without any process."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from capycommon.enrollment import ingress_address
from capycommon.errors import InvalidConfig
from capycommon.hostsettings import HostSection, machine_host_name
from capycommon.paths import resolve_state_dir
from capycommon.settingnames import derived_flag, derived_variable
from capycommon.settings import (
    ROLES,
    HostSettings,
    Role,
    RouterSection,
    StandaloneSettings,
    auto_workers,
    host_name,
    own_host,
    redacted,
    setting_specs,
    template,
)
from capycommon.settingsources import LoadedSettings, load_settings, locate_document
from capycommon.settingvalues import split_address


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


def test_the_ingress_is_dialled_at_its_address_else_at_its_bind() -> None:
    def dialled(**env: str) -> str:
        settings = load_settings("host", document=None, env=env).settings
        assert isinstance(settings, HostSettings)
        return ingress_address(settings)

    assert dialled() == f"{socket.gethostname()}:8444", "every interface: this machine's name"
    assert dialled(CAPYCTL_HOST_INGRESS_BIND="[::]:9000") == f"{socket.gethostname()}:9000"
    assert dialled(CAPYCTL_HOST_INGRESS_BIND="100.64.0.21:8444") == "100.64.0.21:8444"
    assert dialled(CAPYCTL_HOST_INGRESS_BIND="[fd00::7]:8444") == "[fd00::7]:8444"
    both = {
        "CAPYCTL_HOST_INGRESS_BIND": "0.0.0.0:8444",
        "CAPYCTL_HOST_INGRESS_ADDRESS": "gpu.lan:1",
    }
    assert dialled(**both) == "gpu.lan:1"


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("CAPYCTL_HOST_INGRESS_BIND", "gpu-box:8444", "is not an IP address"),
        ("CAPYCTL_HOST_INGRESS_ADDRESS", "0.0.0.0:8444", "names every interface"),
        ("CAPYCTL_HOST_INGRESS_ADDRESS", "gpu-box.lan", "is not HOST:PORT"),
    ],
)
def test_ingress_addresses_are_checked(name: str, value: str, reason: str) -> None:
    with pytest.raises(InvalidConfig, match=reason):
        load_settings("host", document=None, env={name: value})


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


def _yaml_for(path: str, value: str) -> str:
    node: dict[str, object] = {}
    document: dict[str, object] = node
    *parents, leaf = path.split(".")
    for part in parents:
        child: dict[str, object] = {}
        node[part] = child
        node = child
    node[leaf] = value
    return yaml.safe_dump(document)


def _row(loaded: LoadedSettings, path: str) -> tuple[object, str, str | None]:
    row = next(row for row in loaded.rows if row.path == path)
    return row.value, row.source, row.origin


@pytest.mark.parametrize("role", ROLES)
def test_every_setting_is_documented_with_an_example(role: Role) -> None:
    defaults = {row.path: row.value for row in load_settings(role, document=None, env={}).rows}
    specs = setting_specs(role)
    assert set(specs) == set(defaults), "every leaf of the tree is a setting"
    for spec in specs.values():
        assert spec.description, f"{spec.path} has no description"
        assert spec.example, f"{spec.path} has no example"
        assert spec.variable == derived_variable(spec.path)
        assert spec.secret or spec.flag == derived_flag(spec.path)


@pytest.mark.parametrize("role", ROLES)
def test_every_setting_comes_from_yaml_a_flag_or_a_variable(tmp_path: Path, role: Role) -> None:
    defaults = {row.path: row.value for row in load_settings(role, document=None, env={}).rows}
    for spec in setting_specs(role).values():
        # A server takes host settings only with an embedded host.
        embedded = {"CAPYCTL_EMBEDDED_HOST": "on"} if role == "server" else {}
        env = embedded if spec.path.startswith("host.") and spec.path != "host.embedded" else {}
        # Replication takes this server's address and its peers' together.
        env |= REPLICATION_PAIRS.get(spec.path, {})
        doc = tmp_path / f"{spec.path}.yaml"
        doc.write_text(_yaml_for(spec.path, spec.example))
        from_yaml = _row(load_settings(role, document=doc, env=env), spec.path)
        assert from_yaml == (from_yaml[0], "yaml", str(doc))
        assert from_yaml[0] != defaults[spec.path], f"{spec.path}: the example is the default"
        for name in spec.variables:
            loaded = load_settings(role, document=doc, env={**env, name: spec.example})
            assert _row(loaded, spec.path) == (from_yaml[0], "env", name)
        for name in spec.flags:
            loaded = load_settings(role, document=doc, env=env, flags={name: spec.example})
            assert _row(loaded, spec.path) == (from_yaml[0], "flag", name)


REPLICATION_PAIRS = {
    "replication.advertise": {"CAPYCTL_REPLICATION_PEERS": "10.0.0.12"},
    "replication.peers": {"CAPYCTL_REPLICATION_ADVERTISE": "10.0.0.11"},
}


def test_names_are_derived_and_unique() -> None:
    specs = setting_specs("standalone")
    assert specs["server.scheduling.max_parked"].flags == ("--server-scheduling-max-parked",)
    assert specs["server.scheduling.max_parked"].variables == (
        "CAPYCTL_SERVER_SCHEDULING_MAX_PARKED",
    )
    assert specs["host.deep_park"].flags == ("--host-deep-park", "--deep-park")
    assert specs["host.deep_park"].variables == ("CAPYCTL_HOST_DEEP_PARK", "CAPYCTL_DEEP_PARK")
    assert specs["redis.url"].flags == (), "a secret has no flag"
    flags = [name for spec in specs.values() for name in spec.flags]
    variables = [name for spec in specs.values() for name in spec.variables]
    assert len(flags) == len(set(flags))
    assert len(variables) == len(set(variables))
    assert not {"--state-dir", "--config", "--json", "--debug", "--role"} & set(flags)
    assert not {"CAPYCTL_STATE_DIR", "CAPYCTL_CONFIG"} & set(variables)
    # The standalone role has every setting but the server's enrollment of remote hosts and
    # its replication, its switch for an embedded host, and a joined host's ingress.
    enrollment = {
        path for path in setting_specs("server") if path.startswith(("enrollment.", "replication."))
    }
    ingress = {path for path in setting_specs("host") if path.startswith("host.ingress.")}
    assert ingress == {"host.ingress.bind", "host.ingress.address"}
    assert set(setting_specs("server")) | set(setting_specs("host")) == (
        set(specs) | enrollment | ingress | {"host.embedded"}
    )
    assert setting_specs("server")["host.embedded"].flags == (
        "--host-embedded",
        "--embedded-host",
    )
    assert setting_specs("host")["host.ingress.bind"].flags == ("--host-ingress-bind",)
    assert setting_specs("host")["host.ingress.address"].variables == (
        "CAPYCTL_HOST_INGRESS_ADDRESS",
    )


def test_two_names_of_one_setting_must_agree() -> None:
    both = {"--server-listeners-inference-bind": "127.0.0.1:1", "--listen": "127.0.0.1:1"}
    same = load_settings("standalone", document=None, env={}, flags=both)
    assert same.settings.server.listeners.inference.bind == "127.0.0.1:1"  # type: ignore[union-attr]
    both["--listen"] = "127.0.0.1:2"
    with pytest.raises(InvalidConfig) as caught:
        load_settings("standalone", document=None, env={}, flags=both)
    assert caught.value.message == (
        "--server-listeners-inference-bind and --listen both set server.listeners.inference.bind, "
        "to '127.0.0.1:1' and '127.0.0.1:2'; give one of them"
    )
    env = {"CAPYCTL_DEEP_PARK": "on", "CAPYCTL_HOST_DEEP_PARK": "off"}
    with pytest.raises(InvalidConfig, match="CAPYCTL_HOST_DEEP_PARK and CAPYCTL_DEEP_PARK both"):
        load_settings("host", document=None, env=env)


def test_flags_that_are_not_the_roles_are_refused() -> None:
    with pytest.raises(InvalidConfig) as caught:
        load_settings("standalone", document=None, env={}, flags={"--lisen": "127.0.0.1:1"})
    assert caught.value.message == (
        "unknown flag --lisen for the standalone role; did you mean --listen? "
        "(--help lists every flag)"
    )
    with pytest.raises(
        InvalidConfig, match=r"^--host-ingress-bind does not apply to the server role"
    ):
        load_settings("server", document=None, env={}, flags={"--host-ingress-bind": "0:1"})
    with pytest.raises(InvalidConfig, match=r"^--embedded-host does not apply to the host role"):
        load_settings("host", document=None, env={}, flags={"--embedded-host": "on"})
    with pytest.raises(InvalidConfig) as caught:
        load_settings("host", document=None, env={}, flags={"--redis-url": "redis://h:1"})
    assert caught.value.message == (
        "redis.url never comes from a flag (it may hold a secret); set CAPYCTL_REDIS_URL or "
        "redis.url in the role document"
    )


@pytest.mark.parametrize(
    "name", ["CAPYCTL_DEEP_PARK", "CAPYCTL_HOST_DEEP_PARK", "CAPYCTL_ENGINE_PORTS"]
)
def test_some_variables_may_not_be_empty(name: str) -> None:
    with pytest.raises(InvalidConfig, match=rf"^{name} is set but empty; give it a value"):
        load_settings("standalone", document=None, env={name: ""})


def test_deep_park_is_on_or_off(tmp_path: Path) -> None:
    doc = tmp_path / "host.yaml"
    doc.write_text("host:\n  deep_park: off\n")
    loaded = load_settings("host", document=doc, env={})
    assert loaded.settings.host.deep_park == "off"
    loaded = load_settings("host", document=None, env={})
    assert loaded.settings.host.deep_park == "on"
    with pytest.raises(InvalidConfig, match=r"--deep-park sets host\.deep_park to 'disabled'"):
        load_settings("host", document=None, env={}, flags={"--deep-park": "disabled"})


def test_router_workers_are_a_count_or_auto(tmp_path: Path) -> None:
    def router(document: Path | None = None, **env: str) -> RouterSection:
        settings = load_settings("standalone", document=document, env=env).settings
        assert isinstance(settings, StandaloneSettings)
        return settings.server.router

    doc = tmp_path / "standalone.yaml"
    doc.write_text("server:\n  router:\n    workers: 3\n")
    assert router(doc).worker_count == 3
    assert router().workers == "auto"
    assert router().worker_count == auto_workers()
    assert router(CAPYCTL_SERVER_ROUTER_WORKERS="2").workers == 2
    for bad in ("0", "65", "two", "1.5"):
        with pytest.raises(
            InvalidConfig,
            match=rf"--server-router-workers sets server\.router\.workers to '{bad}': "
            rf"'{bad}' is no count of workers; give a whole number from 1 to 64, or auto",
        ):
            load_settings(
                "standalone", document=None, env={}, flags={"--server-router-workers": bad}
            )


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (96, 8)])
def test_auto_is_one_worker_per_four_cpus_from_one_to_eight(cpus: int, workers: int) -> None:
    assert auto_workers(cpus) == workers


@pytest.mark.parametrize(
    ("hostname", "name"),
    [
        ("vm", "vm"),
        ("GPU-Box.example.com", "gpu-box"),
        ("my_box", "my-box"),
        ("-odd--", "odd"),
        ("a" * 80, "a" * 63),
        ("___", "local"),
    ],
)
def test_the_default_host_name_is_the_hostname_made_to_fit(hostname: str, name: str) -> None:
    assert machine_host_name(hostname) == name
    HostSection(name=name)  # fits the pattern


def test_the_default_host_name_is_this_machines() -> None:
    loaded = load_settings("standalone", document=None, env={})
    assert loaded.settings.host.name == machine_host_name()


def test_secrets_are_shown_without_their_password() -> None:
    assert redacted("redis.url", "rediss://capy:s3cret@10.0.0.1:6380/0") == (
        "rediss://capy:***@10.0.0.1:6380/0"
    )
    assert redacted("redis.url", "unix:///run/redis.sock") == "unix:///run/redis.sock"
    assert redacted("host.name", "a:b@c") == "a:b@c"


def test_a_server_has_a_host_of_its_own_only_when_embedded() -> None:
    server = load_settings("server", document=None, env={"CAPYCTL_HOST_NAME": "main"})
    assert own_host(server.settings) is None
    assert host_name(server.settings) is None
    with pytest.raises(InvalidConfig) as caught:
        load_settings("server", document=None, env={}, flags={"--models-root": "/srv/m"})
    assert caught.value.message == (
        "--models-root sets host.models_root, which applies to a server only with an embedded "
        "host; add --embedded-host on (host.embedded: on), or drop it"
    )
    embedded = load_settings(
        "server", document=None, env={"CAPYCTL_EMBEDDED_HOST": "on"}, flags={"--host-name": "main"}
    )
    assert host_name(embedded.settings) == "main"
    standalone = load_settings("standalone", document=None, env={}, flags={"--host-name": "s"})
    assert host_name(standalone.settings) == "s"
