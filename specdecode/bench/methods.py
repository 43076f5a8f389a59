"""What a benchmark run compares: our methods, and as peers transformers' `generate` and llama.cpp (on the same
GGUF file), behind one call."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..api import LLM
from ..engine.assets import ASYNC_DRAFTS
from ..engine.loop import Generation


def output_hash(token_ids: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


@dataclass
class Method:
    """One column of the benchmark: a label and how to run a prompt with it."""

    label: str
    kind: str  # "ours" | "transformers" | "llama.cpp"
    method: str  # none | prompt-lookup | draft
    k: int | str = 0  # tokens guessed per step, or "auto"
    draft: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # e.g. async_draft=True (name+async), cascade (name+cascade)

    @property
    def remembers_outputs(self) -> bool:
        """Matches the global cache of earlier outputs (suffix; hybrid's suffix half): a second run of a prompt would
        find its own first answer there (the runner holds a prompt's outputs aside until its rounds end)."""
        return self.kind == "ours" and self.method in ("suffix", "hybrid")

    def run(self, runner: Runners, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> dict:
        if self.kind == "ours":
            return runner.ours(self, prompt_ids, max_new_tokens, temperature, seed)
        if self.kind == "llama.cpp":
            return runner.llama_cpp(self, prompt_ids, max_new_tokens, temperature, seed)
        return runner.transformers(self, prompt_ids, max_new_tokens, temperature, seed)


SPECULATIVE = ("prompt-lookup", "draft", "lookahead", "layer-skip", "hybrid", "eagle", "medusa", "quantized", "suffix")


PEERS = ("transformers", "llama.cpp")
MODIFIERS: dict[str, dict[str, Any]] = {"async": {"async_draft": True}, "cascade": {"cascade": "prompt-lookup"}}


def with_async(spec: str) -> str:
    """--async-draft: each model draft in a --methods list runs twice, side by side: as given and drafting ahead
    ('quantized@4' -> 'quantized@4,quantized+async@4')."""
    items = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        items.append(item)
        head, at, fixed_k = item.partition("@")
        name, colon, arg = head.partition(":")
        if name.split("+")[0] in ASYNC_DRAFTS and "async" not in name.split("+")[1:]:
            items.append(f"{name}+async{colon}{arg}{at}{fixed_k}")
    return ",".join(items)


def parse_methods(spec: str, ks: list[int | str], peers: bool | set[str] | list[str]) -> list[Method]:
    """'none,prompt-lookup,draft:PATH,hybrid[:PATH],lookahead@auto' -> methods; each without @K runs every K
    of the sweep `ks`; `none` always first, peers last (peers=True: transformers)."""
    peers = {"transformers"} if peers is True else set(peers or ())
    unknown = peers - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peer {sorted(unknown)[0]!r} in --peers; choose from {', '.join(PEERS)}")
    methods: list[Method] = [Method("none", "ours", "none")]
    drafts: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        item, _, fixed_k = item.partition("@")  # name@K: this K only, whatever the sweep
        name, _, arg = item.partition(":")
        name, *modifiers = name.split("+")  # name+async: drafts ahead; name+cascade: prompt lookup guesses for it
        unknown_modifiers = set(modifiers) - set(MODIFIERS)
        if unknown_modifiers:
            raise ValueError(f"unknown modifier +{sorted(unknown_modifiers)[0]} in --methods (+async, +cascade)")
        options = {option: value for m in modifiers for option, value in MODIFIERS[m].items()}
        if name == "none" and fixed_k:  # a second plain run, e.g. none@0: shows the measurement's noise
            methods.append(Method(f"none@k={fixed_k}", "ours", "none"))
            continue
        item_ks = ks
        if fixed_k:
            if fixed_k != "auto" and not fixed_k.isdigit():
                raise ValueError(f"bad K {fixed_k!r} in --methods: use name@K with K an integer or auto")
            item_ks = ["auto" if fixed_k == "auto" else int(fixed_k)]
        if name == "none":
            continue
        if name not in SPECULATIVE:
            raise ValueError(f"unknown method {name!r} in --methods (none, {', '.join(SPECULATIVE)}; draft:PATH)")
        if name in ("draft", "medusa") and not arg:
            raise ValueError(f"{name} needs a path: --methods {name}:PATH")
        if name == "draft":
            drafts.append(arg)
        taken = {m.label for m in methods}
        for k in item_ks:
            full = "+".join([name, *modifiers])
            label = full if len(ks) == 1 and not fixed_k else f"{full}@k={k}"
            if label in taken and arg:  # the same method with another draft (two heads side by side): name it
                label = label.replace(name, f"{name}:{Path(arg).name or arg}", 1)
            if label in taken:
                raise ValueError(f"{label} twice in --methods: give each column its own draft or K")
            methods.append(Method(label, "ours", name, k=k, draft=arg or None, options=options))
    if "llama.cpp" in peers:
        methods.append(Method("llama.cpp-plain", "llama.cpp", "none"))
        methods.append(Method("llama.cpp-prompt-lookup", "llama.cpp", "prompt-lookup", k=10))
    if "transformers" in peers:
        methods.append(Method("hf-plain", "transformers", "none"))
        fixed = [k for k in ks if isinstance(k, int)]  # transformers has no adaptive K for prompt lookup
        methods.append(Method("hf-prompt-lookup", "transformers", "prompt-lookup", k=max(fixed, default=4)))
        for d in drafts:
            methods.append(Method("hf-assisted", "transformers", "draft", draft=d))
    return methods


class Runners:
    """Holds the loaded models: ours, and transformers' own copy of the same checkpoint for the peers."""

    def __init__(self, llm: LLM, checkpoint_dir: str, need_peers: bool, llama_cpp_model: str | None = None,
                 context: int = 2048) -> None:
        self.llm = llm
        self._hf = None
        self._hf_drafts: dict[str, Any] = {}
        if need_peers:
            self._hf = self._load_hf(checkpoint_dir)
        self._llama_cpp = None
        if llama_cpp_model is not None:
            from .llamacpp import LlamaCppPeer

            self._llama_cpp = LlamaCppPeer(llama_cpp_model, llm.stop_token_ids, context)

    @staticmethod
    def _load_hf(path: str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def start(self, m: Method, prompt_ids: list[int], max_new_tokens: int, temperature: float,
              seed: int) -> Generation:
        """One of our requests, not yet run: the benchmark steps it alongside the other methods'."""
        return self.llm.start(prompt_ids, method=m.method, draft=m.draft, k=m.k, max_new_tokens=max_new_tokens,
                              temperature=temperature, seed=seed, **m.options)

    @staticmethod
    def record(gen: Generation, seconds: float, prefill_seconds: float | None = None) -> dict:
        s = gen.stats
        return {"new_tokens": s.new_tokens, "seconds": seconds, "prefill_seconds": prefill_seconds,
                "cached_tokens": s.cached_tokens,
                "drafted": s.drafted, "accepted": s.accepted, "target_forwards": s.target_forwards, "tau": s.tau,
                "estimated_speedup": s.estimated_speedup, "output_hash": output_hash(gen.new_tokens),
                **({"ahead_hits": s.ahead_hits, "ahead_steps": s.ahead_steps} if s.ahead_steps else {})}

    def ours(self, m: Method, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> dict:
        gen = self.start(m, prompt_ids, max_new_tokens, temperature, seed)
        for _ in gen:
            pass
        return self.record(gen, gen.stats.seconds)

    def peer_versions(self) -> dict[str, str]:
        import transformers

        out = {"transformers": transformers.__version__} if self._hf is not None else {}
        if self._llama_cpp is not None:
            out["llama-cpp-python"] = self._llama_cpp.version
        return out

    def llama_cpp(self, m: Method, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> dict:
        rec = self._llama_cpp.run(m.method, prompt_ids, max_new_tokens, temperature, seed)
        rec["output_hash"] = output_hash(rec.pop("token_ids"))
        return rec

    def transformers(self, m: Method, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                     seed: int) -> dict:
        from ..models import resolve

        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": sorted(self.llm.stop_token_ids),
                                  "pad_token_id": self.llm.tokenizer.pad_token_id}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if m.method == "prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = m.k
        elif m.method == "draft":
            assert m.draft is not None, "a draft method names its draft"
            path = str(resolve(m.draft))
            if path not in self._hf_drafts:
                self._hf_drafts[path] = self._load_hf(path)
            kwargs["assistant_model"] = self._hf_drafts[path]
        ids = torch.tensor([prompt_ids])
        # when every target forward ends, the prefill included: it yields the first token, as ours does
        calls: list[float] = []
        hook = self._hf.register_forward_hook(lambda *_: calls.append(time.perf_counter()))
        torch.manual_seed(seed)
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self._hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        finally:
            hook.remove()
        seconds = time.perf_counter() - started
        new = out[0, len(prompt_ids):].tolist()
        return {"new_tokens": len(new), "seconds": seconds, "prefill_seconds": calls[0] - started if calls else None,
                "drafted": None, "accepted": None,
                "target_forwards": len(calls), "tau": len(new) / len(calls) if calls else None,
                "output_hash": output_hash(new)}
