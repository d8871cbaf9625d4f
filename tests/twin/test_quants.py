"""GGUF weights kept quantized on MLX: exact where the mapping is exact, bounded otherwise.

The law (module docstring of :mod:`accelerated.quants`):

- exact types (``aq.EXACT_TYPES``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q3_K, MXFP4,
  IQ4_NL, IQ4_XS, TQ2_0): for every block with finite float16 scales (an E8M0 exponent below 255 for
  MXFP4),
  ``mx.dequantize(to_mlx(t))`` equals the reference's dequantization in value, and in bits
  except the sign of a zero; Q4_1, Q5_1, Q4_K and Q5_K are bit-identical everywhere;
- bounded types (``aq.BOUNDED_TYPES``, ``bounded=True``): Q6_K within a quarter of the
  group's anchor scale (its anchor sub-block exact), Q2_K within a thirtieth of the group's
  range;
- ``quantized_matmul`` equals the float matmul of the dequantized weights within float32
  rounding.

The reference is ``reference.quants.dequantize`` where it knows the type, ``gguf.quants``
otherwise. Checked on random blocks (zero,
largest, negative and subnormal scales forced in), on edge blocks, on every quantized tensor of
SmolLM2-135M, and on a Q4_K_M-like model for the resident bytes.
"""

from __future__ import annotations

import gguf.quants as gq
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from accelerated import quants as aq
from reference import quants as ref
from reference.quants import QuantError, QuantizedTensor
from reference.testing import nmse

T = GGMLQuantizationType
EXACT = list(aq.EXACT_TYPES)
BOUNDED = list(aq.BOUNDED_TYPES)
NEG_ZERO = np.uint32(0x80000000)
MATMUL_NMSE = 5e-4  # test-backend-ops' threshold for mul_mat

# Byte offsets of the float16 fields (d, m, dmin) of each block.
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q3_K: (108,), T.Q6_K: (208,), T.Q2_K: (80, 82),
    T.MXFP4: (), T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.TQ2_0: (64,),
}
BIT_IDENTICAL = {T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K}  # no zero changes sign
MLX_NEG_ZERO = {T.MXFP4}  # e2m1 code 8 is -0 in MLX, +0 in ggml; elsewhere ggml's -0 is MLX's +0

# float16 bit patterns of scales worth forcing: zeros, the largest finite, the smallest and
# largest subnormals, the smallest normal, one, and their negatives.
EDGE_F16 = [0x0000, 0x7BFF, 0x0001, 0x03FF, 0x0400, 0x3C00]
EDGE_F16 += [b | 0x8000 for b in EDGE_F16]
EDGE_E8M0 = [0, 1, 2, 127, 128, 253, 254]  # 255 is outside the law


def expected(t: QuantizedTensor) -> np.ndarray:
    """The reference's float32 weights (gguf.quants for types the reference does not know)."""
    with np.errstate(over="ignore"):  # MXFP4: 12 * 2**126 is inf, in ggml as in MLX
        if t.qtype in ref.DEQUANTIZE:
            return t.dequantize()
        return gq.dequantize(t.data, t.qtype).astype(np.float32)


def finite_f16_bits() -> st.SearchStrategy[int]:
    """float16 bit patterns of finite numbers (exponent field not all ones), edges first."""
    any_finite = st.integers(0, 0xFFFF).filter(lambda b: (b >> 10) & 0x1F != 0x1F)
    return st.one_of(st.sampled_from(EDGE_F16), any_finite)


def with_scales(qtype: GGMLQuantizationType, blocks: np.ndarray, bits: list[int]) -> np.ndarray:
    """``blocks`` ``(n_rows, n_blocks, size)`` with its float16 fields (or MXFP4's exponent)
    set from ``bits``, field after field of each block."""
    blocks = blocks.copy()
    if qtype == T.MXFP4:
        blocks[..., 0] = np.array(bits, np.uint8).reshape(blocks.shape[:-1])
        return blocks
    fields = F16_FIELDS[qtype]
    values = np.array(bits, "<u2").reshape(*blocks.shape[:-1], len(fields))
    for k, off in enumerate(fields):
        blocks[..., off : off + 2] = values[..., k : k + 1].view(np.uint8)
    return blocks


def tensor(qtype: GGMLQuantizationType, blocks: np.ndarray) -> QuantizedTensor:
    """The tensor of ``blocks`` ``(n_rows, n_blocks, size)``."""
    n_rows, n_blocks, size = blocks.shape
    block_size = GGML_QUANT_SIZES[qtype][0]
    return QuantizedTensor(qtype, (n_rows, n_blocks * block_size), blocks.reshape(n_rows, -1))


