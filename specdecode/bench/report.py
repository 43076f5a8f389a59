"""Turns results.json into report.md and PNG plots: speedup and tau per category, speedup vs K."""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

OVERALL = "overall"


@dataclass
class Cell:
    """One (temperature, category, method) aggregate."""

    prompts: int
    tokens: int
    seconds: float
    speedup: float  # total ratio: method tokens/s over `none` tokens/s on the same prompts
    speedups: list[float]  # per prompt
    tau: float | None
    acceptance: float | None
    same_as_none: float | None  # share of prompts whose output equals plain decoding's (greedy only)
    ahead_hit_rate: float | None = None  # asynchronous drafting: proposals taken from chains drafted ahead

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def aggregate(results: dict) -> dict[float, dict[str, dict[str, Cell]]]:
    """temperature -> category (and 'overall') -> method label -> Cell."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    base: dict[tuple, dict] = {}
    for r in results["records"]:
        for cat in (r["category"], OVERALL):
            groups[(r["temperature"], cat, r["method"])].append(r)
        if r["method"] in ("none", "llama.cpp-plain"):  # llama.cpp's rows are compared with its own plain run
            base[(r["temperature"], r["question_id"], r["method"] == "llama.cpp-plain")] = r
    out: dict[float, dict[str, dict[str, Cell]]] = defaultdict(lambda: defaultdict(dict))
    for (temp, cat, label), recs in groups.items():
        bases = [base[(temp, r["question_id"], False)] for r in recs]
        same = [base.get((temp, r["question_id"], r.get("kind") == "llama.cpp"), b) for r, b in zip(recs, bases,
                                                                                                  strict=True)]
        tokens, seconds = sum(r["new_tokens"] for r in recs), sum(r["seconds"] for r in recs)
        base_tps = sum(b["new_tokens"] for b in bases) / sum(b["seconds"] for b in bases)
        forwards = sum(r["target_forwards"] or 0 for r in recs)
        drafted = sum(r["drafted"] or 0 for r in recs)
        out[temp][cat][label] = Cell(
            prompts=len(recs), tokens=tokens, seconds=seconds,
            speedup=(tokens / seconds) / base_tps if seconds and base_tps else 0.0,
            speedups=[tps(r) / tps(b) for r, b in zip(recs, bases, strict=True) if r["seconds"] and b["seconds"]],
            tau=tokens / forwards if forwards else None,
            acceptance=sum(r["accepted"] or 0 for r in recs) / drafted if drafted else None,
            same_as_none=(sum(r["output_hash"] == b["output_hash"] for r, b in zip(recs, same, strict=True))
                          / len(recs)) if temp == 0 else None,
            ahead_hit_rate=(sum(r.get("ahead_hits", 0) for r in recs) / steps) if (
                steps := sum(r.get("ahead_steps", 0) for r in recs)) else None,
        )
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else f"{x:{spec}}"


def tps(rec: dict) -> float:
    """Tokens per second of one record (0 when it took no time)."""
    return rec["new_tokens"] / rec["seconds"] if rec["seconds"] else 0.0


def cached_share(results: dict) -> float:
    """The share of our runs' prompt tokens read from the prefix cache."""
    ours = [r for r in results["records"] if "cached_tokens" in r]
    total = sum(r["prompt_tokens"] for r in ours)
    return sum(r["cached_tokens"] for r in ours) / total if total else 0.0


