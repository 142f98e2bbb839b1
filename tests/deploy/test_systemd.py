"""The systemd units in systemd/system and systemd/user.

Each unit is checked by `systemd-analyze verify`, which needs no running systemd. It exits
0 on some problems it only warns about (an unknown key, a bad value), so any output at all
fails the test.

`verify` also checks that every Exec*= binary exists. The system units name
/usr/local/bin/capyctl: they are verified as copies in which that path is the venv's
capyctl. The user units name %h/.local/bin/capyctl: they are verified as they are, with
HOME pointing at a folder whose .local/bin/capyctl is the venv's capyctl. `--user verify`
works without a user manager once XDG_RUNTIME_DIR names a private folder.

A template (`capyctl-host@.service`) is verified as an instance, `capyctl-host@gpu-a.service`:
verify loads the template beside the instance's path, with %i expanded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capycommon.settings import ROLES
from capyctl_cli.roles import PROCESSES

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"
FOLDERS = ("system", "user")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
VENV_CAPYCTL = Path(sys.executable).parent / "capyctl"

SYSTEM_BINARY = "/usr/local/bin/capyctl"
USER_BINARY = "%h/.local/bin/capyctl"
BINARIES = {"system": SYSTEM_BINARY, "user": USER_BINARY}

# Every process any role runs; each has a unit of its own (the standalone role's).
PROCESS_NAMES = tuple(sorted({name for names in PROCESSES.values() for name in names}))
ROLE_UNITS: dict[str, str] = {role: f"capyctl-{role}.service" for role in ROLES}
PROCESS_UNITS = {name: f"capyctl-{name}.service" for name in PROCESS_NAMES}
TARGET = "capyctl.target"
REDIS_UNIT = PROCESS_UNITS["redis"]
# One host role per joined host on a machine, each instance with its own state dir.
HOST_TEMPLATE = "capyctl-host@.service"
INSTANCE = "gpu-a"
# The release notes' spelling of the role units, the role its instance: capyctl@host.service.
ROLE_TEMPLATE = "capyctl@.service"
# The units whose hostd starts engines, which keep running when the unit stops.
ENGINE_UNITS = {
    ROLE_UNITS["standalone"],
    ROLE_UNITS["server"],  # its embedded host's, when it has one
    ROLE_UNITS["host"],
    HOST_TEMPLATE,
    ROLE_TEMPLATE,
    PROCESS_UNITS["hostd"],
}

# A configuration or credentials error: restarting cannot fix it. The host adds 14 (revoked).
NO_RESTART = {"2", "3", "5"}

needs_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed on this machine"
)

Unit = dict[str, dict[str, list[str]]]


def parse_unit(path: Path) -> Unit:
    """Sections -> key -> every value the key is given, in order."""
    sections: Unit = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path}:{number}: keep each setting on one line"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert current is not None, f"{path}:{number}: {raw!r} is outside a [section]"
        assert sep, f"{path}:{number}: {raw!r} is not KEY=VALUE"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit_files(folder: str) -> list[Path]:
    return sorted(p for p in (SYSTEMD / folder).iterdir() if p.suffix in (".service", ".target"))


def service_names(folder: str) -> list[str]:
    return [p.name for p in unit_files(folder) if p.suffix == ".service"]


def words(unit: Unit, section: str, key: str) -> list[str]:
    """Every space-separated word of every value of `key` (Requires=, After=, ...)."""
    return [word for value in unit.get(section, {}).get(key, []) for word in value.split()]


def one(unit: Unit, section: str, key: str) -> str:
    values = unit.get(section, {}).get(key, [])
    assert len(values) == 1, f"[{section}] {key}= is given {len(values)} times, not once"
    return values[0]


def environment(unit: Unit) -> dict[str, str]:
    pairs = (value.partition("=") for value in unit["Service"].get("Environment", []))
    return {name: value for name, _, value in pairs}


def role_of(unit_name: str) -> str:
    """The role a unit runs; a unit per process runs the standalone role's process."""
    if unit_name == HOST_TEMPLATE:
        return "host"
    name = unit_name.removeprefix("capyctl-").removesuffix(".service")
    return name if name in ROLES else "standalone"


def state_name(unit_name: str) -> str:
    """What names a unit's state dir and environment file: its role, for the host template
    `host-%i`, one per instance, and for the role template its instance, the role."""
    if unit_name == ROLE_TEMPLATE:
        return "%i"
    return "host-%i" if unit_name == HOST_TEMPLATE else role_of(unit_name)


def as_instances(units: list[Path]) -> list[Path]:
    """The units to verify: a template as an instance (the role template as its host role,
    any other as INSTANCE), a path beside it."""
    instances = {ROLE_TEMPLATE: "host"}
    return [
        unit.with_name(unit.name.replace("@.", f"@{instances.get(unit.name, INSTANCE)}."))
        if "@." in unit.name
        else unit
        for unit in units
    ]


