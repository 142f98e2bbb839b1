"""The status page's session mark and form key: signed with the admin token, so another
token's sessions and forms are refused, and neither reveals the token."""

from __future__ import annotations

from capyctl_scheduler.page import session

TOKEN = "a" * 43
OTHER = "b" * 43


def test_a_session_mark_is_the_tokens_own_and_does_not_reveal_it() -> None:
    assert session.mark(TOKEN) == session.mark(TOKEN)
    assert session.mark(TOKEN) != session.mark(OTHER)
    assert TOKEN not in session.mark(TOKEN)


def test_a_form_key_belongs_to_one_session() -> None:
    one, two = "session-one", "session-two"
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
