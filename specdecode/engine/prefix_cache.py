"""Prefix caching: the keys and values of earlier requests' text, reused by a request that begins the same way.

A chat's next turn re-sends the whole conversation, an agent's next call its transcript, every request of an app
its system prompt: the target has already run those tokens. When a request leaves, its committed text and its
cache entries are kept here (bounded in bytes, least recently used first out); a later request whose tokens share
a prefix with a kept text copies those entries into its cache row and prefills only the rest.

Lossless: a token's keys and values depend only on the tokens before it, and the native kernels compute them bit
for bit the same whatever else is in the forward (a prefill chunk, a verified tree, a batch), so copied entries are
the ones a prefill would write. The cache keeps no hidden states: a request whose proposer reads them (EAGLE, Medusa)
prefills at least the prompt's last positions it reads (`Needs.hidden_context`), and drafts as after a full
prefill.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..common.held_back import HoldsBack
from ..common.names import PREFIX_CACHE_MB

DEFAULT_MB = PREFIX_CACHE_MB  # the server's default budget
MIN_TOKENS = 16  # shorter shared prefixes (a chat template's header) are not worth a copy


@dataclass
class Hit:
    kv: torch.Tensor  # [layers, k|v, kv_heads, n, head_dim]: the shared prefix's entries
    tokens: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (binary search over slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache(HoldsBack):
    """Earlier texts' cache entries, at most `max_bytes` of them. Thread-safe. Texts stored inside `holding()` are
    kept when the block ends."""

    def __init__(self, max_bytes: int = DEFAULT_MB << 20, min_tokens: int = MIN_TOKENS) -> None:
        if max_bytes < 0:
            raise ValueError(f"a prefix cache's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self._entries: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()
        self.bytes = 0
        self.lookups = self.hits = self.hit_tokens = 0  # counters for metrics

    @property
    def texts(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int]) -> Hit | None:
        """The kept entries of the longest prefix of `tokens` that an earlier text shares (at least min_tokens)."""
        key = tuple(tokens)
        with self._lock:
            self.lookups += 1
            best, n = None, 0
            for text in self._entries:
                if text[:1] == key[:1] and (m := common_prefix(text, key)) > n:
                    best, n = text, m
            if best is None or n < self.min_tokens:
                return None
            self._entries.move_to_end(best)
            self.hits += 1
            self.hit_tokens += n
            return Hit(self._entries[best][:, :, :, :n], n)

    def store(self, tokens: Sequence[int], kv: torch.Tensor) -> None:
        """Keep a text's entries (kv: [layers, k|v, kv_heads, len(tokens), head_dim], copied here)."""
        if len(tokens) < self.min_tokens or self.max_bytes == 0:
            return
        key, kv = tuple(tokens), kv[:, :, :, : len(tokens)].clone()
        with self._lock:
            if not self._hold((key, kv)):
                self._add(key, kv)

    def _add(self, key: tuple[int, ...], kv: torch.Tensor) -> None:
        size = self._entry_bytes(kv)
        if size > self.max_bytes:
            return
        for text in list(self._entries):
            if key[: len(text)] == text:  # an earlier turn of the same conversation: this text covers it
                self.bytes -= self._entry_bytes(self._entries.pop(text))
            elif text[: len(key)] == key:  # already covered by a longer text
                self._entries.move_to_end(text)
                return
        self._entries[key] = kv
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= self._entry_bytes(old)

    @staticmethod
    def _entry_bytes(kv: torch.Tensor) -> int:
        return kv.numel() * kv.element_size()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def _join(self, items: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        with self._lock:
            for key, kv in items:
                self._add(key, kv)
