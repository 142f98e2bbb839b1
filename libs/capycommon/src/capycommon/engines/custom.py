"""A custom engine: any OpenAI-compatible server, started from the command its registration
gives (`engines.template`), ready once its readiness path answers 200, always restart-only
and sized by the deployment's `resources`. It gets what every engine gets: the closed
environment, one GPU, its log, its memory attributed by process group, a hang-up closing
its connection, and a stop that settles what was cut. Its key reaches it only where its
registration names the variable it reads (`key_env`); the command line never carries it.
"""

from __future__ import annotations

from capycommon.engines import template
from capycommon.engines.launch import (
    ENGINE_HOST,
    LaunchPlan,
    LaunchSpec,
    check_extra_args,
    check_restart_only,
    unmetered_capabilities,
)

capabilities = unmetered_capabilities
RESERVED: frozenset[str] = frozenset()


def reserved_flags(command: tuple[str, ...]) -> frozenset[str]:
    """The long options the template sets: a deployment's extra arguments may not repeat
    them."""
    return frozenset(word.split("=", 1)[0] for word in command if word.startswith("--"))


def plan(spec: LaunchSpec) -> LaunchPlan:
    check_restart_only(spec, "a custom engine")
    profile = spec.profile
    values = {
        "port": str(spec.port),
        "model": str(spec.model_path),
        "served_name": spec.served_name,
        "host": ENGINE_HOST,
    }
    argv = template.render(profile.command, values)
    argv += check_extra_args(
        f"custom engine {profile.name}", spec.tuning.extra_args, reserved_flags(profile.command)
    )
    env = {profile.key_env: spec.api_key} if profile.key_env else {}
    return LaunchPlan(argv, env)
