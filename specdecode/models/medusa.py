"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state guess the tokens +2..+K+1
after it. The runtime half: the heads and their saved form; training lives in training/medusa.py."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .llama import Transformer


@dataclass
class MedusaConfig:
    heads: int
    hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    accuracy: list[list[float]] | None = None  # [head][rank]: P(head's rank-r guess is the target's token)
    target: str = ""  # what the heads were trained on (for the record)
    model_type: str = field(default="medusa")

    def __post_init__(self) -> None:
        if self.heads < 1:
            raise ValueError(f"Medusa needs at least one head, got heads={self.heads}")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft vocabulary of {self.draft_vocab_size} tokens must be in "
                             f"[1, {self.target_vocab_size}] (the target's vocabulary)")


class MedusaHeads(nn.Module):
    """hidden [..., H] (the target's last layer, before its final norm) -> logits [..., K, draft vocab]."""

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.config = cfg
        k, h, v = cfg.heads, cfg.hidden_size, cfg.draft_vocab_size
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps).requires_grad_(False)  # the target's, frozen
        self.res_weight = nn.Parameter(torch.zeros(k, h, h))
        self.res_bias = nn.Parameter(torch.zeros(k, h))
        self.out_weight = nn.Parameter(torch.zeros(k, v, h))
        self.register_buffer("vocab_ids", torch.arange(v))  # draft index -> target token id

    def forward(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """heads: run only the first ones (each costs its share of the weights read)."""
        k = heads or self.config.heads
        x = self.norm(hidden)
        y = x.unsqueeze(-2) + F.silu(torch.einsum("...h,kgh->...kg", x, self.res_weight[:k]) + self.res_bias[:k])
        return torch.einsum("...kh,kvh->...kv", y, self.out_weight[:k])

    def target_logits(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """[..., K, target vocab]: -inf on tokens outside the draft vocabulary (never guessed)."""
        return self.to_target_vocab(self.forward(hidden, heads))

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft vocab] spread over the target's (-inf elsewhere)."""
        full = logits.new_full((*logits.shape[:-1], self.config.target_vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, logits)

    def to_draft(self) -> torch.Tensor:
        """[target vocab] target id -> draft index, -1 outside the draft vocabulary."""
        table = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long, device=self.vocab_ids.device)
        table[self.vocab_ids] = torch.arange(len(self.vocab_ids), device=table.device)
        return table

    def check_target(self, target: Transformer) -> None:
        cfg, tcfg = self.config, target.config
        if (cfg.hidden_size, cfg.target_vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
            raise ValueError(
                f"these Medusa heads were trained for a target with hidden size {cfg.hidden_size} and "
                f"{cfg.target_vocab_size} tokens ({cfg.target or 'unknown'}), not {tcfg.hidden_size} and "
                f"{tcfg.vocab_size}: train heads for this target with `specdecode train medusa`"
            )

    # ---------------------------------------------------------------------------------- building
    @classmethod
    @torch.no_grad()
    def from_target(cls, target: Transformer, heads: int, vocab_ids: torch.Tensor, name: str = "") -> MedusaHeads:
        """Fresh heads: the target's final norm, output rows = the target's lm_head rows, zero residuals."""
        tcfg = target.config
        vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long).sort().values
        cfg = MedusaConfig(heads, tcfg.hidden_size, tcfg.vocab_size, len(vocab_ids), tcfg.rms_norm_eps, target=name)
        out = cls(cfg).to(device=target.device, dtype=target.dtype)
        out.norm.weight.copy_(target.norm.weight)
        out.out_weight.copy_(target.lm_head.weight[vocab_ids.to(target.device)].expand(heads, -1, -1))
        out.vocab_ids.copy_(vocab_ids)
        return out

    # ------------------------------------------------------------------------------- persistence
    def save(self, out_dir: Path | str, dtype: torch.dtype | None = None) -> Path:
        """dtype: store the weights in it (bfloat16 halves the files; they are cast back on load)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in self.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(asdict(self.config), indent=1))
        return out

    @classmethod
    def load(cls, path: Path | str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
             ) -> MedusaHeads:
        path = Path(path).expanduser()
        config, weights = path / "config.json", path / "model.safetensors"
        if not config.is_file() or not weights.is_file():
            raise FileNotFoundError(f"{path} holds no Medusa heads (config.json + model.safetensors): "
                                    "train them with `specdecode train medusa`")
        data = json.loads(config.read_text())
        if data.get("model_type") != "medusa":
            raise ValueError(f"{path} is not a Medusa checkpoint (model_type {data.get('model_type')!r})")
        heads = cls(MedusaConfig(**data))
        heads.load_state_dict(load_file(str(weights)), assign=True)  # as saved: no rounding through float32
        return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
