"""`specdecode train draft` end to end on a tiny checkpoint: the target answers prompts, the draft is distilled,
saved as an HF checkpoint that our loader, transformers and `--method draft` all take; resume; bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import specdecode
from specdecode.cli.commands import main as cli_main
from specdecode.models import load_transformer
from specdecode.training.distill import draft_config, init_embeddings, new_draft
from specdecode.training.features import FeatureStore

from .helpers import CORPUS, make_tokenizer, write_checkpoint


def write_train_data(root: Path, n: int = 8) -> Path:
    """A ShareGPT-layout folder of `n` short conversations (the layout shared/data/train has)."""
    (root / "sharegpt").mkdir(parents=True)
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"{CORPUS[i % len(CORPUS)]} ({i})"},
                                             {"from": "gpt", "value": "ok"}]} for i in range(n)]
    (root / "sharegpt" / "sample.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """(tiny target checkpoint with a real tokenizer, training data folder)."""
    root = tmp_path_factory.mktemp("train")
    return write_checkpoint(root / "target", make_tokenizer()), write_train_data(root / "data")


def train_args(kind: str, target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """A few seconds of the whole pipeline: 8 prompts, 12-token answers, a handful of steps."""
    return ["train", kind, "--target", str(target), "--data", str(data), "--out", str(out), "--max-samples", "8",
            "--heldout", "2", "--max-new-tokens", "12", "--batch-size", "2", "--max-len", "64", "--eval-every", "2",
            "--device", "cpu", "--eval-prompts", "1", *extra]


DRAFT = ("--layers", "1", "--hidden", "32", "--heads", "2")


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory) -> Path:
    target, data = setup
    out = tmp_path_factory.mktemp("draft")
    assert cli_main(train_args("draft", target, data, out, "--steps", "2", *DRAFT)) == 0
    return out


def test_train_draft_end_to_end(setup, trained) -> None:
    target, _ = setup
    for name in ("config.json", "model.safetensors", "tokenizer.json", "report.md", "work/samples.jsonl"):
        assert (trained / name).exists(), name
    report = (trained / "report.md").read_text()
    assert "| step |" in report and "held-out prompts" in report
    # our runtime and transformers read the same weights and agree
    from transformers import AutoModelForCausalLM

    ours = load_transformer(trained, dtype=torch.float64)
    theirs = AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float64).eval()
    assert ours.config.num_layers == 1 and ours.config.hidden_size == 32 and ours.config.tie_word_embeddings
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        expected = theirs(ids).logits
    torch.testing.assert_close(ours.forward(ids, ours.new_cache(6)).logits, expected, rtol=1e-5, atol=1e-6)
    # and `--method draft` takes it: lossless as ever (its tokenizer is the target's)
    llm = specdecode.load(target, dtype="float64")
    plain = llm.generate("the quick brown fox", method="none", max_new_tokens=20)
    spec = llm.generate("the quick brown fox", max_new_tokens=20, method="draft", draft=trained, k=3)
    assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0


def test_draft_refused_by_a_target_with_another_tokenizer(trained, tmp_path) -> None:
    other = specdecode.load(write_checkpoint(tmp_path / "other", make_tokenizer(extra_token="<|tool|>")))
    with pytest.raises(ValueError, match="tokenizer does not match"):
        other.generate("the quick brown fox", max_new_tokens=4, method="draft", draft=trained)


def test_resume_and_settings_guard(setup, trained, capsys) -> None:
    target, data = setup
    log = trained / "train_log.jsonl"
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [2]
    assert cli_main(train_args("draft", target, data, trained, "--steps", "4", *DRAFT)) == 0
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [2, 4]  # carried on from step 2
    assert "resuming from step 2" in capsys.readouterr().err
    # the same folder with another draft shape is refused before any work
    assert cli_main(train_args("draft", target, data, trained, "--steps", "4", "--layers", "2", "--hidden", "32")) == 2
    assert "other settings" in capsys.readouterr().err


def test_interrupted_run_resumes_exactly(setup, tmp_path, monkeypatch, capsys) -> None:
    """A run stopped after its step-2 checkpoint and started again ends bit for bit where an uninterrupted
    run ends (same seed: same initialisation and data order; the checkpoint holds the optimizer too)."""
    target, data = setup
    args = ("--steps", "4", "--eval-prompts", "0", *DRAFT)
    assert cli_main(train_args("draft", target, data, tmp_path / "whole", *args)) == 0
    batches = FeatureStore.batches

    def stop_at_step_3(self, *a, **kw):
        for i, batch in enumerate(batches(self, *a, **kw)):
            if i == 2:
                raise KeyboardInterrupt  # like Ctrl-C during step 3
            yield batch

    monkeypatch.setattr(FeatureStore, "batches", stop_at_step_3)
    assert cli_main(train_args("draft", target, data, tmp_path / "stopped", *args)) == 130  # Ctrl-C's exit code
    assert "interrupted: specdecode train stopped (Ctrl-C)" in capsys.readouterr().err
    assert not (tmp_path / "stopped" / "model.safetensors").exists()
    monkeypatch.setattr(FeatureStore, "batches", batches)
    capsys.readouterr()
    assert cli_main(train_args("draft", target, data, tmp_path / "stopped", *args)) == 0
    assert "resuming from step 2" in capsys.readouterr().err
    whole, resumed = (tmp_path / name / "model.safetensors" for name in ("whole", "stopped"))
    assert resumed.read_bytes() == whole.read_bytes()


def test_bad_input(setup, tmp_path, capsys) -> None:
    target, data = setup
    cases = [
        (train_args("draft", target, tmp_path / "missing", tmp_path / "a"), "not found"),
        (train_args("draft", target, data, tmp_path / "b", "--layers", "0"), "--layers"),
        (train_args("draft", target, data, tmp_path / "c", "--hidden", "30", "--heads", "4"), "divisible"),
        (train_args("draft", tmp_path / "no-model", data, tmp_path / "d"), "not found"),
    ]
    for argv, message in cases:
        assert cli_main(argv) == 2, argv
        assert message in capsys.readouterr().err
    # answers written with another tokenizer (ids past this vocabulary) are refused
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"tokens": [1, 2, 3, 5000, 4], "prompt_len": 2}) + "\n" for _ in range(4)))
    argv = train_args("draft", target, data, tmp_path / "e", "--samples-file", str(samples), "--steps", "1", *DRAFT)
    assert cli_main(argv) == 2
    assert "another tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()  # refused before anything was written


def test_draft_config() -> None:
    target = {"vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
              "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 576, "tie_word_embeddings": True}
    cfg = draft_config(target, layers=2, hidden=256)
    assert (cfg["vocab_size"], cfg["num_hidden_layers"], cfg["hidden_size"]) == (49152, 2, 256)
    assert (cfg["num_attention_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (4, 64, 704)
    assert cfg["rope_theta"] == 100000.0 and cfg["eos_token_id"] == 2 and cfg["tie_word_embeddings"]
    with pytest.raises(ValueError, match="even head size"):
        draft_config(target, layers=1, hidden=27, heads=9)


def test_embedding_starts_from_the_target() -> None:
    """Projected on the target's principal directions: the draft's embedding keeps the target's geometry."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(60, 3, generator=gen) @ torch.randn(3, 16, generator=gen)  # rank 3 (plus the mean)
    target += torch.randn(16, generator=gen)
    config = draft_config({"vocab_size": 60, "max_position_embeddings": 64}, layers=1, hidden=8, heads=2)
    model = new_draft(config, seed=0)
    before = model.get_input_embeddings().weight.detach().clone()
    init_embeddings(model, target)
    weight = model.get_input_embeddings().weight.detach()
    centred = target - target.mean(0)
    # 3 of the 8 dims carry all of the target's variance: distances between tokens are kept
    def dist(x: torch.Tensor) -> torch.Tensor:
        return torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")

    projected = target @ torch.linalg.svd(centred, full_matrices=False)[2][:8].T
    scale = float(before.std()) / float(projected.std())  # brought to a fresh embedding's scale
    torch.testing.assert_close(dist(weight[:, :3]), scale * dist(centred), rtol=1e-4, atol=1e-6)
    assert float(weight.std()) == pytest.approx(float(before.std()), rel=0.05)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied: the output layer starts from it too
    assert not torch.equal(weight, before)
    with pytest.raises(ValueError, match="rows"):
        init_embeddings(model, target[:50])


