"""A suffix index over token ids: where did the end of the current text occur before, and what followed it?

Suffix decoding (Oliaro et al., SuffixDecoding; ArcticInference, vLLM) asks a suffix tree two questions each step:
the longest suffix of the context that occurred earlier (up to `max_match` tokens), and, over its occurrences,
how often each continuation followed (a node's count over its parent's is the chance of that token). This
index answers both from the token ids themselves: each position is filed under the 1 and the 3 tokens ending
there, in sorted arrays searched by bisection (plus a small dict of positions not sorted in yet). The most
recent `max_occurrences` positions filed under the context's last 3 tokens (or last 1 when those 3 never
occurred) are matched backwards in one vectorised comparison, and the ones that match longest are the
occurrences; their continuations come out as rows of a matrix. A filter of the trigram keys (`may_have`) says in
pure Python whether the context's last 3 tokens could be there at all, before any array is searched.

Why not a pointer-based suffix tree: in Python its nodes cost a few hundred bytes a token and an insertion walks
up to `max_match` nodes a token; here a token costs about 40 bytes (its id, a key and a position at each of the two
levels, and a few bits of the trigram level's filter) and an insertion is two list appends. Occurrences beyond the most
recent `max_occurrences` of a key are not seen (recent text weighs more, which is what a cache of earlier outputs
wants anyway).

Memory is bounded by `max_tokens`: the oldest sequences are evicted first (FIFO) once the live tokens exceed it.
Every public method holds the index's lock, so the server's threads and a library user's may share one index.

`TextIndex` answers the same question for one request's own text (a few thousand tokens, one thread) from plain
dicts and lists: numpy's small operations cost more there than the Python loops they replace (as prompt lookup's dict
of n-grams had shown; what it saved: benchmarks/results/comment-timings.md).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SEPARATOR = -1  # between sequences: never matched, never continued past
_SHIFT = 21  # bits per token in a trigram key: vocabularies up to 2M ids
_SEAL_AT = 4096  # positions kept unsorted before they are sorted into the arrays
_NONE = np.empty(0, dtype=np.int64)  # no positions (read only)
_NONE.flags.writeable = False
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: a key's filter bit is the top bits of key * _MIX mod 2^64
_WORD = (1 << 64) - 1
_FILTER_BITS_PER_KEY = 8  # at most ~12% of absent keys pass the filter


@dataclass
class Match:
    """The longest earlier occurrences of the context's end and what followed each."""

    length: int  # tokens of context matched (the same for every occurrence)
    continuations: np.ndarray  # [occurrences, depth] int: the tokens after each, SEPARATOR-padded past an end

    def distinct(self, columns: int) -> tuple[list[list[int]], list[int]]:
        """The distinct continuations cut to `columns` tokens, ascending, and how often each occurred."""
        return count_rows(self.continuations[:, :columns].tolist())


@dataclass
class TextMatch:
    """A TextIndex's match: the positions of the occurrences in its text, read lazily."""

    length: int
    text: list[int]
    positions: list[int]  # where each occurrence ends (its continuation starts after it)
    depth: int

    def distinct(self, columns: int) -> tuple[list[list[int]], list[int]]:
        """As Match.distinct; a continuation that reaches the text's end is shorter (not padded)."""
        width, text = min(columns, self.depth), self.text
        return count_rows([text[p + 1 : p + 1 + width] for p in self.positions])


