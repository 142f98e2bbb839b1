"""Which releases may start a role on a state dir.

The state dir keeps the newest release that started a role on it (`<state>/release`); a start
only ever raises it. A release line (0.1.x) keeps one form of the state dir, so any release of
the line that started it may start it again: rolling back from 0.1.1 to 0.1.0 works. A state
dir that a newer line started (0.2.x) may hold what an older line cannot read, and is refused.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from capycommon.errors import InvalidConfig, StateDirNewer
from capycommon.paths import StatePaths, write_atomic


def line(version: Version) -> tuple[int, int]:
    """The release line: major and minor."""
    return version.major, version.minor


def refusal(kept: Version, running: Version, paths: StatePaths) -> StateDirNewer | None:
    """Why `running` may not start on a state dir that `kept` started, or None."""
    if line(kept) <= line(running):
        return None
    return StateDirNewer(
        f"the state dir {paths.root} was started by CapyCTL {kept}, and this is CapyCTL "
        f"{running}: a release starts only a state dir of its own release line "
        f"({running.major}.{running.minor}.x) or an older one. Install CapyCTL {kept} again "
        f"(install.sh --version v{kept}), or start with another --state-dir"
    )


def admit(paths: StatePaths, running: str) -> None:
    """Refuse a state dir a newer release line started; else keep the newer of the two."""
    this = Version(running)
    try:
        text = paths.release.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        text = None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise InvalidConfig(f"cannot read {paths.release}: {reason}; fix its mode") from None
    kept = this
    if text is not None:
        try:
            kept = Version(text)
        except InvalidVersion:
            raise InvalidConfig(
                f"{paths.release} holds {text!r}, not a version; write the version of the "
                f"newest CapyCTL that started this state dir there"
            ) from None
    refused = refusal(kept, this, paths)
    if refused is not None:
        raise refused
    if text is None or this > kept:
        write_atomic(paths.release, f"{this}\n")
