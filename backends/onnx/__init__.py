"""The ONNX Runtime backend: each shard is one ONNX graph built with ``onnx.helper`` and run on
ONNX Runtime's CPU execution provider, 4-bit and 8-bit GGUF blocks kept as they are (exo-tui's
``QLinear`` kernel, :mod:`backends.onnx.kernels`; ``com.microsoft`` ``MatMulNBits`` where it cannot
be built), attention and the KV cache in exo-tui's ``Attention`` (``GroupQueryAttention`` without
the kernel library)."""

from __future__ import annotations

import numpy as np

from backends.base import Backend, BackendError, ModelConfig, Shard, physical_cores, unsupported_features
from backends.onnx.affinity import core_plan
from backends.weights import ShardWeights, check_shard_layers

SPIN_US = 15
"""How long (µs) an idle intra-op thread spins for the next op of a step before it sleeps.

A decode step is ~300 ops; with two threads each parallel op hands work to the other thread, and
a sleeping thread takes tens of microseconds to wake (more in a VM). Measured on 2 cores
(``benchmarks/onnx_spin.py``: SmolLM2, one whole-model shard, the policies taking turns; ranges
over the runs that measured each), milliseconds a decode step:

=====================  ============  ============================  ============================
idle threads spin      alone         beside 1 busy process         beside 2 (both cores taken)
=====================  ============  ============================  ============================
never                  13.2 - 13.8   15.8 - 19.3                   18.5 - 23.0
15 µs (the default)    11.6 - 12.4   15.6 - 16.4                   20.7 - 24.1
25 µs                  10.9 - 11.4   19.0 - 19.8                   21.9
40 µs                  10.8 - 11.2   22.4 - 22.5                   23.1
until the step ends    11.1 - 13.0   24.0 - 28.5                   32.0
=====================  ============  ============================  ============================

A longer spin catches more of the gaps between ops, but where another process wants the core
the spinning thread holds it away from the step's other thread. 15 µs takes most of the gain
alone, costs nothing beside one busy process and up to ~30 % where other work takes every core
(0 - 30 % in three runs; an overloaded node, which its load shows the scheduler).
(``session.intra_op.spin_duration_us``, ONNX Runtime 1.26 and later; older versions do not spin
at all rather than spin without a bound.)"""
SPIN_DURATION_MIN_ORT = (1, 26)

PRECISIONS = {"float32": 0, "int16": 16, "int8": 8}
"""The precisions, and the bits of the integer codes each takes activations to before a
quantized matrix product (0: none).

* ``int16`` (the default's, but on K-quant files: :data:`AUTO`): each block of 32 activations
  rounded to int16 with one scale, integer
  products on ``QLinear`` (VPDPWSSD, or AVX2's VPMADDWD: the same numbers). 15 bits of a block's
  largest value: on the default model logits stay within 3e-2 of float32's (float32's own are
  within 1e-4 of MLX's) and 12 prompts x 96 greedy tokens were MLX's token for token (again with
  the float16 KV caches the integer precisions keep); on the default model 1.2x float32's prefill
  and 1.14x its decode (Zen 5, AVX-512; 1.7x and 1.4x on a Zen 4); on a Q4_K_M file of
  Llama-3.2-1B's shape 1.5x llama.cpp's prefill and 1.18x its decode. Where the build has no
  integer products it runs float32 products instead (as exact as float32, not faster).
* ``float32``: float32 math on the dequantized weights, for answers bit-faithful to it (the
  KV caches float32 too, where the integer precisions keep them in float16).
* ``int8``: the same with int8 codes, as llama.cpp's Q8_0 (7 bits: on the default model logits
  move by 0.23 RMS, 2 at most, and some greedy answers part from float32's within a few tokens;
  on the K-quant fixtures of tests/fixtures/families they lie 0.024-0.045 RMS from float32's,
  where llama.cpp's lie 0.034-0.054 from them, and no farther from the float model than
  llama.cpp's; on the default model 2.1x the prefill and 1.2x
  the decode of float32, on the 1B-shape Q4_K_M file 2.06x llama.cpp's prefill): on
  ``QLinear``'s integer products where its build has them (AVX-512 VNNI, or AVX2's pair sums,
  the same numbers), else on ``MatMulNBits``'."""
AUTO = "auto"
"""The default setting: each shard's precision by its file's blocks (``precision.resolve_precision``):
``int8`` where most of its quantized bytes are K-quant super-blocks (Q4_K, Q5_K, Q6_K) and the
build has integer products, ``int16`` otherwise. On a K-quant file llama.cpp itself rounds the
activations to 8 bits, once per 256 (Q8_K), where int8 rounds them per 32: it computes such a
file more exactly than llama.cpp, lies no farther from the float model on every quantized fixture
(tests/unit/test_family_logits.py), and runs a Q4_K_M file of Llama-3.1-8B's shape at 1.36x
llama.cpp's decode and 2.06x its prefill where int16 does 1.07x and 1.57x (AVX2: 1.05x decode
against 0.72x; docs/benchmarks.md). Q4_0, Q4_1 and Q8_0 files, the default model among them, keep
int16: there int8 would round as llama.cpp does, no finer, and on the default model it parts
some greedy answers from float32's."""
DEFAULT_PRECISION = AUTO
SETTINGS = (AUTO, *PRECISIONS)
"""What ``precision`` (``--precision``, ``node.onnx.precision``, ``EXO_TUI_ONNX_PRECISION``) takes."""
ACCURACY_LEVEL = {"float32": 1, "int16": 1, "int8": 4}
"""``MatMulNBits``' ``accuracy_level`` per precision, for the matrices it runs."""


