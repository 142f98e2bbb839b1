"""Command groups whose commands are imported when they run.

Most of what a `capyctl` command costs is its start: importing every command's modules (the
role launcher, the settings tree, the deployment schema, the PKI) took longer than most
commands take to run. A lazy group names each command's module instead, and imports it only
when that command is run, or when help lists them all.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, NamedTuple

import typer
import typer.core
import typer.main


class Lazy(NamedTuple):
    """Where a command is: `module:attribute`, a Typer that is a group of commands, or
    (`group` False) that holds just the one command."""

    target: str
    group: bool = True


def one(target: str) -> Lazy:
    """A Typer that holds one command, run as that command."""
    return Lazy(target, group=False)


class LazyGroup(typer.core.TyperGroup):
    """A group whose `table` says where each of its commands is."""

    table: ClassVar[dict[str, Lazy]] = {}

    def list_commands(self, ctx: Any) -> list[str]:
        loaded = super().list_commands(ctx)
        return [*loaded, *(name for name in self.table if name not in loaded)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in self.table:
            lazy = self.table[cmd_name]
            module, _, attribute = lazy.target.partition(":")
            found: typer.Typer = getattr(importlib.import_module(module), attribute)
            get = typer.main.get_group if lazy.group else typer.main.get_command
            command = get(found)
            command.name = cmd_name
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


def lazy_group(table: dict[str, Lazy]) -> type[LazyGroup]:
    """A LazyGroup class over `table`, for `typer.Typer(cls=...)`."""
    return type("LazyCommands", (LazyGroup,), {"table": table})
