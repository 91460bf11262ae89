"""Inference backends. ``backends`` never imports ``exo_tui``: it gets plain arrays and a
:class:`~backends.base.ModelConfig` and returns shards."""

from __future__ import annotations

import importlib
import inspect
import platform

from backends.base import Backend, BackendError

BACKEND_NAMES = ("mlx", "onnx")
_CLASSES = {"mlx": ("backends.mlx", "MLXBackend"), "onnx": ("backends.onnx", "ONNXBackend")}
_instances: dict[str, Backend] = {}


def _backend_class(name: str) -> type[Backend]:
    if name not in _CLASSES:
        raise BackendError(f"unknown backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}")
    module, cls = _CLASSES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise BackendError(f"backend {name} cannot be imported ({exc}): install it with pip") from exc


def backend_class(name: str) -> type[Backend]:
    """The class of the backend called ``name``, for what it says without running (its
    ``held_nbytes``): importing it needs neither MLX nor ONNX Runtime."""
    return _backend_class(name)


def get_backend(name: str) -> Backend:
    """The backend called ``name`` ("mlx" or "onnx"), checked to be available here."""
    if name not in _instances:
        _instances[name] = _backend_class(name)()
    backend = _instances[name]
    if not backend.available():
        why = f": {backend.unavailable_reason}" if backend.unavailable_reason else ""
        raise BackendError(f"backend {name} is not available on this machine{why}")
    return backend


def configure_backend(name: str, **options: object) -> Backend:
    """Make ``name`` the backend built with ``options`` (ONNX: ``threads``, ``precision``, ``spin``,
    ``pin``) for the rest of this process: every later :func:`get_backend` returns it. A node
    calls this once at start, from its command line; options left out keep their defaults
    (environment variables included)."""
    backend_cls = _backend_class(name)
    unknown = sorted(set(options) - set(inspect.signature(backend_cls).parameters))
    if unknown:
        raise BackendError(f"backend {name} has no setting {', '.join(unknown)}: leave it out for {name} nodes")
    backend = backend_cls(**options)
    _instances[name] = backend
    return backend


def available_backends() -> list[str]:
    """The names of the backends that work on this machine."""
    names = []
    for name in BACKEND_NAMES:
        try:
            get_backend(name)
        except BackendError:
            continue
        names.append(name)
    return names


def is_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def default_backend_name() -> str:
    """MLX on Apple silicon, ONNX Runtime everywhere else."""
    return "mlx" if is_apple_silicon() else "onnx"
