"""The model store: plans from tree listings, the disk check, the manifest and the read-only
tree that appears in one rename."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from capycommon.hub import HubSource, StorePaths, read_manifest
from capycommon.hub.errors import DiskFull, HfIntegrity
from capycommon.hub.integrity import git_blob_sha1
from capycommon.hub.store import (
    MAX_NAME_BYTES,
    Stored,
    check_room,
    commit_store,
    partial_bytes,
    plan_from_tree,
    remove_tree,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = b'{"model_type": "tiny"}\n'
WEIGHTS = bytes(range(256)) * 64


def tree() -> list[dict[str, Any]]:
    sha = hashlib.sha256(WEIGHTS).hexdigest()
    return [
        {"type": "file", "path": "config.json", "size": len(CONFIG), "oid": git_blob_sha1(CONFIG)},
        {"type": "directory", "path": "nested", "oid": "d" * 40},
        {
            "type": "file",
            "path": "model.safetensors",
            "size": 134,
            "oid": "e" * 40,
            "lfs": {"oid": sha, "size": len(WEIGHTS), "pointerSize": 134},
        },
        {
            "type": "file",
            "path": ".cache/huggingface/download/x.metadata",
            "size": 3,
            "oid": "f" * 40,
        },
        {"type": "file", "path": ".capyctl-manifest.json", "size": 2, "oid": "a" * 40},
    ]


def test_a_plan_keeps_selected_files_with_their_identities() -> None:
    plan = plan_from_tree(HubSource("acme/tiny", COMMIT), COMMIT, tree())
    assert [(f.path, f.size, f.lfs) for f in plan.files] == [
        ("config.json", len(CONFIG), False),
        ("model.safetensors", len(WEIGHTS), True),
    ]
    assert plan.files[1].oid == hashlib.sha256(WEIGHTS).hexdigest()
    assert plan.total_size == len(CONFIG) + len(WEIGHTS)
    only = plan_from_tree(HubSource("acme/tiny", COMMIT, ("*.json",)), COMMIT, tree())
    assert [f.path for f in only.files] == ["config.json"]


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a//b", "a/./b", "a\\b"])
def test_a_listed_path_outside_the_repository_is_refused(path: str) -> None:
    entry = {"type": "file", "path": path, "size": 1, "oid": "a" * 40}
    with pytest.raises(HfIntegrity, match="not a relative path"):
        plan_from_tree(HubSource("acme/tiny", COMMIT), COMMIT, [entry])


def _file(path: str) -> dict[str, Any]:
    return {"type": "file", "path": path, "size": 1, "oid": "a" * 40}


LONGEST = "n" * (MAX_NAME_BYTES - len(".partial"))
UNFIT = {
    "a name over 255 bytes": "w" * 300,
    "a name that with .partial is over 255 bytes": LONGEST + "x",
    "a folder's name over 255 bytes": "d" * 256 + "/model.safetensors",
    "a path over 1024 bytes": "/".join(["f" * 200] * 6),
}


@pytest.mark.parametrize("path", UNFIT.values(), ids=UNFIT.keys())
def test_a_name_no_file_system_holds_is_refused(path: str) -> None:
    with pytest.raises(HfIntegrity) as caught:
        plan_from_tree(HubSource("acme/tiny", COMMIT), COMMIT, [_file(path)])
    assert f"lists a file {path!r} in acme/tiny whose name is longer" in caught.value.message


def test_the_longest_name_that_fits_is_kept() -> None:
    plan = plan_from_tree(HubSource("acme/tiny", COMMIT), COMMIT, [_file(f"d/{LONGEST}")])
    assert [f.path for f in plan.files] == [f"d/{LONGEST}"]


CLASHES = {
    "a file and a listed folder": ([_file("x"), {"type": "directory", "path": "x"}], "'x'"),
    "a file and another file's folder": ([_file("a/b"), _file("a/b/c")], "'a/b'"),
    "a file and a deeper file's folder": ([_file("a"), _file("a/b/c")], "'a'"),
}


@pytest.mark.parametrize(("entries", "path"), CLASHES.values(), ids=CLASHES.keys())
def test_a_path_both_a_file_and_a_folder_is_refused(
    entries: list[dict[str, Any]], path: str
) -> None:
    """Even where the choice of files keeps only one of them: no git tree lists both."""
    with pytest.raises(HfIntegrity) as caught:
        plan_from_tree(HubSource("acme/tiny", COMMIT, ("*.json",)), COMMIT, entries)
    assert f"of acme/tiny@{COMMIT} lists {path} as a file and a folder" in caught.value.message


def test_a_path_listed_twice_is_refused() -> None:
    with pytest.raises(HfIntegrity, match="lists 'x' twice, which no git tree holds"):
        plan_from_tree(HubSource("acme/tiny", COMMIT), COMMIT, [_file("x"), _file("x")])


def test_a_store_that_cannot_be_built_leaves_no_staging_folder(tmp_path: Path) -> None:
    """A partial file gone before the move (here: never written) fails the commit, which
    removes what it had built."""
    plan = plan_from_tree(HubSource("acme/tiny"), COMMIT, tree())
    paths = StorePaths.of(tmp_path, plan.source, COMMIT)
    paths.partial("config.json").parent.mkdir(parents=True)
    paths.partial("config.json").write_bytes(CONFIG)
    with pytest.raises(FileNotFoundError):
        commit_store(paths, plan, [])
    assert list(paths.store.parent.iterdir()) == []


def test_an_entry_without_a_size_is_the_hub_breaking_its_contract() -> None:
    with pytest.raises(HfIntegrity, match="without its 'size'"):
        plan_from_tree(HubSource("acme/tiny"), COMMIT, [{"type": "file", "path": "x", "oid": "a"}])


def test_the_disk_check_names_both_figures() -> None:
    check_room(1 << 30, Path("/"), free=(2 << 30) + 1)
    with pytest.raises(DiskFull) as caught:
        check_room(3 << 30, Path("/"), free=(3 << 30) + (512 << 20))
    assert "needs 3.0 GiB more (plus 1.0 GiB kept free)" in caught.value.message
    assert "has 3.5 GiB free" in caught.value.message
    assert (caught.value.code, caught.value.exit_code) == ("disk_full", 4)


def test_bytes_already_in_partial_files_count_as_done(tmp_path: Path) -> None:
    plan = plan_from_tree(HubSource("acme/tiny"), COMMIT, tree())
    paths = StorePaths.of(tmp_path, plan.source, COMMIT)
    paths.partial("model.safetensors").parent.mkdir(parents=True)
    paths.partial("model.safetensors").write_bytes(WEIGHTS[:1000])
    paths.partial("config.json").write_bytes(CONFIG * 2)  # longer than the file: starts over
    assert partial_bytes(paths, plan) == 1000


def test_a_committed_store_is_read_only_with_a_manifest_of_every_file(tmp_path: Path) -> None:
    plan = plan_from_tree(HubSource("acme/tiny"), COMMIT, tree())
    paths = StorePaths.of(tmp_path, plan.source, COMMIT)
    stored = []
    for name, content in (("config.json", CONFIG), ("model.safetensors", WEIGHTS)):
        paths.partial(name).parent.mkdir(parents=True, exist_ok=True)
        paths.partial(name).write_bytes(content)
        stored.append(Stored(name, len(content), hashlib.sha256(content).hexdigest()))
    store = commit_store(paths, plan, stored)
    assert store == tmp_path / "sources" / "huggingface" / f"acme--tiny@{COMMIT}"
    assert (store / "model.safetensors").read_bytes() == WEIGHTS
    assert not paths.partial_dir.exists()
    assert [p.name for p in store.parent.iterdir()] == [store.name]  # no staging left
    manifest = read_manifest(store)
    assert (manifest["repo"], manifest["commit"]) == ("acme/tiny", COMMIT)
    assert manifest["files"] == [
        {"path": s.path, "size": s.size, "sha256": s.sha256} for s in stored
    ]
    assert json.loads((store / ".capyctl-manifest.json").read_text()) == manifest
    for dirpath, _dirnames, filenames in os.walk(store):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o555
        for name in filenames:
            assert stat.S_IMODE(os.stat(os.path.join(dirpath, name)).st_mode) == 0o444
    remove_tree(store)
    assert not store.exists()
