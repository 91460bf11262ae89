"""What a typed forward body costs a hop: the step's body decoded and checked where it arrives, and
the next hop's built and encoded, against the untyped dict handling it replaced.

Per forward frame, a node reads the body (the dispatch's decode; then the executor's fields) and
sends the next hop's (its body with ``hop``, ``timing`` and ``more`` changed, encoded). Both ways
are timed in one run, interleaved, on the same bodies: a decode step's, one with a 512-token
history (a sampler with a repetition penalty sends it on every step) and a scored prompt's.
``decode``: the typed body's check alone (the dispatch's ``Forward.decode``); ``frame codec``: the
whole frame's encoding and decoding (header, body and a 576-float hidden state), for scale.

    python benchmarks/wire_bodies.py [--frames 20000] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402
from exo_tui.net.frame import Frame, decode_frame, frame_bytes  # noqa: E402
from exo_tui.net.messages import Forward  # noqa: E402

TIMING = [["n-0123456789ab", 3.1e-05, 0.0012, 1796641838.5144386, 1796641838.5152495]]
BODIES = {
    "decode step": {"rid": "chatcmpl-5f1c2a", "hop": 1, "pos": 211, "step": 17, "n_tokens": 212,
                    "sampling": {"temperature": 0.7, "top_p": 0.9, "seed": 1234}, "timing": TIMING, "more": 3},
    "history 512": {"rid": "chatcmpl-5f1c2a", "hop": 1, "pos": 511, "step": 17, "n_tokens": 512,
                    "sampling": {"temperature": 0.7, "repeat_penalty": 1.1}, "history": list(range(512)),
                    "timing": TIMING},
    "scored prompt": {"rid": "cmpl-9", "hop": 1, "pos": 0, "step": 0, "n_tokens": 64, "sampling": {},
                      "score": {"top": 1, "targets": list(range(1, 64))}, "logprobs": 1, "timing": TIMING},
}


def untyped(body: dict[str, Any]) -> dict[str, Any]:
    """What the node did with the dict before typed bodies (agent, executor, sampling_step)."""
    hop = int(body["hop"])
    rid = body.get("rid")
    adopt = body.get("adopt")
    _ = type(adopt) is str
    more = body.get("more")
    _ = type(more) is int and more > 0
    _ = str(body.get("rid")), hop
    _ = body["rid"], int(body["pos"]), body.get("adopt"), "score" in body, body.get("fill")
    score = body.get("score")
    if score is not None and (type(score) is not dict or type(score.get("top")) is not int
                              or type(score.get("targets")) is not list or any(type(t) is not int for t in score["targets"])):
        raise ValueError("score")
    timing = body.get("timing")
    timing = [*(timing if type(timing) is list else ()), TIMING[0]]
    out = dict(body)
    out["hop"] = hop + 1
    out["timing"] = timing
    out.pop("more", None)
    _ = rid
    return out


def typed(body: dict[str, Any]) -> dict[str, Any]:
    """The same with a typed body: decoded and checked once, the next hop's built from it."""
    msg = Forward.decode(body)
    _ = msg.rid, msg.hop, msg.adopt, msg.more, msg.pos, msg.score, msg.fill
    return msg.copy(hop=msg.hop + 1, timing=[*(msg.timing or ()), TIMING[0]], more=0).to_body()


def per_frame_us(fn: Any, body: dict[str, Any], frames: int) -> float:
    t0 = time.perf_counter()
    for _ in range(frames):
        fn(body)
    return (time.perf_counter() - t0) / frames * 1e6


def frame_us(body: dict[str, Any], frames: int) -> float:
    frame = Frame("forward", body=body, tensor=np.zeros((1, 576), np.float32), plan=3)
    t0 = time.perf_counter()
    for _ in range(frames):
        decode_frame(frame_bytes(frame))
    return (time.perf_counter() - t0) / frames * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = parse(ap, frames=200, rounds=1)
    frames, rounds = args.frames, args.rounds
    for body in BODIES.values():  # the same bodies both ways
        assert typed(body) == {k: v for k, v in untyped(body).items() if k != "more"}
    print(f"per forward frame, median of {rounds} rounds of {frames} (us)")
    print(f"{'body':<14} {'untyped':>8} {'typed':>8} {'extra':>8} {'decode':>8} {'frame codec':>12}")
    for name, body in BODIES.items():
        old, new, dec = [], [], []
        for _ in range(rounds):
            old.append(per_frame_us(untyped, body, frames))
            new.append(per_frame_us(typed, body, frames))
            dec.append(per_frame_us(Forward.decode, body, frames))
        codec = frame_us(body, max(1, frames // 4))
        o, n = statistics.median(old), statistics.median(new)
        print(f"{name:<14} {o:8.2f} {n:8.2f} {n - o:8.2f} {statistics.median(dec):8.2f} {codec:12.2f}")


if __name__ == "__main__":
    main()
