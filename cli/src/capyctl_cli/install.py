"""`capyctl install units ROLE` and `capyctl docs [PAGE]`: what a release carries to run it
under systemd and to operate it, with no clone at hand.

The units are the project's own (`systemd/system`, `systemd/user`), each naming the capyctl
that writes them in place of the path it expects (/usr/local/bin/capyctl, or
~/.local/bin/capyctl for a user's)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from capycommon.errors import InvalidRequest, NotFound
from capycommon.paths import write_atomic
from capycommon.settings import Role
from capyctl_cli import output
from capyctl_cli.bundled import bundled
from capyctl_cli.options import JsonOpt, RoleArg, command_group, expected_errors, role_of

install_app = command_group("Install what runs CapyCTL under systemd.")
docs_app = typer.Typer(help="Read the operations guide and the other pages of the docs.")

EXPECTED = {"system": "/usr/local/bin/capyctl", "user": "%h/.local/bin/capyctl"}
# The units each role runs from: its own, the release notes' template (capyctl@ROLE), and
# for the standalone role its units per process, for a host one instance per joined host.
PROCESSES = ("redis", "router", "scheduler", "hostd", "memwatch")
EXTRA: dict[Role, tuple[str, ...]] = {
    "standalone": ("capyctl.target", *(f"capyctl-{name}.service" for name in PROCESSES)),
    "server": (),
    "host": ("capyctl-host@.service",),
}


def units_of(role: Role) -> tuple[str, ...]:
    return (f"capyctl-{role}.service", "capyctl@.service", *EXTRA[role])


def running_capyctl() -> Path:
    """This capyctl as it was run: the link on the PATH an installation makes (so a unit
    follows an upgrade that moves the link), not the file it points at."""
    found = shutil.which(sys.argv[0]) or shutil.which("capyctl")
    if found is None:
        raise NotFound("cannot tell where this capyctl is; name it with --executable PATH")
    return Path(os.path.abspath(found))


def unit_text(source: Path, scope: str, executable: Path) -> str:
    """The unit with `executable` in its Exec*= lines (its comments keep the path they
    explain)."""
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(
        line.replace(EXPECTED[scope], str(executable)) if line.startswith("Exec") else line
        for line in lines
    )


def write_units(
    role: Role, scope: str, folder: Path, executable: Path, *, force: bool
) -> dict[str, str]:
    """Each unit of `role` written into `folder` (kept where it already reads the same);
    refused, with nothing written, where one differs and `force` is off."""
    if any(c.isspace() for c in str(executable)):
        raise InvalidRequest(f"{executable} has a space; name a path without one (--executable)")
    wanted = {
        name: unit_text(bundled("systemd") / scope / name, scope, executable)
        for name in units_of(role)
    }
    found = {
        name: (folder / name).read_text(encoding="utf-8")
        for name in wanted
        if (folder / name).exists()
    }
    changed = [folder / name for name, text in found.items() if text != wanted[name]]
    if changed and not force:
        names = ", ".join(str(path) for path in changed)
        raise InvalidRequest(
            f"{names} differ from this release's units; pass --force to replace them (edits "
            "there are lost; keep yours with a drop-in, systemctl edit)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, text in wanted.items():
        path = folder / name
        if found.get(name) == text:
            written[str(path)] = "unchanged"
            continue
        write_atomic(path, text, mode=0o644)
        written[str(path)] = "replaced" if name in found else "written"
    return written


ScopeOpt = Annotated[
    bool | None,
    typer.Option(
        "--user/--system",
        help="A user's units (~/.config/systemd/user), or the machine's (/etc/systemd/system). "
        "Default: the machine's as root, else the user's.",
        show_default=False,
    ),
]


@install_app.command("units")
@expected_errors
def install_units(
    role: RoleArg,
    user: ScopeOpt = None,
    folder: Annotated[
        Path | None, typer.Option("--dir", help="Write them here instead.", show_default=False)
    ] = None,
    executable: Annotated[
        Path | None,
        typer.Option(
            "--executable", help="The capyctl they run (default: this one).", show_default=False
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace units that differ.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write the systemd units of a role, naming this capyctl."""
    chosen = role_of(role)
    scope = "user" if (user if user is not None else os.geteuid() != 0) else "system"
    if folder is None:
        config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        folder = config / "systemd" / "user" if scope == "user" else Path("/etc/systemd/system")
    binary = Path(os.path.abspath(executable)) if executable else running_capyctl()
    written = write_units(chosen, scope, folder, binary, force=force)
    ctl = "systemctl --user" if scope == "user" else "systemctl"
    answer = {"role": chosen, "scope": scope, "executable": str(binary), "units": written}
    start = f"{ctl} daemon-reload; {ctl} enable --now capyctl-{chosen} (or capyctl@{chosen})"
    details = [*written.items(), ("executable", binary), ("next", start)]
    head = f"The {scope} units of the {chosen} role are in {folder}."
    output.show(answer, f"{head}\n{output.pairs(details)}", as_json=as_json)


def pages() -> dict[str, Path]:
    """Each page of the docs by its name: `operations`, `roles/host`, ..."""
    root = bundled("docs")
    return {str(p.relative_to(root).with_suffix("")): p for p in sorted(root.rglob("*.md"))}


@docs_app.command()
@expected_errors
def docs(
    page: Annotated[
        str | None, typer.Argument(help="The page, e.g. operations (none: the list).")
    ] = None,
) -> None:
    """Print a page of the documentation this release carries, as Markdown."""
    found = pages()
    if page is None:
        output.echo("\n".join(found))
        return
    path = found.get(page.removesuffix(".md"))
    if path is None:
        raise NotFound(f"no page {page!r} in the docs; the pages: {', '.join(found)}")
    output.echo(path.read_text(encoding="utf-8").rstrip("\n"))
