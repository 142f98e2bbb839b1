"""The local model store: where downloads land, partial files, the manifest, the disk check.

Layout under `<models_root>/sources/`:

- `huggingface/<owner>--<name>@<commit>/`: a complete store, read-only (files 0444, folders
  0555), with `.capyctl-manifest.json`. It appears in one rename, so a folder of that name
  with a manifest is complete. Names starting with `.` in `huggingface/` are never stores
  (they are trees being built).
- `.capyctl/partial/<owner>--<name>@<commit>/<path>.partial`: bytes downloaded so far, kept
  across runs so a later run resumes them; `.capyctl/` is private (0700).
- `.capyctl/locks/<owner>--<name>@<commit>.lock`: held while a process downloads that store.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from capycommon.errors import InvalidConfig
from capycommon.hub.errors import DiskFull, HfIntegrity
from capycommon.hub.integrity import Expected
from capycommon.hub.source import HubSource
from capycommon.units import format_size

MANIFEST = ".capyctl-manifest.json"
# What the Hub's own client keeps inside a model folder: never part of a model.
_HF_CACHE = (".cache", "huggingface")
RESERVE_BYTES = 1 << 30
# A file's partial download is `<path>.partial`: with that suffix, each part of a listed path
# must fit a file system's 255-byte name; the whole path stays far below PATH_MAX.
PARTIAL = ".partial"
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 1024


@dataclass(frozen=True)
class Plan:
    """The files of one download, as the Hub lists them at `commit`."""

    source: HubSource
    commit: str
    files: tuple[Expected, ...]

    @property
    def total_size(self) -> int:
        return sum(file.size for file in self.files)


@dataclass(frozen=True)
class StorePaths:
    """Where one repository at one commit lives under a models root."""

    root: Path
    name: str

    @classmethod
    def of(cls, models_root: Path, source: HubSource, commit: str) -> StorePaths:
        return cls(models_root / "sources", source.store_name(commit))

    @property
    def store(self) -> Path:
        return self.root / "huggingface" / self.name

    @property
    def manifest(self) -> Path:
        return self.store / MANIFEST

    @property
    def private(self) -> Path:
        return self.root / ".capyctl"

    @property
    def partial_dir(self) -> Path:
        return self.private / "partial" / self.name

    @property
    def lock(self) -> Path:
        return self.private / "locks" / f"{self.name}.lock"

    def partial(self, path: str) -> Path:
        return self.partial_dir / f"{path}{PARTIAL}"

    def staging(self) -> Path:
        return self.store.parent / f".{self.name}.staging-{os.getpid()}"

    def stale_stagings(self) -> list[Path]:
        """Staging folders of this store left by a process that stopped half way."""
        return sorted(self.store.parent.glob(f".{self.name}.staging-*"))

    def complete(self) -> bool:
        return self.manifest.is_file()


def make_private(folder: Path) -> None:
    """Creates `folder` and its missing parents as 0700 folders (under `sources/.capyctl`,
    which `StorePaths.private` names, they hold what only this user may read)."""
    missing = []
    while not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir(mode=0o700, exist_ok=True)
        path.chmod(0o700)


def safe_path(path: str, repo: str) -> str:
    """`path` when it is a plain relative path inside the repository that fits on disk; a Hub
    that lists `../x`, `/x`, an empty part or a name no file system holds is not trusted with
    our disk."""
    parts = PurePosixPath(path).parts
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or "\0" in path
        or any(part in ("", ".", "..") for part in path.split("/"))
        or not parts
    ):
        raise HfIntegrity(f"the Hub lists a file {path!r} in {repo} that is not a relative path")
    try:
        on_disk = f"{path}{PARTIAL}".encode()
    except UnicodeEncodeError:
        raise HfIntegrity(f"the Hub lists a file {path!r} in {repo} that is not UTF-8") from None
    if len(on_disk) > MAX_PATH_BYTES or any(
        len(part) > MAX_NAME_BYTES for part in on_disk.split(b"/")
    ):
        raise HfIntegrity(
            f"the Hub lists a file {path!r} in {repo} whose name is longer than a file system "
            f"holds ({MAX_NAME_BYTES} bytes a name with the {PARTIAL} suffix of its download, "
            f"{MAX_PATH_BYTES} bytes a path); no model needs one, and nothing was downloaded"
        )
    return path


def in_store(path: str) -> bool:
    """Whether a listed file belongs in the store: not the Hub client's own `.cache/huggingface/`
    folder, and not our manifest's name."""
    parts = tuple(path.split("/"))
    return parts[:2] != _HF_CACHE and path != MANIFEST


def plan_from_tree(source: HubSource, commit: str, entries: Iterable[Mapping[str, Any]]) -> Plan:
    """The files of the tree listing `entries` that `source` selects (see `HubSource.selects`),
    sorted by path. Folders are skipped; so are `.cache/huggingface/` and a file named like our
    manifest. An entry without a size or identity fails: the Hub broke its contract; so does a
    listing no git tree makes (a path twice, or both a file and a folder)."""
    files: dict[str, Expected] = {}
    listed: list[str] = []
    folders: set[str] = set()
    for entry in entries:
        if entry.get("type") == "directory":
            folders.add(str(entry.get("path")))
        if entry.get("type") != "file":
            continue
        expected = _expected(entry, source, commit)
        listed.append(expected.path)
        if in_store(expected.path) and source.selects(expected.path):
            files[expected.path] = expected
    _check_tree(listed, folders, source, commit)
    return Plan(source, commit, tuple(files[path] for path in sorted(files)))


