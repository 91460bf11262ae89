"""exo-tui's own ONNX Runtime kernels, one library in the custom-op domain ``exo.tui``:
``QLinear`` (``qlinear.c``), a 4-, 5- or 8-bit matrix in GGUF's own blocks times float32 rows,
``Attention`` (``attention.c``), rotary causal attention over the in-place KV cache, and
``Experts`` (``experts.c``, :mod:`backends.onnx.kernels.experts`), a mixture of experts on QLinear's tiles.

``MatMulNBits`` has no float zero point on its fast path, so a Q4_1 matrix there costs a second,
float32 matmul of the input's block sums (see :mod:`backends.onnx.weights`) and float32 scales:
24 bytes per 32 weights read per step, against 20 here (float16 scale and bias beside the codes,
as the file has them), and three ops fewer per matrix; its float 8-bit path is slow, so a Q8_0
matrix there is two 4-bit passes (40 bytes per 32 weights, against 36 here), and a Q5_0 or Q5_1
one two passes and a correction (44.5 bytes, against 24 here: the codes' low 4 bits as Q4_1's,
their fifth bits in a plane as Q5_K's; the file's 22 and 24). The K-quants
(Q4_K, Q5_K, Q6_K) keep their super-blocks' float16 ``d`` (and ``dmin``) and small integer scales
(and mins) beside the codes, and the kernel makes each group's float32 scale and bias from them
as llama.cpp does: 4.625 bits a Q4_K weight (the file's 4.5; MatMulNBits' float32 scales and
correction take 6), 5.63 a Q5_K weight (the file's 5.5; MatMulNBits 11.1) and 6.56 a Q6_K weight
(the file's; MatMulNBits 14.25), their bits above the fourth in planes beside 4-bit lines. The blocks are
regrouped at load in tiles of 32 output columns (:mod:`backends.onnx.kernels.tiles`), so the kernel's vectors run along
the columns: each product is one multiply-add into a column's sum, a tile's codes are widened
once for up to 8 rows, and nothing is summed across vector lanes.

The library is compiled for this machine (``-march=native``) by the C compiler on first use and
kept in a cache folder keyed by its source, compiler and CPU. Before it is used it must agree
with NumPy on random data, on its own and inside an ONNX Runtime session; if there is no compiler,
or the build or that check fails, the backend keeps ``MatMulNBits`` and says why once.
``EXO_TUI_ONNX_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends import kquants
from backends.onnx.kernels.tiles import (  # noqa: F401  (the package's names for its callers)
    BLOCK,
    K_BLOCK_BYTES,
    K_HEADER,
    K_PLANES,
    KQUANT,
    SUPER,
    SUPER_BYTES,
    TILE,
    TILE_BLOCK_BYTES,
    kernel_format,
    op_attributes,
    pack,
    runs_on_kernel,
)
from backends.weights import BLOCK_TYPES, QuantizedWeight

log = logging.getLogger("exo_tui.backends.onnx")

HERE = Path(__file__).parent
SOURCES = [HERE / "register.c", HERE / "qlinear.c", HERE / "attention.c", HERE / "experts.c"]  # one library
HEADERS = [HERE / "ort.h", HERE / "half.h", HERE / "qlinear.h"]
DOMAIN = "exo.tui"
OP = "QLinear"
ATTENTION = "Attention"  # the cached, rotary, causal attention (attention.c), float32 caches
ATTENTION_F16 = "AttentionF16"  # the same on float16 caches
FLAG_SETS = (["-O3", "-march=native"], ["-O3", "-mcpu=native"], ["-O3"])


@dataclass(frozen=True)
class Library:
    path: str
    isa: str  # the instruction set it was built for: avx512, avx2 or c
    integer: bool = False  # whether it has the int16 and int8 precisions' integer products (AVX-512 VNNI or AVX2)

    @property
    def build(self) -> str:
        """Which build (of which source, by which compiler, for which CPU): a new kernel is
        another build, so timings taken on an older one are not reused."""
        return Path(self.path).stem


_enabled = True


def use(on: bool) -> None:
    """Turn exo-tui's kernels on (the default) or off for this process (a node's
    ``node.onnx.kernel``, ``EXO_TUI_ONNX_KERNEL``): off, shards run ``MatMulNBits`` and ONNX
    Runtime's attention only. Shards built afterwards follow it."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def library() -> Library | None:
    """The kernel built for this machine, or None (turned off, or it cannot be built or trusted:
    then logged once, with the reason)."""
    found = _library() if enabled() else None
    return found if isinstance(found, Library) else None


