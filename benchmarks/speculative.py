"""Speculative decoding (issue 42), side by side in one run: decode tok/s of the default model with
and without speculation, on one node and on a 3-node ring (ONNX node processes on loopback), and
beside llama.cpp's own prompt-lookup speculation on one process.

Tasks (greedy, so every configuration gives the same text; the benchmark checks it does):

* ``copy``: code the model writes, asked again with its earlier answer as the request's
  ``prediction`` (OpenAI's Predicted Outputs: an edit that keeps the code, as a client re-asking
  with the file it has). The default model (135M) does not copy a block given in the prompt
  faithfully (it rewrites it shorter), so the prediction is its own answer, given as text and
  tokenized as a client's would be. Target: >= 3x off, one node and ring.
* ``chat``: a free question; speculation ``auto`` (prompt lookup, drafting only where it measures a
  gain). Target: >= 0.97x off.
* headline: the 3-node ring with speculation against one node without, on ``copy``: >= 1.0x.
* 8 streams at once, one node and ring, ``auto`` against ``off``: the throughput must not drop;
  also the copies with their prediction, under ``auto`` and at a fixed ``--stream-k`` (their verify
  steps run, batched with the other streams' decode steps). Each round's ratio against that
  round's ``off``, many rounds' median, interval, quartiles and sign test, the coordinator's CPU
  time per token (``benchmarks/_streams.py``). To show it: ``--tasks streams --stream-modes auto
  --rounds 40 --tokens 48`` (``--profile``: the coordinator's busiest functions per mode).
* ``draft``: a draft model (``--draft``): the default Q4_1 file drafting for its own F16
  requantization (``benchmarks/draft_f16.py``, llama.cpp's quantizer) on free chat, the F16 model
  served with the draft model against without, ``auto`` and a fixed ``k`` of 4. Target: >= 1.5x off,
  one node and ring; the ring with it against one node without: >= 1.0x. (Needs llama_cpp for the
  F16 file: skipped with a note where it is not installed.)
* llama.cpp (llama-cpp-python's ``LlamaPromptLookupDecoding``, the same threads, the copy prompt):
  one node of exo-tui with prompt lookup and with the prediction against it: >= 1.5x. (llama.cpp
  has no predictions: its lookup drafts from the prompt and answer only.)

The clusters are all up at once and take turns, ``--rounds`` times, every other round in the
reverse order (a shared machine's speed drifts over minutes; measured one after the other, the
drift would land in the ratios). Then, per
stage of a 3-way split of the model, in this process: the time of a step of ``k + 1`` rows against
a 1-row step (what a verify step costs a node), on ONNX and MLX, and among 8 streams' decode steps
what one stream's verify step adds to their batched step, its rows in the batch and apart. Medians.

    python benchmarks/speculative.py [--rounds 3] [--tokens 96] [--threads 1] [--no-llama] [--no-draft | --draft-only] [--nodes 1,3]
        [--tasks copy,chat,streams] [--stages-only | --no-stages] [--stage-backends onnx,mlx] [--batch-backends onnx]
        [--stream-k 4] [--stream-modes off,auto,predicted,fixed] [--profile]
        [--ks 1,4,8,16,32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends import available_backends  # noqa: E402
from benchmarks._streams import STREAMS, modes, print_profiles, print_streams, streams_round  # noqa: E402
from benchmarks.quick import have_llama_cpp, parse  # noqa: E402

COPY = [{"role": "user", "content": "Write a Python class for a bank account with deposit, withdraw and balance methods."}]
CHAT = [{"role": "user", "content": "Tell me about the history of bicycles."}]
TASKS = ("copy", "chat", "streams")
Runs = dict[tuple[str, int], list[dict[str, Any]]]


async def _decode(c: Any, messages: list[dict[str, str]], tokens: int, mode: str | int,
                  prediction: str | None = None, temperature: float = 0.0) -> dict[str, Any]:
    """One answer (greedy unless told): its tokens, decode tok/s (after the first token) and
    speculation stats."""
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams

    request = Request(c.model.chat_prompt_ids(messages), SamplingParams(temperature=temperature, seed=1), tokens,
                      speculative=mode,
                      predicted=c.model.tokenizer.encode(prediction, add_special=False, parse_special=False)
                      if prediction else None)
    async for _ in c.generate(request):
        pass
    s = request.speculation.stats if request.speculation is not None else None
    return {"tokens": list(request.generated), "tok_s": request.decode_tok_per_s,
            "drafted": s.drafted if s else 0, "accepted": s.accepted if s else 0,
            "shadowed": s.shadowed if s else 0, "shadow_kept": s.shadow_kept if s else 0,
            "k": list(s.k_chosen) if s else []}


CASES = [  # (name, nodes, task, speculation, with the prediction)
    ("copy off", 1, "copy", "off", False), ("copy prediction", 1, "copy", "auto", True),
    ("copy lookup", 1, "copy", "auto", False),
    ("chat off", 1, "chat", "off", False), ("chat auto", 1, "chat", "auto", False),
    ("copy off", 3, "copy", "off", False), ("copy prediction", 3, "copy", "auto", True),
    ("chat off", 3, "chat", "off", False), ("chat auto", 3, "chat", "auto", False),
]


async def _clusters(rounds: int, tokens: int, home: Path, sizes: tuple[int, ...] = (1, 3),
                    tasks: tuple[str, ...] = TASKS, stream_modes: list[tuple[str, str | int, bool]] | None = None,
                    profiles: dict[tuple[str, int], cProfile.Profile] | None = None) -> tuple[Runs, Runs]:
    """The single-stream cases' runs, and the 8 streams' (``stream_modes``: benchmarks/_streams.py)."""
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.config import Config

    config = Config()
    config.scheduler.fault_tolerance.heartbeat_timeout = 30.0
    clusters: dict[int, Coordinator] = {}
    cases = [case for case in CASES if case[1] in sizes and case[2] in tasks]
    runs: Runs = {(name, n): [] for name, n, *_ in cases}
    streams: Runs = {}
    stream_modes = stream_modes or modes("off,auto", 4)
    try:
        for n in sorted(sizes):  # every size asked for: the streams task alone has no case of its own
            c = Coordinator(local_nodes=n, local_backends=["onnx"], strategy="even", config=config,
                            home=home / f"{n}-nodes", persist=False)
            await c.start()
            clusters[n] = c
        answers = {}  # the copies' prediction in the 8 streams: the copy's answer (greedy: every round's)
        for n, c in clusters.items():  # warm up: the first answers run slower
            answers[n] = c.model.tokenizer.decode((await _decode(c, COPY, tokens, "off"))["tokens"])
        for r in range(rounds):  # every other round in the reverse order: no case always runs after the same one
            for name, n, task, mode, predicted in cases if r % 2 == 0 else cases[::-1]:
                messages = COPY if task == "copy" else CHAT
                answer = clusters[n].model.tokenizer.decode(runs[("copy off", n)][-1]["tokens"]) if predicted else None
                runs[(name, n)].append(await _decode(clusters[n], messages, tokens, mode, answer))
            for n, c in clusters.items():  # 8 streams at once: the cluster's throughput (benchmarks/_streams.py)
                if "streams" not in tasks:
                    break
                for name, mode, predicted in stream_modes if r % 2 == 0 else stream_modes[::-1]:
                    profile = profiles.setdefault((name, n), cProfile.Profile()) if profiles is not None else None
                    streams.setdefault((name, n), []).append(await streams_round(
                        _decode, c, COPY, CHAT, tokens, mode, answers[n] if predicted else None, profile))
            if "streams" in tasks and len(stream_modes) > 1:
                print(f"round {r + 1}/{rounds}, {STREAMS} streams ÷ off: " + ", ".join(
                    f"{n} node(s) {name} {streams[(name, n)][-1]['tok_s'] / streams[('off', n)][-1]['tok_s']:.2f}"
                    for n in clusters for name, *_ in stream_modes[1:]), flush=True)
        return runs, streams
    finally:
        for c in clusters.values():
            await c.stop()


DRAFT_CASES = [  # (name, speculation, with the draft model, temperature)
    ("chat off", "off", False, 0.0), ("chat draft auto", "auto", True, 0.0), ("chat draft k=4", 4, True, 0.0),
    ("chat T=0.7 off", "off", False, 0.7), ("chat T=0.7 draft auto", "auto", True, 0.7),
]


async def _draft_clusters(rounds: int, tokens: int, home: Path, sizes: tuple[int, ...], target: Path,
                          draft: Path) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """The draft-model case: ``target`` served on 1 and 3 nodes with ``draft`` as its draft model,
    free chat with and without it, taking turns."""
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.cluster.drafting import load_draft
    from exo_tui.config import Config

    config = Config()
    config.scheduler.fault_tolerance.heartbeat_timeout = 30.0
    clusters: dict[int, Coordinator] = {}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {(name, n): [] for name, *_ in DRAFT_CASES for n in sizes}
    try:
        for n in sizes:
            c = Coordinator(model=str(target), local_nodes=n, local_backends=["onnx"], strategy="even", config=config,
                            home=home / f"draft-{n}-nodes", persist=False)
            await c.start()
            c.draft = load_draft(str(draft), c, c.model)
            clusters[n] = c
        for c in clusters.values():  # warm up, the draft model loaded on its node too
            await _decode(c, CHAT, 16, 4)
        for _ in range(rounds):
            for n, c in clusters.items():
                for name, mode, drafting, temperature in DRAFT_CASES:
                    saved, c.draft = c.draft, c.draft if drafting else None
                    try:
                        runs[(name, n)].append(await _decode(c, CHAT, tokens, mode, temperature=temperature))
                    finally:
                        c.draft = saved
        return runs
    finally:
        for c in clusters.values():
            await c.stop()


def _print_draft(runs: dict[tuple[str, int], list[dict[str, Any]]], sizes: tuple[int, ...], target: Path,
                 draft: Path) -> None:
    def med(key: tuple[str, int]) -> float:
        return statistics.median(r["tok_s"] for r in runs[key])

    print(f"\nA draft model: {draft.name} drafting for {target.name} (llama.cpp's requantization), free chat "
          "(sampled: speculative sampling with the draft's distribution, the same distribution, other draws)\n")
    print("| nodes | case | decode tok/s | ÷ off | acceptance | k chosen (median) | same text as off |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for n in sizes:
        for name, _mode, _drafting, temperature in DRAFT_CASES:
            off = ("chat off" if temperature == 0 else f"chat T={temperature:g} off", n)
            rs = runs[(name, n)]
            drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
            ks = [k for r in rs for k in r["k"]]
            same = all(r["tokens"] == o["tokens"] for r, o in zip(rs, runs[off], strict=True)) if temperature == 0 \
                else "sampled"
            print(f"| {n} | {name} | {med((name, n)):.1f} | {med((name, n)) / med(off):.2f} | "
                  f"{accepted / drafted if drafted else 0:.2f} | {statistics.median(ks) if ks else 0:g} | {same} |")
    if 1 in sizes and 3 in sizes:
        best = max(med(("chat draft auto", 3)), med(("chat draft k=4", 3)))
        print(f"\nHeadline: 3-node ring with the draft model ÷ one node off: {best / med(('chat off', 1)):.2f}x")


def _llama(model: Path, threads: int, tokens: int, rounds: int) -> dict[str, list[float]]:
    """llama.cpp on the copy prompt, without and with LlamaPromptLookupDecoding: decode tok/s."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    out: dict[str, list[float]] = {"llama.cpp off": [], "llama.cpp prompt lookup": []}
    plain = Llama(str(model), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
    lookup = Llama(str(model), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False,
                   draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
    for _ in range(rounds):
        for name, llm in (("llama.cpp off", plain), ("llama.cpp prompt lookup", lookup)):
            stamps = []
            for _chunk in llm.create_chat_completion(COPY, temperature=0.0, max_tokens=tokens, stream=True):
                stamps.append(time.perf_counter())
            n = len(stamps) - 2  # the role chunk and the first token left out
            out[name].append(n / (stamps[-1] - stamps[1]) if n > 0 else 0.0)
    return out


def _split_shards(backend: str) -> tuple[Any, list[Any]]:
    """The default model and its shards, a 3-way split on ``backend`` (the caller closes them)."""
    from exo_tui.inference.local import even_split, load_shards
    from exo_tui.models.catalog import resolve_model
    from exo_tui.models.gguf_file import GGUFModel

    model = GGUFModel(resolve_model())
    return model, load_shards(model, even_split(model.config.n_layers, [backend] * 3))


def _rows_of(model: Any, shard: Any, rng: Any) -> Any:
    """A function of ``t``: random inputs of ``t`` rows for ``shard`` (token ids on the first
    stage, else hidden states)."""
    import numpy as np

    def x_of(t: int) -> np.ndarray:
        if shard.is_first:
            return rng.integers(0, model.config.vocab_size, size=t)
        return rng.standard_normal((t, model.config.hidden_size)).astype(np.float32)

    return x_of


def _stage_costs(ks: list[int], repeats: int, backend: str) -> list[tuple[str, int, float, dict[str, float]]]:
    """Per stage of a 3-way split of the default model on ``backend``, after 200 positions cached:
    a 1-row step's median CPU seconds (the last stage's with its token drawn), and a (k + 1)-row
    verify step's as the node runs it. On the last stage three ways: ``all``, the head on every row
    (``forward(all_logits=True)``, as before ``Shard.forward_rows``) and the check; ``rejected``,
    the rows head read as a check that rejects the first draft reads it (row 0); ``accepted``, as
    one that accepts every draft (every row). CPU time of this process: on a shared machine a
    step's wall time measures the neighbours as much as the step."""
    import numpy as np

    from exo_tui.inference.sampling import Length, Sampler, SamplingParams

    model, shards = _split_shards(backend)
    sampler = Sampler(SamplingParams(temperature=0.0))
    rows_out = []
    try:
        rng = np.random.default_rng(0)
        for shard in shards:
            x_of = _rows_of(model, shard, rng)
            shard.forward("warm", x_of(200), np.arange(200))

            def timed(t: int, how: str, shard: Any = shard, x_of: Any = x_of) -> float:
                times = []
                for _ in range(repeats + 1):
                    x, pos = x_of(t), np.arange(200, 200 + t)
                    t0 = time.process_time()
                    if not shard.is_last:
                        shard.forward("warm", x, pos)
                    elif how == "all" or t == 1:
                        out = shard.forward("warm", x, pos, all_logits=True)
                        for i in range(1 if how == "rejected" else t):
                            sampler.sample(out[i], Length(200 + i))
                    else:
                        rows = shard.forward_rows("warm", x, pos)
                        for i in range(1 if how == "rejected" else t):
                            sampler.sample(rows[i], Length(200 + i))
                    times.append(time.process_time() - t0)
                    shard.truncate_kv("warm", 200)
                return statistics.median(times[1:])

            one = timed(1, "rejected")
            name = f"[{shard.start}, {shard.end})" + (" + head" if shard.is_last else "")
            for k in ks:
                ways = ("all", "rejected", "accepted") if shard.is_last else ("all",)
                rows_out.append((name, k, one, {how: timed(k + 1, how) for how in ways}))
    finally:
        for shard in shards:
            shard.close()
    return rows_out


def _print_stage_costs(ks: list[int], repeats: int, backends: list[str]) -> None:
    print("\nA verify step's cost per stage (3-way split, 200 positions cached, one thread, CPU time): (k + 1)-row "
          "step ÷ 1-row step. Last stage: the head on every row (all) / on the rows a check reads that rejects the "
          "first draft (rejected) / that accepts every draft (accepted)\n")
    print("| backend | stage | 1 row, ms | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|---|---:|" + "---:|" * len(ks))
    for backend in backends:
        costs = _stage_costs(ks, repeats, backend)
        for stage in dict.fromkeys(c[0] for c in costs):
            mine = [c for c in costs if c[0] == stage]
            cells = [" / ".join(f"{v / c[2]:.2f}" for v in c[3].values()) for c in mine]
            print(f"| {backend} | {stage} | {mine[0][2] * 1000:.2f} | " + " | ".join(cells) + " |")


def _batch_costs(ks: list[int], repeats: int, backend: str) -> list[tuple[str, int, float, float, float]]:
    """Per stage of a 3-way split of the default model on ``backend``, 8 streams at 200 positions
    cached: the CPU seconds of their batched decode step, and of that step with one stream's
    verify step of ``k + 1`` rows instead of its token, in the batch (``forward_batch``, every row's
    logits on the last stage) and apart (the other 7 batched, the verify step alone: a second
    pass over the weights). Medians."""
    import numpy as np

    model, shards = _split_shards(backend)
    rids = [f"s{i}" for i in range(STREAMS)]
    out = []
    try:
        rng = np.random.default_rng(0)
        for shard in shards:
            x_of = _rows_of(model, shard, rng)
            for rid in rids:
                shard.forward(rid, x_of(200), np.arange(200))

            def timed(rows: int, together: bool, shard: Any = shard, x_of: Any = x_of) -> float:
                times = []
                for _ in range(repeats + 1):
                    items = [(rid, x_of(rows if i == 0 else 1), np.arange(200, 200 + (rows if i == 0 else 1)))
                             for i, rid in enumerate(rids)]
                    every = [0] if shard.is_last and rows > 1 else []
                    t0 = time.process_time()
                    if together or rows == 1:
                        shard.forward_batch(items, every)
                    else:
                        shard.forward_batch(items[1:])
                        shard.forward(*items[0], all_logits=shard.is_last)
                    times.append(time.process_time() - t0)
                    for rid in rids:
                        shard.truncate_kv(rid, 200)
                return statistics.median(times[1:])

            plain = timed(1, True)
            name = f"[{shard.start}, {shard.end})" + (" + head" if shard.is_last else "")
            out += [(name, k, plain, timed(k + 1, True), timed(k + 1, False)) for k in ks]
    finally:
        for shard in shards:
            shard.close()
    return out


def _print_batch_costs(ks: list[int], repeats: int, backends: list[str]) -> None:
    print(f"\nA verify step among {STREAMS} streams' decode steps, per stage (3-way split, 200 positions cached, one "
          "thread, CPU time): the step with one stream's k + 1 rows ÷ the plain batched step, its rows in the batch / "
          "apart (a pass of its own)\n")
    print(f"| backend | stage | {STREAMS} streams, ms | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|---|---:|" + "---:|" * len(ks))
    for backend in backends:
        costs = _batch_costs(ks, repeats, backend)
        for stage in dict.fromkeys(c[0] for c in costs):
            mine = [c for c in costs if c[0] == stage]
            cells = [f"{c[3] / c[2]:.2f} / {c[4] / c[2]:.2f}" for c in mine]
            print(f"| {backend} | {stage} | {mine[0][2] * 1000:.2f} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of every node and of llama.cpp (EXO_TUI_THREADS; on a loaded shared machine, spinning "
                         "threads of 2 lose most of their time to each other)")
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--no-draft", action="store_true", help="leave the draft-model case out")
    ap.add_argument("--draft-only", action="store_true", help="the draft-model case alone")
    ap.add_argument("--ks", default="1,4,8,16,32", help="drafted tokens whose step cost is measured per stage")
    ap.add_argument("--nodes", default="1,3", help="the clusters' sizes: 1, 3 or 1,3")
    ap.add_argument("--repeats", type=int, default=15, help="steps timed per stage and k (medians)")
    ap.add_argument("--stage-backends", default=",".join(b for b in ("onnx", "mlx") if b in available_backends()),
                    help="the backends whose verify step is timed per stage")
    ap.add_argument("--batch-backends", default="onnx",
                    help="the backends whose verify step among 8 streams is timed per stage (MLX on the CPU: minutes)")
    ap.add_argument("--stages-only", action="store_true", help="only the verify step's cost per stage")
    ap.add_argument("--no-stages", action="store_true", help="leave the verify step's cost per stage out")
    ap.add_argument("--stream-k", type=int, default=4,
                    help="the fixed k of the 8 streams' case whose copies run their prediction at that k")
    ap.add_argument("--stream-modes", default="off,auto,predicted,fixed",
                    help="the 8 streams' modes, each against off: some of auto, predicted (the copies with their "
                         "prediction, auto), fixed (the same at --stream-k)")
    ap.add_argument("--profile", action="store_true", help="the coordinator's busiest functions in each 8 streams' mode")
    ap.add_argument("--tasks", default=",".join(TASKS), help="the cases run on the clusters: some of copy,chat,streams")
    args = parse(ap, rounds=1, tokens=8, ks="1,4", nodes="1", repeats=2)
    sizes = tuple(int(n) for n in args.nodes.split(","))
    if not set(sizes) <= {1, 3}:
        ap.error("--nodes takes 1, 3 or 1,3")
    tasks = tuple(t for t in args.tasks.split(",") if t)
    if not tasks or not set(tasks) <= set(TASKS):
        ap.error(f"--tasks takes some of {','.join(TASKS)}")
    try:
        stream_modes = modes(args.stream_modes, args.stream_k)
    except ValueError as exc:
        ap.error(str(exc))
    profiles: dict[tuple[str, int], cProfile.Profile] | None = {} if args.profile else None
    os.environ["EXO_TUI_THREADS"] = str(args.threads)  # the node processes and this process's shards read it
    if not args.no_llama and not have_llama_cpp():
        args.no_llama = True
    if not args.no_draft and importlib.util.find_spec("llama_cpp") is None:
        print("draft model: skipped (the F16 target is made by llama.cpp's quantizer, and llama_cpp is not installed)")
        args.no_draft = True
    from exo_tui.models.catalog import resolve_model
    from exo_tui.net import loop as event_loop

    if args.stages_only:
        _print_stage_costs([int(k) for k in args.ks.split(",")], args.repeats, args.stage_backends.split(","))
        _print_batch_costs([int(k) for k in args.ks.split(",")], args.repeats, args.batch_backends.split(","))
        return
    draft_runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="exo-bench-") as d:
        runs, streams = ({}, {}) if args.draft_only else event_loop.run(
            _clusters(args.rounds, args.tokens, Path(d), sizes, tasks, stream_modes, profiles))
        if not args.no_draft:
            from benchmarks.draft_f16 import default_out_dir, f16_requantization

            draft = resolve_model()
            target = f16_requantization(draft, default_out_dir())
            draft_runs = event_loop.run(_draft_clusters(args.rounds, args.tokens, Path(d), sizes, target, draft))
    if args.draft_only:
        if draft_runs:
            _print_draft(draft_runs, sizes, target, draft)
        return
    llama = {} if args.no_llama or "copy" not in tasks else _llama(resolve_model(), args.threads, args.tokens, args.rounds)

    def med(key: tuple[str, int]) -> float:
        return statistics.median(r["tok_s"] for r in runs[key])

    print(f"\nThe default model, greedy, {args.tokens} tokens, ONNX node processes on loopback, {args.rounds} rounds "
          f"taking turns, medians (a shared 2-core machine: noisy)\n")
    print("| nodes | case | decode tok/s | ÷ off | drafted | accepted | acceptance | not run: proposed / would keep | "
          "k chosen (median) | same text as off |")
    print("|---:|---|---:|---:|---:|---:|---:|---|---:|---|")
    for name, n, task, _mode, _p in (case for case in CASES if case[1] in sizes and case[2] in tasks):
        off = (f"{task} off", n)
        drafted = sum(r["drafted"] for r in runs[(name, n)])  # all rounds' drafts
        accepted = sum(r["accepted"] for r in runs[(name, n)])
        ks = [k for r in runs[(name, n)] for k in r["k"]]
        same = all(r["tokens"] == o["tokens"] for r, o in zip(runs[(name, n)], runs[off], strict=True))
        shadow = "{} / {}".format(*(sum(r[f] for r in runs[(name, n)]) for f in ("shadowed", "shadow_kept")))
        print(f"| {n} | {name} | {med((name, n)):.1f} | {med((name, n)) / med(off):.2f} | {drafted} | {accepted} | "
              f"{accepted / drafted if drafted else 0:.2f} | {shadow} | {statistics.median(ks) if ks else 0:g} | {same} |")
    if "streams" in tasks:
        print_streams(streams, sizes, [name for name, *_ in stream_modes], args.rounds, args.tokens)
        print_profiles(profiles or {})
    if sizes == (1, 3) and "copy" in tasks:
        print(f"\nHeadline: 3-node ring, copy with the prediction ÷ one node off: "
              f"{med(('copy prediction', 3)) / med(('copy off', 1)):.2f}x")
    if llama and 1 in sizes:
        ref = statistics.median(llama["llama.cpp prompt lookup"])
        print(f"\nllama.cpp ({args.threads} threads), copy prompt: off {statistics.median(llama['llama.cpp off']):.1f} "
              f"tok/s, LlamaPromptLookupDecoding {ref:.1f} tok/s")
        print(f"exo-tui one node, copy with prompt lookup ÷ llama.cpp prompt lookup: {med(('copy lookup', 1)) / ref:.2f}x; "
              f"with the prediction: {med(('copy prediction', 1)) / ref:.2f}x")
    if draft_runs:
        _print_draft(draft_runs, sizes, target, draft)
    if not args.no_stages:
        _print_stage_costs([int(k) for k in args.ks.split(",")], args.repeats, args.stage_backends.split(","))
        _print_batch_costs([int(k) for k in args.ks.split(",")], args.repeats, args.batch_backends.split(","))


if __name__ == "__main__":
    main()
