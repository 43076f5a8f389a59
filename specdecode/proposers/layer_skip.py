"""Self-speculation by layer skipping (Draft & Verify, SWIFT): the target drafts for itself with some
of its middle layers skipped, so no second model, no training and no extra weights are needed.

The draft is a view of the target that shares every weight and keeps a small KV cache of its own
for the kept layers; drafting, rollback and resync are exactly DraftModelProposer's. Which layers to
skip is found once per model by a greedy search on calibration text (search_skip_layers) and cached
on disk (save_skip_layers / load_skip_layers).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..common.method_options import LayerSkipOptions
from ..common.paths import default_cache_dir
from ..data import CALIBRATION
from ..models import Transformer
from ..policy.cost import CostModel
from ..policy.speculation import Guessing
from .draft_model import DraftModelProposer

MAX_K = 8  # draft depths the search considers
DEFAULT_CALIBRATION = CALIBRATION  # training-set exchanges shipped with the package (never the benchmark)


def check_skipped(skipped: Sequence[int], num_layers: int) -> list[int]:
    """The skipped layer indices, sorted; ValueError for out-of-range or repeated ones, or all layers."""
    layers = [operator.index(i) for i in skipped]
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"skipped layers {bad} out of range: the model has {num_layers} layers (0..{num_layers - 1})")
    repeated = sorted({i for i in layers if layers.count(i) > 1})
    if repeated:
        raise ValueError(f"skipped layers {repeated} are listed more than once")
    if len(layers) == num_layers:
        raise ValueError(f"cannot skip all {num_layers} layers: the draft must keep at least one")
    return sorted(layers)


def skip_layers(model: Transformer, skipped: Sequence[int]) -> Transformer:
    """A view of `model` without the `skipped` blocks, sharing all its weights (nothing is copied).

    Its config says num_layers = kept blocks, so `new_cache` holds only those. Moving or modifying the
    view's modules changes the target's too: they are the same modules.
    """
    skip = set(check_skipped(skipped, model.config.num_layers))
    view = copy.copy(model)  # shares every attribute; give it its own module registry before replacing one
    view._modules = model._modules.copy()
    view._parameters = model._parameters.copy()
    view._buffers = model._buffers.copy()
    view.layers = nn.ModuleList(block for i, block in enumerate(model.layers) if i not in skip)
    types = model.config.layer_types  # Gemma: each kept block keeps its attention type
    view.config = dataclasses.replace(model.config, num_layers=len(view.layers), layer_types=types and [
        kind for i, kind in enumerate(types) if i not in skip])
    return view


class LayerSkipProposer(DraftModelProposer):
    """Drafts a chain with the target's layer-skipped view (see skip_layers) and its own small cache."""

    name = "layer-skip"
    def __init__(self, target: Transformer, skipped: Sequence[int], *, pays: bool = True) -> None:
        """pays=False: the search found no set that beats plain decoding (k="auto" then never drafts)."""
        self.skipped = check_skipped(skipped, target.config.num_layers)
        self.guessing = Guessing(pays=pays)
        super().__init__(skip_layers(target, self.skipped), target.config.vocab_size)


# ---------------------------------------------------------------------------------------- search
@dataclass
class SkipStep:
    skipped: list[int]
    agreement: float  # fraction of calibration positions where the view's argmax is the target's
    speedup: float  # predicted tokens/s vs plain decoding at the best depth k (1.0 for the empty set)
    k: int  # that depth (0: plain decoding)


@dataclass
class SkipSearchResult:
    skipped: list[int]  # the best set; empty when layer skipping does not pay on this model and machine
    agreement: float
    speedup: float
    k: int
    num_layers: int
    trajectory: list[SkipStep]  # the empty set, then the set after each elimination round

    @property
    def pays(self) -> bool:
        return bool(self.skipped)

    @property
    def draft_layers(self) -> list[int]:
        """The set to draft with when layer-skip is asked for: the best one, or, when none pays, the best
        non-empty one (used with a fixed k only: under k="auto" a set that does not pay never drafts)."""
        if self.skipped:
            return self.skipped
        tried = [s for s in self.trajectory if s.skipped]
        return max(tried, key=lambda s: s.speedup).skipped if tried else []


