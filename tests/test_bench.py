"""The Spec-Bench harness end to end on a tiny checkpoint (no timing assertions), and its arithmetic."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specdecode.bench import aggregate, load_questions, parse_methods
from specdecode.bench.data import is_sample
from specdecode.bench.methods import Method, with_async
from specdecode.bench.runner import fastest, run_round
from specdecode.cli.commands import main as cli_main
from specdecode.data import SPEC_BENCH_SAMPLE, spec_bench_questions
from specdecode.engine.loop import GenerationStats

from .helpers import make_tokenizer, write_checkpoint


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("q") / "question.jsonl"
    rows = [(1, "writing", "the quick brown fox"), (2, "writing", "hello world"), (3, "math", "12345 67890"),
            (4, "math", "def add(a, b):"), (5, "rag", "how are you today?")]
    path.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t, "second turn"]})
                              for i, c, t in rows))
    return path


def test_bench_end_to_end(tmp_path: Path, questions: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # the auto policy's cost table goes here
    ckpt = write_checkpoint(tmp_path / "tiny", make_tokenizer())
    out = tmp_path / "out"
    code = cli_main(["bench", "--model", str(ckpt), "--methods", f"none,prompt-lookup,draft:{ckpt}",
                     "--categories", "writing,math", "--prompts-per-category", "2", "--questions", str(questions),
                     "--max-new-tokens", "8", "--k", "auto,1,2", "--temperature", "0,1.0", "--peers", "transformers",
                     "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    labels = [m["label"] for m in results["methods"]]
    assert labels == ["none", "prompt-lookup@k=auto", "prompt-lookup@k=1", "prompt-lookup@k=2", "draft@k=auto",
                      "draft@k=1", "draft@k=2", "hf-plain", "hf-prompt-lookup", "hf-assisted"]
    assert list((tmp_path / "cache" / "costs").glob("*.json"))
    assert len(results["records"]) == 4 * len(labels) * 2  # prompts x methods x temperatures
    assert all(0 < rec["prefill_seconds"] < rec["seconds"] for rec in results["records"])  # peers' too
    table = aggregate(results)
    for label in labels[1:]:  # greedy: every method reproduces plain decoding token for token
        assert table[0.0]["overall"][label].same_as_none == 1.0, label
    assert table[0.0]["overall"]["draft@k=2"].acceptance == 1.0  # the draft is the target itself
    assert table[0.0]["overall"]["hf-plain"].tau == 1.0  # peers' target forwards are counted too
    assert table[0.0]["overall"]["hf-assisted"].tau > 1.0
    report = (out / "report.md").read_text()
    assert "## Temperature 0.0" in report and "## Temperature 1.0" in report and "| math |" in report
    assert "ours `none` vs transformers `hf-plain`" in report
    for png in ("speedup_T0.0.png", "tau_T0.0.png", "speedup_vs_k_T0.0.png", "speedup_T1.0.png"):
        assert (out / png).stat().st_size > 1000, png


def test_aggregate_uses_total_ratios_against_none_on_the_same_prompts() -> None:
    def rec(q, method, tokens, seconds, kind="ours", forwards=None, cat="a"):
        return {"question_id": q, "category": cat, "method": method, "kind": kind, "temperature": 0.0,
                "new_tokens": tokens, "seconds": seconds, "drafted": 10, "accepted": 5,
                "target_forwards": forwards or tokens, "output_hash": "h"}
    results = {"records": [rec(1, "none", 10, 1.0), rec(1, "x", 10, 0.5, forwards=5),
                           rec(2, "none", 30, 1.0, cat="b"), rec(2, "x", 30, 1.5, forwards=10, cat="b")]}
    t = aggregate(results)[0.0]
    assert t["a"]["x"].speedup == pytest.approx(2.0) and t["b"]["x"].speedup == pytest.approx(2 / 3)
    assert t["overall"]["x"].speedup == pytest.approx((40 / 2.0) / (40 / 2.0))  # total ratio, not a mean
    assert sorted(t["overall"]["x"].speedups) == pytest.approx([2 / 3, 2.0])
    assert t["overall"]["x"].tau == pytest.approx(40 / 15) and t["overall"]["x"].acceptance == 0.5


def test_repeats_keep_the_fastest_run_and_flag_outputs_that_differ(tmp_path: Path, questions: Path,
                                                                   monkeypatch) -> None:
    runs = [{"seconds": 2.0, "output_hash": "a", "tau": 1.0}, {"seconds": 1.5, "output_hash": "a", "tau": 2.0}]
    assert fastest(runs) == {"seconds": 1.5, "output_hash": "a", "tau": 2.0, "seconds_runs": [2.0, 1.5]}
    assert fastest([*runs, {"seconds": 3.0, "output_hash": "b"}])["output_hash"] == "differs-between-runs"
    # a burst in the first run's decode steps and in the second one's prefill: each part keeps its fastest
    split = [{"seconds": 2.0, "prefill_seconds": 0.4, "output_hash": "a"},
             {"seconds": 1.9, "prefill_seconds": 0.8, "output_hash": "a"}]
    best = fastest(split)
    assert best["seconds"] == pytest.approx(0.4 + 1.1) and best["prefill_seconds"] == 0.4
    assert best["seconds_runs"] == [2.0, 1.9] and best["prefill_seconds_runs"] == [0.4, 0.8]

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    ckpt = write_checkpoint(tmp_path / "tiny", make_tokenizer())
    out = tmp_path / "out"
    assert cli_main(["bench", "--model", str(ckpt), "--methods", "prompt-lookup@2,suffix@2", "--categories", "math",
                     "--prompts-per-category", "2", "--questions", str(questions), "--max-new-tokens", "6",
                     "--repeats", "3", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["repeats"] == 3 and len(results["records"]) == 2 * 3  # one record per prompt and method
    for rec in results["records"]:  # suffix too: its cache held each prompt's outputs aside until its rounds ended
        prefill, total = rec["prefill_seconds_runs"], rec["seconds_runs"]
        assert len(total) == 3 and 0 < rec["prefill_seconds"] == min(prefill) < rec["seconds"] <= min(total)
        assert rec["seconds"] == pytest.approx(min(prefill) + min(t - p for t, p in zip(total, prefill, strict=True)))
    assert aggregate(results)[0.0]["overall"]["prompt-lookup@k=2"].same_as_none == 1.0
    report = (out / "report.md").read_text()
    assert "fastest is kept, as timeit does, for the prefill and the decode steps apart" in report
    assert cli_main(["bench", "--model", str(ckpt), "--repeats", "0", "--out", str(out)]) == 2


class SteppedRequest:
    """Stands in for a Generation: `steps` steps of one token each, logged as they run."""

    def __init__(self, label: str, steps: int, log: list[str]) -> None:
        self.label, self.steps, self.log = label, steps, log
        self.stats, self.new_tokens = GenerationStats(), []

    def __iter__(self):
        for _ in range(self.steps):
            self.log.append(self.label)
            self.stats.new_tokens += 1
            self.new_tokens.append(7)
            yield [7]


class LoggingRunners:
    def __init__(self, steps: dict[str, int]) -> None:
        self.steps, self.log = steps, []

    def start(self, m: Method, *_) -> SteppedRequest:
        return SteppedRequest(m.label, self.steps[m.label], self.log)

    def transformers(self, m: Method, *_) -> dict:
        self.log.append(m.label)
        return {"new_tokens": 1, "seconds": 1.0}


def test_a_round_steps_our_methods_in_turn_and_runs_peers_whole() -> None:
    methods = [Method("none", "ours", "none"), Method("pl", "ours", "prompt-lookup", k=2),
               Method("hf-plain", "transformers", "none")]
    runners = LoggingRunners({"none": 5, "pl": 3})
    records = run_round(runners, methods, [1, 2], 8, 0.0, 0, random.Random(0))
    assert list(records) == ["none", "pl", "hf-plain"]
    assert runners.log[0] == "hf-plain" and runners.log.count("none") == 5 and runners.log.count("pl") == 3
    ours = runners.log[1:]
    for n in range(1, 7):  # while both run, neither gets two steps ahead of the other
        assert abs(ours[:n].count("none") - ours[:n].count("pl")) <= 1
    assert records["none"]["new_tokens"] == 5 and records["pl"]["new_tokens"] == 3
    assert 0 < records["pl"]["prefill_seconds"] < records["pl"]["seconds"] < 1.0  # the first step is the prefill


def test_questions_and_methods_are_checked(questions: Path) -> None:
    assert [q.question_id for q in load_questions(questions, ["writing"], 1)] == [1]
    assert len(load_questions(questions)) == 5
    with pytest.raises(ValueError, match="unknown Spec-Bench categories"):
        load_questions(questions, ["poetry"])
    with pytest.raises(FileNotFoundError, match="--questions"):
        load_questions(questions.parent / "missing.jsonl")
    with pytest.raises(ValueError, match="draft needs a path"):
        parse_methods("none,draft", [4], peers=False)
    with pytest.raises(ValueError, match="medusa needs a path"):
        parse_methods("medusa", [4], peers=False)
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("jacobi", [4], peers=False)
    with pytest.raises(ValueError, match="bad K"):
        parse_methods("prompt-lookup@x", [4], peers=False)
    methods = parse_methods("none@0,prompt-lookup@2,lookahead,hybrid:d@auto", ["auto", 4], peers=False)
    assert [(m.label, m.k, m.draft) for m in methods] == [
        ("none", 0, None), ("none@k=0", 0, None), ("prompt-lookup@k=2", 2, None), ("lookahead@k=auto", "auto", None),
        ("lookahead@k=4", 4, None), ("hybrid@k=auto", "auto", "d")]
    two_heads = parse_methods("eagle@auto,eagle:heads/new@auto", [4], peers=False)  # two heads side by side
    assert [m.label for m in two_heads] == ["none", "eagle@k=auto", "eagle:new@k=auto"]
    with pytest.raises(ValueError, match="twice in --methods"):
        parse_methods("prompt-lookup@2,prompt-lookup@2", [4], peers=False)
    # modifiers: drafting ahead, prompt lookup guessing for the draft; --async-draft adds each model draft's twin
    spec = with_async("none@0,quantized@4,draft:d,quantized+cascade@auto,eagle@auto")
    assert spec == "none@0,quantized@4,quantized+async@4,draft:d,draft+async:d,quantized+cascade@auto," \
        "quantized+cascade+async@auto,eagle@auto"
    methods = {m.label: m for m in parse_methods(spec, [4], peers=False)}
    assert methods["quantized+async@k=4"].options == {"async_draft": True}
    assert methods["draft+async"].draft == "d" and methods["draft+async"].method == "draft"
    assert methods["quantized+cascade+async@k=auto"].options == {"cascade": "prompt-lookup", "async_draft": True}
    with pytest.raises(ValueError, match="unknown modifier"):
        parse_methods("quantized+fast", [4], peers=False)


def test_default_questions_are_spec_bench_or_its_shipped_sample(tmp_path, monkeypatch) -> None:
    """The full set where $SPECDECODE_DATA (else shared/data beside the checkout) has it, else the 2 questions per
    category that ship with the package: the same first questions, so a fresh clone benchmarks what CI does."""
    full = load_questions(per_category=1)
    assert len(full) == 13 and {q.category for q in full} >= {"translation", "rag", "math_reasoning"}
    monkeypatch.setenv("SPECDECODE_DATA", str(tmp_path))  # an empty data folder: only the package's sample
    assert is_sample(None) and spec_bench_questions() == SPEC_BENCH_SAMPLE
    sample = load_questions(per_category=5)
    assert len(sample) == 26 and [q.question_id for q in sample][::2] == [q.question_id for q in full]
    (tmp_path / "eval" / "spec_bench").mkdir(parents=True)
    (tmp_path / "eval" / "spec_bench" / "question.jsonl").write_text(SPEC_BENCH_SAMPLE.read_text())
    assert not is_sample(None)


def test_bench_without_the_full_spec_bench_says_where_to_get_it(tmp_path, monkeypatch, capsys, caplog) -> None:
    with pytest.raises(FileNotFoundError, match="github.com/hemingkx/Spec-Bench"):
        load_questions(tmp_path / "question.jsonl")
    monkeypatch.setenv("SPECDECODE_DATA", str(tmp_path))
    monkeypatch.setattr("specdecode.bench.run_benchmark", lambda cfg: pytest.fail("should stop before running"))
    assert cli_main(["bench", "--categories", "poetry", "--out", str(tmp_path / "out")]) == 2
    assert "unknown Spec-Bench categories" in capsys.readouterr().err
    warning = " ".join(r.getMessage() for r in caplog.records if r.name == "specdecode")
    assert "shipped sample" in warning and "github.com/hemingkx/Spec-Bench" in warning


def training_folder(root: Path) -> Path:
    """A few made-up rows in the training data's layout (sharegpt, GPTeacher codegen and toolformer)."""
    (root / "sharegpt").mkdir(parents=True)
    (root / "gpteacher").mkdir()
    chats = [{"conversations": [{"from": "human", "value": f"Question {i}: what should a newcomer read first?"},
                                {"from": "gpt", "value": f"Answer {i}. " + "Some words. " * 40}]} for i in range(6)]
    (root / "sharegpt" / "sharegpt_sample_1000.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    code = [{"instruction": "Write code", "input": "", "response": f"def f{i}(x):\n" + "    x += 1\n" * 40}
            for i in range(6)]
    (root / "gpteacher" / "codegen-instruct.json").write_text(json.dumps(code))
    tools = [{"instruction": f"toolformer: enabled\nFind fact {i}.", "input": f"topic {i}",
              "response": f"wikipedia('topic {i}')"} for i in range(12)]
    (root / "gpteacher" / "toolformer-dedupe-only-dataset.json").write_text(json.dumps(tools))
    return root


