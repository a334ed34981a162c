"""omnid's version: the installed distribution's, or the checkout's when run from a
source tree without an install."""

from __future__ import annotations

import functools


@functools.cache
def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("omnid")
    except Exception:  # noqa: BLE001 - not installed: a checkout on PYTHONPATH
        return "0.1.0 (not installed)"
