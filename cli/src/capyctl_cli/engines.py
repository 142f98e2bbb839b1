"""`capyctl engine detect|add|add-custom|list|remove`: the engines installed on this machine."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated

import redis
import typer

from capycommon.engines import detect, registry
from capycommon.engines.families import Family, is_verified
from capycommon.engines.registry import Registry
from capycommon.errors import EngineNotFound, EngineUnsupported
from capycommon.paths import StatePaths, resolve_state_dir
from capycommon.settingsources import locate_document
from capyctl_cli import output, record
from capyctl_cli.options import (
    ConfigOpt,
    JsonOpt,
    RoleOpt,
    StateDirOpt,
    command_group,
    expected_errors,
    role_of,
)
from capyctl_cli.record import RoleRecord
from capyctl_cli.rolelock import lock_is_held

app = command_group("Register the engines installed on this machine.")


def engines_file(role: str, state_dir: str | None, config: str | None) -> tuple[Path, StatePaths]:
    """The engine registry of the role's document (as the options name them), and the state
    dir's paths (to publish to a running role)."""
    env = dict(os.environ)
    root, _ = resolve_state_dir(state_dir, env)
    paths = StatePaths(root)
    document = locate_document(config, env, paths.role_document(role_of(role)))
    return registry.locate(document, Path.home()), paths


def choose(found: list[detect.Found], family: Family | None, path: Path) -> detect.Found:
    if family is not None:
        matching = [f for f in found if f.family == family]
        if not matching:
            raise EngineNotFound(f"{path} holds no {family} installation")
        return matching[0]
    if len(found) > 1:
        families = " and ".join(f.family.value for f in found)
        raise EngineUnsupported(
            f"{path} holds {families}; choose one with --family (add each you want registered)"
        )
    return found[0]


def _running_host(paths: StatePaths) -> RoleRecord | None:
    """The role running on the state dir, when it has a host to publish to."""
    found = record.read(paths) if lock_is_held(paths) else None
    return found if found is not None and found.host else None


def publish_if_running(paths: StatePaths, engines: Registry) -> str:
    """Publish to the role running on the state dir; say where the registry went."""
    if not lock_is_held(paths):
        return "published when capyctl starts"
    running = _running_host(paths)
    if running is None or running.host is None:
        role = getattr(record.read(paths), "role", "running")
        return f"not published: the {role} role has no host"
    host = running.host
    try:
        with record.state_of(running) as state:
            state(lambda s: s.engines.publish(host, engines))
    except (redis.RedisError, OSError) as exc:
        return f"not published ({exc}); it will be when capyctl starts"
    return f"published to the running {running.role} role (revision {engines.revision})"


def published_revision(paths: StatePaths) -> int | None:
    """The registry revision the running role holds, or None when no role runs."""
    running = _running_host(paths)
    if running is None or running.host is None:
        return None
    host = running.host
    try:
        with record.state_of(running) as state:
            found = state(lambda s: s.engines.get(host))
    except (redis.RedisError, OSError):
        return None
    return None if found is None else found.revision


