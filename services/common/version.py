"""The tokenline version every process reports (gateway /version, frontend ServerInfo)."""

from __future__ import annotations

import functools
import importlib.metadata

PACKAGE = "tokenline"


@functools.cache
def package_version() -> str:
    """The installed package's version; "0+unknown" when run from a tree not installed."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
