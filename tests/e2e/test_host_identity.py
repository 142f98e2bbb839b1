"""A state dir keeps its host's name: a later start under another name is refused."""

from __future__ import annotations

import shutil

from capycommon.hostsettings import machine_host_name
from ports import free_port
from support import capyctl, clean_env, processes_mentioning, short_dir, start_role


def test_a_start_under_another_name_is_refused() -> None:
    root = short_dir("ident")
    state = root / "state"
    try:
        first = start_role("standalone", state_dir=state, env=clean_env(CAPYCTL_HOST_NAME="alpha"))
        assert (state / "identity" / "host-name").read_text() == "alpha\n"
        assert first.stop() == 0

        listeners = [
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--management-listen",
            f"127.0.0.1:{free_port()}",
        ]
        env = clean_env(CAPYCTL_HOST_NAME="beta")
        result = capyctl("start", "standalone", "--state-dir", str(state), *listeners, env=env)
        assert result.returncode == 2, result.stderr
        kept = state / "identity" / "host-name"
        assert result.stderr == (
            f"error [host_name_changed]: this state dir belongs to host 'alpha' (kept in {kept} "
            "since its first start), but this start is host 'beta' (from CAPYCTL_HOST_NAME); "
            "start it as alpha: keep the hostname (a container: docker run --hostname alpha) or "
            "set host.name: alpha (--host-name alpha or CAPYCTL_HOST_NAME=alpha); a new host "
            "needs another --state-dir\n"
        )
        assert processes_mentioning(str(state)) == []
        assert kept.read_text() == "alpha\n", "the kept name is not replaced"

        again = start_role("standalone", state_dir=state, extra=["--host-name", "alpha"])
        assert [host["host"] for host in again.status()["hosts"]] == ["alpha"]
        assert again.stop() == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_name_defaults_to_the_hostname_and_is_kept_by_init() -> None:
    root = short_dir("ident")
    state = root / "state"
    try:
        result = capyctl("init", "standalone", "--state-dir", str(state))
        assert result.returncode == 0, result.stderr
        assert (state / "identity" / "host-name").read_text() == f"{machine_host_name()}\n"
        shown = capyctl("config", "show", "--state-dir", str(state), "--host-name", "other")
        assert shown.returncode == 0, "config show only shows; it checks nothing"
        refused = capyctl(
            "init",
            "standalone",
            "--state-dir",
            str(state),
            env=clean_env(CAPYCTL_HOST_NAME="other"),
        )
        assert refused.returncode == 2
        assert refused.stderr.startswith("error [host_name_changed]: this state dir belongs to")
        assert "(from CAPYCTL_HOST_NAME)" in refused.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)