def clean_environment() -> dict[str, str]:
    """The caller's environment without the variables that change what systemd reads."""
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("SYSTEMD_", "XDG_")) and name != "HOME"
    }


def run_verify(units: list[Path], env: dict[str, str], *, user: bool) -> None:
    assert SYSTEMD_ANALYZE is not None
    assert units, "no units to verify"
    argv = [SYSTEMD_ANALYZE, *(["--user"] if user else []), "verify", *map(str, units)]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0 or output:
        pytest.fail(f"systemd-analyze verify exited {result.returncode}:\n{output}")


@pytest.fixture
def venv_capyctl() -> Path:
    if not os.access(VENV_CAPYCTL, os.X_OK):
        pytest.fail(f"{VENV_CAPYCTL} is not an executable; run scripts/setup")
    return VENV_CAPYCTL


@needs_analyze
def test_system_units_verify(tmp_path: Path, venv_capyctl: Path) -> None:
    # Copies of the whole folder: verify loads the units a unit names from beside it.
    copies = []
    for source in unit_files("system"):
        text = source.read_text(encoding="utf-8")
        if source.suffix == ".service":
            assert SYSTEM_BINARY in text
        copy = tmp_path / source.name
        copy.write_text(text.replace(SYSTEM_BINARY, str(venv_capyctl)), encoding="utf-8")
        copies.append(copy)
    run_verify(as_instances(copies), clean_environment(), user=False)


