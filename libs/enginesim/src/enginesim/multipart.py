"""A multipart/form-data body read with the standard library: its text fields and its files.

A body that is not multipart (or has no boundary) reads as an empty form, so the route
answers as it does for a form that lacks the fields. A field given twice keeps its last value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from email.message import Message
from email.parser import BytesHeaderParser

from starlette.requests import Request


@dataclass(frozen=True)
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    filenames: dict[str, str] = field(default_factory=dict)


async def read_form(request: Request) -> Form:
    return parse_form(request.headers.get("content-type", ""), await request.body())


def parse_form(content_type: str, body: bytes) -> Form:
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str):
        return Form()
    form = Form()
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):  # the closing delimiter
            break
        _add_part(form, part.removeprefix(b"\r\n"))
    return form


def _add_part(form: Form, part: bytes) -> None:
    head, _, data = part.partition(b"\r\n\r\n")
    data = data.removesuffix(b"\r\n")
    headers = BytesHeaderParser().parsebytes(head + b"\r\n\r\n")
    name = headers.get_param("name", header="content-disposition")
    if not isinstance(name, str):
        return
    filename = headers.get_filename()
    if filename is None:
        form.fields[name] = data.decode("utf-8", errors="replace")
    else:
        form.files[name] = data
        form.filenames[name] = filename