def count_rows(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct rows in ascending order (as np.unique(axis=0) sorts them) and how often each occurs; a dict
    over a few dozen short rows costs a tenth of np.unique's structured sort."""
    counts: dict[tuple[int, ...], int] = {}
    for row in rows:
        key = tuple(row)
        counts[key] = counts.get(key, 0) + 1
    keys = sorted(counts)
    return [list(k) for k in keys], [counts[k] for k in keys]


class _Level:
    """Positions filed under a key (the n tokens ending at the position): sorted arrays + recent positions."""

    def __init__(self) -> None:
        self.keys = np.empty(0, dtype=np.int64)  # sorted by (key, position)
        self.positions = np.empty(0, dtype=np.int64)
        self.fresh: dict[int, list[int]] = {}  # key -> positions not sorted in yet, ascending
        self.fresh_count = 0

    def add(self, keys: list[int], start: int) -> None:
        """File position start + i under keys[i], skipping negative keys (no key there)."""
        fresh, filed = self.fresh, 0
        for position, key in enumerate(keys, start):
            if key >= 0:
                positions = fresh.get(key)
                if positions is None:
                    fresh[key] = [position]
                else:
                    positions.append(position)
                filed += 1
        self.fresh_count += filed

    def find(self, key: int, live_from: int, most: int) -> np.ndarray:
        """The last `most` live positions filed under `key`, ascending."""
        recent = self.fresh.get(key)
        if len(self.keys):
            lo, hi = np.searchsorted(self.keys, [key, key + 1])
            older = self.positions[max(lo, hi - most) : hi]
            found = np.concatenate((older, recent[-most:]))[-most:] if recent else older[-most:]
        elif recent:  # nothing sorted in yet (a request's own text): no array search at all
            found = np.array(recent[-most:], dtype=np.int64)
        else:
            return _NONE
        return found[found >= live_from] if live_from else found

    def seal(self, live_from: int) -> None:
        """Sort the recent positions in and drop evicted ones (amortised: run when enough piled up)."""
        if not self.fresh_count:
            return
        fresh = self.fresh
        sizes = np.fromiter(map(len, fresh.values()), np.int64, len(fresh))
        keys = np.repeat(np.fromiter(fresh, np.int64, len(fresh)), sizes)
        positions = np.fromiter(itertools.chain.from_iterable(fresh.values()), np.int64, self.fresh_count)
        order = np.argsort(keys, kind="stable")  # each key's positions stay ascending
        keys, positions = keys[order], positions[order]
        old_keys, old_positions = self.keys, self.positions
        if len(old_positions) and old_positions.min() < live_from:
            keep = old_positions >= live_from
            old_keys, old_positions = old_keys[keep], old_positions[keep]
        # merged, not sorted again: a fresh position is newer than every sorted one, so it goes after its key's
        at = np.searchsorted(old_keys, keys, side="right")
        self.keys, self.positions = np.insert(old_keys, at, keys), np.insert(old_positions, at, positions)
        self.fresh, self.fresh_count = {}, 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.positions.nbytes + 48 * self.fresh_count  # a list slot and an int each


class _FilteredLevel(_Level):
    """A level with a one-hash Bloom filter of its keys in a bytearray, which answers "was this key ever filed?" in
    pure Python (right after a forward a numpy search costs many times what the filter does). Only the trigram
    level has one: it alone is asked."""

    def __init__(self) -> None:
        super().__init__()
        self._build_filter()

    def add(self, keys: list[int], start: int) -> None:
        super().add(keys, start)
        shift, marks = self.filter
        for key in keys:
            if key >= 0:
                bit = (key * _MIX & _WORD) >> shift
                marks[bit >> 3] |= 1 << (bit & 7)

    def may_have(self, key: int) -> bool:
        """False: the key was never filed (or only in positions dropped at the last seal); True: it probably was."""
        shift, marks = self.filter  # one object: a seal on another thread swaps both at once
        bit = (key * _MIX & _WORD) >> shift
        return bool(marks[bit >> 3] >> (bit & 7) & 1)

    def seal(self, live_from: int) -> None:
        if self.fresh_count:  # else nothing changed
            super().seal(live_from)
            self._build_filter()

    def _build_filter(self) -> None:
        """The filter of the sorted keys, sized for them and those that join before the next seal (see
        SuffixIndex._append): (shift, marks), where a key's bit is the top 64 - shift bits of key * _MIX."""
        keys = self.keys
        room = _FILTER_BITS_PER_KEY * (len(keys) + max(_SEAL_AT, len(keys) // 4))
        shift = 64 - max(16, room.bit_length())
        bits = (keys.astype(np.uint64) * np.uint64(_MIX)) >> np.uint64(shift)  # wraps mod 2^64, as & _WORD does
        marked = np.zeros(1 << (64 - shift), dtype=bool)
        marked[bits] = True
        self.filter = (shift, bytearray(np.packbits(marked, bitorder="little")))

    @property
    def nbytes(self) -> int:
        return super().nbytes + len(self.filter[1])


class SuffixIndex:
    """Token sequences, searchable by their suffixes; see the module docstring.

    max_tokens: live tokens kept (None: unbounded); the oldest whole sequences go first, and a sequence longer
    than the budget keeps its last `max_tokens`. max_match: context tokens compared. max_occurrences: the most
    recent positions of a key that are compared.
    """

    def __init__(self, max_tokens: int | None = None, max_match: int = 32, max_occurrences: int = 64) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None (unbounded), got {max_tokens}")
        if max_match < 1 or max_occurrences < 1:
            raise ValueError(f"max_match and max_occurrences must be >= 1, got {max_match}, {max_occurrences}")
        self.max_tokens, self.max_match, self.max_occurrences = max_tokens, max_match, max_occurrences
        self._lock = threading.RLock()
        # absolute position p at index p - _base; index 0, evicted positions and the rest past the end hold
        # SEPARATOR, so any position reads as its token or SEPARATOR with one clipped gather
        self._buffer = np.full(1024, SEPARATOR, dtype=np.int32)
        self._base = -1
        self._end = 0  # absolute position after the last token
        self._live_from = 0  # positions before this are evicted
        self._sequences: deque[tuple[int, int]] = deque()  # (start, end) of each sequence, oldest first
        self._trigrams = _FilteredLevel()  # the level `may_have` asks
        self._levels = {1: _Level(), 3: self._trigrams}
        self.evicted_sequences = 0
        self._seal_at = min(_SEAL_AT, max_tokens or _SEAL_AT)  # unsorted positions stay within the budget

    # -------------------------------------------------------------------------------------- writing
    def extend(self, tokens: Sequence[int]) -> None:
        """Append to the last sequence (a first one is started if there is none)."""
        with self._lock:
            if not self._sequences:
                self._sequences.append((self._end, self._end))
            self._append(tokens)

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """A new sequence, never matched across its boundaries; then evict down to `max_tokens`."""
        if self.max_tokens is not None and len(tokens) > self.max_tokens:
            tokens = tokens[-self.max_tokens :]
        with self._lock:
            separator = [SEPARATOR] if self._end > self._live_from else []
            start = self._end + len(separator)
            self._sequences.append((start, start))
            self._append([*separator, *tokens])
            self._evict()

    def _append(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        if not n:
            return
        self._reserve(n)
        at = self._end - self._base
        self._buffer[at : at + n] = tokens
        # the two tokens before and the new ones, as Python ints (evicted positions, and those before the buffer,
        # read SEPARATOR): filing them is then two list appends a token, no numpy scalar read
        window = self._buffer[max(at - 2, 0) : at + n].tolist()
        window[:0] = [SEPARATOR] * (n + 2 - len(window))
        self._levels[1].add(window[2:], self._end)
        self._levels[3].add([_trigram(a, b, c) if a >= 0 and b >= 0 and c >= 0 else SEPARATOR
                             for a, b, c in zip(window, window[1:], window[2:], strict=False)], self._end)
        self._end += n
        start, _ = self._sequences[-1]
        self._sequences[-1] = (start, self._end)
        for level in self._levels.values():
            if level.fresh_count >= max(self._seal_at, len(level.keys) // 4):
                level.seal(self._live_from)

    def _reserve(self, n: int) -> None:
        used = self._end - self._base
        if used + n < len(self._buffer):  # at least one SEPARATOR stays after the end
            return
        dead = self._live_from - self._base  # compact away evicted tokens, then grow if still short
        live = self._buffer[dead:used]
        buffer = np.full(max(1024, 2 * (len(live) + n) + 1), SEPARATOR, dtype=np.int32)
        buffer[1 : 1 + len(live)] = live
        self._buffer, self._base = buffer, self._live_from - 1

    def _evict(self) -> None:
        if self.max_tokens is None:
            return
        while self._sequences and self.live_tokens > self.max_tokens:
            self._sequences.popleft()
            live_from = self._sequences[0][0] if self._sequences else self._end
            self._buffer[self._live_from - self._base : live_from - self._base] = SEPARATOR
            self._live_from = live_from
            self.evicted_sequences += 1
        for level in self._levels.values():
            if len(level.keys) and level.positions[0] < self._live_from and self.live_tokens * 2 < len(level.keys):
                level.seal(self._live_from)  # half of the sorted entries are dead: drop them now

    # -------------------------------------------------------------------------------------- reading
    def match(self, context: Sequence[int], depth: int) -> Match | None:
        """The occurrences of the longest suffix of `context` (up to max_match tokens) that has something after it,
        with up to `depth` following tokens each; None when not even the last token occurred before."""
        if depth < 1 or not len(context):
            return None
        with self._lock:
            tail = [int(t) for t in context[-3:]]
            candidates = _NONE
            for n in (3, 1):
                if len(tail) >= n:
                    key = _trigram(*tail) if n == 3 else tail[-1]
                    candidates = self._levels[n].find(key, self._live_from, self.max_occurrences)
                    if len(candidates):
                        candidates = candidates[self._token_at(candidates + 1) >= 0]  # something follows it
                    if len(candidates):
                        break
            if not len(candidates):
                return None
            ctx = np.asarray(context[-self.max_match :], dtype=np.int64)
            longest, chosen = self._longest(candidates, ctx[::-1])
            ahead = chosen[:, None] + 1 + np.arange(depth)[None, :]
            following = self._token_at(ahead)
            following[np.cumprod(following >= 0, axis=1) == 0] = SEPARATOR  # nothing past a sequence's end
            return Match(longest, following)

    def may_have(self, last3: Sequence[int]) -> bool:
        """False when these 3 tokens never occurred together, so `match` could not match 3 tokens of a context
        ending with them; True when they probably did (a filter, far cheaper than a `match`). Lock-free: a stale
        answer only costs or spares one search."""
        return len(last3) == 3 and self._trigrams.may_have(_trigram(*last3))

    def _longest(self, candidates: np.ndarray, backwards: np.ndarray) -> tuple[int, np.ndarray]:
        """How many tokens before each candidate (itself included) match `backwards` (the context, last first):
        the longest count and the candidates with it. The first few tokens weed out most candidates; the rest of
        the context is compared with the survivors in one go."""
        matched, width = 0, 4
        while matched < len(backwards):
            width = min(width, len(backwards) - matched)
            offsets = matched + np.arange(width)
            equal = self._token_at(candidates[:, None] - offsets[None, :]) == backwards[None, matched : matched + width]
            whole = equal.all(axis=1)
            if not whole.any():
                run = equal.argmin(axis=1)  # the first mismatch
                best = int(run.max())
                return matched + best, candidates[run == best]
            candidates, matched, width = candidates[whole], matched + width, len(backwards)
        return matched, candidates

    def _token_at(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at absolute positions; SEPARATOR outside the live range."""
        return self._buffer.take(positions - self._base, mode="clip")

    # ----------------------------------------------------------------------------------------- size
    @property
    def live_tokens(self) -> int:
        return self._end - self._live_from

    @property
    def sequences(self) -> int:
        return len(self._sequences)

    @property
    def nbytes(self) -> int:
        """Bytes held by the token buffer and the position arrays (the Python objects around them aside)."""
        with self._lock:
            return self._buffer.nbytes + sum(level.nbytes for level in self._levels.values())

    def tokens(self) -> list[list[int]]:
        """The live sequences (tests, debugging)."""
        with self._lock:
            out = []
            for start, end in self._sequences:
                start = max(start, self._live_from)
                out.append(self._buffer[start - self._base : end - self._base].tolist())
            return out


class TextIndex:
    """One request's text (prompt, then output as it commits), searchable as SuffixIndex is, with the same answers:
    the most recent `max_occurrences` positions filed under the text's last 3 tokens (else its last one) that have
    something after them, matched backwards up to `max_match` tokens, the longest kept. Not thread-safe: a request
    is stepped by one thread at a time."""

    def __init__(self, max_match: int = 32, max_occurrences: int = 64) -> None:
        if max_match < 1 or max_occurrences < 1:
            raise ValueError(f"max_match and max_occurrences must be >= 1, got {max_match}, {max_occurrences}")
        self.max_match, self.max_occurrences = max_match, max_occurrences
        self.text: list[int] = []
        self._unigrams: dict[int, list[int]] = {}  # token -> its positions, ascending
        self._trigrams: dict[tuple[int, int, int], list[int]] = {}  # 3 tokens -> positions of the last, ascending

    def extend(self, tokens: Sequence[int]) -> None:
        text, unigrams, trigrams = self.text, self._unigrams, self._trigrams
        start = len(text)
        text.extend(int(t) for t in tokens)
        for p in range(start, len(text)):
            unigrams.setdefault(text[p], []).append(p)
            if p >= 2:
                trigrams.setdefault((text[p - 2], text[p - 1], text[p]), []).append(p)

    def match(self, context: Sequence[int], depth: int) -> TextMatch | None:
        """As SuffixIndex.match, where the context is this index's whole text (extended up to it by the caller)."""
        text = self.text
        end = len(text) - 1
        if len(context) != len(text):
            raise ValueError(f"a TextIndex matches its own text ({len(text)} tokens), not {len(context)} tokens")
        if depth < 1 or end < 1:
            return None
        found: list[int] = []
        for positions in (self._trigrams.get((text[-3], text[-2], text[-1])) if end >= 2 else None,
                          self._unigrams.get(text[-1])):
            if positions:
                found = positions[-self.max_occurrences :]
                if found[-1] == end:  # the text's own end: nothing after it
                    found = found[:-1]
            if found:
                break
        if not found:
            return None
        most = min(self.max_match, end + 1)
        longest, chosen = 0, []
        for p in found:
            n = 0
            while n < most and n <= p and text[p - n] == text[end - n]:
                n += 1
            if n > longest:
                longest, chosen = n, [p]
            elif n == longest:
                chosen.append(p)
        return TextMatch(longest, text, chosen, depth)


def _trigram(a: int, b: int, c: int) -> int:
    return (a << (2 * _SHIFT)) | (b << _SHIFT) | c