def unavailable() -> KernelUnavailable | None:
    """Why :func:`library` is None (None when it is not, or when the kernel is turned off)."""
    found = _library() if enabled() else None
    return found if isinstance(found, KernelUnavailable) else None


@functools.cache
def _library() -> Library | KernelUnavailable:
    try:
        return _check(_build())
    except KernelUnavailable as exc:
        log.warning("the ONNX backend runs its quantized matrices on MatMulNBits and attention on "
                    "GroupQueryAttention (slower decoding): %s", exc)
        return exc


class KernelUnavailable(Exception):
    pass


class NoCompiler(KernelUnavailable):
    """There is no C compiler to build the kernel with (the one reason tests may skip it for)."""


def _cache_dir() -> Path:
    env = os.environ.get("EXO_TUI_CACHE", "").strip()
    if env:
        return Path(env).expanduser() / "kernels"
    import platformdirs

    return Path(platformdirs.user_cache_dir("exo-tui")) / "kernels"


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler() -> str:
    cc = os.environ.get("CC", "").strip() or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), "")
    if not cc:
        raise NoCompiler("no C compiler (cc, gcc or clang) found: install one (e.g. apt install gcc) to get the faster kernel")
    return cc


def _build() -> Path:
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {cc} does not run ({exc})") from exc
    sources = [f.read_bytes() for f in SOURCES + HEADERS]
    key = hashlib.sha256(b"\0".join([*sources, version.encode(), _cpu_key().encode(), platform.machine().encode()]))
    target = _cache_dir() / f"exo-kernels-{key.hexdigest()[:16]}{'.dylib' if platform.system() == 'Darwin' else '.so'}"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelUnavailable(f"cannot create {target.parent} ({exc})") from exc
    errors = []
    for flags in FLAG_SETS:
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=target.suffix)
            os.close(fd)
        except OSError as exc:  # a full disk, a read-only cache
            raise KernelUnavailable(f"cannot write in {target.parent} ({exc})") from exc
        cmd = [cc, *flags, "-shared", "-fPIC", "-std=c11", "-o", tmp, *map(str, SOURCES), "-lm"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                os.replace(tmp, target)  # atomic: nodes building at once each write their own file
                return target
            errors.append(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
        finally:
            Path(tmp).unlink(missing_ok=True)
    raise KernelUnavailable(f"{cc} could not build {', '.join(f.name for f in SOURCES)}: {errors[-1] if errors else 'unknown error'}")


def _check(path: Path) -> Library:
    """The kernel must match NumPy on random data, called directly and inside a session."""
    try:
        lib = ctypes.CDLL(str(path))
        lib.exo_qlinear_isa.restype = ctypes.c_char_p
        isa = lib.exo_qlinear_isa().decode()
        integer = bool(lib.exo_qlinear_integer())
        lib.exo_qlinear  # noqa: B018 - there
    except (OSError, AttributeError) as exc:
        raise KernelUnavailable(f"cannot load {path} ({exc})") from exc
    rng = np.random.default_rng(0)
    n, k = 72, 96
    for bits in TILE_BLOCK_BYTES:
        w = QuantizedWeight.random(rng, n, k, bits)
        for xbits in (0, 16, 8) if integer else (0,):
            blob = pack([w], xbits)
            for m in (1, 3, 11):
                x = rng.standard_normal((m, k)).astype(np.float32)
                want = integer_reference(x, w, xbits) if xbits else float_reference(x, w)
                y = call(lib, x, blob, bits, n, xbits)
                if not np.allclose(y, want, rtol=1e-4, atol=1e-4):
                    raise KernelUnavailable(
                        f"the {isa} kernel built here disagrees with NumPy ({bits}-bit, "
                        f"{f'int{xbits}' if xbits else 'float32'}, off by {np.abs(y - want).max():.3g})"
                    )
                if not np.array_equal(run_in_session(path, x, blob, bits, n, xbits), y):
                    raise KernelUnavailable("the kernel gives other results inside ONNX Runtime than called directly")
    for type_name in KQUANT:  # the K-quants' super-blocks: 2 of them along K, N not whole tiles
        w = random_kquant(rng, 40, 512, type_name)
        for xbits in (0, 16, 8) if integer else (0,):
            blob = pack([w], xbits)
            for m in (1, 5):
                x = rng.standard_normal((m, 512)).astype(np.float32)
                want = integer_reference(x, w, xbits) if xbits else float_reference(x, w)
                y = call(lib, x, blob, w.bits, 40, xbits, KQUANT[type_name])
                if not np.allclose(y, want, rtol=1e-4, atol=1e-4):
                    raise KernelUnavailable(
                        f"the {isa} kernel built here disagrees with NumPy ({type_name}, "
                        f"{f'int{xbits}' if xbits else 'float32'}, off by {np.abs(y - want).max():.3g})"
                    )
                if not np.array_equal(run_in_session(path, x, blob, w.bits, 40, xbits, KQUANT[type_name]), y):
                    raise KernelUnavailable("the kernel gives other results inside ONNX Runtime than called directly")
    shapes = ((3, 1, 5, 0.0, 0), (1, 4, 1, 0.0, 0), (2, 3, 3, 0.3, 5))  # the last: a scale and a sliding window
    for (rows, tokens, slots, scale, window), half in itertools.product(shapes, (False, True)):
        case = AttentionCase.random(rng, rows, tokens, heads=4, kv_heads=2, head_dim=16, capacity=12, half=half,
                                    slots=slots, scale=scale, window=window)
        expected = case.reference()
        got = case.call(lib)
        rtol, atol = (HALF_RTOL, 1e-4) if half else (1e-4, 1e-5)
        if not all(np.allclose(g, w, rtol=rtol, atol=atol) for g, w in zip(got, expected, strict=True)):
            raise KernelUnavailable(f"the {isa} attention built here disagrees with NumPy ({rows} rows of {tokens} "
                                    f"tokens, {'float16' if half else 'float32'} caches)")
        if not all(np.array_equal(g, s) for g, s in zip(case.in_session(path), got, strict=True)):
            raise KernelUnavailable("the attention gives other results inside ONNX Runtime than called directly")
    from backends.onnx.kernels import experts

    experts.check(lib, path, integer)
    return Library(str(path), isa, integer)


def random_legacy(rng: np.random.Generator, rows: int, cols: int, type_name: str) -> QuantizedWeight:
    """A random matrix of GGUF's blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as GGUF's reader gives
    it: random codes and float16 scales (:meth:`QuantizedWeight.random`), and the type's biases: a
    random float16 one a block for Q4_1 and Q5_1, the middle code times the scale for the others
    (Q4_0 -8 s, Q5_0 -16 s, Q8_0 -128 s: exact in float16 too)."""
    bits = BLOCK_TYPES[type_name]
    w = QuantizedWeight.random(rng, rows, cols, bits)
    biases = w.biases if type_name.endswith("_1") else np.float32(-(2 ** (bits - 1))) * w.scales
    return dataclasses.replace(w, biases=biases, source_type=type_name)


def random_kquant(rng: np.random.Generator, rows: int, cols: int, type_name: str) -> QuantizedWeight:
    """A random Q4_K, Q5_K or Q6_K matrix as GGUF's reader gives it (:func:`backends.kquants.decode`'s
    groups): per super-block a random float16 ``d`` (and ``dmin``), random sub-block scales (and
    mins) over their whole range, random codes; weights about 0.05 in size."""
    ns, group, bits = cols // SUPER, kquants.GROUP[type_name], kquants.BITS[type_name]
    per = SUPER // group
    q = rng.integers(0, 2**bits, (rows, cols), dtype=np.uint8)
    if type_name == "Q6_K":
        d = (rng.standard_normal((rows, ns)) * 2e-4).astype(np.float16)
        sc = rng.integers(-128, 128, (rows, ns, per)).astype(np.float32)
        scales = (d.astype(np.float32)[..., None] * sc).reshape(rows, -1)
        return QuantizedWeight(q, scales, np.float32(-32.0) * scales, bits, group, type_name)
    top = 2**bits - 1
    d = (rng.random((rows, ns)) * 0.1 / (63 * top)).astype(np.float16)
    dmin = (rng.random((rows, ns)) * 0.05 / 63).astype(np.float16)
    sc, m = (rng.integers(0, 64, (rows, ns, per)).astype(np.float32) for _ in range(2))
    scales = (d.astype(np.float32)[..., None] * sc).reshape(rows, -1)
    biases = -(dmin.astype(np.float32)[..., None] * m).reshape(rows, -1)
    return QuantizedWeight(q, scales, biases, bits, group, type_name)


def float_reference(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """What ``QLinear`` computes in float32 (here in float64): x @ the dequantized matrix.T."""
    return x.astype(np.float64) @ w.dequantize().astype(np.float64).T


def integer_reference(x: np.ndarray, w: QuantizedWeight, xbits: int) -> np.ndarray:
    """What ``QLinear`` computes at the int16 or int8 precision (``xbits``, in float64): each block
    of 32 values of a row of ``x`` rounded to integer codes with one scale (max |x| / 32767 or
    / 127), integer products with the matrix's codes, then scaled, plus the matrix's bias times the
    block's sum as rounded (its scale times its codes' sum: the dequantized matrix times the
    dequantized row, as llama.cpp's), per group of the matrix (32, or Q6_K's 16: there the codes
    less 32 and no bias, as llama.cpp takes them)."""
    m, k = x.shape
    top = np.float32(2 ** (xbits - 1) - 1)
    xb = x.reshape(m, k // BLOCK, BLOCK).astype(np.float32)
    amax = np.abs(xb).max(-1)
    inv = np.divide(top, amax, out=np.zeros_like(amax), where=amax > 0)
    g = w.group
    xq = np.clip(np.rint(xb * inv[..., None]), -top, top).astype(np.float64).reshape(m, k // g, g)
    d = np.repeat((amax / top).astype(np.float64), BLOCK // g, axis=1)
    n = w.q.shape[0]
    codes = w.q.reshape(n, k // g, g).astype(np.float64)
    scales, biases = np.asarray(w.scales, np.float64), np.asarray(w.biases, np.float64)
    if w.source_type == "Q6_K":
        codes, biases = codes - 32.0, np.zeros_like(biases)
    dots = np.einsum("mbk,nbk->mnb", xq, codes)
    sums = xq.sum(-1) * d
    return (dots * d[:, None, :] * scales[None]).sum(-1) + (sums @ biases.T)


def call(lib: ctypes.CDLL, x: np.ndarray, blob: np.ndarray, bits: int, n: int, xbits: int = 0,
         kquant: int = 0) -> np.ndarray:
    """The library's computation called directly (one thread, no ONNX Runtime); ``n`` columns;
    ``xbits`` 16 or 8: the int16 or int8 precision; ``kquant`` 4, 5, 6: ``blob`` holds Q4_K, Q5_K
    or Q6_K super-blocks (:func:`op_attributes`)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    y = np.empty((m, n), np.float32)
    p, i = ctypes.c_void_p, ctypes.c_int64
    if lib.exo_qlinear(p(x.ctypes.data), p(blob.ctypes.data), p(y.ctypes.data), i(m), i(k), i(n), i(bits), i(xbits),
                       i(kquant)):
        raise KernelUnavailable("the kernel cannot run this (no integer products in this build, or out of memory)")
    return y


def run_in_session(path: str | Path, x: np.ndarray, blob: np.ndarray, bits: int, n: int, xbits: int = 0,
                   kquant: int = 0) -> np.ndarray:
    """``QLinear`` in a one-node ONNX Runtime session; ``n`` columns (``kquant``: as :func:`call`)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k = x.shape[-1]
    extra: dict[str, Any] = {"kquant": kquant} if kquant else {}
    node = helper.make_node(OP, ["x", "w"], ["y"], domain=DOMAIN, K=k, N=n, bits=bits, xbits=xbits, **extra)
    graph = helper.make_graph(
        [node], "check", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], [numpy_helper.from_array(blob, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        options.register_custom_ops_library(str(path))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session.run(None, {"x": x})[0]
    except Exception as exc:  # onnxruntime raises its own exception types
        raise KernelUnavailable(f"ONNX Runtime cannot use the kernel ({exc})") from exc


def gqa_window(window: int) -> int:
    """``GroupQueryAttention``'s ``local_window_size`` for a window of ``window`` positions, the
    query's own included (as measured on ONNX Runtime 1.2x's CPU op; -1: no window)."""
    return window if window > 0 else -1


HALF_RTOL = 2e-3
"""How far ``Attention``'s results may be from :meth:`AttentionCase.reference`'s: a new key (rotated
in float32 here, in float64 there) may round to the neighbouring float16 (2^-11 relative apart)."""


@dataclass
class AttentionCase:
    """Inputs of the ``Attention`` op (see ``attention.c``), with a float64 model of what it computes.
    Its caches hold float16 values (as float32 here, the type ``GroupQueryAttention`` takes); the
    op gets them as float16."""

    qkv: np.ndarray  # (B, T, (H + 2 G) D)
    keys: np.ndarray  # (S, G, capacity, D), float32 of float16 values: S >= B slots
    values: np.ndarray
    seqlens: np.ndarray  # (B,) int32: cached + T - 1
    cos: np.ndarray  # (max_pos, D / 2)
    sin: np.ndarray
    heads: int
    kv_heads: int
    half: bool = True  # the op's caches are float16 (AttentionF16), else float32 (Attention)
    slots: np.ndarray | None = None  # (B,) int32: each row's slot of the caches; None: row b in slot b
    scale: float = 0.0  # the queries' scale (0: 1 / sqrt(head_dim))
    window: int = 0  # a sliding window of that many positions (0: none)

    @classmethod
    def random(cls, rng: np.random.Generator, rows: int, tokens: int, heads: int, kv_heads: int, head_dim: int,
               capacity: int, half: bool = True, slots: int | None = None, scale: float = 0.0,
               window: int = 0) -> AttentionCase:
        """Rows at different positions (each cached up to what leaves room for ``tokens``);
        ``slots``: caches of that many slots, the rows in distinct ones in a random order (None:
        as many as rows, row b in slot b)."""
        ang = np.arange(capacity + 4)[:, None] * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)[None, :]
        cached = rng.integers(0, capacity - tokens + 1, rows)
        n = rows if slots is None else slots
        return cls(
            qkv=rng.standard_normal((rows, tokens, (heads + 2 * kv_heads) * head_dim)).astype(np.float32),
            keys=rng.standard_normal((n, kv_heads, capacity, head_dim)).astype(np.float16).astype(np.float32),
            values=rng.standard_normal((n, kv_heads, capacity, head_dim)).astype(np.float16).astype(np.float32),
            seqlens=(cached + tokens - 1).astype(np.int32),
            cos=np.cos(ang).astype(np.float32), sin=np.sin(ang).astype(np.float32), heads=heads, kv_heads=kv_heads,
            half=half, slots=None if slots is None else rng.permutation(slots)[:rows].astype(np.int32),
            scale=scale, window=window,
        )

    @property
    def slot_ids(self) -> np.ndarray:
        return np.arange(self.qkv.shape[0], dtype=np.int32) if self.slots is None else self.slots

    @property
    def head_dim(self) -> int:
        return self.qkv.shape[2] // (self.heads + 2 * self.kv_heads)

    def reference(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(output, keys, values) in float64: rotary on adjacent pairs, the new keys and values at
        their positions (rounded to float16 on float16 caches), causal softmax attention; past
        positions beyond a row's are untouched."""
        half = self.half
        b, t, _ = self.qkv.shape
        h, g, d = self.heads, self.kv_heads, self.head_dim
        keys, values = self.keys.astype(np.float64), self.values.astype(np.float64)
        out = np.zeros((b, t, h * d))
        qkv = self.qkv.astype(np.float64)

        def rotate(x: np.ndarray, pos: int) -> np.ndarray:
            c, s = self.cos[pos].astype(np.float64), self.sin[pos].astype(np.float64)
            x0, x1 = x[0::2], x[1::2]
            return np.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(-1)

        for i, slot in enumerate(self.slot_ids):  # every row's keys first (rows may share a slot)
            first = int(self.seqlens[i]) - (t - 1)
            for j in range(t):
                for kv in range(g):
                    keys[slot, kv, first + j] = rotate(qkv[i, j, (h + kv) * d : (h + kv + 1) * d], first + j)
                    values[slot, kv, first + j] = qkv[i, j, (h + g + kv) * d : (h + g + kv + 1) * d]
                    if half:
                        keys[slot, kv, first + j] = keys[slot, kv, first + j].astype(np.float16)
                        values[slot, kv, first + j] = values[slot, kv, first + j].astype(np.float16)
        for i, slot in enumerate(self.slot_ids):  # then each row attends
            first = int(self.seqlens[i]) - (t - 1)
            for j in range(t):
                pos = first + j
                for head in range(h):
                    kv = head // (h // g)
                    q = rotate(qkv[i, j, head * d : (head + 1) * d], pos) * (self.scale or 1 / np.sqrt(d))
                    lo = max(0, pos + 1 - self.window) if self.window else 0
                    scores = keys[slot, kv, lo : pos + 1] @ q
                    p = np.exp(scores - scores.max())
                    out[i, j, head * d : (head + 1) * d] = (p / p.sum()) @ values[slot, kv, lo : pos + 1]
        return out, keys, values

    def call(self, lib: ctypes.CDLL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The library's computation called directly (one thread, no ONNX Runtime)."""
        b, t, _ = self.qkv.shape
        dtype = np.float16 if self.half else np.float32
        keys, values = self.keys.astype(dtype), self.values.astype(dtype)
        out = np.empty((b, t, self.heads * self.head_dim), np.float32)
        p, i = ctypes.c_void_p, ctypes.c_int64
        arrays = (self.qkv, keys, values, self.seqlens, np.ascontiguousarray(self.slot_ids), self.cos, self.sin, out)
        lib.exo_attention(*(p(a.ctypes.data) for a in arrays), i(b), i(t), i(self.heads), i(self.kv_heads),
                          i(self.head_dim), i(keys.shape[2]), i(self.cos.shape[0]), i(int(self.half)),
                          ctypes.c_float(self.scale), i(self.window))
        return out, keys, values

    def in_session(self, path: str | Path | None, in_place: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``Attention`` from the library at ``path`` in a one-node ONNX Runtime session (``None``:
        ONNX Runtime's own ``GroupQueryAttention``, the op it replaces, rotary interleaved);
        ``in_place``: the present caches bound to the past ones' buffers (as the shard binds them),
        else given back as new arrays."""
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        b, t, w = self.qkv.shape
        cache = list(self.keys.shape)
        f = TensorProto.FLOAT
        half = path is not None and self.half
        kv_type, kv_dtype = (TensorProto.FLOAT16, np.float16) if half else (f, np.float32)
        rest = ["seqlens_k", "total", "cos", "sin"]
        slots = [helper.make_tensor_value_info("slots", TensorProto.INT32, [b])] if path is not None else []
        if path is not None:
            domain, node = DOMAIN, helper.make_node(ATTENTION_F16 if half else ATTENTION, ["qkv", "pk", "pv", *rest, "slots"],
                                                    ["o", "ok", "ov"], domain=DOMAIN, num_heads=self.heads,
                                                    kv_num_heads=self.kv_heads, scale=float(self.scale),
                                                    window=int(self.window))
        else:
            if cache[0] != b or not np.array_equal(self.slot_ids, np.arange(b)):
                raise ValueError("GroupQueryAttention takes row b's cache in slot b: no slot map")
            domain, node = "com.microsoft", helper.make_node(
                "GroupQueryAttention", ["qkv", "", "", "pk", "pv", *rest], ["o", "ok", "ov"], domain="com.microsoft",
                num_heads=self.heads, kv_num_heads=self.kv_heads, scale=float(self.scale or 1 / np.sqrt(self.head_dim)),
                do_rotary=1, rotary_interleaved=1, local_window_size=gqa_window(self.window),
            )
        graph = helper.make_graph(
            [node], "check",
            [helper.make_tensor_value_info("qkv", f, [b, t, w]), helper.make_tensor_value_info("pk", kv_type, cache),
             helper.make_tensor_value_info("pv", kv_type, cache), helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
             helper.make_tensor_value_info("total", TensorProto.INT32, []), *slots],
            [helper.make_tensor_value_info("o", f, [b, t, self.heads * self.head_dim]),
             helper.make_tensor_value_info("ok", kv_type, cache), helper.make_tensor_value_info("ov", kv_type, cache)],
            [numpy_helper.from_array(self.cos, "cos"), numpy_helper.from_array(self.sin, "sin")],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)])
        model.ir_version = 10
        options = ort.SessionOptions()
        options.log_severity_level = 3
        total = np.array(int(self.seqlens.max()) + 1, np.int32)
        try:
            if path is not None:
                options.register_custom_ops_library(str(path))
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            keys, values = self.keys.astype(kv_dtype), self.values.astype(kv_dtype)
            feeds = {"slots": self.slot_ids} if path is not None else {}
            if not in_place:
                o, k, v = session.run(None, {"qkv": self.qkv, "pk": keys, "pv": values,
                                             "seqlens_k": self.seqlens, "total": total, **feeds})
                return o, k, v
            io = session.io_binding()
            kv, vv = ort.OrtValue.ortvalue_from_numpy(keys), ort.OrtValue.ortvalue_from_numpy(values)
            io.bind_cpu_input("qkv", self.qkv)
            io.bind_cpu_input("seqlens_k", self.seqlens)
            io.bind_cpu_input("total", total)
            for name, array in feeds.items():
                io.bind_cpu_input(name, array)
            io.bind_ortvalue_input("pk", kv)
            io.bind_ortvalue_input("pv", vv)
            io.bind_ortvalue_output("ok", kv)
            io.bind_ortvalue_output("ov", vv)
            io.bind_output("o", "cpu")
            session.run_with_iobinding(io)
            return io.copy_outputs_to_cpu()[2], keys, values
        except Exception as exc:  # onnxruntime raises its own exception types
            raise KernelUnavailable(f"ONNX Runtime cannot use the attention kernel ({exc})") from exc
