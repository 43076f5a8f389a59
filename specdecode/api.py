"""The user-facing API: load a model, generate text with any speculative method."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .detokenize import IncrementalText
from .engine import Generation, GenerationStats
from .models import Transformer, load_transformer, resolve
from .models.loading import DTYPES
from .proposers import DraftModelProposer, NoProposer, PromptLookupProposer, Proposer
from .sampling import SamplingParams

METHODS = ("none", "prompt-lookup", "draft")
# End-of-turn markers of common chat templates; generation stops at whichever the vocabulary has.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


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

    @classmethod
    def load(cls, name_or_path: str | os.PathLike = "smollm2-135m-instruct", *, dtype: str = "float32") -> LLM:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        from transformers import AutoTokenizer

        path = resolve(name_or_path)
        model = load_transformer(path, dtype=DTYPES[dtype])
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(model, tokenizer, name=str(name_or_path))

    # ---------------------------------------------------------------------------------- prompts
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, str) and not chat:
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt[0], dict):
            if not self.tokenizer.chat_template:
                raise ValueError(f"{self.name}'s tokenizer has no chat template: pass a plain string without chat")
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_dict=False)
            return list(ids)
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
        max_ngram: int = 3,
        min_ngram: int = 1,
        branches: int = 1,
    ) -> Proposer:
        if method == "none":
            return NoProposer()
        if method == "prompt-lookup":
            return PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram, branches=branches)
        if method == "draft":
            if draft is None:
                raise ValueError("method 'draft' needs a draft model: pass draft=<registry name, HF dir or .gguf>")
            return DraftModelProposer(self.draft_model(draft).model, self.model.config.vocab_size)
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")

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

    # -------------------------------------------------------------------------------- generation
    def generate(
        self,
        prompt: Prompt,
        *,
        method: str = "none",
        draft: str | os.PathLike | LLM | None = None,
        k: int = 4,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        chat: bool = False,
        stream: bool = False,
        **proposer_options: Any,
    ) -> GenerationOutput | TextStream:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        proposer = self.proposer(method, draft, **proposer_options)
        ids = self.encode(prompt, chat=chat)
        gen = Generation(
            self.model, proposer, ids, max_new_tokens=max_new_tokens, params=params, k=k,
            stop_token_ids=self.stop_token_ids, seed=seed,
        )
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        result = TextStream(self._pieces(gen, stops, method))
        if stream:
            return result
        for _ in result:
            pass
        return result.output

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


def load(name_or_path: str | os.PathLike = "smollm2-135m-instruct", *, dtype: str = "float32") -> LLM:
    """Load a model by registry name, HF checkpoint dir or .gguf file."""
    return LLM.load(name_or_path, dtype=dtype)

