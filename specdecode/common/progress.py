"""Progress with a time estimate on stderr, for one-off work that can take more than a couple of seconds (timing
forwards on a new machine): a bar on a terminal, usable inside another live display (then it stays quiet); plain
lines where stderr is not a terminal (a pipe, a log file, CI), where a bar would print nothing until the end."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.errors import LiveError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

Advance = Callable[[], None]
FIRST_LINE_S = 3.0  # work done sooner says nothing: a line for it would only be noise in a log
EVERY_S = 10.0  # then a line this often, elapsed and estimated time left


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Advance]:
    """Yields a function to call after each of `total` units of work."""
    console = Console(stderr=True)
    if not console.is_terminal:
        with progress_lines(description, total, sys.stderr) as advance:
            yield advance
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True)
    task = bar.add_task(description, total=total)
    try:
        bar.start()
    except LiveError:  # another live display (a spinner, the benchmark's bar) owns the terminal
        yield lambda: None
        return
    try:
        yield lambda: bar.advance(task)
    finally:
        bar.stop()


@contextmanager
def progress_lines(description: str, total: int, out: TextIO,
                   clock: Callable[[], float] = time.monotonic) -> Iterator[Advance]:
    """Plain-text progress: a line once the work has run FIRST_LINE_S, then every EVERY_S (done/total, elapsed,
    estimated time left at the pace so far), and a last line with the time it took if any line was written."""
    start = clock()
    done, due, lines = 0, start + FIRST_LINE_S, 0

    def line(text: str) -> None:
        nonlocal lines
        print(f"{description}: {text}", file=out, flush=True)
        lines += 1

    def advance() -> None:
        nonlocal done, due
        done += 1
        now = clock()
        if now >= due and done < total:
            elapsed = now - start
            line(f"{done}/{total}, {elapsed:.0f} s elapsed, about {elapsed / done * (total - done):.0f} s left")
            due = now + EVERY_S

    yield advance
    if lines:
        line(f"done in {clock() - start:.0f} s")
