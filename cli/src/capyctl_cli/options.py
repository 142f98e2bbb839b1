"""Options and error handling shared by the CLI's commands."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from capycommon.errors import CapyError, InvalidConfig
from capycommon.settings import Role
from capyctl_cli import output

StateDirOpt = Annotated[
    str | None,
    typer.Option("--state-dir", help="State dir (CAPYCTL_STATE_DIR).", show_default=False),
]
ConfigOpt = Annotated[
    str | None, typer.Option("--config", help="Role document (CAPYCTL_CONFIG).", show_default=False)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")]
ListenOpt = Annotated[
    str | None,
    typer.Option(
        "--listen",
        help="Inference listener ADDR:PORT (CAPYCTL_INFERENCE_ADDR).",
        show_default=False,
    ),
]
ManagementOpt = Annotated[
    str | None,
    typer.Option(
        "--management-listen",
        help="Management listener, loopback ADDR:PORT (CAPYCTL_MANAGEMENT_ADDR).",
        show_default=False,
    ),
]
HostNameOpt = Annotated[
    str | None,
    typer.Option("--host-name", help="This host's name (CAPYCTL_HOST_NAME).", show_default=False),
]
ModelsRootOpt = Annotated[
    str | None,
    typer.Option("--models-root", help="Models folder (CAPYCTL_MODELS_ROOT).", show_default=False),
]
EnginePortsOpt = Annotated[
    str | None,
    typer.Option(
        "--engine-ports",
        help="Engine port range START-END (CAPYCTL_ENGINE_PORTS).",
        show_default=False,
    ),
]
LogLevelOpt = Annotated[
    str | None,
    typer.Option(
        "--log-level", help="debug|info|warning|error (CAPYCTL_LOG_LEVEL).", show_default=False
    ),
]

F = TypeVar("F", bound=Callable[..., Any])


def expected_errors(fn: F) -> F:
    """Print a CapyError as one line (or JSON) and exit with its code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CapyError as exc:
            output.error(
                exc, as_json=kwargs.get("as_json", False), debug=kwargs.get("debug", False)
            )
            raise typer.Exit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


RoleOpt = Annotated[str, typer.Option("--role", help="standalone, server or host.")]


def role_of(value: str) -> Role:
    if value not in ("standalone", "server", "host"):
        raise InvalidConfig(f"unknown role {value!r}; use standalone, server or host")
    return value  # type: ignore[return-value]
