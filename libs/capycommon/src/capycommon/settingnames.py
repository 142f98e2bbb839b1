"""The names each setting answers to, derived from the settings tree.

Every leaf of a role's tree (a setting) can be stated three ways: in the YAML role document
under its dotted path, as a flag, and as a variable. The flag and the variable are derived
from the path, so a new setting gets both without a hand-kept list:

    server.scheduling.max_parked -> --server-scheduling-max-parked
                                    CAPYCTL_SERVER_SCHEDULING_MAX_PARKED

(the flag: `--`, then the path with `.` and `_` as `-`; the variable: `CAPYCTL_`, then the
path upper-cased with `.` as `_`). A few settings also keep a short name (`--listen`,
`CAPYCTL_INFERENCE_ADDR`, ...), declared beside the field with `Setting`. A secret never
has a flag: a command line is visible to every user of the machine.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict, Union, Unpack, get_args, get_origin

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Setting:
    """How a setting is stated beside its derived flag and variable (field metadata)."""

    # Short names kept beside the derived ones (they are documented, and scripts use them).
    flags: tuple[str, ...] = ()
    variables: tuple[str, ...] = ()
    # What the value looks like on a command line, for --help (derived from the type if "").
    metavar: str = ""
    # Never from a flag, and shown without its password.
    secret: bool = False
    # An empty variable is refused instead of counting as unset.
    empty_refused: bool = False


class Bounds(TypedDict, total=False):
    """The bounds a number setting may have (pydantic's)."""

    gt: float
    ge: float
    le: float


def setting(default: Any, description: str, example: str, **bounds: Unpack[Bounds]) -> Any:
    """The field of a setting: its default, the description and the one example that `--help`
    and the reference show (the example a valid value other than the default), and the
    bounds of a number, if any."""
    return Field(default, description=description, examples=[example], **bounds)


@dataclass(frozen=True)
class SettingSpec:
    """One setting: its dotted path and every name it answers to."""

    path: str
    # The derived flag first, then the short names; none for a secret.
    flags: tuple[str, ...]
    # The derived variable first, then the short names.
    variables: tuple[str, ...]
    description: str
    # A valid value that differs from the default, as written on a command line.
    example: str
    metavar: str
    secret: bool
    empty_refused: bool

    @property
    def flag(self) -> str | None:
        return self.flags[0] if self.flags else None

    @property
    def variable(self) -> str:
        return self.variables[0]


def derived_flag(path: str) -> str:
    """`server.scheduling.max_parked` -> `--server-scheduling-max-parked`."""
    return "--" + path.replace(".", "-").replace("_", "-")


def derived_variable(path: str) -> str:
    """`server.scheduling.max_parked` -> `CAPYCTL_SERVER_SCHEDULING_MAX_PARKED`."""
    return "CAPYCTL_" + path.replace(".", "_").upper()


def specs_of(model: type[BaseModel], prefix: str = "") -> Iterator[SettingSpec]:
    """Every leaf of a settings tree, in declaration order (`kind` is not a setting)."""
    for name, info in model.model_fields.items():
        if name == "kind":
            continue
        path = f"{prefix}{name}"
        child = info.annotation
        if isinstance(child, type) and issubclass(child, BaseModel):
            yield from specs_of(child, f"{path}.")
        else:
            yield _spec(path, info)


def _spec(path: str, info: FieldInfo) -> SettingSpec:
    setting = _merged([m for m in info.metadata if isinstance(m, Setting)])
    flags = () if setting.secret else (derived_flag(path), *setting.flags)
    variables = (derived_variable(path), *setting.variables)
    examples = info.examples or []
    return SettingSpec(
        path=path,
        flags=tuple(dict.fromkeys(flags)),
        variables=tuple(dict.fromkeys(variables)),
        description=info.description or "",
        example=str(examples[0]) if examples else "",
        metavar=setting.metavar or _metavar(info.annotation),
        secret=setting.secret,
        empty_refused=setting.empty_refused,
    )


def _merged(found: list[Setting]) -> Setting:
    """The `Setting`s of a field and of the types it is built from, as one."""
    return Setting(
        flags=tuple(flag for each in found for flag in each.flags),
        variables=tuple(name for each in found for name in each.variables),
        metavar=next((each.metavar for each in reversed(found) if each.metavar), ""),
        secret=any(each.secret for each in found),
        empty_refused=any(each.empty_refused for each in found),
    )


def _metavar(annotation: object) -> str:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        inner = [arg for arg in get_args(annotation) if arg is not type(None)]
        return _metavar(inner[0]) if len(inner) == 1 else "VALUE"
    if origin is Literal:
        return "|".join(str(arg) for arg in get_args(annotation))
    names = {int: "N", float: "NUMBER", Path: "PATH", bool: "on|off"}
    return names.get(annotation, "TEXT") if isinstance(annotation, type) else "VALUE"