@st.composite
def quantized_tensors(draw: st.DrawFn, qtype: GGMLQuantizationType) -> QuantizedTensor:
    """A random tensor of ``qtype``: random quant bytes, finite scales (edges included)."""
    n_rows = draw(st.integers(1, 3))
    n_blocks = draw(st.integers(1, 3))
    size = GGML_QUANT_SIZES[qtype][1]
    seed = draw(st.integers(0, 2**32 - 1))
    blocks = np.random.default_rng(seed).integers(0, 256, (n_rows, n_blocks, size), np.uint8)
    n_fields = max(len(F16_FIELDS[qtype]), 1) * n_rows * n_blocks
    scale = st.sampled_from(EDGE_E8M0) | st.integers(0, 254) if qtype == T.MXFP4 else (
        finite_f16_bits()
    )
    bits = draw(st.lists(scale, min_size=n_fields, max_size=n_fields))
    return tensor(qtype, with_scales(qtype, blocks, bits))


def assert_lossless(t: QuantizedTensor) -> int:
    """The law of the exact types; returns how many weights differ in bits (signed zeros)."""
    want = expected(t)
    got = np.array(aq.dequantize_mlx(aq.to_mlx(t)))
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)  # the same values (no NaN: scales are finite)
    w_bits, g_bits = want.view(np.uint32), got.view(np.uint32)
    differ = w_bits != g_bits
    ref_zero, mlx_zero = (0, NEG_ZERO) if t.qtype in MLX_NEG_ZERO else (NEG_ZERO, 0)
    assert np.all(w_bits[differ] == ref_zero) and np.all(g_bits[differ] == mlx_zero)
    if t.qtype in BIT_IDENTICAL:
        assert not differ.any()
    return int(differ.sum())


@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
@given(data=st.data())
def test_dequantize_is_bit_identical_on_random_blocks(qtype, data):
    assert_lossless(data.draw(quantized_tensors(qtype)))


@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
@pytest.mark.parametrize("edge", range(len(EDGE_F16)))
def test_dequantize_is_bit_identical_on_edge_scales(qtype, edge):
    """Every scale field of every block the same edge value (zeros, +-65504, subnormals)."""
    blocks = np.random.default_rng(edge).integers(0, 256, (2, 3, GGML_QUANT_SIZES[qtype][1]),
                                                  np.uint8)
    n_fields = max(len(F16_FIELDS[qtype]), 1) * 6
    value = EDGE_E8M0[edge % len(EDGE_E8M0)] if qtype == T.MXFP4 else EDGE_F16[edge]
    assert_lossless(tensor(qtype, with_scales(qtype, blocks, [value] * n_fields)))


def one_block(qtype: GGMLQuantizationType, scale: float, quants: np.ndarray) -> QuantizedTensor:
    """A single Q4_0/Q4_1/Q5_0/Q8_0 block with the given float16 scale (m = 0) and quants."""
    d = np.array([scale], "<f2").view(np.uint8)
    if qtype == T.Q8_0:
        block = np.concatenate([d, quants.astype(np.int8).view(np.uint8)])
    elif qtype == T.Q5_0:
        qh = np.packbits((quants >> 4).astype(np.uint8), bitorder="little")
        qs = ((quants[:16] & 15) | ((quants[16:] & 15) << 4)).astype(np.uint8)
        block = np.concatenate([d, qh, qs])
    else:
        qs = (quants[:16] | (quants[16:] << 4)).astype(np.uint8)
        m = np.zeros(2, np.uint8) if qtype == T.Q4_1 else np.zeros(0, np.uint8)
        block = np.concatenate([d, m, qs])
    return QuantizedTensor(qtype, (1, 32), block[None])


@pytest.mark.parametrize("scale", [-65504.0, -1.0, -(2.0**-24), -0.0, 0.0, 2.0**-24, 1.0, 65504.0])
def test_the_only_bit_difference_is_the_sign_of_zero(scale):
    """Exactly the weights that the reference makes -0.0 differ, and only Q4_0/Q5_0/Q8_0 ones."""
    q4 = np.arange(32) % 16  # every nibble twice, q = 8 included
    q5 = np.arange(32)  # q = 16 included
    q8 = np.arange(-16, 16)  # q = 0 included
    for qtype, q in [(T.Q4_0, q4), (T.Q4_1, q4), (T.Q5_0, q5), (T.Q8_0, q8)]:
        t = one_block(qtype, scale, q)
        neg_zeros = int((t.dequantize().view(np.uint32) == NEG_ZERO).sum())
        assert assert_lossless(t) == (0 if qtype == T.Q4_1 else neg_zeros)
    # Q4_0 with d < 0: the two q = 8 weights are -0.0 in the reference; Q5_0: the q = 16 one
    if np.signbit(scale) and scale != 0:
        assert assert_lossless(one_block(T.Q4_0, scale, q4)) == 2
        assert assert_lossless(one_block(T.Q5_0, scale, q5)) == 1


