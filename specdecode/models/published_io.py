"""Reading the files of a published draft head: its weights (safetensors, or a pickle read weights-only), its
config.json, and which layout the folder holds (specdecode's own EAGLE or Medusa, EAGLE-3, EAGLE-1/2, Medusa).

A pickled `.bin` / `.pt` file is a program: unpickling it unrestricted can run any code its author put in. It is
read only through torch.load(weights_only=True), which rebuilds tensors and plain containers and refuses
everything else; a file that holds anything more is refused with the reason, never unpickled another way.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .eagle import CONFIG as OUR_EAGLE_CONFIG
from .eagle import WEIGHTS as OUR_EAGLE_WEIGHTS

# the weight files a published head ships, in the order they are looked for (Medusa's trainer writes
# medusa_lm_head.safetensors, its hub uploads medusa_lm_head.pt; EAGLE's and SpecForge's save_pretrained
# model.safetensors, older EAGLE uploads pytorch_model.bin)
SAFE_FILES = ("model.safetensors", "medusa_lm_head.safetensors")
PICKLE_FILES = ("pytorch_model.bin", "medusa_lm_head.pt", "model.bin", "model.pt")

OURS_EAGLE, OURS_MEDUSA, EAGLE3, EAGLE1, MEDUSA = "specdecode-eagle", "specdecode-medusa", "eagle3", "eagle", "medusa"
LAYOUT_NAMES = {OURS_EAGLE: "specdecode's EAGLE head", OURS_MEDUSA: "specdecode's Medusa heads",
                EAGLE3: "an EAGLE-3 head", EAGLE1: "an EAGLE-1/2 head", MEDUSA: "published Medusa heads"}


def read_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A pickled state dict, weights only (see the module docstring): a clear ValueError for anything more."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"refused to read {path}: it is a pickle that holds more than tensors ({first}). Unpickling it would "
            "run whatever code it names, so specdecode reads pickles weights-only; convert it to safetensors "
            "with a tool you trust, or use the head's .safetensors file") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a state dict of tensors (got {type(state).__name__}): a head's weights are "
                         "a mapping of names to tensors")
    return {str(k): v for k, v in state.items()}


def weights_file(path: Path) -> Path | None:
    """The folder's weight file (safetensors first), or None."""
    for name in (*SAFE_FILES, *PICKLE_FILES):
        if (path / name).is_file():
            return path / name
    return None


def head_weights_file(path: Path) -> Path:
    """The folder's one weight file; a clear error where it holds none or a sharded checkpoint."""
    file = weights_file(path)
    if file is None:
        if (path / "model.safetensors.index.json").exists() or (path / "pytorch_model.bin.index.json").exists():
            raise ValueError(f"{path} holds a sharded checkpoint: a draft head is one file (model.safetensors); "
                             "is this the target model rather than its head?")
        raise FileNotFoundError(f"{path} holds no head weights: expected one of "
                                f"{', '.join((*SAFE_FILES, *PICKLE_FILES))} (a published head's folder, or train one: "
                                "`specdecode train eagle|medusa --out DIR`)")
    return file


def without_model_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """The keys with a leading `model.` dropped where every key has one."""
    if state and all(k.startswith("model.") for k in state):
        return {k.removeprefix("model."): v for k, v in state.items()}
    return state


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The state dict in `path` (a folder), with a leading `model.` dropped where every key has one."""
    file = head_weights_file(path)
    return without_model_prefix(load_file(str(file)) if file.suffix == ".safetensors" else read_pickle(file))


def weight_names(path: Path) -> list[str]:
    """read_weights(path)'s keys, from a safetensors header alone (no tensor read: telling a head from a model's
    checkpoint must not load the model)."""
    file = head_weights_file(path)
    if file.suffix != ".safetensors":
        return list(read_weights(path))
    with safe_open(str(file), "pt") as f:
        return list(without_model_prefix(dict.fromkeys(f.keys())))


def read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds {type(data).__name__}, not a JSON object")
    return data


def detect_layout(path: Path | str) -> str:
    """Which head a folder (or a file in one) holds: one of OURS_EAGLE, OURS_MEDUSA, EAGLE3, EAGLE1, MEDUSA."""
    path = Path(path).expanduser()
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist: pass the folder of a draft head (its config and weights)")
    if (path / OUR_EAGLE_CONFIG).is_file() and (path / OUR_EAGLE_WEIGHTS).is_file():
        return OURS_EAGLE
    config = read_config(path)
    if config.get("model_type") == "medusa" and (path / "model.safetensors").is_file():
        return OURS_MEDUSA
    if "medusa_num_heads" in config:
        return MEDUSA
    keys = weight_names(path)
    if any(k.startswith("midlayer.") for k in keys):
        return EAGLE3
    if any(k.startswith(("medusa_head.", "0.0.linear.")) for k in keys):
        return MEDUSA
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return EAGLE1
    sample = ", ".join(sorted(keys)[:6])
    raise ValueError(
        f"{path} holds no draft head specdecode reads (its weights: {sample}, ...). Heads it reads: its own (train "
        "one with `specdecode train eagle` / `medusa`), EAGLE-3 (midlayer.*, fc, d2t), EAGLE-1/2 (fc, layers.0.*) "
        "and Medusa (medusa_lm_head: {i}.{j}.linear.*)")
