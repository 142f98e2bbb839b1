"""Find engine installations by asking them, in a bounded subprocess, what they are.

vLLM and SGLang: the target environment's own python reads the package metadata (never
importing the engine). llama.cpp: `llama-server --version`; TensorFold: `tensorfold
--version`. Nothing here imports an engine into CapyCTL's process. A custom engine is not
found: its registration names it (`capyctl engine add-custom`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from capycommon.engines import tensorfold
from capycommon.engines.families import PYTHON_FAMILIES, Family
from capycommon.engines.registry import EngineProfile, profile_from
from capycommon.errors import EngineNotFound, EngineVersionFailed, InvalidConfig

PROBE_TIMEOUT_S = 60
OUTPUT_LIMIT = 4096
# A cleared environment: the probe sees nothing of ours.
PROBE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8"}

# Runs inside the target environment: package metadata only, never `import vllm`.
_METADATA_PROBE = """
import hashlib, importlib.metadata as md, json, os
found = {}
for name in ("vllm", "sglang", "lmcache"):
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    digest = hashlib.sha256(f"{name}=={dist.version}\\n".encode())
    for item in sorted(dist.files or [], key=str):
        try:
            size = os.stat(dist.locate_file(item)).st_size
        except OSError:
            size = -1
        recorded = item.hash.value if item.hash else ""
        digest.update(f"{item}\\0{size}\\0{recorded}\\n".encode())
    found[name] = {"version": dist.version, "digest": digest.hexdigest()}
