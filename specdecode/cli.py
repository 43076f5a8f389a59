"""Command line: `specdecode generate PROMPT --method ...`, `bench`, `tune` and `train`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from rich.console import Console
from rich.table import Table

from .api import LLM, METHODS, GenerationOutput
from .cli_precision import add_precision_args, quantization
from .models.quant import QUANTIZATIONS
from .server.cli import add_parser as add_serve_parser
from .server.cli import cmd_serve
from .training.cli import add_train_parser, cmd_train

err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    g.add_argument("--model", default="smollm2-135m-instruct", help="registry name, HF checkpoint dir or .gguf file")
    g.add_argument("--method", choices=METHODS, default="prompt-lookup")
    g.add_argument("--draft", help="--method draft: the draft model (registry name, HF dir or .gguf); "
                   "--method eagle: a trained head's folder (default: the one shipped for the model); "
                   "--method medusa: trained heads' folder")
    g.add_argument("--k", default="auto", help="tokens guessed per step (tree depth), or 'auto': the cost model "
                   "picks each step's depth from measured forward cost and acceptance")
    g.add_argument("--max-ngram", type=int, default=3, help="prompt-lookup: longest n-gram matched")
    g.add_argument("--min-ngram", type=int, default=1, help="prompt-lookup: shortest n-gram matched")
    g.add_argument("--branches", type=int, help="prompt-lookup: continuations merged into a tree (default: "
                   "3 with --k auto, which verifies as much of the tree as pays; 1 with a fixed k)")
    g.add_argument("--window", type=int, default=4, help="lookahead: Jacobi window columns")
    g.add_argument("--ngram", type=int, default=3, help="lookahead: n-gram size (levels = ngram - 1)")
    g.add_argument("--guesses", type=int, default=4, help="lookahead: pool n-grams verified per step")
    g.add_argument("--skip-layers", help="layer-skip: comma list of layers to skip (default: searched once, cached)")
    g.add_argument("--topk", type=int, default=4, help="eagle: children per expanded tree node")
    g.add_argument("--nodes", type=int, default=24,
                   help="eagle: most guessed tokens a step (the cost model picks how many of them are worth verifying)")
    g.add_argument("--low-bit", default="int4-a8", choices=list(QUANTIZATIONS),
                   help="quantized: the precision of the target's copy that drafts (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")
    g.add_argument("--compare", action="store_true", help="also run plain decoding, interleaved, and compare")
    g.add_argument("--repeats", type=int, default=3, help="--compare: runs of each method (median reported)")
    add_precision_args(g)
    g.add_argument("--json", action="store_true", help="print the result as JSON instead of text")

    t = sub.add_parser("tune", help="measure and cache what the adaptive policy and layer-skip use")
    t.add_argument("what", choices=["cost", "layer-skip"],
                   help="cost: time target forwards by size (the cost model); layer-skip: search layers to skip")
    t.add_argument("--model", default="smollm2-135m-instruct")
    add_precision_args(t)
    t.add_argument("--texts", type=int, default=6, help="layer-skip: calibration texts (training-set exchanges shipped with the package, at most 48)")
    t.add_argument("--max-tokens", type=int, default=128, help="layer-skip: tokens per calibration text")

    add_train_parser(sub)

    add_serve_parser(sub)

    b = sub.add_parser("bench", help="Spec-Bench: speedup and tau per category, with transformers as peers")
    b.add_argument("--model", default="smollm2-135m-instruct")
    b.add_argument("--methods", default="none,prompt-lookup", help="comma list: none, prompt-lookup, draft:PATH")
    b.add_argument("--categories", default="all", help="'all' or a comma list of Spec-Bench categories")
    b.add_argument("--prompts-per-category", type=int, default=10)
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--k", default="auto", help="tokens guessed per step or 'auto'; a comma list sweeps K (auto,2,4)")
    b.add_argument("--temperature", default="0", help="a comma list sweeps temperatures")
    b.add_argument("--peers", default="none", help="comma list: transformers (its generate on the same weights), "
                   "llama.cpp (llama-cpp-python on the same GGUF file: `pip install llama-cpp-python`)")
    add_precision_args(b)
    b.add_argument("--questions", help="Spec-Bench question.jsonl (default: ../shared/data/eval/spec_bench)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--repeats", type=int, default=1,
                   help="runs of each prompt and method, in interleaved rounds; the fastest prefill and the "
                        "fastest decode are kept (timeit's rule)")
    b.add_argument("--out", required=True, help="output folder: results.json, report.md, plots")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"bench": cmd_bench, "generate": cmd_generate, "tune": cmd_tune, "train": cmd_train}
        commands["serve"] = cmd_serve
        return commands[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        err.print(f"[red]error:[/red] {e}")
        return 2


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with err.status(f"loading {args.model}..."):
        llm = LLM.load(args.model, dtype=args.dtype, quantization=quantization(args))
    if args.k == "auto" and args.method != "none":
        measure_costs_once(llm)
    options = dict(
        method=args.method, draft=args.draft, k=args.k, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
        chat=args.chat, max_ngram=args.max_ngram, min_ngram=args.min_ngram, branches=args.branches,
        window=args.window, ngram=args.ngram, guesses=args.guesses, low_bit=args.low_bit,
        skip_layers=[int(i) for i in args.skip_layers.split(",")] if args.skip_layers else None,
    )
    if args.method == "eagle":
        options.update(topk=args.topk, nodes=args.nodes)
    if args.compare:
        return compare(llm, prompt, options, args.repeats, as_json=args.json)
    if args.json:
        out = llm.generate(prompt, **options)
        print(json.dumps(output_record(out), indent=2))
        return 0
    stream = llm.generate(prompt, stream=True, **options)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    show_stats([stream.output])
    return 0


def measure_costs_once(llm: LLM) -> None:
    """`--k auto` prices guesses with the target's forward costs, timed on the first run on a machine:
    say so rather than look hung."""
    from .policy import CostModel

    if CostModel.cached(llm.model) is None:
        with err.status("timing target forwards (once per model and machine, about a minute)..."):
            llm.cost_model()


def cmd_tune(args: argparse.Namespace) -> int:
    with err.status(f"loading {args.model}..."):
        llm = LLM.load(args.model, dtype=args.dtype, quantization=quantization(args))
    if args.what == "cost":
        from .policy import CostModel

        with err.status("timing target forwards..."):
            cost = CostModel.measure(llm.model)
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

    with err.status("searching layers to skip (teacher-forced agreement on training text)..."):
        result = llm.tune_layer_skip(n_texts=args.texts, max_tokens=args.max_tokens, progress=show)
    if result.pays:
        err.print(f"layer-skip drafts without layers {result.skipped}: predicted {result.speedup:.2f}x")
    else:
        err.print(f"layer skipping does not pay for this model on this machine: `--method layer-skip` runs plain "
                  f"steps under --k auto; a fixed --k drafts without layers {result.draft_layers}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .bench import BenchConfig, load_questions, parse_methods, run_benchmark, save_results, write_report
    from .bench.data import is_sample
    from .data import SPEC_BENCH_SOURCE

    ks: list[int | str] = [k if k == "auto" else int(k) for k in args.k.split(",")]
    temperatures = [float(t) for t in args.temperature.split(",")]
    if any(k != "auto" and k < 1 for k in ks) or any(t < 0 for t in temperatures) or args.prompts_per_category < 1 \
            or args.repeats < 1:
        raise ValueError("--k values (or auto), --prompts-per-category and --repeats must be >= 1, temperatures >= 0")
    categories = "all" if args.categories == "all" else args.categories.split(",")
    if is_sample(args.questions):
        err.print(f"[yellow]Spec-Bench's full question set is not here: using the shipped sample (2 questions per "
                  f"category); for all of it, {SPEC_BENCH_SOURCE}[/yellow]")
    questions = load_questions(args.questions, categories, args.prompts_per_category)
    cfg = BenchConfig(
        model=args.model, methods=parse_methods(args.methods, ks, peers=[] if args.peers == "none" else
                                                args.peers.split(",")),
        dtype=args.dtype, quantization=quantization(args),
        questions=questions, temperatures=temperatures, max_new_tokens=args.max_new_tokens, seed=args.seed,
        command="specdecode " + " ".join(sys.argv[1:]), repeats=args.repeats,
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
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    plain_options = {**options, "method": "none"}
    llm.generate(prompt, **{**options, "max_new_tokens": 8})  # warm-up: first calls pay one-off costs
    llm.generate(prompt, **{**plain_options, "max_new_tokens": 8})
    spec_runs: list[GenerationOutput] = []
    plain_runs: list[GenerationOutput] = []
    for r in range(repeats):
        order = [(options, spec_runs), (plain_options, plain_runs)]
        for opts, runs in order if r % 2 == 0 else order[::-1]:
            with err.status(f"run {r + 1}/{repeats}: {opts['method']}..."):
                runs.append(llm.generate(prompt, **opts))
    pairs = zip(spec_runs, plain_runs, strict=True)
    speedups = [s.stats.tokens_per_second / p.stats.tokens_per_second for s, p in pairs]
    same = all(s.token_ids == plain_runs[0].token_ids for s in spec_runs + plain_runs)
    greedy = options["temperature"] == 0
    if as_json:
        print(json.dumps({
            "speculative": [output_record(o) for o in spec_runs], "plain": [output_record(o) for o in plain_runs],
            "speedup_median": statistics.median(speedups), "speedups": speedups,
            "outputs_match": same if greedy else None,
        }, indent=2))
        return 0
    print(spec_runs[-1].text)
    show_stats([spec_runs[-1], plain_runs[-1]])
    match = ("[green]yes[/green]" if same else "[red]NO[/red]") if greedy else "n/a (sampling)"
    err.print(
        f"speedup over plain decoding: [bold]{statistics.median(speedups):.2f}x[/bold] "
        f"(median of {repeats}, min {min(speedups):.2f}x, max {max(speedups):.2f}x); outputs identical: {match}"
    )
    return 0 if same or not greedy else 1


def output_record(out: GenerationOutput) -> dict:
    return {"text": out.text, "finish_reason": out.finish_reason, "method": out.method,
            "token_ids": out.token_ids, "stats": out.stats.as_dict()}


def show_stats(outputs: list[GenerationOutput]) -> None:
    table = Table(title="generation stats", title_justify="left")
    for col in ("method", "tokens", "tokens/s", "accept rate", "tau", "target fwd", "target s", "draft s", "prefill s"):
        table.add_column(col, justify="right")
    for o in outputs:
        s = o.stats
        table.add_row(o.method, str(s.new_tokens), f"{s.tokens_per_second:.1f}", f"{s.acceptance_rate:.2f}",
                      f"{s.tau:.2f}", str(s.target_forwards), f"{s.target_seconds:.2f}", f"{s.draft_seconds:.3f}",
                      f"{s.prefill_seconds:.2f}")
    err.print(table)


if __name__ == "__main__":
    sys.exit(main())
