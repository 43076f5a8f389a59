"""What speculation keeps per model across requests (`Assets`): the draft models, EAGLE and Medusa heads, the layer-skip
search, the target's low-bit copies, the suffix cache of earlier outputs and the forward cost table that k='auto'
prices guesses with. Each method's builder (proposers/registry.py) reads them to make a request's proposer."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from ..models import Transformer
from ..models.eagle import EagleHead
from ..models.medusa import MedusaHeads
from ..models.published_heads import load_eagle_head, load_medusa_heads
from ..policy.cost import CostModel
from ..proposers import SuffixCache
from ..proposers.assets import Draft, is_path
from ..proposers.async_draft import Drafter
from ..proposers.layer_skip import SkipSearchResult, load_skip_search
from ..proposers.medusa import RankAccuracy
from ..proposers.online_learning import OnlineConfig, OnlineHead
from ..proposers.quantized import low_bit_copy

ASYNC_DRAFTS = ("draft", "quantized", "layer-skip")  # the methods that can draft ahead (async_draft)
# prompt lookup under k='auto' merges the continuations of the three latest matches into a tree, which the policy
# cuts to the depth that pays where a few tokens verify for the price of one (`auto_branches`); a fixed k verifies
# every branch whole, so it gets one (benchmarks/results/policy-replay-smollm2-cpu.md)
AUTO_BRANCHES = 3
# an EAGLE head beside a target with int8 activations (the GGUF default) runs in int8 too: in float32 a draft token
# reads a sizeable share of what the int4 target's forward reads, and drafting cost more than verification saved
EAGLE_BESIDE_A8 = "int8-a8"
# EAGLE heads that ship with the package, by registry name of their target
SHIPPED_EAGLE = {name: Path(__file__).resolve().parent.parent / "drafts" / f"{name}-eagle"
                 for name in ("smollm2-135m-instruct", "gemma3-270m")}


class Assets:
    """What a target's proposers share across requests (an `LLM` owns one); `load_draft(name, dtype=...)` loads a draft
    model by name (`LLM.load`)."""

    def __init__(self, model: Transformer, tokenizer, name: str = "", load_draft: Callable[..., Any] | None = None
                 ) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.load_draft = load_draft
        self._drafts: dict[str, Any] = {}  # loaded draft models (LLMs), by name or path
        self._heads: dict[str, EagleHead] = {}
        self._online: dict[str, OnlineHead] = {}  # heads learning while they serve, by folder
        self._medusa: dict[str, MedusaHeads] = {}
        self._cost: CostModel | None = None
        self._rank_accuracy: dict[int, RankAccuracy] = {}  # long-run, per loaded Medusa heads (by id)
        self._low_bit: dict[str, Transformer] = {}  # the target's low-bit copies (method "quantized"), by kind
        self._suffix: SuffixCache | None = None  # earlier outputs, shared by every request (method "suffix")
        self._drafter: Drafter | None = None  # drafts ahead for asynchronous requests (async_draft)

    def rank_accuracy(self, heads: MedusaHeads) -> RankAccuracy:
        """The long-run accuracy of loaded Medusa heads, shared by every request that drafts with them."""
        return self._rank_accuracy.setdefault(id(heads), RankAccuracy.of(heads))

    def low_bit(self, kind: str) -> Transformer:
        """The target's low-bit copy of this precision (built once; method "quantized" drafts with it)."""
        if kind not in self._low_bit:
            self._low_bit[kind] = low_bit_copy(self.model, kind)
        return self._low_bit[kind]

    def drafter(self, threads: int = 1) -> Drafter:
        """The worker thread that drafts ahead for this model's asynchronous requests (made on first use, with
        `threads` threads; the target's forwards keep the cores it leaves)."""
        if self._drafter is None:
            self._drafter = Drafter(threads, self.model.device)
        elif threads != self._drafter.threads:
            raise ValueError(f"the drafter already runs with {self._drafter.threads} threads")
        return self._drafter

    def suffix_cache(self, max_tokens: int | None = None) -> SuffixCache:
        """The global cache of earlier outputs that method 'suffix' matches (made on first use; `max_tokens`, given
        then, bounds it: default suffix.DEFAULT_CACHE_TOKENS, None at first use means that default)."""
        if self._suffix is None:
            self._suffix = SuffixCache() if max_tokens is None else SuffixCache(max_tokens)
        elif max_tokens is not None and max_tokens != self._suffix.index.max_tokens:
            raise ValueError(f"the suffix cache already exists with max_tokens={self._suffix.index.max_tokens}")
        return self._suffix

    def auto_branches(self) -> int:
        """Branches of prompt lookup's tree under k='auto': AUTO_BRANCHES where verifying 4 tokens costs about
        what one does (a bandwidth-bound forward), else a chain: where every verified token costs compute, a tree's
        siblings never pay for their place and keep the policy from guessing at all."""
        cost = self.cost_model()
        return AUTO_BRANCHES if cost.forward_seconds(4, 256) <= 1.25 * cost.forward_seconds(1, 256) else 1

    def skip_layers(self) -> list[int]:
        """Layers the layer-skip draft leaves out: searched once per model and cached (see tune_layer_skip)."""
        return self.skip_search().draft_layers

    def skip_search(self) -> SkipSearchResult:
        """The layer-skip search for this model on this machine: run once, then read from the cache."""
        result = load_skip_search(self.model)
        if result is None:
            logging.getLogger("specdecode").warning(
                "searching which layers of %s to skip for self-speculation (once; cached): "
                "run `specdecode tune layer-skip` to see it progress", self.name)
            result = self.tune_layer_skip()
        return result

    def tune_layer_skip(self, n_texts: int = 6, max_tokens: int = 128, progress=None):
        """Search the layers to skip on calibration text (never the benchmark), save and return the result."""
        from ..proposers.layer_skip import calibration_tokens, save_skip_layers, search_skip_layers

        texts = calibration_tokens(self.tokenizer, n_texts=n_texts, max_tokens=max_tokens)
        result = search_skip_layers(self.model, texts, self.cost_model(), progress=progress)
        save_skip_layers(self.model, result)
        return result

    def has_eagle_head(self) -> bool:
        """Whether an EAGLE head ships for this model (the default hybrid then merges it with suffix decoding)."""
        path = SHIPPED_EAGLE.get(self.name.lower())
        return path is not None and path.exists()

    def eagle_head(self, path: str | os.PathLike | None = None) -> EagleHead:
        """A trained EAGLE head for this model (loaded once): `path`, or the one shipped for it."""
        if path is None:
            path = SHIPPED_EAGLE.get(self.name.lower())
            if path is None or not path.exists():
                raise ValueError(f"no EAGLE head ships for {self.name!r}: train one (`specdecode train eagle "
                                 "--target ... --out DIR`) and pass draft=DIR (--draft DIR)")
        key = str(Path(path).expanduser().resolve())
        if key not in self._heads:
            head = load_eagle_head(key, self.model)  # ours, EAGLE-3 or EAGLE-1/2: detected, checked
            if self.model.quantization.endswith("-a8"):  # beside an int8-activation target: int8 too
                head.quantize_(EAGLE_BESIDE_A8)
            head.warm_up()
            self._heads[key] = head
        return self._heads[key]

    def online_head(self, path: str | os.PathLike | None = None, cfg: OnlineConfig | None = None) -> OnlineHead:
        """The EAGLE head of `path` (default: the shipped one) learning online, shared by every request that asks for
        it; its learner thread starts here (`cfg`, given at first use, sets how it learns)."""
        head = self.eagle_head(path)
        key = next(k for k, v in self._heads.items() if v is head)
        if key not in self._online:
            quantized = self.model.quantization.endswith("-a8")
            self._online[key] = OnlineHead(head, self.model.embed, cfg, EAGLE_BESIDE_A8 if quantized else None,
                                            output=self.model.lm_head)
            self._online[key].start()
        return self._online[key]

    def medusa_heads(self, path: str | os.PathLike | None) -> MedusaHeads:
        """Trained Medusa heads for this model (loaded once)."""
        if path is None:
            raise ValueError("method 'medusa' needs trained heads: train them (`specdecode train medusa --target ... "
                             "--out DIR`) and pass draft=DIR (--draft DIR)")
        key = str(Path(path).expanduser().resolve())
        if key not in self._medusa:
            heads = load_medusa_heads(key, self.model)  # ours or Medusa's layout: detected, checked
            self._medusa[key] = heads
        return self._medusa[key]

    def draft_model(self, draft: Draft) -> Any:
        """A draft model with the target's tokenizer (loaded once, in the target's dtype): a loaded LLM, or a
        registry name, HF checkpoint dir or .gguf file."""
        if draft is None or not is_path(draft):
            llm = draft
        else:
            path = Path(cast(str, draft)).expanduser()
            key = str(path.resolve()) if path.exists() else str(draft)
            if key not in self._drafts:
                if self.load_draft is None:
                    raise ValueError("these assets load no draft models: pass a loaded one (draft=llm)")
                self._drafts[key] = self.load_draft(draft, dtype=str(self.model.dtype).removeprefix("torch."))
            llm = self._drafts[key]
        check_same_tokenizer(self.tokenizer, llm.tokenizer)
        return llm

    def cost_model(self) -> CostModel:
        """The target's forward cost on this machine: calibrated on first use (about a minute), then read from the cache
        dir; the steps every request runs refine it (saved after requests that taught it something)."""
        if self._cost is None:
            if CostModel.cached(self.model) is None:  # k='auto' (the default) prices guesses with these
                logging.getLogger("specdecode").warning(
                    "timing %s's forwards on this machine for k='auto' (once per model and machine, cached: about a "
                    "minute on 2 busy cores, less on an idle machine)", self.name)
            self._cost = CostModel.for_model(self.model)
        return self._cost

    def save_cost_model(self, min_learned: int = 16) -> None:
        """Save what the requests so far taught the cost table (once it learned from `min_learned` steps), so the
        next process starts from it."""
        if self._cost is not None and self._cost.learned >= min_learned:
            CostModel.save(self.model, self._cost)


def check_same_tokenizer(target, draft) -> None:
    """Speculation needs one token space: refuse drafts whose vocabulary or special tokens differ."""
    problems = []
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv != dv:
        differ = sorted(set(tv.items()) ^ set(dv.items()))
        sample = ", ".join(repr(tok) for tok, _ in differ[:3])
        problems.append(f"vocabularies differ ({len(tv)} vs {len(dv)} tokens; e.g. {sample})")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target, attr, None), getattr(draft, attr, None)
        if a != b:
            problems.append(f"{attr} {a} vs {b}")
    if problems:
        raise ValueError(
            "the draft model's tokenizer does not match the target's: " + "; ".join(problems)
            + ". Use a draft trained with the target's tokenizer (same family), "
            "or another method such as prompt-lookup."
        )