def test_mxfp4_code_8_is_minus_zero_in_mlx():
    """e2m1 code 8 is -0: ggml's table makes it +0, MLX's decoder -0; the values are equal."""
    codes = np.arange(16, dtype=np.uint8)
    block = np.concatenate([[np.uint8(127)], codes | (codes << 4)])  # weights j, j + 16: code j
    t = QuantizedTensor(T.MXFP4, (1, 32), block[None].astype(np.uint8))
    assert assert_lossless(t) == 2
    assert expected(t)[0, :8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_infinite_scale_is_outside_the_law():
    """d = inf (never written by a quantizer): MLX's inf*q - 8*inf is NaN, ggml's is inf."""
    t = one_block(T.Q4_0, np.inf, np.full(32, 9))
    assert np.all(t.dequantize() == np.inf)
    assert np.all(np.isnan(np.array(aq.dequantize_mlx(aq.to_mlx(t)))))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_order_matches_mx_dequantize(bits):
    """Our words are MLX's bit stream: weight i in bits bits*i and up (scale 1, bias 0)."""
    q = (np.arange(64) * 7 % 2**bits).reshape(2, 32)  # (2, 32), every bit position used
    w_q = mx.array(aq._pack_words(q, bits))  # (2, bits)
    ones, zeros = mx.ones((2, 1)), mx.zeros((2, 1))
    got = mx.dequantize(w_q, ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(got), q.astype(np.float32))
    if bits == 4:
        assert np.array(aq._pack_words(np.arange(32)[None] % 16, 4))[0, 0] == 0x76543210


@pytest.fixture(scope="module")
def smollm2_tensors() -> dict[str, QuantizedTensor]:
    from reference.gguf import read_gguf
    from reference.model_loader import ModelLoadError, default_model_path

    try:
        path = default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    tensors = read_gguf(path).tensors
    return {n: t for n, t in tensors.items() if isinstance(t, QuantizedTensor)}


def test_smollm2_every_quantized_tensor_is_bit_identical(smollm2_tensors):
    """All 211 quantized tensors of SmolLM2 (210 Q4_1, token_embd Q8_0): zero differing bits."""
    kinds = {t.qtype for t in smollm2_tensors.values()}
    assert kinds == {T.Q4_1, T.Q8_0}
    n_weights = 0
    for t in smollm2_tensors.values():
        assert assert_lossless(t) == 0
        n_weights += int(np.prod(t.shape))
    assert n_weights > 100_000_000


# ---------------------------------------------------------------------------------------------
# The bounded types
# ---------------------------------------------------------------------------------------------


def q6_k_anchor_scales(t: QuantizedTensor) -> np.ndarray:
    """Per weight, the sub-block scale ``d * sc`` of largest magnitude in its group of 128."""
    blocks = t.data.reshape(*t.shape[:-1], -1, 210)
    d = blocks[..., 208:210].copy().view("<f2").astype(np.float32)  # (..., nb, 1)
    sub = np.abs(d * blocks[..., 192:208].view(np.int8).astype(np.float32))  # (..., nb, 16)
    anchor = sub.reshape(*sub.shape[:-1], 2, 8).max(axis=-1)  # (..., nb, 2)
    return anchor.repeat(128, axis=-1).reshape(t.shape)


def assert_q6_k_bound(t: QuantizedTensor) -> None:
    """|MLX - reference| <= S/4 (S the group's anchor scale), rounding included."""
    want, got = expected(t), np.array(aq.dequantize_mlx(aq.to_mlx(t, bounded=True)))
    s = q6_k_anchor_scales(t)
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= s * (0.25 + 2.0**-16))
    # the anchor sub-block of every group is exact (bit for bit up to the sign of zero)
    blocks = t.data.reshape(*t.shape[:-1], -1, 210)
    d = blocks[..., 208:210].copy().view("<f2").astype(np.float32)
    sub = np.abs(d * blocks[..., 192:208].view(np.int8).astype(np.float32))  # (..., nb, 16)
    pick = sub.reshape(*sub.shape[:-1], 2, 8).argmax(axis=-1)  # (..., nb, 2)
    first = (pick + np.array([0, 8])) * 16  # (..., nb, 2) first weight in the block
    for idx in np.ndindex(first.shape):
        row, nb = idx[:-2], idx[-2]
        start = nb * 256 + first[idx]
        assert np.array_equal(got[row][start : start + 16], want[row][start : start + 16])


