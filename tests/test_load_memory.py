"""Loading a GGUF file without holding it twice: the file's pages leave the process's memory map as each tensor is
converted (gguf_file.release), a large matrix converts a few rows at a time (loading._from_gguf_rows) into the same
weights as at once, and a load's peak resident memory stays near the weights' size."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from specdecode.models import loading  # noqa: E402
from specdecode.models.gguf_file import release  # noqa: E402
from specdecode.models.quant import GGUF_BLOCKS, K_QUANTS, QuantLinear  # noqa: E402


def rss_file_kib() -> int:
    """This process's resident file-backed pages (RssFile), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


def write_raw(path: Path, name: str, kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A GGUF file holding one `kind` matrix of random valid blocks; returns its bytes [rows, row bytes]."""
    qtype = gguf.GGMLQuantizationType[kind]
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    scale_at = {"Q6_K": 208, "Q3_K": 108}.get(kind, 0)  # the float16 d: small and finite
    raw[..., scale_at:scale_at + 2] = np.full((rows, cols // per, 1), 1e-3, np.float16).view(np.uint8)
    if kind in ("Q4_1", "Q4_K", "Q5_K", "Q5_1"):
        raw[..., 2:4] = np.full((rows, cols // per, 1), 1e-3, np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raw


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_release_drops_a_tensors_pages_from_the_map(tmp_path):
    path = tmp_path / "one.gguf"
    write_raw(path, "w.weight", "Q8_0", 4096, 1024)  # 4.25 MiB
    t = gguf.GGUFReader(str(path)).tensors[0]
    before = rss_file_kib()
    assert int(t.data.astype(np.int64).sum()) >= 0  # every page read: mapped into this process
    touched = rss_file_kib() - before
    assert touched > 3 * 1024, f"reading the tensor mapped only {touched} KiB"
    release(t)
    left = rss_file_kib() - before
    assert left < touched / 4, f"{left} of {touched} KiB still mapped after release"
    assert int(t.data[:7].astype(np.int64).sum()) >= 0  # still readable: the pages map back from the page cache


def test_release_ignores_arrays_not_mapped():
    release(np.zeros((4, 34), np.uint8))  # nothing to drop, no error


@pytest.mark.parametrize("width", [0, 8, 16])
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_rows_converted_a_few_at_a_time_equal_all_at_once(tmp_path, monkeypatch, kind, width):
    """Chunks of 5 rows (or one tile's: 8, 16), the last one short, and with `width` tiled chunk by chunk: the same
    buffers as the whole tensor converted (and tiled) at once, the same outputs."""
    raw = write_raw(tmp_path / f"{kind}.gguf", "w.weight", kind, 37, 512, seed=1)
    monkeypatch.setattr(loading, "CHUNK_BYTES", raw.shape[1] * 5)
    chunked, whole = loading._from_gguf_rows(raw, kind, width), QuantLinear.from_gguf(raw, kind)
    if width:
        whole.tile(width)
    assert (chunked.kind, chunked.act8, chunked.tiled, chunked.out_features) == \
        (whole.kind, kind in K_QUANTS, whole.tiled, whole.out_features) == (whole.kind, kind in K_QUANTS, width, 37)
    for name in ("qs", "d", "m"):
        a, b = getattr(chunked, name), getattr(whole, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert kind in K_QUANTS or kind in GGUF_BLOCKS
    chunked.act8 = whole.act8 = True
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(chunked(x), whole(x))


PEAK_SCRIPT = """
import gc, json, sys
from pathlib import Path
import torch
from specdecode.models import loading
from specdecode.models.loading import load_gguf
loading.CHUNK_BYTES = 1 << 20  # the chunked conversion at this small file's scale
def mib(key):
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return int(line.split()[1]) / 1024
from specdecode.models.quant import trim_heap
path = Path(sys.argv[1])
model = load_gguf(path, path.parent, torch.float32, act8=True)  # a first load: code and libraries in memory
del model
gc.collect()
trim_heap()
Path('/proc/self/clear_refs').write_text('5')  # VmHWM from here on (Linux 4.0+)
before = mib('VmRSS')
model = load_gguf(path, path.parent, torch.float32, act8=True)
gc.collect()
print(json.dumps({'before': before, 'hwm': mib('VmHWM'), 'rss': mib('VmRSS')}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_loads_peak_memory_stays_near_the_files_size(tmp_path):
    """A Q4_K_M-like Llama file of ~52 MiB loads, in a fresh process (after a first load of it: code and libraries
    in memory), with its peak resident memory under the file's size plus 60%: the file's pages released as they are
    converted (else they stay mapped: 2x at the end), fused layers replacing their parts one layer at a time (else
    ~1.9x), large matrices converted in chunks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from llamacpp_files import Shape, rule_mix, write_synthetic

    shape = Shape("peak", 2048, 2, 4096, 16, 4, 4096)
    file = write_synthetic(tmp_path / "peak.gguf", shape, rule_mix(shape, "Q4_K_M"), 15, progress=lambda s: None)
    gc.collect()
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(file)], capture_output=True, text=True, check=True,
                          cwd=str(Path(__file__).resolve().parents[1]))
    m = json.loads(done.stdout.strip().splitlines()[-1])
    size = file.stat().st_size / 2**20
    peak, kept = m["hwm"] - m["before"], m["rss"] - m["before"]
    assert kept < 1.25 * size + 16, f"{kept:.0f} MiB resident after loading a {size:.0f} MiB file"
    assert peak < 1.6 * size + 16, f"peak {peak:.0f} MiB while loading a {size:.0f} MiB file"
