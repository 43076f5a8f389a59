"""llama.cpp as a peer (through llama-cpp-python, an optional extra: `pip install llama-cpp-python`, built for
the host CPU): the same GGUF file, the same prompt token ids, its plain decoding and its prompt lookup."""

from __future__ import annotations

import time

import torch

from ..models.loading import gguf_source

PROMPT_LOOKUP_TOKENS = 10  # llama-cpp-python's LlamaPromptLookupDecoding default


class LlamaCppPeer:
    def __init__(self, model: str, stop_token_ids: frozenset[int], context: int) -> None:
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as e:
            raise ValueError("--peers llama.cpp needs llama-cpp-python: `pip install llama-cpp-python` (it builds "
                             "llama.cpp for this CPU, a few minutes)") from e
        path = gguf_source(model)
        if path is None:
            raise ValueError(f"--peers llama.cpp runs GGUF files; {model!r} is not one (give a registry name or a "
                             ".gguf path)")
        # one batch holds the whole prompt: llama-cpp-python's draft path keeps logits for n_batch rows only and
        # fails on longer prompts
        context = min(context, 4096)
        options = dict(n_ctx=context, n_batch=context, n_threads=torch.get_num_threads(), verbose=False)
        self.models = {
            "none": llama_cpp.Llama(str(path), **options),
            "prompt-lookup": llama_cpp.Llama(
                str(path), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS), **options),
        }
        self.stop_token_ids = stop_token_ids
        self.version = llama_cpp.__version__

    def run(self, method: str, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> dict:
        llm = self.models[method]
        llm.reset()  # else the next run reuses the cached prompt and skips its prefill
        llm.set_seed(seed)
        sampling = dict(temp=0.0, top_k=1) if temperature == 0 else dict(temp=temperature, top_k=0)
        started = time.perf_counter()
        first = None
        new: list[int] = []
        for token in llm.generate(prompt_ids, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True,
                                  **sampling):
            if first is None:
                first = time.perf_counter() - started
            new.append(int(token))
            if token in self.stop_token_ids or len(new) >= max_new_tokens:
                break
        seconds = time.perf_counter() - started
        return {"new_tokens": len(new), "seconds": seconds, "prefill_seconds": first, "drafted": None,
                "accepted": None, "target_forwards": None, "tau": None, "token_ids": new}