def predicted_speedup(
    alpha: float, kept: int, total: int, cost: CostModel, context: int, head_share: float = 0.0
) -> tuple[float, int]:
    """(speedup vs plain decoding, best depth) of a chain draft, each guess accepted with probability alpha
    (given the ones before were). A guess costs the kept layers' share of a 1-token target forward plus
    the output layer, which is never skipped (`head_share`: its part of the forward, ~0.2 for SmolLM2)."""
    t1 = cost.forward_seconds(1, context)
    per_guess = (head_share + (1 - head_share) * kept / total) * t1
    best, best_k, expected = 0.0, 0, 0.0
    for k in range(1, MAX_K + 1):
        expected += alpha**k
        speedup = (1 + expected) * t1 / (cost.forward_seconds(k + 1, context) + k * per_guess)
        if speedup > best:
            best, best_k = speedup, k
    return best, best_k


def _argmaxes(model: Transformer, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens], device=model.device)
    return model.forward(ids, model.new_cache(len(tokens))).logits[0].argmax(-1)


def search_skip_layers(
    model: Transformer,
    calibration: list[list[int]],
    cost: CostModel,
    max_skip: int | None = None,
    progress: Callable[[SkipStep], None] | None = None,
    patience: int = 4,
) -> SkipSearchResult:
    """Greedy backward elimination of layers, scored by predicted speedup; see the module docstring.

    Each round tries removing each remaining middle layer (the first and last are always kept), scores
    it by teacher-forced argmax agreement with the full model on `calibration` (one forward per text,
    which equals greedy per-depth acceptance since a draft conditions on accepted = target tokens), and
    removes the one that keeps agreement highest. `progress` is called with each round's step.
    Rounds stop once even a 2-layer draft at the current agreement could not beat the best set so far
    (agreement only falls as layers go, in practice), or after `patience` rounds without a new best:
    agreement falls about geometrically per removed layer, so a speedup that keeps falling rarely turns.
    """
    texts = [t for t in calibration if len(t) >= 2]
    if not texts:
        raise ValueError("calibration needs at least one sequence of 2 or more tokens")
    total = model.config.num_layers
    context = round(sum(map(len, texts)) / len(texts))
    positions = sum(map(len, texts))
    reference = [_argmaxes(model, t) for t in texts]
    head = model.lm_head.weight.numel()  # weights streamed per token: the cost of a decoding forward on CPU
    head_share = head / (head + sum(p.numel() for p in model.layers.parameters()))

    def agreement(skipped: list[int]) -> float:
        view = skip_layers(model, skipped)
        hits = sum(int((_argmaxes(view, t) == ref).sum()) for t, ref in zip(texts, reference, strict=True))
        return hits / positions

    candidates = list(range(1, total - 1))
    limit = len(candidates) if max_skip is None else max(0, min(max_skip, len(candidates)))
    trajectory = [SkipStep([], 1.0, 1.0, 0)]  # skipping nothing = plain decoding
    best, current = trajectory[0], list[int]()
    while len(current) < limit:
        scored = [(agreement(sorted([*current, j])), j) for j in candidates if j not in current]
        alpha, layer = max(scored, key=lambda s: s[0])  # ties: the lowest layer
        current = sorted([*current, layer])
        speedup, k = predicted_speedup(alpha, total - len(current), total, cost, context, head_share)
        step = SkipStep(current, alpha, speedup, k)
        trajectory.append(step)
        if progress is not None:
            progress(step)
        if step.speedup > best.speedup:
            best = step
        stale = len(current) - len(best.skipped) >= patience
        if stale or predicted_speedup(alpha, 2, total, cost, context, head_share)[0] <= best.speedup:
            break
    return SkipSearchResult(best.skipped, best.agreement, best.speedup, best.k, total, trajectory)


