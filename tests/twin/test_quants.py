"""Proof that Q4_0, Q4_1 and Q8_0 run quantized in MLX without changing a weight.

The law (module docstring of :mod:`accelerated.quants`): for every block with a finite
float16 scale, ``mx.dequantize(to_mlx(t))`` equals :func:`reference.quants.dequantize`
bit for bit (compared as uint32 views of float32), except that a weight the reference
computes as ``-0.0`` comes out ``+0.0`` for Q4_0 and Q8_0 (never for Q4_1). Checked on
random blocks (with zero, largest, negative and subnormal scales forced in) and on every
quantized tensor of SmolLM2-135M (Q4_1 and Q8_0), which is bit-identical with no exception.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from accelerated import quants as aq
from reference import quants as ref
from reference.quants import BLOCK_LAYOUTS, QuantError, QuantizedTensor
from reference.testing import nmse

T = GGMLQuantizationType
EXACT = [T.Q4_0, T.Q4_1, T.Q8_0]
NEG_ZERO = np.uint32(0x80000000)
MATMUL_NMSE = 5e-4  # test-backend-ops' threshold for mul_mat

# float16 bit patterns of scales worth forcing: zeros, the largest finite, the smallest and
# largest subnormals, the smallest normal, one, and their negatives.
EDGE_F16 = [0x0000, 0x7BFF, 0x0001, 0x03FF, 0x0400, 0x3C00]
EDGE_F16 += [b | 0x8000 for b in EDGE_F16]


def finite_f16_bits() -> st.SearchStrategy[int]:
    """float16 bit patterns of finite numbers (exponent field not all ones), edges first."""
    any_finite = st.integers(0, 0xFFFF).filter(lambda b: (b >> 10) & 0x1F != 0x1F)
    return st.one_of(st.sampled_from(EDGE_F16), any_finite)


@st.composite
def quantized_tensors(draw: st.DrawFn, qtype: GGMLQuantizationType) -> QuantizedTensor:
    """A random tensor of ``qtype``: random quant bytes, finite scales (edges included)."""
    n_rows = draw(st.integers(1, 4))
    n_blocks = draw(st.integers(1, 4))
    size = BLOCK_LAYOUTS[qtype].type_size
    seed = draw(st.integers(0, 2**32 - 1))
    blocks = np.random.default_rng(seed).integers(0, 256, (n_rows, n_blocks, size), np.uint8)
    if draw(st.booleans()):  # a block of zero quants (the qs field ends the block)
        blocks[0, 0, size - (32 if qtype == T.Q8_0 else 16) :] = 0
    n_scales = 2 if qtype == T.Q4_1 else 1
    bits = draw(
        st.lists(
            finite_f16_bits(),
            min_size=n_scales * n_rows * n_blocks,
            max_size=n_scales * n_rows * n_blocks,
        )
    )
    scales = np.array(bits, np.uint16).astype("<u2").view(np.uint8)
    blocks[..., : 2 * n_scales] = scales.reshape(n_rows, n_blocks, 2 * n_scales)
    data = blocks.reshape(n_rows, n_blocks * size)
    return QuantizedTensor(qtype, (n_rows, n_blocks * 32), data)


def assert_lossless(t: QuantizedTensor) -> int:
    """The law; returns how many weights differ in bits (reference -0.0, MLX +0.0)."""
    want = t.dequantize()
    got = np.array(aq.dequantize_mlx(aq.to_mlx(t)))
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)  # the same values (no NaN: scales are finite)
    w_bits, g_bits = want.view(np.uint32), got.view(np.uint32)
    differ = w_bits != g_bits
    assert np.all(w_bits[differ] == NEG_ZERO) and np.all(g_bits[differ] == 0)
    if t.qtype == T.Q4_1:
        assert not differ.any()
    return int(differ.sum())


@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
@given(data=st.data())
def test_dequantize_is_bit_identical_on_random_blocks(qtype, data):
    assert_lossless(data.draw(quantized_tensors(qtype)))


def one_block(qtype: GGMLQuantizationType, scale: float, quants: np.ndarray) -> QuantizedTensor:
    """A single block with the given float16 scale (and m = 0) and quants in weight order."""
    d = np.array([scale], "<f2").view(np.uint8)
    if qtype == T.Q8_0:
        block = np.concatenate([d, quants.astype(np.int8).view(np.uint8)])
    else:
        qs = (quants[:16] | (quants[16:] << 4)).astype(np.uint8)
        m = np.zeros(2, np.uint8) if qtype == T.Q4_1 else np.zeros(0, np.uint8)
        block = np.concatenate([d, m, qs])
    return QuantizedTensor(qtype, (1, 32), block[None])


@pytest.mark.parametrize("scale", [-65504.0, -1.0, -(2.0**-24), -0.0, 0.0, 2.0**-24, 1.0, 65504.0])
def test_the_only_bit_difference_is_the_sign_of_zero(scale):
    """Exactly the weights that the reference makes -0.0 differ, and only Q4_0/Q8_0 ones."""
    q4 = np.arange(32) % 16  # every nibble twice, q = 8 included
    q8 = np.arange(-16, 16)  # q = 0 included
    for qtype, q in [(T.Q4_0, q4), (T.Q4_1, q4), (T.Q8_0, q8)]:
        t = one_block(qtype, scale, q)
        neg_zeros = int((t.dequantize().view(np.uint32) == NEG_ZERO).sum())
        assert assert_lossless(t) == (0 if qtype == T.Q4_1 else neg_zeros)
    # Q4_0 with d < 0: the two q = 8 weights are -0.0 in the reference
    if np.signbit(scale) and scale != 0:
        assert assert_lossless(one_block(T.Q4_0, scale, q4)) == 2


def test_infinite_scale_is_outside_the_law():
    """d = inf (never written by a quantizer): MLX's inf*q - 8*inf is NaN, ggml's is inf."""
    t = one_block(T.Q4_0, np.inf, np.full(32, 9))
    assert np.all(t.dequantize() == np.inf)
    assert np.all(np.isnan(np.array(aq.dequantize_mlx(aq.to_mlx(t)))))


def test_packing_order_matches_mx_quantize():
    """Our words are MLX's: mx.quantize of weights 0..15 (scale 1, bias 0) packs the same."""
    w = np.tile(np.arange(16, dtype=np.float32), 2)[None]  # (1, 32)
    t = one_block(T.Q4_1, 1.0, w[0].astype(np.int64))
    w_q, scales, biases = mx.quantize(mx.array(w), group_size=32, bits=4)
    ours = aq.to_mlx(t)
    # MLX may pick a different but equivalent (scale, bias); compare the decoded values
    # and, when it picks scale 1 / bias 0, the words themselves.
    if float(scales[0, 0]) == 1.0 and float(biases[0, 0]) == 0.0:
        assert np.array_equal(np.array(w_q), np.array(ours.w_q))
    assert np.array(ours.w_q)[0, 0] == 0x76543210  # weight 0 in the lowest nibble
    assert np.array_equal(np.array(aq.dequantize_mlx(ours)), w)


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



