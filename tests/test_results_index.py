"""benchmarks/results/README.md is the index of the dated reports: every run in the folder is named there, and
every link it holds leads to a file or folder that exists."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def unlisted(folder: Path) -> list[str]:
    index = (folder / "README.md").read_text()
    return sorted(p.name for p in folder.iterdir() if p.name != "README.md" and p.name not in index)


def broken_links(folder: Path) -> list[str]:
    index = (folder / "README.md").read_text()
    targets = [t for t in LINK.findall(index) if "://" not in t]
    return sorted({t for t in targets if not (folder / t).exists()})


def test_every_run_is_in_the_index() -> None:
    assert unlisted(RESULTS) == [], "add each to benchmarks/results/README.md (its topic's row or list)"


def test_every_link_of_the_index_leads_somewhere() -> None:
    assert broken_links(RESULTS) == []


def test_the_checks_find_an_unlisted_run_and_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("| topic | [a.md](a.md) | 1 |\n[gone](gone/report.md) [web](https://x.org/y)\n")
    (tmp_path / "a.md").write_text("")
    (tmp_path / "b-run").mkdir()
    assert unlisted(tmp_path) == ["b-run"]
    assert broken_links(tmp_path) == ["gone/report.md"]
