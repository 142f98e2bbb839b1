"""Why the role's redis-server cannot start, and the repair that works for each kind of damage
to its append-only data: Redis 7.0's multi-part AOF, a manifest that lists one base file
(`appendonly.aof.<n>.base.rdb`) and the incremental files written since
(`appendonly.aof.<n>.incr.aof`), in `<state>/redis/appendonly/`.

What works, tried against redis-server and redis-check-aof 7.0:

- A torn record at the end of an incremental file is not damage: Redis cuts it off and loads
  the rest (`aof-load-truncated`, on by default); at the end of an earlier file it exits
  after cutting it, and loads at its next start, which supervisord makes (or the one after,
  when the cut left a transaction open: that start cuts it off and exits too).
- A record Redis cannot read in the last incremental file: `redis-check-aof --fix <manifest>`
  cuts that file at the record.
- A record Redis cannot read in an earlier incremental file: redis-check-aof cuts only the
  last file ("not the last file"), so the manifest is first written to end at the damaged
  file, then cut as above.
- A damaged or missing base file, or a missing incremental file: redis-check-aof cannot help
  (it gives up on a base it cannot read); the manifest is written anew without that file and
  Redis loads the rest.
- A damaged manifest (redis-check-aof cannot read it either): it is written anew from the
  files present, the newest base and every incremental file in order. A missing manifest
  makes Redis start empty beside the files, so the launcher refuses to start it. (The files
  alone cannot tell an incremental file a rewrite replaced, which Redis deletes at once, from
  a current one: one left by a crash in that moment would be listed too.)

Each repair is a command line the person can run as it is written.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from capycommon.errors import CapyError, Internal, StateCorrupt
from capycommon.paths import StatePaths
from capyctl_cli import supervisor

# Redis's default `appendfilename`, which the role's configuration keeps.
PREFIX = "appendonly.aof"
MANIFEST = f"{PREFIX}.manifest"
_PART = re.compile(rf"{re.escape(PREFIX)}\.(\d+)\.(base\.rdb|base\.aof|incr\.aof)")
_TYPES = {"base.rdb": "b", "base.aof": "b", "incr.aof": "i"}


@dataclass(frozen=True)
class Part:
    """One file of the append-only data: its name, sequence number and type (b: base,
    i: incremental, h: history, which Redis deletes)."""

    name: str
    seq: int
    kind: str

    @property
    def line(self) -> str:
        return f"file {self.name} seq {self.seq} type {self.kind}"


def read_manifest(path: Path) -> list[Part] | None:
    """The files the manifest lists, or None when it is missing or not one Redis reads:
    lines of `file <name> seq <n> type <b|h|i>` (comments aside), one base at most, the
    incremental files in rising order."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    parts: list[Part] = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        words = line.split()
        fields = dict(zip(words[::2], words[1::2], strict=False))
        if len(words) != 6 or set(fields) != {"file", "seq", "type"}:
            return None
        if not fields["seq"].isdigit() or fields["type"] not in ("b", "h", "i"):
            return None
        parts.append(Part(fields["file"], int(fields["seq"]), fields["type"]))
    live = [part for part in parts if part.kind != "h"]
    incr = [part.seq for part in live if part.kind == "i"]
    if not live or sum(part.kind == "b" for part in live) > 1 or incr != sorted(set(incr)):
        return None
    return live


def present_parts(aof: Path) -> list[Part]:
    """What a manifest written anew lists: the newest base file in `aof`, then every
    incremental file in order."""
    found = []
    for entry in aof.iterdir() if aof.is_dir() else ():
        match = _PART.fullmatch(entry.name)
        if match is not None and entry.is_file():
            found.append(Part(entry.name, int(match[1]), _TYPES[match[2]]))
    bases = sorted((part for part in found if part.kind == "b"), key=lambda part: part.seq)
    incr = sorted((part for part in found if part.kind == "i"), key=lambda part: part.seq)
    return bases[-1:] + incr


def unlisted_data(paths: StatePaths) -> StateCorrupt | None:
    """Refuses a start where the manifest is gone but its files are not: Redis would start
    empty beside them, and a rewrite could take their names."""
    aof = paths.redis_dir / "appendonly"
    parts = present_parts(aof)
    if (aof / MANIFEST).exists() or not parts:
        return None
    return StateCorrupt(
        f"Redis's manifest {aof / MANIFEST} is missing, but {aof} holds its data: Redis "
        f"would start empty. {_relist(aof, parts, 'write the manifest anew from its files')}"
    )


def redis_failure(paths: StatePaths) -> CapyError:
    """Why the role's redis-server cannot start, from the last lines of its log and its
    folder, with the repair for its kind of damage."""
    lines = _tail(supervisor.log_file(paths, "redis"), 40)
    reason = next((line for line in reversed(lines) if "#" in line), "see its log")
    reason = reason.split("# ", 1)[-1].split(": make a backup", 1)[0].strip()
    aof = paths.redis_dir / "appendonly"
    if not any("AOF" in line or "append only" in line for line in lines):
        return Internal(
            f"Redis cannot start: {reason} (its log: {supervisor.log_file(paths, 'redis')})"
        )
    said = f"Redis cannot load the role's data in {aof}: {reason}. "
    listed = read_manifest(aof / MANIFEST)
    if listed is None:
        return StateCorrupt(
            said + _relist(aof, present_parts(aof), "write the manifest anew from its files")
        )
    missing = [part for part in listed if not (aof / part.name).is_file()]
    if missing:
        names = ", ".join(part.name for part in missing)
        kept = [part for part in listed if part not in missing]
        lost = f"what {names} held is lost"
        return StateCorrupt(said + _relist(aof, kept, f"list the files without {names}", lost))
    return StateCorrupt(said + _damaged_repair(aof, listed, _warnings(lines)))


