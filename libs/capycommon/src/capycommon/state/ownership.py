"""Which instance records the control plane believes: a host speaks only for itself.

A joined host writes its own prefix as it likes, so nothing it writes may decide where a
deployment runs. The store already refuses a record whose data names another host than the
prefix it was read from (`InstanceStore`); here a record is weighed against the scheduler's
own choices, kept in the deployment's record: the generation it last drew, and the host it
placed that generation on. A record of a generation the scheduler never drew, or of the
current generation on a host it did not place it on, is refused (logged once, counted). The
deployment's instance is its highest believed record on the host it is placed on; every
other live record is an orphan, stopped on its own host and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import LIVE_STATES, InstanceRecord
from capycommon.state import keys, quarantine


def refusal(record: InstanceRecord, deployment: DeploymentRecord) -> str | None:
    """Why `record` (read under its own host's prefix) cannot be its deployment's instance
    by the scheduler's choices; None when it can be, or is merely an older generation."""
    if record.generation > deployment.generation:
        return (
            f"{record.member} of host {record.host} claims generation {record.generation}; "
            f"the scheduler drew {deployment.generation}"
        )
    placed = deployment.host
    if placed is not None and record.host != placed and record.generation == deployment.generation:
        return (
            f"{record.member} of host {record.host} claims generation {record.generation}, "
            f"which the scheduler placed on host {placed}"
        )
    return None


def candidate(record: InstanceRecord, deployment: DeploymentRecord) -> bool:
    """Whether `record`, believed, may be the deployment's instance: one of its instance 0,
    on the host its generation is placed on (any host, for a record that names none)."""
    placed = deployment.host
    return record.instance == 0 and (placed is None or record.host == placed)


def refuse(record: InstanceRecord, why: str) -> None:
    """Log and count a record refused here (once per value)."""
    key = keys.instance(record.host, record.deployment, record.instance)
    quarantine.REFUSALS.refuse(key, record.model_dump_json(), why)


def owners(
    records: Iterable[InstanceRecord], deployments: Mapping[str, DeploymentRecord]
) -> tuple[dict[str, InstanceRecord], list[InstanceRecord]]:
    """Each deployment's instance (its highest believed candidate), and the live records
    nobody owns: a deleted deployment's, an older generation still running, or one refused
    (its engine, if any, runs on its own host: it is stopped there)."""
    instances: dict[str, InstanceRecord] = {}
    orphans: list[InstanceRecord] = []
    for record in sorted(records, key=lambda r: (-r.generation, r.host)):
        deployment = deployments.get(record.deployment)
        why = None if deployment is None else refusal(record, deployment)
        if why is not None:
            refuse(record, why)
        owned = deployment is not None and why is None and candidate(record, deployment)
        if owned and record.deployment not in instances:
            instances[record.deployment] = record
        elif record.state in LIVE_STATES or record.cache is not None:
            orphans.append(record)  # a live engine, or an LMCache server a park kept
    return instances, orphans
