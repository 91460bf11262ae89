"""A shard drops a speculative step's rejected positions (``Shard.truncate_kv``): drafted tokens
run as one step, some of them cut back, the request goes on, and every later position's logits
are those of a run that never saw them (transformers' logits of the fixture's tokens), on ONNX
(the kernel's rings, and GroupQueryAttention's full-length caches) and MLX, whole and split, on
Gemma 3's windowed layers (rings of 8 + MAX_DRAFT rows) and a plain llama. Every (length, to)
pair either goes back and matches, or is refused with a BackendError (and the cache is as it
was); within MAX_DRAFT positions it is never refused."""

from __future__ import annotations

import numpy as np
import pytest

from backends.base import MAX_DRAFT, BackendError
from tests.unit.test_family_logits import BACKENDS, DENSE, assert_close, backend, fixture

MODELS = {name: next(e for e in DENSE if e["name"] == name) for name in ("gemma3", "llama3")}
JUNK = np.random.default_rng(7).integers(3, 500, size=64)  # drafts nobody would accept


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return fixture(MODELS[request.param])


def load(model, name: str, plan: list[tuple[int, int]]) -> list:
    return [backend(name).load_shard(model.config, model.shard_weights(a, b)) for a, b in plan]


def step(shards: list, rid: str, x: np.ndarray, start: int) -> np.ndarray:
    """One step of ``x`` at ``start ..`` through ``shards``: every row's logits."""
    pos = np.arange(start, start + len(x))
    for shard in shards:
        x = shard.forward(rid, x, pos, all_logits=shard.is_last)
    return x


def close(shards: list) -> None:
    for shard in shards:
        shard.close()


PLANS = {"whole": lambda n: [(0, n)], "split": lambda n: [(0, 1), (1, n)]}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", BACKENDS)
def test_drafts_partly_accepted_then_cut_back(model, name: str, plan: str) -> None:
    """From several points of the sequence (before, at and past the ring's rows), a verify step of
    the true token and k drafts of which the first ``a`` are right: its rows' logits are the true
    ones up to the first wrong draft, the rest go, and the request goes on from there."""
    gguf, tokens, want = model
    shards = load(gguf, name, PLANS[plan](gguf.config.n_layers))
    try:
        step(shards, "r", tokens[:5], 0)
        pos = 5
        for k, accepted in ((4, 0), (6, 3), (MAX_DRAFT, 2), (3, 3), (MAX_DRAFT, 0), (2, 1), (5, 4),
                            (MAX_DRAFT, 5), (8, 8), (MAX_DRAFT, 1)):
            drafts = np.concatenate([tokens[pos : pos + 1 + accepted], JUNK[: k - accepted]])
            out = step(shards, "r", drafts, pos)
            assert out.shape[0] == 1 + k
            assert_close(out[: 1 + accepted], want[pos : pos + 1 + accepted], f"{name} {plan}: verify step at {pos}")
            pos += 1 + accepted
            for shard in shards:
                shard.truncate_kv("r", pos)
            assert [s.kv_length("r") for s in shards] == [pos] * len(shards)
        assert pos == 42
        rest = [step(shards, "r", tokens[p : p + 1], p) for p in range(pos, len(tokens))]  # decode steps
        assert_close(np.concatenate(rest), want[pos:], f"{name} {plan}: the rest after the cuts")
    finally:
        close(shards)


@pytest.mark.parametrize("name", [*BACKENDS, "onnx-gqa"])
def test_every_cut_goes_back_or_is_refused(model, name: str, monkeypatch) -> None:
    """A cache of ``length`` positions (the true ``to`` and junk after them, as a verify step
    leaves it) cut back to ``to``: then what it exports is what a cache of the true ``to``
    exports (every layer's last window, none of it junk) and the next positions' logits are the
    true ones, or a BackendError refuses the cut and leaves the cache as it was. A cut of at most
    MAX_DRAFT positions is never refused."""
    gguf, tokens, want = model
    if name == "onnx-gqa":
        if "onnx" not in BACKENDS:
            pytest.skip("needs ONNX Runtime")
        from backends.onnx import kernels

        monkeypatch.setattr(kernels, "_enabled", False)  # full-length caches: every cut goes
        name = "onnx"
    [shard] = load(gguf, name, [(0, gguf.config.n_layers)])
    refused, done = 0, 0
    try:
        for to in (0, 1, 7, 8, 13, 20, 33, 40, 44):
            if to:
                step([shard], "true", tokens[:to], 0)
                true = shard.export_kv("true")
                shard.drop("true")
            for dropped in (1, 2, 7, MAX_DRAFT - 1, MAX_DRAFT, MAX_DRAFT + 1, MAX_DRAFT + 9):
                rid = f"{to}-{dropped}"
                if to:
                    step([shard], rid, tokens[:to], 0)
                step([shard], rid, JUNK[:dropped], to)
                try:
                    shard.truncate_kv(rid, to)
                except BackendError as exc:
                    assert dropped > MAX_DRAFT, f"{name}: {dropped} positions back from {to + dropped}: {exc}"
                    assert shard.kv_length(rid) == to + dropped
                    refused += 1
                    shard.drop(rid)
                    continue
                assert shard.kv_length(rid) == to
                if to:
                    cut = shard.export_kv(rid)
                    for layer, (k, v, tk, tv) in enumerate(zip(cut.keys, cut.values, true.keys, true.values, strict=True)):
                        where = f"{name}: {to + dropped} cut back to {to}, layer {layer}"
                        assert_close(k, tk, f"{where}'s keys")
                        assert_close(v, tv, f"{where}'s values")
                got = np.concatenate([step([shard], rid, tokens[to : to + 1], to),  # a decode step,
                                      step([shard], rid, tokens[to + 1 : to + 3], to + 1)])  # then two rows
                assert_close(got, want[to : to + 3], f"{name}: {to + dropped} cut back to {to}")
                shard.drop(rid)
                done += 1
    finally:
        shard.close()
    windowed = gguf.config.ring_window and shard.ring_layers
    assert done and (refused > 0) == bool(windowed)  # rings refuse the long cuts past their rows, only they


