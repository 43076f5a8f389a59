"""A report's machine line says whether other work shared the machine, from the load average against the run's
own threads."""

import os

import pytest

from specdecode.bench.hardware import sharing_note


@pytest.mark.parametrize(("load", "threads", "shared"), [(1.9, 2, False), (2.7, 2, False), (2.8, 2, True),
                                                         (17.4, 2, True), (0.4, 1, False), (1.9, 1, True)])
def test_a_load_beyond_the_runs_threads_says_shared(monkeypatch, load, threads, shared):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    note = sharing_note(threads)
    assert note.startswith("SHARED") is shared
    assert f"{load:.1f}" in note
