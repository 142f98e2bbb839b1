"""The errors of models from the Hugging Face Hub: resolving, downloading and storing them
(`capycommon.hub`). They are CapyCTL errors like the rest (`capycommon.errors`), with their
codes in `capycommon.errorcodes`."""

from __future__ import annotations

from capycommon.errors import CapyError


class DiskFull(CapyError):
    """A download that would not fit the free space of the model store's filesystem (with
    its reserve): refused before any byte is fetched."""

    code = "disk_full"


class HfRepoNotFound(CapyError):
    """The Hub has no such repository, or hides a private one from the token sent."""

    code = "hf_repo_not_found"


class HfRevisionNotFound(CapyError):
    """The repository has no such branch, tag or commit."""

    code = "hf_revision_not_found"


class HfGated(CapyError):
    """A gated or private repository asked for with no token."""

    code = "hf_gated"


class HfTokenRefused(CapyError):
    """The Hub refused the token sent (wrong, expired, or without access to the repository)."""

    code = "hf_token_refused"


class HfUnreachable(CapyError):
    """The Hub could not be reached (refused, name not resolved, timed out) or kept failing."""

    code = "hf_unreachable"


class HfIntegrity(CapyError):
    """What the Hub served is not what it listed: a hash, a size or the commit differs."""

    code = "hf_integrity"


class HfOfflineMissing(CapyError):
    """Offline, and the model is not in the store: nothing may be downloaded."""

    code = "hf_offline_missing"
