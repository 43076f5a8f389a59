"""Copies of the model's tokenizer for the routes' worker threads.

A fast tokenizer must not run in two threads at once, and one lock for every route let a 2 MB prompt's encoding
(seconds) hold up every small request behind it. Each route takes a copy of its own for as long as it encodes; a
request waits only when every copy is busy.
"""

from __future__ import annotations

import contextlib
import copy
import queue
from collections.abc import Iterator

COPIES = 4  # more than the worker threads that encode at once, in practice (each copy: a few MB)


class TokenizerPool:
    def __init__(self, tokenizer, copies: int = COPIES) -> None:
        if copies < 1:
            raise ValueError(f"a tokenizer pool needs at least one copy, got {copies}")
        self.copies = copies
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(copies):
            self._free.put(copy.deepcopy(tokenizer))

    @contextlib.contextmanager
    def take(self) -> Iterator:
        """A copy no other thread uses until the block ends."""
        tokenizer = self._free.get()
        try:
            yield tokenizer
        finally:
            self._free.put(tokenizer)


def max_token_bytes(tokenizer) -> int:
    """An upper bound of the text one token stands for, in UTF-8 bytes: its vocabulary string's length in bytes
    (a byte-level BPE writes a byte as one character of at least one byte; SentencePiece writes the text itself,
    a space as '▁' of three bytes, a byte fallback as '<0xAB>'). A text longer than a context of such tokens cannot
    fit the context: it is refused before it is tokenized."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(piece.encode("utf-8", "replace")) for piece in pieces if piece)
