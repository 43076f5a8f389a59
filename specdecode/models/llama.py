"""A Llama-family transformer (Llama, Mistral, Qwen2, SmolLM2) in plain PyTorch, and Gemma 3 through the options
of ModelConfig (per-layer sliding windows and RoPE bases, QK-norm, sandwich norms, GeGLU, scaled embeddings).

Built for speculative decoding: the forward takes a batch of new tokens that may form a token tree
(tree attention mask, explicit positions), writes their keys/values into a preallocated cache,
computes logits only where asked, and can return the hidden states of chosen layers.
Projections are fused (q|k|v and gate|up) so one step issues few large matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from . import native
from .cache import KV_KINDS, BatchKVCache, KVCache, kv_dtype, read_rows, store_rows
from .config import ModelConfig
from .linear import Linear
from .masks import attention_mask, padded_masks, ragged_mask
from .paged import PagedKVCache, PagedRow


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, n_selected, V]
    hidden: list[torch.Tensor]  # one [B, n, H] per requested layer
    greedy: list[int] | None = None  # each selected row's first maximum, where the native kernel found it


@dataclass
class BatchForwardOutput:
    logits: list[torch.Tensor]  # per row: [sizes[b], V], its real tokens only (no padding)
    hidden: list[list[torch.Tensor]]  # per row: one [sizes[b], H] per requested layer
    greedy: list[list[int]] | None = None  # per row: each token's first maximum (the native kernel's), or None


def rope_inv_freq(cfg: ModelConfig, sliding: bool = False) -> torch.Tensor:
    """RoPE frequencies; with per-layer types (Gemma 3), the sliding layers' own base and no scaling."""
    dim = cfg.head_dim
    local = sliding and cfg.layer_types is not None
    theta = (cfg.rope_local_theta or cfg.rope_theta) if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = None if local else cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":  # Llama 3.1: stretch low frequencies, keep high ones, blend in between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
        return torch.where(wavelen < old_len / high, inv_freq, out)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")


RopeTable = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [positions, head_dim]


ROPE_TABLE_START = 8192  # positions a first table covers at most (Llama 3.1's 131072 would take 134 MB at head dim 128)


def rope_table(cfg: ModelConfig, need: int, device: torch.device, dtype: torch.dtype, sliding: bool = False,
               table: RopeTable | None = None) -> RopeTable:
    """cos/sin for positions up to at least `need`, built in float64 then cast (a position's values do not depend on
    the table's size, so a grown table agrees with the old one bit for bit): `table` as it is where it still serves
    (long enough, this dtype, this device: a model moved after a forward must not index a table left behind); a
    first table covers the model's context up to ROPE_TABLE_START positions, a longer one doubles."""
    if table is not None and table[0].shape[0] >= need and table[0].dtype == dtype and table[0].device == device:
        return table
    grown = 2 * table[0].shape[0] if table is not None else 0
    size = max(need, min(cfg.max_position_embeddings, ROPE_TABLE_START), grown)
    freqs = torch.outer(torch.arange(size, dtype=torch.float64), rope_inv_freq(cfg, sliding))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.wqkv = Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        self.wo = Linear(q_dim, cfg.hidden_size, bias=False)
        self.split = (q_dim, kv_dim, kv_dim)
        self.scale = cfg.query_scale  # None: SDPA's head_dim ** -0.5
        if cfg.qk_norm:  # Gemma 3: each head's queries and keys normalized before RoPE
            self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, cache: KVCache, layer: int, start: int, mask) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = q.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = cache.write(layer, k, v, start)
        lib = kernels.native() if native_attention(q, cache) else None
        if lib is None and keys.dtype == torch.int8:  # int8 keys meet queries quantized as rows are (the kernel's)
            q = read_rows(store_rows(q, torch.int8), self.head_dim, q.dtype)
        if lib is None and keys.dtype != q.dtype:  # a float16 (widened exactly) or int8 cache's numbers for SDPA
            keys, values = read_rows(keys, self.head_dim, q.dtype), read_rows(values, self.head_dim, q.dtype)
        if lib is not None:  # a query's numbers independent of the forward's size: trees verify bit for bit
            return self.wo(self._native(lib, q, cache, layer, start, mask).view(b, n, -1))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.n_kv != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))

    def _native(self, lib, q: torch.Tensor, cache: KVCache, layer: int, start: int, mask) -> torch.Tensor:
        """kernels/block.c's attention over the cache (keys and values written): [n, heads * head_dim]."""
        n = q.shape[2]
        rows = q.transpose(1, 2).reshape(n, -1).contiguous()
        out = torch.empty_like(rows)
        full = None if mask is None else mask.to(torch.uint8).contiguous()  # [n, start + n]; None: causal
        kv = cache.kv[layer]
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        if lib.specdecode_attention(rows.data_ptr(), rows.shape[1], out.data_ptr(), out.shape[1], kv[0].data_ptr(),
                                    kv[1].data_ptr(), cache.max_len, start, n, None,
                                    None if full is None else full.data_ptr(), self.n_heads, self.n_kv,
                                    self.head_dim, scale, KV_KINDS[kv.dtype]):
            raise MemoryError("the native attention could not allocate its scratch memory")
        return out


