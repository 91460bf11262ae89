"""The default model's F16 requantization: the target that its own Q4_1 file drafts for in
``benchmarks/speculative.py``'s draft-model case (issue 42).

llama.cpp's quantizer (``llama_cpp.llama_model_quantize``, ``allow_requantize``) writes the Q4_1
file's weights again as F16: the same model at 16 bits a weight, about 3.4 times the bytes a token
reads, so the Q4_1 file is a cheap draft whose argmax mostly agrees with it.

    python benchmarks/draft_f16.py [--out DIR]   # prints the F16 file's path (made once, then reused)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402


def default_out_dir() -> Path:
    from exo_tui.paths import exo_home

    return exo_home() / "bench-models"


def f16_requantization(source: Path, out_dir: Path) -> Path:
    """``source`` (a GGUF) requantized to F16 by llama.cpp under ``out_dir`` (made once)."""
    import llama_cpp

    out = out_dir / f"{source.stem.split('.')[0]}.F16-from-{source.stem.split('.')[-1]}.gguf"
    if out.exists() and out.stat().st_size > 0:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
    params.allow_requantize = True
    params.nthread = 2
    tmp = out.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's quantizer failed ({rc}) requantizing {source} to F16")
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="where to write it (default EXO_TUI_HOME/bench-models)")
    args = parse(ap)
    from benchmarks.quick import have_llama_cpp
    from exo_tui.models.catalog import resolve_model

    if not have_llama_cpp():
        return
    print(f16_requantization(resolve_model(), args.out or default_out_dir()))


if __name__ == "__main__":
    main()
