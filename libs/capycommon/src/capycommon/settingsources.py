"""Where settings come from, and who stated each value.

Precedence is fixed here, in `load_settings`: flag > CAPYCTL_* environment > YAML role
document > default. Every layer records who stated each value, so a malformed value is
refused naming its origin, and `capyctl config show` can say where each value came from.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from capycommon.errors import InvalidConfig
from capycommon.settingnames import derived_flag
from capycommon.settings import (
    MODELS,
    AnySettings,
    Role,
    ServerSettings,
    all_setting_specs,
    setting_specs,
)
from capycommon.yamldoc import load_yaml_document


@dataclass
class Layer:
    """One source of values: nested data plus, per dotted path, who stated it."""

    source: Literal["flag", "env", "yaml"]
    data: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)

    def put(self, path: str, value: Any, origin: str) -> None:
        node = self.data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        self.origins[path] = origin

    def origin_of(self, path: str) -> str | None:
        """Who stated `path`, a path enclosing it, or a path inside it."""
        parts = path.split(".")
        for end in range(len(parts), 0, -1):
            origin = self.origins.get(".".join(parts[:end]))
            if origin is not None:
                return origin
        inside = f"{path}."
        return next((o for p, o in self.origins.items() if p.startswith(inside)), None)


@dataclass(frozen=True)
class SettingRow:
    path: str
    value: Any
    source: str
    # The flag, variable or document that stated it; None for a default.
    origin: str | None = None


@dataclass(frozen=True)
class LoadedSettings:
    role: Role
    settings: AnySettings
    document: Path | None
    rows: tuple[SettingRow, ...]


def flag_layer(role: Role, flags: Mapping[str, str | None]) -> Layer:
    """Flags given on the command line (name -> value; None means not given)."""
    specs = setting_specs(role)
    by_flag = {name: spec for spec in specs.values() for name in spec.flags}
    stated: dict[str, list[tuple[str, str]]] = {}
    for name, value in flags.items():
        if value is None:
            continue
        spec = by_flag.get(name)
        if spec is None:
            raise InvalidConfig(unknown_flag(role, name))
        stated.setdefault(spec.path, []).append((name, value))
    layer = Layer("flag")
    for path, given in stated.items():
        layer.put(path, *_agreed(path, given))
    return layer


def unknown_flag(role: Role, name: str) -> str:
    """Why `name` is no flag of `role`'s settings, and what to do instead."""
    for spec in all_setting_specs().values():
        if name in spec.flags:
            return f"{name} does not apply to the {role} role; drop it"
        if spec.secret and name == derived_flag(spec.path):
            return (
                f"{spec.path} never comes from a flag (it may hold a secret); set "
                f"{spec.variable} or {spec.path} in the role document"
            )
    known = [flag for spec in setting_specs(role).values() for flag in spec.flags]
    # `--max-parked` is most likely the end of a setting's path; else the closest spelling.
    ends = [flag for flag in known if flag.endswith(f"-{name.lstrip('-')}")]
    close = ends[:1] if len(ends) == 1 else difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown flag {name} for the {role} role{hint} (--help lists every flag)"


def env_layer(role: Role, env: Mapping[str, str]) -> Layer:
    """The CAPYCTL_* variables of `role`'s settings; an empty one counts as unset, except
    where the setting refuses it."""
    layer = Layer("env")
    for spec in setting_specs(role).values():
        given = []
        for name in spec.variables:
            value = env.get(name)
            if value is None:
                continue
            if value == "":
                if spec.empty_refused:
                    raise InvalidConfig(
                        f"{name} is set but empty; give it a value (for example "
                        f"{name}={spec.example}) or unset it"
                    )
                continue
            given.append((name, value))
        if given:
            layer.put(spec.path, *_agreed(spec.path, given))
    return layer


def _agreed(path: str, given: list[tuple[str, str]]) -> tuple[str, str]:
    """The value of a setting stated under several names, which must agree."""
    first_name, first = given[0]
    for name, value in given[1:]:
        if value != first:
            raise InvalidConfig(
                f"{first_name} and {name} both set {path}, to {first!r} and {value!r}; "
                "give one of them"
            )
    return first, first_name


