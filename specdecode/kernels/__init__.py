"""Native kernels, compiled once per CPU at first use (a C compiler is all they need; gcc ships on our machines).

`native()` returns the loaded library, or None when it cannot be built here; callers then fall back to
PyTorch and this module logs one line saying so and why. The build is cached under the cache dir, keyed by
the source, the compiler and the CPU's flags, so a machine with other flags (AVX-512, AVX2 only, no AVX)
builds its own, and the build dispatches on those flags (kernels/simd.h): AVX2 + FMA + F16C, with AVX-VNNI or
AVX512-VNNI int8 dot products where present, plain C otherwise. SPECDECODE_NATIVE=0 turns the kernels off;
SPECDECODE_NATIVE=portable builds them for the baseline of the architecture (plain C: what a CPU without AVX2 runs,
and what its tests check); SPECDECODE_NATIVE=emulate-vnni builds the VNNI code path on a CPU without VNNI (tests).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch  # noqa: F401  (loaded first: its OpenMP runtime is the one the kernels share)

log = logging.getLogger("specdecode")
SOURCES = [Path(__file__).with_name(name)
           for name in ("qmatmul.c", "a8matmul.c", "kquants.c", "f16matmul.c", "attention.c", "attention_int8.c",
                        "block.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "kquants.h", "attention.h")]
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


def _target_flags() -> list[str]:
    mode = os.environ.get("SPECDECODE_NATIVE")
    if mode == "portable":
        return ["-march=x86-64"] if platform.machine() in ("x86_64", "AMD64") else []
    return ["-march=native", "-mtune=native", *(["-DSPECDECODE_EMULATE_VNNI"] if mode == "emulate-vnni" else [])]


SIMD_NAMES = {0: "scalar", 2: "avx2", 3: "avx2+avx-vnni", 4: "avx2+avx512-vnni", 5: "avx2+vnni-emulated"}
_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), or the machine name where /proc has none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")


def _build(cache_dir: Path, source_dir: Path | None = None) -> Path:
    """The library built from the kernels' sources (in `source_dir` where given: another revision's), cached by
    their hash, the flags, the compiler and the CPU."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    sources = SOURCES if source_dir is None else [source_dir / s.name for s in SOURCES]
    headers = HEADERS if source_dir is None else [source_dir / h.name for h in HEADERS]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    flags = [*_target_flags(), *FLAGS]
    key = hashlib.sha1(b"".join(s.read_bytes() for s in sources + headers) + " ".join(flags).encode() + version.encode()
                       + cpu_flags().encode()).hexdigest()[:16]
    lib = cache_dir / "kernels" / f"specdecode-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    log.warning("compiling the native kernels for this CPU (once, a few seconds)...")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        done = subprocess.run([cc, *flags, *map(str, sources), "-o", str(out), "-lm"], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-400:]}")
        out.replace(lib)
    log.info("compiled %s in %.1f s", lib.name, time.perf_counter() - started)
    return lib


def native() -> ctypes.CDLL | None:
    """The kernels' library, built on first use; None (and one log line) where it cannot be had."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib = None
        if os.environ.get("SPECDECODE_NATIVE", "1") == "0":
            reason = "SPECDECODE_NATIVE=0"
        else:
            try:
                from ..common.paths import default_cache_dir

                lib = ctypes.CDLL(str(_build(default_cache_dir())))
                _declare(lib)
                reason = ""
            except (OSError, RuntimeError) as e:
                lib, reason = None, str(e)
        if lib is None:
            log.warning("native quantized kernels unavailable (%s): quantized weights run through PyTorch, "
                        "dequantized per call (same model, several times slower)", reason)
        elif lib.specdecode_simd() == 0:
            log.warning("this CPU lacks AVX2/FMA/F16C: the quantized kernels run as plain C (correct, slower)")
        else:
            log.info("native kernels for this CPU: %s (int8 dot products by %s)", SIMD_NAMES[lib.specdecode_simd()],
                     "vpdpbusd" if lib.specdecode_simd() >= 3 else "vpmaddubsw + vpmaddwd")
        _state["lib"] = lib
        return lib


def source_key() -> str:
    """A short hash of the kernels' source: forward costs measured with other kernels are measured again."""
    return hashlib.sha1(b"".join(s.read_bytes() for s in SOURCES + HEADERS)).hexdigest()[:8]


def tile_width() -> int:
    """Outputs per tile the int8-activation kernel prefers here: 16 where it meets 16 at once (AVX-512), else 8."""
    lib = native()
    return 16 if lib is not None and lib.specdecode_tile_width() == 16 else 8


