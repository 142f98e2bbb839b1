from __future__ import annotations

import configparser
from pathlib import Path

from capycommon.paths import StatePaths
from capyctl_cli import redisconf, supervisor


def test_supervisord_configuration(tmp_path: Path) -> None:
    paths = StatePaths(tmp_path / "100%")
    programs = [
        supervisor.Program("redis", ["/usr/bin/redis-server", str(paths.redis_conf)], 10, 10),
        supervisor.Program(
            "router", ["/venv/bin/python", "-m", "capyctl_router", "--role", "x y"], 20, 8
        ),
    ]
    text = supervisor.render("standalone", paths, programs)
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    assert parser["supervisord"]["nodaemon"] == "true"
    assert parser["unix_http_server"]["chmod"] == "0700"
    assert parser["program:redis"]["priority"] == "10"
    router = parser["program:router"]
    assert router["command"] == "/venv/bin/python -m capyctl_router --role 'x y'"
    assert router["autorestart"] == "true"
    assert router["stopasgroup"] == "true"
    assert "100%%" in router["stdout_logfile"], "percent signs are escaped for supervisord"


def test_redis_listens_on_a_private_socket_only(tmp_path: Path) -> None:
    paths = StatePaths(tmp_path)
    lines = redisconf.render(paths).splitlines()
    assert "port 0" in lines
    assert f"unixsocket {paths.redis_socket}" in lines
    assert "unixsocketperm 700" in lines
    assert "appendonly yes" in lines
    assert "appendfsync everysec" in lines


def test_redis_bounds_a_scripts_time_and_a_values_size(tmp_path: Path) -> None:
    lines = redisconf.render(StatePaths(tmp_path)).splitlines()
    assert "busy-reply-threshold 1000" in lines
    assert "proto-max-bulk-len 8mb" in lines
