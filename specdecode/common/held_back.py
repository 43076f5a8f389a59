"""Held back: what a shared cache is given while a `holding` block runs joins it only when the block ends.

A benchmark runs one prompt several times and by several methods at once; none of those runs may find another's
answer (the suffix cache) or prefill (the prefix cache) in a cache they share, so what they leave is held until the
prompt's last run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class HoldsBack:
    """For a thread-safe cache (`_lock`): an item `_hold` takes inside `holding()` waits, and `_join` gets them all
    when the block ends (keep=False: dropped)."""

    _lock: threading.Lock
    _held: list[Any] | None = None

    def _hold(self, item: Any) -> bool:
        """Under `_lock`: hold `item` while a block runs (True); else (False) the caller adds it now."""
        if self._held is None:
            return False
        self._held.append(item)
        return True

    def _join(self, items: list[Any]) -> None:
        """Add what was held (called outside `_lock`)."""
        raise NotImplementedError

    @contextmanager
    def holding(self, keep: bool = True) -> Iterator[None]:
        with self._lock:
            self._held = []
        try:
            yield
        finally:
            with self._lock:
                held, self._held = self._held or [], None
            if keep:
                self._join(held)
