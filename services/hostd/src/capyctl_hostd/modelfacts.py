"""The host's models as facts for the control plane (`capycommon.state.hostfacts`).

hostd publishes what the scheduler needs to resolve deployments here: every model under the
models root (a folder holding `config.json` or weights, or a weights file, up to two levels
down), and each path the scheduler asked it to describe (`commands.Describe`: a folder
outside the root, or a name the root's listing did not show). It publishes when it starts,
when it is asked, and when a look every few seconds finds something changed.

Looking stays cheap and safe. The walk of the models root never follows a link (a linked
model is described once a deployment names it, like any path); only small regular files are
read (`config.json`, `hf_quant_config.json`, at most 4 MiB each; never a FIFO or a device);
weights are only stat'ed, except a GGUF's header, whose metadata may declare a decision
model (`capycommon.gguf`: read once per file version, never past its metadata). Files a
model folder links to (a Hugging Face snapshot links its files to blobs) count when they are
regular files, as the engine would load them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from capycommon import gguf
from capycommon.deployments.resolve import HUB_STORE
from capycommon.domain.commands import Describe, HubPull
from capycommon.domain.models import (
    WEIGHT_SUFFIXES,
    DecisionHead,
    HostModels,
    ModelFacts,
    QuantizationConfig,
    weights_of,
)
from capycommon.engines.llamacpp import model_file
from capycommon.errors import CapyError
from capycommon.hub import MANIFEST, HubAccess, HubLimits, HubSource, hub_access, listed_weights
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state.stores import State

log = logging.getLogger(__name__)

# How often hostd looks at its models again.
RESCAN_S = 5.0
# The Hub's file listing of a store not downloaded yet: bounds, and when a failed one is asked
# for again.
LISTING_LIMITS = HubLimits(connect_timeout_s=5.0, read_timeout_s=10.0, attempts=2)
LISTING_TIMEOUT_S = 30.0
LISTING_RETRY_S = 60.0
# The largest config file read (they are a few KiB; anything bigger is not one).
MAX_CONFIG_BYTES = 4 << 20
# How deep under the models root a model is looked for: `<root>/<name>`, `<root>/<org>/<name>`.
SCAN_DEPTH = 2
# Bounds on what one record holds.
MAX_MODELS = 1024
MAX_DESCRIBED = 256
MAX_TEXT = 256
MAX_ARCHITECTURES = 16
# A folder's decision-head files (`DecisionHead`).
DECISION_CONFIG = "decision_config.json"
JOINT_HEAD = ("joint_head_config.json", "joint_head.safetensors")
# GGUF headers read: by (path, inode, size, mtime), the decision type each declares.
MAX_GGUF_READS = 1024
_gguf_reads: dict[tuple[str, int, int, int], str | None] = {}


def locate(written: str, root: Path) -> Path | None:
    """Where a deployment's model path is on this host: under `root` unless it is absolute
    or `~/...`; None for `~user/...` when that user has no home here."""
    if written.startswith("~"):
        try:
            return Path(written).expanduser()
        except RuntimeError:
            return None
    path = Path(written)
    return path if path.is_absolute() else root / path


def describe(path: Path) -> ModelFacts:
    """The facts of one model path (the path itself may be a link, as a named path is)."""
    try:
        info = path.stat()
    except (OSError, ValueError):
        return ModelFacts(path=str(path), kind="missing")
    if stat.S_ISREG(info.st_mode):
        weights = info.st_size if path.suffix in WEIGHT_SUFFIXES else None
        return ModelFacts(
            path=str(path), kind="file", weights_bytes=weights, decision=_gguf_head(path)
        )
    if not stat.S_ISDIR(info.st_mode):
        return ModelFacts(path=str(path), kind="other")
    config = _small_json(path / "config.json") or {}
    return ModelFacts(
        path=str(path),
        kind="folder",
        weights_bytes=_weights(path),
        architectures=_architectures(config.get("architectures")),
        dtype=_text(config.get("dtype") or config.get("torch_dtype")) or None,
        quantization=_quantization(config, _small_json(path / "hf_quant_config.json")),
        attention_heads=_heads(config, "num_attention_heads"),
        kv_heads=_heads(config, "num_key_value_heads"),
        decision=_folder_head(path),
    )


def scan(root: Path) -> dict[str, ModelFacts]:
    """The models under `root` by their name there (`Qwen3-8B`, `org/name`, `one.gguf`,
    `sources/huggingface/org--name@<commit>`)."""
    found: dict[str, ModelFacts] = {}
    _walk(root, root, 1, found)
    # Downloads from the Hub: each complete store, `sources/huggingface/<org>--<name>@<commit>`.
    for entry in _entries(root / HUB_STORE):
        if len(found) >= MAX_MODELS:
            break
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False) and (path / MANIFEST).is_file():
            found[f"{HUB_STORE}/{entry.name}"] = describe(path)
    return found


def survey(root: Path, paths: Iterable[str]) -> HostModels:
    """The record hostd publishes: the root's models, and each path asked for."""
    described = {}
    for written in paths:
        where = locate(written, root)
        described[written] = (
            describe(where) if where is not None else ModelFacts(path=written, kind="no_home")
        )
    return HostModels(models_root=str(root), models=scan(root), described=described)


