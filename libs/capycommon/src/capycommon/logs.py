"""Logging, configured once in each program's main(): text on a terminal, JSON lines else."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal, TextIO

# Attributes every LogRecord has; anything else on a record is a field passed via `extra`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's ANSI-coloured copy of the message
}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in vars(record).items() if key not in _RECORD_ATTRS}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "message": record.getMessage(),
            "fields": _fields(record),
        }
        if record.exc_info:
            line["fields"]["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(f"{key}={value}" for key, value in _fields(record).items())
        text = f"{stamp} {record.levelname.lower():<7} {self.service}: {record.getMessage()}"
        if extras:
            text = f"{text}  {extras}"
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        return text


def configure(
    service: str,
    level: str = "info",
    fmt: Literal["auto", "text", "json"] = "auto",
    stream: TextIO | None = None,
) -> None:
    """Route every logger (uvicorn's included) to one handler on `stream`."""
    target = stream if stream is not None else sys.stderr
    use_text = fmt == "text" or (fmt == "auto" and target.isatty())
    handler = logging.StreamHandler(target)
    handler.setFormatter(TextFormatter(service) if use_text else JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = True
    # A line per engine call is noise (and would name every URL): keep their warnings only.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(root.level, logging.WARNING))