class ONNXBackend(Backend):
    """Shards on ONNX Runtime (CPU).

    Its settings are plain values (a node passes its config's ``node.threads`` and ``node.onnx.*``,
    with their environment overrides, through ``backends.configure_backend``); it reads no
    environment. ``threads``: intra-op threads per shard (default: the number of physical cores).
    ``precision``: ``"auto"`` (default: :data:`AUTO`), ``"int16"``, ``"float32"`` or ``"int8"``
    (see :data:`PRECISIONS`), the integer ones faster but not bit-faithful to float32 math.
    ``spin``: how long an idle intra-op thread busy-waits for the next op of a step before it
    sleeps: ``False`` never, ``True`` until the step returns, an int at most that many
    microseconds. Default :data:`SPIN_US`, see there for why; threads never spin between steps,
    so an idle node uses no CPU. ``pin``: whether a step's threads run on cores of their own. Off
    by default, a trade measured in :mod:`backends.onnx.affinity`: it speeds up nodes that hand
    steps to each other on one machine and slows down nodes whose cores other work wants too.
    ``kernel``: exo-tui's kernels on (the default) or off for this process (``MatMulNBits`` and
    ONNX Runtime's attention only; see :func:`backends.onnx.kernels.use`); None leaves it as it is.
    ``session_config``: extra ONNX Runtime session config entries.
    """

    name = "onnx"
    experts = True  # exo-tui's Experts op on quantized experts, ONNX Runtime's MoE on float ones (graph.py)
    embedding_first = True  # ONNXShard makes its embedding's rows, then builds the graph

    @classmethod
    def held_nbytes(cls, type_name: str, shape: tuple[int, ...], *, embedding: bool = False) -> int:
        """``QLinear``'s tiles of a matrix (``kernels.tiles.packed_nbytes``: Q4_K 148 bytes a 256
        weights against the file's 144, Q5_K 180 / 176, Q6_K 210 / 210, Q4_0 and Q4_1 20 a 32,
        Q5_0 and Q5_1 24 / 22 and 24, Q8_0 36 / 34), the embedding's compact rows
        (``weights.embedding_nbytes``), float32 otherwise. Counted as the kernel holds them: where
        it cannot be built (no C compiler), ``MatMulNBits``' forms hold a float32 scale and
        correction a group of 32 more."""
        from backends.onnx.kernels.tiles import packed_nbytes
        from backends.onnx.weights import embedding_nbytes

        if embedding and type_name == "F16":  # a float16 embedding stays so
            return 2 * int(np.prod(shape, dtype=np.int64))
        if len(shape) < 2:
            return super().held_nbytes(type_name, shape)
        *lead, rows, cols = shape
        held = (embedding_nbytes if embedding else packed_nbytes)(type_name, rows, cols)
        return int(np.prod(lead, dtype=np.int64)) * held if held is not None else super().held_nbytes(type_name, shape)

    @classmethod
    def shares_tied(cls, type_name: str, shape: tuple[int, ...]) -> bool:
        """Only a matrix on the kernel: a tied embedding's rows are looked up in the head's tiles
        (ONNXShard, kernels.tile_rows); another (a float one) is held as float32 for the head
        beside its rows."""
        from backends.onnx.kernels.tiles import packed_nbytes

        return len(shape) == 2 and packed_nbytes(type_name, *shape) is not None

    def __init__(
        self,
        threads: int | None = None,
        precision: str | None = None,
        session_config: dict[str, str] | None = None,
        spin: bool | int | None = None,
        pin: bool | None = None,
        kernel: bool | None = None,
    ) -> None:
        if threads is not None and threads < 1:
            raise BackendError(f"threads must be at least 1, got {threads}")
        self.threads = threads or physical_cores()
        if kernel is not None:
            from backends.onnx import kernels

            kernels.use(kernel)
        precision = precision or DEFAULT_PRECISION
        if precision not in SETTINGS:
            raise BackendError(
                f"unknown ONNX precision {precision!r}: choose one of {', '.join(SETTINGS)}"
            )
        self.precision = precision
        self.spin_us = _spin_us(spin)
        self.session_config = _spin_config(self.spin_us)
        self.pin = bool(pin)
        self.cores = core_plan(self.threads) if self.pin else None
        if self.cores is not None:
            self.session_config["session.intra_op_thread_affinities"] = self.cores.ort_affinities
        self.session_config.update(session_config or {})
        self._available: bool | None = None

    def available(self) -> bool:
        if self._available is None:
            try:
                import onnx  # noqa: F401
                import onnxruntime as ort

                self._available = "CPUExecutionProvider" in ort.get_available_providers()
                if not self._available:
                    self.unavailable_reason = f"ONNX Runtime offers no CPU provider ({', '.join(ort.get_available_providers())})"
            except ImportError as exc:
                self._available = False
                self.unavailable_reason = f"ImportError: {exc}"
        return self._available

    def describe(self) -> dict[str, str]:
        from backends.onnx import kernels
        from backends.onnx.precision import integer_codes, kernel_for

        auto = self.precision == AUTO
        precision = self._base_precision
        library = kernel_for(precision)
        if library is not None:
            xbits = integer_codes(precision, library)
            matmul = f"QLinear {library.isa}"
            if xbits:
                matmul += (" int8 products on K-quants, int16 on others" if auto else f" int{xbits} products") + (
                    " (VNNI)" if library.isa == "avx512" else "")
            elif precision != "float32":  # int16 asked of a build without integer products
                matmul += " float32 products (no integer products in this build: they need AVX2 or AVX-512 VNNI)"
        elif kernels.library() is not None:  # built, but int8 was asked of a build without it
            matmul = "MatMulNBits (ONNX Runtime's): QLinear here has no int8 products (they need AVX2 or AVX-512 VNNI)"
        else:
            matmul = "MatMulNBits (ONNX Runtime's)"
        attention = "exo-tui Attention" if library is not None else "GroupQueryAttention (ONNX Runtime's)"
        spin = "never" if self.spin_us == 0 else "until a step ends" if self.spin_us is None else f"at most {self.spin_us} µs"
        return {"precision": self.precision, "threads": str(self.threads), "matmul": matmul, "attention": attention,
                "idle threads spin": spin, "pinned": "yes" if self.pin else "no"}

    def kv_value_bytes(self) -> int:
        from backends.onnx.precision import caches_half, integer_codes, kernel_for

        library = kernel_for(self._base_precision)
        return 2 if caches_half(library, integer_codes(self._base_precision, library)) else 4

    @property
    def _base_precision(self) -> str:
        """The precision this backend's description and caches go by: ``auto``'s is int16 (its
        int8, on K-quant shards where the build has it, keeps the same float16 caches)."""
        return "int16" if self.precision == AUTO else self.precision

    def load_shard(self, config: ModelConfig, weights: ShardWeights) -> Shard:
        if not self.available():
            raise BackendError("ONNX Runtime is not installed: pip install onnxruntime onnx")
        check_shard(config, weights)
        from backends.onnx.shard import ONNXShard

        return ONNXShard(
            config,
            weights,
            threads=self.threads,
            precision=self.precision,
            session_config=self.session_config,
            cores=self.cores,
        )