def write_report(results: dict, out: Path) -> Path:
    table = aggregate(results)
    labels = [m["label"] for m in results["methods"]]
    lines = [
        f"# Spec-Bench: {results['model']}",
        "",
        f"- date: {results['date']}",
        f"- machine: {results['machine']}",
        *([f"- weights: {results['weights']}"] if results.get("weights") else []),
        *([f"- peers: {', '.join(f'{k} {v}' for k, v in results['peer_versions'].items())}"]
          if results.get("peer_versions") else []),
        f"- command: `{results['command']}`",
        *([f"- prefix cache: {results['prefix_cache_mb']} MiB (as the server: a prompt that begins as an earlier "
           f"prompt's text or a session's earlier turn did reads their keys and values, and prefills the rest; "
           f"{cached_share(results):.0%} of prompt tokens read so; never another run of the same prompt)"]
          if results.get("prefix_cache_mb") else []),
        f"- max new tokens: {results['max_new_tokens']}; after a warm-up, " + interleaving_note(results)
        + repeats_note(results.get("repeats", 1)),
        f"- physical limit: memory bandwidth {results['memory_bandwidth_gbs']:.1f} GB/s, weights "
        f"{results['weight_bytes'] / 1e6:.0f} MB per token -> plain decoding can reach at most "
        f"{results['plain_decoding_bound_tokens_per_s']:.1f} tokens/s",
        "",
        "speedup = tokens/s over plain decoding (`none`) on the same prompts in the same run (total ratio); "
        "per-prompt speedups as median [min–max]; tau = tokens per target forward; "
        "`= none` = share of prompts whose greedy output equals plain decoding's, token for token (llama.cpp's "
        "rows: its own plain decoding's).",
    ]
    for temp, cats in table.items():
        overall = cats[OVERALL]
        lines += ["", f"## Temperature {temp}", "", "| method | tokens/s | speedup | per-prompt speedup | tau | "
                  "acceptance | = none |", "|---|---:|---:|---:|---:|---:|---:|"]
        for label in labels:
            c = overall.get(label)
            if c is None:
                continue
            spread = (f"{statistics.median(c.speedups):.2f} [{min(c.speedups):.2f}–{max(c.speedups):.2f}]"
                      if c.speedups else "–")
            lines.append(f"| {label} | {c.tokens_per_second:.1f} | {c.speedup:.2f}x | {spread} | {fmt(c.tau)} | "
                         f"{fmt(c.acceptance)} | {fmt(c.same_as_none, '.0%')} |")
        lines += peer_lines(overall)
        lines += ["", "Per category: speedup (tau)", "",
                  "| category | " + " | ".join(labels[1:]) + " |", "|---|" + "---:|" * (len(labels) - 1)]
        for cat in [c for c in cats if c != OVERALL] + [OVERALL]:
            row = [f"{cats[cat][m].speedup:.2f}x ({fmt(cats[cat][m].tau)})" if m in cats[cat] else "–"
                   for m in labels[1:]]
            lines.append(f"| {cat} | " + " | ".join(row) + " |")
        ahead = [m for m in labels if overall.get(m) and overall[m].ahead_hit_rate is not None]
        if ahead:
            lines += ["", "Drafting ahead (asynchronous): share of proposals taken from a chain drafted while the "
                      "target verified", "", "| category | " + " | ".join(ahead) + " |", "|---|" + "---:|" * len(ahead)]
            for cat in [c for c in cats if c != OVERALL] + [OVERALL]:
                lines.append(f"| {cat} | " + " | ".join(fmt(cats[cat][m].ahead_hit_rate, ".0%") if m in cats[cat]
                                                        else "–" for m in ahead) + " |")
    for png in plot(table, labels, out):
        lines += ["", f"![{png.stem}]({png.name})"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def interleaving_note(results: dict) -> str:
    if results.get("interleave") == "step":
        return ("our methods run each prompt side by side, one step each in turn (a fresh random order every "
                "round of steps), so load that comes and goes hits them alike; each is timed by the sum of its own "
                "steps, prefill included" + ("; peers (transformers, llama.cpp) cannot be stepped: they run whole, "
                                             "first" if any(m["kind"] != "ours" for m in results["methods"]) else ""))
    return "methods interleaved per prompt (random order per prompt)"


def repeats_note(repeats: int) -> str:
    if repeats == 1:
        return ""
    return (f"; each prompt ran {repeats} times per method in rounds (a fresh random order each) and the "
            "fastest is kept, as timeit does, for the prefill and the decode steps apart: the prefill is one long "
            "step that a burst of load hits alone, and the same work in every run (every run's seconds are in "
            "results.json); the global cache of earlier outputs (suffix, hybrid) holds a prompt's outputs aside until "
            "its last round, so no run finds that prompt's answer")


def peer_lines(overall: dict[str, Cell]) -> list[str]:
    pairs = [("none", "hf-plain"), ("prompt-lookup", "hf-prompt-lookup"), ("draft", "hf-assisted"),
             ("none", "llama.cpp-plain"), ("prompt-lookup", "llama.cpp-prompt-lookup")]
    out = []
    for ours, theirs in pairs:
        if ours in overall and theirs in overall and overall[theirs].tokens_per_second:
            ratio = overall[ours].tokens_per_second / overall[theirs].tokens_per_second
            peer = "llama.cpp" if theirs.startswith("llama.cpp") else "transformers"
            out.append(f"- ours `{ours}` vs {peer} `{theirs}`: {ratio:.2f}x the tokens/s")
    if "llama.cpp-plain" in overall and overall["llama.cpp-plain"].tokens_per_second:
        base = overall["llama.cpp-plain"].tokens_per_second
        best = max((m for m in overall if not m.startswith(("llama.cpp", "hf-"))),
                   key=lambda m: overall[m].tokens_per_second)
        out.append(f"- our best, `{best}`: {overall[best].tokens_per_second / base:.2f}x llama.cpp's plain decoding")
    return [""] + out if out else []


def plot(table, labels: list[str], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for temp, cats in table.items():
        names = [c for c in cats if c != OVERALL] + [OVERALL]
        for metric, ylabel in (("speedup", "speedup over plain decoding"), ("tau", "tokens per target forward")):
            shown = [m for m in labels[1:] if any(getattr(cats[c].get(m), metric, None) for c in names)]
            if not shown:
                continue
            fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 4.5))
            width = 0.8 / len(shown)
            for j, m in enumerate(shown):
                vals = [getattr(cats[c].get(m), metric, None) or 0 for c in names]
                ax.bar([i + j * width for i in range(len(names))], vals, width, label=m)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=35, ha="right")
            if metric == "speedup":
                ax.axhline(1.0, color="black", lw=0.8)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{metric} per category (temperature {temp})")
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out / f"{metric}_T{temp}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        swept: defaultdict[str, dict] = defaultdict(dict)
        for m in labels:
            match = re.fullmatch(r"(.+)@k=(\d+)", m)
            if match and m in cats[OVERALL]:
                swept[match.group(1)][int(match.group(2))] = cats[OVERALL][m].speedup
        if swept:
            fig, ax = plt.subplots(figsize=(6, 4))
            for name, curve in swept.items():
                ks = sorted(curve)
                line = ax.plot(ks, [curve[k] for k in ks], marker="o", label=name)[0]
                auto = cats[OVERALL].get(f"{name}@k=auto")
                if auto is not None:  # the adaptive policy picks K itself: one level across the plot
                    ax.axhline(auto.speedup, color=line.get_color(), ls="--", label=f"{name} k=auto")
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xlabel("K (tokens guessed per step)")
            ax.set_ylabel("overall speedup")
            ax.set_title(f"speedup vs K (temperature {temp})")
            ax.legend()
            fig.tight_layout()
            path = out / f"speedup_vs_k_T{temp}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written
