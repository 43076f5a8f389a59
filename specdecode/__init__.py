"""specdecode: lossless speculative decoding for Llama-family language models.

The public names load on first use (PEP 562): `import specdecode` itself imports no torch, so the command line
(`specdecode --help`, its checks of a prompt or a model name) answers before the seconds torch takes to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
_WHERE = {"LLM": "api", "GenerationOutput": "api", "TextStream": "api", "load": "api", "Generation": "engine.loop",
          "GenerationStats": "engine.loop", "generate_ids": "engine.loop", "SamplingParams": "core.sampling"}
__all__ = ["LLM", "GenerationOutput", "TextStream", "load", "Generation", "GenerationStats", "generate_ids",
           "SamplingParams"]

if TYPE_CHECKING:
    from .api import LLM, GenerationOutput, TextStream, load
    from .core.sampling import SamplingParams
    from .engine.loop import Generation, GenerationStats, generate_ids


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
