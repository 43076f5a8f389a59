"""The user-facing API: load a model, generate text with any speculative method."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .detokenize import IncrementalText
from .engine import Generation, GenerationStats
from .keywords import check_keywords, keyword_names
from .models import Transformer
from .models.eagle import EagleHead
from .models.loading import DTYPES, load_model
from .policy import AcceptanceStats, AdaptiveK, CostModel, FixedK, Policy
from .proposers import (
    DraftModelProposer,
    EagleProposer,
    HybridProposer,
    LayerSkipProposer,
    LookaheadProposer,
    MedusaProposer,
    NoProposer,
    PromptLookupProposer,
    Proposer,
    QuantizedSelfProposer,
)
from .proposers.layer_skip import SkipSearchResult, load_skip_search
from .proposers.medusa import RankAccuracy
from .proposers.quantized import low_bit_copy
from .sampling import SamplingParams
from .training.medusa import MedusaHeads

METHODS = ("none", "prompt-lookup", "draft", "lookahead", "layer-skip", "hybrid", "eagle", "medusa", "quantized")
# the default of generate() and of the CLI: the fastest lossless method that needs nothing trained or loaded besides
# the target (with k='auto' it never costs more than a few probes where guessing does not pay)
DEFAULT_METHOD = "prompt-lookup"
# prompt lookup under k='auto' merges the continuations of the three latest matches into a tree: the policy cuts
# it to the depth that pays, and on this CPU 3-6 tokens verify for the price of one (benchmarks/policy_replay.py:
# 1.66x with 3 branches, 1.63x with one; a fixed k does best with one branch, as it verifies every branch whole)
AUTO_BRANCHES = 3
# EAGLE heads that ship with the package, by registry name of their target
SHIPPED_EAGLE = {"smollm2-135m-instruct": Path(__file__).resolve().parent / "drafts" / "smollm2-135m-instruct-eagle"}
# End-of-turn markers of common chat templates; generation stops at whichever the vocabulary has.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")

Prompt = str | Sequence[int] | Sequence[dict[str, str]]
PROMPT_KINDS = ("a prompt is a string, a list of token ids or a list of chat messages ({'role': ..., 'content': ...}); "
                "several prompts: a list of those")


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, end of turn or a stop string) | "length"
    method: str
    prompt_tokens: int
    stats: GenerationStats = field(repr=False)


class TextStream:
    """Iterate for text pieces as they become final; `.output` holds the full result afterwards."""

    def __init__(self, pieces: Iterator[str]) -> None:
        self._pieces = pieces
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[str]:
        self.output = yield from self._pieces


class LLM:
    def __init__(self, model: Transformer, tokenizer, name: str = "") -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.stop_token_ids = stop_token_ids(tokenizer)
        self._drafts: dict[str, LLM] = {}
        self._heads: dict[str, EagleHead] = {}
        self._medusa: dict[str, MedusaHeads] = {}
        self._cost: CostModel | None = None
        self._acceptance: dict[str, AcceptanceStats] = {}  # long-run acceptance per method and options
        self._rank_accuracy: dict[int, RankAccuracy] = {}  # long-run, per loaded Medusa heads (by id)
        self._low_bit: dict[str, Transformer] = {}  # the target's low-bit copies (method "quantized"), by kind

    @classmethod
    def load(cls, name_or_path: str | os.PathLike = "smollm2-135m-instruct", *, dtype: str = "float32",
             quantization: str | None = "auto") -> LLM:
        """quantization: "auto" (a GGUF file's Q4_0 / Q4_1 / Q8_0 weights as stored, multiplied as llama.cpp does,
        with int8 activations; others in `dtype`), None (every weight in `dtype`), "int4" or "int8" (weight-only,
        blocks of 32, float32 activations), "int4-a8" or "int8-a8" (with int8 activations)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        from transformers import AutoTokenizer

        model, path = load_model(name_or_path, dtype=DTYPES[dtype], quantization=quantization)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(model, tokenizer, name=str(name_or_path))

    # ---------------------------------------------------------------------------------- prompts
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, str) and not chat:
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt[0], dict):
            if not all(isinstance(m, dict) for m in prompt):
                raise ValueError(f"{PROMPT_KINDS}, not a list of {kinds(prompt)}")
            if not self.tokenizer.chat_template:
                raise ValueError(f"{self.name}'s tokenizer has no chat template: pass a plain string without chat")
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_dict=False)
            return list(ids)
        if not all(isinstance(t, int) or hasattr(t, "__index__") for t in prompt):
            raise ValueError(f"{PROMPT_KINDS}, not a list of {kinds(prompt)}")
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < self.model.config.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {self.model.config.vocab_size})")
        return ids

    # --------------------------------------------------------------------------------- proposers
    def proposer(
        self,
        method: str,
        draft: str | os.PathLike | LLM | None = None,
        *,
        k: int | str = "auto",
        max_ngram: int = 3,
        min_ngram: int = 1,
        branches: int | None = None,
        window: int = 4,
        ngram: int = 3,
        guesses: int = 4,
        skip_layers: Sequence[int] | None = None,
        topk: int = 4,
        nodes: int = 24,
        low_bit: str = "int4-a8",
    ) -> Proposer:
        """A fresh proposer for `method`, to run with `k`; options: prompt lookup (max_ngram, min_ngram, branches:
        default AUTO_BRANCHES with k='auto', else 1),
        lookahead (window, ngram, guesses), layer-skip (skip_layers, default: searched once and cached),
        eagle (draft = a trained head's folder, default: the one shipped for this model; topk, nodes: the most
        guesses a step, the tree is sized by the cost model within them and the depth k),
        medusa (draft = trained heads' folder; the tree is sized by the cost model), quantized (low_bit: the
        precision of the target's copy that drafts, skip_layers: layers it also leaves out)."""
        if method == "none":
            return NoProposer()
        if method == "prompt-lookup":
            if branches is None:
                branches = self.auto_branches() if k == "auto" else 1
            return PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram, branches=branches)
        if method == "draft":
            if draft is None:
                raise ValueError("method 'draft' needs a draft model: pass draft=<registry name, HF dir or .gguf>")
            return DraftModelProposer(self.draft_model(draft).model, self.model.config.vocab_size)
        if method == "lookahead":
            return LookaheadProposer(window=window, ngram=ngram, guesses=guesses)
        if method == "layer-skip":
            if skip_layers is not None:
                return LayerSkipProposer(self.model, skip_layers)
            search = self.skip_search()
            return LayerSkipProposer(self.model, search.draft_layers, pays=search.pays)
        if method == "eagle":
            return EagleProposer(self.eagle_head(draft), self.model, topk=topk, nodes=nodes, cost=self.cost_model())
        if method == "medusa":
            heads = self.medusa_heads(draft)
            accuracy = self._rank_accuracy.setdefault(id(heads), RankAccuracy.of(heads))
            return MedusaProposer(heads, self.model.config.vocab_size, cost=self.cost_model(), accuracy=accuracy)
        if method == "quantized":
            if low_bit not in self._low_bit:
                self._low_bit[low_bit] = low_bit_copy(self.model, low_bit)
            return QuantizedSelfProposer(self.model, self._low_bit[low_bit], low_bit, skip_layers or ())
        if method == "hybrid":  # prompt lookup plus a model draft: the given one, else the layer-skipped target
            model_draft = self.proposer("draft" if draft is not None else "layer-skip", draft, skip_layers=skip_layers)
            return HybridProposer(PromptLookupProposer(max_ngram, min_ngram, branches or 1), model_draft)
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")

    def auto_branches(self) -> int:
        """Branches of prompt lookup's tree under k='auto': AUTO_BRANCHES where verifying 4 tokens costs about
        what one does (a bandwidth-bound forward: oneDNN's float32), else a chain. Where every verified token
        costs compute (int4 on 2 AVX2 cores: 4 tokens cost 2.2 plain steps) a tree's siblings never pay for
        their place and kept the policy from guessing at all (tau 1.00 on Spec-Bench)."""
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
        from .proposers.layer_skip import calibration_tokens, save_skip_layers, search_skip_layers

        texts = calibration_tokens(self.tokenizer, n_texts=n_texts, max_tokens=max_tokens)
        result = search_skip_layers(self.model, texts, self.cost_model(), progress=progress)
        save_skip_layers(self.model, result)
        return result

    def eagle_head(self, path: str | os.PathLike | None = None) -> EagleHead:
        """A trained EAGLE head for this model (loaded once): `path`, or the one shipped for it."""
        if path is None:
            path = SHIPPED_EAGLE.get(self.name.lower())
            if path is None or not path.exists():
                raise ValueError(f"no EAGLE head ships for {self.name!r}: train one (`specdecode train eagle "
                                 "--target ... --out DIR`) and pass draft=DIR (--draft DIR)")
        key = str(Path(path).expanduser().resolve())
        if key not in self._heads:
            head = EagleHead.load(key, dtype=self.model.dtype, device=self.model.device)
            head.check_target(self.model)
            self._heads[key] = head
        return self._heads[key]

    def medusa_heads(self, path: str | os.PathLike | None) -> MedusaHeads:
        """Trained Medusa heads for this model (loaded once)."""
        if path is None:
            raise ValueError("method 'medusa' needs trained heads: train them (`specdecode train medusa --target ... "
                             "--out DIR`) and pass draft=DIR (--draft DIR)")
        key = str(Path(path).expanduser().resolve())
        if key not in self._medusa:
            heads = MedusaHeads.load(key, dtype=self.model.dtype, device=self.model.device)
            heads.check_target(self.model)
            self._medusa[key] = heads
        return self._medusa[key]

    def draft_model(self, draft: str | os.PathLike | LLM) -> LLM:
        if isinstance(draft, LLM):
            llm = draft
        else:
            key = str(Path(draft).expanduser().resolve()) if Path(draft).expanduser().exists() else str(draft)
            if key not in self._drafts:
                self._drafts[key] = LLM.load(draft, dtype=str(self.model.dtype).removeprefix("torch."))
            llm = self._drafts[key]
        check_same_tokenizer(self.tokenizer, llm.tokenizer)
        return llm

    def cost_model(self) -> CostModel:
        """The target's forward cost on this machine (measured once, then read from the cache dir)."""
        if self._cost is None:
            if CostModel.cached(self.model) is None:  # k='auto' (the default) prices guesses with these
                logging.getLogger("specdecode").warning(
                    "timing %s's forwards on this machine for k='auto' (once, about a minute; cached)", self.name)
            self._cost = CostModel.for_model(self.model)
        return self._cost

    def policy(self, k: int | str, proposer: Proposer, key: str = "") -> Policy:
        """k = 'auto': the cost model decides each step; an int: always guess k tokens."""
        if k == "auto":
            if isinstance(proposer, NoProposer) or not proposer.expected_to_pay:
                return FixedK(0)
            if proposer.sizes_itself:  # sizes each step from the cost model (which its steps keep correcting)
                return FixedK(proposer.max_depth, cost=self.cost_model())
            key = key or proposer.name
            if isinstance(proposer, HybridProposer):  # its model draft gets a cost-aware policy of its own
                draft_stats = self._acceptance.setdefault(key + "|draft", AcceptanceStats())
                proposer.draft_policy = AdaptiveK(self.cost_model(), draft_stats, cheap=False) \
                    if proposer.draft.expected_to_pay else FixedK(0)
            stats = self._acceptance.setdefault(key, AcceptanceStats())
            return AdaptiveK(self.cost_model(), stats, cheap=proposer.cheap,
                             tree_size=getattr(proposer, "tree_size", None))
        if isinstance(k, str):
            if not k.isdigit():
                raise ValueError(f"k must be 'auto' or an integer >= 0 (tokens guessed per step), got {k!r}")
            k = int(k)
        return FixedK(k)

    # -------------------------------------------------------------------------------- generation
    def generate(
        self,
        prompt: Prompt | Sequence[Prompt],
        *,
        method: str = DEFAULT_METHOD,
        draft: str | os.PathLike | LLM | None = None,
        k: int | str = "auto",
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        chat: bool = False,
        stream: bool = False,
        **proposer_options: Any,
    ) -> GenerationOutput | TextStream | list[GenerationOutput]:
        """Text for `prompt` (a string, token ids or chat messages), by default with prompt lookup and k='auto'
        (method='none': plain decoding). Several prompts (a list of those): a list of outputs, in order.
        Method options (max_ngram, window, skip_layers, ...): see `proposer`."""
        check_keywords("generate", proposer_options, keyword_names(self.generate) | self.proposer_options())
        if many_prompts(prompt):
            if stream:
                raise ValueError("stream=True takes one prompt: stream them one at a time")
            return self._generate_many(list(prompt), method=method, draft=draft, k=k, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                                       chat=chat, **proposer_options)
        gen = self.start(prompt, method=method, draft=draft, k=k, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chat=chat, **proposer_options)
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        result = TextStream(self._pieces(gen, stops, method))
        if stream:
            return result
        for _ in result:
            pass
        return result.output

    def _generate_many(self, prompts: list[Prompt], **options: Any) -> list[GenerationOutput]:
        """generate() of several prompts: for now one after another (outputs as generate gives them one by one)."""
        return [self.generate(prompt, **options) for prompt in prompts]

    def proposer_options(self) -> set[str]:
        """The method options generate() and start() pass on to `proposer`."""
        return keyword_names(self.proposer) - {"method", "draft", "k"}

    def start(
        self,
        prompt: Prompt,
        *,
        method: str = DEFAULT_METHOD,
        draft: str | os.PathLike | LLM | None = None,
        k: int | str = "auto",
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        chat: bool = False,
        **proposer_options: Any,
    ) -> Generation:
        """A request on token ids, ready to run: each iteration runs one step and yields its new token ids
        (the benchmark steps several requests in turn). `generate` adds text, stop strings and streaming."""
        check_keywords("start", proposer_options, keyword_names(self.start) | self.proposer_options())
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        proposer = self.proposer(method, draft, k=k, **proposer_options)
        ids = self.encode(prompt, chat=chat)
        key = f"{method}|{draft}|{sorted(proposer_options.items())}"
        policy = FixedK(k) if isinstance(k, int) else self.policy(k, proposer, key)
        return Generation(
            self.model, proposer, ids, max_new_tokens=max_new_tokens, params=params, k=policy,
            stop_token_ids=self.stop_token_ids, seed=seed,
        )

    def _pieces(self, gen: Generation, stops: list[str], method: str):
        text = IncrementalText(self.tokenizer, stops)
        finish, stop_token = None, []
        try:
            for step in gen:
                for token in step:
                    if token in self.stop_token_ids:
                        finish, stop_token = "stop", [token]  # kept in token_ids, never in the text
                        break
                    if text.add(token):
                        finish = "stop"
                        break
                if finish:
                    break
                if piece := text.ready():
                    yield piece
        finally:
            gen.close()
        if piece := text.finish():
            yield piece
        return GenerationOutput(
            text=text.text,
            token_ids=text.tokens + stop_token,
            finish_reason=finish or gen.finish_reason or "length",
            method=method,
            prompt_tokens=gen.stats.prompt_tokens,
            stats=gen.stats,
        )


def kinds(items) -> str:
    return "/".join(sorted({type(t).__name__ for t in items}))


def many_prompts(prompt: Prompt | Sequence[Prompt]) -> bool:
    """A list of prompts (strings, token-id lists or message lists), rather than one prompt."""
    return isinstance(prompt, list | tuple) and len(prompt) > 0 and isinstance(prompt[0], str | list | tuple)


def stop_token_ids(tokenizer) -> frozenset[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {}))
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in special)
    return frozenset(ids)


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


def load(name_or_path: str | os.PathLike = "smollm2-135m-instruct", *, dtype: str = "float32",
         quantization: str | None = "auto") -> LLM:
    """Load a model by registry name, HF checkpoint dir or .gguf file (see `LLM.load` for quantization)."""
    return LLM.load(name_or_path, dtype=dtype, quantization=quantization)

