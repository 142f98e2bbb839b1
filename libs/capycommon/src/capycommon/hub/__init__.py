"""Models from the Hugging Face Hub into the local model store (see `download.pull`)."""

from capycommon.hub.access import HubAccess, hub_access, read_token
from capycommon.hub.client import HubClient, HubLimits
from capycommon.hub.download import Progress, listed_weights, pull, resolve
from capycommon.hub.source import HubSource, endpoint_from, is_commit
from capycommon.hub.store import MANIFEST, StorePaths, read_manifest

__all__ = [
    "MANIFEST",
    "HubAccess",
    "HubClient",
    "HubLimits",
    "HubSource",
    "Progress",
    "StorePaths",
    "endpoint_from",
    "hub_access",
    "is_commit",
    "listed_weights",
    "pull",
    "read_manifest",
    "read_token",
    "resolve",
]
