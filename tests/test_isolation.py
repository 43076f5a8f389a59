"""The suite needs nothing beside the checkout: conftest's guard refuses reads there, and CI runs a copy of the
checkout with nothing beside it (.ci/run)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import CHECKOUT, ReadOutsideCheckout, outside_reads, refused


def test_a_read_beside_the_checkout_fails_the_test(tmp_path) -> None:
    beside = CHECKOUT.parent / "shared" / "data" / "train"
    before = len(outside_reads)
    with pytest.raises(ReadOutsideCheckout, match="outside the checkout"):
        open(beside / "sharegpt.jsonl")  # noqa: SIM115 (refused before anything is opened)
    with pytest.raises(ReadOutsideCheckout):
        os.listdir(CHECKOUT.parent)
    assert outside_reads[before:] == [str(beside / "sharegpt.jsonl"), str(CHECKOUT.parent)]
    del outside_reads[before:]  # recorded reads fail the test at teardown: these two were meant


def test_the_checkout_temp_dir_and_python_are_readable(tmp_path) -> None:
    import torch

    assert not refused(str(CHECKOUT / "README.md")) and not refused(str(tmp_path / "x"))
    assert not refused(torch.__file__) and not refused(os.__file__)
    assert refused(str(CHECKOUT.parent / "shared" / "data")) and refused(str(CHECKOUT.parent / "other-clone"))
    assert (tmp_path / "x").write_text("ok") and (tmp_path / "x").read_text() == "ok"


def test_tools_dot_folders_in_home_stay_readable(monkeypatch) -> None:
    """A checkout cloned into HOME makes HOME the folder beside it: the tools' own config and caches there
    (matplotlib's ~/.config, pip's ~/.cache) are still theirs to read; HOME's other files are not."""
    import tests.conftest as guard

    monkeypatch.setattr(guard, "FORBIDDEN", [guard.HOME])
    monkeypatch.setattr(guard, "ALLOWED", [])
    assert not refused(os.path.join(guard.HOME, ".config", "matplotlib", "matplotlibrc"))
    assert refused(os.path.join(guard.HOME, "shared", "data", "train"))
