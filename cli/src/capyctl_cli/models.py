"""`capyctl model pull` and `capyctl model remove`: a host's model store, ahead of any
deployment.

A pull resolves a branch or tag to its commit here (as `deploy model` pins one), then the
host's hostd downloads that commit into its store; this command follows it with a progress
bar until it is done. A removal is refused while a deployment names the model or an engine
runs from it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Annotated

import typer

from capycommon.deployments.resolve import HUB_STORE
from capycommon.errors import AgentUnreachable, CapyError
from capycommon.hub import HubSource
from capycommon.management import Download, PullRequest, RemoveRequest, StoreOperationAnswer
from capycommon.paths import StatePaths, resolve_state_dir
from capyctl_cli import output
from capyctl_cli.management import Management
from capyctl_cli.options import JsonOpt, StateDirOpt, command_group, expected_errors
from capyctl_cli.pin import resolve_commit
from capyctl_cli.progress import DownloadBar

model_app = command_group("Download models into a host's store ahead of time, or remove them.")

# How long hostd may take to begin an operation before the CLI says it is not there.
TAKEN_WITHIN_S = 60.0
POLL_S = 0.25

HostOpt = Annotated[
    str | None,
    typer.Option(
        "--host", help="The host (may be left out where there is one).", show_default=False
    ),
]


def split_source(text: str) -> tuple[str, str]:
    """`org/name[@revision]` as (repository, revision); `main` when none is written."""
    repo, _, revision = text.partition("@")
    return repo, revision or "main"


@model_app.command("pull")
@expected_errors
def pull_model(
    source: Annotated[str, typer.Argument(help="ORG/NAME[@REVISION] on the Hugging Face Hub.")],
    host: HostOpt = None,
    files: Annotated[
        list[str] | None,
        typer.Option("--files", help="Only files matching this pattern (repeat for more)."),
    ] = None,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="Follow it to its end.")] = True,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Download a model from the Hub into a host's store, for deployments to start from."""
    repo, revision = split_source(source)
    root, _ = resolve_state_dir(state_dir, dict(os.environ))
    wanted = HubSource(repo, revision, tuple(files or ()))
    commit = resolve_commit(wanted, root)
    with Management(StatePaths(root)) as api:
        request = PullRequest(repo=repo, revision=commit, files=list(wanted.files), host=host)
        answer = api.pull(request)
        if wait:
            with DownloadBar() as bar:
                answer = follow(api, answer, seen=bar.show)
    pinned = "" if revision == commit else f" ({revision})"
    told = f"{repo}@{commit}{pinned} "
    told += f"is in the store of host {answer.host}: {answer.name}" if wait else "is downloading"
    output.show(answer, told, as_json=as_json)


@model_app.command("remove")
@expected_errors
def remove_model(
    name: Annotated[
        str,
        typer.Argument(
            help=f"A download as capyctl list models names it ({HUB_STORE}/...), or "
            "ORG/NAME@COMMIT for a whole repository."
        ),
    ],
    host: HostOpt = None,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove a download from a host's store; refused while a deployment uses it."""
    if not name.startswith(f"{HUB_STORE}/"):
        repo, commit = split_source(name)
        name = f"{HUB_STORE}/{HubSource(repo).store_name(commit)}"
    root, _ = resolve_state_dir(state_dir, dict(os.environ))
    with Management(StatePaths(root)) as api:
        answer = follow(api, api.remove(RemoveRequest(name=name, host=host)))
    output.show(answer, f"removed {answer.name} from host {answer.host}", as_json=as_json)


def follow(
    api: Management,
    sent: StoreOperationAnswer,
    seen: Callable[[Download | None], None] | None = None,
) -> StoreOperationAnswer:
    """Poll the operation until it is done (its answer) or failed (its error); `seen` is told
    its download figures each time."""
    taken_by = time.monotonic() + TAKEN_WITHIN_S
    current = sent
    while True:
        if seen is not None:
            seen(current.download)
        if current.state == "done":
            return current.model_copy(update={"kind": sent.kind, "name": sent.name})
        if current.state == "failed":
            raise CapyError(current.message or f"the {sent.kind} failed", code=current.code)
        if current.state == "sent" and time.monotonic() > taken_by:
            raise AgentUnreachable(
                f"hostd on host {sent.host} did not begin the {sent.kind} of {sent.name} within "
                f"{TAKEN_WITHIN_S:.0f} s; is it running? (capyctl status host {sent.host})"
            )
        time.sleep(POLL_S)
        current = api.store_operation(sent.host, sent.operation_id)
