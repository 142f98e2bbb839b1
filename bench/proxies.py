"""The other proxies the router bench measures beside the router, on the same engine: nginx
(from Debian, installed when missing and the bench runs as root) and LiteLLM's proxy (from
PyPI, installed once into bench/.venv-litellm). Each says why when it cannot be had."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

import benchrole
from benchclient import Engine, Side, start_side

BENCH = Path(__file__).resolve().parent
LITELLM_VENV = BENCH / ".venv-litellm"
LITELLM_KEY = "sk-bench"

NGINX_CONF = """
worker_processes {workers};
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    upstream engine {{
        server 127.0.0.1:{engine};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def _nginx_binary() -> tuple[str | None, str]:
    """nginx, installed from Debian when missing and this runs as root; else why not."""
    found = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if found:
        return found, ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "nginx is not installed (as root: apt-get install -y nginx-light)"
    print("installing nginx-light from Debian ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nginx-light"]
    pid_before = Path("/run/nginx.pid").exists()
    for attempt in ([], ["apt-get", "update", "-qq"]):
        if attempt:
            subprocess.run(attempt, env=env, capture_output=True, timeout=600, check=False)
        done = subprocess.run(
            install, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        if done.returncode == 0:
            break
    else:
        return None, f"apt-get install nginx-light failed: {done.stderr.strip()[-300:]}"
    if not pid_before and Path("/run/nginx.pid").exists():  # the package started its service
        subprocess.run(["/usr/sbin/nginx", "-s", "quit"], capture_output=True, check=False)
    return "/usr/sbin/nginx", ""


def _litellm_binary() -> tuple[str | None, str]:
    """LiteLLM's proxy from its own venv, installed there from PyPI on first use."""
    binary = LITELLM_VENV / "bin" / "litellm"
    if binary.exists():
        return str(binary), ""
    print(f"installing litellm[proxy] into {LITELLM_VENV} (once; minutes) ...", flush=True)
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", str(LITELLM_VENV)], capture_output=True, check=True
        )
        done = subprocess.run(
            [str(LITELLM_VENV / "bin" / "python"), "-m", "pip", "install", "-q", "litellm[proxy]"],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not install LiteLLM into {LITELLM_VENV}: {exc}"
    if done.returncode != 0 or not binary.exists():
        return None, f"pip install 'litellm[proxy]' failed: {done.stderr.strip()[-300:]}"
    return str(binary), ""


def _started(found: tuple[str | None, str], start: Callable[[str, int], Side | str]) -> Side | str:
    """`start` (the proxy's binary, a free port) where `found` has the binary; else why not."""
    binary, why = found
    return why if binary is None else start(binary, benchrole.free_port())


def start_nginx(folder: Path, engine: Engine) -> Side | str:
    return _started(_nginx_binary(), functools.partial(_start_nginx, folder, engine))


def start_litellm(folder: Path, engine: Engine) -> Side | str:
    return _started(_litellm_binary(), functools.partial(_start_litellm, folder, engine))


def _start_nginx(folder: Path, engine: Engine, binary: str, port: int) -> Side | str:
    conf = folder / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(workers=os.cpu_count() or 1, folder=folder, engine=engine.port, port=port)
    )
    argv = [binary, "-c", str(conf), "-p", str(folder)]
    return start_side(
        argv, folder / "nginx.log", port, "nginx", 20, key=engine.key, model=engine.model
    )


def _start_litellm(folder: Path, engine: Engine, binary: str, port: int) -> Side | str:
    config = folder / "litellm.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model_list": [
                    {
                        "model_name": "bench",
                        "litellm_params": {
                            "model": f"openai/{engine.model}",
                            "api_base": f"http://127.0.0.1:{engine.port}/v1",
                            "api_key": engine.key,
                        },
                    }
                ],
                "general_settings": {"master_key": LITELLM_KEY},
                "litellm_settings": {"drop_params": True, "telemetry": False},
            }
        )
    )
    argv = [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--num_workers", str(os.cpu_count() or 1)]
    return start_side(
        argv,
        folder / "litellm.log",
        port,
        "LiteLLM",
        180,
        key=LITELLM_KEY,
        model="bench",
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},
    )
