"""What a joined host can and cannot do on a real server role: its Redis TLS port lets in
only certificates of the server's authority and only logged-in users; a host's user reaches
its own prefix and nothing else; an invitation works once, before it expires, and only for a
server of the join file's authority; a revoked host is cut off with its keys kept, and comes
back with its id; hosts and servers of different release lines refuse each other."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.client import PubSub
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.retry import Retry

from capycommon import joinfile, pki
from capycommon.authority import Authority
from capycommon.enrollment import JOIN_PATH, JoinRequest
from capycommon.state import functions, keys
from capycommon.version import __version__
from support import (
    Role,
    capyctl,
    join_host,
    join_hosts,
    short_dir,
    start_host,
    start_role,
    wait_for,
)

# Commands no host may run: they read other keys' names, the server's settings or users,
# watch every client, or wipe what others wrote.
SERVER_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("RANDOMKEY",),
    ("CONFIG", "GET", "*"),
    ("ACL", "LIST"),
    ("ACL", "GETUSER", "host-a"),
    ("CLIENT", "LIST"),
    ("MONITOR",),
    ("FLUSHALL",),
    ("SCRIPT", "FLUSH"),
    ("FUNCTION", "LIST"),
    ("DEBUG", "SLEEP", "0"),
)
SCRIPTING: tuple[tuple[str, ...], ...] = (
    ("EVAL", "return 1", "0"),
    ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"),
    ("SCRIPT", "LOAD", "return 1"),
    ("FUNCTION", "LOAD", "REPLACE", functions.SOURCE),
    ("FUNCTION", "DELETE", functions.LIBRARY),
)
# A transition's arguments: from absent, any generation, a record, its event, its member and
# its notification.
TRANSITION_ARGS = ("absent", "", "{}", "{}", "m:0", "{}")


@dataclass
class Server:
    """A server role with hosts `a` and `b` joined (not running), and an authority of
    another server."""

    role: Role
    root: Path
    foreign: Authority

    def state(self, host: str) -> Path:
        return self.root / host / "state"

    def joined(self, host: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(
            (self.state(host) / "identity" / "joined.json").read_text()
        )
        return data

    def control(self) -> redis.Redis:
        """The server's Redis on its unix socket, as the control plane's user."""
        return self.role.control(protocol=2)

    def tls(
        self, certificate: Path | None, username: str | None = None, password: str | None = None
    ) -> redis.Redis:
        """A client of the server's Redis TLS port (as a host dials it), presenting
        `certificate` (with its key) if any and logging in if given; one try per
        command, so a refusal is seen at once."""
        host, port = self.joined("a")["redis_address"].rsplit(":", 1)
        return redis.Redis(
            host=host,
            port=int(port),
            ssl=True,
            ssl_certfile=None if certificate is None else str(certificate),
            ssl_ca_certs=str(self.state("a") / "identity" / "server-ca.pem"),
            ssl_cert_reqs="required",
            protocol=2,
            retry=Retry(NoBackoff(), 0),
            # No CLIENT SETINFO on connect: each command below is the first one sent.
            driver_info=None,
            socket_timeout=5,
            username=username,
            password=password,
        )

    def as_host(self, host: str) -> redis.Redis:
        """The server's Redis as `host`'s user, with its certificate and password."""
        joined = self.joined(host)
        return self.tls(
            self.state(host) / "identity" / "host.pem",
            username=joined["redis_user"],
            password=joined["redis_password"],
        )

    def invite(self, host: str, *extra: str) -> Path:
        target = self.root / f"{host}-{time.monotonic_ns()}.join"
        result = self.role.capyctl("invite", "host", host, "--output", str(target), *extra)
        assert result.returncode == 0, result.stderr
        return target


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    root = short_dir("hostsec")
    (root / "server").mkdir()
    role = start_role("server", state_dir=root / "server" / "state")
    try:
        found = Server(role, root, Authority.create(root / "foreign-ca", "Another authority"))
        join_hosts(role, root, "a", "b")
        yield found
    finally:
        role.stop()
        shutil.rmtree(root, ignore_errors=True)


def post_join(join: joinfile.JoinFile, version: str = __version__) -> httpx.Response:
    """Send a join request for `join` to the server's bootstrap listener, as `capyctl join
    host` does, but with nothing checked here first."""
    key = pki.new_private_key()
    request = JoinRequest(
        invitation_secret=join.invitation_secret,
        host_name=join.host_name,
        version=version,
        certificate_request=pki.certificate_request(key, join.host_name).decode(),
    )
    trust = ssl.create_default_context(cadata=join.server_ca)
    with httpx.Client(verify=trust, timeout=10) as client:
        return client.post(
            join.server_address + JOIN_PATH,
            content=request.model_dump_json(),
            headers={"Content-Type": "application/json"},
        )


def send(client: redis.Redis, *args: str) -> Any:
    """One command as written (redis-py leaves execute_command untyped)."""
    command: Callable[..., Any] = client.execute_command
    return command(*args)


def listener(client: redis.Redis) -> PubSub:
    make: Callable[[], PubSub] = client.pubsub
    return make()


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def join(join_file: Path, state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return capyctl("join", "host", "--join-file", str(join_file), "--state-dir", str(state), *extra)


def test_the_tls_port_wants_a_certificate_of_the_servers_authority_and_a_login(
    server: Server,
) -> None:
    joined = server.joined("a")
    login = (joined["redis_user"], joined["redis_password"])

    # No client certificate: the handshake is refused, whatever the login.
    with pytest.raises(redis.ConnectionError) as refused:
        server.tls(None, *login).ping()
    assert not isinstance(refused.value, AuthenticationError), refused.value

    # A certificate for host a, with a's own id, from another authority: refused too.
    key = pki.new_private_key()
    foreign = server.foreign.sign_request(
        pki.certificate_request(key, "a"),
        kind="host",
        name="a",
        identity=joined["host_id"],
        lifetime=timedelta(days=1),
    )
    foreign_file = server.root / "foreign-a.pem"
    foreign_file.write_bytes(foreign + key)
    with pytest.raises(redis.ConnectionError) as refused:
        server.tls(foreign_file, *login).ping()
    assert not isinstance(refused.value, AuthenticationError), refused.value

    # Host a's certificate, but nobody logged in: the default user's password is known to
    # nobody, so every command is refused, and so is logging in as it.
    anonymous = server.tls(server.state("a") / "identity" / "host.pem")
    for command in (
        ("PING",),
        ("GET", keys.server_version()),
        ("SET", "capyctl:host:a:probe", "x"),
        ("KEYS", "*"),
        ("INFO",),
        ("CONFIG", "GET", "*"),
        ("ACL", "WHOAMI"),
        ("SUBSCRIBE", "capyctl:notify"),
        ("EVAL", "return 1", "0"),
    ):
        with pytest.raises(AuthenticationError, match="Authentication required"):
            send(anonymous, *command)
    with pytest.raises(AuthenticationError, match="invalid username-password pair"):
        send(anonymous, "AUTH", "")

    # The same certificate with a's login gets in: the refusals above were the server's.
    assert server.as_host("a").ping() is True
    assert server.control().exists("capyctl:host:a:probe") == 0


def test_a_hosts_user_reaches_its_own_prefix_and_nothing_else(server: Server) -> None:
    host = server.as_host("a")
    control = server.control()

    # Its own prefix: every kind of write hostd and memwatch make, and the server's version.
    assert host.set("capyctl:host:a:probe", "x") is True
    assert host.get("capyctl:host:a:probe") == b"x"
    assert host.xadd("capyctl:host:a:probe-stream", {"k": "v"})
    own = listener(host)
    own.subscribe("capyctl:host:a:probe-channel")
    assert wait_for(lambda: own.get_message(timeout=0.2), 5, "the subscription")["type"] == (
        "subscribe"
    )
    assert host.publish("capyctl:host:a:probe-channel", "hello") == 1
    assert wait_for(lambda: own.get_message(timeout=0.2), 5, "the message")["data"] == b"hello"
    own.close()
    assert host.delete("capyctl:host:a:probe", "capyctl:host:a:probe-stream") == 2
    assert host.get(keys.server_version()) == __version__.encode()
    with pytest.raises(NoPermissionError):
        host.set(keys.server_version(), "9.9.9")
    assert control.get(keys.server_version()) == __version__.encode()

    # Anyone else's keys: another host's, the desired state, the server's records of hosts
    # and its invitations (one pending here, beside a made-up id).
    pending = server.invite("spare")
    invitation = keys.invitation(joinfile.read(pending).invitation_id)
    control.set("capyctl:host:b:probe", "b's")
    others = (
        "capyctl:host:b:probe",
        "capyctl:host:b:commands",
        "capyctl:deployment:x",
        "capyctl:deployments",
        keys.host_identity("a"),
        keys.host_identity("b"),
        invitation,
        keys.invitation("0" * 64),
    )
    before = {key: control.dump(key) for key in others}
    for key in others:
        for command in (("GET", key), ("SET", key, "x"), ("DEL", key)):
            with pytest.raises(NoPermissionError, match="no permissions to access one of the keys"):
                send(host, *command)

    # Commands over the whole server. DEBUG is refused before the ACL is asked; ask the ACL
    # too, so it would still be refused were DEBUG enabled.
    for words in SERVER_COMMANDS:
        refusal = NoPermissionError if words[0] != "DEBUG" else ResponseError
        with pytest.raises(refusal):
            send(host, *words)
        verdict = send(control, "ACL", "DRYRUN", "host-a", *words)
        assert b"no permissions" in verdict, (words, verdict)

    # No script of its own (one holds the whole server while it runs): only the control
    # plane's functions, which reach no more than its user, whatever keys they are given.
    for words in SCRIPTING:
        with pytest.raises(NoPermissionError, match="no permissions to run"):
            send(host, *words)
    others_keys = (
        keys.instance("b", "m", 0),
        keys.instances("b"),
        keys.host_events("b"),
        keys.host_notifications("b"),
    )
    with pytest.raises(NoPermissionError, match="no permissions to access one of the keys"):
        send(host, "FCALL", functions.TRANSITION, "4", *others_keys, *TRANSITION_ARGS)

    # Another host's channels and the scheduler's: neither announce nor listen.
    for channel in ("capyctl:host:b:notify", "capyctl:host:b:memory-notify", "capyctl:notify"):
        with pytest.raises(NoPermissionError, match="channels"):
            host.publish(channel, "x")
        refused = listener(server.as_host("a"))
        refused.subscribe(channel)  # sent here, answered on the next read
        with pytest.raises(NoPermissionError, match="channels"):
            refused.get_message(timeout=2)
        refused.close()
    refused = listener(server.as_host("a"))
    refused.psubscribe("capyctl:*")
    with pytest.raises(NoPermissionError):
        refused.get_message(timeout=2)
    refused.close()

    # Nothing of the above changed anything.
    assert {key: control.dump(key) for key in others} == before
    assert control.get(keys.server_version()) == __version__.encode()
    control.delete("capyctl:host:b:probe", invitation)


def test_no_secret_is_kept_in_redis(server: Server) -> None:
    """The server's API key and admin token, and the hosts' Redis passwords, are in files of
    their own; no key of the server's Redis holds one (so no Redis user can read one)."""
    identity = server.role.state_dir / "identity"
    credentials = yaml.safe_load((identity / "credentials").read_text())
    secrets = {
        "api_key": credentials["api_key"],
        "admin_token": credentials["admin_token"],
        "control user's password": (identity / "redis-password").read_text().strip(),
        **{f"host {h} password": server.joined(h)["redis_password"] for h in ("a", "b")},
    }
    assert all(len(value) >= 32 for value in secrets.values())
    control = server.control()
    names = cast(list[bytes], control.keys("*"))
    assert names
    for name in names:
        kind = control.type(name)
        if kind == b"string":
            values: Any = control.get(name)
        elif kind == b"hash":
            values = control.hgetall(name)
        elif kind == b"set":
            values = control.smembers(name)
        elif kind == b"zset":
            values = control.zrange(name, 0, -1, withscores=True)
        elif kind == b"list":
            values = control.lrange(name, 0, -1)
        else:
            assert kind == b"stream", (name, kind)
            values = control.xrange(name)
        text = repr((name, values))
        for what, secret in secrets.items():
            assert secret not in text, f"{name!r} holds the {what}"


def test_an_invitation_works_once_and_not_after_it_expires(server: Server) -> None:
    used = server.invite("twice")
    first, second = server.root / "twice-1" / "state", server.root / "twice-2" / "state"
    assert join(used, first).returncode == 0
    again = join(used, second)
    assert again.returncode == 3, again.stderr
    assert again.stderr.startswith("error [invitation_refused]: the invitation is unknown, already")
    assert not (second / "identity" / "joined.json").exists()
    answer = post_join(joinfile.read(used))
    assert answer.status_code == 403
    assert error_of(answer)["code"] == "invitation_refused"

    late = server.invite("late", "--ttl", "1")
    expires = joinfile.read(late).expires_unix
    time.sleep(max(0.0, expires - time.time()) + 1)
    expired = join(late, server.root / "late" / "state")
    assert expired.returncode == 3, expired.stderr
    assert expired.stderr.startswith("error [invitation_refused]: the join file for host late ")
    # The server refuses it too, whatever a host's CLI checks.
    answer = post_join(joinfile.read(late))
    assert answer.status_code == 403
    assert error_of(answer)["code"] == "invitation_refused"


def test_a_join_file_of_another_authority_is_refused_before_the_invitation_is_used(
    server: Server,
) -> None:
    good = server.invite("pinned")
    found = joinfile.read(good)
    forged = server.root / "pinned-forged.join"
    joinfile.write(
        forged, found.model_copy(update={"server_ca": server.foreign.certificate_pem.decode()})
    )
    state = server.root / "pinned" / "state"
    refused = join(forged, state)
    assert refused.returncode == 3, refused.stderr
    assert refused.stderr.startswith(
        "error [certificate_invalid]: the server at "
        f"{found.server_address} did not present a certificate from the authority in the join file"
    )
    assert not (state / "identity" / "joined.json").exists()
    assert server.control().exists(keys.invitation(found.invitation_id)) == 1

    joined = join(good, state)
    assert joined.returncode == 0, joined.stderr
    assert json.loads((state / "identity" / "joined.json").read_text())["host_name"] == "pinned"
    assert server.control().exists(keys.invitation(found.invitation_id)) == 0


def test_a_revoked_host_is_cut_off_keeps_its_keys_and_recovers_with_its_id(
    server: Server,
) -> None:
    state = server.state("a")
    control = server.control()
    identity = json.loads(cast(bytes, control.get(keys.host_identity("a"))))
    old_serial = pki.read_certificate((state / "identity" / "host.pem").read_bytes()).serial
    assert old_serial == identity["serial"]
    host_id = server.joined("a")["host_id"]

    host = start_host(state)
    try:
        kept = set(cast(list[bytes], control.keys("capyctl:host:a:*")))
        assert b"capyctl:host:a:heartbeat:hostd" in kept
        revoked = server.role.capyctl("revoke", "host", "a")
        assert revoked.returncode == 0, revoked.stderr
        assert revoked.stdout.startswith(f"host a (id {host_id}) revoked.")
        assert host.proc.wait(timeout=10) == 14, host.output()
        assert "error [host_revoked]" in host.output()
    finally:
        host.stop()

    with pytest.raises(AuthenticationError, match="invalid username-password pair"):
        server.as_host("a").ping()
    left = set(cast(list[bytes], control.keys("capyctl:host:a:*")))
    assert {key for key in kept if b":heartbeat:" not in key} <= left
    listed = server.role.capyctl("list", "hosts", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert (rows["a"]["state"], rows["a"]["revoked"]) == ("revoked", True)
    twice = server.role.capyctl("revoke", "host", "a")
    assert twice.returncode == 0, twice.stderr
    assert f"host a (id {host_id}) was already revoked." in twice.stdout

    join_host(server.role, "a", state, "--recover")
    host = start_host(state)
    try:
        assert server.joined("a")["host_id"] == host_id
        assert control.sismember(keys.revoked_serials(), old_serial)
        renewed = json.loads(cast(bytes, control.get(keys.host_identity("a"))))
        assert (renewed["host_id"], renewed["revoked_at"]) == (host_id, None)
        assert renewed["serial"] != old_serial
        assert server.as_host("a").ping() is True
    finally:
        assert host.stop() == 0


def test_a_server_refuses_a_host_of_another_release_line(server: Server) -> None:
    invitation = joinfile.read(server.invite("newer"))
    answer = post_join(invitation, version="0.2.0")
    assert answer.status_code == 409
    error = error_of(answer)
    assert error["code"] == "host_version_incompatible"
    assert f"this server runs CapyCTL {__version__} and the host 0.2.0" in error["message"]
    # Refused before the invitation was taken: the right host may still use it.
    control = server.control()
    assert control.exists(keys.invitation(invitation.invitation_id)) == 1
    control.delete(keys.invitation(invitation.invitation_id))


def test_a_host_refuses_a_server_of_another_release_line(server: Server) -> None:
    control = server.control()
    control.set(keys.server_version(), "0.2.0")
    try:
        host = start_host(server.state("b"), wait=False)
        try:
            code = host.proc.wait(timeout=20)
        finally:
            host.stop()
        output = host.output()
        assert code == 5, output
        assert "error [host_version_incompatible]" in output
        assert f"this server runs CapyCTL 0.2.0 and the host {__version__}" in output
    finally:
        control.set(keys.server_version(), __version__)
