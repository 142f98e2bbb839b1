"""The status page's HTML, rendered on the server from a `PageView`.

Each section (`hosts`, `deployments`, `timeline`, `engines`) renders on its own, so the live
updates send only the sections that changed. Times are written as UTC clock times, which
the page's script turns into "2 min ago" and "in 3 min"; with scripts off they stay as
written. Memory bars are inline SVG (sized by attributes, so the page needs no inline style
and its Content-Security-Policy allows no inline code at all).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from html import escape

from capycommon.units import format_duration, format_size
from capycommon.version import __version__
from capyctl_scheduler.page.view import Bar, DeploymentLine, HostLine, Moment, PageView

# The width of a memory bar in its SVG's units.
BAR_UNITS = 1000
Render = Callable[[PageView], str]
SECTIONS: dict[str, Render] = {}

# What each button asks before it acts.
QUESTIONS = {
    "park": "Park {name}? Its engine gives its GPU memory back; the next request wakes it.",
    "wake": "Wake {name}? Its engine takes its GPU memory back.",
    "start": "Start {name}? Its engine starts on a GPU with room for it.",
    "stop": "Stop {name}? Its engine ends, and requests get deployment_stopped until a start.",
    "drain": "Drain host {name}? Every engine on it stops; its deployments stay on demand.",
}


def section(name: str, title: str) -> Callable[[Render], Render]:
    """Register a section's content under its element id, `name`: the page shows it inside
    `<section id=name>` headed by `title`."""

    def register(content: Render) -> Render:
        def render(view: PageView) -> str:
            return f'<section id="{name}"><h2>{title}</h2>{content(view)}</section>'

        SECTIONS[name] = render
        return content

    return register


def sections(view: PageView) -> dict[str, str]:
    """Each section's HTML, by its element id."""
    return {name: render(view) for name, render in SECTIONS.items()}


def page(view: PageView, form_key: str, notice: str = "") -> str:
    body = "".join(sections(view).values())
    head = _head("CapyCTL status", form_key)
    return (
        f"{head}<body>{_header(signed_in=True)}"
        f'<p id="notice" role="status">{escape(notice)}</p>'
        f"<main>{body}</main>"
        '<noscript><p class="quiet">Scripts are off: reload the page to see changes.</p>'
        "</noscript></body></html>"
    )


def login(message: str = "") -> str:
    refused = f'<p class="refused" role="alert">{escape(message)}</p>' if message else ""
    return (
        f"{_head('CapyCTL: log in', '')}<body>{_header(signed_in=False)}<main>"
        '<section class="login"><h2>Log in</h2>'
        "<p>Give the admin token (in the state dir's <code>identity/credentials</code>, or "
        "<code>capyctl config show</code>). The API key opens the inference endpoint, not "
        "this page.</p>"
        f"{refused}"
        '<form method="post" action="/login">'
        '<label for="token">Admin token</label>'
        '<input id="token" name="token" type="password" autocomplete="current-password" '
        "required>"
        '<button type="submit">Log in</button></form></section></main></body></html>'
    )


def confirm(target: str, name: str, action: str, form_key: str, key: str) -> str:
    """The confirmation a button asks for where scripts are off (with scripts, a dialog)."""
    fields = _hidden(target=target, name=name, action=action, form_key=form_key, key=key)
    return (
        f"{_head('CapyCTL: confirm', form_key)}<body>{_header(signed_in=True)}<main>"
        f'<section class="confirm"><h2>{escape(action.capitalize())} {escape(name)}</h2>'
        f"<p>{escape(QUESTIONS[action].format(name=name))}</p>"
        f'<form method="post" action="/actions">{fields}'
        f'<button type="submit" class="danger">{escape(action.capitalize())}</button> '
        '<a href="/">Cancel</a></form></section></main></body></html>'
    )


def _head(title: str, form_key: str) -> str:
    key = f'<meta name="capyctl-form-key" content="{escape(form_key)}">' if form_key else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="color-scheme" content="light dark">'
        f"<title>{escape(title)}</title>{key}"
        '<link rel="stylesheet" href="/static/page.css">'
        '<script src="/static/page.js" defer></script></head>'
    )


def _header(signed_in: bool) -> str:
    out = (
        '<form method="post" action="/logout"><button type="submit">Log out</button></form>'
        if signed_in
        else ""
    )
    live = '<span id="live" class="live" hidden>live</span>' if signed_in else ""
    return (
        f'<header><h1><a href="/">CapyCTL</a></h1><span class="quiet">{__version__}</span>'
        f"{live}{out}</header>"
    )


# Sections ---------------------------------------------------------------------------------


@section("hosts", "Memory")
def _hosts(view: PageView) -> str:
    return "".join(_host(host) for host in view.hosts) or '<p class="quiet">No host yet.</p>'


@section("deployments", "Deployments")
def _deployments(view: PageView) -> str:
    rows = "".join(_deployment(d) for d in view.deployments)
    return rows or '<p class="quiet">No deployment yet: <code>capyctl deploy model</code>.</p>'


@section("timeline", "Lifecycle")
def _timeline(view: PageView) -> str:
    rows = "".join(_moment(m) for m in view.timeline)
    return f'<ol class="timeline">{rows}</ol>' if rows else '<p class="quiet">Nothing yet.</p>'


@section("engines", "Engines")
def _engines(view: PageView) -> str:
    rows = "".join(
        f"<tr><td>{escape(e.host)}</td><td>{escape(e.name)}</td><td>{escape(e.family)}</td>"
        f"<td>{escape(e.version)}</td><td>{'yes' if e.verified else 'no'}</td></tr>"
        for host in view.hosts
        for e in host.engines
    )
    if not rows:
        return '<p class="quiet">None registered: <code>capyctl engine add PATH</code>.</p>'
    return (
        '<div class="scroll"><table><thead><tr>'
        "<th>Host</th><th>Name</th><th>Family</th><th>Version</th><th>Verified</th>"
        f"</tr></thead><tbody>{rows}</tbody></table></div>"
    )


