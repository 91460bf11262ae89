"""The MLX backend (Apple silicon GPU on a Mac, MLX's CPU build on Linux).

``MLXBackend().load_shard(config, weights)`` returns an :class:`~backends.mlx.shard.MLXShard`:
every family of :class:`~backends.base.ModelConfig`, mixtures of experts included
(:mod:`backends.mlx.experts`), its quantized matrices kept quantized (:mod:`backends.mlx.quant`).
This module imports without MLX installed; ``available()`` then says no.
"""

from __future__ import annotations

import os

from backends.base import (
    Backend,
    BackendError,
    ModelConfig,
    Shard,
    ShardWeights,
    check_shard_layers,
    physical_cores,
    unsupported_features,
)

MAX_DEFAULT_THREADS = 8
"""The default thread count stops here: past it each matmul's parts get too small to pay off."""


class MLXBackend(Backend):
    """Shards on MLX's default device.

    ``threads``: on MLX's CPU build, each matmul is cut into this many row blocks run at once on
    as many CPU streams (MLX's CPU kernels use one core each); default: env ``EXO_TUI_THREADS``,
    else the physical cores (at most 8). Ignored on a GPU. ``compile_decode``: run one-token steps
    as one ``mx.compile``-d function.
    """

    name = "mlx"
    experts = True  # mixtures of experts: backends.mlx.experts

    def __init__(self, *, threads: int | None = None, compile_decode: bool = True) -> None:
        if threads is None:
            env = os.environ.get("EXO_TUI_THREADS", "").strip()
            if env:
                try:
                    threads = int(env)
                except ValueError:
                    raise BackendError(f"EXO_TUI_THREADS={env!r} is not a whole number of threads") from None
            else:
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
            except Exception:  # not installed, or no usable device
                self._available = False
        return self._available

    def device(self) -> str:
        """The MLX device shards run on ("cpu" or "gpu")."""
        import mlx.core as mx

        return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"

    def load_shard(self, config: ModelConfig, weights: ShardWeights) -> Shard:
        if not self.available():
            raise BackendError("MLX is not installed or not working here: pip install mlx (mlx[cpu] on Linux)")
        problems = unsupported_features(config, experts=True)
        if problems:
            raise BackendError(f"this {config.arch} model uses {problems[0]}, which this backend does not run")
        check_shard_layers(config, weights)
        from backends.mlx.shard import MLXShard

        return MLXShard(config, weights, compile_decode=self.compile_decode, threads=self.threads)


__all__ = ["MLXBackend", "physical_cores"]