@needs_analyze
def test_user_units_verify(tmp_path: Path, venv_capyctl: Path) -> None:
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "bin" / "capyctl").symlink_to(venv_capyctl)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = clean_environment() | {"HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)}
    run_verify(as_instances(unit_files("user")), env, user=True)


@needs_analyze
def test_verify_checks_a_template_through_its_instance(tmp_path: Path) -> None:
    """The instance's path need not exist: verify reads the template beside it."""
    unit = tmp_path / "capyctl-probe@.service"
    unit.write_text("[Service]\nExecStart=/bin/true %i\nNoSuchKey=1\n", encoding="utf-8")
    (instance,) = as_instances([unit])
    assert instance.name == f"capyctl-probe@{INSTANCE}.service"
    assert not instance.exists()
    with pytest.raises(pytest.fail.Exception, match="NoSuchKey"):
        run_verify([instance], clean_environment(), user=False)


@needs_analyze
def test_verify_check_catches_a_warning(tmp_path: Path) -> None:
    """verify exits 0 on an unknown key; the check above still fails on it."""
    unit = tmp_path / "capyctl-probe.service"
    unit.write_text("[Service]\nExecStart=/bin/true\nNoSuchKey=1\n", encoding="utf-8")
    with pytest.raises(pytest.fail.Exception, match="NoSuchKey"):
        run_verify([unit], clean_environment(), user=False)


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_role_and_process_has_a_unit(folder: str) -> None:
    expected = {
        *ROLE_UNITS.values(),
        *PROCESS_UNITS.values(),
        TARGET,
        HOST_TEMPLATE,
        ROLE_TEMPLATE,
    }
    assert {p.name for p in unit_files(folder)} == expected


def runs_a_role(folder: str, name: str, role: str, *, revocable: bool) -> Unit:
    """The unit `name` runs `capyctl start <role>`, restarts on failure but not on an error
    a restart cannot fix (nor, `revocable`, after a revocation: 14), stops only capyctl (its
    engines run on) and starts with the machine or the user; the unit, for more checks."""
    unit = parse_unit(SYSTEMD / folder / name)
    assert one(unit, "Service", "ExecStart") == f"{BINARIES[folder]} start {role}"
    assert one(unit, "Service", "Restart") == "on-failure"
    prevented = set(words(unit, "Service", "RestartPreventExitStatus"))
    assert prevented >= NO_RESTART | ({"14"} if revocable else set())
    assert one(unit, "Service", "KillMode") == "process"
    assert one(unit, "Service", "TimeoutStopSec") == "35"
    wanted_by = "multi-user.target" if folder == "system" else "default.target"
    assert words(unit, "Install", "WantedBy") == [wanted_by]
    return unit


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("role", ROLES)
def test_role_unit(folder: str, role: str) -> None:
    runs_a_role(folder, ROLE_UNITS[role], role, revocable=role == "host")


@pytest.mark.parametrize("folder", FOLDERS)
def test_host_template_runs_a_host_per_instance(folder: str) -> None:
    # 14: a revoked host stays stopped until it joins again; its engines run on.
    unit = runs_a_role(folder, HOST_TEMPLATE, "host", revocable=True)
    # The instance is the host's name; the environment file may still name another.
    assert environment(unit)["CAPYCTL_HOST_NAME"] == "%i"
    assert one(unit, "Service", "NoNewPrivileges") == "yes"
    # Each instance has its own state dir, so instances and role units run side by side.
    assert "Conflicts" not in unit.get("Unit", {})


@pytest.mark.parametrize("folder", FOLDERS)
def test_role_template_runs_the_role_its_instance_names(folder: str) -> None:
    unit = runs_a_role(folder, ROLE_TEMPLATE, "%i", revocable=True)
    # Never beside the project's own spelling of the same role, which has its state dir.
    conflicts = set(words(unit, "Unit", "Conflicts"))
    if folder == "system":
        assert "capyctl-%i.service" in conflicts
    else:
        assert conflicts >= set(ROLE_UNITS.values())


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("name", PROCESS_NAMES)
def test_process_unit(folder: str, name: str) -> None:
    unit = parse_unit(SYSTEMD / folder / PROCESS_UNITS[name])
    binary = BINARIES[folder]
    assert one(unit, "Service", "ExecStart") == f"{binary} run {name} --role standalone"
    assert words(unit, "Unit", "PartOf") == [TARGET]
    assert words(unit, "Install", "WantedBy") == [TARGET]
    assert set(words(unit, "Service", "RestartPreventExitStatus")) >= NO_RESTART
    assert one(unit, "Service", "TimeoutStopSec") == "35"
    if name == "redis":
        # The state dir is prepared once, before the units ordered after redis start.
        assert one(unit, "Service", "ExecStartPre") == f"{binary} init standalone"
    else:
        assert REDIS_UNIT in words(unit, "Unit", "Requires")
        assert REDIS_UNIT in words(unit, "Unit", "After")
    if name == "hostd":
        assert one(unit, "Service", "KillMode") == "process"
    else:
        assert "KillMode" not in unit["Service"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_target_wants_every_process(folder: str) -> None:
    unit = parse_unit(SYSTEMD / folder / TARGET)
    assert sorted(words(unit, "Unit", "Wants")) == sorted(PROCESS_UNITS.values())
    # The role units would run the same processes and listeners a second time.
    assert set(words(unit, "Unit", "Conflicts")) == set(ROLE_UNITS.values())


@pytest.mark.parametrize("name", service_names("system"))
def test_system_unit_state_and_hardening(name: str) -> None:
    unit = parse_unit(SYSTEMD / "system" / name)
    service = unit["Service"]
    state = state_name(name)
    state_dir = f"/var/lib/capyctl/{state}"
    assert one(unit, "Service", "User") == "capyctl"
    assert one(unit, "Service", "StateDirectory") == f"capyctl/{state}"
    assert one(unit, "Service", "StateDirectoryMode") == "0700"
    assert environment(unit)["CAPYCTL_STATE_DIR"] == state_dir
    assert one(unit, "Service", "EnvironmentFile") == f"-/etc/capyctl/{state}.env"
    assert one(unit, "Service", "NoNewPrivileges") == "yes"
    assert one(unit, "Service", "ProtectSystem") == "strict"
    assert state_dir in words(unit, "Service", "ReadWritePaths")
    # read-only, not yes: hostd and the engines read the models in the user's ~/models.
    assert one(unit, "Service", "ProtectHome") == "read-only"
    assert "PrivateDevices" not in service, "hostd, memwatch and the engines use the GPUs"
    # systemd empties a private /tmp when the unit stops, under engines that keep running.
    assert ("PrivateTmp" in service) is (name not in ENGINE_UNITS)
    if name in ENGINE_UNITS:
        # The engines' caches: the home is read-only, the state dir is CapyCTL's.
        assert one(unit, "Service", "CacheDirectory") == f"capyctl/{state}"
        assert environment(unit)["XDG_CACHE_HOME"] == f"/var/cache/capyctl/{state}"


@pytest.mark.parametrize("name", service_names("user"))
def test_user_unit_state(name: str) -> None:
    unit = parse_unit(SYSTEMD / "user" / name)
    service = unit["Service"]
    assert "User" not in service
    # The role units share the one default state dir; each host instance has its own.
    state_dir = "capyctl-host-%i" if name == HOST_TEMPLATE else "capyctl"
    assert one(unit, "Service", "StateDirectory") == state_dir
    assert environment(unit)["CAPYCTL_STATE_DIR"] == f"%S/{state_dir}"
    assert one(unit, "Service", "EnvironmentFile") == f"-%E/capyctl/{state_name(name)}.env"
    for key in ("ExecStartPre", "ExecStart"):
        assert all(value.startswith(f"{USER_BINARY} ") for value in service.get(key, []))
