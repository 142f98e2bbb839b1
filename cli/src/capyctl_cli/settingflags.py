"""A role's settings as command-line flags (`capyctl start <role>`, `config show`): one
option per flag of the settings tree, and unknown flags refused by the settings loader."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer
import typer.core

from capycommon.errors import InvalidConfig
from capycommon.settingnames import SettingSpec
from capycommon.settings import Role, all_setting_specs, setting_specs


class SettingsCommand(typer.core.TyperCommand):
    """A command with setting flags: it accepts what click does not know, so that
    `load_settings`, not click, refuses an unknown flag (naming it, as one line with an exit
    code); its help is plain text, which never cuts a long flag name short."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["context_settings"] = {
            **(kwargs.get("context_settings") or {}),
            "allow_extra_args": True,
            "ignore_unknown_options": True,
        }
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None


def setting_flags(role: Role | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command one option per flag of `role`'s settings (of every role's for None),
    derived from its tree.

    The command takes `ctx: typer.Context` and `flags: dict[str, str | None]` (each flag
    name and its value, None when not given, with any flag click did not know, which
    `load_settings` refuses naming it); --help lists the options. Register the command with
    `cls=SettingsCommand`.
    """
    specs = all_setting_specs() if role is None else setting_specs(role)
    named = [(name, spec) for spec in specs.values() for name in spec.flags]
    options = [(f"setting_{index}", name, spec) for index, (name, spec) in enumerate(named)]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "flags"]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            flags = {name: kwargs.pop(param) for param, name, _ in options}
            ctx: typer.Context = kwargs["ctx"]
            return fn(*args, flags={**flags, **_extras(ctx.args)}, **kwargs)

        params = [_option(param, name, spec) for param, name, spec in options]
        wrapper.__signature__ = inspect.Signature([*own, *params])  # type: ignore[attr-defined]
        return wrapper

    return decorate


def _option(param: str, name: str, spec: SettingSpec) -> inspect.Parameter:
    text = spec.description if name == spec.flag else f"Same as {spec.flag}."
    if name == spec.flag and len(spec.variables) > 1:
        text += f" Also {', '.join(spec.variables[1:])}."
    option = typer.Option(name, metavar=spec.metavar, help=text, show_default=False)
    annotation = Annotated[str | None, option]
    return inspect.Parameter(
        param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation
    )


def _extras(args: list[str]) -> dict[str, str]:
    """What click left over, as flags; `load_settings` refuses the unknown ones by name."""
    found: dict[str, str] = {}
    rest = iter(args)
    for arg in rest:
        if not arg.startswith("-"):
            raise InvalidConfig(f"unexpected argument {arg!r}; settings are given as --flag VALUE")
        name, sep, value = arg.partition("=")
        found.setdefault(name, value if sep else next(rest, ""))
    return found
