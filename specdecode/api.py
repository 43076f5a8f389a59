"""The user-facing API: load a model, generate text with any speculative method."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, overload

from .common.keywords import check_keywords, keyword_names
from .common.names import DEFAULT_METHOD, METHODS
from .core import chat_template as chat_templates
from .core.acceptance import AcceptanceStats
from .core.detokenize import RequestText
from .core.grammar import GrammarTokenizer, StructuredOutput
from .core.sampling import SAMPLING_OPTIONS, SamplingParams
from .engine.assets import AUTO_BRANCHES, SHIPPED_EAGLE, Assets, check_same_tokenizer
from .engine.loop import Engine, Generation
from .engine.prefix_cache import PrefixCache
from .engine.request import GenerationStats, Request, TokenLogprob
from .models import Transformer
from .models.cache import kv_dtype
from .models.loading import DTYPES, load_model
from .policy.batch_cost import BatchCost
from .policy.cost import CostModel
from .policy.speculation import Pricing
from .proposers import Proposer, registry

__all__ = ["AUTO_BRANCHES", "DEFAULT_METHOD", "LLM", "METHODS", "SHIPPED_EAGLE", "GenerationOutput", "TextStream",
           "check_same_tokenizer", "load", "stop_token_ids"]

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
    # with generate(logprobs=N): each generated token's log-probability and its N likeliest alternatives
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)


class TextStream:
    """Iterate for text pieces as they become final; `.output` holds the full result afterwards."""

    def __init__(self, pieces: Generator[str, None, GenerationOutput]) -> None:
        self._pieces = pieces
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[str]:
        self.output = yield from self._pieces


class LLM:
    """A target model and its tokenizer: generate text (one prompt, a stream, or a list run as one batch) with any
    method; what speculation keeps per model across requests (drafts, heads, cost table, low-bit copies, the suffix
    cache) is its `assets`."""

    def __init__(self, model: Transformer, tokenizer, name: str = "", prefix_cache_mb: int = 0) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.assets = Assets(model, tokenizer, name, load_draft=type(self).load)
        self.stop_token_ids = stop_token_ids(tokenizer)
        # earlier requests' keys and values, reused by a prompt that begins the same way (None: every prompt prefilled)
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb else None
        self._acceptance: dict[str, AcceptanceStats] = {}  # long-run acceptance per method and options
        self._grammar: GrammarTokenizer | None = None

    @classmethod
    def load(cls, name_or_path: str | os.PathLike = "smollm2-135m-instruct", *, dtype: str = "float32",
             quantization: str | None = "auto", prefix_cache_mb: int = 0, kv_cache_dtype: str = "float16") -> LLM:
        """quantization: "auto" (a GGUF file's Q4_0 / Q4_1 / Q8_0 weights as stored, multiplied as llama.cpp does,
        with int8 activations; others in `dtype`), None (every weight in `dtype`), "int4" or "int8" (weight-only,
        blocks of 32, float32 activations), "int4-a8" or "int8-a8" (with int8 activations). prefix_cache_mb: keep
        up to this many MiB of earlier requests' keys and values, so a prompt that begins as an earlier request's
        text did (a chat's next turn, a shared system prompt) prefills only the rest (0: off). kv_cache_dtype:
        "float16" (half the memory, as llama.cpp) or "float32", the keys and values of a float32 model (other dtypes
        keep theirs); greedy speculation equals plain decoding with the same cache type."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        kv_dtype(DTYPES[dtype], kv_cache_dtype)  # a bad name refused before the model loads
        from transformers import AutoTokenizer

        model, path = load_model(name_or_path, dtype=DTYPES[dtype], quantization=quantization)
        model.kv_cache_dtype = kv_cache_dtype
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(model, tokenizer, name=str(name_or_path), prefix_cache_mb=prefix_cache_mb)

    # ---------------------------------------------------------------------------------- prompts
    def encode(self, prompt: Prompt, chat: bool = False, *, chat_template: str | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_kwargs: dict[str, Any] | None = None, tokenizer=None) -> list[int]:
        """Token ids of a prompt; chat messages (or a string with chat=True) through the chat template: the
        tokenizer's own, or `chat_template` (Jinja, run in transformers' sandbox), with the assistant's turn opened
        (add_generation_prompt) or the last message continued (continue_final_message); template_kwargs: more
        variables for the template (e.g. enable_thinking; apply_chat_template's own arguments are refused);
        tokenizer: a copy of this model's to use (a fast tokenizer runs in one thread at a time)."""
        tokenizer = tokenizer or self.tokenizer
        if isinstance(prompt, str) and not chat:
            return list(tokenizer(prompt)["input_ids"])
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt[0], dict):
            if not all(isinstance(m, dict) for m in prompt):
                raise ValueError(f"{PROMPT_KINDS}, not a list of {kinds(prompt)}")
            if not (chat_template or tokenizer.chat_template):
                raise ValueError(f"{self.name}'s tokenizer has no chat template: pass a plain string without chat")
            text = chat_templates.render(tokenizer, cast(Sequence[dict], prompt), chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, variables=template_kwargs)
            return chat_templates.tokenize(tokenizer, text)
        if not all(isinstance(t, int) or hasattr(t, "__index__") for t in prompt):
            raise ValueError(f"{PROMPT_KINDS}, not a list of {kinds(prompt)}")
        ids = [int(t) for t in cast(Sequence[int], prompt)]
        if any(not 0 <= t < self.model.config.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {self.model.config.vocab_size})")
        return ids

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
        logprobs: int | None = None,
        structured: StructuredOutput | dict[str, Any] | None = None,
        **proposer_options: Any,
    ) -> GenerationOutput | TextStream | list[GenerationOutput]:
        """Text for `prompt` (a string, token ids or chat messages), by default with prompt lookup and k='auto'
        (method='none': plain decoding). Several prompts (a list of those): a list of outputs, in order.
        Sampling options besides temperature, top_k and top_p (min_p, logit_bias, presence_penalty,
        frequency_penalty, repetition_penalty, min_tokens): see SamplingParams; speculation stays lossless under
        them. logprobs=N: the output's `logprobs` holds each token's log-probability under the target and its N
        likeliest alternatives. structured={"json": schema} (or {"json": True}: any JSON object), {"regex": r} or
        {"choice": [...]}: the output follows it (through the grammar; still lossless: exactly structured plain
        decoding). Method options (max_ngram, window, skip_layers, ...): see `proposer`."""
        check_keywords("generate", proposer_options,
                       keyword_names(self.generate) | self.proposer_options() | SAMPLING_OPTIONS)
        if many_prompts(prompt):
            if stream:
                raise ValueError("stream=True takes one prompt: stream them one at a time")
            return self._generate_many(list(cast(Sequence[Prompt], prompt)), stop, method=method, draft=draft, k=k,
                                       max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                       top_p=top_p, seed=seed, chat=chat, logprobs=logprobs, structured=structured,
                                       **proposer_options)
        gen = self.start(cast(Prompt, prompt), method=method, draft=draft, k=k, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chat=chat, logprobs=logprobs,
                         structured=structured, **proposer_options)
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
                                 prompt_tokens=r.stats.prompt_tokens, stats=r.stats, logprobs=kept_logprobs(r, t))
                for r, t in zip(requests, texts, strict=True)]

    def grammar(self) -> GrammarTokenizer:
        """The tokenizer as the structured-output grammars read it (built at first use, about half a second)."""
        if self._grammar is None:
            self._grammar = GrammarTokenizer(self.tokenizer, self.model.config.vocab_size, self.stop_token_ids)
        return self._grammar

    def proposer(self, method: str, draft: str | os.PathLike | LLM | None = None, *, k: int | str = "auto",
                 **options: Any) -> Proposer:
        """A fresh proposer for `method`, to run with `k`. Options, each method taking its own (proposers/registry.py
        lists them; the others are ignored): prompt lookup (max_ngram, min_ngram, branches: default AUTO_BRANCHES
        with k='auto', else 1), lookahead (window, ngram, guesses), layer-skip (skip_layers, default: searched once
        and cached), eagle (draft = a trained head's folder, default: the one shipped for this model; topk, nodes:
        the most guesses a step, the tree is sized by the cost model within them and the depth k), medusa (draft =
        trained heads' folder; the tree is sized by the cost model), quantized (low_bit: the precision of the
        target's copy that drafts, skip_layers: layers it also leaves out), suffix (nodes: the most guesses a step,
        sized by the cost model under k='auto'; matches this request's text and `assets.suffix_cache()`).
        online_draft: eagle's head (hybrid's too) keeps learning from what the target verifies
        (`assets.online_head`). cascade: 'prompt-lookup' guesses for the model draft (draft, quantized, layer-skip),
        which checks its guesses in one forward. async_draft: the model draft drafts the next step while the target
        verifies this one, in a worker thread with `draft_threads` threads (see proposers/async_draft.py)."""
        check_keywords("proposer", options, registry.option_names())
        return registry.build(self.assets, method, draft, k=k, **options)

    def proposer_options(self) -> set[str]:
        """The method options generate() and start() pass on to `proposer`."""
        return registry.option_names()

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
        logprobs: int | None = None,
        structured: StructuredOutput | dict[str, Any] | None = None,
        **proposer_options: Any,
    ) -> Generation:
        """A request on token ids, ready to run: each iteration runs one step and yields its new token ids
        (the benchmark steps several requests in turn). `generate` adds text, stop strings and streaming."""
        check_keywords("start", proposer_options,
                       keyword_names(self.start) | self.proposer_options() | SAMPLING_OPTIONS)
        engine, request = self._request(prompt, method=method, draft=draft, k=k, max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chat=chat,
                                        logprobs=logprobs, structured=structured, **proposer_options)
        return Generation(engine, request)

    def _request(self, prompt: Prompt, *, method: str = DEFAULT_METHOD, draft: str | os.PathLike | LLM | None = None,
                 k: int | str = "auto", max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, chat: bool = False, engine: Engine | None = None,
                 logprobs: int | None = None, structured: StructuredOutput | dict[str, Any] | None = None,
                 **proposer_options: Any) -> tuple[Engine, Request]:
        """A request, and the engine it will run in (`engine`, else a new one priced for a request alone)."""
        sampling = {name: proposer_options.pop(name) for name in list(proposer_options) if name in SAMPLING_OPTIONS}
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, **sampling)
        proposer = self.proposer(method, draft, k=k, **proposer_options)
        ids = self.encode(prompt, chat=chat)
        if engine is None:
            priced = k == "auto" and not proposer.guessing.plain
            engine = Engine(self.model, BatchCost.single(self.assets.cost_model() if priced else CostModel.flat()),
                            self.prefix_cache)
        key = f"{method}|{draft}|{sorted(proposer_options.items())}"
        request = Request(self.model.config.max_position_embeddings, proposer, ids, max_new_tokens=max_new_tokens,
                          params=params, k=k, pricing=Pricing(engine.view, self.acceptance(key)),
                          stop_token_ids=self.stop_token_ids, seed=seed, logprobs=logprobs,
                          constraint=None if structured is None else self.grammar().constraint(structured))
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
            self.assets.save_cost_model()
        return GenerationOutput(text=text.text, token_ids=text.token_ids, finish_reason=text.finish or "length",
                                method=method, prompt_tokens=gen.stats.prompt_tokens, stats=gen.stats,
                                logprobs=kept_logprobs(gen.request, text))


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


def load(name_or_path: str | os.PathLike = "smollm2-135m-instruct", *, dtype: str = "float32",
         quantization: str | None = "auto", prefix_cache_mb: int = 0, kv_cache_dtype: str = "float16") -> LLM:
    """Load a model by registry name, HF checkpoint dir or .gguf file (see `LLM.load` for its options)."""
    return LLM.load(name_or_path, dtype=dtype, quantization=quantization, prefix_cache_mb=prefix_cache_mb,
                    kv_cache_dtype=kv_cache_dtype)


def kept_logprobs(request: Request, text: RequestText) -> list[TokenLogprob] | None:
    """The request's token log-probabilities for the tokens its output kept (None unless asked for)."""
    return None if request.logprobs is None else request.token_logprobs[: len(text.token_ids)]