def assert_q2_k_bound(t: QuantizedTensor) -> None:
    """|MLX - reference| <= (max - min) / 30 of its group of 32, plus float rounding."""
    want, got = expected(t), np.array(aq.dequantize_mlx(aq.to_mlx(t, bounded=True)))
    groups = want.reshape(-1, 32).astype(np.float64)
    lo, hi = groups.min(axis=1, keepdims=True), groups.max(axis=1, keepdims=True)
    bound = (hi - lo) / 30 * (1 + 2.0**-16) + 2.0**-20 * np.maximum(abs(lo), abs(hi))
    assert np.all(np.abs(got.reshape(-1, 32) - groups) <= bound)


@given(data=st.data())
def test_q6_k_is_within_a_quarter_of_the_anchor_scale(data):
    assert_q6_k_bound(data.draw(quantized_tensors(T.Q6_K)))


@given(data=st.data())
def test_q2_k_is_within_a_thirtieth_of_the_group_range(data):
    assert_q2_k_bound(data.draw(quantized_tensors(T.Q2_K)))


@pytest.mark.parametrize("edge", range(len(EDGE_F16)))
def test_bounded_types_on_edge_scales(edge):
    rng = np.random.default_rng(edge)
    for qtype, check in [(T.Q6_K, assert_q6_k_bound), (T.Q2_K, assert_q2_k_bound)]:
        blocks = rng.integers(0, 256, (2, 2, GGML_QUANT_SIZES[qtype][1]), np.uint8)
        n_fields = len(F16_FIELDS[qtype]) * 4
        check(tensor(qtype, with_scales(qtype, blocks, [EDGE_F16[edge]] * n_fields)))


def test_q6_k_with_equal_sub_block_scales_is_exact():
    """One scale for all 16 sub-blocks: the grid is Q6_K's own, every weight exact."""
    blocks = np.random.default_rng(3).integers(0, 256, (2, 2, 210), np.uint8)
    blocks[..., 192:208] = np.int8(-37).view(np.uint8)
    t = tensor(T.Q6_K, with_scales(T.Q6_K, blocks, [0x2E66] * 4))  # d = 0.1
    got = np.array(aq.dequantize_mlx(aq.to_mlx(t, bounded=True)))
    assert np.array_equal(got, expected(t))


# ---------------------------------------------------------------------------------------------
# Matmul, rows, loading
# ---------------------------------------------------------------------------------------------


