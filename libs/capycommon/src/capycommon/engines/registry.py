"""engines.yaml: the engines registered on this machine.

Written only by `capyctl engine add|remove`, atomically and under a lock. It lives beside the
role document, else in ~/.config/capyctl/; the first line carries the document revision.
"""

from __future__ import annotations

import fcntl
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from capycommon.domain.strict import Strict
from capycommon.engines import template
from capycommon.engines.families import Family, check_supported, is_verified
from capycommon.errors import InvalidConfig, ProfileExists, ProfileNotFound
from capycommon.paths import write_atomic
from capycommon.yamldoc import parse_yaml

FILE_NAME = "engines.yaml"
REVISION_PREFIX = "# capyctl-document-revision: "

ProfileName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")]
# A custom engine's: the argv template (`engines.custom`), the path that answers 200 once it
# is ready, and the variable it reads its API key from.
CommandWord = Annotated[str, Field(min_length=1, max_length=4096)]
ReadyPath = Annotated[str, Field(pattern=r"^/[A-Za-z0-9._~/%?=&{}-]{0,199}$")]
KeyVariable = Annotated[str, Field(pattern=r"^[A-Z_][A-Z0-9_]{0,63}$")]


class EngineProfile(Strict):
    """One registered engine installation."""

    name: ProfileName
    family: Family
    version: str
    # The program that starts the engine: the venv's python for vLLM and SGLang,
    # the llama-server binary for llama.cpp.
    executable: Path
    # The virtual environment, or the llama-server binary.
    install_path: Path
    # The version plus a digest of the installed files: `0.29.0+sha256:<hex>`.
    fingerprint: str
    verified: bool
    added_at: datetime
    # A custom engine's start (family custom only; the others' adapters know theirs).
    command: tuple[CommandWord, ...] = Field(default=(), max_length=256)
    ready_path: ReadyPath | None = None
    key_env: KeyVariable | None = None

    @model_validator(mode="after")
    def _custom_fields(self) -> EngineProfile:
        if self.family != Family.CUSTOM:
            if self.command or self.ready_path is not None or self.key_env is not None:
                raise ValueError(
                    "command, ready_path and key_env are for custom engines only; drop them"
                )
            return self
        template.check(self.command, self.executable, self.key_env)
        if self.ready_path is None:
            raise ValueError(
                "a custom engine needs ready_path, the path that answers 200 once ready"
            )
        template.check_ready_path(self.ready_path)
        return self


class PublishedEngines(Strict):
    """The registry as a host publishes it: its profiles at one revision of its file."""

    revision: int
    source: str
    profiles: list[EngineProfile]


class EnginesDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    kind: Literal["engines"] = "engines"
    profiles: dict[str, EngineProfile] = Field(default_factory=dict)


class Registry(BaseModel):
    """The document and its revision, as read from one file."""

    path: Path
    revision: int
    document: EnginesDocument


def locate(document: Path | None, home: Path) -> Path:
    """Where engines.yaml is: beside the role document, else ~/.config/capyctl/.

    An existing file wins, so registering before and after the first start of a role finds
    the same file.
    """
    beside = document.parent / FILE_NAME if document is not None else None
    fallback = home / ".config" / "capyctl" / FILE_NAME
    if beside is not None and beside.exists():
        return beside
    if fallback.exists() or beside is None:
        return fallback
    return beside


def read(path: Path) -> Registry:
    if not path.exists():
        return Registry(path=path, revision=0, document=EnginesDocument())
    text = path.read_text(encoding="utf-8")
    match = re.match(rf"{re.escape(REVISION_PREFIX)}(\d+)\n", text)
    revision = int(match[1]) if match else 0
    data = parse_yaml(text, str(path)) or {}
    try:
        document = EnginesDocument.model_validate(data)
    except ValidationError as exc:
        raise InvalidConfig(
            f"{path} is not a valid engines document ({exc}); fix it or remove the entry"
        ) from None
    for key, profile in document.profiles.items():
        if key != profile.name:
            raise InvalidConfig(
                f"{path}: profile {key!r} is named {profile.name!r}; make them equal"
            )
    return Registry(path=path, revision=revision, document=document)


def _write(registry: Registry) -> None:
    data = registry.document.model_dump(mode="json")
    body = yaml.safe_dump(data, sort_keys=False)
    write_atomic(registry.path, f"{REVISION_PREFIX}{registry.revision}\n{body}", mode=0o600)


@contextmanager
def locked(path: Path) -> Iterator[Registry]:
    """Read the registry under its lock; write it back (revision + 1) if the block changed it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        registry = read(path)
        before = registry.document.model_dump()
        yield registry
        if registry.document.model_dump() != before:
            registry.revision += 1
            _write(registry)


def add(path: Path, profile: EngineProfile) -> Registry:
    with locked(path) as registry:
        if profile.name in registry.document.profiles:
            taken = registry.document.profiles[profile.name]
            raise ProfileExists(
                f"an engine named {profile.name!r} is already registered ({taken.family} "
                f"{taken.version} at {taken.install_path}); choose another with --name"
            )
        registry.document.profiles[profile.name] = profile
    return registry


def remove(path: Path, name: str) -> Registry:
    with locked(path) as registry:
        if name not in registry.document.profiles:
            known = ", ".join(sorted(registry.document.profiles)) or "none"
            raise ProfileNotFound(f"no engine named {name!r} is registered (registered: {known})")
        del registry.document.profiles[name]
    return registry


def profile_from(
    family: Family,
    version: str,
    executable: Path,
    install_path: Path,
    fingerprint: str,
    name: str | None = None,
    now: datetime | None = None,
) -> EngineProfile:
    """A profile for an installation that described itself; refuses unsupported versions."""
    check_supported(family, version)
    return EngineProfile(
        name=name or family.value,
        family=family,
        version=version,
        executable=executable,
        install_path=install_path,
        fingerprint=fingerprint,
        verified=is_verified(family, version),
        added_at=now or datetime.now(UTC),
    )
