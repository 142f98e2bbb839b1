"""Reading a YAML document strictly: a duplicate key is refused instead of keeping the last
one, a document that is too large, not UTF-8 or full of aliases (a "billion laughs" bomb) is
refused before it is built, and every error names the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from capycommon.errors import InvalidConfig

# Role and deployment documents are a few kilobytes; these bounds leave them room and stop a
# document that would take the CLI's memory or time.
MAX_BYTES = 1 << 20
MAX_ALIASES = 64


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys instead of keeping the last one, and more
    than MAX_ALIASES aliases."""

    aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise InvalidConfig(
                    f"more than {MAX_ALIASES} YAML aliases; write the values out instead of "
                    "repeating them by alias"
                )
        return super().compose_node(parent, index)


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
        with path.open("rb") as file:
            data = file.read(MAX_BYTES + 1)
    except OSError as exc:
        raise InvalidConfig(f"cannot read {path}: {exc.strerror}; check the path") from None
    if len(data) > MAX_BYTES:
        raise InvalidConfig(
            f"{path} is larger than {MAX_BYTES >> 10} KiB; a CapyCTL document is a few "
            "kilobytes: check that this is the right file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfig(
            f"{path} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r}); "
            "save it as UTF-8"
        ) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except InvalidConfig as exc:
        raise InvalidConfig(f"{path}: {exc.message}") from None
    except yaml.YAMLError as exc:
        raise InvalidConfig(f"{path} is not valid YAML: {exc}; fix the document") from None
