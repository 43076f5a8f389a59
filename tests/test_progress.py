"""Progress where stderr is not a terminal (a pipe, a log, CI): plain lines with elapsed and estimated time."""

from __future__ import annotations

import io

from specdecode.common import progress


def test_plain_lines_say_elapsed_and_time_left_once_work_takes_a_while() -> None:
    now = [0.0]
    out = io.StringIO()
    with progress.progress_lines("timing forwards", 10, out, clock=lambda: now[0]) as advance:
        for _ in range(10):
            now[0] += 1.5  # 15 s in all: a line after 3 s, then every 10 s, then the total
            advance()
    assert out.getvalue().splitlines() == ["timing forwards: 2/10, 3 s elapsed, about 12 s left",
                                           "timing forwards: 9/10, 14 s elapsed, about 2 s left",
                                           "timing forwards: done in 15 s"]


def test_quick_work_writes_nothing() -> None:
    out = io.StringIO()
    with progress.progress_lines("timing forwards", 3, out) as advance:
        for _ in range(3):
            advance()
    assert out.getvalue() == ""


def test_a_bar_where_stderr_is_a_terminal_lines_elsewhere(capsys, monkeypatch) -> None:
    monkeypatch.setattr(progress, "FIRST_LINE_S", 0.0)
    with progress.progress_bar("calibrating", 2) as advance:  # pytest's captured stderr is no terminal
        advance()
        advance()
    assert "calibrating: done in 0 s" in capsys.readouterr().err
