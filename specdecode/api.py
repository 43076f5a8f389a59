"""The user-facing API: load a model, generate text with any speculative method."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, overload

from .acceptance import AcceptanceStats
from .batch_cost import BatchCost
from .cost import CostModel
from .detokenize import RequestText
from .engine import Engine, Generation, policy_for
from .keywords import check_keywords, keyword_names
from .models import Transformer
from .models.eagle import EagleHead
from .models.loading import DTYPES, load_model
from .models.medusa import MedusaHeads
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
    SuffixCache,
    SuffixProposer,
)
from .proposers.layer_skip import SkipSearchResult, load_skip_search
from .proposers.medusa import RankAccuracy
from .proposers.quantized import low_bit_copy
from .proposers.suffix_eagle import SuffixEagleProposer
from .request import GenerationStats, Request
from .sampling import SamplingParams

METHODS = ("none", "prompt-lookup", "draft", "lookahead", "layer-skip", "hybrid", "eagle", "medusa", "quantized",
           "suffix")
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

    def __init__(self, pieces: Generator[str, None, GenerationOutput]) -> None:
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
        self._suffix: SuffixCache | None = None  # earlier outputs, shared by every request (method "suffix")

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
        ids = [int(t) for t in cast(Sequence[int], prompt)]
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
        precision of the target's copy that drafts, skip_layers: layers it also leaves out), suffix (nodes: the most
        guesses a step, sized by the cost model under k='auto'; matches this request's text and `suffix_cache()`)."""
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
        if method in ("eagle", "medusa"):
            if isinstance(draft, LLM):
                raise ValueError(f"method {method!r} drafts with trained heads: pass draft=<their folder>, not a model")
            if method == "eagle":
                return EagleProposer(self.eagle_head(draft), self.model, topk=topk, nodes=nodes,
                                     cost=self.cost_model())
            heads = self.medusa_heads(draft)
            accuracy = self._rank_accuracy.setdefault(id(heads), RankAccuracy.of(heads))
            return MedusaProposer(heads, self.model.config.vocab_size, cost=self.cost_model(), accuracy=accuracy)
        if method == "quantized":
            if low_bit not in self._low_bit:
                self._low_bit[low_bit] = low_bit_copy(self.model, low_bit)
            return QuantizedSelfProposer(self.model, self._low_bit[low_bit], low_bit, skip_layers or ())
        if method == "suffix":
            return SuffixProposer(self.suffix_cache(), nodes=nodes, cost=self.cost_model() if k == "auto" else None)
        if method == "hybrid" and draft is None and self.has_eagle_head():  # suffix + the EAGLE head, one tree
            cost = self.cost_model()
            return SuffixEagleProposer(SuffixProposer(self.suffix_cache(), nodes=nodes, cost=cost),
                                       EagleProposer(self.eagle_head(), self.model, topk=topk, nodes=nodes, cost=cost))
        if method == "hybrid":  # prompt lookup plus a model draft: the given one, else the layer-skipped target
            model_draft = self.proposer("draft" if draft is not None else "layer-skip", draft, skip_layers=skip_layers)
            return HybridProposer(PromptLookupProposer(max_ngram, min_ngram, branches or 1), model_draft)
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")

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
        """The target's forward cost on this machine: calibrated in seconds on first use, then read from the cache
        dir; the steps every request runs refine it (saved after requests that taught it something)."""
        if self._cost is None:
            if CostModel.cached(self.model) is None:  # k='auto' (the default) prices guesses with these
                logging.getLogger("specdecode").warning(
                    "timing %s's forwards on this machine for k='auto' (once, seconds; cached)", self.name)
            self._cost = CostModel.for_model(self.model)
        return self._cost

    def save_cost_model(self, min_learned: int = 16) -> None:
        """Save what the requests so far taught the cost table (once it learned from `min_learned` steps), so the
        next process starts from it."""
        if self._cost is not None and self._cost.learned >= min_learned:
            CostModel.save(self.model, self._cost)

    def acceptance(self, key: str) -> Callable[[str], AcceptanceStats]:
        """The long-run acceptance statistics of a method and its options (and of named parts of its proposer),
        which each request starts from and hands back to."""
        return lambda part: self._acceptance.setdefault(f"{key}|{part}" if part else key, AcceptanceStats())

    # -------------------------------------------------------------------------------- generation
    @overload
    def generate(self, prompt: list[str], *, stream: Literal[False] = False, **options: Any) -> list[GenerationOutput]:
        ...

    @overload
    def generate(self, prompt: Prompt, *, stream: Literal[False] = False, **options: Any) -> GenerationOutput: ...

    @overload
    def generate(self, prompt: Prompt, *, stream: Literal[True], **options: Any) -> TextStream: ...

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
            return self._generate_many(list(cast(Sequence[Prompt], prompt)), stop, method=method, draft=draft, k=k,
                                       max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                       top_p=top_p, seed=seed, chat=chat, **proposer_options)
        gen = self.start(cast(Prompt, prompt), method=method, draft=draft, k=k, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chat=chat, **proposer_options)
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        result = TextStream(self._pieces(gen, stops, method))
        if stream:
            return result
        for _ in result:
            pass
        assert result.output is not None
        return result.output

    def _generate_many(self, prompts: list[Prompt], stop: str | Sequence[str] | None, **options: Any
                       ) -> list[GenerationOutput]:
        """generate() of several prompts as one batch through the engine: each step verifies every row in one
        forward (the server's continuous batching, without a server); a row leaves when its text ends."""
        engine, first = self._request(prompts[0], **options)
        requests = [first, *(self._request(p, engine=engine, **options)[1] for p in prompts[1:])]
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        texts = [RequestText(self.tokenizer, stops, self.stop_token_ids) for _ in requests]
        row_text = {id(r): t for r, t in zip(requests, texts, strict=True)}
        try:
            for request in requests:
                engine.add(request)
            while engine.rows:
                for request, result in engine.step():
                    if isinstance(result, Exception):
                        raise result
                    text = row_text[id(request)]
                    text.step(result, request.finish_reason)
                    if text.finish and request in engine.rows:
                        engine.remove(request)
        finally:
            for request in list(engine.rows):
                engine.remove(request)
        method = options.get("method", DEFAULT_METHOD)
        return [GenerationOutput(text=t.text, token_ids=t.token_ids, finish_reason=t.finish or "length", method=method,
                                 prompt_tokens=r.stats.prompt_tokens, stats=r.stats)
                for r, t in zip(requests, texts, strict=True)]

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
        engine, request = self._request(prompt, method=method, draft=draft, k=k, max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chat=chat,
                                        **proposer_options)
        return Generation(engine, request)

    def _request(self, prompt: Prompt, *, method: str = DEFAULT_METHOD, draft: str | os.PathLike | LLM | None = None,
                 k: int | str = "auto", max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, chat: bool = False, engine: Engine | None = None,
                 **proposer_options: Any) -> tuple[Engine, Request]:
        """A request, and the engine it will run in (`engine`, else a new one priced for a request alone)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        proposer = self.proposer(method, draft, k=k, **proposer_options)
        ids = self.encode(prompt, chat=chat)
        if engine is None:
            priced = k == "auto" and proposer.capabilities.guesses
            engine = Engine(self.model, BatchCost.single(self.cost_model() if priced else CostModel.flat()))
        key = f"{method}|{draft}|{sorted(proposer_options.items())}"
        policy = policy_for(k, proposer, engine.view, self.acceptance(key))
        request = Request(self.model.config.max_position_embeddings, proposer, ids, max_new_tokens=max_new_tokens,
                          params=params, k=policy, stop_token_ids=self.stop_token_ids, seed=seed)
        return engine, request

    def _pieces(self, gen: Generation, stops: list[str], method: str) -> Generator[str, None, GenerationOutput]:
        text = RequestText(self.tokenizer, stops, self.stop_token_ids)
        try:
            for step in gen:
                if piece := text.step(step, gen.finish_reason):
                    yield piece
                if text.finish:
                    break
        finally:
            gen.close()
            self.save_cost_model()
        return GenerationOutput(text=text.text, token_ids=text.token_ids, finish_reason=text.finish or "length",
                                method=method, prompt_tokens=gen.stats.prompt_tokens, stats=gen.stats)


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

