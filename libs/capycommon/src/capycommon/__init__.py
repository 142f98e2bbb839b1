"""Shared library of CapyCTL: everything the services and the CLI have in common."""

from capycommon.version import __version__

__all__ = ["__version__"]