def test_repetitive_workload_is_built_from_training_data(tmp_path) -> None:
    from specdecode.bench.workloads import has_own_turns, load_workload

    train = training_folder(tmp_path / "train")  # made-up rows: the tests read nothing beside the repository
    questions = load_workload("repetitive", per_category=2, train=train)
    assert [q.category for q in questions] == ["revise"] * 2 + ["code-edit"] * 2 + ["tool-loop"] * 2
    assert questions == load_workload("repetitive", per_category=2, train=train)  # the same prompts every run
    assert len({q.question_id for q in questions}) == 6
    revise = questions[0].prompt
    assert [m["role"] for m in revise] == ["user", "assistant", "user"] and "Revise" in revise[-1]["content"]
    tools = questions[-1].prompt
    assert tools[0]["role"] == "system" and '"tool"' in tools[2]["content"]  # earlier calls in the fixed schema
    sessions = load_workload("sessions", per_category=2, train=train)
    assert [q.category for q in sessions] == ["revise-session"] * 2 + ["edit-session"] * 2 + ["tool-session"] * 2
    assert sessions == load_workload("sessions", per_category=2, train=train)
    assert all(has_own_turns(q.prompt) and q.prompt[-1]["role"] == "user" for q in sessions)
    assert not any(has_own_turns(q.prompt) for q in questions)
    spec_bench = spec_bench_questions().read_text()
    assert all(m["content"][:200] not in spec_bench for q in questions + sessions for m in q.prompt
               if m["content"] is not None)  # never eval prompts
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope", train=train)
    with pytest.raises(ValueError, match="unknown categories"):
        load_workload("revise", ["tool-loop"], train=train)


