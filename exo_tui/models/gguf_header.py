"""A GGUF file's header, read directly: its metadata (keys and values) and its tensor directory,
parsed with ``struct`` over a memory map of the file; a tensor's bytes are a NumPy view of it.

gguf's own ``GGUFReader`` builds a NumPy view for every element of every array field: opening
SmolLM2 (a 49k-token vocabulary and 49k merges, as strings) took it 1.8 s, in the coordinator and
again in every node process. Here the strings are decoded straight from the mapped bytes (~0.1 s).
Little-endian GGUF versions 2 and 3, as llama.cpp writes them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types: the struct format of each scalar (8 is a string, 9 an array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF header this reader can parse (truncated, corrupt or unsupported)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # as stored: the innermost (contiguous) dimension first
    type_id: int  # GGMLQuantizationType
    offset: int  # from the start of the file
    n_bytes: int


class GGUFHeader:
    """The metadata (``fields``: key -> value; arrays of numbers as NumPy arrays, of strings as
    lists) and tensors (``tensors``: name -> :class:`TensorEntry`) of a GGUF file."""

    def release_pages(self, entry: TensorEntry | None = None) -> None:
        """Let go of the file's pages this process has read (the tensors' bytes once a backend has
        its own form of them), or only ``entry``'s: they leave this process's resident memory, not
        the page cache, and come back from there if read again (the map is read-only: nothing is
        lost). Where the platform cannot, nothing happens."""
        import mmap

        raw = getattr(self._map, "_mmap", None)
        if raw is None or not hasattr(raw, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        if entry is None:
            raw.madvise(mmap.MADV_DONTNEED)
            return
        self._release(raw, entry.offset, entry.n_bytes)

    def release_view(self, view: np.ndarray) -> None:
        """:meth:`release_pages` for the bytes under ``view`` (contiguous, of this file's map):
        a backend that reads a tensor a few rows at a time lets each go once read."""
        import mmap

        raw = getattr(self._map, "_mmap", None)
        if raw is None or not hasattr(raw, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        offset = view.ctypes.data - self._map.ctypes.data
        if view.flags.c_contiguous and 0 <= offset <= len(raw) - view.nbytes:
            self._release(raw, offset, view.nbytes)

    @staticmethod
    def _release(raw: Any, offset: int, n_bytes: int) -> None:  # noqa: ANN401 - an mmap.mmap
        import mmap

        start = offset // mmap.PAGESIZE * mmap.PAGESIZE  # the page it starts in: read-only, it is read again if needed
        end = min(len(raw), offset + n_bytes)
        if end > start:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, mode="r")
        self._buf = self._map.data
        self._pos = 0
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, TensorEntry] = {}
        if self._take("<I") != 0x46554747:  # b"GGUF"
            raise GGUFFormatError("it does not start with b'GGUF'")
        version = self._take("<I")
        if version not in VERSIONS:
            if version & 0xFFFF == 0:
                raise GGUFFormatError("it is a big-endian GGUF: convert it again for a little-endian machine")
            raise GGUFFormatError(f"it is GGUF version {version}; exo-tui reads versions 2 and 3")
        n_tensors, n_fields = self._take("<Q"), self._take("<Q")
        self._need(n_fields * 13 + n_tensors * 24, "its counts of fields and tensors exceed the file")
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._take("<I"))
        entries = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._take("<I")
            if n_dims > 8:
                raise GGUFFormatError(f"tensor {name!r} claims {n_dims} dimensions")
            dims = tuple(self._take("<Q") for _ in range(n_dims))
            entries.append((name, dims, self._take("<I"), self._take("<Q")))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
        self.data_offset = -(-self._pos // alignment) * alignment
        for name, dims, type_id, offset in entries:
            self.tensors[name] = TensorEntry(name, dims, type_id, self.data_offset + offset, _stored_bytes(name, dims, type_id))

    def tensor_bytes(self, entry: TensorEntry) -> np.ndarray:
        """The tensor's bytes as stored (uint8, a view of the mapped file)."""
        if entry.offset + entry.n_bytes > len(self._map):
            raise GGUFFormatError(f"tensor {entry.name} ends past the end of the file")
        return np.asarray(self._map[entry.offset : entry.offset + entry.n_bytes])

    # ------------------------------------------------------------------ parsing

    def _need(self, n: int, what: str = "it ends inside its header") -> None:
        if self._pos + n > len(self._buf):
            raise GGUFFormatError(what)

    def _take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._take("<Q")
        self._need(n)
        try:
            s = str(self._buf[self._pos : self._pos + n], "utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at byte {self._pos} is not UTF-8 ({exc.reason})") from exc
        self._pos += n
        return s

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._take(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown value type {kind} at byte {self._pos - 4}")
        item, count = self._take("<I"), self._take("<Q")
        if item in _DTYPES:
            dtype = np.dtype(_DTYPES[item])
            self._need(count * dtype.itemsize, f"an array of {count} values exceeds the file")
            values = np.frombuffer(self._buf, dtype, count, self._pos).copy()
            self._pos += count * dtype.itemsize
            return values
        self._need(count * 8, f"an array of {count} values exceeds the file")  # strings, arrays: 8 bytes at least
        if item == _STRING:
            return [self._string() for _ in range(count)]
        return [self._value(item) for _ in range(count)]


def _stored_bytes(name: str, dims: tuple[int, ...], type_id: int) -> int:
    import gguf

    try:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    except (ValueError, KeyError) as exc:
        raise GGUFFormatError(f"tensor {name!r} has unknown type {type_id}") from exc
    n = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if n % block:
        raise GGUFFormatError(f"tensor {name!r} has {n} elements, not whole blocks of {block}")
    return n // block * type_size


def type_name(type_id: int) -> str:
    """The GGML type's name (``Q4_1``, ``F32``, ...)."""
    import gguf

    return gguf.GGMLQuantizationType(type_id).name