def _walk(root: Path, folder: Path, depth: int, found: dict[str, ModelFacts]) -> None:
    for entry in _entries(folder):
        if len(found) >= MAX_MODELS:
            return
        if entry.name.startswith(".") or entry.is_symlink():
            continue
        path = Path(entry.path)
        if entry.is_file(follow_symlinks=False) and path.suffix in WEIGHT_SUFFIXES:
            found[str(path.relative_to(root))] = describe(path)
        elif entry.is_dir(follow_symlinks=False):
            if _holds_a_model(path):
                found[str(path.relative_to(root))] = describe(path)
            elif depth < SCAN_DEPTH:
                _walk(root, path, depth + 1, found)


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as listing:
            return sorted(listing, key=lambda entry: entry.name)
    except OSError:
        return []


def _holds_a_model(folder: Path) -> bool:
    return any(
        entry.name == "config.json" or Path(entry.name).suffix in WEIGHT_SUFFIXES
        for entry in _entries(folder)
    )


def _weights(folder: Path) -> int | None:
    """Bytes of the weights in `folder`, counting one format (WEIGHT_FORMATS); None if none."""
    weights = (e for e in _entries(folder) if Path(e.name).suffix in WEIGHT_SUFFIXES)
    return weights_of(_regular_sizes(weights))


def _regular_sizes(entries: Iterable[os.DirEntry[str]]) -> Iterator[tuple[str, int]]:
    """(name, size) of the entries that are regular files, links followed as the engine
    would follow them."""
    for entry in entries:
        try:
            found = entry.stat()
        except OSError:
            continue
        if stat.S_ISREG(found.st_mode):
            yield entry.name, found.st_size


def _small_json(path: Path) -> dict[str, Any] | None:
    """A small regular file's JSON object; None for anything else (missing, too big, not a
    regular file, not JSON). Opening does not block on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_CONFIG_BYTES:
                return None
            raw = file.read(MAX_CONFIG_BYTES + 1)
        found = json.loads(raw) if len(raw) <= MAX_CONFIG_BYTES else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _folder_head(folder: Path) -> DecisionHead | None:
    """The decision head a folder's files declare: SGLang's `decision_config.json`, the
    joint-head files, or the metadata of the GGUF llama.cpp would load from it."""
    if _regular(folder / DECISION_CONFIG):
        return DecisionHead(kind="decision_config", evidence=str(folder / DECISION_CONFIG))
    if all(_regular(folder / name) for name in JOINT_HEAD):
        shown = " and ".join(str(folder / name) for name in JOINT_HEAD)
        return DecisionHead(kind="joint_head", evidence=shown)
    if not any(Path(entry.name).suffix == ".gguf" for entry in _entries(folder)):
        return None
    try:
        return _gguf_head(model_file(folder))
    except CapyError:
        return None


def _gguf_head(path: Path) -> DecisionHead | None:
    """The decision type a GGUF file's metadata declares (read once per version of it)."""
    if path.suffix != ".gguf":
        return None
    try:
        info = path.stat()
        key = (str(path), info.st_ino, info.st_size, info.st_mtime_ns)
        if key not in _gguf_reads:
            if len(_gguf_reads) >= MAX_GGUF_READS:
                _gguf_reads.clear()
            _gguf_reads[key] = gguf.decision_type(path)
        found = _gguf_reads[key]
    except (OSError, gguf.NotGguf):
        return None
    if found is None:
        return None
    evidence = f"{path}: {gguf.DECISION_SUFFIX.lstrip('.')} {found}"
    return DecisionHead(kind="gguf", evidence=evidence, type=_text(found))


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except (OSError, ValueError):
        return False


def _text(value: object) -> str:
    return "" if value is None else str(value)[:MAX_TEXT]


def _heads(config: dict[str, Any], key: str) -> int | None:
    """A head count from config.json, or from its `text_config` (a multimodal model's
    language model); None where neither holds a positive integer."""
    for section in (config, config.get("text_config")):
        value = section.get(key) if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 20:
            return value
    return None


