"""Reading GGUF files (llama.cpp's format): their config as an HF config dict, their tensors under HF names.

Architectures: llama, qwen2 (the Llama block) and gemma3. Tensors keep the file's layout but for two fixes that
make them the HF checkpoint's: llama.cpp permutes llama's q/k rows (interleaved RoPE pairs), and stores Gemma's
norm weights as 1 + w (HF: w, scaled by 1 + w at run time), so `dense` subtracts the 1 again, as transformers'
GGUF reader does.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "gemma3")

# the chat template of Google's Gemma 3 tokenizers (text only), for Gemma 3 GGUF files that carry none
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

BLOCK_NAMES = {  # GGUF block tensor -> HF name within model.layers.{i}.
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GEMMA3_BLOCK_NAMES = {  # Gemma's HF names: post_attention_layernorm is the norm on the attention's output
    **BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def reader(path: Path):
    """(reader, architecture) of a GGUF file this runtime can run."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})")
    return r, arch


def field(r, key: str, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def tensors(path: Path):
    """(HF name, gguf tensor, row order or None, norm shift) for every tensor of the file. The row order undoes
    llama.cpp's q/k row permutation; the shift is what `dense` subtracts (Gemma's norms: 1)."""
    r, arch = reader(path)
    n_heads = field(r, f"{arch}.attention.head_count")
    n_kv = field(r, f"{arch}.attention.head_count_kv", n_heads)
    names = GEMMA3_BLOCK_NAMES if arch == "gemma3" else BLOCK_NAMES
    for t in r.tensors:
        name, rows = t.name, None
        if name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in names:
                raise ValueError(f"{path.name}: GGUF tensor {name!r} is not supported (not a {arch} block tensor)")
            if arch == "llama" and kind in ("attn_q", "attn_k"):  # llama.cpp permutes only llama's q/k
                rows = _unpermute(torch.arange(int(t.shape[-1])), n_heads if kind == "attn_q" else n_kv)
            name = f"model.layers.{layer}.{names[kind]}.{suffix}"
        elif name in TOP_NAMES:
            name = TOP_NAMES[name]
        else:  # e.g. rope_freqs.weight: Llama 3.1 RoPE scaling, which this converter does not read yet
            raise ValueError(f"{path.name}: GGUF tensor {name!r} is not supported; use the HF checkpoint instead")
        shift = 1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        yield name, t, rows, shift


def dense(t, rows: torch.Tensor | None = None, shift: float = 0.0) -> torch.Tensor:
    """A GGUF tensor dequantized to float32, in HF's layout (see `tensors`)."""
    import gguf

    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
    w = (w if rows is None else w[rows]).contiguous()
    return w - shift if shift else w


def read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """GGUF -> (HF config dict, HF-named float32 state dict)."""
    return config(path), {name: dense(t, rows, shift) for name, t, rows, shift in tensors(path)}


def config(path: Path) -> dict:
    """The HF config of a GGUF file, from its metadata."""
    r, arch = reader(path)

    def get(key: str, default=None):
        return field(r, f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    n_kv = get("attention.head_count_kv", n_heads)
    hidden = get("embedding_length")
    names = {t.name for t in r.tensors}
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}[arch]],
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "vocab_size": get("vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": get("attention.key_length") or hidden // n_heads,
        "max_position_embeddings": get("context_length", 4096),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(r, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "gemma3":  # what llama.cpp fixes for Gemma 3: every 6th layer global, local RoPE base 10k
        cfg.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                   sliding_window=get("attention.sliding_window"), sliding_window_pattern=6,
                   rope_local_base_freq=10000.0,  # llama.cpp: the 27B (62 layers) scales queries by hidden / heads
                   query_pre_attn_scalar=hidden // n_heads if cfg["num_hidden_layers"] == 62 else cfg["head_dim"],
                   pad_token_id=field(r, "tokenizer.ggml.padding_token_id"))
        kind, factor = get("rope.scaling.type"), get("rope.scaling.factor")
        if kind not in (None, "none") and factor not in (None, 1.0):
            cfg["rope_scaling"] = {"rope_type": kind, "factor": float(factor)}
    return cfg