@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
@given(
    n_out=st.integers(1, 40),
    n_blocks=st.integers(1, 6),
    n_tokens=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_quantized_matmul_matches_dequantized_matmul(qtype, n_out, n_blocks, n_tokens, seed):
    rng = np.random.default_rng(seed)
    n_in = 32 * n_blocks
    t = QuantizedTensor.from_float(rng.standard_normal((n_out, n_in), np.float32), qtype)
    x = rng.standard_normal((n_tokens, n_in), np.float32)
    got = np.array(aq.quantized_matmul(mx.array(x), aq.to_mlx(t)))  # (n_tokens, n_out)
    want = x @ t.dequantize().T  # (n_tokens, n_out)
    assert got.shape == (n_tokens, n_out)
    assert nmse(want, got) <= MATMUL_NMSE


def test_quantized_matmul_on_smollm2(smollm2_tensors):
    rng = np.random.default_rng(0)
    for name in ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"]:
        t = smollm2_tensors[name]
        x = rng.standard_normal((5, t.shape[1]), np.float32)  # (5, n_in)
        got = np.array(aq.quantized_matmul(mx.array(x), aq.to_mlx(t)))  # (5, n_out)
        assert nmse(x @ t.dequantize().T, got) <= MATMUL_NMSE


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


@pytest.mark.parametrize(
    "qtype", [T.F16, T.BF16, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda q: q.name
)
def test_other_types_are_dequantized_once_by_the_reference(qtype):
    layout = BLOCK_LAYOUTS[qtype]
    n = 2 * max(layout.block_size, 32)
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, (3, ref.row_size(qtype, n)), np.uint8)
    t = QuantizedTensor(qtype, (3, n), data)
    with pytest.raises(QuantError, match="no exact MLX affine form"):
        aq.to_mlx(t)
    w = aq.load_weight(t)
    assert isinstance(w, mx.array) and w.dtype == mx.float32
    assert np.array_equal(np.array(w).view(np.uint32), t.dequantize().view(np.uint32))
    assert aq.load_weight(t, mx.float16).dtype == mx.float16


def test_load_weight_keeps_exact_types_quantized_unless_asked():
    t = QuantizedTensor.from_float(np.linspace(-1, 1, 64, dtype=np.float32)[None], T.Q4_1)
    assert isinstance(aq.load_weight(t), aq.MLXQuantized)
    w = aq.load_weight(t, keep_quantized=False)
    assert np.array_equal(np.array(w), t.dequantize())
    f32 = aq.load_weight(np.arange(4, dtype=np.float32), mx.float16)
    assert f32.dtype == mx.float16 and f32.tolist() == [0, 1, 2, 3]


def test_errors():
    t = QuantizedTensor.from_float(np.ones((3, 64), np.float32), T.Q8_0)
    with pytest.raises(QuantError, match="n_in"):
        aq.quantized_matmul(mx.ones((1, 32)), aq.to_mlx(t))
    with pytest.raises(QuantError, match="floating dtype"):
        aq.load_weight(t, mx.int32)