def _expected(entry: Mapping[str, Any], source: HubSource, commit: str) -> Expected:
    """A file entry of the tree listing, checked."""
    try:
        path = safe_path(str(entry["path"]), source.repo)
        lfs = entry.get("lfs")
        if isinstance(lfs, Mapping):
            expected = Expected(path, int(lfs["size"]), str(lfs["oid"]).lower(), lfs=True)
        else:
            expected = Expected(path, int(entry["size"]), str(entry["oid"]).lower(), lfs=False)
    except (KeyError, TypeError, ValueError) as exc:
        raise HfIntegrity(
            f"the Hub's tree listing of {source.repo}@{commit} has an entry without its "
            f"{exc}: {dict(entry)!r}; is the endpoint a Hugging Face Hub?"
        ) from None
    if expected.size < 0:
        raise HfIntegrity(f"the Hub lists {path} in {source.repo} with a negative size")
    return expected


def _check_tree(listed: list[str], folders: set[str], source: HubSource, commit: str) -> None:
    """Refuses a listing no git tree makes, which could not be stored either: a path listed
    twice, or a path that is both a file and a folder (a listed folder, or the folder of
    another listed file)."""
    twice = sorted(path for path, count in Counter(listed).items() if count > 1)
    parents = {
        "/".join(parts[:depth])
        for parts in (path.split("/") for path in listed)
        for depth in range(1, len(parts))
    }
    both = sorted(set(listed) & (folders | parents))
    if not twice and not both:
        return
    problem = f"lists {twice[0]!r} twice" if twice else f"lists {both[0]!r} as a file and a folder"
    raise HfIntegrity(
        f"the Hub's tree listing of {source.repo}@{commit} {problem}, which no git tree holds; "
        "nothing was downloaded: is the endpoint a Hugging Face Hub, or a mirror that serves "
        "another listing?"
    )


def partial_bytes(paths: StorePaths, plan: Plan) -> int:
    """Bytes already downloaded for `plan` (partial files no longer than their file)."""
    done = 0
    for file in plan.files:
        try:
            size = paths.partial(file.path).stat().st_size
        except FileNotFoundError:
            continue
        if size <= file.size:
            done += size
    return done


def check_room(
    needed: int, folder: Path, *, reserve: int = RESERVE_BYTES, free: int | None = None
) -> None:
    """Refuses a download of `needed` more bytes into `folder`'s filesystem unless `reserve`
    bytes stay free after it. `free` stands in for the filesystem's free space (tests)."""
    if free is None:
        free = shutil.disk_usage(folder).free
    if needed + reserve > free:
        raise DiskFull(
            f"the download needs {format_size(needed)} more (plus {format_size(reserve)} kept "
            f"free) but the filesystem of {folder} has {format_size(free)} free; free space there "
            "or choose files with the source's `files` patterns"
        )


@dataclass(frozen=True)
class Stored:
    """A verified file: its path in the store, size and sha256."""

    path: str
    size: int
    sha256: str


def write_manifest(folder: Path, plan: Plan, files: Iterable[Stored]) -> None:
    """Writes `folder/.capyctl-manifest.json`: the repository, the commit and every file's size
    and sha256, sorted by path."""
    body = {
        "format": 1,
        "source": "huggingface",
        "repo": plan.source.repo,
        "commit": plan.commit,
        "files": [
            {"path": file.path, "size": file.size, "sha256": file.sha256}
            for file in sorted(files, key=lambda file: file.path)
            if in_store(file.path)
        ],
    }
    (folder / MANIFEST).write_text(json.dumps(body, indent=1) + "\n")


def read_manifest(store: Path) -> dict[str, Any]:
    """The manifest of a complete store."""
    try:
        body = json.loads((store / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{store / MANIFEST} cannot be read ({exc}); remove {store}") from None
    if not isinstance(body, dict):
        raise InvalidConfig(f"{store / MANIFEST} is not a manifest; remove {store}")
    return body


def make_read_only(folder: Path) -> None:
    """Files 0444 and folders 0555, `folder` included, deepest first."""
    for dirpath, dirnames, filenames in os.walk(folder, topdown=False):
        for filename in filenames:
            os.chmod(os.path.join(dirpath, filename), 0o444)
        for dirname in dirnames:
            path = os.path.join(dirpath, dirname)
            os.chmod(path, 0o555)  # noqa: S103 - engines of other users read the models
    folder.chmod(0o555)


def remove_tree(folder: Path) -> None:
    """Removes `folder` even when it was made read-only."""
    if not folder.exists():
        return
    for dirpath, _dirnames, _filenames in os.walk(folder):
        os.chmod(dirpath, stat.S_IRWXU)
    shutil.rmtree(folder)


def commit_store(paths: StorePaths, plan: Plan, files: Iterable[Stored]) -> Path:
    """Moves the verified partial files into the store in one rename: they are renamed into a
    sibling staging folder, which gets the manifest and is made read-only, and then renamed to
    the store's name. The partial folder is removed after. The caller holds the store's lock."""
    for stale in paths.stale_stagings():  # the caller holds the store's lock
        remove_tree(stale)
    staging = paths.staging()
    staging.mkdir(parents=True)
    try:
        for file in plan.files:
            target = staging / file.path
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(paths.partial(file.path), target)
        write_manifest(staging, plan, files)
        make_read_only(staging)
        os.rename(staging, paths.store)
    except BaseException:
        remove_tree(staging)  # the partial files it took are downloaded again
        raise
    shutil.rmtree(paths.partial_dir, ignore_errors=True)
    return paths.store
