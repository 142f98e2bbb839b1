"""A Hub source: repository ids by the Hub's rules, store names, the endpoint's precedence and
the `files` pattern rule."""

from __future__ import annotations

import re

import pytest

from capycommon.errors import InvalidConfig
from capycommon.hub import HubSource, endpoint_from, is_commit
from capycommon.hub.client import origin

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    "repo", ["acme/tiny", "Qwen/Qwen2.5-0.5B-Instruct", "a_b/c.d-e", "x" * 96 + "/" + "y" * 96]
)
def test_a_valid_repository_id_is_taken(repo: str) -> None:
    assert HubSource(repo).repo == repo


@pytest.mark.parametrize(
    "repo",
    [
        "tiny",
        "acme/tiny/extra",
        "/tiny",
        "acme/",
        "acme/ti ny",
        "acme/ti..ny",
        "ac--me/tiny",
        "acme/-tiny",
        "acme/tiny.",
        "acme/../x",
        "x" * 97 + "/tiny",
        "acme/tiny@main",
    ],
)
def test_an_invalid_repository_id_is_refused_with_the_rule(repo: str) -> None:
    with pytest.raises(InvalidConfig, match="write it as owner/name"):
        HubSource(repo)


def test_the_store_name_joins_owner_and_name_and_needs_a_commit() -> None:
    source = HubSource("acme/tiny", "main")
    assert source.store_name(COMMIT) == f"acme--tiny@{COMMIT}"
    with pytest.raises(InvalidConfig, match="40-hex commit"):
        source.store_name("main")


def test_a_choice_of_files_has_a_store_of_its_own_whatever_the_order_of_its_patterns() -> None:
    some = HubSource("acme/tiny", "main", ("*.json", "*.gguf")).store_name(COMMIT)
    assert re.fullmatch(rf"acme--tiny@{COMMIT}-[0-9a-f]{{8}}", some)
    assert HubSource("acme/tiny", "main", ("*.gguf", "*.json", "*.gguf")).store_name(COMMIT) == some
    assert HubSource("acme/tiny", "main", ("*.json",)).store_name(COMMIT) != some


def test_only_forty_lowercase_hex_digits_are_a_commit() -> None:
    assert is_commit(COMMIT)
    assert not is_commit(COMMIT.upper())
    assert not is_commit(COMMIT[:39])
    assert not is_commit("main")


def test_an_empty_revision_or_pattern_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="revision"):
        HubSource("acme/tiny", "")
    with pytest.raises(InvalidConfig, match="empty file pattern"):
        HubSource("acme/tiny", "main", ("",))


def test_the_endpoint_prefers_capyctl_then_hf_then_the_public_hub() -> None:
    assert endpoint_from({}) == "https://huggingface.co"
    assert endpoint_from({"HF_ENDPOINT": "http://mirror:8080/"}) == "http://mirror:8080"
    both = {"HF_ENDPOINT": "http://mirror", "CAPYCTL_HF_ENDPOINT": "https://ours"}
    assert endpoint_from(both) == "https://ours"
    assert endpoint_from({"CAPYCTL_HF_ENDPOINT": "", "HF_ENDPOINT": "http://m"}) == "http://m"
    with pytest.raises(InvalidConfig, match="CAPYCTL_HF_ENDPOINT"):
        endpoint_from({"CAPYCTL_HF_ENDPOINT": "mirror:8080"})


PATHS = ["config.json", "model.safetensors", "nested/tokenizer/vocab.txt", "nested/a.json"]


@pytest.mark.parametrize(
    ("patterns", "selected"),
    [
        ((), PATHS),
        (("*.json",), ["config.json", "nested/a.json"]),  # `*` crosses `/`
        (("nested/",), ["nested/tokenizer/vocab.txt", "nested/a.json"]),  # a folder
        (("nested/tokenizer/",), ["nested/tokenizer/vocab.txt"]),
        (("CONFIG.json",), []),  # case-sensitive
        (("config.json", "*.safetensors"), ["config.json", "model.safetensors"]),
        (("model.safetensor?",), ["model.safetensors"]),
        (("[cm]*",), ["config.json", "model.safetensors"]),
    ],
)
def test_patterns_select_files_with_fnmatch_rules(
    patterns: tuple[str, ...], selected: list[str]
) -> None:
    source = HubSource("acme/tiny", "main", patterns)
    assert [path for path in PATHS if source.selects(path)] == selected


def test_an_origin_is_scheme_host_and_port() -> None:
    assert origin("https://huggingface.co/api") == origin("https://HuggingFace.co:443/x")
    assert origin("http://127.0.0.1:8080/a") != origin("http://localhost:8080/a")
    assert origin("http://127.0.0.1:8080") != origin("https://127.0.0.1:8080")
    assert origin("http://127.0.0.1:8080") != origin("http://127.0.0.1:8081")