def _spin_us(spin: bool | int | None) -> int | None:
    """The spin policy in microseconds: 0 never, None until the step returns, else at most that."""
    if spin is None:
        spin = SPIN_US
    if spin is True:
        return None
    if spin is False:
        return 0
    if spin < 0:
        raise BackendError(f"spin must be at least 0 microseconds, got {spin}")
    return int(spin)


def _spin_config(spin_us: int | None) -> dict[str, str]:
    """ONNX Runtime's session config for a spin policy (see :data:`SPIN_US`). Threads stop
    spinning when each step returns (``force_spinning_stop``): an idle node uses no CPU."""
    if spin_us == 0:
        return {"session.intra_op.allow_spinning": "0"}
    config = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}
    if spin_us is not None:
        import onnxruntime as ort

        version = tuple(int(p) for p in ort.__version__.split(".")[:2] if p.isdigit())
        if version < SPIN_DURATION_MIN_ORT:  # no bound there: better not to spin than to spin without one
            return {"session.intra_op.allow_spinning": "0"}
        config["session.intra_op.spin_duration_us"] = str(spin_us)
    return config


def check_shard(config: ModelConfig, weights: ShardWeights) -> None:
    """Errors for weights that do not fit the config, before any graph is built."""
    c = config
    problems = unsupported_features(c, experts=True)
    if problems:
        raise BackendError(f"this {c.arch} model uses {problems[0]}, which this backend does not run")
    if not 0 <= weights.start < weights.end <= c.n_layers:
        raise BackendError(f"layer range [{weights.start}, {weights.end}) is not within [0, {c.n_layers})")
    if c.n_heads % c.n_kv_heads or c.head_dim % 2:
        raise BackendError(
            f"unsupported attention shape: {c.n_heads} heads, {c.n_kv_heads} KV heads, head_dim {c.head_dim}"
        )
    if weights.start == 0 and weights.embed is None:
        raise BackendError("the first shard needs the token embedding (weights.embed)")
    if weights.end == c.n_layers and (weights.norm is None or weights.output is None):
        raise BackendError("the last shard needs the final norm and the output matrix")
    h = c.hidden_size
    check_shard_layers(c, weights)
    for name in ("embed", "output"):
        w = getattr(weights, name)
        if w is not None and tuple(w.shape) != (c.vocab_size, h):
            raise BackendError(f"{name} has shape {tuple(w.shape)}, expected ({c.vocab_size}, {h})")


__all__ = ["ONNXBackend", "PRECISIONS", "SPIN_US", "check_shard", "physical_cores"]