@app.command("detect")
@expected_errors
def engine_detect(
    path: Annotated[
        list[Path] | None, typer.Option("--path", help="Also look here (repeatable).")
    ] = None,
    role: RoleOpt = "standalone",
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Find vLLM and SGLang environments and llama-server binaries (executes only probes)."""
    places = detect.candidates(Path.home(), path or [], os.environ.get("PATH", ""))
    found = detect.detect(places)
    file, _ = engines_file(role, state_dir, config)
    known = {p.executable: p.name for p in registry.read(file).document.profiles.values()}
    rows = [
        {
            "path": str(f.install_path),
            "family": f.family.value,
            "version": f.version,
            "verified": is_verified(f.family, f.version),
            "registered": known.get(f.executable),
        }
        for f in found
    ]
    if as_json:
        output.emit_json(rows)
    elif not rows:
        output.echo(
            "No engine found. Name a folder with --path, or register one with `capyctl engine add`."
        )
    else:
        output.echo(
            output.table(
                ["PATH", "ENGINE", "VERSION", "VERIFIED", "REGISTERED"],
                [list(r.values()) for r in rows],
            )
        )


@app.command("add")
@expected_errors
def engine_add(
    path: Annotated[
        Path, typer.Argument(help="A vLLM or SGLang virtualenv, a llama-server, or a tensorfold.")
    ],
    name: Annotated[
        str | None, typer.Option("--name", help="Profile name (default: the family).")
    ] = None,
    family: Annotated[
        Family | None, typer.Option("--family", help="When a venv holds several.")
    ] = None,
    role: RoleOpt = "standalone",
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Register an engine: its family, version, executable and fingerprint."""
    found = choose(detect.probe(path), family, path)
    _register(found.profile(name), role, state_dir, config, as_json)


@app.command("add-custom")
@expected_errors
def engine_add_custom(
    name: Annotated[str, typer.Argument(help="The profile's name, which deployments name.")],
    command: Annotated[
        str,
        typer.Option(
            "--command",
            help="The server's argv, split like a shell would but run without one: an absolute "
            "program, then its arguments with {port} and {model} (and {served_name}, {host}).",
        ),
    ],
    ready_path: Annotated[
        str, typer.Option("--ready-path", help="The path that answers 200 once it serves.")
    ] = "/health",
    key_env: Annotated[
        str | None,
        typer.Option("--key-env", help="The variable it reads its API key from, if any."),
    ] = None,
    version: Annotated[
        str, typer.Option("--version", help="A version to show for it (not checked).")
    ] = "unversioned",
    role: RoleOpt = "standalone",
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Register any OpenAI-compatible server as a custom engine (always restart_only; its
    deployments state their resources)."""
    profile = detect.custom_profile(name, command, ready_path, key_env, version)
    _register(profile, role, state_dir, config, as_json)


def _register(
    profile: registry.EngineProfile,
    role: str,
    state_dir: str | None,
    config: str | None,
    as_json: bool,
) -> None:
    file, paths = engines_file(role, state_dir, config)
    saved = registry.add(file, profile)
    published = publish_if_running(paths, saved)
    answer = {
        "profile": profile.model_dump(mode="json"),
        "file": str(file),
        "revision": saved.revision,
        "published": published,
    }
    details = [
        ("executable", profile.executable),
        *([("command", shlex.join(profile.command))] if profile.command else []),
        ("fingerprint", profile.fingerprint),
        ("verified", "yes" if profile.verified else "no (custom)"),
        ("file", f"{file} (revision {saved.revision})"),
        ("registry", published),
    ]
    registered = f"Registered {profile.family} {profile.version} as {profile.name!r}."
    output.show(answer, f"{registered}\n{output.pairs(details)}", as_json=as_json)


@app.command("list")
@expected_errors
def engine_list(
    role: RoleOpt = "standalone",
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The registered engines."""
    file, paths = engines_file(role, state_dir, config)
    current = registry.read(file)
    live = published_revision(paths)
    published = live is not None and live == current.revision
    profiles = sorted(current.document.profiles.values(), key=lambda p: p.name)
    answer = {
        "file": str(file),
        "revision": current.revision,
        "published": published,
        "profiles": [p.model_dump(mode="json") for p in profiles],
    }
    headers = ["PROFILE", "ENGINE", "VERSION", "CUSTOM", "PUBLISHED", "PATH"]
    rows = [
        [p.name, p.family, p.version, "no" if p.verified else "yes", published, p.install_path]
        for p in profiles
    ]
    output.show(answer, output.table(headers, rows), as_json=as_json)


@app.command("remove")
@expected_errors
def engine_remove(
    name: Annotated[str, typer.Argument(help="The profile to remove.")],
    role: RoleOpt = "standalone",
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove a registered engine (its installation is left alone)."""
    file, paths = engines_file(role, state_dir, config)
    saved = registry.remove(file, name)
    published = publish_if_running(paths, saved)
    output.show(
        {"removed": name, "revision": saved.revision, "published": published},
        f"Removed {name!r} ({file}, revision {saved.revision}); {published}.",
        as_json=as_json,
    )