def _architectures(value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(_text(name) for name in value if isinstance(name, str))[:MAX_ARCHITECTURES]


def _quantization(
    config: dict[str, Any], exported: dict[str, Any] | None
) -> tuple[QuantizationConfig, ...]:
    section = exported.get("quantization", exported) if exported else None
    files: tuple[tuple[Literal["config.json", "hf_quant_config.json"], object], ...] = (
        ("config.json", config.get("quantization_config")),
        ("hf_quant_config.json", section),
    )
    return tuple(
        QuantizationConfig(
            file=file,
            quant_method=_text(stated.get("quant_method")),
            quant_algo=_text(stated.get("quant_algo")),
        )
        for file, stated in files
        if isinstance(stated, dict)
    )


@dataclass
class Shelf:
    """The host's models record: what hostd was asked to describe, and the last published."""

    state: State
    host: str
    root: Path
    paths: tuple[str, ...] = ()
    # Where the Hub token is (None: the Hub's listings are not asked for).
    state_dir: Path | None = None
    # The Hub sources of described paths, for their weights before the download.
    sources: dict[str, HubPull] = field(default_factory=dict)
    _published: str | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The weights a source's Hub listing gave (None: it failed), and when it was asked.
    _listed: dict[HubPull, tuple[int | None, float]] = field(default_factory=dict)
    _listing: dict[HubPull, asyncio.Task[None]] = field(default_factory=dict)

    async def start(self) -> None:
        """Publish at start, still describing what the previous hostd was asked to."""
        try:
            previous = await self.state.host_models.get(self.host)
        except ValidationError:
            previous = None  # written by another release: the scheduler asks again
        if previous is not None:
            self.paths = tuple(previous.described)[:MAX_DESCRIBED]
            self.sources = {p: s for p, s in previous.sources.items() if p in self.paths}
        await self.refresh()

    async def describe(self, command: Describe) -> None:
        self.paths = tuple(dict.fromkeys(command.paths))[:MAX_DESCRIBED]
        self.sources = {p: s for p, s in command.sources.items() if p in self.paths}
        await self.refresh()

    async def refresh(self) -> None:
        """Look again; publish (and notify) only when something changed."""
        async with self._lock:
            found = self._with_listings(await asyncio.to_thread(survey, self.root, self.paths))
            value = found.model_dump_json()
            if value != self._published:
                await self.state.host_models.publish(self.host, found)
                self._published = value

    def _with_listings(self, found: HostModels) -> HostModels:
        """`found` with the weights of each store not downloaded yet, as its source's Hub
        listing gives them; a listing not asked for yet is asked for in the background, and
        the shelf looks again once it is in."""
        described = dict(found.described)
        for path, source in self.sources.items():
            facts = described.get(path)
            if facts is None or facts.kind != "missing":
                continue
            listed = self._listed.get(source)
            now = time.monotonic()
            if listed is None or (listed[0] is None and now - listed[1] > LISTING_RETRY_S):
                self._ask_listing(source)
            if listed is not None and listed[0] is not None:
                described[path] = facts.model_copy(update={"weights_bytes": listed[0]})
        return found.model_copy(update={"described": described, "sources": self.sources})

    def _ask_listing(self, source: HubPull) -> None:
        if self.state_dir is None or source in self._listing:
            return
        access = hub_access(self.state_dir, os.environ)
        if access.offline:
            return
        self._listing[source] = asyncio.create_task(self._list(source, access))
        self._listing[source].add_done_callback(lambda _: self._listing.pop(source, None))

    async def _list(self, source: HubPull, access: HubAccess) -> None:
        weights: int | None = None
        try:
            weights = await asyncio.wait_for(
                listed_weights(
                    HubSource(source.repo, source.commit, source.files),
                    source.commit,
                    endpoint=access.endpoint,
                    token=access.token,
                    limits=LISTING_LIMITS,
                ),
                LISTING_TIMEOUT_S,
            )
        except (CapyError, TimeoutError) as exc:
            log.info("no file listing of %s@%s yet: %s", source.repo, source.commit, exc)
        self._listed[source] = (weights, time.monotonic())
        if weights is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await self.refresh()

    async def watch(self, stop: asyncio.Event) -> None:
        """Look again every RESCAN_S seconds until stopped."""
        while not await wait_event(stop, RESCAN_S):
            try:
                await self.refresh()
            except REDIS_ERRORS:
                continue  # the heartbeat decides when Redis was gone too long
