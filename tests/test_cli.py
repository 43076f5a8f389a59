"""The command line as a newcomer meets it: --version, --help with defaults, argparse-level checks, --threads,
Ctrl-C without a traceback, and --compare output whose numbers agree with each other within 80 columns."""

from __future__ import annotations

import io
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

import specdecode
from specdecode.api import METHODS, TextStream
from specdecode.cli import commands as cli
from specdecode.cli.commands import main as cli_main

from .helpers import make_tokenizer, own_cache_dir, write_checkpoint

PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown"


_own_cache_dir = own_cache_dir()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), make_tokenizer())


@pytest.fixture
def console(monkeypatch) -> io.StringIO:
    """What `specdecode` writes to stderr, on an 80-column terminal."""
    out = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=out, width=80, color_system=None))
    return out


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"specdecode {specdecode.__version__}"


def test_help_shows_defaults_and_every_method(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line per option, for the matching below
    for command, expected in [
        ("generate", ["--method {none,prompt-lookup,", "(default: prompt-lookup)", "(default: 256)",
                      "(default: auto)", "(default: torch's choice)"]),
        ("serve", ["(default: 8000)", "(default: 127.0.0.1)", "(default: 16)", "(default: prompt-lookup)"]),
        ("bench", ["(default: none,prompt-lookup)", *METHODS, "name[:draft][@K]"]),
        ("tune", ["(default: 6)", "up to 48"]),
    ]:
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        text = capsys.readouterr().out
        assert all(e in text for e in expected), (command, [e for e in expected if e not in text])
        assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("args,message", [
    (["serve", "--port", "99999"], "argument --port: a TCP port must be from 1 to 65535, got 99999"),
    (["serve", "--port", "http"], "argument --port: 'http' is not an integer"),
    (["serve", "--max-batch", "0"], "argument --max-batch: a count must be >= 1, got 0"),
    (["generate", "hi", "--threads", "0"], "argument --threads: a count must be >= 1, got 0"),
    (["generate", "hi", "--repeats", "-1"], "argument --repeats: a count must be >= 1, got -1"),
])
def test_bad_numbers_are_refused_before_anything_loads(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def test_generate_threads(checkpoint, capsys, monkeypatch) -> None:
    import torch

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    assert cli_main(["generate", PROMPT, "--model", str(checkpoint), "--max-new-tokens", "4", "--json",
                     "--threads", "1"]) == 0
    assert threads == [1] and json.loads(capsys.readouterr().out)["stats"]["new_tokens"] >= 1


def test_ctrl_c_during_generate_exits_130_with_a_line(checkpoint, capsys, console, monkeypatch) -> None:
    def interrupted(self, prompt, **options) -> TextStream:
        def pieces() -> Iterator[str]:
            yield "Once upon"
            signal.raise_signal(signal.SIGINT)  # what Ctrl-C does: Python raises KeyboardInterrupt here
            yield " a time"

        return TextStream(pieces())

    monkeypatch.setattr(specdecode.LLM, "generate", interrupted)
    assert cli_main(["generate", PROMPT, "--model", str(checkpoint), "--k", "2"]) == cli.INTERRUPTED == 130
    assert capsys.readouterr().out == "Once upon\n"  # what was streamed stays, on a line of its own
    assert console.getvalue() == "interrupted: specdecode generate stopped (Ctrl-C)\n"


def test_ctrl_c_that_breaks_an_import_is_still_one_line_and_130(checkpoint, console, monkeypatch) -> None:
    """Ctrl-C inside an import can surface as that import's own error (numpy's lazy submodules, cut short, recurse
    until RecursionError; transformers re-raises it as a failed import): still the user's Ctrl-C."""
    def load_cut_short(self, prompt, **options) -> TextStream:
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("Failed to import transformers.models.llama.configuration_llama") from interrupt
        raise AssertionError("SIGINT raised nothing")

    monkeypatch.setattr(specdecode.LLM, "generate", load_cut_short)
    assert cli_main(["generate", PROMPT, "--model", str(checkpoint), "--k", "2"]) == 130
    assert console.getvalue() == "interrupted: specdecode generate stopped (Ctrl-C)\n"


def test_an_error_without_ctrl_c_is_not_called_an_interrupt(checkpoint, monkeypatch) -> None:
    def broken(self, prompt, **options) -> TextStream:
        raise RuntimeError("a bug")

    monkeypatch.setattr(specdecode.LLM, "generate", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli_main(["generate", PROMPT, "--model", str(checkpoint), "--k", "2"])


def table_rows(text: str) -> dict[str, list[str]]:
    """The stats table's rows by method: the lines after the header's rule, up to the legend."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if set(line) == {"─"}) + 1
    rows = {}
    for line in lines[start:]:
        if line.startswith("tokens/s:"):
            break
        method, rest = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        rows[method] = rest.split()
    return rows


def test_compare_numbers_agree_with_each_other_in_80_columns(checkpoint, capsys, console) -> None:
    """The draft is the target itself, so every guess is kept and tau, guess/fwd and kept can be checked too."""
    args = ["generate", PROMPT, "--model", str(checkpoint), "--dtype", "float64", "--max-new-tokens", "24",
            "--compare", "--repeats", "3", "--method", "draft", "--draft", str(checkpoint), "--k", "3"]
    assert cli_main(args) == 0
    text = console.getvalue()
    assert all(len(line) <= 80 for line in text.splitlines()) and "…" not in text  # nothing cut
    rows = table_rows(text)
    assert list(rows) == ["draft", "none (plain)"]
    (tokens, tps, speedup, tau, guessed, kept), plain = rows["draft"], rows["none (plain)"]
    assert plain[2:] == ["1.00x", "1.00", "0.0", "-"] and tokens == plain[0]
    # the speedup column is the tokens/s columns' ratio, up to how they are rounded (0.1 each, the speedup 0.01)
    ratio = float(tps) / float(plain[1])
    assert speedup.endswith("x") and abs(float(speedup[:-1]) - ratio) <= 0.005 + 0.05 * (1 + ratio) / float(plain[1])
    assert kept == "100%" and guessed == "3.0"
    assert abs(float(tau) - (1 + float(guessed) * float(kept[:-1]) / 100)) < 0.35  # the legend's identity
    headline = re.search(r"speedup over plain decoding: ([\d.]+)x \(median tokens/s: ([\d.]+) vs ([\d.]+)\)", text)
    assert headline and headline.group(1) + "x" == speedup and headline.groups()[1:] == (tps, plain[1])
    low, high = re.search(r"runs paired one by one: ([\d.]+)x to ([\d.]+)x", text).groups()
    assert float(low) <= float(headline.group(1)) <= float(high)  # the median's ratio lies within the runs'
    assert "greedy outputs identical: yes" in text and "median of 3 runs" in text

    capsys.readouterr()
    assert cli_main([*args, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    medians = record["tokens_per_second_median"]
    assert record["speedup"] == pytest.approx(medians["speculative"] / medians["plain"])
    assert len(record["speedups_by_run"]) == 3 and record["outputs_match"] is True
    assert min(record["speedups_by_run"]) <= record["speedup"] <= max(record["speedups_by_run"])
    spec = sorted(o["stats"]["tokens_per_second"] for o in record["speculative"])
    assert medians["speculative"] == spec[1]


@pytest.mark.parametrize("args,usage,hint", [
    (["generate", "hi", "--max-tokens", "5"], "usage: specdecode generate", "did you mean --max-new-tokens?"),
    (["generate", "hi", "--temprature", "0.7"], "usage: specdecode generate", "did you mean --temperature?"),
    (["tune", "cost", "--texs", "4"], "usage: specdecode tune", "did you mean --texts?"),
    (["generate", "hi", "--method", "promt-lookup"], "usage: specdecode generate", "did you mean 'prompt-lookup'?"),
    (["generte", "hi"], "usage: specdecode [-h]", "did you mean 'generate'?"),
])
def test_a_mistyped_option_gets_the_closest_one_and_the_subcommands_usage(args, usage, hint, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(usage) and hint in err and "Traceback" not in err


@pytest.mark.parametrize("args,stdin,message", [
    (["generate", ""], "", "the prompt is empty"),
    (["generate", "-"], " \n", "the prompt is empty"),
    (["generate", "hi", "--model", "smollm2-135m"], "", "did you mean 'smollm2-135m-instruct'?"),
    (["tune", "cost", "--model", "no/such/dir"], "", "model 'no/such/dir' not found"),
    (["bench", "--model", "gemma3", "--out", "x"], "", "did you mean 'gemma3-270m'?"),
    (["generate", "hi", "--method", "draft", "--draft", "nowhere.gguf"], "", "model 'nowhere.gguf' not found"),
])
def test_cheap_mistakes_are_refused_before_the_model_loads(args, stdin, message, capsys, console,
                                                             monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    monkeypatch.setattr(specdecode.LLM, "load", lambda *a, **k: pytest.fail("loaded the model before checking"))
    assert cli_main(args) == 2
    assert message in " ".join(console.getvalue().split()) and "Traceback" not in capsys.readouterr().err


def test_serve_refuses_a_port_it_cannot_take_before_loading(capsys, console, monkeypatch) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr("specdecode.server.cli.cmd_serve", lambda args: pytest.fail("started before checking"))
        assert cli_main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in console.getvalue()
    assert cli_main(["serve", "--host", "no-such-host.invalid"]) == 2
    assert "--host no-such-host.invalid: cannot resolve it" in console.getvalue()


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["tune", "--help"], ["bench", "--help"],
                                  ["serve", "--help"],
                                  ["train", "eagle", "--help"], ["generate", "hi", "--max-tokens", "3"],
                                  ["generate", "", "--model", "x"]])
def test_help_and_refusals_import_no_torch(args) -> None:
    """--help and the checks before loading answer in a fraction of a second: torch (seconds to import) waits
    for a command that runs."""
    import subprocess
    import sys

    code = ("import sys, time; t = time.perf_counter(); from specdecode.cli.commands import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('imported:', sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "imported: []", done.stderr


def test_ctrl_c_while_torch_imports_is_one_line_and_130(checkpoint, tmp_path) -> None:
    """The first seconds of a command import torch and load the model; Ctrl-C there, as anywhere, prints one line
    (no traceback) and exits with 130. Where Ctrl-C lands depends on the machine's speed (on a fast one the model is
    already loading, and its progress lines come before)."""
    import subprocess
    import sys
    import time

    code = ("import sys; from specdecode import cli; print('ready', file=sys.stderr, flush=True); "
            "sys.exit(cli.main(sys.argv[1:]))")
    env = {**__import__("os").environ, "SPECDECODE_CACHE": str(tmp_path / "cache")}
    child = subprocess.Popen([sys.executable, "-c", code, "generate", PROMPT, "--model", str(checkpoint)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert child.stderr is not None and child.stderr.readline() == "ready\n"
    time.sleep(0.2)  # inside main: parsing done, torch importing (seconds)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted: specdecode generate stopped (Ctrl-C)"


def test_a_first_serve_says_what_it_prepares_and_for_how_long(tmp_path, console, monkeypatch) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr("specdecode.server.cli.cmd_serve", lambda args: 0)
    assert cli_main(["serve", "--port", str(port), "--max-batch", "4"]) == 0
    said = " ".join(console.getvalue().split())
    assert "first start on this machine" in said and "about 2-4 minutes" in said and "later starts take seconds" in said
    (tmp_path / "costs").mkdir()
    (tmp_path / "costs" / "0123-batch4.json").write_text("{}")
    console.seek(0)
    console.truncate()
    assert cli_main(["serve", "--port", str(port), "--max-batch", "4"]) == 0 and console.getvalue() == ""
