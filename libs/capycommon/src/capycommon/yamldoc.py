"""Reading a YAML document strictly: a duplicate key is refused instead of keeping the last
one, a document that is too large, not UTF-8, nested too deep or full of aliases (a "billion
laughs" bomb) is refused before it is built, a value its tag cannot build (a 5,000-digit
integer, a 13th month, a list as a key) is refused where it stands, and every error names the
file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from capycommon.errors import InvalidConfig

# Role and deployment documents are a few kilobytes; these bounds leave them room and stop a
# document that would take the CLI's memory or time.
MAX_BYTES = 1 << 20
MAX_ALIASES = 64
# A role or deployment document is a few levels deep; PyYAML builds a document by
# recursion, and a thousand levels end in a RecursionError.
MAX_DEPTH = 32


def _where(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys instead of keeping the last one, more than
    MAX_ALIASES aliases, nesting deeper than MAX_DEPTH, and values their tag cannot build."""

    aliases = 0
    depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise InvalidConfig(
                    f"more than {MAX_ALIASES} YAML aliases; write the values out instead of "
                    "repeating them by alias"
                )
        if self.depth >= MAX_DEPTH:
            # check_event has read the node's first event into current_event.
            mark: yaml.Mark = self.current_event.start_mark
            raise InvalidConfig(
                f"nested more than {MAX_DEPTH} levels deep at {_where(mark)}; "
                "a CapyCTL document is a few levels deep: check that this is the right file"
            )
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError):
            # A plain value its resolved tag cannot build: int('1' * 5000), 2001-13-45, ...
            kind = node.tag.rsplit(":", 1)[-1]
            shown = node.value if isinstance(node.value, str) else ""
            shown = repr(shown[:40] + "..." if len(shown) > 40 else shown)
            raise InvalidConfig(
                f"the value {shown} at {_where(node.start_mark)} is not a valid YAML {kind}; "
                "correct it, or quote it to keep it as text"
            ) from None


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            hash(key)
        except TypeError:
            raise InvalidConfig(
                f"the key at {_where(key_node.start_mark)} is a {key_node.id}; "
                "a key must be a plain value"
            ) from None
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
    return parse_yaml(text, str(path))


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text strictly, as load_yaml_document does a file; errors name `source`."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except InvalidConfig as exc:
        raise InvalidConfig(f"{source}: {exc.message}") from None
    except yaml.YAMLError as exc:
        raise InvalidConfig(f"{source} is not valid YAML: {exc}; fix the document") from None
