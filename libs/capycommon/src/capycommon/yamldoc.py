"""Reading a YAML document strictly: a duplicate key is refused instead of keeping the last
one, and every error names the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from capycommon.errors import InvalidConfig


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys instead of keeping the last one."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise InvalidConfig(f"duplicate key {key!r} at line {line}; keep one of them")
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _mapping_without_duplicates,
)


def load_yaml_document(path: Path) -> Any:
    """Parse a YAML document strictly; errors name the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidConfig(f"cannot read {path}: {exc.strerror}; check the path") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except InvalidConfig as exc:
        raise InvalidConfig(f"{path}: {exc.message}") from None
    except yaml.YAMLError as exc:
        raise InvalidConfig(f"{path} is not valid YAML: {exc}; fix the document") from None