def simd() -> str:
    lib = native()
    return "none" if lib is None else SIMD_NAMES[lib.specdecode_simd()]


class Weight(ctypes.Structure):
    """A linear layer's weight as block.c reads it (kind: 0 float32, 1 int4, 2 int8, 3 float16, 4 bfloat16 (qs: the
    16-bit words [n_out, n_in]), 9 parts stacked (qs: an
    array of Weights ended by one with n_out 0), 10 + the int8-activation kernel's kind)."""

    _fields_ = [("kind", ctypes.c_int), ("n_out", ctypes.c_int), ("n_in", ctypes.c_int), ("qs", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """A block as block.c's specdecode_blocks reads it: its norms' weights (Gemma's QK and sandwich norms, or
    NULL), epsilon, four weights, the MLP's gate (gelu: 1 for tanh-GELU), the index of its View, and wide: 1 where
    q/k/v read the call's own inputs (EAGLE-3's layer) instead of the normed residual stream."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("eps", ctypes.c_float),
                *((name, ctypes.POINTER(Weight)) for name in ("wqkv", "wo", "w13", "w2")),
                *((name, ctypes.c_void_p) for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")),
                ("gelu", ctypes.c_int), ("view", ctypes.c_int), ("wide", ctypes.c_int)]


class View(ctypes.Structure):
    """One attention type's RoPE table for the call's tokens: cos, sin [n, head_dim]."""

    _fields_ = [("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]


class Span(ctypes.Structure):
    """One sequence's tokens in the call (a batch's row): first, n, start (tokens cached before), kv_offset (floats
    from a layer's keys to the row's), and per View the tree mask [n, n] (NULL: a chain) and the mask over all keys
    [n, start + n] (NULL: every cached key visible); table: the row's block table (int32; NULL: its keys contiguous at
    kv_offset)."""

    _fields_ = [("first", ctypes.c_int), ("n", ctypes.c_int), ("start", ctypes.c_int), ("kv_offset", ctypes.c_int64),
                ("masks", ctypes.c_void_p * 2), ("full_masks", ctypes.c_void_p * 2), ("table", ctypes.c_void_p)]


class Output(ctypes.Structure):
    """The final norm (weight, epsilon) and output layer block.c runs after the blocks, on rows first..first+n of x,
    into logits [n, n_out], and where `argmax` is set ([n] int32), each row's first maximum (specdecode_argmax)."""

    _fields_ = [("norm", ctypes.c_void_p), ("eps", ctypes.c_float), ("w", ctypes.POINTER(Weight)),
                ("first", ctypes.c_int), ("n", ctypes.c_int), ("logits", ctypes.c_void_p), ("argmax", ctypes.c_void_p)]


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.specdecode_q4_matmul.argtypes = [p, p, i, i, p, p, p, p, i]
    lib.specdecode_q8_matmul.argtypes = [p, i, i, p, p, p, i]
    lib.specdecode_f32_matmul.argtypes = [p, i, i, p, p, i]
    lib.specdecode_a8_matmul.argtypes = [i, p, i, i, p, p, p, p, i]
    lib.specdecode_a8_matmul.restype = i
    lib.specdecode_h_matmul.argtypes = [i, p, i, i, p, p, i]  # bf16, x, M, K, W's 16-bit words, y, N
    lib.specdecode_h_matmul.restype = None
    q = ctypes.c_int64
    lib.specdecode_blocks.argtypes = [p, i, i, ctypes.POINTER(Layer), i, p, q, q, i, i, ctypes.POINTER(View),
                                      ctypes.POINTER(Span), i, i, i, i, i, f, p, ctypes.POINTER(Output), q, p]
    lib.specdecode_blocks.restype = i
    lib.specdecode_attention.argtypes = [p, i, p, i, p, p, i, i, i, p, p, i, i, i, f, i]  # last: kv_kind
    lib.specdecode_attention.restype = i
    lib.specdecode_argmax.argtypes = [p, i]
    lib.specdecode_argmax.restype = i
    lib.specdecode_simd.restype = i
    lib.specdecode_tile_width.restype = i
    for fn in (lib.specdecode_q4_matmul, lib.specdecode_q8_matmul, lib.specdecode_f32_matmul):
        fn.restype = None


def reset() -> None:
    """Forget the loaded library (tests: build again, or take the fallback)."""
    with _lock:
        _state.clear()


__all__ = ["Layer", "Output", "Span", "View", "Weight", "native", "simd", "source_key", "cpu_flags", "reset",
           "tile_width"]