def modest_tensor(qtype: GGMLQuantizationType, n_out: int, n_in: int, seed: int):
    """Random quant bytes with scales of a trained model's size (float16 in [-0.05, 0.05],
    MXFP4 exponents 2**-8 to 2**2)."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_out, n_in // size[0], size[1]), np.uint8)
    if qtype == T.MXFP4:
        bits = rng.integers(119, 130, blocks.shape[:-1]).ravel().tolist()
    else:
        n = blocks.shape[0] * blocks.shape[1] * len(F16_FIELDS[qtype])
        bits = rng.uniform(-0.05, 0.05, n).astype("<f2").view("<u2").tolist()
    return tensor(qtype, with_scales(qtype, blocks, bits))


def matmul_tolerance(x: np.ndarray, m: aq.MLXQuantized) -> np.ndarray:
    """float32 rounding of ``x @ W.T`` however MLX orders it, per output ``(n_tokens, n_out)``:
    ``n_in * 2**-22`` times ``|x| @ A.T``, ``A`` the largest ``|s q| + |b|`` of each group (the
    kernel may sum ``s * (x . q)`` and ``b * sum(x)`` apart)."""
    w = np.abs(np.array(aq.dequantize_mlx(m)))  # (n_out, n_in)
    n_out, n_in = w.shape
    if m.mode == "mxfp4":
        a = w.reshape(n_out, -1, m.group_size).max(axis=-1)  # (n_out, n_groups)
    else:
        a = np.abs(np.array(m.scales)) * (2**m.bits - 1) + np.abs(np.array(m.biases))
    a = np.maximum(a.repeat(m.group_size, axis=-1), w)  # (n_out, n_in)
    return n_in * 2.0**-22 * (np.abs(x).astype(np.float64) @ a.T)


@pytest.mark.parametrize("qtype", list(aq.FORMS), ids=lambda q: q.name)
@given(
    n_out=st.integers(1, 24), n_blocks=st.integers(1, 3), n_tokens=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_quantized_matmul_matches_the_float_matmul(qtype, n_out, n_blocks, n_tokens, seed):
    """Within float32 rounding of the reference's float matmul (exact types), or of the float
    matmul of the requantized weights, which is within the stated bound of it (bounded)."""
    n_in = max(GGML_QUANT_SIZES[qtype][0], 128) * n_blocks  # groups of up to 128
    t = modest_tensor(qtype, n_out, n_in, seed)
    x = np.random.default_rng(seed + 1).standard_normal((n_tokens, n_in), np.float32)
    m = aq.to_mlx(t, bounded=True)
    got = np.array(aq.quantized_matmul(mx.array(x), m)).astype(np.float64)  # (n_tokens, n_out)
    assert got.shape == (n_tokens, n_out)
    w_ref, w_mlx = expected(t).astype(np.float64), np.array(aq.dequantize_mlx(m))
    tol = matmul_tolerance(x, m)  # (n_tokens, n_out)
    assert np.all(np.abs(got - x @ w_mlx.T) <= tol)
    off = np.abs(x).astype(np.float64) @ np.abs(w_mlx - w_ref).T  # 0 for the exact types
    assert np.all(np.abs(got - x @ w_ref.T) <= tol + off)
    if qtype in aq.EXACT_TYPES:
        assert not off.any()


def test_quantized_matmul_on_smollm2(smollm2_tensors):
    rng = np.random.default_rng(0)
    for name in ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"]:
        t = smollm2_tensors[name]
        x = rng.standard_normal((5, t.shape[1]), np.float32)  # (5, n_in)
        got = np.array(aq.quantized_matmul(mx.array(x), aq.to_mlx(t)))  # (5, n_out)
        assert nmse(x @ t.dequantize().T, got) <= MATMUL_NMSE


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q3_K, T.MXFP4, T.Q6_K], ids=lambda q: q.name)
def test_take_rows_is_a_row_of_dequantize_mlx(qtype):
    m = aq.to_mlx(modest_tensor(qtype, 5, 256, 4), bounded=True)
    idx = mx.array([4, 0, 4])
    assert np.array_equal(np.array(aq.take_rows(m, idx)), np.array(aq.dequantize_mlx(m))[[4, 0, 4]])


def test_quantized_matmul_keeps_leading_dims():
    t = QuantizedTensor.from_float(np.ones((3, 64), np.float32), T.Q8_0)
    x = mx.ones((2, 4, 64))
    assert aq.quantized_matmul(x, aq.to_mlx(t)).shape == (2, 4, 3)


def test_one_and_three_dimensional_tensors_round_trip():
    rng = np.random.default_rng(1)
    for shape in [(64,), (2, 3, 32)]:
        t = QuantizedTensor.from_float(rng.standard_normal(shape, np.float32), T.Q4_0)
        assert aq.dequantize_mlx(aq.to_mlx(t)).shape == shape
        assert_lossless(t)
    t = modest_tensor(T.Q4_K, 6, 256, 2)
    t3 = QuantizedTensor(T.Q4_K, (2, 3, 256), t.data.reshape(2, 3, -1))
    assert np.array_equal(np.array(aq.dequantize_mlx(aq.to_mlx(t3))), expected(t3))


@pytest.mark.parametrize(
    "qtype", [T.F16, T.BF16, T.IQ2_XXS, T.Q6_K, T.Q2_K], ids=lambda q: q.name
)
def test_other_types_are_dequantized_once_by_the_reference(qtype):
    """F16, BF16 and the IQ grid types always, Q6_K and Q2_K unless ``bounded``."""
    n_bytes = ref.row_size(qtype, 256)
    t = modest_tensor(qtype, 3, 256, 2) if qtype in aq.FORMS else QuantizedTensor(
        qtype, (3, 256), np.random.default_rng(2).integers(0, 256, (3, n_bytes), np.uint8)
    )
    if qtype in aq.BOUNDED_TYPES:
        with pytest.raises(QuantError, match=f"{qtype.name} has no exact MLX affine form.*"
                                             "bounded \\(bounded=True\\): Q6_K, Q2_K"):
            aq.to_mlx(t)
        assert isinstance(aq.load_weight(t, bounded=True), aq.MLXQuantized)
        if qtype not in ref.DEQUANTIZE:
            return  # the reference cannot dequantize it yet
    else:
        with pytest.raises(QuantError, match="no exact MLX affine form"):
            aq.to_mlx(t, bounded=True)
        if qtype not in ref.DEQUANTIZE:  # the IQ grid types until the reference reads them
            with pytest.raises(QuantError, match=qtype.name):
                aq.load_weight(t, bounded=True)
            return
        assert not isinstance(aq.load_weight(t, bounded=True), aq.MLXQuantized)
    w = aq.load_weight(t)
    assert isinstance(w, mx.array) and w.dtype == mx.float32
    assert np.array_equal(np.array(w).view(np.uint32), t.dequantize().view(np.uint32))
    assert aq.load_weight(t, mx.float16).dtype == mx.float16


@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
def test_load_weight_keeps_exact_types_quantized_unless_asked(qtype):
    t = modest_tensor(qtype, 2, 256, 5)
    m = aq.load_weight(t)
    assert isinstance(m, aq.MLXQuantized)
    assert (m.bits, m.group_size, m.mode) == (aq.FORMS[qtype].bits, aq.FORMS[qtype].group_size,
                                              aq.FORMS[qtype].mode)
    if qtype in ref.DEQUANTIZE:
        assert np.array_equal(np.array(aq.load_weight(t, keep_quantized=False)), t.dequantize())
    f32 = aq.load_weight(np.arange(4, dtype=np.float32), mx.float16)
    assert f32.dtype == mx.float16 and f32.tolist() == [0, 1, 2, 3]


def test_errors():
    t = QuantizedTensor.from_float(np.ones((3, 64), np.float32), T.Q8_0)
    with pytest.raises(QuantError, match="n_in"):
        aq.quantized_matmul(mx.ones((1, 32)), aq.to_mlx(t))
    with pytest.raises(QuantError, match="floating dtype"):
        aq.load_weight(t, mx.int32)


# ---------------------------------------------------------------------------------------------
# Resident bytes of a Q4_K_M model
# ---------------------------------------------------------------------------------------------


def q4_k_m_weights(n_embd=256, n_ff=768, n_layer=4, n_vocab=2048, seed=0) -> dict:
    """A random llama with Q4_K_M's type mix: Q4_K everywhere, Q6_K for ``output`` and every
    other layer's ``attn_v`` and ``ffn_down``, F32 norms."""
    w = {"token_embd.weight": modest_tensor(T.Q4_K, n_vocab, n_embd, seed),
         "output.weight": modest_tensor(T.Q6_K, n_vocab, n_embd, seed + 1),
         "output_norm.weight": np.ones(n_embd, np.float32)}
    shapes = {"attn_q": (n_embd, n_embd), "attn_k": (n_embd, n_embd), "attn_v": (n_embd, n_embd),
              "attn_output": (n_embd, n_embd), "ffn_gate": (n_ff, n_embd),
              "ffn_up": (n_ff, n_embd), "ffn_down": (n_embd, n_ff)}
    for il in range(n_layer):
        for name, (n_out, n_in) in shapes.items():
            more_bits = il % 2 == 0 and name in ("attn_v", "ffn_down")
            qtype = T.Q6_K if more_bits else T.Q4_K
            w[f"blk.{il}.{name}.weight"] = modest_tensor(qtype, n_out, n_in, seed + 2 + il)
        for name in ("attn_norm", "ffn_norm"):
            w[f"blk.{il}.{name}.weight"] = np.ones(n_embd, np.float32)
    return w


def test_q4_k_m_resident_bytes_are_at_most_1_35_of_the_file():
    w = q4_k_m_weights()
    file_bytes = sum(t.data.nbytes if isinstance(t, QuantizedTensor) else t.nbytes
                     for t in w.values())
    loaded = [aq.load_weight(t, bounded=True) for t in w.values()]
    resident = sum(m.nbytes for m in loaded)
    assert sum(isinstance(m, aq.MLXQuantized) for m in loaded) == 2 + 7 * 4
    assert resident / file_bytes <= 1.35
    f16_bytes = sum(2 * int(np.prod(t.shape)) if isinstance(t, QuantizedTensor) else t.nbytes
                    for t in w.values())  # the same model dequantized to float16
    assert f16_bytes / file_bytes > 3
