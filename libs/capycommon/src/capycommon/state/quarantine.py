"""Values read from Redis that cannot be believed: each is refused where it is read, logged
once and counted, and its reader goes on with the rest.

Nothing read from Redis is trusted. A joined host writes its own prefix as it likes, and a
value it damaged, or forged, must cost that one key, never a service. `parse` is how a
reader turns a stored value into a model: a value that is too large, not UTF-8, not JSON or
not the model is refused there (None), as one the reader found to lie (`refuse`: a record
naming another host, a generation the scheduler never drew). A refusal is logged the first
time its key holds that value, with the host whose prefix holds it, and counted by host and
kind. Services that publish metrics send the counts on (`drain`): the control plane adds them
to one hash in Redis, which the router's /metrics shows as
`capyctl_host_records_refused_total{host,kind}`.

The ledger is process-wide, as the logging module and `service.REDIS_OUTAGE` are: every
read in the process reports into it, and each read is far from any place a ledger could be
handed down from.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from capycommon.state import keys

log = logging.getLogger(__name__)

# The largest value a reader parses. Every record CapyCTL writes is far below it (a host's
# model facts, the largest, are tens of KiB for hundreds of models); a larger one is refused
# unread, so a host cannot make each reader parse megabytes a second.
MAX_VALUE_BYTES = 1 << 20
# How many refused values are remembered, so each is logged once; the oldest is forgotten
# first (and logged again if it is ever met again).
REMEMBERED = 4096

M = TypeVar("M", bound=BaseModel)


class Refusals:
    """The values this process refused: each logged once, counted by (host, kind)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._unsent: Counter[tuple[str, str]] = Counter()
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    def refuse(self, key: str, raw: bytes | str | None, why: str) -> None:
        """Refuse the value `raw` of `key` because of `why`: logged and counted the first
        time the key holds that value."""
        data = raw.encode(errors="surrogatepass") if isinstance(raw, str) else raw or b""
        seen = (key, hashlib.blake2b(data, digest_size=16).digest())
        if seen in self._seen:
            self._seen.move_to_end(seen)
            return
        self._seen[seen] = None
        if len(self._seen) > REMEMBERED:
            self._seen.popitem(last=False)
        host, kind = owner(key)
        self.counts[(host, kind)] += 1
        self._unsent[(host, kind)] += 1
        log.warning(
            "refused a value read from Redis: %s",
            why,
            extra={"host": host or None, "kind": kind, "key": key},
        )

    def drain(self) -> Counter[tuple[str, str]]:
        """The refusals counted since the last drain, to send on."""
        unsent, self._unsent = self._unsent, Counter()
        return unsent

    def keep(self, unsent: Counter[tuple[str, str]]) -> None:
        """Take back counts drained but not sent, for the next drain."""
        self._unsent.update(unsent)


REFUSALS = Refusals()


def owner(key: str) -> tuple[str, str]:
    """The host whose prefix holds `key` ('' for the control plane's), and the kind of value
    it holds (the key's first name after the prefix: instance, memory, info, ...)."""
    parts = key.split(":")
    if len(parts) >= 4 and parts[:2] == [keys.PREFIX, "host"]:
        return parts[2], parts[3]
    return "", parts[1] if len(parts) >= 2 else key


def parse(model: type[M], raw: bytes | str | None, key: str) -> M | None:
    """The value of `key` as `model`, or None when there is none (`raw` None) or it cannot
    be one (refused)."""
    if raw is None:
        return None
    if len(raw) > MAX_VALUE_BYTES:
        REFUSALS.refuse(key, raw[:4096], f"{len(raw)} bytes, over the {MAX_VALUE_BYTES} read")
        return None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        REFUSALS.refuse(key, raw, f"not a {model.__name__}: {_first(exc)}")
        return None


def parse_many(model: type[M], found: dict[str, bytes | str | None]) -> dict[str, M]:
    """Each present value of `found` (key -> raw) as `model`, the refused ones left out."""
    parsed = {key: parse(model, raw, key) for key, raw in found.items() if raw is not None}
    return {key: value for key, value in parsed.items() if value is not None}


def _first(exc: ValidationError) -> str:
    """The first of a validation's errors, short: where, and what."""
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]


def parse_entry(model: type[M], fields: Mapping[bytes, bytes], name: str, key: str) -> M | None:
    """A stream entry's field `name` as `model`, or None when it has none or cannot be one
    (refused)."""
    raw = fields.get(name.encode())
    if raw is None:
        REFUSALS.refuse(key, b"|".join(fields), f"an entry without its {name} field")
        return None
    return parse(model, raw, key)
