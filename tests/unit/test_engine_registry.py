"""engines.yaml: where it lives, its revisions, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from capycommon.engines import registry
from capycommon.engines.families import Family, check_supported, is_verified
from capycommon.errors import EngineUnsupported, InvalidConfig, ProfileExists, ProfileNotFound
from support import engine_profile


def test_revisions_count_writes(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    assert registry.read(path).revision == 0
    registry.add(path, engine_profile(Family.VLLM, "a"))
    registry.add(path, engine_profile(Family.VLLM, "b"))
    saved = registry.remove(path, "a")
    assert saved.revision == 3
    text = path.read_text()
    assert text.startswith("# capyctl-document-revision: 3\nschema_version: 1\nkind: engines\n")
    assert path.stat().st_mode & 0o777 == 0o600
    assert list(registry.read(path).document.profiles) == ["b"]


def test_a_taken_name_and_an_unknown_name_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    registry.add(path, engine_profile(Family.VLLM))
    with pytest.raises(ProfileExists, match="choose another with --name") as caught:
        registry.add(path, engine_profile(Family.VLLM))
    assert caught.value.exit_code == 19
    with pytest.raises(
        ProfileNotFound, match=r"no engine named 'x' is registered \(registered: vllm\)"
    ):
        registry.remove(path, "x")
    assert registry.read(path).revision == 1, "a refusal writes nothing"


def test_a_broken_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text("kind: engines\nprofiles: {x: {name: x}}\n")
    with pytest.raises(InvalidConfig, match=str(path)):
        registry.read(path)


def test_location_prefers_an_existing_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    document = tmp_path / "state" / "config" / "standalone.yaml"
    fallback = home / ".config" / "capyctl" / "engines.yaml"
    assert registry.locate(None, home) == fallback
    assert registry.locate(document, home) == document.parent / "engines.yaml"
    fallback.parent.mkdir(parents=True)
    fallback.touch()
    assert registry.locate(document, home) == fallback, "registered before the first start"
    document.parent.mkdir(parents=True)
    (document.parent / "engines.yaml").touch()
    assert registry.locate(document, home) == document.parent / "engines.yaml"


def test_supported_and_verified_versions() -> None:
    check_supported(Family.VLLM, "0.29.0")
    check_supported(Family.LLAMACPP, "6500")
    with pytest.raises(EngineUnsupported, match=r"older than 0\.11\.0") as caught:
        check_supported(Family.VLLM, "0.8.5")
    assert caught.value.exit_code == 17
    with pytest.raises(EngineUnsupported, match="not a version number"):
        check_supported(Family.SGLANG, "banana")
    assert is_verified(Family.VLLM, "0.29.0")
    assert not is_verified(Family.VLLM, "0.30.0")
    assert is_verified(Family.VLLM, "0.32.0"), "named by the 0.1.7 notes"
    assert is_verified(Family.SGLANG, "0.5.22"), "named by the 0.1.7 notes"
    assert not is_verified(Family.SGLANG, "0.5.21")
    assert not is_verified(Family.LLAMACPP, "6500")
