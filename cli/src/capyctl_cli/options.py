"""Options and error handling shared by the CLI's commands."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
import typer.core

from capycommon.errors import CapyError, InvalidConfig
from capycommon.settingnames import SettingSpec
from capycommon.settings import Role, all_setting_specs, setting_specs
from capyctl_cli import output

StateDirOpt = Annotated[
    str | None,
    typer.Option("--state-dir", help="State dir (CAPYCTL_STATE_DIR).", show_default=False),
]
ConfigOpt = Annotated[
    str | None, typer.Option("--config", help="Role document (CAPYCTL_CONFIG).", show_default=False)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
# One option of `capyctl` itself (capyctl --debug <command> ...), read by `expected_errors`.
DebugOpt = Annotated[
    bool,
    typer.Option(
        "--debug",
        help="Show an error's traceback (capyctl --debug <command> ...).",
        show_default=False,
    ),
]
F = TypeVar("F", bound=Callable[..., Any])
_CONTEXT = "_context"


def command_group(summary: str) -> typer.Typer:
    """A group of commands (`capyctl <group> ...`) that shows its help when given none."""
    return typer.Typer(help=summary, no_args_is_help=True)


def expected_errors(fn: F) -> F:
    """Print a CapyError as one line (or JSON, for a command given --json) and exit with its
    code; `capyctl --debug` shows its traceback first.

    The command gets the click context it needs for that (to read the root's --debug) as a
    parameter of its own, unless it already takes one."""
    signature = inspect.signature(fn, eval_str=True)
    own = next(
        (p.name for p in signature.parameters.values() if p.annotation is typer.Context), None
    )

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx: typer.Context = kwargs[own] if own else kwargs.pop(_CONTEXT)
        try:
            return fn(*args, **kwargs)
        except CapyError as exc:
            debug = bool(ctx.find_root().params.get("debug"))
            output.error(exc, as_json=kwargs.get("as_json", False), debug=debug)
            raise typer.Exit(exc.exit_code) from None

    if own is None:
        context = inspect.Parameter(
            _CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context
        )
        params = [*signature.parameters.values(), context]
        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


RoleOpt = Annotated[str, typer.Option("--role", help="standalone, server or host.")]


def role_of(value: str) -> Role:
    if value not in ("standalone", "server", "host"):
        raise InvalidConfig(f"unknown role {value!r}; use standalone, server or host")
    return value  # type: ignore[return-value]


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