def native_attention(q: torch.Tensor, cache) -> bool:
    """Whether the PyTorch block's attention runs in the native kernel: one sequence on the CPU in float32 (its cache
    float32, float16 or int8), where some layer keeps the blocks out of the native path (SDPA's numbers for a query
    depend on the others in the call)."""
    # a RowCache (one row of the server's batch) qualifies: the kernel reads one row's [kv_heads, max_len, head_dim]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[0] == 1 and isinstance(cache, KVCache)
            and cache.kv.dtype in KV_KINDS and cache.kv[0, 0, 0].is_contiguous()
            and not torch.is_grad_enabled())


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate | up
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"  # Gemma's GeGLU; otherwise SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        """index: the layer's place in the model (its attention type: sliding window or full)."""
        super().__init__()
        self.sliding = cfg.sliding(index)  # the block keeps it: a layer-skipped view drops blocks, not types
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if cfg.sandwich_norm:  # Gemma: the attention's and the MLP's outputs normalized before the residual add
            self.post_attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.post_mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        else:
            self.post_attn_norm = self.post_mlp_norm = None

    def forward(self, x, cos, sin, cache, layer, start, mask) -> torch.Tensor:
        h = self.attn(self.attn_norm(x), cos, sin, cache, layer, start, mask)
        x = x + (h if self.post_attn_norm is None else self.post_attn_norm(h))
        h = self.mlp(self.mlp_norm(x))
        return x + (h if self.post_mlp_norm is None else self.post_mlp_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # drawn as nn.Embedding draws it, except on the meta device (a checkpoint's skeleton, its weights read after):
        # there PyTorch's normal_ imports torch._dynamo (and sympy), a second's imports for numbers never used
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if table.device.type != "meta":
            nn.init.normal_(table)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self._rope_cache: dict[bool, RopeTable] | None = None  # by `sliding`
        self.kv_cache_dtype = "float16"  # the caches' elements where the model is float32 (see cache.kv_dtype)

    @property
    def dtype(self) -> torch.dtype:  # the final norm's: the embedding may be a quantized table
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def quantization(self) -> str:
        """How the weights are stored: a quantization ('int4-a8': int4 weights multiplied with int8 activations)
        or the float dtype ('float32')."""
        layer = self.layers[0].attn.wqkv if len(self.layers) else self.lm_head
        return getattr(layer, "quantization", str(self.dtype).removeprefix("torch."))

    @property
    def native_kernels(self) -> bool:
        """Whether its forwards run the native kernels (on the CPU in float32, where they built)."""
        return self.device.type == "cpu" and self.dtype == torch.float32 and kernels.native() is not None

    def weights_kind(self) -> str:
        """How the weights are stored and multiplied (forward costs differ by it): e.g. 'int4 native avx2'."""
        path = f"native {kernels.simd()} {kernels.source_key()}" if self.native_kernels else "torch"
        return f"{self.quantization} {path}"

    @property
    def kv_dtype(self) -> torch.dtype:
        """Its caches' element type: for a float32 model float16 unless kv_cache_dtype says "float32" or "int8"; the
        model's dtype otherwise (cache.kv_dtype)."""
        return kv_dtype(self.dtype, self.kv_cache_dtype)

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache:
        cfg = self.config
        return KVCache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len,
            batch_size=batch_size, dtype=self.kv_dtype, device=self.device,
        )

    def rope(self, positions: torch.Tensor, sliding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the given positions (of the sliding or the full layers), from a table kept (`rope_table`)."""
        cos, sin = self._rope_table(int(positions.max()) + 1, sliding)
        return cos[positions], sin[positions]

    def rope_span(self, start: int, n: int, sliding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope` of positions start..start + n - 1: views of the table (a chain's step, most steps: indexing with a
        positions tensor was three tensor operators a step, each slow right after the blocks' call)."""
        cos, sin = self._rope_table(start + n, sliding)
        return cos[start : start + n], sin[start : start + n]

    def _rope_table(self, need: int, sliding: bool) -> RopeTable:
        tables = self._rope_cache if self._rope_cache is not None else {}
        table = rope_table(self.config, need, self.device, self.dtype, sliding, tables.get(sliding))
        if table is not tables.get(sliding):
            self._rope_cache = {**tables, sliding: table}
        return table

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The blocks' input: embeddings, times Gemma's scale (rounded to float32, then the dtype, as Gemma does)."""
        x = self.embed(tokens)
        scale = self.config.embed_scale
        return x if scale is None else x * torch.tensor(scale, dtype=torch.float32).to(x.dtype)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from the last block's output: final norm, output layer, Gemma 2's softcap where set."""
        return self.softcap(self.lm_head(self.norm(x)))

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | PagedRow,
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        logits_at: slice | torch.Tensor | None = slice(None),
        hidden_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Run `tokens` [B, n] after the `cache.length` cached ones.

        positions: [n] absolute positions (default: consecutive after the cache).
        tree_mask: [n, n] bool, True where node i may attend to node j (itself and its ancestors);
            None means a causal chain.
        logits_at: which of the n positions need logits (None: none, e.g. during prefill).
        hidden_layers: layer indices (negative ones count from the end) whose outputs to return, in that order.
        """
        _, n = tokens.shape
        start = cache.length
        fused, greedy = None, None
        consecutive = positions is None  # a chain after the cache: RoPE reads views of its table
        num_layers = len(self.layers)
        if any(not -num_layers <= i < num_layers for i in hidden_layers):
            raise IndexError(f"hidden_layers {list(hidden_layers)} out of range for {num_layers} layers")
        wanted = [i % num_layers for i in hidden_layers]  # negative indices count from the last layer
        x = self.embed_tokens(tokens)
        states = {}
        native_run = self._native_blocks(tokens, cache)
        if native_run is not None:  # the same blocks in one native call
            lib, blocks = native_run
            if start + n > cache.max_len:
                raise ValueError(f"KV cache overflow: need {start + n} positions, cache holds {cache.max_len}")
            flat = x.reshape(n, -1).float().contiguous()
            types = blocks.types  # full first, then sliding
            masks = [self._native_masks(start, positions, tree_mask, t, n) for t in types]
            span = native.RowSpan(0, n, start, 0, masks, native.table_of(cache, 0))
            outputs = {i: torch.empty_like(flat) for i in wanted}
            # the logits in the same call where the kernel runs the output layer (a slice of rows; else all rows, then
            # the ones asked: every forward's logits come from the same code, whichever rows it wants)
            rows = None if blocks.head is None or logits_at is None else \
                logits_at if isinstance(logits_at, slice) and logits_at.step in (None, 1) else slice(None)
            ropes = [self.rope_span(start, n, t) if consecutive else self.rope(positions, t) for t in types]
            # each row's greedy token read by the kernel, where the logits asked are the ones it computes
            found = None if rows is None or rows is not logits_at else self._kernel_greedy(len(range(*rows.indices(n))))
            fused = blocks.run(lib, flat, cache.kv, [span], ropes, self.config, outputs, rows, found)
            greedy = None if found is None else found.tolist()
            states = {i: out.view(1, n, -1) for i, out in outputs.items()}
            x = flat.view(1, n, -1)
        else:
            if positions is None:
                positions = torch.arange(start, start + n, device=tokens.device)
            window = self.config.sliding_window
            # per attention type (all one type but in Gemma): RoPE and mask, a sliding layer's mask with its window
            views = {sliding: (*self.rope(positions, sliding),
                               attention_mask(start, positions, tree_mask, window if sliding else None, self.device))
                     for sliding in {layer.sliding for layer in self.layers}}
            for i, layer in enumerate(self.layers):
                cos, sin, mask = views[layer.sliding]
                x = layer(x, cos, sin, cache, i, start, mask)
                if i in wanted:
                    states[i] = x
        cache.length = start + n
        logits = None
        if fused is not None:
            logits = self.softcap(fused if rows is logits_at else fused[logits_at])[None]
        elif logits_at is not None:
            logits = self.output_logits(x[:, logits_at])
        return ForwardOutput(logits, [states[i] for i in wanted], greedy)  # in the order requested

    def _kernel_greedy(self, rows: int) -> torch.Tensor | None:
        """Where the native kernel's output layer reads each of `rows` rows' greedy token (int32): not under a softcap,
        whose tanh may round distinct logits to one value and so move the first maximum."""
        return None if self.config.final_logit_softcap is not None else torch.empty(rows, dtype=torch.int32)

    def _native_masks(self, start: int, positions: torch.Tensor | None, tree_mask: torch.Tensor | None,
                      sliding: bool, n: int) -> native.Masks:
        """One attention type's masks for a sequence's n tokens in the native blocks (positions None: a chain after
        the `start` cached ones): the kernel reads the tree mask [n, n] itself; only a window that hides some key needs
        the mask over all keys [n, start + n]."""
        window = self.config.sliding_window if sliding else None
        if window is None or (start + n - 1 if positions is None else int(positions.max())) < window:
            return None if tree_mask is None else tree_mask.to(torch.uint8).contiguous(), None
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        return None, attention_mask(start, positions, tree_mask, window, self.device).to(torch.uint8).contiguous()

    def _native_blocks(self, tokens: torch.Tensor, cache):
        """(library, NativeBlocks) when this forward can run its blocks natively (models/native.py), else None."""
        if not native.applies(self, tokens, cache):
            return None
        return native.runner(self, self.layers, self.norm, self.lm_head)

    # --------------------------------------------------------------------------- ragged batches
    @torch.inference_mode()
    def forward_batch(
        self,
        tokens: torch.Tensor,
        cache: BatchKVCache | PagedKVCache,
        *,
        positions: torch.Tensor | None,
        sizes: list[int],
        tree_masks: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
        hidden_layers: Sequence[int] = (),
        prefill: list[int] | None = None,
    ) -> BatchForwardOutput:
        """Run a ragged batch: row b's first sizes[b] tokens of `tokens` [B, n] follow its own
        cache.lengths[b] cached ones (the rest of the row is padding, seen by no real token).

        positions: [B, n] absolute positions (padding: any valid position); None for one row that is a chain after
            its cached tokens.
        tree_masks: [B, n, n] bool, or per row [sizes[b], sizes[b]] or None (a causal chain): True where node i of
            a row may attend to node j of the same row; None: every row a chain.
            Afterwards cache.lengths[b] = old length + sizes[b], as `forward` does.
        hidden_layers: as in `forward`; returned per row, real tokens only.
        One row runs the single-sequence `forward` on the row in place (the native kernels on the CPU), so a lone
        request computes exactly what it computes in a batch of one.
        prefill: prompt tokens of the cache's next row (B) to cache in the same call, after its cached ones (no
            logits; the native blocks only: see `carries_prefill`).
        """
        b, n = tokens.shape
        device = self.device
        if positions is None and b > 1:
            raise ValueError("a batch of several rows needs their positions")
        if prefill:
            run = self._native_blocks(tokens, cache)
            if run is None:
                raise ValueError("a prefill chunk rides along only in the native blocks (see carries_prefill)")
            return self._native_batch(run, tokens, cache, positions, sizes, tree_masks, hidden_layers, prefill)
        if b == 1:
            m = sizes[0]
            mask = None if tree_masks is None else tree_masks[0]
            cache.reserve(1, cache.lengths[0] + m)
            out = self.forward(tokens[:, :m].to(device), cache.row(0),
                               positions=None if positions is None else positions[0, :m].to(device),
                               tree_mask=None if mask is None else mask[:m, :m], hidden_layers=hidden_layers)
            return BatchForwardOutput([out.logits[0]], [[h[0] for h in out.hidden]],
                                      None if out.greedy is None else [out.greedy])
        native_run = self._native_blocks(tokens, cache)
        if native_run is not None:  # every row's tokens through the native blocks: each computes what it would alone
            return self._native_batch(native_run, tokens, cache, positions, sizes, tree_masks, hidden_layers)
        if tree_masks is not None and not isinstance(tree_masks, torch.Tensor):
            tree_masks = padded_masks(tree_masks, sizes, n)
        starts = torch.tensor(cache.lengths[:b], dtype=torch.long, device=device)
        sizes_t = torch.tensor(sizes, dtype=torch.long, device=device)
        positions = positions.to(device)
        visible = cache.begin_step(starts, n)
        try:
            window = self.config.sliding_window
            views = {}
            for sliding in {layer.sliding for layer in self.layers}:
                cos, sin = self.rope(positions, sliding)
                views[sliding] = (cos.unsqueeze(1), sin.unsqueeze(1),  # [B, 1, n, D]: broadcast over heads
                                  ragged_mask(starts, sizes_t, positions, tree_masks, visible,
                                              window if sliding else None, device))
            wanted = [i % len(self.layers) for i in hidden_layers]
            states = {}
            x = self.embed_tokens(tokens.to(device))
            for i, layer in enumerate(self.layers):
                cos, sin, mask = views[layer.sliding]
                x = layer(x, cos, sin, cache, i, None, mask)
                if i in wanted:
                    states[i] = x
        finally:
            cache.end_step()
        for row, size in enumerate(sizes):
            cache.lengths[row] += size
        real = torch.arange(n, device=device)[None, :] < sizes_t[:, None]
        logits = self.output_logits(x[real])  # [sum(sizes), V]: padding gets no logits
        hidden = [[states[i][row, :size] for i in wanted] for row, size in enumerate(sizes)]
        return BatchForwardOutput(list(logits.split(sizes)), hidden)

    @torch.inference_mode()  # as forward_batch runs
    def carries_prefill(self, tokens: torch.Tensor, cache: BatchKVCache | PagedKVCache) -> bool:
        """Whether forward_batch can cache a prefill chunk in the same call (the native blocks run it)."""
        return self._native_blocks(tokens, cache) is not None

    def _native_batch(self, native_run, tokens: torch.Tensor, cache: BatchKVCache | PagedKVCache,
                      positions: torch.Tensor | None, sizes: list[int], tree_masks, hidden_layers: Sequence[int],
                      prefill: list[int] | None = None) -> BatchForwardOutput:
        """forward_batch in the native blocks: the rows' real tokens side by side (no padding), each row attending
        to its own cache row, then the prefill chunk of row B; every operation is row-invariant, so a row's
        numbers are those of the row alone."""
        lib, blocks = native_run
        b = len(sizes)
        starts = cache.lengths[:b]
        chunk = list(prefill or [])
        done = cache.lengths[b] if chunk else 0
        cache.reserve(b + bool(chunk), max([start + size for start, size in zip(starts, sizes, strict=True)]
                                           + [done + len(chunk)]))
        flat_tokens = torch.cat([tokens[i, :m] for i, m in enumerate(sizes)] + [torch.tensor(chunk, dtype=torch.long)])
        rows = [torch.arange(starts[0], starts[0] + sizes[0])] if positions is None else \
            [positions[i, :m] for i, m in enumerate(sizes)]  # None: one row, a chain after its cached tokens
        flat_positions = torch.cat([row.to(self.device) for row in rows]
                                   + [torch.arange(done, done + len(chunk), device=self.device)])
        x = self.embed_tokens(flat_tokens[None].to(self.device))[0].float().contiguous()
        types = blocks.types  # full first, then sliding
        spans, first = [], 0
        for i, (start, m) in enumerate(zip(starts, sizes, strict=True)):
            mask = None if tree_masks is None else tree_masks[i]
            mask = None if mask is None else mask[:m, :m]
            pos = flat_positions[first : first + m]
            masks = [self._native_masks(start, pos, mask, t, m) for t in types]
            spans.append(native.RowSpan(first, m, start, i, masks, native.table_of(cache, i)))
            first += m
        if chunk:  # a prompt's next tokens: a causal chain after its cached ones
            pos = flat_positions[first:]
            spans.append(native.RowSpan(first, len(chunk), done, b,
                                        [self._native_masks(done, pos, None, t, len(chunk)) for t in types],
                                        native.table_of(cache, b)))
        wanted = [i % len(self.layers) for i in hidden_layers]
        outputs = {i: torch.empty_like(x) for i in wanted}
        found = None if blocks.head is None else self._kernel_greedy(first)
        fused = blocks.run(lib, x, cache.kv, spans, [self.rope(flat_positions, t) for t in types], self.config, outputs,
                           None if blocks.head is None else slice(0, first), found)
        for i, m in enumerate(sizes):
            cache.lengths[i] += m
        if chunk:
            cache.lengths[b] += len(chunk)
        # the rows' tokens only: a prefill needs none
        logits = self.output_logits(x[:first]) if fused is None else self.softcap(fused)
        hidden = [[outputs[layer][span.first : span.first + span.n] for layer in wanted] for span in spans[:b]]
        greedy = None
        if found is not None:  # per row, its tokens' greedy ones
            every = found.tolist()
            greedy = [every[span.first : span.first + span.n] for span in spans[:b]]
        return BatchForwardOutput(list(logits.split(sizes)), hidden, greedy)
