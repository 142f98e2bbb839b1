"""A server role the end-to-end tests of joined hosts drive: its Redis as the control plane's
user, an OpenAI client of its endpoint, its CLI, deployments declared on it, and a question to a
model, answered whole or streamed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import redis
import yaml

from support import Role


@dataclass
class ServerSetup:
    folder: Path
    server: Role
    clients: list[openai.OpenAI] = field(default_factory=list, init=False)  # see close_clients

    @property
    def redis(self) -> redis.Redis:
        return self.server.control()

    def openai(self, timeout: float = 60) -> openai.OpenAI:
        key = self.server.credentials()["api_key"]
        url = f"http://{self.server.inference}/v1"
        client = openai.OpenAI(base_url=url, api_key=key, timeout=timeout, max_retries=0)
        self.clients.append(client)
        return client

    def close_clients(self) -> None:
        for client in self.clients:
            client.close()

    def ok(self, *args: str) -> str:
        result = self.server.capyctl(*args)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def deploy(self, name: str, **fields: Any) -> None:
        document = {"name": name, "engine": "vllm", "model": "m14", **fields}
        path = self.folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(document))
        self.ok("deploy", "model", "--file", str(path))


def ask(client: openai.OpenAI, model: str, stream: bool = False) -> str:
    messages: Any = [{"role": "user", "content": "hello"}]
    if not stream:
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        return answer.choices[0].message.content or ""
    parts = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in parts if chunk.choices)
