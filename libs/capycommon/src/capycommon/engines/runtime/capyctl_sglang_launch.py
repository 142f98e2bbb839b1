"""Starts SGLang's server with the launch's key (`python -m capyctl_sglang_launch <flags>`).

SGLang reads its key only from --api-key, and a process's command line is open to every local
user (/proc/<pid>/cmdline) while its environment is open to its owner only. So CapyCTL hands
the key over in the environment; this module takes it out of the environment (nothing SGLang
starts inherits it), adds `--api-key=<key>` to sys.argv in this process and runs
`sglang.launch_server` as __main__, as `python -m sglang.launch_server` would. It runs inside
the engine's environment, so it uses the standard library only.
"""

from __future__ import annotations

import os
import runpy
import sys

KEY_VARIABLE = "CAPYCTL_ENGINE_API_KEY"
SERVER = "sglang.launch_server"


def main() -> None:
    key = os.environ.pop(KEY_VARIABLE, None)
    if key is None:
        raise SystemExit(f"{KEY_VARIABLE} is not set: it holds the key SGLang is started with")
    sys.argv.append(f"--api-key={key}")  # one token, even if the key were to begin with "-"
    runpy.run_module(SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
