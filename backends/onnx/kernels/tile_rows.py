"""Rows of a matrix read back out of ``QLinear``'s tiles (:mod:`backends.onnx.kernels.tiles`).

A model that ties its output head to its token embedding (Qwen2.5, Llama 3.2, Gemma 3, SmolLM2:
most small models) needs the matrix twice on a shard that holds both ends: as the head's tiles,
which the kernel reads, and as rows a token's embedding is looked up in. :class:`TileRows` looks
the rows up in the head's tiles, so such a shard holds the matrix once (Qwen2.5-0.5B's 152k x 896
Q8_0 embedding: 153 MB less).

Where each code's bits lie in a tile block depends on the format and on the precision the tiles
were laid out for; rather than a second description of the layouts, :func:`_code_map` finds them
once per layout by packing probe codes with :func:`~backends.onnx.kernels.tiles.code_bytes`,
the function that lays the tiles out.
"""

from __future__ import annotations

import functools

import numpy as np

from backends.onnx.kernels.tiles import BLOCK, K_HEADER, KQUANT, SUPER, TILE, code_bytes

PROBES = 32  # probe blocks packed at once (32 KB of codes)


@functools.cache
def _code_map(bits: int, xbits: int) -> tuple[tuple[np.ndarray, np.ndarray, int, int], ...]:
    """Where the codes of a tile block laid out for ``xbits`` lie, as runs of a code's bits that
    lie side by side in one byte (an 8-bit code's byte, a 4-bit line's nibble, a plane's bit):
    per run, the byte and the bit of that byte it starts at for each (column ``c``, ``k``),
    ``(32, 32)`` each, how many bits it has and the bit of the code it starts at. Found by packing,
    block by block, one code with one bit set."""
    n = TILE * BLOCK * bits
    byte: np.ndarray = np.empty(n, np.int64)
    bit: np.ndarray = np.empty(n, np.int64)
    for lo in range(0, n, PROBES):  # a few blocks at a time: no temporaries of megabytes, which leave
        hi = min(n, lo + PROBES)  # glibc's heap more fragmented than a node's unload can give back
        c, k, i = np.unravel_index(np.arange(lo, hi), (TILE, BLOCK, bits))
        probe = np.zeros((1, TILE, hi - lo, BLOCK), np.uint8)
        probe[0, c, np.arange(hi - lo), k] = np.left_shift(1, i).astype(np.uint8)
        laid = code_bytes(probe, bits, xbits)[0]  # (blocks, bytes)
        block, at = np.nonzero(laid)
        if not np.array_equal(block, np.arange(hi - lo)):
            raise AssertionError(f"a {bits}-bit code's bit is not one bit of its tile block (xbits {xbits})")
        byte[lo:hi], bit[lo:hi] = at, np.log2(laid[block, at]).astype(np.int64)
    byte, bit = byte.reshape(TILE, BLOCK, bits), bit.reshape(TILE, BLOCK, bits)
    runs: list[tuple[np.ndarray, np.ndarray, int, int]] = []
    first = 0
    for j in range(1, bits + 1):  # a run ends where the next bit of the code lies elsewhere, for any code
        if j == bits or not (np.all(byte[..., j] == byte[..., j - 1]) and np.all(bit[..., j] == bit[..., j - 1] + 1)):
            runs.append((byte[..., first], bit[..., first].astype(np.uint8), j - first, first))
            first = j
    return tuple(runs)


class TileRows:
    """Float32 rows of the matrix whose tiles are ``tiles`` (``pack``'s result for one matrix of
    GGUF type ``type_name`` and ``bits``-bit codes, laid out for ``xbits``), exactly its values
    (``QuantizedWeight.dequantize``'s): the blocks' codes, scales and biases read from the tiles
    of the rows asked for. Holds nothing of its own (``nbytes`` 0): ``tiles`` are the head's."""

    nbytes = 0

    def __init__(self, tiles: np.ndarray, type_name: str, bits: int, xbits: int, cols: int) -> None:
        self.tiles, self.type_name, self.bits, self.cols = tiles, type_name, bits, cols
        self.runs = _code_map(bits, xbits)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        t = len(ids)
        tile, col = (ids // TILE)[:, None, None], ids % TILE
        nb = self.cols // BLOCK
        kquant = self.type_name in KQUANT
        header = K_HEADER[self.type_name] if kquant else 128
        block = np.arange(nb)[None, :, None]
        if kquant:  # a super-block's header, then its 8 blocks' codes
            unit, at_block = block // 8, header + (block % 8) * ((self.tiles.shape[2] - header) // 8)
        else:  # a block's header, then its codes
            unit, at_block = block, header
        q = np.zeros((t, nb, BLOCK), np.uint8)
        for byte, shift, width, at in self.runs:  # each run's bits of every code, gathered from the tiles
            picked = self.tiles[tile, unit, at_block + byte[col][:, None, :]]
            q |= ((picked >> shift[col][:, None, :]) & ((1 << width) - 1)) << at
        scales, biases = self._groups(self.tiles[ids // TILE, :, :header], col)
        group = self.cols // scales.shape[1]
        out = q.reshape(t, -1, group).astype(np.float32)
        out *= scales[:, :, None]
        out += biases[:, :, None]
        return out.reshape(t, self.cols)

    def _groups(self, header: np.ndarray, col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's float32 scale and bias a group, ``(T, groups)``, from its tile's headers
        (a block's float16 pair, or a super-block's ``d``, ``dmin`` and integer scales and mins,
        as ``qlinear.c`` makes them)."""
        t, units, _ = header.shape
        rows = np.arange(t)[:, None]

        def half(lo: int) -> np.ndarray:  # the row's float16 at bytes lo .. lo + 64 (one a column), (T, units)
            return np.ascontiguousarray(header[:, :, lo : lo + 64]).view(np.float16)[rows, :, col[:, None]].reshape(t, units).astype(np.float32)

        def column_bytes(lo: int, n: int, dtype: type) -> np.ndarray:  # n bytes a column from lo, (T, units, n)
            a: np.ndarray = np.ascontiguousarray(header[:, :, lo : lo + 32 * n]).view(dtype).reshape(t, units, n, TILE)
            return a[np.arange(t), :, :, col].astype(np.float32)

        if self.type_name not in KQUANT:
            return half(0), half(64)
        d = half(0)[:, :, None]
        if self.type_name == "Q6_K":  # int8 scales a group of 16, the bias -32 times the scale
            scales = (d * column_bytes(64, SUPER // 16, np.int8)).reshape(t, -1)
            return scales, np.float32(-32.0) * scales
        dmin = half(64)[:, :, None]
        scales = (d * column_bytes(128, SUPER // BLOCK, np.uint8)).reshape(t, -1)
        return scales, -(dmin * column_bytes(384, SUPER // BLOCK, np.uint8)).reshape(t, -1)
