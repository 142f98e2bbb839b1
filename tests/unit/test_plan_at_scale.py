"""One plan over 100 deployments on 10 hosts: the actions a small case plans, at scale."""

from __future__ import annotations

from collections import defaultdict

from capyctl_scheduler.actions import Action
from capyctl_scheduler.charges import charged
from capyctl_scheduler.policy import plan, quiet_until
from plan import FITS, IDLE, LAYOUT, SWITCH, deployment_name, snapshot

# bench/plan.py's scene: on each of 10 hosts, ten deployments laid out as its LAYOUT.
HOSTS = 10


def _by_deployment(actions: list[Action]) -> dict[str, list[Action]]:
    found: dict[str, list[Action]] = defaultdict(list)
    for action in actions:
        found[action.deployment].append(action)
    return found


def test_a_plan_of_100_deployments_on_10_hosts_is_sane() -> None:
    scene = snapshot(hosts=HOSTS)
    assert (len(scene.deployments), len(scene.hosts)) == (100, 10)
    actions = plan(scene)
    by_name = _by_deployment(actions)
    assert set(by_name) <= set(scene.deployments)

    serving = {
        deployment_name(h, i) for h in range(HOSTS) for i, (_, _, s) in enumerate(LAYOUT) if s
    }
    assert not serving & set(by_name), "a model serving requests is never drained or stopped"
    for h in range(HOSTS):
        idle = [a for a in by_name[deployment_name(h, IDLE)] if a.reason == "idle for 5m"]
        assert [(a.kind, a.then) for a in idle] == [("drain", "park")], "idle: it parks"
        for i in (1, 3, 5, 6, 7):
            assert deployment_name(h, i) not in by_name, "an idle model within its timeouts stays"

    starts = [a for a in actions if a.kind == "start"]
    assert sorted(a.deployment for a in starts) == [deployment_name(h, FITS) for h in range(HOSTS)]
    assert len({(a.host, a.gpu) for a in starts}) == len(starts), "one start per GPU"
    for start in starts:
        footprint = scene.bindings[start.deployment][start.host].footprints[start.gpu]
        # Admission raises when the start would break a limit of its GPU or host.
        charged(scene, start.host).admit(start.deployment, footprint.charge("starting"))

    for h in range(HOSTS):
        name = deployment_name(h, SWITCH)
        (wait,) = by_name[name]
        assert wait.kind == "wait"
        assert wait.reason.startswith("switch: releasing ")
        victims = wait.reason.removeprefix("switch: releasing ").split(" to ")[0].split(", ")
        for victim in victims:
            assert victim not in serving
            assert any(
                a.kind == "drain" and a.reason.startswith(f"switch to {name}")
                for a in by_name[victim]
            )
    assert quiet_until(scene, actions) is None, "demands keep the loop at its pace"