# ----------------------------------------------------------------------------------- persistence
def model_key(model: Transformer) -> str:
    """Shape + vocabulary, and the first layer's weights (as float32, so the dtype it was loaded in does not
    matter): different checkpoints of the same shape get different keys."""
    cfg = model.config
    shape = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
             cfg.num_kv_heads, cfg.head_dim)
    weights = hashlib.sha1()
    for name, tensor in sorted(model.layers[0].state_dict().items()):
        weights.update(name.encode())
        weights.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return f"{hashlib.sha1(repr(shape).encode()).hexdigest()[:10]}-{weights.hexdigest()[:10]}"


def _path(model: Transformer, cache_dir: Path | None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "layer_skip" / f"{model_key(model)}.json"


def save_skip_layers(model: Transformer, result: SkipSearchResult, cache_dir: Path | None = None) -> Path:
    path = _path(model, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(result), indent=1))
    return path


def load_skip_search(model: Transformer, cache_dir: Path | None = None) -> SkipSearchResult | None:
    """The saved search for this model, or None when none was saved (or the file is unusable)."""
    path = _path(model, cache_dir)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        data["trajectory"] = [SkipStep(**step) for step in data["trajectory"]]
        result = SkipSearchResult(**data)
        for step in result.trajectory:
            check_skipped(step.skipped, model.config.num_layers)
        return result
    except (ValueError, TypeError, KeyError):
        return None  # damaged or from another layout: search again


def load_skip_layers(model: Transformer, cache_dir: Path | None = None) -> list[int] | None:
    """The saved best skip set for this model (empty: skipping does not pay), or None."""
    result = load_skip_search(model, cache_dir)
    return None if result is None else check_skipped(result.skipped, model.config.num_layers)


# ----------------------------------------------------------------------------------- calibration
def calibration_tokens(
    tokenizer, n_texts: int = 8, max_tokens: int = 256, path: Path | str | None = None
) -> list[list[int]]:
    """Token ids of `n_texts` exchanges in ShareGPT's layout (a user turn and the answer after it, in the chat
    template when the tokenizer has one), each cut to `max_tokens`. Training data only: never the benchmark set."""
    path = Path(DEFAULT_CALIBRATION if path is None else path)
    if not path.exists():
        raise FileNotFoundError(f"calibration data {path} not found: a ShareGPT-layout .jsonl of exchanges")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    random.Random(0).shuffle(rows)  # a spread of topics, the same every time
    out: list[list[int]] = []
    for row in rows:
        turns = row.get("conversations", [])
        pair = next(((a["value"], b["value"]) for a, b in zip(turns, turns[1:], strict=False)
                     if a.get("from") == "human" and b.get("from") == "gpt"), None)
        if pair is None:
            continue
        user, answer = (s[: 8 * max_tokens] for s in pair)  # no need to tokenize more than fits
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        else:
            text = f"{user}\n{answer}"
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens]
        if len(ids) >= min(32, max_tokens):
            out.append(ids)
        if len(out) == n_texts:
            break
    if len(out) < n_texts:
        raise ValueError(f"{path} holds {len(out)} exchanges of at least {min(32, max_tokens)} tokens; "
                         f"ask for at most that many calibration texts (--texts)")
    return out


if TYPE_CHECKING:
    from .assets import Assets, Draft


def build(assets: Assets, options: LayerSkipOptions, draft: Draft, k: int | str) -> LayerSkipProposer:
    if options.skip_layers is not None:
        return LayerSkipProposer(assets.model, options.skip_layers)
    search = assets.skip_search()
    return LayerSkipProposer(assets.model, search.draft_layers, pays=search.pays)
