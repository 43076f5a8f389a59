"""What `specdecode generate` prints after the text: a stats table that fits 80 columns, and --compare's verdict,
every number in it defined and consistent with the others."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table

from ..api import GenerationOutput
from ..engine.loop import GenerationStats

# each line under 80 columns: what the table's columns mean, and how tau follows from the two after it
LEGEND = ("tau: tokens per target forward (plain decoding: 1.00) = 1 + guess/fwd x kept\n"
          "guess/fwd: tokens guessed per target forward (every node of a tree counts)\n"
          "kept: share of the guessed tokens that the target confirmed")


def total(outputs: list[GenerationOutput]) -> GenerationStats:
    """The stats of several runs added up (tau and kept are then over all of them)."""
    s = GenerationStats()
    for o in outputs:
        for name in ("prompt_tokens", "new_tokens", "drafted", "accepted", "target_forwards", "prefill_seconds",
                     "target_seconds", "draft_seconds", "seconds"):
            setattr(s, name, getattr(s, name) + getattr(o.stats, name))
    return s


def median_tps(outputs: list[GenerationOutput]) -> float:
    return statistics.median(o.stats.tokens_per_second for o in outputs)


@dataclass
class Comparison:
    """--compare's runs: the method's and plain decoding's, run in alternating order, paired run by run."""

    spec: list[GenerationOutput]
    plain: list[GenerationOutput]
    greedy: bool

    @property
    def speedup(self) -> float:
        """Median tokens/s of the method's runs over the median of plain decoding's: the table's two numbers."""
        return median_tps(self.spec) / median_tps(self.plain)

    @property
    def by_run(self) -> list[float]:
        """Each run's tokens/s over the plain run beside it: their spread is the machine's noise."""
        return [s.stats.tokens_per_second / p.stats.tokens_per_second for s, p in zip(self.spec, self.plain,
                                                                                    strict=True)]

    @property
    def outputs_match(self) -> bool:
        return all(o.token_ids == self.plain[0].token_ids for o in self.spec + self.plain)

    def record(self) -> dict:
        return {"tokens_per_second_median": {"speculative": median_tps(self.spec), "plain": median_tps(self.plain)},
                "speedup": self.speedup, "speedups_by_run": self.by_run,
                "outputs_match": self.outputs_match if self.greedy else None}


def stats_table(rows: list[tuple[str, list[GenerationOutput]]], plain_tps: float | None = None) -> Table:
    """One row per method: tokens, tokens/s (the median over its runs), speedup over `plain_tps` when given, tau,
    tokens guessed per target forward and the share kept (over all its runs), and for a single run its prefill
    seconds. Fits 80 columns."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    columns = ["method", "tokens", "tokens/s", *(["speedup"] if plain_tps else []), "tau", "guess/fwd", "kept",
               *([] if plain_tps else ["prefill s"])]
    for name in columns:
        table.add_column(name, justify="left" if name == "method" else "right", no_wrap=True)
    for method, outputs in rows:
        s, tps = total(outputs), median_tps(outputs)
        guessed = s.drafted / s.target_forwards if s.target_forwards else 0.0
        kept = f"{s.acceptance_rate:.0%}" if s.drafted else "-"
        table.add_row(method, str(outputs[-1].stats.new_tokens), f"{tps:.1f}",
                      *([f"{tps / plain_tps:.2f}x"] if plain_tps else []), f"{s.tau:.2f}", f"{guessed:.1f}", kept,
                      *([] if plain_tps else [f"{s.prefill_seconds:.2f}"]))
    return table


def show_stats(console: Console, output: GenerationOutput) -> None:
    console.print(stats_table([(output.method, [output])]))
    console.print(LEGEND, style="dim", highlight=False)


def show_comparison(console: Console, c: Comparison) -> None:
    runs = len(c.spec)
    console.print(stats_table([(c.spec[0].method, c.spec), ("none (plain)", c.plain)], median_tps(c.plain)))
    console.print(f"tokens/s: the median of {runs} run{'s' * (runs > 1)} each, prefill included; speedup: over "
                  "plain's\n" + LEGEND, style="dim", highlight=False)
    match = ("[green]yes[/green]" if c.outputs_match else "[red]NO[/red]") if c.greedy else "n/a (sampling)"
    console.print(f"speedup over plain decoding: [bold]{c.speedup:.2f}x[/bold] (median tokens/s: "
                  f"{median_tps(c.spec):.1f} vs {median_tps(c.plain):.1f})", highlight=False)
    if runs > 1:  # the median's ratio always lies within the paired runs' range
        console.print(f"runs paired one by one: {min(c.by_run):.2f}x to {max(c.by_run):.2f}x (the spread is "
                      "this machine's noise)", highlight=False)
    console.print(f"greedy outputs identical: {match}", highlight=False)
