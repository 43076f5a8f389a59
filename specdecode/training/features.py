"""The target's features, computed once and cached, so training epochs never run the target again.

Per position t of every sample: the hidden states of chosen target layers (float16 where they fit, else bfloat16:
Gemma's residual stream runs past float16's 65,504, which stored as inf trained a head to NaN) and the target's
next-token distribution as its top-k ids and probabilities (the teacher; k small, since a 49k-vocab
distribution per token would dwarf everything else). Everything is stored flat (samples concatenated,
with offsets) in safetensors shards.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..models import Transformer
from .data import Sample

log = logging.getLogger(__name__)
LOGITS_BYTES = 2 << 30  # a batch's float32 logits (its softmax takes as much again): 8,192 tokens of a 262k vocabulary
# would be 8.6 GB


@dataclass
class FeatureStore:
    layers: list[int]  # target layer indices of hidden[:, i]
    tokens: torch.Tensor  # [N] long
    offsets: torch.Tensor  # [S + 1]: sample s is tokens[offsets[s]:offsets[s + 1]]
    prompt_lens: torch.Tensor  # [S]
    hidden: torch.Tensor  # [N, L, H] float16 or bfloat16
    teacher_ids: torch.Tensor  # [N, k]: the target's top-k next tokens after each position
    teacher_probs: torch.Tensor  # [N, k]

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def to(self, device: torch.device | str) -> FeatureStore:
        return FeatureStore(self.layers, *(t.to(device) for t in (self.tokens, self.offsets, self.prompt_lens,
                                                                   self.hidden, self.teacher_ids, self.teacher_probs)))

    def layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise ValueError(f"features hold target layers {self.layers}, not {layer}: extract them again")
        return self.layers.index(layer)

    def batch(self, samples: list[int], max_len: int) -> dict[str, torch.Tensor]:
        """Right-padded batch of the given samples, each cut to `max_len`:
        tokens [B, T]; mask [B, T] True where position t predicts an answer token (t + 1 past the prompt);
        hidden [B, T, L, H] (float32); teacher_ids / teacher_probs [B, T, k]."""
        lengths = [min(int(self.offsets[s + 1] - self.offsets[s]), max_len) for s in samples]
        width, device = max(lengths), self.tokens.device
        k = self.teacher_ids.shape[1]
        out = {
            "tokens": torch.zeros(len(samples), width, dtype=torch.long, device=device),
            "mask": torch.zeros(len(samples), width, dtype=torch.bool, device=device),
            "hidden": torch.zeros(len(samples), width, *self.hidden.shape[1:], device=device),
            "teacher_ids": torch.zeros(len(samples), width, k, dtype=torch.long, device=device),
            "teacher_probs": torch.zeros(len(samples), width, k, device=device),
        }
        for row, (s, n) in enumerate(zip(samples, lengths, strict=True)):
            a = int(self.offsets[s])
            out["tokens"][row, :n] = self.tokens[a : a + n]
            out["mask"][row, max(int(self.prompt_lens[s]) - 1, 0) : n - 1] = True
            out["hidden"][row, :n] = self.hidden[a : a + n].float()
            out["teacher_ids"][row, :n] = self.teacher_ids[a : a + n]
            out["teacher_probs"][row, :n] = self.teacher_probs[a : a + n].float()
        return out

    def batches(self, batch_size: int, max_len: int, seed: int, start_step: int = 0) -> Iterator[dict]:
        """Endless shuffled batches (epoch after epoch, a fresh seeded order each), from `start_step` on."""
        step, epoch = 0, 0
        while True:
            order = list(range(len(self)))
            random.Random(f"{seed}-{epoch}").shuffle(order)
            for b in range(0, len(order) - batch_size + 1 if len(order) >= batch_size else 1, batch_size):
                if step >= start_step:
                    yield self.batch(order[b : b + batch_size], max_len)
                step += 1
            epoch += 1

    # ------------------------------------------------------------------------------ persistence
    def save(self, out_dir: Path | str) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: getattr(self, name).contiguous().cpu() for name in
                   ("tokens", "offsets", "prompt_lens", "hidden", "teacher_ids", "teacher_probs")}
        save_file(tensors, str(out / "features.safetensors"))
        (out / "features.json").write_text(json.dumps({"layers": self.layers}))

    @classmethod
    def load(cls, out_dir: Path | str) -> FeatureStore:
        out = Path(out_dir)
        if not (out / "features.json").exists():
            raise FileNotFoundError(f"no cached features in {out}: extract them first")
        t = load_file(str(out / "features.safetensors"))
        layers = json.loads((out / "features.json").read_text())["layers"]
        return cls(layers, t["tokens"], t["offsets"], t["prompt_lens"], t["hidden"], t["teacher_ids"],
                   t["teacher_probs"])


@torch.inference_mode()
def extract_features(
    target: Transformer,
    samples: list[Sample],
    layers: list[int],
    *,
    topk: int = 8,
    batch_tokens: int = 8192,
    device: torch.device | str = "cpu",
    progress: Callable[[int], None] | None = None,
) -> FeatureStore:
    """Run the target over every sample (batches of similar length, right-padded: padding sits after every
    real token, so causal attention keeps it out of sight) and keep the requested layers and the teacher.
    The store is filled in place on `device` (a GPU run keeps tens of GB there, never two copies)."""
    if not samples:
        raise ValueError("no samples to extract features from")
    num_layers = target.config.num_layers
    layers = [i % num_layers for i in layers]
    lengths = torch.tensor([len(s.tokens) for s in samples])
    offsets = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0)))
    total = int(offsets[-1])
    hidden: torch.Tensor | None = None  # allocated at the first batch, in the dtype its values fit
    teacher_ids = torch.empty(total, topk, dtype=torch.int32, device=device)
    teacher_probs = torch.empty(total, topk, dtype=torch.half, device=device)
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
    batch_tokens = min(batch_tokens, LOGITS_BYTES // (4 * target.config.vocab_size))  # Gemma's 262k: 2,048
    b = 0
    while b < len(order):
        width = len(samples[order[b]].tokens)
        rows = max(1, batch_tokens // max(width, 1))
        idx = order[b : b + rows]
        width = max(len(samples[i].tokens) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(samples[i].tokens)] = torch.tensor(samples[i].tokens)
        out = target.forward(ids.to(target.device), target.new_cache(width, batch_size=len(idx)),
                             hidden_layers=layers)
        probs, top = out.logits.float().softmax(-1).topk(topk, dim=-1)
        states = torch.stack(out.hidden, dim=2) if layers else None  # [B, T, L, H]
        for r, i in enumerate(idx):
            a, n = int(offsets[i]), len(samples[i].tokens)
            if states is not None:
                hidden = _fit_storage(hidden, states[r, :n], (total, len(layers), target.config.hidden_size), device)
                hidden[a : a + n] = states[r, :n].to(device, hidden.dtype)
            teacher_ids[a : a + n] = top[r, :n].to(device, torch.int32)
            teacher_probs[a : a + n] = probs[r, :n].to(device, torch.half)
        b += len(idx)
        if progress is not None:
            progress(len(idx))
    return FeatureStore(
        layers=layers,
        tokens=torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long, device=device),
        offsets=offsets.to(device),
        prompt_lens=torch.tensor([s.prompt_len for s in samples], device=device),
        hidden=hidden if hidden is not None else torch.empty(total, 0, target.config.hidden_size, device=device),
        teacher_ids=teacher_ids,
        teacher_probs=teacher_probs,
    )


def _fit_storage(hidden: torch.Tensor | None, states: torch.Tensor, shape: tuple[int, ...],
                 device: torch.device | str) -> torch.Tensor:
    """The store for `states`: float16 (11-bit mantissa) while every value fits it, bfloat16 (float32's range)
    once one does not; a float16 store already filled is converted once, with a line saying why."""
    fits = bool(states.abs().amax() < torch.finfo(torch.half).max / 2)  # a margin for the batches to come
    if hidden is None:
        return torch.empty(shape, dtype=torch.half if fits else torch.bfloat16, device=device)
    if hidden.dtype == torch.half and not fits:
        log.info("target hidden states exceed float16's range: features kept in bfloat16 from here on")
        return hidden.to(torch.bfloat16)
    return hidden