def test_engine_distillation_answers_as_the_loaded_target_does_one_request_at_a_time(setup) -> None:
    """specdecode's engine answers a batch of prompts (of several lengths, some stopping early) exactly as plain
    decoding of each alone, the stop token kept; the time budget keeps only whole batches."""
    import specdecode
    from specdecode.training.data import engine_distill

    target, _ = setup
    llm = specdecode.load(target, dtype="float64")
    prompts = [llm.encode(text, chat=True) for text in CORPUS[:5]]
    samples = engine_distill(llm, prompts, max_new_tokens=12, batch_size=2)
    assert [s.tokens[: s.prompt_len] for s in samples] == prompts
    for prompt, sample in zip(prompts, samples, strict=True):
        alone = llm.generate(prompt, method="none", max_new_tokens=12)
        assert sample.tokens[sample.prompt_len :] == list(alone.token_ids)
    assert engine_distill(llm, prompts, max_new_tokens=12, batch_size=2, seconds=0.0) == []


def test_interrupted_self_distillation_answers_only_the_rest(setup, tmp_path, monkeypatch, capsys) -> None:
    """--distill-only stops after the answers; the answers are kept batch by batch as they come, so a run stopped
    after its first batch answers only the prompts left when started again, and its samples.jsonl is the one an
    uninterrupted run writes, byte for byte. So does a run that ended (a time budget) when asked again."""
    import specdecode.training.common as common

    target, data = setup
    args = ("--distill-only", "--gen-batch", "3", *DRAFT)
    assert cli_main(train_args("draft", target, data, tmp_path / "whole", *args)) == 0
    assert "8 answers in" in capsys.readouterr().err
    assert not (tmp_path / "whole" / "model.safetensors").exists()  # answers only
    real = common.engine_distill
    answered: list[int] = []

    def stopped_after_one_batch(llm, prompts, *, on_batch, **kw):
        def once(batch):
            on_batch(batch)
            raise KeyboardInterrupt  # like Ctrl-C after the first batch

        return real(llm, prompts, on_batch=once, **kw)

    def counting(llm, prompts, **kw):
        answered.append(len(prompts))
        return real(llm, prompts, **kw)

    monkeypatch.setattr(common, "engine_distill", stopped_after_one_batch)
    stopped = tmp_path / "stopped"
    assert cli_main(train_args("draft", target, data, stopped, *args)) == 130
    partial = stopped / "work" / "samples.partial.jsonl"
    assert len(partial.read_text().splitlines()) == 3 and not (stopped / "work" / "samples.jsonl").exists()
    with partial.open("a") as f:
        f.write('{"tokens": [1, 2')  # a line the interruption cut short
    monkeypatch.setattr(common, "engine_distill", counting)
    capsys.readouterr()
    assert cli_main(train_args("draft", target, data, stopped, *args)) == 0
    assert "resuming self-distillation: 3 answers kept" in capsys.readouterr().err
    assert answered == [5] and not partial.exists()
    whole = (tmp_path / "whole" / "work" / "samples.jsonl").read_bytes()
    assert (stopped / "work" / "samples.jsonl").read_bytes() == whole

    # a budgeted run that ended (samples.jsonl written, 3 answered), asked again with --distill-only, answers the rest
    more = tmp_path / "more" / "work"
    more.mkdir(parents=True)
    (more / "samples.jsonl").write_text("".join(whole.decode().splitlines(keepends=True)[:3]))
    answered.clear()
    assert cli_main(train_args("draft", target, data, more.parent, *args)) == 0
    assert "resuming self-distillation: 3 answers kept" in capsys.readouterr().err
    assert answered == [5] and (more / "samples.jsonl").read_bytes() == whole
    assert not (more / "samples.partial.jsonl").exists()
