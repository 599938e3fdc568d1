"""Where generated demo artifacts (embedded model, synthetic datasets) are cached on local disk.

`$MEGARL_CACHE` if set, else `~/.cache/megarl`. Left out: eviction and any remote cache.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MEGARL_CACHE"


def default_cache_root() -> Path:
    """`$MEGARL_CACHE` if set, else `~/.cache/megarl`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megarl"
