"""A multipart/form-data body (an audio upload): its text fields read, and the body rebuilt
with one field's value replaced (the model, by the name its engine serves it under).

Only what RFC 7578 forms hold is read: parts between `--<boundary>` lines, each with its
headers, a blank line and its bytes. A part is named by its Content-Disposition's `name`; a
file part also has a `filename`. The bytes of every part but the one replaced pass through as
they came.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from capycommon.errors import InvalidRequest

# The longest boundary RFC 2046 allows.
MAX_BOUNDARY = 70
# The most parts a form may have: a transcription's fields are a dozen.
MAX_PARTS = 64
_BOUNDARY = re.compile(r';\s*boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', re.IGNORECASE)
_NAME = re.compile(rb'(?:^|;)\s*name="([^"]*)"', re.IGNORECASE)
_FILENAME = re.compile(rb";\s*filename\*?=", re.IGNORECASE)
_FIX = "send the audio as a multipart/form-data body with a file part and a model field"


@dataclass(frozen=True, slots=True)
class Part:
    headers: bytes
    name: str
    is_file: bool
    data: bytes


@dataclass(frozen=True, slots=True)
class Form:
    boundary: bytes
    parts: tuple[Part, ...]

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self.boundary.decode()}"

    def fields(self) -> dict[str, str]:
        """The text fields by name (the last of a name given twice, as engines read forms);
        InvalidRequest for one that is not UTF-8."""
        found: dict[str, str] = {}
        for part in self.parts:
            if part.is_file:
                continue
            try:
                found[part.name] = part.data.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidRequest(f"form field {part.name!r} is not UTF-8 text") from None
        return found

    def files(self) -> tuple[str, ...]:
        return tuple(part.name for part in self.parts if part.is_file)

    def with_field(self, name: str, value: str) -> bytes:
        """The body, with every part named `name` holding `value`."""
        parts = [
            replace(part, data=value.encode()) if part.name == name and not part.is_file else part
            for part in self.parts
        ]
        dash = b"--" + self.boundary
        pieces = [
            dash + b"\r\n" + part.headers + b"\r\n\r\n" + part.data + b"\r\n" for part in parts
        ]
        return b"".join(pieces) + dash + b"--\r\n"


def fields_of(form: Form) -> dict[str, Any]:
    """A transcription form's text fields as a body to check: `stream` read as a boolean;
    InvalidRequest for a form without its file."""
    if "file" not in form.files():
        raise InvalidRequest(f"the form has no file part named 'file'; {_FIX}")
    fields: dict[str, Any] = dict(form.fields())
    stream = fields.get("stream")
    if stream is not None:
        said = stream.strip().lower()
        if said not in ("true", "false"):
            raise InvalidRequest(f"form field 'stream' is {stream[:20]!r}; send true or false")
        fields["stream"] = said == "true"
    return fields


def boundary_of(content_type: str | None) -> bytes:
    """The boundary a multipart/form-data Content-Type names; InvalidRequest otherwise."""
    if content_type is None or not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest(
            f"Content-Type is {(content_type or 'missing')[:100]!r}, not "
            f"multipart/form-data; {_FIX}"
        )
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise InvalidRequest(f"the multipart Content-Type names no boundary; {_FIX}")
    return (found.group(1) or found.group(2)).encode()


def parse(content_type: str | None, raw: bytes) -> Form:
    """The form a body holds; InvalidRequest naming what is wrong with it."""
    boundary = boundary_of(content_type)
    dash = b"--" + boundary
    if not raw.startswith(dash):
        raise InvalidRequest(f"the body does not begin with its boundary; {_FIX}")
    pieces = raw.split(b"\r\n" + dash)
    pieces[0] = pieces[0][len(dash) :]
    if len(pieces) < 2 or not pieces[-1].startswith(b"--"):
        raise InvalidRequest(f"the form has no closing boundary (it was cut short); {_FIX}")
    if len(pieces) - 1 > MAX_PARTS:
        raise InvalidRequest(f"the form has over {MAX_PARTS} parts; {_FIX}")
    return Form(boundary, tuple(_part(piece) for piece in pieces[:-1]))


def _part(piece: bytes) -> Part:
    if not piece.startswith(b"\r\n"):
        raise InvalidRequest(f"a boundary line of the form is followed by other bytes; {_FIX}")
    headers, blank, data = piece[2:].partition(b"\r\n\r\n")
    if not blank:
        raise InvalidRequest(f"a part of the form has no blank line after its headers; {_FIX}")
    disposition = next(
        (
            line.split(b":", 1)[1]
            for line in headers.split(b"\r\n")
            if line.lower().startswith(b"content-disposition:")
        ),
        None,
    )
    named = None if disposition is None else _NAME.search(disposition)
    if disposition is None or named is None:
        raise InvalidRequest(f"a part of the form has no Content-Disposition name; {_FIX}")
    try:
        name = named.group(1).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("a part of the form has a name that is not UTF-8") from None
    return Part(headers, name, _FILENAME.search(disposition) is not None, data)
