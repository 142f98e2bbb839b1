"""What to download from the Hugging Face Hub, and where the Hub is.

A `HubSource` names a model repository (`owner/name`), a revision (a branch, a tag or a
40-hex commit) and optional file patterns. Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from capycommon.errors import InvalidConfig

DEFAULT_ENDPOINT = "https://huggingface.co"

# A Hub name part: letters, digits, `-`, `_` and `.`, at most 96 characters, not starting or
# ending with `-` or `.`; `--` and `..` are forbidden (the Hub's own rules), which also keeps
# the store name `<owner>--<name>@<commit>` unambiguous.
_PART = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def endpoint_from(env: Mapping[str, str]) -> str:
    """The Hub's base URL: `CAPYCTL_HF_ENDPOINT`, else `HF_ENDPOINT`, else huggingface.co.

    An empty value counts as unset; a trailing `/` is dropped."""
    for name in ("CAPYCTL_HF_ENDPOINT", "HF_ENDPOINT"):
        value = env.get(name, "").strip()
        if value:
            if not value.startswith(("http://", "https://")):
                raise InvalidConfig(
                    f"{name}={value!r} is not an http(s) URL; write it like https://huggingface.co"
                )
            return value.rstrip("/")
    return DEFAULT_ENDPOINT


def is_commit(revision: str) -> bool:
    """Whether `revision` is a pinned commit: 40 lowercase hex digits."""
    return _COMMIT.match(revision) is not None


def check_repo(repo: str) -> str:
    """`repo` when it is a valid Hub model id `owner/name`; raises InvalidConfig otherwise."""
    parts = repo.split("/")
    if len(parts) != 2 or not all(
        _PART.match(part) and "--" not in part and ".." not in part for part in parts
    ):
        raise InvalidConfig(
            f"{repo!r} is not a Hugging Face repository id; write it as owner/name (letters, "
            "digits, '-', '_' and '.', at most 96 characters each, no '--' or '..')"
        )
    return repo


def patterns_digest(patterns: tuple[str, ...]) -> str:
    """8 hex digits naming a set of file patterns (their order and repeats do not matter)."""
    joined = "\n".join(sorted(set(patterns)))
    return hashlib.sha256(joined.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class HubSource:
    """A model repository on the Hub at a revision, optionally narrowed to `files` patterns
    (see `selects`)."""

    repo: str
    revision: str = "main"
    files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_repo(self.repo)
        if not self.revision or not self.revision.isprintable() or len(self.revision) > 256:
            raise InvalidConfig(
                f"revision {self.revision!r} of {self.repo} is not a branch, tag or commit"
            )
        if any(not pattern for pattern in self.files):
            raise InvalidConfig(f"an empty file pattern for {self.repo}; remove it")

    @property
    def owner(self) -> str:
        return self.repo.split("/")[0]

    @property
    def name(self) -> str:
        return self.repo.split("/")[1]

    def store_name(self, commit: str) -> str:
        """The store folder's name for this repository at `commit`: `<owner>--<name>@<commit>`
        for the whole repository, and `<owner>--<name>@<commit>-<8 hex>` for the files that
        `files` selects, the hex naming the set of patterns. Two sources of one commit that
        select different files so never share a folder (llama.cpp loads the first GGUF of the
        folder it is given)."""
        if not is_commit(commit):
            raise InvalidConfig(f"{commit!r} is not a 40-hex commit of {self.repo}")
        name = f"{self.owner}--{self.name}@{commit}"
        return f"{name}-{patterns_digest(self.files)}" if self.files else name

    def selects(self, path: str) -> bool:
        """Whether the file at `path` (relative, `/`-separated) is part of the download.

        No patterns select every file. Otherwise a file is selected when one pattern matches
        it with `fnmatch.fnmatchcase`: case-sensitive, `*` and `?` also match `/`, `[...]` is a
        character class; a pattern ending in `/` means everything under that folder
        (`nested/` = `nested/*`). These are the Hub client's `allow_patterns` rules."""
        if not self.files:
            return True
        return any(
            fnmatchcase(path, pattern + "*" if pattern.endswith("/") else pattern)
            for pattern in self.files
        )