@pytest.mark.parametrize("name", BACKENDS)
def test_an_imported_ring_is_not_cut_back_past_what_came(name: str) -> None:
    """An import brings a ring the window's positions only: the cache goes back to where it
    came in, not before (those positions never came), and on from there it matches."""
    gguf, tokens, want = fixture(MODELS["gemma3"])
    [src] = load(gguf, name, [(0, 6)])
    [dst] = load(gguf, name, [(0, 6)])
    try:
        step([src], "r", tokens[:20], 0)
        dst.import_kv("r", src.export_kv("r"))
        with pytest.raises(BackendError, match="cannot go back to 19"):
            dst.truncate_kv("r", 19)
        step([dst], "r", JUNK[:5], 20)
        dst.truncate_kv("r", 20)
        assert_close(step([dst], "r", tokens[20:24], 20), want[20:24], f"{name}: imported, drafted, cut back")
    finally:
        close([src, dst])


def batch(shards: list, items: list[tuple[str, np.ndarray, int]], verify: int) -> list[np.ndarray]:
    """One batch of steps ``(request, tokens, first position)`` through ``shards`` (as nodes run
    them: ``forward_batch`` on each), item ``verify`` a verify step (every row's logits)."""
    xs = [x for _, x, _ in items]
    for shard in shards:
        xs = shard.forward_batch([(rid, x, np.arange(p, p + len(t))) for (rid, t, p), x in zip(items, xs, strict=True)],
                                 [verify] if shard.is_last else [])
    return xs


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", [*BACKENDS, "onnx-gqa"])
def test_a_verify_step_in_a_batch_of_decode_steps(model, name: str, plan: str, monkeypatch) -> None:
    """A batch of two decode steps and a verify step's rows (as a node runs requests that are at
    its shard together; on ONNX's kernel the verify step's rows are rows of the batch, sharing its
    slot, and on MLX its tokens are rows of the batch's eager step): each one's logits are the model's, the verify step's every row is, bit for bit, what it
    gives run alone, and after its rejected rows are cut back all three go on right."""
    gguf, tokens, want = model
    if name == "onnx-gqa":  # GroupQueryAttention: the verify step runs alone
        if "onnx" not in BACKENDS:
            pytest.skip("needs ONNX Runtime")
        from backends.onnx import kernels

        monkeypatch.setattr(kernels, "_enabled", False)
        name = "onnx"
    shards = load(gguf, name, PLANS[plan](gguf.config.n_layers))
    try:
        for rid, n in (("a", 9), ("b", 14), ("v", 20)):
            step(shards, rid, tokens[:n], 0)
        drafts = np.concatenate([tokens[20:23], JUNK[:3]])  # the true token, 2 right drafts, 3 wrong
        a, v, b = batch(shards, [("a", tokens[9:10], 9), ("v", drafts, 20), ("b", tokens[14:15], 14)], verify=1)
        assert_close(a, want[9:10], f"{name} {plan}: decode a")
        assert_close(b, want[14:15], f"{name} {plan}: decode b")
        assert v.shape[0] == 6
        assert_close(v[:3], want[20:23], f"{name} {plan}: the verify step's rows up to its first wrong draft")
        assert [s.kv_length(r) for s in shards for r in "avb"] == [10, 26, 15] * len(shards)
        for shard in shards:
            shard.truncate_kv("v", 20)
        assert np.array_equal(step(shards, "v", drafts, 20), v)  # alone: the same numbers
        for shard in shards:  # the rejected rows go
            shard.truncate_kv("v", 23)
        a, v, b = batch(shards, [("a", tokens[10:11], 10), ("v", tokens[23:27], 23), ("b", tokens[15:16], 15)],
                        verify=1)
        assert_close(np.concatenate([a, b, v]), want[[10, 15, 23, 24, 25, 26]], f"{name} {plan}: after the cut")
        assert [s.kv_length(r) for s in shards for r in "avb"] == [11, 27, 16] * len(shards)
    finally:
        close(shards)
