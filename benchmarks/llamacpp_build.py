"""Where scripts/build_llamacpp.sh put llama.cpp's own binaries: the directory it writes to $LLAMACPP_HOME/READY
(default /work/llamacpp) once they run. One answer for every benchmark that runs llama.cpp beside us."""

from __future__ import annotations

import os
from pathlib import Path


def ready_file() -> Path:
    return Path(os.environ.get("LLAMACPP_HOME", "/work/llamacpp")) / "READY"


def built_bins() -> Path | None:
    """The binaries' directory, or None where the build has not finished (or never ran)."""
    ready = ready_file()
    return Path(ready.read_text().strip()) if ready.is_file() else None
