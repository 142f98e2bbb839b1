"""A custom engine's command template: the argv its registration gives, with placeholders
CapyCTL fills at each launch. No shell ever reads it: each word is one argument.

Placeholders: `{port}` and `{model}` must appear; `{served_name}` (the name requests carry)
and `{host}` (the loopback address) may. Braces meant literally are doubled, as in Python's
`str.format`: `{{` and `}}`. The readiness path may name `{served_name}` (an engine that
answers `/v1/models/<name>` only once that model is loaded).
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

PLACEHOLDERS = ("port", "model", "served_name", "host")
REQUIRED = ("port", "model")
# Variables the closed environment sets itself: a key there would be overwritten, or would
# redirect what the engine runs.
CLOSED = frozenset(
    {"PATH", "HOME", "LANG", "PYTHONUNBUFFERED", "PYTHONPATH", "CUDA_VISIBLE_DEVICES"}
)
CLOSED_PREFIXES = ("CAPYCTL_", "LD_", "HF_", "TRANSFORMERS_", "DO_NOT_TRACK")


def fields_of(word: str) -> list[str]:
    """The placeholders a word names; ValueError naming the word where one is unknown or a
    brace is left open."""
    try:
        names = [name for _, name, spec, _ in string.Formatter().parse(word) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{word!r}: {exc}; write a literal brace as {{{{ or }}}}") from None
    for name in names:
        if name not in PLACEHOLDERS:
            known = ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
            raise ValueError(f"{word!r} names {{{name}}}, which is not a placeholder ({known})")
    return names


def check(command: Sequence[str], executable: Path, key_env: str | None) -> None:
    """ValueError naming the problem where the template cannot start an engine safely."""
    if not command:
        raise ValueError("a custom engine needs its command, with {port} and {model}")
    if fields_of(command[0]):
        raise ValueError(f"the program {command[0]!r} holds a placeholder; name it plainly")
    if not Path(command[0]).is_absolute() or Path(command[0]) != executable:
        raise ValueError(
            f"the program {command[0]!r} must be an absolute path, the profile's executable"
        )
    named = {name for word in command for name in fields_of(word)}
    missing = [f"{{{name}}}" for name in REQUIRED if name not in named]
    if missing:
        raise ValueError(
            f"the command never names {' or '.join(missing)}: CapyCTL gives each launch its "
            "port and model there"
        )
    if key_env is not None and (key_env in CLOSED or key_env.startswith(CLOSED_PREFIXES)):
        raise ValueError(f"key_env {key_env} is a variable CapyCTL sets itself; name another")


def check_ready_path(path: str) -> None:
    named = fields_of(path)
    if any(name != "served_name" for name in named):
        raise ValueError(f"ready_path {path!r} may name {{served_name}} alone")


def ready_path(path: str, served_name: str) -> str:
    """The readiness path of one launch."""
    return path.format_map({"served_name": quote(served_name, safe="")})


def render(command: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """The argv of one launch: each word with its placeholders filled."""
    return [word.format_map(values) for word in command]
