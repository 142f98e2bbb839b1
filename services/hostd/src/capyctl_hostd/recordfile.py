"""A record hostd keeps in its state dir of what it started (its engines, its LMCache
servers), so that it finds them again after a restart: entries by member, rewritten whole
(atomically, owner-only) on a change."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from pydantic import TypeAdapter, ValidationError

from capycommon.paths import write_atomic

log = logging.getLogger(__name__)


class _Entry(Protocol):
    @property
    def member(self) -> str: ...


E = TypeVar("E", bound=_Entry)


class RecordFile(Generic[E]):
    """The entries of the file at `path` (a JSON list `adapter` reads and writes), by member.
    An unreadable file is logged and read as empty: Redis's records still lead re-adoption,
    and the record starts again from them."""

    def __init__(self, path: Path, adapter: TypeAdapter[list[E]], what: str) -> None:
        self.path = path
        self.adapter = adapter
        self.entries = {entry.member: entry for entry in self._read(what)}

    def keep(self, entry: E) -> None:
        if self.entries.get(entry.member) != entry:
            self.entries[entry.member] = entry
            self._write()

    def drop(self, member: str) -> None:
        if self.entries.pop(member, None) is not None:
            self._write()

    def _read(self, what: str) -> list[E]:
        try:
            return self.adapter.validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, ValidationError) as exc:
            log.error("ignoring an unreadable record of %s %s: %s", what, self.path, exc)
            return []

    def _write(self) -> None:
        data = self.adapter.dump_json(list(self.entries.values()), indent=2).decode()
        write_atomic(self.path, data)
