"""The status page's HTML from a view: the memory bars' widths, the buttons a state offers,
the timeline's order, and that nothing an engine or an operator wrote becomes markup."""

from __future__ import annotations

import re

from capycommon.domain.desired import Choice
from capycommon.domain.instances import Event
from capycommon.management import EngineRow
from capyctl_scheduler.page import render
from capyctl_scheduler.page.view import (
    ACTIONS,
    Bar,
    DeploymentLine,
    HostLine,
    PageView,
    Placement,
    Segment,
    timeline,
)

GiB = 1 << 30
HOSTILE = '<img src=x onerror="alert(1)">'


def bar(*segments: Segment, capacity: int = 24 * GiB) -> Bar:
    return Bar("h1", "gpu0", capacity, "nvml reading", segments, measured_used=3 * GiB)


def host(name: str, *bars: Bar) -> HostLine:
    engine = EngineRow(
        host=name,
        name="vllm",
        family="vllm",
        version="0.29.0",
        executable="/x/bin/vllm",
        install_path="/x",
        fingerprint="f",
        verified=True,
        added_at=0.0,
    )
    return HostLine(name, "ready", False, True, bars, (engine,), reading_at=100.0)


def line(name: str, state: str, note: str = "") -> DeploymentLine:
    return DeploymentLine(
        name=name,
        state=state,
        api="chat",
        routes=(name,),
        placements=(Placement("h1", "gpu0", state, 90.0),),
        running=2,
        waiting=3,
        last_used=95.0,
        next_step=("park", 400.0),
        note=note,
        actions=ACTIONS.get(state, ()),
    )


def event(at: float, to_state: str, deployment: str = "a", reason: str = "r") -> Event:
    return Event(
        kind="transition",
        host="h1",
        deployment=deployment,
        instance=0,
        generation=1,
        from_state="x",
        to_state=to_state,
        reason=reason,
        duration_s=1.5,
        at=at,
    )


def test_a_bar_is_split_by_what_holds_the_memory_within_its_width() -> None:
    parts = (
        Segment("ready", 14 * GiB, "a ready", "measured"),
        Segment("parked", 1 * GiB, "b parked", "declared"),
        Segment("reserve", 2 * GiB, "free reserve", "role setting"),
        Segment("free", 7 * GiB, "free", "capacity less charges and reserve"),
    )
    html = render.sections(PageView(100.0, (host("h1", bar(*parts)),), (), ()))["hosts"]
    widths = [int(w) for w in re.findall(r'<rect class="\w+" x="\d+" y="0" width="(\d+)"', html)]
    assert widths == [583, 42, 83, 292]
    assert sum(widths) <= render.BAR_UNITS
    for source in ("measured", "declared", "role setting", "nvml reading"):
        assert source in html
    assert "measured in use 3.0 GiB" in html
    # More charged than the capacity (an engine nobody can size) never overflows the bar.
    over = bar(Segment("ready", 30 * GiB, "x ready", "unsized"))
    html = render.sections(PageView(100.0, (host("h1", over),), (), ()))["hosts"]
    assert re.findall(r'width="(\d+)"', html) == [str(render.BAR_UNITS)]


def test_each_host_and_its_engines_are_shown() -> None:
    view = PageView(100.0, (host("h1", bar()), host("h2", bar())), (), ())
    parts = render.sections(view)
    assert 'data-host="h1"' in parts["hosts"]
    assert 'data-host="h2"' in parts["hosts"]
    assert parts["engines"].count("<td>vllm</td>") == 4  # a name and a family per host


def test_the_buttons_are_those_the_cli_offers_in_each_state() -> None:
    html = render.sections(
        PageView(100.0, (), (line("a", "ready"), line("b", "parked"), line("c", "stopped")), ())
    )["deployments"]

    def buttons(name: str) -> list[str]:
        article = html.split(f'data-deployment="{name}"')[1].split("</article>")[0]
        return re.findall(r'data-action="(\w+)"', article)

    assert buttons("a") == ["park", "stop"]
    assert buttons("b") == ["wake", "stop"]
    assert buttons("c") == ["start"]
    assert "Park a? Its engine gives its GPU memory back" in html
    assert '<span class="running">2</span> running, <span class="waiting">3</span>' in html


def test_the_timeline_is_newest_first_and_keeps_only_lifecycle_moments() -> None:
    events = [
        event(10.0, "starting"),
        event(12.0, "ready"),
        event(20.0, "parking"),
        event(21.0, "parked"),
        event(30.0, "failed", reason="engine exited with code 1"),
        event(31.0, "reconciling"),
    ]
    moments = timeline(events)
    assert [m.what for m in moments] == ["failed", "parked", "park", "ready", "start"]
    assert moments[0].failed
    assert [m.duration_s for m in moments] == [None, 1.5, None, 1.5, None]


def test_nothing_written_by_an_engine_or_an_operator_becomes_markup() -> None:
    view = PageView(
        100.0,
        (),
        (line("a", "failed", note=HOSTILE),),
        timeline([event(10.0, "failed", reason=HOSTILE)]),
    )
    page = render.page(view, form_key='"><script>', notice=HOSTILE)
    assert HOSTILE not in page
    assert "<script>" not in page.replace('<script src="/static/page.js" defer></script>', "")
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page


def test_the_timeline_has_the_schedulers_switches_and_refusals() -> None:
    def chosen(kind: str, at: float, **fields: object) -> Choice:
        return Choice.model_validate(
            {"kind": kind, "deployment": "b", "reason": kind, "at": at, **fields}
        )

    choices = [
        chosen("switched", 40.0, host="h1", duration_s=2.5, engine_s=1.0),
        chosen("refuse", 50.0),
        chosen("evicted", 45.0, cause="switch"),  # the host's park says it already
        chosen("start", 35.0),
    ]
    moments = timeline([event(30.0, "starting")], choices)
    assert [(m.what, m.failed, m.duration_s) for m in moments] == [
        ("refused", True, None),
        ("switch", False, 2.5),
        ("start", False, None),
    ]
    html = render.sections(PageView(100.0, (), (), moments))["timeline"]
    assert "switch</span> in 2.5 s" in html, html
    assert '<span class="quiet">refuse</span>' in html
