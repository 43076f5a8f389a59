"""Structured output: a JSON schema, any JSON object, a regular expression or a choice of strings constrains the
target's tokens, through llguidance (the grammar engine of llama.cpp and vLLM): its token masks cost far less than a
decode step and it needs no GPU toolchain (xgrammar, beside it in benchmarks/grammar_masks.py, needs triton; their
costs: benchmarks/results/grammar-masks.md).

Lossless with speculation: verification walks down the draft tree and masks the target's logits at each node it
reaches with the grammar's state there (the committed tokens, then the accepted path), so the committed tokens
are exactly those of structured plain decoding; a guess the grammar forbids has p = 0 and is never accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

KINDS = ("json", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: exactly one of a JSON schema (a dict, or {} / True for any JSON object), a
    regular expression, or a list of strings to choose from."""

    json: dict | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    @classmethod
    def of(cls, spec: StructuredOutput | dict[str, Any]) -> StructuredOutput:
        if isinstance(spec, StructuredOutput):
            return spec
        unknown = set(spec) - set(KINDS)
        if unknown or len(spec) != 1:
            raise ValueError(f"structured output takes exactly one of {', '.join(KINDS)}; got {sorted(spec)}")
        choice = spec.get("choice")
        return cls(json=spec.get("json"), regex=spec.get("regex"), choice=None if choice is None else tuple(choice))

    def grammar(self) -> str:
        """llguidance's grammar for it."""
        import llguidance

        if self.json is not None:
            schema = self.json if isinstance(self.json, dict) and self.json else {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
            raise ValueError("choice needs a list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))


class GrammarTokenizer:
    """The model's tokenizer as llguidance reads it (built once per model: about half a second)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(stop_token_ids) or None)

    def constraint(self, spec: StructuredOutput | dict[str, Any]) -> Constraint:
        """A request's constraint; a ValueError that says what is wrong for a grammar llguidance refuses."""
        import llguidance

        grammar = StructuredOutput.of(spec).grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"structured output: {error}")
        return Constraint(llguidance.LLMatcher(self.tokenizer, grammar), self.vocab_size)


class Constraint:
    """One request's grammar state: which tokens may come next, advanced as tokens are accepted."""

    def __init__(self, matcher, vocab_size: int) -> None:
        import llguidance.torch

        self.matcher = matcher
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """One position's logits [V] with the tokens the grammar forbids now at -inf (a float32 copy). Bit t % 32 of
        the mask's word t // 32 allows token t; tokens past the mask are forbidden. The bits are unpacked here rather
        than by llguidance's apply_token_bitmask_inplace, a torch.compile kernel whose C++ build can fail on a CPU
        (and compiles for seconds at a first request)."""
        import llguidance.torch

        out = logits.float().clone()  # once the text is complete, only the stop tokens are left
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        words = self.bitmask[0].numpy().astype("<i4", copy=False)  # little-endian words: bytes in token order
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")
        size = out.shape[-1]
        forbidden = np.ones(size, dtype=bool)
        forbidden[: min(size, allowed.size)] = allowed[:size] == 0
        out[..., torch.from_numpy(forbidden).to(out.device)] = float("-inf")
        return out

    def advance(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)
