"""Bad training input refused up front, with a message that says what to do (instead of a shape or index
error from deep inside a checkpoint load or a forward): an output folder resumed with other settings,
the target's answers written with another tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .data import load_samples
from .distributed import world

RUN = "run.json"


def claim(out_dir: Path | str, settings: dict[str, Any]) -> None:
    """Record `settings` in OUT/run.json, or check that they equal the ones recorded there (the main worker's
    job: the others would race it)."""
    if not world().main:
        return
    out = Path(out_dir)
    path = out / RUN
    if path.exists():
        before = json.loads(path.read_text())
        changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if changed:
            diff = ", ".join(f"{k}: {a!r} before, {b!r} now" for k, (a, b) in changed.items())
            raise ValueError(f"{out} holds a run with other settings ({diff}): resume with the same settings "
                             "or pass a new --out")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1))


def check_samples_file(path: Path | str | None, vocab_size: int) -> None:
    """A --samples-file must hold token ids of this target's vocabulary."""
    if path is None:
        return
    samples = load_samples(path)
    if not samples:
        raise ValueError(f"{path} holds no samples")
    top = max(max(s.tokens) for s in samples)
    if top >= vocab_size:
        raise ValueError(f"{path} holds token id {top}, past the target's vocabulary of {vocab_size}: it was "
                         "written with another tokenizer; let this target write its own answers")
