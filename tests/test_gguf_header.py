"""gguf_header.Header reads what the `gguf` package's reader reads (fields, tensor table, tensor data views), without
making a Python object of every vocabulary entry."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from specdecode.models.gguf_header import Header, NotFast  # noqa: E402


def write_file(path, vocab: int = 300) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_name("header test")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.5] * vocab)
    w.add_bool("test.flag", True)
    w.add_array("test.ints", [1, -2, 3])
    w.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((4, 64)).astype(np.float16))
    q8 = rng.integers(0, 256, (5, 2 * 34), dtype=np.uint8)
    w.add_tensor("c.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d.weight", rng.integers(0, 256, (2, 144), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_header_reads_what_the_package_reads(tmp_path):
    path = tmp_path / "h.gguf"
    write_file(path)
    ours, theirs = Header(path), gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert set(keys) <= set(ours.fields)
    for key in keys:
        assert ours.fields[key].contents() == theirs.fields[key].contents(), key
        assert len(ours.fields[key].data) == len(theirs.fields[key].data), key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[299] == "tok299"


def test_header_refuses_what_it_does_not_read(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(NotFast, match="version 7"):
        Header(path)
