"""Command line: `specdecode generate PROMPT --method ...`, `bench`, `tune` and `train`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console

from .. import __version__
from ..common.command_line import Parser, add_precision_args, int_in, positive, quantization
from ..common.method_options import add_method_flags, all_options, method_options
from ..common.names import DEFAULT_METHOD, METHODS, check_model
from ..common.progress import FIRST_LINE_S

if TYPE_CHECKING:  # the command line imports torch (seconds) only once a command runs: --help answers at once
    from ..api import LLM, GenerationOutput

# a log or pipe gets 120 columns unless $COLUMNS says otherwise; a terminal, its own width
err = Console(stderr=True, width=None if sys.stderr.isatty() or "COLUMNS" in os.environ else 120)
INTERRUPTED = 130  # the shell's code for a command stopped by Ctrl-C (128 + SIGINT)


@contextmanager
def status(text: str) -> Iterator[None]:
    """A spinner while a step runs, on a terminal. Where stderr is not one (a pipe, `make demo > log`, CI) a
    spinner shows nothing at all, so the step's line is printed as it starts, and how long it took once it ends if
    that was more than a few seconds. (A console a test substitutes for stderr keeps the quiet spinner.)"""
    if err.is_terminal or err.file is not sys.stderr:
        with err.status(text):
            yield
        return
    start = time.monotonic()
    err.print(text, highlight=False)
    yield
    took = time.monotonic() - start
    if took >= FIRST_LINE_S:
        err.print(f"{text.removesuffix('...')}: done in {took:.0f} s", highlight=False)


COMMANDS = {"generate": "generate text for one prompt",
            "tune": "measure and cache what the adaptive policy and layer-skip use",
            "train": "train a draft on the target's own answers: eagle, medusa or draft",
            "serve": "OpenAI-compatible HTTP server with continuous batching and speculation",
            "bench": "Spec-Bench: speedup and tau per category, with transformers as peers",
            "export-head": "write a draft head in its published layout (Medusa's, EAGLE-3)"}


def command_of(argv: list[str]) -> str | None:
    """The subcommand a command line names: its first word that is not an option (the top level's options,
    --help and --version, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (`command`) the top level and that subcommand's options only: `train` and
    `serve` build theirs from modules that import torch, which a command line naming another subcommand, or
    none (`specdecode --help`, a mistyped subcommand), never pays."""
    parser = Parser(prog="specdecode", description="Lossless speculative decoding for LLMs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def wanted(name: str) -> bool:
        if command is None or command == name:
            return True
        sub.add_parser(name, help=COMMANDS[name])  # listed in the top level's help, its options never parsed
        return False

    if wanted("generate"):
        add_generate_parser(sub)
    if wanted("tune"):
        add_tune_parser(sub)
    if wanted("train"):
        from ..training.parsers import add_train_parser

        add_train_parser(sub)
    if wanted("serve"):
        from ..server.cli import add_parser as add_serve_parser

        add_serve_parser(sub)
    if wanted("bench"):
        add_bench_parser(sub)
    if wanted("export-head"):
        from .export import add_export_parser

        add_export_parser(sub)
    return parser


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help=COMMANDS["generate"])
    g.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    g.add_argument("--model", default="smollm2-135m-instruct", help="registry name, HF checkpoint dir or .gguf file")
    g.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                   help="speculation method ('none': plain decoding); see README, 'Which method should I use?'")
    g.add_argument("--draft", help="--method draft: the draft model (registry name, HF dir or .gguf); "
                   "--method eagle: a head's folder, ours, EAGLE-3 or EAGLE-1/2 (default: the one shipped for the "
                   "model); --method medusa: heads' folder, ours or Medusa's")
    g.add_argument("--k", default="auto", help="tokens guessed per step (tree depth), or 'auto': the cost model "
                   "picks each step's depth from measured forward cost and acceptance")
    add_method_flags(g)  # every method's options (common/method_options.py)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
    g.add_argument("--seed", type=int, help="sampling seed (default: a fresh one each run)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="most tokens generated")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")
    g.add_argument("--compare", action="store_true", help="also run plain decoding, interleaved, and compare")
    g.add_argument("--repeats", type=positive, default=3,
                   help="--compare: runs of each method (the table shows the median tokens/s)")
    g.add_argument("--threads", type=positive, help="CPU threads for the forwards (default: torch's choice)")
    add_precision_args(g)
    g.add_argument("--json", action="store_true", help="print the result as JSON instead of text")



def add_tune_parser(sub) -> None:
    t = sub.add_parser("tune", help=COMMANDS["tune"])
    t.add_argument("what", choices=["cost", "layer-skip"],
                   help="cost: time target forwards by size, thoroughly (32 paired rounds of 14 sizes: minutes; "
                        "first use calibrates in seconds and refines online); layer-skip: search layers to skip")
    t.add_argument("--model", default="smollm2-135m-instruct", help="registry name, HF checkpoint dir or .gguf file")
    add_precision_args(t)
    t.add_argument("--texts", type=positive, default=6,
                   help="layer-skip: calibration texts (training-set exchanges shipped with the package, up to 48)")
    t.add_argument("--max-tokens", type=int, default=128, help="layer-skip: tokens per calibration text")



def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help=COMMANDS["bench"])
    b.add_argument("--model", default="smollm2-135m-instruct", help="registry name, HF checkpoint dir or .gguf file")
    b.add_argument("--methods", default="none,prompt-lookup",
                   help=f"comma list of name[:draft][@K]: name one of {', '.join(METHODS)}; :PATH for draft, "
                   "medusa (required), hybrid and eagle; @K runs that method at K only (e.g. prompt-lookup@4, "
                   "none@0 for a second plain run as a noise control)")
    b.add_argument("--async-draft", action="store_true",
                   help="each model draft in --methods (draft, quantized, layer-skip) also runs drafting ahead while "
                        "the target verifies (name+async), side by side")
    b.add_argument("--workload", default="spec-bench",
                   help="spec-bench (default), or a repetitive workload built from the training data: repetitive "
                        "(= revise, code-edit, tool-loop: earlier turns recorded), sessions (= revise-session, "
                        "edit-session, tool-session: earlier turns the model's own), or any one of those")
    b.add_argument("--prefix-cache-mb", type=int_in(0, what="a size in MiB"), default=0,
                   help="reuse earlier requests' keys and values (up to this many MiB), as the server does by "
                        "default: a session's turn then prefills only what is new (0: every prompt prefilled whole; "
                        "no run ever finds another run of its own prompt)")
    b.add_argument("--categories", default="all", help="'all' or a comma list of the workload's categories")
    b.add_argument("--prompts-per-category", type=int, default=10, help="the first N questions of each category")
    b.add_argument("--max-new-tokens", type=int, default=256, help="most tokens generated per prompt")
    b.add_argument("--k", default="auto", help="tokens guessed per step or 'auto'; a comma list sweeps K (auto,2,4)")
    b.add_argument("--temperature", default="0", help="a comma list sweeps temperatures")
    b.add_argument("--peers", default="none", help="comma list: transformers (its generate on the same weights), "
                   "llama.cpp (llama-cpp-python on the same GGUF file: `pip install llama-cpp-python`)")
    add_precision_args(b)
    b.add_argument("--questions", help="Spec-Bench question.jsonl (default: $SPECDECODE_DATA/eval/spec_bench/ where "
                   "you keep the full set, else the 2 per category shipped with the package)")
    b.add_argument("--seed", type=int, default=0, help="seed of the run order and of sampling")
    b.add_argument("--repeats", type=int, default=1,
                   help="runs of each prompt and method, in interleaved rounds; the fastest prefill and the "
                        "fastest decode are kept (timeit's rule)")
    b.add_argument("--out", required=True, help="output folder: results.json, report.md, plots")


class CtrlC:
    """SIGINT's handler while a command runs: Python's own (KeyboardInterrupt), and a note that it came. An interrupt
    that lands inside an import can surface as another error: numpy's lazy submodules, cut short, recurse until
    RecursionError, and transformers re-raises that as its own import failure. Whatever a command raises after
    Ctrl-C, the user stopped it."""

    def __init__(self) -> None:
        self.pressed = False

    def __call__(self, signum: int, frame: object) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    @contextmanager
    def installed(self) -> Iterator[CtrlC]:
        """This handler for the block, where signals can be handled (the main thread); the previous one after."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = command_of(argv)
    with CtrlC().installed() as ctrl_c:
        try:
            # everything after this line may import torch and load a model (seconds to a minute): Ctrl-C anywhere in
            # it is one line and exit code 130, never a traceback
            args = build_parser(command if command in COMMANDS else "").parse_args(argv)
            args.argv = argv  # `train --nproc N` hands them to its workers
            check_before_loading(args)
            return run_command(args)
        except KeyboardInterrupt:
            return interrupted(command)
        except Exception as e:
            if ctrl_c.pressed:  # the interrupt cut an import short, which failed in its own words
                return interrupted(command)
            if not isinstance(e, (ValueError, FileNotFoundError)):
                raise
            # one logical line, wrapped by the terminal, never broken into the message (paths stay copyable)
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            return 2


def interrupted(command: str | None) -> int:
    """Ctrl-C: a line, not a traceback (what was streamed stays on the screen)."""
    print(flush=True)
    name = f"specdecode {command}" if command in COMMANDS else "specdecode"
    err.print(f"interrupted: {name} stopped (Ctrl-C)")
    return INTERRUPTED


def run_command(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "tune":
        return cmd_tune(args)
    if args.command == "bench":
        return cmd_bench(args)
    if args.command == "export-head":
        from .export import cmd_export

        return cmd_export(args)
    if args.command == "train":
        from ..training.cli import cmd_train

        return cmd_train(args)
    from ..server.cli import cmd_serve

    announce_serve_setup(args)
    return cmd_serve(args)


def announce_serve_setup(args: argparse.Namespace) -> None:
    """A server's first start on a machine prepares for a while before it listens (the tokenizer converted, the
    kernels compiled, forwards timed for k='auto' by batch size): it says so first, instead of looking hung. Later
    starts read all of it from the cache. First start means: no
    batch table for this --max-batch in the cache (of any model: a heuristic that needs no model loaded)."""
    from ..common.paths import default_cache_dir

    cache = default_cache_dir()
    if any((cache / "costs").glob(f"*-batch{args.max_batch}.json")):
        return
    err.print(f"first start on this machine: before it listens on {args.host}:{args.port}, the server loads "
              f"{args.model}, builds its kernels for this CPU and times its forwards for k='auto' up to batches of "
              f"{args.max_batch} (one-off work cached in {cache}): about 2-4 minutes on 2 cores, each part with its "
              "own progress; later starts take seconds", highlight=False)


def check_before_loading(args: argparse.Namespace) -> None:
    """What can be refused without the model is refused before it loads (loading is the slow part of a first run):
    a model name or path that is not there, a draft model likewise, an empty prompt, a port the server cannot
    take."""
    if args.command == "generate" and args.online_draft and args.method not in ("eagle", "hybrid"):
        raise ValueError(f"--online-draft trains the EAGLE head: use it with --method eagle or hybrid, not "
                         f"{args.method}")
    for option in ("model", "target"):  # generate, tune, bench, serve: --model; train: --target
        if isinstance(getattr(args, option, None), str):
            check_model(getattr(args, option))
    if args.command == "generate":
        if args.method == "draft" and args.draft:
            check_model(args.draft)
        args.prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if not args.prompt.strip():
            raise ValueError("the prompt is empty: give the text to continue (or '-' and the text on standard "
                             "input)")
    if args.command == "serve":
        check_port(args.host, args.port)


def check_port(host: str, port: int) -> None:
    """The server binds host:port after the model loaded and its methods are set up (a minute on a first start):
    a port another process holds, or a host that is not this machine's, is found out now instead."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed port's TIME_WAIT is fine
        try:
            s.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (another server there? choose "
                             "another --port)") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from ..api import LLM

    prompt = args.prompt  # read and checked before the model loads (check_before_loading)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with status(f"loading {args.model}..."):
        llm = LLM.load(args.model, dtype=args.dtype, quantization=quantization(args),
                       kv_cache_dtype=args.kv_cache_dtype)
    if args.k == "auto" and args.method != "none":
        llm.assets.cost_model()  # on a new machine, timed first (seconds, with a progress bar), not during the stream
    options = dict(
        method=args.method, draft=args.draft, k=args.k, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
        chat=args.chat, **method_options(args),
    )
    if args.compare:
        return compare(llm, prompt, options, args.repeats, as_json=args.json)
    if args.json:
        out = llm.generate(prompt, **options)
        print(json.dumps(output_record(out), indent=2))
        return 0
    from .report import show_stats

    stream = llm.generate(prompt, stream=True, **options)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    assert stream.output is not None  # set once the stream is read to its end
    show_stats(err, stream.output)
    return 0


def measure_costs_once(llm: LLM) -> None:
    """`--k auto` prices guesses with the target's forward costs, timed on the first run on a machine:
    say so rather than look hung."""
    from ..policy.cost import CostModel

    if CostModel.cached(llm.model) is None:
        with status("timing target forwards..."):  # the library logs a line saying why and for how long
            llm.assets.cost_model()


def cmd_tune(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..api import LLM

    with status(f"loading {args.model}..."):
        llm = LLM.load(args.model, dtype=args.dtype, quantization=quantization(args),
                       kv_cache_dtype=args.kv_cache_dtype)
    if args.what == "cost":
        from ..policy.cost import CostModel

        cost = CostModel.measure(llm.model)  # the thorough table (minutes; first use calibrates in seconds)
        CostModel.save(llm.model, cost)
        table = Table(title=f"target forward ms ({cost.machine})", title_justify="left")
        table.add_column("tokens", justify="right")
        for c in cost.contexts:
            table.add_column(f"context {c}", justify="right")
        for i, n in enumerate(cost.sizes):
            table.add_row(str(n), *(f"{row[i] * 1e3:.1f}" for row in cost.seconds))
        err.print(table)
        return 0

    def show(step) -> None:
        err.print(f"skip {step.skipped}: agreement {step.agreement:.3f}, predicted {step.speedup:.2f}x (k={step.k})")

    with status("searching layers to skip (teacher-forced agreement on training text)..."):
        result = llm.assets.tune_layer_skip(n_texts=args.texts, max_tokens=args.max_tokens, progress=show)
    if result.pays:
        err.print(f"layer-skip drafts without layers {result.skipped}: predicted {result.speedup:.2f}x")
    else:
        err.print(f"layer skipping does not pay for this model on this machine: `--method layer-skip` runs plain "
                  f"steps under --k auto; a fixed --k drafts without layers {result.draft_layers}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..bench import BenchConfig, load_questions, parse_methods, run_benchmark, save_results, write_report
    from ..bench.methods import with_async
    from ..bench.workloads import load_workload

    ks: list[int | str] = [k if k == "auto" else int(k) for k in args.k.split(",")]
    temperatures = [float(t) for t in args.temperature.split(",")]
    if any(isinstance(k, int) and k < 1 for k in ks) or any(t < 0 for t in temperatures) \
            or args.prompts_per_category < 1 or args.repeats < 1:
        raise ValueError("--k values (or auto), --prompts-per-category and --repeats must be >= 1, temperatures >= 0")
    categories = "all" if args.categories == "all" else args.categories.split(",")
    if args.workload == "spec-bench":
        questions = load_questions(args.questions, categories, args.prompts_per_category)
    else:
        questions = load_workload(args.workload, categories, args.prompts_per_category, seed=args.seed)
    cfg = BenchConfig(
        model=args.model, methods=parse_methods(with_async(args.methods) if args.async_draft else args.methods, ks,
                                                peers=[] if args.peers == "none" else
                                                args.peers.split(",")),
        dtype=args.dtype, quantization=quantization(args), kv_cache_dtype=args.kv_cache_dtype,
        questions=questions, temperatures=temperatures, max_new_tokens=args.max_new_tokens, seed=args.seed,
        command="specdecode " + " ".join(sys.argv[1:]), repeats=args.repeats, prefix_cache_mb=args.prefix_cache_mb,
    )
    results = run_benchmark(cfg)
    out = Path(args.out)
    save_results(results, out)
    report = write_report(results, out)
    err.print(f"wrote {out / 'results.json'} and {report}")
    print(report.read_text())
    return 0


def compare(llm: LLM, prompt: str, options: dict, repeats: int, as_json: bool) -> int:
    """Plain decoding vs the chosen method on the same prompt, alternating order so drift hits both."""
    from .report import Comparison, show_comparison

    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    plain_options = {**{k: v for k, v in options.items() if k not in all_options()}, "method": "none"}
    with status("warming up (first calls pay one-off costs)..."):
        llm.generate(prompt, **{**options, "max_new_tokens": 8})
        llm.generate(prompt, **{**plain_options, "max_new_tokens": 8})
    spec_runs: list[GenerationOutput] = []
    plain_runs: list[GenerationOutput] = []
    for r in range(repeats):
        order = [(options, spec_runs), (plain_options, plain_runs)]
        for opts, runs in order if r % 2 == 0 else order[::-1]:
            with status(f"run {r + 1}/{repeats}: {opts['method']}..."):
                runs.append(llm.generate(prompt, **opts))
    result = Comparison(spec_runs, plain_runs, greedy=options["temperature"] == 0)
    if as_json:
        print(json.dumps({"speculative": [output_record(o) for o in spec_runs],
                          "plain": [output_record(o) for o in plain_runs], **result.record()}, indent=2))
        return 0
    print(spec_runs[-1].text)
    show_comparison(err, result)
    return 0 if result.outputs_match or not result.greedy else 1


def output_record(out: GenerationOutput) -> dict:
    return {"text": out.text, "finish_reason": out.finish_reason, "method": out.method,
            "token_ids": out.token_ids, "stats": out.stats.as_dict()}


if __name__ == "__main__":
    sys.exit(main())