print(json.dumps(found))
"""

_LLAMA_VERSION = re.compile(r"version:\s*(\d+)\s*\(([^)]*)\)")


@dataclass(frozen=True)
class Found:
    """One engine installation, as it described itself."""

    family: Family
    version: str
    executable: Path
    install_path: Path
    digest: str

    @property
    def fingerprint(self) -> str:
        return f"{self.version}+sha256:{self.digest}"

    def profile(self, name: str | None = None) -> EngineProfile:
        return profile_from(
            self.family, self.version, self.executable, self.install_path, self.fingerprint, name
        )


def _run(argv: list[str], what: str) -> str:
    try:
        done = subprocess.run(
            argv,
            env=PROBE_ENV,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise EngineVersionFailed(
            f"{what} did not answer within {PROBE_TIMEOUT_S} s; check the installation"
        ) from None
    except OSError as exc:
        raise EngineVersionFailed(f"cannot run {what}: {exc.strerror}") from None
    output = (done.stdout[:OUTPUT_LIMIT] + b"\n" + done.stderr[:OUTPUT_LIMIT]).decode(
        "utf-8", "replace"
    )
    if done.returncode != 0:
        tail = output.strip().splitlines()[-1:] or ["no output"]
        raise EngineVersionFailed(f"{what} exited with {done.returncode}: {tail[0]}")
    return output


def venv_python(path: Path) -> Path | None:
    python = path / "bin" / "python"
    return python if (path / "pyvenv.cfg").is_file() and os.access(python, os.X_OK) else None


def probe_venv(path: Path) -> list[Found]:
    """The vLLM and SGLang distributions installed in the virtual environment `path`."""
    python = venv_python(path)
    if python is None:
        raise EngineNotFound(f"{path} is not a virtual environment (no pyvenv.cfg and bin/python)")
    output = _run([str(python), "-I", "-c", _METADATA_PROBE], f"{python}")
    try:
        found = json.loads(output.strip().splitlines()[0])
    except (ValueError, IndexError):
        raise EngineVersionFailed(f"{python} answered the metadata probe with {output!r}") from None
    return [
        Found(Family(name), info["version"], python, path, info["digest"])
        for name, info in sorted(found.items())
        if Family(name) in PYTHON_FAMILIES
    ]


def _digest_files(paths: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(f"{path.name}\0".encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def probe_llama_server(path: Path) -> Found:
    """A llama-server binary: its build number, and a digest of it and its libraries."""
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineNotFound(f"{path} is not an executable llama-server")
    output = _run([str(path), "--version"], f"{path} --version")
    match = _LLAMA_VERSION.search(output)
    if match is None:
        raise EngineNotFound(
            f"{path} --version does not print a llama.cpp build: {output.strip()[:200]!r}"
        )
    libraries = [p for p in path.parent.glob("lib*.so*") if p.is_file()]
    return Found(Family.LLAMACPP, match[1], path, path, _digest_files([path, *libraries]))


def probe_tensorfold(path: Path) -> Found:
    """A tensorfold executable: its version, and a digest of it."""
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineNotFound(f"{path} is not an executable tensorfold")
    output = _run([str(path), "--version"], f"{path} --version")
    match = tensorfold.VERSION_LINE.search(output)
    if match is None:
        raise EngineNotFound(
            f"{path} --version does not print a TensorFold version: {output.strip()[:200]!r}"
        )
    return Found(Family.TENSORFOLD, match[1], path, path, _digest_files([path]))


def tensorfold_in(folder: Path) -> Path | None:
    for candidate in (folder / tensorfold.EXECUTABLE, folder / "bin" / tensorfold.EXECUTABLE):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def llama_server_in(folder: Path) -> Path | None:
    for candidate in (
        folder / "llama-server",
        folder / "bin" / "llama-server",
        folder / "build" / "bin" / "llama-server",
    ):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def probe(path: Path) -> list[Found]:
    """Whatever engine lives at `path`: a venv, a llama-server binary or a llama.cpp folder, or
    a tensorfold executable (or the folder, or venv, holding one)."""
    path = path.expanduser().absolute()
    if not path.exists():
        raise EngineNotFound(f"{path} does not exist")
    if path.is_file():
        if path.name == tensorfold.EXECUTABLE:
            return [probe_tensorfold(path)]
        return [probe_llama_server(path)]
    folded = tensorfold_in(path)
    if venv_python(path) is not None:
        found = probe_venv(path)
        if folded is not None:
            found.append(probe_tensorfold(folded))
        if not found:
            raise EngineNotFound(f"{path} is a virtual environment without vllm, sglang or lmcache")
        return found
    server = llama_server_in(path)
    if server is None and folded is None:
        raise EngineNotFound(
            f"{path} is neither a virtual environment with vllm or sglang, nor a llama-server, "
            "nor a tensorfold"
        )
    return [probe(found)[0] for found in (server, folded) if found is not None]


def candidates(home: Path, extra: Iterable[Path], search_path: str) -> list[Path]:
    """Where engines are usually installed, most specific first, without duplicates."""
    places: list[Path] = [p.expanduser().absolute() for p in extra]
    for pattern in ("venvs/*", ".virtualenvs/*", "*"):
        places += sorted(p for p in home.glob(pattern) if p.is_dir() and venv_python(p))
    places += [home / ".venv"]
    places += sorted(p for p in Path("/opt").glob("*") if p.is_dir())
    places += [Path(d) for d in search_path.split(os.pathsep) if d]
    places += [*sorted(home.glob("llama.cpp/build*/bin")), Path("/usr/local/bin")]
    unique: list[Path] = []
    for place in places:
        if place.exists() and place not in unique:
            unique.append(place)
    return unique


def detect(places: Iterable[Path]) -> list[Found]:
    """Every engine found in `places`; places that hold none are skipped."""
    found: list[Found] = []
    for place in places:
        try:
            if (
                place.is_dir()
                and venv_python(place) is None
                and llama_server_in(place) is None
                and tensorfold_in(place) is None
            ):
                continue
            found += probe(place)
        except (EngineNotFound, EngineVersionFailed):
            continue
    unique = {(f.family, f.executable): f for f in found}
    return list(unique.values())


def custom_profile(
    name: str, command: str, ready_path: str, key_env: str | None, version: str
) -> EngineProfile:
    """A custom engine's profile from its registration: `command` split as a shell would
    (and never run by one); refused, naming what to change, where it cannot start safely."""
    try:
        words = tuple(shlex.split(command))
    except ValueError as exc:
        raise InvalidConfig(f"--command: {exc}; quote it as a shell would") from None
    program = Path(words[0]) if words else Path()
    if words and not (program.is_absolute() and program.is_file() and os.access(program, os.X_OK)):
        raise EngineNotFound(f"--command: {words[0]} is not an executable file (absolute path)")
    digest = hashlib.sha256(_digest_files([program]).encode() if words else b"")
    digest.update("\0".join(words).encode())
    try:
        return EngineProfile(
            name=name,
            family=Family.CUSTOM,
            version=version,
            executable=program,
            install_path=program,
            fingerprint=f"{version}+sha256:{digest.hexdigest()}",
            verified=False,
            added_at=datetime.now(UTC),
            command=words,
            ready_path=ready_path,
            key_env=key_env,
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'command'}: "
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
        raise InvalidConfig(f"custom engine {name!r}: {problems}") from None
