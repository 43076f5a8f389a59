"""An EAGLE head directory in our format, whichever architecture its config names: ours (eagle.py) or EAGLE-3's
(eagle3.py). Heads in the published layouts are read by published_heads.py."""

from __future__ import annotations

from pathlib import Path

import torch

from .eagle import ARCH_EAGLE3, ARCH_OURS, EagleHead, read_config
from .eagle3 import Eagle3Head

CLASSES: dict[str, type[EagleHead]] = {ARCH_OURS: EagleHead, ARCH_EAGLE3: Eagle3Head}


def load_head(path: Path | str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> EagleHead:
    """The head saved in `path` (EagleHead.save), as the class its config names."""
    return CLASSES[read_config(Path(path)).arch].load(path, dtype=dtype, device=device)
