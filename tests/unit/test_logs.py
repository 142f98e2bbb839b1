from __future__ import annotations

import io
import json
import logging

from capycommon import logs


def test_json_lines_off_a_terminal() -> None:
    stream = io.StringIO()
    logs.configure("router", "info", "auto", stream=stream)
    logging.getLogger("x").info("hello %s", "world", extra={"port": 8443})
    logging.getLogger("x").debug("hidden")
    line = json.loads(stream.getvalue())
    assert line["level"] == "info"
    assert line["service"] == "router"
    assert line["message"] == "hello world"
    assert line["fields"] == {"port": 8443}
    assert line["ts"].endswith("Z")


def test_text_when_asked() -> None:
    stream = io.StringIO()
    logs.configure("hostd", "debug", "text", stream=stream)
    logging.getLogger("y").debug("started", extra={"pid": 7})
    assert stream.getvalue().rstrip().endswith("debug   hostd: started  pid=7")
