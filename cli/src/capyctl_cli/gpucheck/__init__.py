"""The GPU check: CapyCTL on a real NVIDIA GPU, in under five minutes, with nothing to download.

`scripts/gpu-check` runs it from a clone's .venv or from a release executable
(`PEX_MODULE=capyctl_cli.gpucheck capyctl-<version>-linux-<arch>.pex`); so does
`python -m capyctl_cli.gpucheck` wherever capyctl is installed. Each step prints one line,
PASS, FAIL or SKIP, with its figures:

1. memwatch's NVML backend credits a child's allocation to the child's PID and sees it
   released (`attribution`);
2. the NVML-gated tests pass, from a clone (`nvmltests`);
3. `capyctl start standalone` reads the GPU through NVML and stops (`rolestep`);
4. the engine simulator as vLLM with its memory made real (`enginesim.cuda`): cold start,
   park, wake, and the startup peak memwatch measured against NVML's (`enginesteps`);
5. three models that do not all fit, asked in turn, all answered, with the most the GPU held;
6. a drain that leaves 0 bytes of the check's processes on the GPU.

Where the machine lacks what a step needs (an NVIDIA GPU, redis-server, torch for steps 4 to
6) that step says SKIP with what is missing; the exit status is 1 only when a step failed.
Everything runs in a temporary folder, removed at the end unless a step failed (its logs are
kept there, and named).
"""
