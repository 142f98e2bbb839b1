"""A release as a user gets it: scripts/release builds two releases of the tree whose versions
differ, a loopback HTTP server serves them, and the install.sh published with them installs
them into a temporary prefix (release.builds). The installed capyctl runs the demo; a
corrupted file is refused by name; an upgrade and a rollback on one state dir keep the running
engine (the same process serves). The signature's tests: test_release_signature.py."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import zipfile
from pathlib import Path
from typing import cast

import openai
import pytest
import redis

from capycommon.domain.instances import InstanceRecord
from capycommon.state import keys
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from ports import engine_ports, free_port
from release.builds import ARCH, MAJOR, MINOR, NEW, OLD, ROOT, Releases, build, install
from support import (
    Role,
    clean_env,
    ctrl_c_heard,
    group_members,
    processes_mentioning,
    short_dir,
    wait_for,
)

GiB = 1 << 30
HELLO: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]

# Two release builds (the session's), then installs and roles: past the suite's default of
# 180 s a test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def run(prefix: Path, *args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(prefix / "bin" / "capyctl"), *args],
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_release_holds_the_wheels_an_executable_and_their_sums(releases: Releases) -> None:
    folder = releases.folder / f"v{OLD}"
    names = sorted(path.name for path in folder.iterdir())
    assert f"capyctl-{OLD}-linux-{ARCH}.pex" in names
    assert f"capyctl-{OLD}-linux-{ARCH}" in names
    assert f"capycommon-{OLD}-py3-none-any.whl" in names
    assert "install.sh" in names
    assert len([name for name in names if name.endswith(".whl")]) == 7
    listed = sorted(line.split()[1] for line in (folder / "SHA256SUMS").read_text().splitlines())
    assert listed == [name for name in names if not name.startswith("SHA256SUMS")]
    assert "SHA256SUMS.sig" in names


def test_the_same_tree_builds_the_same_files(releases: Releases, tmp_path: Path) -> None:
    """Byte for byte, but for the self-contained executable: PyInstaller's is not yet."""
    build(OLD, tmp_path / "again", releases.key)

    def sums(folder: Path) -> dict[str, str]:
        lines = (folder / "SHA256SUMS").read_text().splitlines()
        return {name: digest for digest, name in (line.split() for line in lines)}

    first = sums(releases.folder / f"v{OLD}")
    assert first.pop(f"capyctl-{OLD}-linux-{ARCH}")
    assert sums(tmp_path / "again") == first


