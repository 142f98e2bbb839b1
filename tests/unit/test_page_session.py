"""The status page's session cookie and form key: signed with the admin token, expiring,
and refused when tampered with or signed by another token."""

from __future__ import annotations

from capyctl_scheduler.page import session

TOKEN = "a" * 43
OTHER = "b" * 43


def test_a_session_lasts_its_lifetime_and_no_longer() -> None:
    value = session.issue(TOKEN, now=1000.0)
    assert session.valid(value, TOKEN, now=1000.0)
    assert session.valid(value, TOKEN, now=1000.0 + session.LIFETIME_S - 1)
    assert not session.valid(value, TOKEN, now=1000.0 + session.LIFETIME_S)


def test_a_session_holds_no_token_and_opens_nothing_once_changed() -> None:
    value = session.issue(TOKEN, now=1000.0)
    assert TOKEN not in value
    version, expires, signature = value.split(".")
    later = f"{version}.{int(expires) + 3600}.{signature}"
    assert not session.valid(later, TOKEN, now=1000.0)
    assert not session.valid(value, OTHER, now=1000.0)
    assert not session.valid(value[:-1] + ("0" if value[-1] != "0" else "1"), TOKEN, 1000.0)
    for junk in ("", "v1", "v1..", "v2.99999999999.x", "v1.abc.def", None):
        assert not session.valid(junk, TOKEN, now=1000.0)


def test_a_form_key_belongs_to_one_session() -> None:
    one, two = session.issue(TOKEN, now=1000.0), session.issue(TOKEN, now=2000.0)
    key = session.form_key(TOKEN, one)
    assert session.form_key_valid(key, TOKEN, one)
    assert not session.form_key_valid(key, TOKEN, two)
    assert not session.form_key_valid(key, OTHER, one)
    assert not session.form_key_valid("", TOKEN, one)


def test_only_the_admin_token_in_the_header_counts() -> None:
    assert session.is_admin_header(f"Bearer {TOKEN}", TOKEN)
    assert session.is_admin_header(f"bearer  {TOKEN} ", TOKEN)
    for header in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {OTHER}", "Bearer "):
        assert not session.is_admin_header(header, TOKEN)
