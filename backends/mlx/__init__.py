"""The MLX backend (Apple silicon GPU on a Mac, MLX's CPU build on Linux).

``MLXBackend().load_shard(config, weights)`` returns an :class:`~backends.mlx.shard.MLXShard`:
every family of :class:`~backends.base.ModelConfig`, mixtures of experts included
(:mod:`backends.mlx.experts`), its quantized matrices kept quantized (:mod:`backends.mlx.quant`).
This module imports without MLX installed; ``available()`` then says no.
"""

from __future__ import annotations

import logging

import numpy as np

from backends.base import Backend, BackendError, ModelConfig, Shard, physical_cores, unsupported_features
from backends.kquants import CODE_BITS
from backends.kquants import GROUP as KQUANT_GROUP
from backends.weights import ShardWeights, check_shard_layers

log = logging.getLogger(__name__)

SCALE_BYTES = {"Q4_0": (2, 0), "Q5_0": (2, 0), "Q8_0": (2, 0), "Q4_1": (4, 0), "Q5_1": (4, 0),
               "Q4_K": (2, 4), "Q5_K": (2, 4), "Q6_K": (1, 2)}
"""The bytes a quantized type's scales and biases take on MLX: a group's, a super-block's of 256."""
MAX_DEFAULT_THREADS = 8
"""The default thread count stops here: past it each matmul's parts get too small to pay off."""


class MLXBackend(Backend):
    """Shards on MLX's default device.

    ``threads``: on MLX's CPU build, each matmul is cut into this many row blocks run at once on
    as many CPU streams (MLX's CPU kernels use one core each); default the physical cores (at most
    8; a node passes its config's ``node.threads``). Ignored on a GPU. ``compile_decode``: run one-token steps
    as one ``mx.compile``-d function.
    """

    name = "mlx"
    experts = True  # mixtures of experts: backends.mlx.experts

    @classmethod
    def held_nbytes(cls, type_name: str, shape: tuple[int, ...], *, embedding: bool = False) -> int:
        """The codes packed at their bits and each group's scale and bias in the file's own form
        (``scales.GroupScales``): Q4_0, Q5_0 and Q8_0 a float16 scale a group of 32 (the bias
        implied), Q4_1 and Q5_1 a float16 scale and bias; Q4_K and Q5_K an integer scale and min a group of 32 and
        ``d``, ``dmin`` (float16) a super-block of 256, Q6_K an integer scale a group of 16 and ``d``:
        the file's bytes, Q4_K and Q5_K 1.03x and 1.02x (the 6-bit scales and mins in a byte each);
        float32 otherwise. The embedding is the same arrays, which a tied head shares."""
        bits = CODE_BITS.get(type_name)
        if bits is None or len(shape) < 2:
            return super().held_nbytes(type_name, shape)
        weights = int(np.prod(shape, dtype=np.int64))
        group_bytes, block_bytes = SCALE_BYTES[type_name]
        return weights * bits // 8 + weights // KQUANT_GROUP.get(type_name, 32) * group_bytes + weights // 256 * block_bytes

    def __init__(self, *, threads: int | None = None, compile_decode: bool = True) -> None:
        if threads is None:
            threads = min(physical_cores(), MAX_DEFAULT_THREADS)
        if threads < 1:
            raise BackendError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self.compile_decode = compile_decode
        self._available: bool | None = None

    def describe(self) -> dict[str, str]:
        import mlx.core as mx

        return {"device": str(mx.default_device()), "threads": str(self.threads),
                "decode steps": "compiled" if self.compile_decode else "eager"}

    def available(self) -> bool:
        if self._available is None:
            try:
                import mlx.core as mx

                mx.eval(mx.array([1.0, 2.0]) * 2)
                self._available = True
            except Exception as exc:  # not installed, or no usable device: kept, get_backend says it
                self._available = False
                self.unavailable_reason = f"{type(exc).__name__}: {exc}"
                log.info("MLX is not available here: %s", self.unavailable_reason)
        return self._available

    def device(self) -> str:
        """The MLX device shards run on ("cpu" or "gpu")."""
        import mlx.core as mx

        return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"

    def load_shard(self, config: ModelConfig, weights: ShardWeights) -> Shard:
        if not self.available():
            raise BackendError(f"MLX is not installed or not working here ({self.unavailable_reason}): "
                               "pip install mlx (mlx[cpu] on Linux)")
        problems = unsupported_features(config, experts=True)
        if problems:
            raise BackendError(f"this {config.arch} model uses {problems[0]}, which this backend does not run")
        check_shard_layers(config, weights)
        from backends.mlx.shard import MLXShard

        return MLXShard(config, weights, compile_decode=self.compile_decode, threads=self.threads)


__all__ = ["MLXBackend", "physical_cores"]
