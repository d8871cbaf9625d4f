r"""Twin of [`reference.quants`][reference.quants]: GGUF weights on MLX, quantized where that costs
nothing.

MLX stores a quantized matrix with *affine group quantization*: each row is cut into groups
of ``group_size`` consecutive weights, every group has a float ``scale`` $s$ and ``bias``
$b$, and weight $j$ of a group is an unsigned ``bits``-bit integer $q_j$:

$$w_j = s \cdot q_j + b, \qquad q_j \in [0, 2^{\text{bits}} - 1]$$

Three GGUF block formats are this map already, with groups of 32 (one block = one group):

| GGUF type | ggml's dequantization       | $q^{\text{MLX}}$     | bits | scale $s$ | bias $b$   |
|-----------|-----------------------------|----------------------|-----:|-----------|------------|
| Q4_0      | $d \cdot (q - 8)$, $q \in [0, 15]$   | $q$          | 4    | $d$       | $-8d$      |
| Q4_1      | $d \cdot q + m$, $q \in [0, 15]$     | $q$          | 4    | $d$       | $m$        |
| Q8_0      | $d \cdot q$, $q \in [-128, 127]$     | $q + 128$    | 8    | $d$       | $-128d$    |

so [`to_mlx`][] only *moves bits*: it unpacks ggml's nibbles (byte $j$ holds weights $j$
and $j + 16$) and repacks them in MLX's order (a little-endian ``uint32`` word holds
``32 / bits`` consecutive weights, the first in the lowest bits), and widens the float16
$d$ and $m$ to float32 scales and biases.

Why the values are *identical*, not merely close (all arithmetic float32, round to nearest):

- $d$ and $m$ are float16, so exact in float32; $-8d$ and $-128d$ are exact (powers of two);
- $s \cdot q^{\text{MLX}}$ is exact: an 11-bit significand times an integer of at most 8 bits
  fits in float32's 24 bits, and float16's range keeps it far from over- and underflow;
- Q4_1: MLX computes $\mathrm{fl}(d q + m)$, ggml computes $\mathrm{fl}(q d + m)$: the same
  single rounding of the same exact product;
- Q4_0 and Q8_0: $d q^{\text{MLX}} + b = d \cdot (q - 8)$ (resp. $d \cdot q$) exactly, and that
  value fits in float32 (at most 19 significant bits), so the sum is not rounded at all.

One thing differs, and only in bits, never in value: *the sign of zero*. IEEE addition of two
non-zero numbers that cancel gives $+0$, so MLX's $s q + b$ is $+0$ where ggml's product
$d \cdot (q - 8)$ is $-0$ (a Q4_0 block with $d < 0$ and $q = 8$, or $d = \pm 0$ with the
matching sign of $q - 8$; a Q8_0 block with $d = +0$ and $q < 0$, or $d < 0$ and $q = 0$). No
scale and bias can fix that: a zero that is $s q + b$ with $s \ne 0$ is $-0$ only when $q = 0$
and $b = -0$, and the zero of Q4_0 and Q8_0 is an *interior* level ($q = 8$, $q = 0$), while
$q^{\text{MLX}} = 0$ must be an end of the range. Since $-0 = +0$, every product and every sum
that has a non-zero term is unchanged. Q4_1 has no such case: it is bit-identical everywhere.
Non-finite scales (an infinite or NaN float16 $d$, never written by a quantizer) are outside
the proof: $\infty \cdot q - 8\infty$ is NaN where ggml gives $\pm\infty$.

Every other type (F16, BF16, Q5_0, Q5_1 and the K-quants) is dequantized once, at load, by
[`reference.quants.dequantize`][reference.quants.dequantize] ([`load_weight`][]): MLX's affine
groups cannot hold a 5-bit quant, nor a K-quant's two-level scales, without changing values.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType

from reference import quants as ref
from reference.quants import QuantError, QuantizedTensor

T = GGMLQuantizationType


# --8<-- [start:MLXQuantized]
@dataclass(frozen=True, eq=False)
class MLXQuantized:
    """A weight in MLX's affine group quantization: ``w = scales * q + biases`` per group.

    Attributes:
        w_q: uint32 ``(*lead, n // (32 // bits))``: the packed quants, ``32 // bits`` per word,
            the first in the lowest bits; ``lead`` is ``shape[:-1]``, or ``(1,)`` for a 1-D
            weight (MLX wants at least two dimensions).
        scales: float32 ``(*lead, n // group_size)``.
        biases: float32 ``(*lead, n // group_size)``.
        group_size: weights per group (32 for every GGUF type that maps exactly).
        bits: 4 or 8.
        shape: the logical shape in NumPy order, ``(*shape[:-1], n)``.
        qtype: the GGUF type it came from.
    """

    w_q: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType


# --8<-- [end:MLXQuantized]


# --8<-- [start:EXACT_TYPES]
EXACT_TYPES: dict[GGMLQuantizationType, int] = {T.Q4_0: 4, T.Q4_1: 4, T.Q8_0: 8}
"""The GGUF types that run quantized in MLX without loss, and their MLX ``bits``."""
# --8<-- [end:EXACT_TYPES]


def _pack_words(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned quants ``(..., n)`` (values < ``2**bits``) -> MLX words ``(..., n*bits/32)``.

    Weight ``i`` of a word sits in bits ``bits*i`` and up: with 4 bits, byte ``k`` of the
    little-endian word holds weight ``2k`` in its low nibble and ``2k + 1`` in its high one.
    """
    q = q.astype(np.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)  # (..., n // 2) bytes
    return np.ascontiguousarray(q).view("<u4").astype(np.uint32)  # (..., n * bits // 32)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block ``(..., n_blocks, type_size)``, as float32."""
    return (
        np.ascontiguousarray(blocks[..., start : start + 2]).view("<f2")[..., 0].astype(np.float32)
    )  # (..., n_blocks)


# --8<-- [start:to_mlx]
def to_mlx(t: QuantizedTensor) -> MLXQuantized:
    r"""Twin of
    [`reference.quants.QuantizedTensor.dequantize`][reference.quants.QuantizedTensor.dequantize],
    without dequantizing.

    Re-encodes a Q4_0, Q4_1 or Q8_0 tensor in MLX's affine group quantization (group size
    32) so that [`dequantize_mlx`][] gives back the reference's float32 weights: the same
    values, and the same bits except the sign of a zero (see the module docstring).

    | GGUF  | quants $q^{\text{MLX}}$                        | scales | biases   |
    |-------|------------------------------------------------|--------|----------|
    | Q4_0  | the nibbles, in weight order                   | $d$    | $-8d$    |
    | Q4_1  | the nibbles, in weight order                   | $d$    | $m$      |
    | Q8_0  | the int8 bytes plus 128 (flip the top bit)     | $d$    | $-128d$  |

    Args:
        t: the GGUF tensor, ``t.shape == (..., n)``, ``n`` a multiple of 32.

    Returns:
        The [`MLXQuantized`][] weight (float32 scales and biases).

    Raises:
        QuantError: if ``t.qtype`` is not one of [`EXACT_TYPES`][].

    Examples:
        >>> x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
        >>> t = QuantizedTensor.from_float(x, GGMLQuantizationType.Q4_0)
        >>> m = to_mlx(t)
        >>> m.w_q.shape, m.scales.shape, m.bits
        ((2, 4), (2, 1), 4)
        >>> bool(np.array_equal(np.array(dequantize_mlx(m)), t.dequantize()))
        True
    """
    if t.qtype not in EXACT_TYPES:
        raise QuantError(
            f"{t.qtype.name} has no exact MLX affine form; exact types: "
            f"{', '.join(q.name for q in EXACT_TYPES)} (use load_weight to dequantize it)"
        )
    bits = EXACT_TYPES[t.qtype]
    layout = ref.BLOCK_LAYOUTS[t.qtype]
    lead = t.shape[:-1] if len(t.shape) > 1 else (1,)
    n = t.shape[-1]
    blocks = np.ascontiguousarray(t.data).reshape(*lead, n // 32, layout.type_size)
    d = _f16_field(blocks, 0)  # (*lead, n_blocks)
    if t.qtype == T.Q4_0:
        q = ref._nibbles(blocks[..., 2:18])  # (*lead, n_blocks, 32)
        biases = np.float32(-8) * d  # exact: a power of two
    elif t.qtype == T.Q4_1:
        q = ref._nibbles(blocks[..., 4:20])  # (*lead, n_blocks, 32)
        biases = _f16_field(blocks, 2)  # m
    else:  # Q8_0: int8 q -> unsigned q + 128, i.e. flip the sign bit
        q = blocks[..., 2:34] ^ np.uint8(0x80)  # (*lead, n_blocks, 32)
        biases = np.float32(-128) * d  # exact: a power of two
    w_q = _pack_words(q.reshape(*lead, n), bits)  # (*lead, n * bits // 32)
    return MLXQuantized(mx.array(w_q), mx.array(d), mx.array(biases), 32, bits, t.shape, t.qtype)


# --8<-- [end:to_mlx]


# --8<-- [start:dequantize_mlx]
def dequantize_mlx(m: MLXQuantized) -> mx.array:
    """The float32 weights of ``m`` via ``mx.dequantize``:
    [`reference.quants.dequantize`][reference.quants.dequantize]'s.

    Takes the [`MLXQuantized`][] form instead of raw bytes and a type.

    Args:
        m: the weight, logical shape ``m.shape``.

    Returns:
        float32 ``m.shape``.

    Examples:
        >>> x = np.full((1, 32), 127.0, np.float32)   # d = 1, q = 127
        >>> t = QuantizedTensor.from_float(x, GGMLQuantizationType.Q8_0)
        >>> dequantize_mlx(to_mlx(t)).tolist()[0][:3]
        [127.0, 127.0, 127.0]
    """
    w = mx.dequantize(m.w_q, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
    return w.reshape(m.shape)  # shape


# --8<-- [end:dequantize_mlx]


# --8<-- [start:quantized_matmul]
def quantized_matmul(x: mx.array, m: MLXQuantized) -> mx.array:
    """``ggml_mul_mat(W, x)`` with a quantized ``W``: ``x @ W.T`` by ``mx.quantized_matmul``.

    The weights stay packed; MLX dequantizes a group at a time inside the kernel, so the
    result equals ``x @ dequantize_mlx(m).T`` up to the order of the float32 sums (NMSE around
    1e-14 on random data, far below the 5e-4 matmul threshold).

    Args:
        x: float32 ``(..., n_in)``.
        m: the weight, ``m.shape == (n_out, n_in)``.

    Returns:
        float32 ``(..., n_out)``.

    Raises:
        QuantError: if ``m`` is not 2-D or the inner sizes differ.

    Examples:
        >>> w = 127 * np.eye(32, dtype=np.float32)   # d = 1 in every block
        >>> t = QuantizedTensor.from_float(w, GGMLQuantizationType.Q8_0)
        >>> quantized_matmul(mx.arange(32, dtype=mx.float32)[None], to_mlx(t)).tolist()[0][:4]
        [0.0, 127.0, 254.0, 381.0]
    """
    if len(m.shape) != 2 or x.shape[-1] != m.shape[1]:
        raise QuantError(
            f"quantized_matmul needs x (..., n_in) and W (n_out, n_in); "
            f"got x {tuple(x.shape)} and W {m.shape}"
        )
    return mx.quantized_matmul(
        x, m.w_q, m.scales, m.biases, transpose=True, group_size=m.group_size, bits=m.bits
    )  # (..., n_out)


# --8<-- [end:quantized_matmul]


# --8<-- [start:load_weight]
def load_weight(
    t: QuantizedTensor | np.ndarray,
    dtype: mx.Dtype = mx.float32,
    keep_quantized: bool = True,
) -> MLXQuantized | mx.array:
    """One GGUF tensor as MLX will use it: quantized if exact, else dequantized once.

    Q4_0, Q4_1 and Q8_0 become [`MLXQuantized`][] ([`to_mlx`][], lossless) unless
    ``keep_quantized`` is false. Every other type is dequantized by the reference
    ([`reference.quants.dequantize`][reference.quants.dequantize], float32) and cast to ``dtype``:
    F16 and F32 arrays keep their values in float16, other types are rounded to it.

    Args:
        t: a [`reference.quants.QuantizedTensor`][reference.quants.QuantizedTensor], or a float
            array (GGUF's F32 tensors are read as NumPy arrays).
        dtype: ``mx.float32`` or ``mx.float16`` (or ``mx.bfloat16``) for dequantized weights.
        keep_quantized: keep the exact types quantized.

    Returns:
        [`MLXQuantized`][], or an ``mx.array`` of ``t.shape`` and ``dtype``.

    Raises:
        QuantError: if the type cannot be dequantized (from
            [`reference.quants.dequantize`][reference.quants.dequantize]) or ``dtype`` is not a
            floating type.

    Examples:
        >>> x = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)
        >>> type(load_weight(QuantizedTensor.from_float(x, GGMLQuantizationType.Q4_1))).__name__
        'MLXQuantized'
        >>> load_weight(QuantizedTensor.from_float(x, GGMLQuantizationType.F16), mx.float16).dtype
        mlx.core.float16
    """
    if not mx.issubdtype(dtype, mx.floating):
        raise QuantError(f"load_weight needs a floating dtype, got {dtype}")
    if isinstance(t, QuantizedTensor):
        if keep_quantized and t.qtype in EXACT_TYPES:
            return to_mlx(t)
        w = t.dequantize()  # float32, shape
    else:
        w = np.asarray(t)
    return mx.array(w).astype(dtype)


# --8<-- [end:load_weight]
