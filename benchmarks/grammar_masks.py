"""What a structured-output token mask costs on this CPU: llguidance (our grammar engine) beside xgrammar, on the
default model's tokenizer, for a JSON schema and a regex, walking a valid text token by token.

    python benchmarks/grammar_masks.py > benchmarks/results/grammar-masks.md

xgrammar is optional (`pip install --no-deps xgrammar apache-tvm-ffi`: its wheel asks for triton, which a CPU
does not need); without it only llguidance's row is printed. Median and max over the text's tokens, each mask
timed alone (a first mask pays for lazy set-up: the max).
"""

from __future__ import annotations

import importlib.util
import json
import platform
import statistics
import time

from transformers import AutoTokenizer

from specdecode.models.loading import resolve

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
JSON_TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines", "notes"]})
REGEX, REGEX_TEXT = r"[A-Z][a-z]+ [0-9]{4}-[0-9]{2}-[0-9]{2}", "December 1815-12-10"


def llguidance_times(tokenizer, vocab: int, grammar_of, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - started
    matcher = llguidance.LLMatcher(lltok, grammar_of(llguidance.LLMatcher))
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - started)
        assert matcher.consume_token(token), matcher.get_error()
    return setup, times


def xgrammar_times(tokenizer, vocab: int, compile_of, ids: list[int]) -> tuple[float, list[float]]:
    import xgrammar

    started = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    setup = time.perf_counter() - started
    matcher = xgrammar.GrammarMatcher(compile_of(compiler))
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - started)
        assert matcher.accept_token(token)
    return setup, times


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(resolve(MODEL, weights=False)))
    vocab = 49152
    cases = {
        "json schema": (JSON_TEXT, lambda m: m.grammar_from_json_schema(json.dumps(SCHEMA)),
                        lambda c: c.compile_json_schema(json.dumps(SCHEMA))),
        "regex": (REGEX_TEXT, lambda m: m.grammar_from_regex(REGEX), lambda c: c.compile_regex(REGEX)),
    }
    engines = {"llguidance": llguidance_times}
    if importlib.util.find_spec("xgrammar") is not None:
        engines["xgrammar"] = xgrammar_times
    print(f"# Token-mask cost on the CPU ({platform.processor() or platform.machine()}), {MODEL}'s tokenizer\n")
    print("| engine | grammar | tokens | tokenizer set-up (s) | mask median (us) | mask max (us) |")
    print("|---|---|---:|---:|---:|---:|")
    for name, run in engines.items():
        for case, (text, llg, xgr) in cases.items():
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            setup, times = run(tokenizer, vocab, llg if name == "llguidance" else xgr, ids)
            print(f"| {name} | {case} | {len(ids)} | {setup:.2f} | {statistics.median(times) * 1e6:.0f} "
                  f"| {max(times) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