def yaml_layer(role: Role, path: Path | None) -> Layer:
    """The role document's values; `kind`, when present, must name the role."""
    layer = Layer("yaml")
    if path is None:
        return layer
    document = load_yaml_document(path)
    if document is None:
        return layer
    if not isinstance(document, dict):
        raise InvalidConfig(f"{path} must be a mapping of settings, not {type(document).__name__}")
    kind = document.pop("kind", role)
    if kind != role:
        raise InvalidConfig(f"{path} is a {kind!r} document; the {role} role needs kind: {role}")
    for dotted, value in _leaves(document):
        layer.put(dotted, value, str(path))
    return layer


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{dotted}.")
        else:
            yield dotted, value


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_settings(
    role: Role,
    *,
    document: Path | None,
    env: Mapping[str, str],
    flags: Mapping[str, str | None] | None = None,
) -> LoadedSettings:
    """Build a role's settings: flag > CAPYCTL_* environment > YAML document > default."""
    layers = [flag_layer(role, flags or {}), env_layer(role, env), yaml_layer(role, document)]
    merged: dict[str, Any] = {}
    for layer in reversed(layers):  # lowest precedence first, so later ones win
        merged = _merge(merged, layer.data)
    try:
        settings = MODELS[role](**merged)
    except ValidationError as exc:
        raise InvalidConfig(_explain(exc, layers)) from None
    rows = []
    for path, value in _leaves(settings.model_dump(mode="json", exclude={"kind"})):
        stated = next((layer for layer in layers if path in layer.origins), None)
        if stated is None:
            rows.append(SettingRow(path, value, "default"))
        else:
            rows.append(SettingRow(path, value, stated.source, stated.origins[path]))
    _check_embedded_host(settings, rows)
    return LoadedSettings(role, settings, document, tuple(rows))


def _check_embedded_host(settings: AnySettings, rows: list[SettingRow]) -> None:
    """A server's host settings, set by a flag or its document to other than their defaults,
    need `host.embedded: on`: without it they would be ignored, and the server runs no
    engine. (The environment is shared with other roles on the machine, so its variables are
    not held against it.)"""
    if not isinstance(settings, ServerSettings) or settings.host.embedded == "on":
        return
    defaults = dict(_leaves({"host": type(settings.host)().model_dump(mode="json")}))
    for row in rows:
        stated = row.source in ("flag", "yaml") and row.value != defaults.get(row.path)
        if row.path.startswith("host.") and stated:
            raise InvalidConfig(
                f"{row.origin} sets {row.path}, which applies to a server only with an "
                "embedded host; add --embedded-host on (host.embedded: on), or drop it"
            )


def _explain(exc: ValidationError, layers: list[Layer]) -> str:
    problems = []
    for error in exc.errors():
        path = ".".join(str(part) for part in error["loc"])
        layer, origin = next(
            ((layer, found) for layer in layers if (found := layer.origin_of(path)) is not None),
            (None, "a default"),
        )
        reason = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            problems.append(f"{origin}: unknown key {path!r}; remove it or correct its spelling")
        elif layer is not None and layer.source == "yaml":
            problems.append(f"{origin}: {path} = {error['input']!r}: {reason}")
        else:
            problems.append(f"{origin} sets {path} to {error['input']!r}: {reason}")
    return "; ".join(problems)


def locate_document(explicit: str | None, env: Mapping[str, str], implicit: Path) -> Path | None:
    """The role document: --config, else CAPYCTL_CONFIG, else the implicit one if present.

    An explicit document that is missing is an error; it is never generated or replaced.
    """
    named = explicit or env.get("CAPYCTL_CONFIG") or None
    if named is None:
        return implicit if implicit.exists() else None
    path = Path(named).expanduser().absolute()
    if not path.is_file():
        who = "--config" if explicit else "CAPYCTL_CONFIG"
        raise InvalidConfig(f"{who} names {path}, which is not a file; fix the path")
    return path
