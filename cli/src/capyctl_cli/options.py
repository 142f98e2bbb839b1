"""Options and error handling shared by the CLI's commands."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from capycommon.errors import CapyError, InvalidConfig
from capyctl_cli import output

if TYPE_CHECKING:
    from capycommon.settings import Role

StateDirOpt = Annotated[
    str | None,
    typer.Option("--state-dir", help="State dir (CAPYCTL_STATE_DIR).", show_default=False),
]
ConfigOpt = Annotated[
    str | None, typer.Option("--config", help="Role document (CAPYCTL_CONFIG).", show_default=False)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
HostArg = Annotated[str, typer.Argument(help="The host's name.", show_default=False)]
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
RoleArg = Annotated[str, typer.Argument(help="standalone, server or host.")]


def role_of(value: str) -> Role:
    if value not in ("standalone", "server", "host"):
        raise InvalidConfig(f"unknown role {value!r}; use standalone, server or host")
    return value  # type: ignore[return-value]
