"""The lock files agree with what the packages declare: every dependency a pyproject names is
pinned, at a version its specifier allows, with hashes; nothing is pinned for one of our
packages that it no longer declares; the dev lock pins what the runtime lock pins, the same.
`scripts/lock` mends a disagreement."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    "libs/capycommon",
    "libs/enginesim",
    "services/router",
    "services/scheduler",
    "services/hostd",
    "services/memwatch",
    "cli",
]
PIN = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)==(?P<version>[^ ;\\]+)(?: ; (?P<marker>[^\\]+))?")
VIA = re.compile(r"^    #\s+(?:via )?(?!via$)(?P<name>[A-Za-z0-9._-]+)$")


@dataclass
class Pin:
    version: Version
    hashes: int = 0
    via: set[str] = field(default_factory=set)


def read_lock(path: Path) -> dict[str, list[Pin]]:
    """Each package of a lock file -> its pins (one per marker fork), with hashes and `via`."""
    pins: dict[str, list[Pin]] = {}
    current: Pin | None = None
    for line in path.read_text().splitlines():
        if match := PIN.match(line):
            current = Pin(Version(match["version"]))
            pins.setdefault(canonicalize_name(match["name"]), []).append(current)
        elif current is not None and line.strip().startswith("--hash=sha256:"):
            current.hashes += 1
        elif current is not None and (via := VIA.match(line)):
            current.via.add(canonicalize_name(via["name"]))
    return pins


def declared() -> dict[str, list[Requirement]]:
    """Each of our packages -> the dependencies its pyproject declares."""
    result: dict[str, list[Requirement]] = {}
    for folder in PACKAGES:
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        requirements = [Requirement(text) for text in project["dependencies"]]
        result[canonicalize_name(project["name"])] = requirements
    return result


OURS = set(declared())
RUNTIME = read_lock(ROOT / "requirements.lock")
DEV = read_lock(ROOT / "requirements-dev.lock")


@pytest.mark.parametrize("package", sorted(OURS))
def test_every_declared_dependency_is_pinned_within_its_specifier(package: str) -> None:
    for requirement in declared()[package]:
        name = canonicalize_name(requirement.name)
        if name in OURS:
            continue
        assert name in RUNTIME, f"{package} needs {requirement}, not in requirements.lock"
        for pin in RUNTIME[name]:
            assert requirement.specifier.contains(pin.version, prereleases=True), (
                f"{package} needs {requirement}; requirements.lock pins {pin.version}"
            )


def test_the_lock_names_no_dependency_that_a_package_dropped() -> None:
    wanted = {
        (package, canonicalize_name(requirement.name))
        for package, requirements in declared().items()
        for requirement in requirements
    }
    for name, pins in RUNTIME.items():
        for pin in pins:
            for package in pin.via & OURS:
                assert (package, name) in wanted, (
                    f"requirements.lock pins {name} for {package}, which no longer needs it"
                )


def test_every_pin_has_hashes_and_no_package_of_ours_is_pinned() -> None:
    for lock in (RUNTIME, DEV):
        assert not OURS & set(lock)
        assert lock, "an empty lock"
        for name, pins in lock.items():
            assert all(pin.hashes for pin in pins), f"{name} is pinned without a hash"


def test_the_dev_lock_pins_the_runtime_lock_the_same() -> None:
    for name, pins in RUNTIME.items():
        assert name in DEV, f"requirements-dev.lock lacks {name}"
        assert {p.version for p in DEV[name]} == {p.version for p in pins}, name


def test_the_dev_tools_are_pinned_within_their_specifiers() -> None:
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        requirement = Requirement(line)
        pins = DEV.get(canonicalize_name(requirement.name), [])
        assert pins, f"requirements-dev.lock lacks {requirement}"
        assert all(requirement.specifier.contains(p.version, prereleases=True) for p in pins)


def test_a_dependency_missing_from_the_lock_is_caught(tmp_path: Path) -> None:
    """The reader sees a pin go: the checks above cannot pass on a lock they fail to read."""
    text = (ROOT / "requirements.lock").read_text()
    dropped = re.sub(r"(?ms)^pyyaml==.*?(?=^\S)", "", text)
    (tmp_path / "requirements.lock").write_text(dropped)
    assert "pyyaml" in RUNTIME
    assert RUNTIME["pyyaml"][0].via >= {"capycommon"}
    assert "pyyaml" not in read_lock(tmp_path / "requirements.lock")