def _host(host: HostLine) -> str:
    flags = " drained" if host.drained else ""
    reading = f" · reading {_time(host.reading_at)}" if host.reading_at else " · no reading"
    bars = "".join(_bar(bar) for bar in host.bars) or '<p class="quiet">No memory reading.</p>'
    drain = "" if host.drained else _button("host", host.name, "drain")
    return (
        f'<article class="host" data-host="{escape(host.name)}">'
        f'<h3>{escape(host.name)} <span class="state {escape(host.state)}">'
        f"{escape(host.state)}{flags}</span></h3>"
        f'<p class="quiet">{len(host.engines)} engines{reading}</p>'
        f'<div class="actions">{drain}</div>{bars}</article>'
    )


def _bar(bar: Bar) -> str:
    rects = []
    x = 0
    for part in bar.segments:
        width = round(part.bytes * BAR_UNITS / bar.capacity) if bar.capacity else 0
        width = min(width, BAR_UNITS - x)
        if width <= 0:
            continue
        tip = f"{part.label}: {format_size(part.bytes)} ({part.source})"
        rects.append(
            f'<rect class="{part.kind}" x="{x}" y="0" width="{width}" height="24">'
            f"<title>{escape(tip)}</title></rect>"
        )
        x += width
    legend = "".join(
        f'<li class="{part.kind}" data-kind="{part.kind}" data-bytes="{part.bytes}">'
        f'<span class="swatch"></span>{escape(part.label)} '
        f"<b>{format_size(part.bytes)}</b> "
        f'<span class="source">{escape(part.source)}</span></li>'
        for part in bar.segments
        if part.bytes > 0 or part.kind == "free"
    )
    measured = (
        f" · measured in use {format_size(bar.measured_used)}"
        if bar.measured_used is not None
        else ""
    )
    return (
        f'<figure class="bar" data-domain="{escape(bar.domain)}">'
        f"<figcaption><b>{escape(bar.domain)}</b> {format_size(bar.capacity)} "
        f'<span class="source">{escape(bar.capacity_source)}</span>{measured}</figcaption>'
        f'<svg viewBox="0 0 {BAR_UNITS} 24" preserveAspectRatio="none" role="img" '
        f'aria-label="{escape(bar.domain)} memory">{"".join(rects)}</svg>'
        f'<ul class="legend">{legend}</ul></figure>'
    )


def _deployment(line: DeploymentLine) -> str:
    where = ", ".join(
        f"{p.host}/{p.gpu or '?'} {p.state} since {_time(p.since)}" for p in line.placements
    )
    step = ""
    if line.next_step is not None:
        action, at = line.next_step
        step = f"{action} {_time(at)}"
    used = _time(line.last_used) if line.last_used is not None else "—"
    note = f'<p class="refused">{escape(line.note)}</p>' if line.note else ""
    buttons = "".join(_button("deployment", line.name, a) for a in line.actions)
    api = "" if line.api == "chat" else f' <span class="quiet">{escape(line.api)}</span>'
    return (
        f'<article class="deployment" data-deployment="{escape(line.name)}" '
        f'data-state="{escape(line.state)}">'
        f"<h3>{escape(line.name)}{api} "
        f'<span class="state {escape(line.state)}">{escape(line.state)}</span></h3>'
        "<dl>"
        f"<dt>Where</dt><dd>{where or '—'}</dd>"
        f'<dt>Requests</dt><dd><span class="running">{line.running}</span> running, '
        f'<span class="waiting">{line.waiting}</span> waiting</dd>'
        f"<dt>Last use</dt><dd>{used}</dd>"
        f"<dt>Next idle step</dt><dd>{step or '—'}</dd>"
        f"<dt>Routes</dt><dd>{escape(', '.join(line.routes))}</dd>"
        f'</dl>{note}<div class="actions">{buttons}</div></article>'
    )


def _moment(moment: Moment) -> str:
    took = f" in {_took(moment.duration_s)}" if moment.duration_s else ""
    kind = "failed" if moment.failed else moment.what
    where = f"on {escape(moment.host)}: " if moment.host else ""
    return (
        f'<li class="{escape(kind)}" data-what="{escape(moment.what)}" '
        f'data-deployment="{escape(moment.deployment)}">'
        f"{_time(moment.at)} <b>{escape(moment.deployment)}</b> "
        f'<span class="what">{escape(moment.what)}</span>{took} '
        f'<span class="quiet">{where}{escape(moment.reason)}</span></li>'
    )


def _took(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 60 else format_duration(seconds)


def _button(target: str, name: str, action: str) -> str:
    """An operator's button: a form that asks for confirmation first (`/confirm`)."""
    question = QUESTIONS[action].format(name=name)
    return (
        f'<form method="get" action="/confirm" class="act">'
        f"{_hidden(target=target, name=name, action=action)}"
        f'<button type="submit" data-action="{action}" data-confirm="{escape(question)}">'
        f"{action}</button></form>"
    )


def _hidden(**fields: str) -> str:
    return "".join(
        f'<input type="hidden" name="{escape(k)}" value="{escape(v)}">' for k, v in fields.items()
    )


def _time(at: float | None) -> str:
    """A moment as a UTC clock time the script shows relative to now."""
    if at is None:
        return "—"
    clock = time.strftime("%H:%M:%S UTC", time.gmtime(at))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return f'<time datetime="{stamp}" data-at="{int(at)}">{clock}</time>'
