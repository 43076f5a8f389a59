"""A GGUF file's header read quickly: its metadata and tensor table, the tensors as numpy views of one memory map.

The `gguf` package's reader makes a numpy array of every part of every metadata field: a 128k-token vocabulary is
~500k small arrays, seconds to build and ~250 MB while the reader lives. Loading weights needs the scalars and the
tensor table only, so this reader parses those, counts string arrays (the vocabulary, the merges) without making
them, and reads other arrays whole. It offers what gguf_file uses of the package's reader: `fields[key].contents()`
(and `len(fields[key].data)`), and `tensors` with the package's name, tensor_type, shape, n_elements, n_bytes,
data_offset and data (the same dtypes and shapes: float types as their numpy dtype, the rest as bytes [rows, row
bytes]). The GGUF layout (version 2 and 3, little-endian) is llama.cpp's published format (docs/gguf.md of ggml).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = 0x46554747  # "GGUF" little-endian
# GGUF value types: struct format of the scalar ones (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
FLOAT_ITEMS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


class NotFast(ValueError):
    """The file is not one this reader handles (big-endian, another version): the package's reader will."""


@dataclass
class Field:
    value: Any = None
    count: int = 0  # a string array's length (its items read only if asked for)
    strings_at: int = -1  # where a string array's items start
    source: Any = None  # the file's bytes, for a string array

    @property
    def data(self) -> range:
        return range(self.count if self.strings_at >= 0 else len(self.value) if isinstance(self.value, list) else 1)

    def contents(self) -> Any:
        if self.strings_at >= 0 and self.value is None:
            values, at = [], self.strings_at
            for _ in range(self.count):
                (n,) = struct.unpack_from("<Q", self.source, at)
                values.append(bytes(self.source[at + 8:at + 8 + n]).decode("utf-8"))
                at += 8 + n
            self.value = values
        return self.value


@dataclass
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's order (the row length first)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class Header:
    """fields and tensors of a GGUF file (see the module's docstring); raises NotFast where it cannot read it."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data)
        self._buf, self._at = buf, 0
        magic, version = self._unpack("<II")
        if magic != MAGIC or version not in (2, 3):
            raise NotFast(f"not a little-endian GGUF v2/v3 file (magic {magic:#x}, version {version})")
        n_tensors, n_kv = self._unpack("<QQ")
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        align_field = self.fields.get("general.alignment")
        align = int(align_field.value) if align_field is not None else 32
        start = -(-self._at // align) * align
        self.tensors: list[Tensor] = []
        for name, dims, kind, offset in infos:
            qtype = gguf.GGMLQuantizationType(kind)
            n = int(np.prod(dims))
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = n * size // block
            np_dims = tuple(reversed(dims))
            at = start + offset
            if qtype.name in FLOAT_ITEMS:
                data = self.data[at:at + n_bytes].view(FLOAT_ITEMS[qtype.name]).reshape(np_dims)
            else:
                data = self.data[at:at + n_bytes].reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
            self.tensors.append(Tensor(name, qtype, np.array(dims, np.uint64), n, n_bytes, at, data))
        del self._buf

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._at)
        self._at += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        text = bytes(self._buf[self._at:self._at + n]).decode("utf-8")
        self._at += n
        return text

    def _value(self, kind: int) -> Field:
        if kind in SCALARS:
            return Field(self._unpack("<" + SCALARS[kind])[0])
        if kind == STRING:
            return Field(self._string())
        if kind != ARRAY:
            raise NotFast(f"unknown GGUF value type {kind}")
        item, n = self._unpack("<IQ")
        if item in NUMPY:  # numbers: read whole
            size = np.dtype(NUMPY[item]).itemsize
            values = np.frombuffer(self._buf, NUMPY[item], n, self._at).tolist()
            self._at += n * size
            return Field(values)
        if item == STRING:  # counted and skipped (a vocabulary): never made into Python strings here
            first = self._at
            for _ in range(n):
                (length,) = struct.unpack_from("<Q", self._buf, self._at)
                self._at += 8 + length
            return Field(None, n, first, self.data)
        raise NotFast(f"GGUF arrays of type {item} are not read here")
