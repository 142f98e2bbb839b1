"""Pinning a Hugging Face source at deploy: `model: {hf: org/name}` (with an optional branch
or tag in `revision`) becomes `{hf: org/name@<commit>}`, resolved once.

A deployment declared before from the same repository, revision and files keeps the commit
it was pinned to, so deploying the same document again changes nothing; `--refresh` asks the
Hub again. The commit is what every host downloads and what status shows.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from capycommon.deployments import Deployment
from capycommon.domain.deployment import ModelSource
from capycommon.errors import CapyError, NotFound
from capycommon.hub import HubSource, hub_access, resolve
from capyctl_cli.management import Management


def pin(
    document: dict[str, Any],
    deployment: Deployment,
    api: Management,
    state_dir: Path,
    refresh: bool,
) -> tuple[dict[str, Any], str | None]:
    """The document with its Hugging Face source pinned, and how (None: nothing to pin)."""
    model = deployment.model
    if model.hf_repo is None or model.hf_commit is not None:
        return document, None
    revision = model.revision or "main"
    commit = None if refresh else _pinned_before(api, deployment.name, model)
    how = f"{model.hf_repo} {revision} pinned to {{commit}} (as deployed before)"
    if commit is None:
        commit = resolve_commit(HubSource(model.hf_repo, revision, model.files), state_dir)
        how = f"{model.hf_repo} {revision} resolved to {{commit}}"
    pinned = model.pinned(commit)
    fields = pinned.model_dump(mode="json", exclude_defaults=True, exclude={"path"})
    return {**document, "model": fields}, how.format(commit=commit)


def resolve_commit(source: HubSource, state_dir: Path) -> str:
    """The commit `source.revision` names on the Hub, asked with the role's Hub access."""
    access = hub_access(state_dir, os.environ)
    return asyncio.run(resolve(source, endpoint=access.endpoint, token=access.token))


def _pinned_before(api: Management, name: str, model: ModelSource) -> str | None:
    """The commit the current deployment of `name` pinned for the same source, if any."""
    try:
        current = api.status(name).document.get("model")
    except CapyError as exc:
        if exc.code == NotFound.code:
            return None
        raise
    if not isinstance(current, dict):
        return None
    before = ModelSource.model_validate(current)
    same = (before.hf_repo, before.revision or "main", before.files) == (
        model.hf_repo,
        model.revision or "main",
        model.files,
    )
    return before.hf_commit if same else None