def test_sessions_answer_their_own_turns_once_and_every_method_reads_the_same_prefix(tmp_path, monkeypatch) -> None:
    """A session's earlier turn is the model's own greedy answer, written once before its runs; with the prefix
    cache on, each run reads that turn's entries and no run finds another's prefill (every method of a question
    reads as many tokens, in every repeat); outputs equal plain decoding's; the report says what was cached."""
    from specdecode import LLM
    from specdecode.bench import BenchConfig, run_benchmark, write_report
    from specdecode.bench.runner import answer_own_turns
    from specdecode.bench.workloads import load_workload

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    train = training_folder(tmp_path / "train")
    questions = load_workload("sessions", per_category=1, train=train)
    ckpt = write_checkpoint(tmp_path / "tiny", make_tokenizer())
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))  # the tool schema
    llm = LLM.load(ckpt, dtype="float64")
    answered = []
    original = answer_own_turns
    monkeypatch.setattr("specdecode.bench.runner.answer_own_turns",
                        lambda *a: answered.append(1) or original(*a))
    cfg = BenchConfig(model="tiny", methods=parse_methods("none,prompt-lookup,suffix", ["auto"], []),
                      questions=questions, temperatures=[0.0], max_new_tokens=12, repeats=2, prefix_cache_mb=16)
    results = run_benchmark(cfg, llm)
    assert len(answered) == len(questions)
    for q in questions:
        recs = [r for r in results["records"] if r["question_id"] == q.question_id]
        own = next(i for i, m in enumerate(q.prompt) if m["content"] is None)
        first_turn = len(llm.encode(q.prompt[:own], chat=True))
        assert len({n for r in recs for n in r["cached_tokens_runs"]}) == 1  # every run of every method
        assert recs[0]["cached_tokens"] >= first_turn - 1
        assert recs[0]["prompt_tokens"] > recs[0]["cached_tokens"]
    overall = aggregate(results)[0.0]["overall"]
    assert overall["suffix"].same_as_none == overall["prompt-lookup"].same_as_none == 1.0
    (tmp_path / "out").mkdir()
    assert "- prefix cache: 16 MiB" in write_report(results, tmp_path / "out").read_text()
