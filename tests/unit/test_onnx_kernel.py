"""exo-tui's ONNX Runtime kernel QLinear (backends/onnx/kernels): built here, checked against
NumPy for each instruction set it has code for, the same numbers for a row whatever the batch,
and a clear fallback where it cannot be built."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging

import numpy as np
import pytest

from backends.kquants import GROUP, decode
from backends.onnx import kernels
from backends.weights import BLOCK_TYPES, QuantizedWeight
from tests.factory import random_kquant_blocks
from tests.reference import ReferenceShard
from tests.unit.test_onnx_backend import PROMPT, close, load

KQUANTS = list(kernels.KQUANT)
LEGACY = list(BLOCK_TYPES)  # GGUF's blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0


def stacked(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Matrices of one kind as one, as ``pack`` stacks them."""
    w = weights[0]
    return QuantizedWeight(np.concatenate([a.q for a in weights]), np.concatenate([a.scales for a in weights]),
                           np.concatenate([a.biases for a in weights]), bits=w.bits, group=w.group,
                           source_type=w.source_type)


def from_file_blocks(rng: np.random.Generator, rows: int, cols: int, type_name: str) -> QuantizedWeight:
    """A K-quant matrix as the GGUF reader decodes it, from random super-blocks with a random
    float16 d (and dmin) each."""
    raw = random_kquant_blocks(rng, rows, cols, type_name, 0.05).reshape(rows, cols // 256, -1)
    half = (rng.standard_normal((rows, cols // 256, 2)) * 1e-3).astype(np.float16)  # d (and dmin) of each
    if type_name == "Q6_K":
        raw[..., 208:210] = half[..., :1].view(np.uint8)
    else:
        raw[..., 0:4] = np.abs(half).view(np.uint8).reshape(rows, cols // 256, 4)
    q, scales, biases = decode(raw.reshape(rows, -1), type_name, cols)
    return QuantizedWeight(q, scales, biases, bits=int(type_name[1]), group=GROUP[type_name], source_type=type_name)


@pytest.fixture(scope="module")
def library() -> kernels.Library:
    """The kernel built here. Skips only where there is no C compiler (the fallback is tested
    below); a kernel that builds but fails its own check against NumPy fails these tests."""
    lib = kernels.library()
    if lib is None:
        why = kernels.unavailable()
        if why is None:
            pytest.skip("the kernel is turned off here (node.onnx.kernel, EXO_TUI_ONNX_KERNEL=0)")
        if isinstance(why, kernels.NoCompiler):
            pytest.skip(f"{why} (the fallback is tested below)")
        pytest.fail(f"the kernel is not used here: {why}")
    return lib


@pytest.mark.parametrize("type_name", LEGACY)
def test_the_kernel_is_float32_math_on_the_dequantized_matrix(library: kernels.Library, type_name: str) -> None:
    rng = np.random.default_rng(1)
    a, b = kernels.random_legacy(rng, 40, 576, type_name), kernels.random_legacy(rng, 3032, 576, type_name)
    bits = BLOCK_TYPES[type_name]
    assert kernels.kernel_format(a) == f"Q{bits}" and kernels.op_attributes(a) == {"bits": bits}
    blob = kernels.pack([a, b])  # two stacked, N not a multiple of 32
    assert blob.shape == (96, 18, kernels.TILE_BLOCK_BYTES[bits]) and blob.dtype == np.uint8
    w = np.concatenate([a.dequantize(), b.dequantize()]).astype(np.float64)
    for m in (1, 2, 7, 8, 9, 33):
        x = rng.standard_normal((m, 576)).astype(np.float32)
        y = kernels.run_in_session(library.path, x, blob, bits, 3072)
        want = x.astype(np.float64) @ w.T
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), m


@pytest.mark.parametrize("type_name", KQUANTS)
@pytest.mark.parametrize(("rows", "k"), [((33,), 256), ((40, 300), 768), ((70,), 4096)])
def test_kquants_are_float32_math_on_their_dequantized_matrix(library: kernels.Library, type_name: str,
                                                              rows: tuple[int, ...], k: int) -> None:
    """Q4_K, Q5_K and Q6_K from their super-blocks' d and integer scales (N not whole tiles, one
    super-block to sixteen along K, matrices stacked): as near the float64 product as GGUF's own
    blocks of 32 are, in a session and called directly, the same numbers both ways."""
    rng = np.random.default_rng(11 + k)
    parts = [from_file_blocks(rng, n, k, type_name) if i else kernels.random_kquant(rng, n, k, type_name)
             for i, n in enumerate(rows)]
    n = sum(rows)
    blob = kernels.pack(parts)
    assert blob.shape == (-(-n // 32), k // 256, kernels.SUPER_BYTES[type_name]) and blob.dtype == np.uint8
    attrs = kernels.op_attributes(parts[0])
    assert attrs == {"bits": int(type_name[1]), "kquant": kernels.KQUANT[type_name]}
    w = stacked(parts)
    x = rng.standard_normal((33, k)).astype(np.float32)
    want = kernels.float_reference(x, w)
    for m in (1, 2, 7, 8, 9, 33):
        y = kernels.run_in_session(library.path, x[:m], blob, n=n, **attrs)
        assert np.abs(y - want[:m]).max() <= 1e-5 * np.abs(want).max(), m
        assert np.array_equal(kernels.call(ctypes.CDLL(library.path), x[:m], blob, n=n, **attrs), y), m


@pytest.mark.parametrize("type_name", KQUANTS)
def test_kquant_tiles_stay_near_the_files_bytes(type_name: str) -> None:
    """What a node holds for a K-quant matrix on the kernel, against its bytes in the file: Q4_K
    within 1.1 times (4.625 bits a weight against 4.5), Q5_K too (5.63 against 5.5), Q6_K within
    1.35 (8.56 against 6.56: its codes in bytes)."""
    rng = np.random.default_rng(12)
    w = kernels.random_kquant(rng, 256, 2048, type_name)
    ratio = {"Q4_K": 1.03, "Q5_K": 1.02, "Q6_K": 1.0}[type_name]
    for xbits in (0, 16, 8):
        blob = kernels.pack([w], xbits)
        assert blob.nbytes / w.nbytes == pytest.approx(ratio, abs=0.01), xbits


@pytest.mark.parametrize("type_name", LEGACY)
def test_blocks_of_32_take_their_tile_bytes(type_name: str) -> None:
    """What a node holds for a matrix of GGUF's blocks of 32 on the kernel, at every precision: a
    float16 scale and bias beside the codes, 5-bit codes' bit 4 in a plane (Q4_0 and Q4_1 0.625
    bytes a weight, the file's 0.5625 and 0.625; Q5_0 and Q5_1 0.75, the file's 0.6875 and 0.75;
    Q8_0 1.125, the file's 1.0625), as ``packed_nbytes`` counts it."""
    rng = np.random.default_rng(17)
    w = kernels.random_legacy(rng, 256, 2048, type_name)
    per_weight = {4: 0.625, 5: 0.75, 8: 1.125}[BLOCK_TYPES[type_name]]
    for xbits in (0, 16, 8):
        blob = kernels.pack([w], xbits)
        assert blob.nbytes == 256 * 2048 * per_weight == kernels.tiles.packed_nbytes(type_name, 256, 2048), xbits


@pytest.mark.parametrize("type_name", KQUANTS)
@pytest.mark.parametrize(("xbits", "near"), [(16, (1e-7, 1e-3)), (8, (1e-4, 0.05))])
def test_kquants_at_the_integer_precisions(integer_library: kernels.Library, type_name: str, xbits: int,
                                           near: tuple[float, float]) -> None:
    """The int16 and int8 products of K-quant blocks (Q6_K's groups of 16 two partial sums a block,
    its codes' offset of 32 taken out in integers): as their float64 model, near the float32 result."""
    rng = np.random.default_rng(13 + xbits)
    parts = [kernels.random_kquant(rng, 40, 1280, type_name), from_file_blocks(rng, 61, 1280, type_name)]
    blob = kernels.pack(parts, xbits)
    w = stacked(parts)
    for m in (1, 3, 4, 5, 9, 17):
        x = rng.standard_normal((m, 1280)).astype(np.float32)
        x[0, :32] = 0.0  # a block of zeros has scale 0
        x[-1, 32:64] *= 1e4  # and a block's largest value takes the largest code
        y = kernels.run_in_session(integer_library.path, x, blob, n=101, xbits=xbits, **kernels.op_attributes(w))
        want = kernels.integer_reference(x, w, xbits)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), m
        exact = kernels.float_reference(x, w)
        assert near[0] < np.abs(y - exact).max() / np.abs(exact).max() < near[1], m


@pytest.mark.parametrize("xbits", [0, 16, 8])
def test_kquant_rows_do_not_depend_on_their_batch(library: kernels.Library, xbits: int) -> None:
    if xbits and not library.integer:
        pytest.skip(f"this CPU's {library.isa} build has no integer products")
    rng = np.random.default_rng(14)
    for type_name in KQUANTS:
        w = kernels.random_kquant(rng, 300, 512, type_name)
        blob, attrs = kernels.pack([w], xbits), kernels.op_attributes(w)
        x = rng.standard_normal((37, 512)).astype(np.float32)
        together = kernels.run_in_session(library.path, x, blob, n=300, xbits=xbits, **attrs)
        for i in (0, 5, 36):
            alone = kernels.run_in_session(library.path, x[i : i + 1], blob, n=300, xbits=xbits, **attrs)[0]
            assert np.array_equal(alone, together[i]), (type_name, i)


def test_a_rows_numbers_do_not_depend_on_its_batch(library: kernels.Library) -> None:
    """Each row is reduced in the same order whatever the number of rows: a request's logits are
    the same bits decoded alone or beside others."""
    rng = np.random.default_rng(2)
    for bits in (4, 5, 8):
        blob = kernels.pack([QuantizedWeight.random(rng, 300, 1536, bits)])
        x = rng.standard_normal((13, 1536)).astype(np.float32)
        together = kernels.run_in_session(library.path, x, blob, bits, 300)
        for i in (0, 7, 12):
            alone = kernels.run_in_session(library.path, x[i : i + 1], blob, bits, 300)[0]
            assert np.array_equal(alone, together[i]), (bits, i)


@pytest.fixture(scope="module")
def integer_library(library: kernels.Library) -> kernels.Library:
    if not library.integer:
        pytest.skip(f"this CPU's {library.isa} build has no integer products (they need AVX2 or AVX-512 VNNI)")
    return library


@pytest.mark.parametrize("type_name", LEGACY)
@pytest.mark.parametrize(("xbits", "near"), [(16, (1e-7, 1e-3)), (8, (1e-4, 0.05))])
def test_the_integer_precisions_are_integer_products_of_rounded_rows(
    integer_library: kernels.Library, type_name: str, xbits: int, near: tuple[float, float]
) -> None:
    """Each block of a row rounded to int16 or int8 (as llama.cpp's Q8_0) with one scale: the
    kernel agrees with that computed in float64, and is near (not equal to) the float32 result,
    int16 about 256 times nearer than int8."""
    rng = np.random.default_rng(5)
    a, b = kernels.random_legacy(rng, 40, 576, type_name), kernels.random_legacy(rng, 3032, 576, type_name)
    bits = BLOCK_TYPES[type_name]
    blob = kernels.pack([a, b], xbits)
    assert blob.shape == (96, 18, kernels.TILE_BLOCK_BYTES[bits])
    both = stacked([a, b])
    for m in (1, 3, 4, 5, 17):
        x = rng.standard_normal((m, 576)).astype(np.float32)
        x[0, :32] = 0.0  # a block of zeros has scale 0
        x[-1, 32:64] *= 1e4  # and a block's largest value takes the largest code
        y = kernels.run_in_session(integer_library.path, x, blob, bits, 3072, xbits)
        want = kernels.integer_reference(x, both, xbits)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), m
        exact = kernels.float_reference(x, both)
        assert near[0] < np.abs(y - exact).max() / np.abs(exact).max() < near[1], m


@pytest.mark.parametrize("xbits", [16, 8])
def test_integer_rows_do_not_depend_on_their_batch_either(integer_library: kernels.Library, xbits: int) -> None:
    rng = np.random.default_rng(6)
    for bits in (4, 5, 8):
        blob = kernels.pack([QuantizedWeight.random(rng, 300, 1536, bits)], xbits)
        x = rng.standard_normal((37, 1536)).astype(np.float32)  # 16 rows or more are quantized in parallel
        together = kernels.run_in_session(integer_library.path, x, blob, bits, 300, xbits)
        for i in (0, 5, 36):
            alone = kernels.run_in_session(integer_library.path, x[i : i + 1], blob, bits, 300, xbits)[0]
            assert np.array_equal(alone, together[i]), (bits, i)


def close_enough(half: bool) -> dict[str, float]:
    """How near ``Attention``'s results are to the float64 model: float32 caches as float32 math;
    on float16 caches a new key may round to the neighbouring float16."""
    return {"rtol": kernels.HALF_RTOL, "atol": 1e-4} if half else {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.parametrize("half", [True, False], ids=["float16-caches", "float32-caches"])
@pytest.mark.parametrize(("rows", "tokens"), [(1, 1), (5, 1), (1, 9), (2, 3)])
def test_attention_is_rotary_causal_attention_over_the_cache(library: kernels.Library, rows: int, tokens: int,
                                                             half: bool) -> None:
    """Rows at different positions, one token each (batched decode) or several (a prompt after a
    cached part): the output and both caches as modelled in float64, in place or not."""
    rng = np.random.default_rng(7 + rows * tokens)
    case = kernels.AttentionCase.random(rng, rows, tokens, heads=9, kv_heads=3, head_dim=64, capacity=300, half=half)
    want = case.reference()
    for in_place in (True, False):
        out, keys, values = case.in_session(library.path, in_place=in_place)
        assert keys.dtype == values.dtype == (np.float16 if half else np.float32)
        assert np.allclose(out, want[0], **close_enough(half)), in_place
        assert np.allclose(keys, want[1], **close_enough(half)), in_place
        if half:
            assert np.allclose(keys, want[1], rtol=kernels.HALF_RTOL, atol=0), in_place  # a float16 apart at most
            assert np.array_equal(values, want[2]), in_place  # the values, rounded to float16
        else:
            assert np.allclose(values, want[2], rtol=1e-6, atol=0), in_place


@pytest.mark.parametrize("half", [True, False], ids=["float16-caches", "float32-caches"])
@pytest.mark.parametrize(("head_dim", "window"), [(64, 7), (128, 20), (48, 1), (256, 9)])
def test_attention_with_a_sliding_window_and_a_query_scale(library: kernels.Library, head_dim: int, window: int,
                                                            half: bool) -> None:
    """Gemma 3's layers: a query sees only the last ``window`` positions, itself included, with its
    own scale; grouped heads (64, 128), single heads (48) and Gemma's 256, prompts and decode."""
    rng = np.random.default_rng(head_dim + window)
    for rows, tokens in ((3, 1), (1, 12)):
        case = kernels.AttentionCase.random(rng, rows, tokens, heads=8, kv_heads=2, head_dim=head_dim, capacity=60,
                                            half=half, scale=0.37, window=window)
        want = case.reference()
        out, keys, _ = case.in_session(library.path)
        assert np.allclose(out, want[0], **close_enough(half)), (rows, tokens)
        assert np.allclose(keys, want[1], **close_enough(half))
        unwindowed = kernels.AttentionCase(**{**case.__dict__, "window": 0}).reference()[0]
        assert not np.allclose(out, unwindowed, atol=1e-3)  # the window mattered


@pytest.mark.parametrize("window", [1, 5, 16])
def test_group_query_attention_window_matches_the_model(window: int) -> None:
    """ONNX Runtime's own op (the fallback) with ``local_window_size`` as :func:`kernels.gqa_window`
    sets it sees the same keys as the model."""
    rng = np.random.default_rng(window)
    for rows, tokens, seqlens in ((1, 9, [30]), (2, 1, [3, 30])):  # its batches: one prompt, or one token a row
        case = kernels.AttentionCase.random(rng, rows, tokens, heads=4, kv_heads=2, head_dim=32, capacity=40,
                                            half=False, scale=0.2, window=window)
        case = kernels.AttentionCase(**{**case.__dict__, "seqlens": np.array(seqlens, np.int32)})
        want = case.reference()
        out, _, _ = case.in_session(None)
        assert np.allclose(out, want[0], rtol=1e-4, atol=1e-4), (rows, tokens)


@pytest.mark.parametrize("half", [True, False], ids=["float16-caches", "float32-caches"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (8, 4, 128), (6, 2, 48)])
def test_attention_for_other_head_shapes(library: kernels.Library, heads: int, kv_heads: int, head_dim: int,
                                         half: bool) -> None:
    """Seven query heads to a key/value head (taken four and three at a time), head size 128, and
    a size of neither kind (each head alone), over a cache long enough to need heap scratch."""
    rng = np.random.default_rng(heads + head_dim)
    case = kernels.AttentionCase.random(rng, 3, 2, heads=heads, kv_heads=kv_heads, head_dim=head_dim, capacity=1500,
                                        half=half)
    case.seqlens[0] = 1400  # a long row beside short ones
    for got, want in zip(case.in_session(library.path), case.reference(), strict=True):
        assert np.allclose(got, want, **close_enough(half))


@pytest.mark.parametrize("half", [True, False], ids=["float16-caches", "float32-caches"])
def test_attention_agrees_with_group_query_attention(library: kernels.Library, half: bool) -> None:
    """The op it replaces: com.microsoft's GroupQueryAttention, rotary interleaved, in place (on
    float32 caches: where ours are float16, the same keys and values rounded, and the output as
    near as the new position's rounding allows)."""
    rng = np.random.default_rng(8)
    case = kernels.AttentionCase.random(rng, 4, 1, heads=9, kv_heads=3, head_dim=64, capacity=128, half=half)
    out, keys, values = case.in_session(None)
    ours, our_keys, our_values = case.in_session(library.path)
    assert np.abs(out - ours).max() < (2e-3 if half else 1e-5)
    for i, last in enumerate(case.seqlens):  # the positions written; GQA leaves the rest as they were
        if half:
            assert np.allclose(keys[i, :, : last + 1], our_keys[i, :, : last + 1], rtol=kernels.HALF_RTOL, atol=1e-7)
            assert np.array_equal(values[i, :, : last + 1].astype(np.float16), our_values[i, :, : last + 1])
        else:
            assert np.allclose(keys[i, :, : last + 1], our_keys[i, :, : last + 1], atol=1e-5)
            assert np.array_equal(values[i, :, : last + 1], our_values[i, :, : last + 1])


@pytest.mark.parametrize("half", [True, False], ids=["float16-caches", "float32-caches"])
def test_an_attention_rows_numbers_do_not_depend_on_its_batch(library: kernels.Library, half: bool) -> None:
    rng = np.random.default_rng(9)
    case = kernels.AttentionCase.random(rng, 6, 1, heads=9, kv_heads=3, head_dim=64, capacity=200, half=half)
    together = case.in_session(library.path)[0]
    for i in (0, 3, 5):
        alone = dataclasses.replace(case, qkv=case.qkv[i : i + 1], keys=case.keys[i : i + 1],
                                    values=case.values[i : i + 1], seqlens=case.seqlens[i : i + 1])
        assert np.array_equal(alone.in_session(library.path)[0][0], together[i])


@pytest.mark.parametrize("half", [True, False], ids=["float16-caches", "float32-caches"])
def test_a_requests_tokens_as_rows_sharing_its_slot(library: kernels.Library, half: bool) -> None:
    """A verify step's 5 tokens as 5 one-token rows of one slot (out of order, between two other
    requests' decode steps): each row attends to the cache and to the rows before it, so the
    outputs and caches are, bit for bit, those of the same tokens as one row of 5, and the model's."""
    rng = np.random.default_rng(11)
    whole = kernels.AttentionCase.random(rng, 1, 5, heads=9, kv_heads=3, head_dim=64, capacity=200, half=half, slots=3)
    first = int(whole.seqlens[0]) - 4
    order = np.array([3, 0, 4, 1, 2])
    other = kernels.AttentionCase.random(rng, 2, 1, heads=9, kv_heads=3, head_dim=64, capacity=200, half=half)
    mine = int(whole.slot_ids[0])
    others = np.array([s for s in range(3) if s != mine], np.int32)
    rows = dataclasses.replace(
        whole, qkv=np.concatenate([other.qkv[:1], whole.qkv[0, order][:, None], other.qkv[1:]]),
        seqlens=np.concatenate([other.seqlens[:1], first + order, other.seqlens[1:]]).astype(np.int32),
        slots=np.concatenate([others[:1], np.full(5, mine, np.int32), others[1:]]),
    )
    out, keys, values = rows.in_session(library.path)
    want = rows.reference()
    assert np.allclose(out, want[0], **close_enough(half))
    alone, alone_keys, alone_values = whole.in_session(library.path)
    assert np.array_equal(out[1:6, 0][np.argsort(order)], alone[0])
    assert np.array_equal(keys[mine], alone_keys[mine]) and np.array_equal(values[mine], alone_values[mine])


def test_rows_share_a_slot_only_one_token_each_at_distinct_positions(library: kernels.Library) -> None:
    """Rows sharing a slot: refused with several tokens each, at one position, or on a ring where
    the later row's key would overwrite a key the earlier row's query sees."""
    rng = np.random.default_rng(12)
    case = kernels.AttentionCase.random(rng, 2, 1, heads=4, kv_heads=2, head_dim=16, capacity=40)
    same = dataclasses.replace(case, slots=np.array([1, 1], np.int32), seqlens=np.array([7, 7], np.int32))
    with pytest.raises(kernels.KernelUnavailable, match="row 1's slot 1 is another row's at the same position"):
        same.in_session(library.path)
    two = kernels.AttentionCase.random(rng, 2, 2, heads=4, kv_heads=2, head_dim=16, capacity=40)
    two = dataclasses.replace(two, slots=np.array([0, 0], np.int32), seqlens=np.array([5, 7], np.int32))
    with pytest.raises(kernels.KernelUnavailable, match="one token each"):
        two.in_session(library.path)
    ring = dataclasses.replace(case, window=8, slots=np.array([0, 0], np.int32))  # a ring of 12 rows: 4 to spare
    ok = dataclasses.replace(ring, keys=case.keys[:, :, :12], values=case.values[:, :, :12],
                             seqlens=np.array([20, 24], np.int32))
    ok.in_session(library.path)  # 24 overwrites 12, which 20's window (13..20) no longer sees
    far = dataclasses.replace(ok, seqlens=np.array([20, 25], np.int32))
    with pytest.raises(kernels.KernelUnavailable, match="too far ahead on the ring"):
        far.in_session(library.path)


def test_attention_refuses_positions_outside_the_cache(library: kernels.Library) -> None:
    rng = np.random.default_rng(10)
    case = kernels.AttentionCase.random(rng, 2, 1, heads=4, kv_heads=2, head_dim=16, capacity=8)
    case.seqlens[1] = 8  # one past the last position
    with pytest.raises(kernels.KernelUnavailable, match="row 1's positions 8..8 are outside the cache"):
        case.in_session(library.path)


@pytest.mark.parametrize("isa", ["avx2", "c"])
def test_the_other_instruction_sets_agree_too(tmp_path, isa: str) -> None:
    """This machine builds one of the kernel's three code paths; the others are built here with
    their flags and checked the same way (for the machines that run them)."""
    import platform
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    if isa == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is x86's")
    flags = ["-mavx2", "-mfma", "-mf16c"] if isa == "avx2" else []
    out = tmp_path / f"q-{isa}.so"
    subprocess.run([cc, "-O2", *flags, "-shared", "-fPIC", "-std=c11", "-o", str(out), *map(str, kernels.SOURCES), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(out))
    lib.exo_qlinear_isa.restype = ctypes.c_char_p
    assert lib.exo_qlinear_isa().decode() == isa
    assert lib.exo_qlinear_integer() == (isa == "avx2")  # AVX2's pair sums (or AVX-512 VNNI); plain C has none
    rng = np.random.default_rng(4)
    for bits in (4, 5, 8):
        w = QuantizedWeight.random(rng, 70, 320, bits)
        blob = kernels.pack([w])
        x = rng.standard_normal((11, 320)).astype(np.float32)
        want = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
        for m in (1, 2, 3, 8, 11):
            y = kernels.call(lib, x[:m], blob, bits, 70)
            assert np.abs(y - want[:m]).max() <= 1e-5 * np.abs(want).max(), (bits, m)
        together = kernels.call(lib, x, blob, bits, 70)  # and a row's bits whatever its batch
        for i in (0, 5, 10):
            assert np.array_equal(kernels.call(lib, x[i : i + 1], blob, bits, 70)[0], together[i]), (bits, i)
    for type_name in KQUANTS:  # the K-quants' super-blocks, float32 products
        w = kernels.random_kquant(rng, 70, 768, type_name)
        blob, attrs = kernels.pack([w]), kernels.op_attributes(w)
        x = rng.standard_normal((11, 768)).astype(np.float32)
        want = kernels.float_reference(x, w)
        for m in (1, 2, 3, 8, 11):
            y = kernels.call(lib, x[:m], blob, n=70, **attrs)
            assert np.abs(y - want[:m]).max() <= 1e-5 * np.abs(want).max(), (type_name, m)
        together = kernels.call(lib, x, blob, n=70, **attrs)
        for i in (0, 5, 10):
            assert np.array_equal(kernels.call(lib, x[i : i + 1], blob, n=70, **attrs)[0], together[i]), (type_name, i)
    if isa == "avx2":  # the integer precisions: their float64 model, and the VNNI build's numbers bit for bit
        native = kernels.library()
        vnni = ctypes.CDLL(native.path) if native is not None and native.integer and native.isa == "avx512" else None
        for type_name, xbits in itertools.product(KQUANTS, (16, 8)):
            w = kernels.random_kquant(rng, 70, 768, type_name)
            blob, attrs = kernels.pack([w], xbits), kernels.op_attributes(w)
            x = rng.standard_normal((11, 768)).astype(np.float32)
            x[3, :32] = 0.0
            want = kernels.integer_reference(x, w, xbits)
            got = kernels.call(lib, x, blob, n=70, xbits=xbits, **attrs)
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (type_name, xbits)
            for i in (0, 3, 10):
                assert np.array_equal(kernels.call(lib, x[i : i + 1], blob, n=70, xbits=xbits, **attrs)[0], got[i])
            if vnni is not None:
                assert np.array_equal(kernels.call(vnni, x, blob, n=70, xbits=xbits, **attrs), got), (type_name, xbits)
        for bits, xbits in itertools.product((4, 5, 8), (16, 8)):
            w = QuantizedWeight.random(rng, 70, 320, bits)
            blob = kernels.pack([w], xbits)
            x = rng.standard_normal((11, 320)).astype(np.float32)
            x[3, :32] = 0.0  # a block of zeros has scale 0
            want = kernels.integer_reference(x, w, xbits)
            got = kernels.call(lib, x, blob, bits, 70, xbits)
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (bits, xbits)
            for i in (0, 3, 10):
                assert np.array_equal(kernels.call(lib, x[i : i + 1], blob, bits, 70, xbits)[0], got[i])
            if vnni is not None:
                assert np.array_equal(kernels.call(vnni, x, blob, bits, 70, xbits), got), (bits, xbits)
    # and the attention (AVX2's 8-wide loops, or the plain ones), head sizes of 8 wide chunks even and odd
    for rows, tokens, heads, kv_heads, head_dim in ((4, 1, 6, 2, 64), (1, 6, 6, 2, 64), (2, 1, 8, 4, 128), (3, 2, 4, 2, 40)):
        for half in (True, False):
            case = kernels.AttentionCase.random(rng, rows, tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                capacity=45, half=half)
            for got, want in zip(case.call(lib), case.reference(), strict=True):
                assert np.allclose(got, want, **close_enough(half)), (rows, tokens, head_dim, half)
    # the caches' float16: NumPy's rounding (to nearest, ties to even) bit for bit, whatever the build
    x = np.concatenate([
        rng.standard_normal(1000).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 1000),  # subnormal to overflow
        np.array([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, np.inf, -np.inf, 2.0**-24, 2.0**-25,
                  3 * 2.0**-26, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2.0**-14 - 2.0**-25], np.float32),
    ]).astype(np.float32)
    halves = np.empty(x.size, np.uint16)
    lib.exo_to_half(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(halves.ctypes.data), ctypes.c_int64(x.size))
    with np.errstate(over="ignore"):
        assert np.array_equal(halves, x.astype(np.float16).view(np.uint16)), isa


def test_only_blocks_of_32_with_half_precision_scales_take_the_kernel() -> None:
    rng = np.random.default_rng(3)
    w = QuantizedWeight.random(rng, 8, 64, 4)
    assert kernels.runs_on_kernel(w) and kernels.runs_on_kernel(QuantizedWeight.random(rng, 8, 64, 8))
    five = QuantizedWeight.random(rng, 8, 64, 5)  # Q5_0's and Q5_1's blocks
    assert kernels.kernel_format(five) == "Q5" and kernels.runs_on_kernel(dataclasses.replace(five, source_type="Q5_0"))
    assert not kernels.runs_on_kernel(QuantizedWeight.random(rng, 8, 64, 5, half=False))  # float32 scales
    assert not kernels.runs_on_kernel(QuantizedWeight(w.q, w.scales * np.float32(1.0001), w.biases, bits=4))
    assert not kernels.runs_on_kernel(QuantizedWeight(w.q[:, :48], w.scales[:, :3], w.biases[:, :3], bits=4, group=16))
    assert not kernels.runs_on_kernel(np.zeros((8, 64), np.float32))


@pytest.mark.parametrize("type_name", KQUANTS)
def test_kquants_take_the_kernel_when_their_scales_are_super_blocks(type_name: str) -> None:
    """A K-quant matrix as the reader decodes it runs on the kernel, in its own format (never fused
    with another); groups that are no super-blocks' ``d * sc`` (or, for Q6_K, biases not
    ``-32 d sc``) stay on MatMulNBits."""
    rng = np.random.default_rng(15)
    w = from_file_blocks(rng, 8, 512, type_name)
    assert kernels.runs_on_kernel(w) and kernels.kernel_format(w) == type_name
    assert kernels.kernel_format(QuantizedWeight.random(rng, 8, 512, 4)) == "Q4"
    odd = dataclasses.replace(w, scales=w.scales * np.float32(1.0 + 2**-20))
    assert not kernels.runs_on_kernel(odd)
    assert not kernels.runs_on_kernel(dataclasses.replace(w, biases=w.biases + np.float32(1e-3)))
    assert not kernels.runs_on_kernel(dataclasses.replace(w, group=32 if type_name == "Q6_K" else 16,
                                                          scales=w.scales[:, ::2], biases=w.biases[:, ::2]))


def test_a_q4_k_m_model_runs_every_matrix_on_the_kernel(library: kernels.Library, tmp_path) -> None:
    """Q4_K layers with a Q6_K output head (as a Q4_K_M file has them): q, k, v as one QLinear and
    gate and up as one, every matrix and the head on QLinear (no MatMulNBits, no dense copy of the
    head), the logits the reference's, split and whole."""
    from backends.onnx import ONNXBackend
    from backends.onnx.graph import build_shard_graph
    from exo_tui.models.gguf_file import GGUFModel
    from tests.factory import write_tiny_llama

    path = write_tiny_llama(tmp_path / "q4km.gguf", hidden=256, intermediate=512, n_layers=2, weight_type="Q4_K",
                            embed_type="F32", tied=False)
    model = GGUFModel(path)
    cfg = model.config
    rng = np.random.default_rng(16)
    head = from_file_blocks(rng, cfg.vocab_size, cfg.hidden_size, "Q6_K")

    def weights(start: int, end: int):
        w = model.shard_weights(start, end)
        return dataclasses.replace(w, output=head) if end == cfg.n_layers else w

    for xbits in (0, 16, 8) if library.integer else (0,):
        graph = build_shard_graph(cfg, weights(0, cfg.n_layers), 1, batch_head_rows=4, kernel=True, xbits=xbits)
        ops = [n for n in graph.model.graph.node if n.domain == kernels.DOMAIN and n.op_type == kernels.OP]
        kinds = [{a.name: a.i for a in n.attribute}.get("kquant", 0) for n in ops]
        assert kinds == [4, 4, 4, 4] * cfg.n_layers + [6], xbits  # qkv, o, gate+up, down; the head
        assert not any(n.op_type in ("MatMulNBits", "If") for n in graph.model.graph.node), xbits
    tokens = np.arange(3, 40) % cfg.vocab_size
    pos = np.arange(len(tokens))
    want = ReferenceShard(cfg, weights(0, cfg.n_layers)).forward("r", tokens, pos, all_logits=True)
    engine = ONNXBackend(threads=2, precision="float32")
    whole = engine.load_shard(cfg, weights(0, cfg.n_layers))
    first, last = engine.load_shard(cfg, weights(0, 1)), engine.load_shard(cfg, weights(1, cfg.n_layers))
    try:
        assert whole.kernel == library.isa
        got = whole.forward("r", tokens, pos, all_logits=True)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        split = last.forward("r", first.forward("r", tokens, pos), pos, all_logits=True)
        assert np.abs(split - want).max() <= 1e-4 * np.abs(want).max()
    finally:
        for shard in (whole, first, last):
            shard.close()


@pytest.mark.parametrize("type_name", [*LEGACY, *KQUANTS])
def test_rows_read_back_out_of_the_tiles_are_the_matrixs(type_name: str) -> None:
    """TileRows (a tied embedding looked up in its head's tiles) gives exactly the rows
    ``dequantize`` gives, for every format and the layout of every precision, rows of the first,
    the last and a partial tile."""
    from backends.onnx.kernels.tile_rows import TileRows

    rng = np.random.default_rng(23)
    w = (kernels.random_kquant if type_name in KQUANTS else kernels.random_legacy)(rng, 70, 512, type_name)
    ids = np.array([0, 31, 32, 5, 69, 64, 5])
    for xbits in (0, 16, 8):
        rows = TileRows(kernels.pack([w], xbits), type_name, w.bits, xbits, 512).rows(ids)
        assert np.array_equal(rows, w.dequantize()[ids]), xbits


def test_a_file_llama_cpp_quantized_with_fallbacks_runs_every_matrix_on_the_kernel(library: kernels.Library) -> None:
    """llama.cpp's Q4_K_M of a model 384 wide (fixture qwen2-fallback): Q5_0 where rows are not whole
    super-blocks, Q8_0 for v and the tied head, Q6_K for the feed-forward's down matrix. Every one
    of them is on QLinear, at every precision: nothing is MatMulNBits or float32."""
    from pathlib import Path

    from backends.onnx.graph import build_shard_graph
    from exo_tui.models.gguf_file import GGUFModel

    model = GGUFModel(Path(__file__).parent.parent / "fixtures" / "families" / "qwen2-fallback.Q4_K_M.gguf")
    cfg = model.config
    assert {model.tensor_info(f"blk.0.{n}.weight").type_name for n in ("attn_q", "attn_v", "ffn_down")} == \
        {"Q5_0", "Q8_0", "Q6_K"}
    for xbits in (0, 16, 8) if library.integer else (0,):
        graph = build_shard_graph(cfg, model.shard_weights(0, cfg.n_layers), 1, batch_head_rows=4, kernel=True,
                                  xbits=xbits)
        ops = [n for n in graph.model.graph.node if n.domain == kernels.DOMAIN and n.op_type == kernels.OP]
        formats = sorted({(a["bits"], a.get("kquant", 0)) for a in ({x.name: x.i for x in n.attribute} for n in ops)})
        assert formats == [(5, 0), (6, 6), (8, 0)], xbits
        assert not any(n.op_type in ("MatMulNBits", "MatMul") for n in graph.model.graph.node), xbits


@pytest.mark.parametrize(("change", "reason"), [
    (("-32.0f", "-31.0f"), "Q6_K, float32"),  # Q6_K's biases -31 d sc for -32 d sc
    (("(f) == FMT_Q5 || ", ""), "5-bit, float32"),  # Q5_0's and Q5_1's bit plane left out (and from their stride)
], ids=["q6_k-biases", "q5-plane"])
def test_a_build_that_gets_a_format_wrong_is_not_used(tmp_path, change: tuple[str, str], reason: str) -> None:
    """The check before use covers every format: a build that gets one wrong (a real build of
    changed source) is refused, the reason naming the format."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    for src in kernels.SOURCES + kernels.HEADERS:
        text = src.read_text()
        if src.name == "qlinear.c":
            assert change[0] in text
            text = text.replace(*change)
        (tmp_path / src.name).write_text(text)
    out = tmp_path / "broken.so"
    for flags in (["-march=native"], []):  # this machine's code path where the compiler takes the flag
        built = subprocess.run([cc, "-O1", *flags, "-shared", "-fPIC", "-std=c11", "-o", str(out),
                                *(str(tmp_path / s.name) for s in kernels.SOURCES), "-lm"], capture_output=True)
        if built.returncode == 0:
            break
    assert built.returncode == 0, built.stderr
    with pytest.raises(kernels.KernelUnavailable, match=rf"disagrees with NumPy \({reason}, off by"):
        kernels._check(out)


def test_without_a_compiler_the_backend_says_so_and_uses_matmulnbits(
    tiny_models, monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("EXO_TUI_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    kernels._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert kernels.library() is None
        assert "quantized matrices on MatMulNBits" in caplog.text and "no-such-cc" in caplog.text
        cfg, weights, shard = load(tiny_models["Q4_1"])
        assert shard.kernel == ""
        ref = ReferenceShard(cfg, weights)
        pos = np.arange(len(PROMPT))
        close(shard.forward("r", PROMPT, pos, all_logits=True), ref.forward("r", PROMPT, pos, all_logits=True))
    finally:
        kernels._library.cache_clear()


def test_a_cache_folder_it_cannot_write_means_matmulnbits_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EXO_TUI_CACHE", str(blocker))  # its "kernels" folder cannot be made
    kernels._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert kernels.library() is None
        assert f"cannot create {blocker / 'kernels'}" in caplog.text
    finally:
        kernels._library.cache_clear()


def test_the_kernel_can_be_turned_off_and_a_bad_setting_says_how(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from backends.onnx import ONNXBackend
    from exo_tui.config import ConfigError, load_config

    monkeypatch.setattr(kernels, "_enabled", True)  # put back after the test
    env = {"EXO_TUI_HOME": str(tmp_path), "EXO_TUI_ONNX_KERNEL": "0"}
    ONNXBackend(**load_config(env=env).node.backend_settings("onnx"))
    assert not kernels.enabled() and kernels.library() is None
    ONNXBackend(kernel=True)
    assert kernels.enabled()
    with pytest.raises(ConfigError, match="node.onnx.kernel is 'maybe'; it must be true or false"):
        load_config(env=env | {"EXO_TUI_ONNX_KERNEL": "maybe"})
