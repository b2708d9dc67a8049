"""Read a GGUF file: metadata as plain Python values and each tensor's raw bytes as a view into the mapped file.

Written here rather than using ``gguf.GGUFReader``: that reader builds numpy views for every vocabulary string
and takes ~4 s on a 49k-token vocabulary; this one takes ~0.1 s. Truncation is detected up front: every tensor
must end inside the file.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidModel

# ggml type id -> (name, elements per block, bytes per block) for the common types; others come from ``gguf``.
_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
}


@dataclass
class GgufTensor:
    name: str
    kind: str             # ggml type name, e.g. "Q4_1"
    type_id: int
    shape: list[int]      # row-major (PyTorch/MLX) order: GGUF lists dims innermost first
    data: np.ndarray      # raw bytes (uint8), a view into the mapped file


@dataclass
class GgufFile:
    meta: dict[str, Any]
    tensors: list[GgufTensor]


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
              12: "<f8"}


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise struct.error(f"the file ends at byte {self.size:,}")
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v if len(v) > 1 else v[0]

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > self.size:
            raise struct.error("string runs past the end of the file")
        s = self.buf[self.pos:self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def count(self, n: int, item_bytes: int) -> int:
        """A count read from the file, checked against the bytes left (a corrupt count must not allocate) and
        against MAX_ARRAY (a metadata array becomes a Python list, ~9 bytes of memory per byte of u8 data)."""
        if n * item_bytes > self.size - self.pos:
            raise struct.error(f"count {n} runs past the end of the file")
        if n > MAX_ARRAY:
            raise struct.error(f"a metadata array of {n:,} entries (more than {MAX_ARRAY:,}: no tokenizer has that "
                               "many)")
        return n

    def strings(self, n: int) -> list[str]:
        # the vocabulary and merges: ~100k strings, so this loop is kept tight (locals, no method calls)
        buf, pos, size, out = self.buf, self.pos, self.size, [None] * self.count(n, 8)
        length = struct.Struct("<Q").unpack_from
        for i in range(n):
            end = pos + 8 + length(buf, pos)[0]
            if end > size:
                raise struct.error("string runs past the end of the file")
            out[i] = buf[pos + 8:end].decode("utf-8", "replace")
            pos = end
        self.pos = pos
        return out

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, n = self.take("<IQ")
            if etype == 8:
                return self.strings(n)
            if etype == 9:
                return [self.value(etype) for _ in range(self.count(n, 12))]
            dt = np.dtype(_NP_SCALAR[etype])
            self.count(n, dt.itemsize)
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
            self.pos += n * dt.itemsize
            return arr.tolist()
        return self.take(_SCALAR[vtype])


MAX_ARRAY = 4_000_000  # metadata array entries: vocabularies and their merges stay below ~1M


def _type_info(type_id: int) -> tuple[str, int, int]:
    if type_id in _TYPES:
        return _TYPES[type_id]
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        return (f"type id {type_id}", 0, 0)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return (qtype.name, block, nbytes)


def read_gguf(path: Path) -> GgufFile:
    bad = f"{path.name}: not a readable GGUF file"
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: empty file
        raise InvalidModel(f"{bad} ({e})", hint="check the path; download the file again") from None
    cur = _Cursor(buf)
    try:
        magic, version, n_tensors, n_kv = cur.take("<4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise InvalidModel(f"{bad} (magic {magic!r}, version {version})", hint="only GGUF v2/v3 files import")
        meta = {}
        for _ in range(cur.count(n_kv, 12)):
            key = cur.string()
            meta[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(cur.count(n_tensors, 24)):
            name = cur.string()
            n_dims = cur.take("<I")
            if n_dims > 8:
                raise struct.error(f"tensor '{name}' has {n_dims} dimensions")
            dims = [cur.take("<Q") for _ in range(n_dims)]
            infos.append((name, dims, *cur.take("<IQ")))
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise struct.error(f"general.alignment is {align!r}")
    except (struct.error, KeyError, RecursionError) as e:
        raise InvalidModel(f"{bad}: header is truncated or corrupt ({e})", hint="download the file again") from None
    data_start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, type_id, offset in infos:
        kind, block, block_bytes = _type_info(type_id)
        n = math.prod(dims)
        if block and (n % block or (dims and dims[0] % block)):  # ggml blocks never cross a row
            raise InvalidModel(f"{bad}: tensor '{name}' rows of {dims[0] if dims else n} elements are not whole "
                               f"{kind} blocks of {block}")
        nbytes = n // block * block_bytes if block else 0
        if block and data_start + offset + nbytes > cur.size:
            raise InvalidModel(
                f"{path.name}: truncated GGUF file (tensor '{name}' ends at byte {data_start + offset + nbytes:,}, "
                f"the file has {cur.size:,})", hint="the download was probably interrupted; download it again")
        data = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=data_start + offset) if block else None
        tensors.append(GgufTensor(name, kind, type_id, [int(d) for d in reversed(dims)], data))
    return GgufFile(meta, tensors)