def test_the_self_contained_executable_needs_no_python(releases: Releases) -> None:
    executable = releases.folder / f"v{OLD}" / f"capyctl-{OLD}-linux-{ARCH}"
    assert executable.read_bytes()[:4] == b"\x7fELF"
    found = subprocess.run(
        [str(executable), "--version"],
        env={"PATH": "/nonexistent"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (found.returncode, found.stdout) == (0, f"capyctl {OLD}\n"), found.stderr
    # The forms CapyCTL starts its own processes with, answered as Python would.
    code = "import sys, capycommon.version as v; print(v.__version__, sys.argv[1:])"
    ran = subprocess.run(
        [str(executable), "-I", "-c", code, "x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.stdout == f"{OLD} ['x']\n", ran.stderr
    module = subprocess.run(
        [str(executable), "-m", "supervisor.supervisord", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert module.returncode == 0, module.stderr
    assert module.stdout.strip()[:1].isdigit(), module.stdout


# ELF's e_machine of each platform the release builds for.
MACHINES = {"x86_64": 62, "aarch64": 183}


def distributions(executable: Path) -> dict[str, str]:
    """The wheels a pex holds, by project and version: their platform tags."""
    with zipfile.ZipFile(executable) as pex:
        wheels = {name.split("/")[1] for name in pex.namelist() if name.startswith(".deps/")}
    held: dict[str, str] = {}
    for wheel in wheels - {""}:
        project, version, *_, platform_tag = wheel.removesuffix(".whl").split("-")
        held[f"{project}=={version}"] = platform_tag
    return held


def test_the_other_platform_holds_the_same_wheels_built_for_it(
    releases: Releases, tmp_path: Path
) -> None:
    """The executable for the machine the suite does not run on (no such machine here to run
    it): the same projects at the same versions as this machine's, each native one built for
    its processor, and every native library in it an ELF file for that processor."""
    other = next(arch for arch in MACHINES if arch != ARCH)
    build(OLD, tmp_path / "other", releases.key, platforms=other)
    executable = tmp_path / "other" / f"capyctl-{OLD}-linux-{other}.pex"
    mine = distributions(releases.folder / f"v{OLD}" / f"capyctl-{OLD}-linux-{ARCH}.pex")
    theirs = distributions(executable)
    assert sorted(theirs) == sorted(mine)
    native = {name: tag for name, tag in theirs.items() if tag != "any"}
    assert {name.split("==")[0] for name in native} >= {"pydantic_core", "cryptography", "pyyaml"}
    for name, tag in native.items():
        assert all(part.endswith(f"_{other}") for part in tag.split(".")), (name, tag)
    with zipfile.ZipFile(executable) as pex:
        libraries = [name for name in pex.namelist() if re.search(r"\.so(\.|$)", name)]
        assert libraries
        for name in libraries:
            header = pex.read(name)[:20]
            assert header[:4] == b"\x7fELF", name
            assert int.from_bytes(header[18:20], "little") == MACHINES[other], name


def test_install_runs_the_demo_and_is_harmless_twice(releases: Releases) -> None:
    root = short_dir("capy-inst")
    prefix, state = root / "prefix", root / "demo"
    inference = free_port()
    demo: subprocess.Popen[bytes] | None = None
    try:
        first = install(releases, "--releases", releases.url, "--version", f"v{OLD}", prefix=prefix)
        assert first.returncode == 0, first.stdout + first.stderr
        assert run(prefix, "--version") == f"capyctl {OLD}\n"
        again = install(releases, "--releases", releases.url, "--version", f"v{OLD}", prefix=prefix)
        assert again.returncode == 0, again.stderr
        assert f"capyctl {OLD} is already installed" in again.stdout
        binary = (prefix / "bin" / "capyctl").resolve()
        assert binary.name == f"capyctl-{OLD}-linux-{ARCH}", "the self-contained executable"
        latest = install(releases, "--releases", releases.url, prefix=prefix)
        assert latest.returncode == 0, latest.stderr
        assert run(prefix, "--version") == f"capyctl {NEW}\n"
        assert "/venv/" in str((prefix / "bin" / "capyctl").resolve()), "NEW has the pex alone"
        back = install(releases, "--releases", releases.url, "--version", OLD, prefix=prefix)
        assert back.returncode == 0, back.stderr
        assert "already installed" in back.stdout
        assert (prefix / "bin" / "capyctl").resolve() == binary, "the demo runs on it"
        # What the release carries to run it under systemd and to operate it, with no clone.
        config = root / "config"
        run(
            prefix, "install", "units", "host", "--user", env=clean_env(XDG_CONFIG_HOME=str(config))
        )
        template = (config / "systemd" / "user" / "capyctl@.service").read_text()
        assert f"ExecStart={prefix}/bin/capyctl start %i\n" in template, "the link, not its target"
        assert run(prefix, "docs", "operations") == (ROOT / "docs" / "operations.md").read_text()

        log = root / "demo.out"
        env = clean_env(HOME=str(root), CAPYCTL_ENGINE_PORTS=engine_ports(9))
        argv = [str(prefix / "bin" / "capyctl"), "demo", "--state-dir", str(state)]
        argv += ["--listen", f"127.0.0.1:{inference}"]
        argv += ["--management-listen", f"127.0.0.1:{free_port()}"]
        with log.open("wb") as out, ctrl_c_heard():
            demo = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_for(lambda: "Ctrl-C stops" in log.read_text(), 120, "the demo's instructions")
        key = (state / "identity" / "credentials").read_text().split("api_key:")[1].split()[0]
        with openai.OpenAI(
            base_url=f"http://127.0.0.1:{inference}/v1", api_key=key, max_retries=0, timeout=120
        ) as client:
            answer = client.chat.completions.create(model="qwen3-8b", messages=HELLO)
        assert answer.choices[0].message.content
        demo.send_signal(signal.SIGINT)
        try:
            code = demo.wait(timeout=120)  # the engines' drain (30 s), then the role's stop
        except subprocess.TimeoutExpired:
            pytest.fail(f"the demo did not stop within 120 s:\n{log.read_text()[-4000:]}")
        assert code == 0, log.read_text()[-4000:]
    finally:
        if demo is not None and demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in processes_mentioning(str(state)):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def test_a_corrupted_file_is_refused_by_name(releases: Releases, tmp_path: Path) -> None:
    release = tmp_path / "release"
    shutil.copytree(releases.folder / f"v{OLD}", release)
    executable = release / f"capyctl-{OLD}-linux-{ARCH}"
    data = bytearray(executable.read_bytes())
    data[len(data) // 2] ^= 0xFF
    executable.write_bytes(bytes(data))
    refused = install(releases, "--from", str(release), prefix=tmp_path / "prefix")
    assert refused.returncode == 1
    assert f"capyctl-{OLD}-linux-{ARCH} does not match SHA256SUMS" in refused.stderr
    assert not (tmp_path / "prefix" / "bin" / "capyctl").exists()
    assert not (tmp_path / "prefix" / "lib" / "capyctl" / OLD).exists()


# What install.sh runs, from the system's own folders; redis-server left out on purpose.
TOOLS = [
    "sh",
    "awk",
    "cat",
    "chmod",
    "cp",
    "cut",
    "id",
    "ln",
    "mkdir",
    "mktemp",
    "mv",
    "rm",
    "sed",
    "sha256sum",
    "ssh-keygen",
    "uname",
]
NOBODY = 65534


def link_tools(folder: Path) -> None:
    """A folder of the TOOLS and the system's python3, from the system's own folders: the
    installer's whole PATH."""
    folder.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool, path="/usr/bin:/bin")
        assert found is not None, tool
        (folder / tool).symlink_to(found)
    (folder / "python3").symlink_to("/usr/bin/python3")


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not Path("/usr/bin/python3").exists(),
    reason="needs root (to run the installer as nobody), setpriv and the system's python3",
)
def test_a_user_without_redis_is_told_the_command(releases: Releases) -> None:
    """A user who is not root, on a machine without redis-server, gets capyctl and the exact
    command that installs redis-server; nothing is installed for them system-wide."""
    root = short_dir("capy-user")
    try:
        release, tools, home = root / "release", root / "bin", root / "home"
        shutil.copytree(releases.folder / f"v{OLD}", release)
        link_tools(tools)
        home.mkdir()
        for path in (root, *root.rglob("*")):
            if not path.is_symlink():
                os.chown(path, NOBODY, NOBODY)
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        argv += ["env", "-i", f"HOME={home}", f"PATH={tools}", "sh", str(release / "install.sh")]
        argv += ["--from", str(release)]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        assert (
            "CapyCTL needs redis-server; install it with: sudo apt-get install -y redis-server"
            in result.stdout
        )
        assert f"{home}/.local/bin is not on your PATH" in result.stdout
        installed = home / ".local" / "bin" / "capyctl"
        version = subprocess.run(
            [str(installed), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
        assert version.stdout == f"capyctl {OLD}\n", version.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


# Debian's package manager as the installer meets it, writing down what it was asked; an
# install of redis-server puts one on the PATH, as the real one does.
FAKE_APT_GET = """#!/bin/sh
printf '%s %s\\n' "$DEBIAN_FRONTEND" "$*" >>{log}
case " $* " in
*" install "*" redis-server "*)
    printf '#!/bin/sh\\necho redis-server 7\\n' >{tools}/redis-server
    /bin/chmod 0755 {tools}/redis-server ;;
esac
"""


def _own_mounts() -> bool:
    """Whether this process may make a mount namespace of its own (root in most containers)."""
    probe = ["unshare", "--mount", "true"]
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(probe, stderr=subprocess.DEVNULL, check=False).returncode == 0


# Runs install.sh with nothing of the caller's environment, in a mount namespace of its own
# whose /usr/local is the folder given ($1), then the capyctl it put on /usr/local/bin: as
# root with no --prefix, the installer installs system-wide.
AS_ROOT = """mount --bind "$1" /usr/local
env -i HOME="$2" PATH="$3" sh "$4" --from "$5" || exit
/usr/local/bin/capyctl --version
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
    reason="needs root (the installer installs redis-server only as root) and the system's python3",
)
def test_root_installs_system_wide_with_redis_server_from_debian_once(
    releases: Releases,
) -> None:
    """As root, on a machine without redis-server, the installer puts capyctl in
    /usr/local/bin and runs apt-get for Debian's redis-server, without questions; a second
    run finds both and asks for nothing."""
    if not _own_mounts():  # asked here, not while every run of the suite collects its tests
        pytest.skip("needs a mount namespace, to install into /usr/local without touching ours")
    root = short_dir("capy-root")
    try:
        tools, log, local = root / "bin", root / "apt-get.log", root / "usr-local"
        link_tools(tools)
        local.mkdir()
        apt_get = tools / "apt-get"
        apt_get.write_text(FAKE_APT_GET.format(log=log, tools=tools))
        apt_get.chmod(0o755)
        release = releases.folder / f"v{OLD}"
        argv = ["unshare", "--mount", "sh", "-c", AS_ROOT, "as-root", str(local), str(root)]
        argv += [str(tools), str(release / "install.sh"), str(release)]

        first = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "install: /usr/local/bin/capyctl is capyctl " + OLD in first.stdout
        assert first.stdout.endswith(f"capyctl {OLD}\n"), first.stdout
        assert (local / "lib" / "capyctl" / OLD / "installed").exists()
        assert "install: installing redis-server from Debian" in first.stdout
        assert log.read_text().splitlines() == [
            "noninteractive update -qq",
            "noninteractive install -y -qq --no-install-recommends redis-server",
        ]
        assert (tools / "redis-server").exists()
        assert "sudo apt-get" not in first.stdout

        again = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"capyctl {OLD} is already installed" in again.stdout
        assert "redis-server" not in again.stdout
        assert len(log.read_text().splitlines()) == 2
    finally:
        shutil.rmtree(root, ignore_errors=True)


def start(prefix: Path, state: Path, env: dict[str, str], listeners: tuple[str, str]) -> Role:
    """The installed capyctl's standalone role on `state`, healthy."""
    log = state.parent / "role.out"
    argv = [str(prefix / "bin" / "capyctl"), "start", "standalone", "--state-dir", str(state)]
    argv += ["--listen", listeners[0], "--management-listen", listeners[1]]
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    role = Role("standalone", state, *listeners, proc, log, env)
    try:
        wait_for(lambda: role.healthy() or proc.poll() is not None, timeout=60, what="the role")
    except BaseException:
        role.stop()
        raise
    assert proc.poll() is None, role.output()[-4000:]
    return role


def _record(state: Path) -> InstanceRecord | None:
    with contextlib.closing(redis.Redis(unix_socket_path=str(state / "redis" / "redis.sock"))) as c:
        raw = cast(bytes | None, c.get(keys.instance("local", "demo", 0)))
    return None if raw is None else InstanceRecord.model_validate_json(raw)


def _ask(role: Role) -> str | None:
    key = role.credentials()["api_key"]
    with openai.OpenAI(base_url=f"http://{role.inference}/v1", api_key=key, timeout=60) as client:
        answer = client.chat.completions.create(model="demo", messages=HELLO)
    return answer.choices[0].message.content


def test_upgrade_and_rollback_keep_the_engine(releases: Releases) -> None:
    root = short_dir("capy-upg")
    prefix, state, home = root / "prefix", root / "state", root / "home"
    env = clean_env(
        HOME=str(home),
        CAPYCTL_SIMULATED_GPUS="gpu0:24GiB",
        CAPYCTL_HOST_NAME="local",
        CAPYCTL_ENGINE_PORTS=engine_ports(11),
    )
    listeners = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    pgid = 0
    roles: list[Role] = []
    try:
        assert (
            install(
                releases, "--releases", releases.url, "--version", OLD, prefix=prefix
            ).returncode
            == 0
        )
        fast = Behaviour(load_seconds=0.3, tokens_per_second=200)
        venv = install_python_engine(root / "vllm", "vllm", "0.29.0", fast)
        run(prefix, "engine", "add", str(venv), "--state-dir", str(state), env=env)
        sparse_model(home / "models" / "demo", 2 * GiB)
        (root / "demo.yaml").write_text("name: demo\nengine: vllm\nmodel: demo\n")

        role = start(prefix, state, env, listeners)
        roles.append(role)
        assert (state / "release").read_text() == f"{OLD}\n"
        deploy = ["deploy", "model", "--file", str(root / "demo.yaml"), "--wait"]
        run(prefix, *deploy, "--state-dir", str(state), env=env)
        ready = _record(state)
        assert ready is not None
        assert ready.process is not None
        pgid = ready.process.pgid
        assert _ask(role)
        assert role.stop() == 0

        upgraded = install(
            releases, "--releases", releases.url, "--version", f"v{NEW}", prefix=prefix
        )
        assert upgraded.returncode == 0, upgraded.stderr
        assert f"also installed: {OLD}" in upgraded.stdout
        assert run(prefix, "--version") == f"capyctl {NEW}\n"
        upgraded_role = start(prefix, state, env, listeners)
        roles.append(upgraded_role)
        wait_for(lambda: "re-adopted" in upgraded_role.output(), 30, "re-adoption after upgrade")
        assert _record(state) == ready, "the same engine, left as it was"
        assert _ask(upgraded_role)
        assert (state / "release").read_text() == f"{NEW}\n"
        assert upgraded_role.stop() == 0

        back = install(releases, "--releases", releases.url, "--version", f"v{OLD}", prefix=prefix)
        assert back.returncode == 0, back.stderr
        assert run(prefix, "--version") == f"capyctl {OLD}\n"
        rolled_back = start(prefix, state, env, listeners)
        roles.append(rolled_back)
        wait_for(lambda: rolled_back.output().count("re-adopted") >= 2, 30, "re-adoption again")
        assert _record(state) == ready
        assert _ask(rolled_back)
        assert (state / "release").read_text() == f"{NEW}\n", "a start never lowers it"
        assert rolled_back.stop() == 0
        assert group_members(pgid), "the engine outlived every role"

        (state / "release").write_text(f"{MAJOR}.{MINOR + 1}.0\n")
        refused = subprocess.run(
            [str(prefix / "bin" / "capyctl"), "start", "standalone", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert refused.returncode == 5
        assert f"CapyCTL {MAJOR}.{MINOR + 1}.0, and this is CapyCTL {OLD}" in refused.stderr
    finally:
        for each in roles:
            each.stop()
        if pgid and group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