def _damaged_repair(aof: Path, listed: list[Part], warnings: list[str]) -> str:
    """The repair of a file Redis cannot read, named by the last start's warnings."""
    damaged = _damaged_part(listed, warnings)
    if damaged is None:
        return f"{_backup(aof)}; then {_cut(aof, 'it')}; and start again"
    if damaged.kind == "b":
        kept = [part for part in listed if part != damaged]
        lost = f"what {damaged.name} held (the data as of Redis's last rewrite) is lost"
        return _relist(aof, kept, f"list the files without {damaged.name}", lost)
    if damaged == listed[-1]:
        return (
            f"{_backup(aof)}; then {_cut(aof, damaged.name)}; and start again; the writes in "
            f"{damaged.name} from the damage on are lost"
        )
    upto = listed[: listed.index(damaged) + 1]
    return (
        f"{_backup(aof)}; then end the manifest at {damaged.name}: {_write(aof, upto)}; then "
        f"{_cut(aof, 'it')}; and start again; the writes from the damage on, and in the files "
        "after it, are lost"
    )


def _damaged_part(listed: list[Part], warnings: list[str]) -> Part | None:
    """The file the warnings name (an RDB error is the base's), newest warning first."""
    for line in reversed(warnings):
        match = _PART.search(line)
        if match is not None:
            return next((part for part in listed if part.name == match[0]), None)
        if "RDB" in line or "loading DB" in line:
            return next((part for part in listed if part.kind == "b"), None)
    return None


def _relist(aof: Path, parts: list[Part], what: str, lost: str = "") -> str:
    """Back up, write a manifest of `parts` (`what` says why), start again, and what is
    `lost`; with nothing to list, the folder goes and the role starts with no state."""
    folder = shlex.quote(str(aof))
    if not parts:
        return (
            f"Nothing in it can be loaded: move it aside: `mv {folder} {folder}.bak`, and "
            "start again with no state (declare the deployments anew)"
        )
    told = f"{_backup(aof)}; then {what}: {_write(aof, parts)}; and start again"
    return f"{told}; {lost}, the rest loads" if lost else f"{told}; Redis loads every file listed"


def _backup(aof: Path) -> str:
    return f"Back it up first: `cp -a {shlex.quote(str(aof))} {shlex.quote(f'{aof}.bak')}`"


def _cut(aof: Path, name: str) -> str:
    manifest = shlex.quote(str(aof / MANIFEST))
    return f"cut {name} at the damage: `redis-check-aof --fix {manifest}` (answer y)"


def _write(aof: Path, parts: list[Part]) -> str:
    """The command that writes a manifest of `parts` (Redis's own file names: nothing to
    quote inside the printf format)."""
    lines = "".join(f"{part.line}\\n" for part in parts)
    return f"`printf '{lines}' > {shlex.quote(str(aof / MANIFEST))}`"


# What Redis writes at each start, and once it has loaded its data and serves: from 7.2
# "Ready to accept connections unix", before it (Debian 12's 7.0) "The server is now ready to
# accept connections at <socket>"; READY is matched in the line's lower case.
STARTING = "Redis is starting"
READY = "ready to accept connections"


class StartLog:
    """Redis's starts since this launch, from its log: a start that ends with no READY line
    failed. Counted here, not from supervisord's retries, which a start that fails at once
    can reset: supervisord, busy with the services starting beside it, can call such a start
    RUNNING (up for `startsecs`) before it notices the exit, and begins counting again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._offset = path.stat().st_size
        except OSError:
            self._offset = 0
        self._failed = 0
        self._partial = b""  # a line Redis has not finished writing

    def failed_in_a_row(self) -> int:
        """How many starts since the last that loaded have begun, each without loading; the
        newest may still be loading: ask whether it runs."""
        try:
            with self.path.open("rb") as file:
                if file.seek(0, os.SEEK_END) < self._offset:
                    self._offset, self._partial = 0, b""  # rotated: the rest is in the backup
                file.seek(self._offset)
                new = file.read()
        except OSError:
            return self._failed
        self._offset += len(new)
        *lines, self._partial = (self._partial + new).split(b"\n")
        for line in lines:
            if STARTING.encode() in line:
                self._failed += 1
            elif READY.encode() in line.lower():
                self._failed = 0
        return self._failed


def _warnings(lines: list[str]) -> list[str]:
    """The warning lines (`#`) of Redis's last start in `lines`."""
    start = max((i for i, line in enumerate(lines) if STARTING in line), default=0)
    return [line for line in lines[start:] if " # " in line]


def _tail(path: Path, count: int) -> list[str]:
    try:
        with path.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 16384))
            return file.read().decode("utf-8", "replace").splitlines()[-count:]
    except OSError:
        return []
