"""Where specdecode keeps what it builds or measures once: converted tokenizers, native kernels, cost tables."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$SPECDECODE_CACHE, else ~/.cache/specdecode."""
    return Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode"))
