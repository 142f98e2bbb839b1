"""What capyctl carries beside its code: the example deployments, the systemd units and the
documentation. An installed capyctl (its wheel, a release executable) holds its own copies
under the package; a clone's editable install reads the repository's."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from capycommon.errors import NotFound


def bundled(folder: str) -> Path:
    """The folder `folder` (`examples/deployments`, `systemd`, `docs`): the package's copy,
    else the repository's that holds this package."""
    here = Path(str(resources.files("capyctl_cli"))).resolve()
    for base in (here, *here.parents):
        found = base / folder
        if found.is_dir():
            return found
    raise NotFound(
        f"{folder} is not beside this installation of capyctl; install a release "
        "(install.sh), or run capyctl from a clone of the repository"
    )
