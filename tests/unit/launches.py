"""Deployments resolved as the scheduler resolves them (`capycommon.deployments.resolve`, from
the facts a host publishes), and the engine terms they launch with, for the sizing tests."""

from __future__ import annotations

from typing import Any

from capycommon.deployments import HostFacts, Resolved, parse_deployment, resolve
from capycommon.domain.models import HostModels, ModelFacts
from capycommon.engines.families import Family
from capyctl_scheduler.engineterms import EngineTerms, terms_of
from support import engine_profile

GiB = 1 << 30
ROOT = "/srv/models"
HOST = HostFacts(unified=False, parked_room=32 * GiB, gpus=("gpu0", "gpu1"))


def resolved(
    family: Family,
    weights: int,
    name: str = "m",
    version: str | None = None,
    host: HostFacts = HOST,
    **document: Any,
) -> Resolved:
    """Deployment `name` of a model of `weights` bytes on the host's `family` engine (at
    `version`, else the tests' one), with the other fields of `document`."""
    profile = engine_profile(family)
    if version is not None:
        profile = profile.model_copy(update={"version": version})
    if family == Family.LLAMACPP:
        document.setdefault("engine_config", {}).setdefault("context_length", 8192)
    deployment = parse_deployment(
        {"name": name, "engine": family.value, "model": name, **document}, "test"
    )
    facts = ModelFacts(path=f"{ROOT}/{name}", kind="folder", weights_bytes=weights)
    models = HostModels(models_root=ROOT, models={name: facts})
    return resolve(deployment, profiles={profile.name: profile}, models=models, host=host)


def terms(family: Family, capacity: int, **document: Any) -> EngineTerms:
    """The terms a deployment of `family` with `document` launches with on a card of
    `capacity` bytes."""
    return terms_of(resolved(family, GiB, **document), capacity)
