r"""GGUF block formats: how ggml stores quantized weights, and how to read them back.

A quantized GGUF tensor is a sequence of *blocks*. Each row of a weight matrix (the last
dimension in NumPy order, ``ne[0]`` in ggml) is cut into blocks of ``block_size`` consecutive
weights, and each block is stored in ``type_size`` bytes: one or a few numbers that set the
scale of the block (float16 mostly; float32 in Q8_K, a bare exponent in MXFP4, 8-bit floats in
NVFP4), followed by small integers (1.6 to 8 bits) packed into bytes. Dequantization of one
weight is an affine map of its integer $q$, or of a table entry $K[q]$:

- $w = d \cdot q$ for the symmetric types (Q4_0, Q5_0, Q3_K and Q6_K after an offset, Q8_0,
  Q8_K; the ternary TQ1_0 and TQ2_0, whose $q - 1$ is $-1$, $0$ or $1$);
- $w = d \cdot q + m$ for the types with a minimum (Q4_1, Q5_1; Q2_K, Q4_K and Q5_K subtract a
  quantized minimum);
- $w = d \cdot K[q]$ for the non-linear types: IQ4_NL and IQ4_XS (16 levels denser near zero),
  MXFP4 and NVFP4 (the 16 values of the FP4 format E2M1).

Why blocks: one scale per tensor would let one outlier weight flatten every other weight to
zero; one scale per block of 32 keeps the error of each weight proportional to the largest
weight *near it*, for the price of 16 bits of scale per 32 weights (0.5 bit per weight).
The K-quants (Q2_K to Q6_K) go one step further: a *super-block* of ``QK_K = 256`` weights
has one or two float16 scales, and its 8 (or 16) sub-blocks have their own scales quantized
to 4, 6 or 8 bits relative to them, which brings the overhead down to 0.25-0.6 bit per weight
with smaller sub-blocks. IQ4_XS does the same for IQ4_NL's levels.

This module mirrors ggml at the pinned commit:

- the block structs of ``ggml/src/ggml-common.h`` (``block_q4_0``, ``block_q4_K``, ...) become
  `BLOCK_LAYOUTS` and the byte tables in each function's docstring;
- ``dequantize_row_*`` of ``ggml/src/ggml-quants.c`` become ``dequantize_q4_0`` and friends,
  for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, TQ1_0,
  TQ2_0, IQ4_NL, IQ4_XS, MXFP4 and NVFP4, bit-identical to ggml's own C (tested through the
  ``libggml-base`` that llama-cpp-python ships) and to ``gguf.quants.dequantize`` (which does
  not read Q8_K): float32 arithmetic in the same order (a C compiler that contracts
  ``d1 * q - m1`` into a fused multiply-add may differ in the last bit; the pinned build does
  not). The grid I-quants (IQ1_*, IQ2_*, IQ3_*) are read by ``reference/quants_iq.py``;
- ``quantize_row_q8_0_ref``, ``quantize_row_q4_0_ref``, ``quantize_row_q4_1_ref`` (the
  reference quantizers used to make model files deterministically) become ``quantize_q8_0``,
  ``quantize_q4_0``, ``quantize_q4_1``, byte-identical to ``gguf.quants.quantize``; the
  K-quants' (``quantize_row_q2_K_ref`` to ``quantize_row_q6_K_ref``, what ``llama-quantize``
  writes into ``Q4_K_M``/``Q5_K_M``/``Q6_K`` files without an importance matrix) are in
  ``reference/quants_k.py``, byte-identical to ggml's C.

Every per-format function works on all blocks at once: its input is ``(..., type_size)`` bytes
(or ``(..., block_size)`` floats) with any leading dimensions, and the fields of the block are
slices of the last axis. [`dequantize`][] and [`quantize`][] cut whole rows into blocks.
All quantization arithmetic is float32, as in ggml, whatever the input dtype.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from reference.common import QuantError
from reference.quants_iq import IQ_DEQUANTIZERS
from reference.quants_k import K_QUANTIZERS

# --8<-- [start:constants]
QK_K = 256  # weights per super-block of the K-quants
K_SCALE_SIZE = 12  # bytes of packed 6-bit scales and mins in block_q4_K / block_q5_K
QK4_0 = 32  # weights per block of the "legacy" quants
QK4_1 = 32
QK5_0 = 32
QK5_1 = 32
QK8_0 = 32
QK4_NL = 32  # weights per block of IQ4_NL
QK_MXFP4 = 32  # weights per block of MXFP4 (one shared E8M0 exponent)
QK_NVFP4 = 64  # weights per block of NVFP4 ...
QK_NVFP4_SUB = 16  # ... in 4 sub-blocks, each with its own UE4M3 scale
# --8<-- [end:constants]




# --8<-- [start:BlockLayout]
@dataclass(frozen=True)
class BlockLayout:
    """How many weights one block holds and how many bytes it takes.

    These are ggml's ``type_traits[type].blck_size`` and ``.type_size``; a row of ``n``
    weights takes ``n // block_size * type_size`` bytes (``ggml_row_size``).

    Examples:
        >>> BLOCK_LAYOUTS[GGMLQuantizationType.Q4_K]
        BlockLayout(block_size=256, type_size=144)
        >>> BLOCK_LAYOUTS[GGMLQuantizationType.Q4_K].bits_per_weight
        4.5
    """

    block_size: int  # weights per block
    type_size: int  # bytes per block

    @property
    def bits_per_weight(self) -> float:
        """Storage cost: ``8 * type_size / block_size``."""
        return 8 * self.type_size / self.block_size


# --8<-- [end:BlockLayout]

# --8<-- [start:BLOCK_LAYOUTS]
T = GGMLQuantizationType
F16_SIZE = 2  # sizeof(ggml_half)

BLOCK_LAYOUTS: dict[GGMLQuantizationType, BlockLayout] = {
    # Plain floats: a "block" is one weight.
    T.F32: BlockLayout(1, 4),
    T.F16: BlockLayout(1, F16_SIZE),
    T.BF16: BlockLayout(1, 2),
    # Legacy quants: 32 weights, one f16 scale d (and a min m), packed quants.
    T.Q4_0: BlockLayout(QK4_0, F16_SIZE + QK4_0 // 2),
    T.Q4_1: BlockLayout(QK4_1, 2 * F16_SIZE + QK4_1 // 2),
    T.Q5_0: BlockLayout(QK5_0, F16_SIZE + 4 + QK5_0 // 2),
    T.Q5_1: BlockLayout(QK5_1, 2 * F16_SIZE + 4 + QK5_1 // 2),
    T.Q8_0: BlockLayout(QK8_0, F16_SIZE + QK8_0),
    # K-quants: super-blocks of 256 weights with quantized sub-block scales.
    T.Q2_K: BlockLayout(QK_K, QK_K // 16 + QK_K // 4 + 2 * F16_SIZE),
    T.Q3_K: BlockLayout(QK_K, QK_K // 8 + QK_K // 4 + 12 + F16_SIZE),
    T.Q4_K: BlockLayout(QK_K, 2 * F16_SIZE + K_SCALE_SIZE + QK_K // 2),
    T.Q5_K: BlockLayout(QK_K, 2 * F16_SIZE + K_SCALE_SIZE + QK_K // 8 + QK_K // 2),
    T.Q6_K: BlockLayout(QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + F16_SIZE),
    # Q8_K: a float32 scale and 16 int16 sums (ggml quantizes activations to it for K-quant dots)
    T.Q8_K: BlockLayout(QK_K, 4 + QK_K + QK_K // 16 * 2),
    # Ternary quants: weights in {-1, 0, 1} times one f16 scale per 256.
    T.TQ1_0: BlockLayout(QK_K, (QK_K - 4 * QK_K // 64) // 5 + QK_K // 64 + F16_SIZE),
    T.TQ2_0: BlockLayout(QK_K, QK_K // 4 + F16_SIZE),
    # Non-linear 4-bit quants: a 4-bit index into a fixed table of 16 levels.
    T.IQ4_NL: BlockLayout(QK4_NL, F16_SIZE + QK4_NL // 2),
    T.IQ4_XS: BlockLayout(QK_K, F16_SIZE + 2 + QK_K // 64 + QK_K // 2),
    # FP4 (E2M1) values with a power-of-two (E8M0) or small-float (UE4M3) scale.
    T.MXFP4: BlockLayout(QK_MXFP4, 1 + QK_MXFP4 // 2),
    T.NVFP4: BlockLayout(QK_NVFP4, QK_NVFP4 // QK_NVFP4_SUB + QK_NVFP4 // 2),
}
# --8<-- [end:BLOCK_LAYOUTS]


# --8<-- [start:row_size]
def row_size(qtype: GGMLQuantizationType, n_per_row: int) -> int:
    """``ggml_row_size``: the bytes of one row of ``n_per_row`` weights of type ``qtype``.

    Args:
        qtype: any ggml tensor type (sizes of types we do not read come from gguf's table).
        n_per_row: weights per row; a multiple of the type's block size.

    Returns:
        ``n_per_row // block_size * type_size``.

    Raises:
        QuantError: if the type is unknown or the row does not split into whole blocks.

    Examples:
        >>> row_size(GGMLQuantizationType.Q4_1, 576)   # 18 blocks of 20 bytes
        360
    """
    layout = _layout(qtype)
    if n_per_row % layout.block_size != 0:
        raise QuantError(
            f"a row of {n_per_row} weights is not a whole number of {qtype.name} blocks "
            f"({layout.block_size} weights each)"
        )
    return n_per_row // layout.block_size * layout.type_size


# --8<-- [end:row_size]


def _layout(qtype: GGMLQuantizationType) -> BlockLayout:
    """The block layout of any ggml type: ours when we read it, else gguf's size table.

    Knowing the size of a type we cannot dequantize lets a file that holds one be read (and
    inspected); only [`dequantize`][] refuses it.
    """
    if qtype in BLOCK_LAYOUTS:
        return BLOCK_LAYOUTS[qtype]
    if qtype in GGML_QUANT_SIZES:
        return BlockLayout(*GGML_QUANT_SIZES[qtype])
    name = getattr(qtype, "name", repr(qtype))
    raise QuantError(f"{name} is not a ggml tensor type")


# ---------------------------------------------------------------------------------------------
# Reading and writing the fields of a block
# ---------------------------------------------------------------------------------------------


def _f16(field: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes ``(..., 2)`` -> float32 ``(..., 1)`` (GGML_FP16_TO_FP32)."""
    return np.ascontiguousarray(field).view("<f2").astype(np.float32)


def _f16_bytes(value: np.ndarray) -> np.ndarray:
    """float32 ``(..., 1)`` -> little-endian float16 bytes ``(..., 2)`` (GGML_FP32_TO_FP16).

    NumPy's cast rounds to nearest, ties to even, like ggml's; a scale beyond the float16
    range becomes infinity there as here.
    """
    with np.errstate(over="ignore"):
        return value.astype("<f2").view(np.uint8)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes ``(..., n)`` -> 4-bit values ``(..., 2n)``: all low nibbles, then all high ones.

    This is the order of every ggml 4-bit field: byte ``j`` holds weight ``j`` in its low
    nibble and weight ``j + n`` in its high nibble.
    """
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _roundf(x: np.ndarray) -> np.ndarray:
    """C's ``roundf``: round to nearest, ties away from zero (``np.round`` ties to even)."""
    a = np.abs(x)
    r = np.floor(a)
    r = r + (a - r >= 0.5)  # a - r is exact in float32
    return np.copysign(r, x)


def _inverse(d: np.ndarray) -> np.ndarray:
    """``id = d ? 1.0f/d : 0.0f``: the reciprocal scale, 0 for an all-zero block."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d)


# ---------------------------------------------------------------------------------------------
# Floats
# ---------------------------------------------------------------------------------------------


# --8<-- [start:dequantize_f32]
def dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    """F32 stored as raw bytes: little-endian IEEE float32, 4 bytes per weight.

    Args:
        blocks: uint8 ``(..., 4 * n)``.

    Returns:
        float32 ``(..., n)``.

    Examples:
        >>> dequantize_f32(np.array([0, 0, 128, 63], dtype=np.uint8))
        array([1.], dtype=float32)
    """
    return np.ascontiguousarray(blocks).view("<f4").astype(np.float32)


# --8<-- [end:dequantize_f32]


# --8<-- [start:dequantize_f16]
def dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    """F16 stored as raw bytes: little-endian IEEE half precision, 2 bytes per weight.

    | bits  | field    | meaning                    |
    |-------|----------|----------------------------|
    | 15    | sign     |                            |
    | 14-10 | exponent | bias 15                    |
    | 9-0   | mantissa | 10 bits, implicit leading 1 |

    The conversion to float32 is exact (``GGML_FP16_TO_FP32``).

    Args:
        blocks: uint8 ``(..., 2 * n)``.

    Returns:
        float32 ``(..., n)``.

    Examples:
        >>> dequantize_f16(np.array([0x00, 0x3C, 0x00, 0xC0], dtype=np.uint8))
        array([ 1., -2.], dtype=float32)
    """
    return _f16(blocks)


# --8<-- [end:dequantize_f16]


# --8<-- [start:dequantize_bf16]
def dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    """BF16 stored as raw bytes: the upper 16 bits of a float32, 2 bytes per weight.

    | bits  | field    | meaning                    |
    |-------|----------|----------------------------|
    | 15    | sign     |                            |
    | 14-7  | exponent | bias 127, as float32       |
    | 6-0   | mantissa | the top 7 of float32's 23  |

    ``ggml_compute_bf16_to_fp32``: shift the 16 bits up into a uint32 and read it as a float.

    Args:
        blocks: uint8 ``(..., 2 * n)``.

    Returns:
        float32 ``(..., n)``.

    Examples:
        >>> dequantize_bf16(np.array([0x80, 0x3F, 0x40, 0xC0], dtype=np.uint8))
        array([ 1., -3.], dtype=float32)
    """
    bits = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16
    return bits.view(np.float32)


# --8<-- [end:dequantize_bf16]


# --8<-- [start:quantize_f32]
def quantize_f32(x: np.ndarray) -> np.ndarray:
    """float -> F32 raw bytes (little-endian).

    Args:
        x: float ``(..., n)``.

    Returns:
        uint8 ``(..., 4 * n)``.

    Examples:
        >>> quantize_f32(np.array([1.0], dtype=np.float32))
        array([  0,   0, 128,  63], dtype=uint8)
    """
    return np.ascontiguousarray(x, dtype="<f4").view(np.uint8)


# --8<-- [end:quantize_f32]


# --8<-- [start:quantize_f16]
def quantize_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> F16 raw bytes: round to nearest, ties to even (``GGML_FP32_TO_FP16``).

    Values beyond the float16 range (65504) become infinities.

    Args:
        x: float ``(..., n)``, converted to float32 first.

    Returns:
        uint8 ``(..., 2 * n)``.

    Examples:
        >>> quantize_f16(np.array([1.0, -2.0], dtype=np.float32))
        array([  0,  60,   0, 192], dtype=uint8)
    """
    return _f16_bytes(np.ascontiguousarray(x, dtype=np.float32))


# --8<-- [end:quantize_f16]


# --8<-- [start:quantize_bf16]
def quantize_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 raw bytes, as ``ggml_compute_fp32_to_bf16``.

    Keep the upper 16 bits of the float32, rounded to nearest with ties to even (add
    ``0x7fff`` plus the lowest kept bit, then shift). A NaN is not rounded (that could carry
    into the exponent and make an infinity): its upper half is kept and the quiet bit
    (``64``) is set.

    Args:
        x: float ``(..., n)``, converted to float32 first.

    Returns:
        uint8 ``(..., 2 * n)``.

    Examples:
        >>> quantize_bf16(np.array([1.0, -3.0], dtype=np.float32))
        array([128,  63,  64, 192], dtype=uint8)
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16  # no overflow: u <= 0xff800000 here
    bits = np.where(is_nan, (u >> 16) | 64, rounded)
    return bits.astype("<u2").view(np.uint8)


# --8<-- [end:quantize_bf16]


# ---------------------------------------------------------------------------------------------
# Legacy quants: blocks of 32
# ---------------------------------------------------------------------------------------------


# --8<-- [start:dequantize_q8_0]
def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q8_0``: 8-bit quants, one scale per 32 weights (8.5 bits/weight).

    ``block_q8_0`` (34 bytes):

    | byte offset | field | type       | meaning                         |
    |------------:|-------|------------|---------------------------------|
    | 0           | `d`   | f16        | scale (delta)                   |
    | 2           | `qs`  | int8[32]   | quant $q_j$ of weight $j$       |

    $$w_j = d \cdot q_j, \qquad q_j \in [-128, 127]$$

    Args:
        blocks: uint8 ``(..., 34)``.

    Returns:
        float32 ``(..., 32)``.

    Examples:
        >>> block = np.zeros(34, dtype=np.uint8)
        >>> block[0:2] = np.array([0.5], dtype="<f2").view(np.uint8)   # d = 0.5
        >>> block[2:5] = np.array([1, -2, 127], dtype=np.int8).view(np.uint8)
        >>> dequantize_q8_0(block)[:4]
        array([ 0.5, -1. , 63.5,  0. ], dtype=float32)
    """
    d = _f16(blocks[..., 0:2])  # (..., 1)
    q = blocks[..., 2:34].view(np.int8)  # (..., 32)
    return q.astype(np.float32) * d


# --8<-- [end:dequantize_q8_0]


# --8<-- [start:quantize_q8_0]
def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q8_0_ref``: float32 blocks of 32 -> ``block_q8_0`` bytes.

    The scale maps the largest magnitude onto 127, and each weight is rounded to the
    nearest integer, ties away from zero (C's ``roundf``):

    $$d = \frac{\max_j |x_j|}{127}, \qquad q_j = \operatorname{roundf}(x_j \cdot d^{-1}),
      \qquad d^{-1} = 0 \text{ if } d = 0$$

    $d$ is computed in float32 and then stored as float16, so the weights come back as
    $q_j \cdot \operatorname{f16}(d)$: the error of a weight is at most
    $d/2 + 127\,|d - \operatorname{f16}(d)|$ (plus float32 rounding).

    Args:
        x: float ``(..., 32)``, converted to float32 first.

    Returns:
        uint8 ``(..., 34)``.

    Examples:
        >>> x = np.linspace(-1.0, 1.0, 32, dtype=np.float32)
        >>> block = quantize_q8_0(x)
        >>> block.shape, block[2:6].view(np.int8)
        ((34,), array([-127, -119, -111, -102], dtype=int8))
        >>> bool(np.abs(dequantize_q8_0(block) - x).max() <= 0.5 / 127 + 1e-4)
        True
    """
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x), axis=-1, keepdims=True)  # (..., 1)
    d = amax / np.float32(127)
    q = _roundf(x * _inverse(d)).astype(np.int8)  # (..., 32)
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=-1)  # (..., 34)


# --8<-- [end:quantize_q8_0]


# --8<-- [start:dequantize_q4_0]
def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q4_0``: 4-bit quants with offset 8, one scale (4.5 bits/weight).

    ``block_q4_0`` (18 bytes):

    | byte offset | field | type       | meaning                                          |
    |------------:|-------|------------|--------------------------------------------------|
    | 0           | `d`   | f16        | scale (delta)                                    |
    | 2           | `qs`  | uint8[16]  | byte $j$: $q_j$ in bits 0-3, $q_{j+16}$ in 4-7   |

    $$w_j = d \cdot (q_j - 8), \qquad q_j \in [0, 15]$$

    Args:
        blocks: uint8 ``(..., 18)``.

    Returns:
        float32 ``(..., 32)``.

    Examples:
        >>> block = np.zeros(18, dtype=np.uint8)
        >>> block[0:2] = np.array([0.25], dtype="<f2").view(np.uint8)   # d = 0.25
        >>> block[2] = 0xF0        # q_0 = 0, q_16 = 15
        >>> w = dequantize_q4_0(block)
        >>> float(w[0]), float(w[1]), float(w[16])
        (-2.0, -2.0, 1.75)
    """
    d = _f16(blocks[..., 0:2])  # (..., 1)
    q = _nibbles(blocks[..., 2:18])  # (..., 32)
    return (q.astype(np.int8) - np.int8(8)).astype(np.float32) * d


# --8<-- [end:dequantize_q4_0]


# --8<-- [start:quantize_q4_0]
def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q4_0_ref``: float32 blocks of 32 -> ``block_q4_0`` bytes.

    The scale is signed: ``max`` is the weight of largest magnitude *with its sign* (the
    first one when several tie), and $d = \mathrm{max} / -8$, so that this weight becomes
    exactly $-8 \cdot d$ (quant 0) and the other 15 levels cover the opposite side. Quants
    are truncated after adding 8.5 (round half up) and clipped to 15:

    $$d = \frac{\mathrm{max}}{-8}, \qquad
      q_j = \min\bigl(15, \operatorname{trunc}(x_j \cdot d^{-1} + 8.5)\bigr)$$

    A weight of the opposite sign and the same magnitude as ``max`` would need quant 16 and
    is clipped: the error bound is $|d|$ for weights with $x_j d^{-1} > 7.5$ and $|d|/2$
    elsewhere (plus the float16 rounding of $d$, times $|q_j - 8| \le 8$).

    For an all-zero block ggml's loop keeps ``max = 0.0f`` and stores $d = -0.0$; this
    follows ``gguf.quants``, which takes ``max`` from the block, so a block whose first
    weight is $-0.0$ stores $d = +0.0$. Both dequantize to zeros.

    Args:
        x: float ``(..., 32)``, converted to float32 first.

    Returns:
        uint8 ``(..., 18)``.

    Examples:
        >>> x = np.zeros(32, dtype=np.float32)
        >>> x[0], x[16] = -4.0, 2.0
        >>> block = quantize_q4_0(x)
        >>> float(block[0:2].view("<f2")[0])     # d = -4 / -8
        0.5
        >>> dequantize_q4_0(block)[[0, 1, 16]]
        array([-4.,  0.,  2.], dtype=float32)
    """
    x = np.asarray(x, dtype=np.float32)
    imax = np.argmax(np.abs(x), axis=-1, keepdims=True)  # (..., 1)
    max = np.take_along_axis(x, imax, axis=-1)  # (..., 1)
    d = max / np.float32(-8)
    xi = np.trunc(x * _inverse(d) + np.float32(8.5)).astype(np.int8)  # (..., 32)
    q = np.minimum(xi, 15).astype(np.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)  # (..., 16)
    return np.concatenate([_f16_bytes(d), qs], axis=-1)  # (..., 18)


# --8<-- [end:quantize_q4_0]


# --8<-- [start:dequantize_q4_1]
def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q4_1``: 4-bit quants, a scale and a minimum (5 bits/weight).

    ``block_q4_1`` (20 bytes):

    | byte offset | field | type       | meaning                                          |
    |------------:|-------|------------|--------------------------------------------------|
    | 0           | `d`   | f16        | scale (delta)                                    |
    | 2           | `m`   | f16        | minimum of the block                             |
    | 4           | `qs`  | uint8[16]  | byte $j$: $q_j$ in bits 0-3, $q_{j+16}$ in 4-7   |

    $$w_j = d \cdot q_j + m, \qquad q_j \in [0, 15]$$

    Args:
        blocks: uint8 ``(..., 20)``.

    Returns:
        float32 ``(..., 32)``.

    Examples:
        >>> block = np.zeros(20, dtype=np.uint8)
        >>> block[0:4] = np.array([0.5, -1.0], dtype="<f2").view(np.uint8)   # d, m
        >>> block[4] = 0x3F        # q_0 = 15, q_16 = 3
        >>> w = dequantize_q4_1(block)
        >>> float(w[0]), float(w[1]), float(w[16])
        (6.5, -1.0, 0.5)
    """
    d = _f16(blocks[..., 0:2])  # (..., 1)
    m = _f16(blocks[..., 2:4])  # (..., 1)
    q = _nibbles(blocks[..., 4:20])  # (..., 32)
    return q.astype(np.float32) * d + m


# --8<-- [end:dequantize_q4_1]


# --8<-- [start:quantize_q4_1]
def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q4_1_ref``: float32 blocks of 32 -> ``block_q4_1`` bytes.

    The 16 levels span the block's range $[\min, \max]$; quants are rounded half up
    (truncation after adding 0.5) and clipped to 15:

    $$d = \frac{\max_j x_j - \min_j x_j}{15}, \qquad
      q_j = \min\bigl(15, \operatorname{trunc}((x_j - \min_j x_j) \cdot d^{-1} + 0.5)\bigr),
      \qquad m = \min_j x_j$$

    $d$ and $m$ are computed in float32, used so, and stored as float16: the error of a
    weight is at most $d/2 + 15\,|d - \operatorname{f16}(d)| + |m - \operatorname{f16}(m)|$
    (plus float32 rounding). The last term is why Q4_1 is poor for a block far from zero
    with a small range.

    Args:
        x: float ``(..., 32)``, converted to float32 first.

    Returns:
        uint8 ``(..., 20)``.

    Examples:
        >>> x = np.linspace(-1.0, 2.0, 32, dtype=np.float32)
        >>> block = quantize_q4_1(x)
        >>> block[0:4].view("<f2")         # d = 3/15, m = -1
        array([ 0.2, -1. ], dtype=float16)
        >>> bool(np.abs(dequantize_q4_1(block) - x).max() <= 0.1 + 1e-3)
        True
    """
    x = np.asarray(x, dtype=np.float32)
    min = np.min(x, axis=-1, keepdims=True)  # (..., 1)
    max = np.max(x, axis=-1, keepdims=True)  # (..., 1)
    d = (max - min) / np.float32(15)
    xi = np.trunc((x - min) * _inverse(d) + np.float32(0.5)).astype(np.int8)  # (..., 32)
    q = np.minimum(xi, 15).astype(np.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)  # (..., 16)
    return np.concatenate([_f16_bytes(d), _f16_bytes(min), qs], axis=-1)  # (..., 20)


# --8<-- [end:quantize_q4_1]


# --8<-- [start:dequantize_q5_0]
def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q5_0``: 5-bit quants with offset 16, one scale (5.5 bits/weight).

    ``block_q5_0`` (22 bytes):

    | byte offset | field | type       | meaning                                              |
    |------------:|-------|------------|------------------------------------------------------|
    | 0           | `d`   | f16        | scale (delta)                                        |
    | 2           | `qh`  | uint8[4]   | little-endian uint32: bit $j$ = bit 4 of $q_j$       |
    | 6           | `qs`  | uint8[16]  | byte $j$: bits 0-3 of $q_j$ (low), $q_{j+16}$ (high) |

    $$w_j = d \cdot (q_j - 16), \qquad q_j \in [0, 31]$$

    Args:
        blocks: uint8 ``(..., 22)``.

    Returns:
        float32 ``(..., 32)``.

    Examples:
        >>> block = np.zeros(22, dtype=np.uint8)
        >>> block[0:2] = np.array([1.0], dtype="<f2").view(np.uint8)
        >>> block[2] = 0b01        # bit 4 of q_0
        >>> block[6] = 0x0F        # bits 0-3 of q_0
        >>> dequantize_q5_0(block)[:2]     # q_0 = 31, q_1 = 0
        array([ 15., -16.], dtype=float32)
    """
    d = _f16(blocks[..., 0:2])  # (..., 1)
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # (..., 32)
    q = _nibbles(blocks[..., 6:22]) | (high << 4)  # (..., 32)
    return (q.astype(np.int8) - np.int8(16)).astype(np.float32) * d


# --8<-- [end:dequantize_q5_0]


# --8<-- [start:dequantize_q5_1]
def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q5_1``: 5-bit quants, a scale and a minimum (6 bits/weight).

    ``block_q5_1`` (24 bytes):

    | byte offset | field | type       | meaning                                              |
    |------------:|-------|------------|------------------------------------------------------|
    | 0           | `d`   | f16        | scale (delta)                                        |
    | 2           | `m`   | f16        | minimum of the block                                 |
    | 4           | `qh`  | uint8[4]   | little-endian uint32: bit $j$ = bit 4 of $q_j$       |
    | 8           | `qs`  | uint8[16]  | byte $j$: bits 0-3 of $q_j$ (low), $q_{j+16}$ (high) |

    $$w_j = d \cdot q_j + m, \qquad q_j \in [0, 31]$$

    Args:
        blocks: uint8 ``(..., 24)``.

    Returns:
        float32 ``(..., 32)``.

    Examples:
        >>> block = np.zeros(24, dtype=np.uint8)
        >>> block[0:4] = np.array([0.5, 1.0], dtype="<f2").view(np.uint8)   # d, m
        >>> block[7] = 0b1000_0000   # bit 31 of qh: bit 4 of q_31
        >>> block[23] = 0xF0         # bits 0-3 of q_31
        >>> dequantize_q5_1(block)[[0, 31]]   # q_0 = 0, q_31 = 31
        array([ 1. , 16.5], dtype=float32)
    """
    d = _f16(blocks[..., 0:2])  # (..., 1)
    m = _f16(blocks[..., 2:4])  # (..., 1)
    high = np.unpackbits(blocks[..., 4:8], axis=-1, bitorder="little")  # (..., 32)
    q = _nibbles(blocks[..., 8:24]) | (high << 4)  # (..., 32)
    return q.astype(np.float32) * d + m


# --8<-- [end:dequantize_q5_1]


def _qh_bytes(q: np.ndarray) -> np.ndarray:
    """5-bit quants ``(..., 32)`` -> their fifth bits as a little-endian uint32 ``(..., 4)``:
    bit ``j`` of ``qh`` is the high bit of weight ``j``."""
    bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)  # (..., 32)
    qh = np.bitwise_or.reduce(bits, axis=-1, keepdims=True)  # (..., 1)
    return qh.astype("<u4").view(np.uint8)  # (..., 4)


# --8<-- [start:quantize_q5_0]
def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q5_0_ref``: float32 blocks of 32 -> ``block_q5_0`` bytes.

    Q4_0 with one more bit: ``max`` is the weight of largest magnitude with its sign,
    $d = \mathrm{max} / -16$, quants truncated after adding 16.5 and clipped to 31:

    $$q_j = \min\bigl(31, \operatorname{trunc}(x_j \cdot d^{-1} + 16.5)\bigr)$$

    The low 4 bits are packed as Q4_0's nibbles, the fifth bits into the 32-bit ``qh``.

    Args:
        x: float ``(..., 32)``, converted to float32 first.

    Returns:
        uint8 ``(..., 22)``.

    Examples:
        >>> x = np.zeros(32, dtype=np.float32)
        >>> x[0], x[16] = -4.0, 2.0
        >>> dequantize_q5_0(quantize_q5_0(x))[[0, 1, 16]]
        array([-4.,  0.,  2.], dtype=float32)
    """
    x = np.asarray(x, dtype=np.float32)
    imax = np.argmax(np.abs(x), axis=-1, keepdims=True)  # (..., 1) the first of the largest
    max = np.take_along_axis(x, imax, axis=-1)  # (..., 1)
    max = np.where(max == 0, np.float32(0.0), max)  # C starts from max = 0.0f: +0, never -0
    d = max / np.float32(-16)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # as C, silently
        xi = np.trunc(x * _inverse(d) + np.float32(16.5)).astype(np.int8)  # (..., 32)
    q = np.minimum(xi, 31).astype(np.uint8)
    qs = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)  # (..., 16)
    return np.concatenate([_f16_bytes(d), _qh_bytes(q), qs], axis=-1)  # (..., 22)
# --8<-- [end:quantize_q5_0]


# --8<-- [start:quantize_q5_1]
def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q5_1_ref``: float32 blocks of 32 -> ``block_q5_1`` bytes.

    Q4_1 with one more bit: 32 levels over the block's range,

    $$d = \frac{\max_j x_j - \min_j x_j}{31}, \qquad
      q_j = \operatorname{trunc}((x_j - \min_j x_j) \cdot d^{-1} + 0.5), \qquad m = \min_j x_j$$

    (no clipping in ggml: the largest weight lands on 31, or 32 by float32 rounding, which
    then loses its fifth bit; we keep ggml's bytes).

    Args:
        x: float ``(..., 32)``, converted to float32 first.

    Returns:
        uint8 ``(..., 24)``.

    Examples:
        >>> x = np.linspace(-1.0, 2.1, 32, dtype=np.float32)
        >>> bool(np.abs(dequantize_q5_1(quantize_q5_1(x)) - x).max() <= 0.05 + 2e-3)
        True
    """
    x = np.asarray(x, dtype=np.float32)
    # C keeps the first weight that is strictly smaller (larger): of equal zeros, the first
    min = np.take_along_axis(x, np.argmin(x, axis=-1, keepdims=True), axis=-1)  # (..., 1)
    max = np.take_along_axis(x, np.argmax(x, axis=-1, keepdims=True), axis=-1)  # (..., 1)
    d = (max - min) / np.float32(31)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # as C, silently
        q = np.trunc((x - min) * _inverse(d) + np.float32(0.5)).astype(np.uint8)  # (..., 32)
    qs = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)  # (..., 16)
    return np.concatenate([_f16_bytes(d), _f16_bytes(min), _qh_bytes(q), qs], axis=-1)  # (..., 24)
# --8<-- [end:quantize_q5_1]


# ---------------------------------------------------------------------------------------------
# K-quants: super-blocks of QK_K = 256
# ---------------------------------------------------------------------------------------------


# --8<-- [start:get_scale_min_k4]
def get_scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""``get_scale_min_k4`` for all 8 sub-blocks: unpack the 12 bytes of 6-bit scales/mins.

    Q4_K and Q5_K give each of their 8 sub-blocks (32 weights) a 6-bit scale $sc_i$ and a
    6-bit min $m_i$: 96 bits in 12 bytes. Sub-blocks 0-3 use the low 6 bits of bytes 0-7;
    sub-blocks 4-7 put their low 4 bits in a nibble of bytes 8-11 and their top 2 bits in
    the spare top bits of bytes 0-7 (letters are bits of $sc$, digits bits of $m$):

    | byte $k$ | top bits                         | low bits                        |
    |---------:|----------------------------------|---------------------------------|
    | 0-3      | 7-6: bits 5-4 of $sc_{k+4}$      | 5-0: $sc_k$                     |
    | 4-7      | 7-6: bits 5-4 of $m_{k}$         | 5-0: $m_{k-4}$                  |
    | 8-11     | 7-4: bits 3-0 of $m_{k-4}$       | 3-0: bits 3-0 of $sc_{k-4}$     |

    Args:
        scales: uint8 ``(..., 12)``, the ``scales`` field of ``block_q4_K``/``block_q5_K``.

    Returns:
        ``(sc, m)``, each uint8 ``(..., 8)`` with values in ``[0, 63]``.

    Examples:
        >>> scales = np.zeros(12, dtype=np.uint8)
        >>> scales[0], scales[4] = 0b11_000001, 0b10_000010   # sc_0=1, m_0=2, top bits
        >>> scales[8] = 0x54                                  # m_4 low=5, sc_4 low=4
        >>> sc, m = get_scale_min_k4(scales)
        >>> int(sc[0]), int(m[0]), int(sc[4]), int(m[4])      # sc_4=0b11_0100, m_4=0b10_0101
        (1, 2, 52, 37)
    """
    lo, hi, packed = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]  # (..., 4) each
    sc = np.concatenate([lo & 63, (packed & 0x0F) | ((lo >> 6) << 4)], axis=-1)  # (..., 8)
    m = np.concatenate([hi & 63, (packed >> 4) | ((hi >> 6) << 4)], axis=-1)  # (..., 8)
    return sc, m


# --8<-- [end:get_scale_min_k4]


def _subblocks_of_64(qs: np.ndarray) -> np.ndarray:
    """K-quant 4-bit field ``(..., 128)`` -> ``(..., 8, 32)``: each 32 bytes hold 64 weights.

    Bytes ``32c .. 32c+31`` carry sub-block ``2c`` in their low nibbles and sub-block
    ``2c + 1`` in their high nibbles.
    """
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)  # (..., 4, 32)
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=-2)  # (..., 4, 2, 32)
    return q.reshape(*qs.shape[:-1], 8, 32)  # (..., 8, 32)


# --8<-- [start:dequantize_q4_k]
def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q4_K``: 8 sub-blocks of 32 with 6-bit scales and mins (4.5 bits/weight).

    ``block_q4_K`` (144 bytes, 256 weights):

    | byte offset | field    | type       | meaning                                          |
    |------------:|----------|------------|--------------------------------------------------|
    | 0           | `d`      | f16        | super-block scale of the sub-block scales        |
    | 2           | `dmin`   | f16        | super-block scale of the sub-block mins          |
    | 4           | `scales` | uint8[12]  | 6-bit $sc_i$ and $m_i$ of the 8 sub-blocks       |
    | 16          | `qs`     | uint8[128] | 4-bit quants $q$, 64 weights per 32 bytes        |

    ``scales`` is unpacked by [`get_scale_min_k4`][]. In ``qs``, bytes $32c \ldots 32c+31$
    hold sub-block $2c$ in their low nibbles and sub-block $2c+1$ in their high nibbles.

    For weight $j$ of sub-block $i$ (weight $32i + j$ of the super-block):

    $$w_{32i+j} = (d \cdot sc_i) \cdot q_{32i+j} - (d_{\min} \cdot m_i), \qquad q \in [0, 15]$$

    Args:
        blocks: uint8 ``(..., 144)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(144, dtype=np.uint8)
        >>> block[0:4] = np.array([0.5, 0.25], dtype="<f2").view(np.uint8)   # d, dmin
        >>> block[4], block[8] = 2, 4          # sc_0 = 2, m_0 = 4
        >>> block[16] = 0x03                   # q_0 = 3 (sub-block 0), q_32 = 0 (sub-block 1)
        >>> w = dequantize_q4_k(block)
        >>> float(w[0]), float(w[1]), float(w[32])   # 0.5*2*3 - 0.25*4, -1, 0
        (2.0, -1.0, 0.0)
    """
    d = _f16(blocks[..., 0:2])[..., None]  # (..., 1, 1)
    dmin = _f16(blocks[..., 2:4])[..., None]  # (..., 1, 1)
    sc, m = get_scale_min_k4(blocks[..., 4:16])  # (..., 8) each
    q = _subblocks_of_64(blocks[..., 16:144])  # (..., 8, 32)
    scale = d * sc[..., None].astype(np.float32)  # (..., 8, 1)
    offset = dmin * m[..., None].astype(np.float32)  # (..., 8, 1)
    w = scale * q.astype(np.float32) - offset  # (..., 8, 32)
    return w.reshape(*blocks.shape[:-1], QK_K)  # (..., 256)


# --8<-- [end:dequantize_q4_k]


# --8<-- [start:dequantize_q5_k]
def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q5_K``: Q4_K plus a fifth bit per weight (5.5 bits/weight).

    ``block_q5_K`` (176 bytes, 256 weights):

    | byte offset | field    | type       | meaning                                          |
    |------------:|----------|------------|--------------------------------------------------|
    | 0           | `d`      | f16        | super-block scale of the sub-block scales        |
    | 2           | `dmin`   | f16        | super-block scale of the sub-block mins          |
    | 4           | `scales` | uint8[12]  | 6-bit $sc_i$ and $m_i$ of the 8 sub-blocks       |
    | 16          | `qh`     | uint8[32]  | bit 4 of $q$: bit $i$ of byte $j$ for $q_{32i+j}$ |
    | 48          | `qs`     | uint8[128] | bits 0-3 of $q$, packed as in Q4_K               |

    $$w_{32i+j} = (d \cdot sc_i) \cdot q_{32i+j} - (d_{\min} \cdot m_i), \qquad q \in [0, 31]$$

    Args:
        blocks: uint8 ``(..., 176)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(176, dtype=np.uint8)
        >>> block[0:4] = np.array([1.0, 1.0], dtype="<f2").view(np.uint8)   # d, dmin
        >>> block[5], block[9] = 1, 3          # sc_1 = 1, m_1 = 3
        >>> block[16] = 0b10                   # bit 4 of weight 0 of sub-block 1
        >>> block[48] = 0x20                   # bits 0-3 of that weight: 2
        >>> float(dequantize_q5_k(block)[32])  # 1*1*(16+2) - 1*3
        15.0
    """
    d = _f16(blocks[..., 0:2])[..., None]  # (..., 1, 1)
    dmin = _f16(blocks[..., 2:4])[..., None]  # (..., 1, 1)
    sc, m = get_scale_min_k4(blocks[..., 4:16])  # (..., 8) each
    qh = blocks[..., None, 16:48]  # (..., 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (..., 8, 32)
    q = _subblocks_of_64(blocks[..., 48:176]) | (high << 4)  # (..., 8, 32)
    scale = d * sc[..., None].astype(np.float32)  # (..., 8, 1)
    offset = dmin * m[..., None].astype(np.float32)  # (..., 8, 1)
    w = scale * q.astype(np.float32) - offset  # (..., 8, 32)
    return w.reshape(*blocks.shape[:-1], QK_K)  # (..., 256)


# --8<-- [end:dequantize_q5_k]


# --8<-- [start:dequantize_q6_k]
def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q6_K``: 16 sub-blocks of 16 with 8-bit scales (6.5625 bits/weight).

    ``block_q6_K`` (210 bytes, 256 weights), in two halves $h \in \{0, 1\}$ of 128 weights:

    | byte offset | field    | type       | meaning                                          |
    |------------:|----------|------------|--------------------------------------------------|
    | 0           | `ql`     | uint8[128] | bits 0-3 of $q$, 64 bytes per half               |
    | 128         | `qh`     | uint8[64]  | bits 4-5 of $q$, 32 bytes per half               |
    | 192         | `scales` | int8[16]   | signed scale $sc_g$ of each group of 16 weights  |
    | 208         | `d`      | f16        | super-block scale                                |

    Within half $h$, weight $l$ ($0 \le l < 128$) takes bits 0-3 from ``ql`` byte
    $64h + (l \bmod 64)$ (low nibble for $l < 64$, high nibble above), and bits 4-5 from
    ``qh`` byte $32h + (l \bmod 32)$, bit pair $\lfloor l / 32 \rfloor$.

    $$w_{16g+j} = (d \cdot sc_g) \cdot (q_{16g+j} - 32), \qquad q \in [0, 63]$$

    Args:
        blocks: uint8 ``(..., 210)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(210, dtype=np.uint8)
        >>> block[208:210] = np.array([0.5], dtype="<f2").view(np.uint8)   # d
        >>> block[192:194] = np.array([2, -1], dtype=np.int8).view(np.uint8)
        >>> block[0], block[128] = 0x0F, 0b11    # weight 0: q = 0b11_1111 = 63
        >>> w = dequantize_q6_k(block)
        >>> float(w[0]), float(w[1]), float(w[16])   # 1*(63-32), 1*(0-32), -0.5*(0-32)
        (31.0, -32.0, 16.0)
    """
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 64)  # (..., 2, 64)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)  # (..., 2, 1, 32)
    sc = blocks[..., 192:208].view(np.int8)  # (..., 16)
    d = _f16(blocks[..., 208:210])[..., None]  # (..., 1, 1)
    low = _nibbles(ql)  # (..., 2, 128)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # (..., 2, 4, 32)
    q = low | (high.reshape(*lead, 2, 128) << 4)  # (..., 2, 128)
    q = (q.astype(np.int8) - np.int8(32)).reshape(*lead, 16, 16)  # (..., 16, 16)
    scale = d * sc[..., None].astype(np.float32)  # (..., 16, 1)
    w = scale * q.astype(np.float32)  # (..., 16, 16)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_q6_k]


def _two_bit_quants(qs: np.ndarray) -> np.ndarray:
    """2-bit field ``(..., 64)`` -> quants ``(..., 256)`` in weight order (Q2_K, Q3_K, TQ2_0).

    Each 32 bytes hold 128 weights: byte ``32h + l`` holds weight ``128h + 32s + l`` in its
    bits ``2s, 2s + 1`` (``s = 0..3``), so each shift reads 32 consecutive weights.
    """
    chunks = qs.reshape(*qs.shape[:-1], 2, 1, 32)  # (..., 2, 1, 32)
    q = (chunks >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # (..., 2, 4, 32)
    return q.reshape(*qs.shape[:-1], QK_K)  # (..., 256)


# --8<-- [start:dequantize_q2_k]
def dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q2_K``: 16 sub-blocks of 16 with 4-bit scales and mins (2.625 bits/weight).

    ``block_q2_K`` (84 bytes, 256 weights):

    | byte offset | field    | type       | meaning                                              |
    |------------:|----------|------------|------------------------------------------------------|
    | 0           | `scales` | uint8[16]  | byte $g$: $sc_g$ in bits 0-3, $m_g$ in bits 4-7      |
    | 16          | `qs`     | uint8[64]  | 2-bit quants $q$, 128 weights per 32 bytes           |
    | 80          | `d`      | f16        | super-block scale of the sub-block scales            |
    | 82          | `dmin`   | f16        | super-block scale of the sub-block mins              |

    In ``qs``, byte $32h + l$ holds weight $128h + 32s + l$ in its bits $2s$ and $2s + 1$
    ($s = 0 \ldots 3$): each shift of a 32-byte half reads 32 consecutive weights.

    For weight $j$ of sub-block $g$ (weight $16g + j$ of the super-block):

    $$w_{16g+j} = (d \cdot sc_g) \cdot q_{16g+j} - (d_{\min} \cdot m_g), \qquad q \in [0, 3]$$

    Args:
        blocks: uint8 ``(..., 84)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(84, dtype=np.uint8)
        >>> block[80:84] = np.array([0.5, 0.25], dtype="<f2").view(np.uint8)   # d, dmin
        >>> block[0], block[2] = 0x32, 0x01    # sc_0 = 2, m_0 = 3; sc_2 = 1, m_2 = 0
        >>> block[16] = 0b01_11                # q_0 = 3 (bits 0-1), q_32 = 1 (bits 2-3)
        >>> w = dequantize_q2_k(block)
        >>> float(w[0]), float(w[1]), float(w[32])   # 0.5*2*3 - 0.25*3, -0.75, 0.5*1*1 - 0
        (2.25, -0.75, 0.5)
    """
    lead = blocks.shape[:-1]
    scales = blocks[..., 0:16, None]  # (..., 16, 1)
    q = _two_bit_quants(blocks[..., 16:80]).reshape(*lead, 16, 16)  # (..., 16, 16)
    d = _f16(blocks[..., 80:82])[..., None]  # (..., 1, 1)
    dmin = _f16(blocks[..., 82:84])[..., None]  # (..., 1, 1)
    dl = d * (scales & 0x0F).astype(np.float32)  # (..., 16, 1)
    ml = dmin * (scales >> 4).astype(np.float32)  # (..., 16, 1)
    w = dl * q.astype(np.float32) - ml  # (..., 16, 16)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_q2_k]


# --8<-- [start:q3_k_scales]
def q3_k_scales(scales: np.ndarray) -> np.ndarray:
    r"""The 16 signed 6-bit sub-block scales of ``block_q3_K``, from its 12 bytes of ``scales``.

    ggml unpacks them with four masked 32-bit words (``kmask1``, ``kmask2`` in
    ``dequantize_row_q3_K``); per scale $g$ that is: bits 0-3 of the stored $sc_g$ are the low
    nibble of byte $g$ ($g < 8$) or the high nibble of byte $g - 8$; bits 4-5 are bits
    $2\lfloor g/4 \rfloor$ and $2\lfloor g/4 \rfloor + 1$ of byte $8 + (g \bmod 4)$. The scale
    used is $sc_g - 32$.

    | byte $k$ | bits 7-6         | bits 5-4         | bits 3-2         | bits 1-0         |
    |---------:|------------------|------------------|------------------|------------------|
    | 0-7      | $sc_{k+8}$ 3-2   | $sc_{k+8}$ 1-0   | $sc_k$ 3-2       | $sc_k$ 1-0       |
    | 8-11     | $sc_{k+4}$ 5-4   | $sc_{k}$ 5-4     | $sc_{k-4}$ 5-4   | $sc_{k-8}$ 5-4   |

    So byte $8 + c$ holds bits 5-4 of $sc_{c}$, $sc_{c+4}$, $sc_{c+8}$ and $sc_{c+12}$,
    from its low bits up.

    Args:
        scales: uint8 ``(..., 12)``, the ``scales`` field of ``block_q3_K``.

    Returns:
        int8 ``(..., 16)`` with values in ``[-32, 31]``.

    Examples:
        >>> scales = np.zeros(12, dtype=np.uint8)
        >>> scales[0], scales[8] = 0x51, 0b10   # sc_0 low 1, sc_8 low 5; sc_0 bits 5-4 = 2
        >>> q3_k_scales(scales)[[0, 1, 8]]      # 33 - 32, 0 - 32, 5 - 32
        array([  1, -32, -27], dtype=int8)
    """
    low = _nibbles(scales[..., 0:8])  # (..., 16)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    high = (scales[..., None, 8:12] >> shifts) & 3  # (..., 4, 4): [g // 4, g % 4]
    sc = low | (high.reshape(*scales.shape[:-1], 16) << 4)  # (..., 16) in [0, 63]
    return sc.astype(np.int8) - np.int8(32)


# --8<-- [end:q3_k_scales]


# --8<-- [start:dequantize_q3_k]
def dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q3_K``: 3-bit quants, 16 sub-blocks with 6-bit scales (3.4375 bits/weight).

    ``block_q3_K`` (110 bytes, 256 weights):

    | byte offset | field    | type       | meaning                                              |
    |------------:|----------|------------|------------------------------------------------------|
    | 0           | `hmask`  | uint8[32]  | bit 2 of $q$: bit $i$ of byte $l$ for $q_{32i+l}$     |
    | 32          | `qs`     | uint8[64]  | bits 0-1 of $q$, packed as Q2_K's `qs`               |
    | 96          | `scales` | uint8[12]  | 6-bit $sc_g$ of the 16 sub-blocks ([`q3_k_scales`][]) |
    | 108         | `d`      | f16        | super-block scale                                    |

    $$w_{16g+j} = \bigl(d \cdot (sc_g - 32)\bigr) \cdot (q_{16g+j} - 4), \qquad q \in [0, 7]$$

    (ggml writes $q - 4$ as "the 2 low bits, minus 4 when the `hmask` bit is *clear*".)

    Args:
        blocks: uint8 ``(..., 110)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(110, dtype=np.uint8)
        >>> block[108:110] = np.array([0.5], dtype="<f2").view(np.uint8)   # d
        >>> block[96], block[104] = 0x01, 0b10   # sc_0 = 0b10_0001 = 33; the others 0
        >>> block[0], block[32] = 0b1, 0b11      # q_0 = 4 + 3
        >>> w = dequantize_q3_k(block)
        >>> float(w[0]), float(w[1]), float(w[16])   # 0.5*1*(7-4), 0.5*1*(0-4), 0.5*-32*(0-4)
        (1.5, -2.0, 64.0)
    """
    lead = blocks.shape[:-1]
    hmask = blocks[..., None, 0:32]  # (..., 1, 32)
    high = (hmask >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (..., 8, 32)
    q = _two_bit_quants(blocks[..., 32:96]) | (high.reshape(*lead, QK_K) << 2)  # (..., 256)
    sc = q3_k_scales(blocks[..., 96:108])  # (..., 16)
    d = _f16(blocks[..., 108:110])[..., None]  # (..., 1, 1)
    dl = d * sc[..., None].astype(np.float32)  # (..., 16, 1)
    q = (q.astype(np.int8) - np.int8(4)).reshape(*lead, 16, 16)  # (..., 16, 16)
    w = dl * q.astype(np.float32)  # (..., 16, 16)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_q3_k]


# --8<-- [start:dequantize_q8_k]
def dequantize_q8_k(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q8_K``: 8-bit quants with a float32 scale per 256 (9.125 bits/weight).

    ggml quantizes *activations* to Q8_K inside the K-quant dot products; it is rarely a
    weight type. ``gguf.quants`` does not read it (ggml's C is the only oracle).

    ``block_q8_K`` (292 bytes, 256 weights):

    | byte offset | field   | type       | meaning                                           |
    |------------:|---------|------------|---------------------------------------------------|
    | 0           | `d`     | f32        | scale                                             |
    | 4           | `qs`    | int8[256]  | quant $q_j$ of weight $j$                         |
    | 260         | `bsums` | int16[16]  | sums of the quants of each group of 16 (unread)   |

    $$w_j = d \cdot q_j, \qquad q_j \in [-128, 127]$$

    Args:
        blocks: uint8 ``(..., 292)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(292, dtype=np.uint8)
        >>> block[0:4] = np.array([0.25], dtype="<f4").view(np.uint8)   # d
        >>> block[4:6] = np.array([-128, 127], dtype=np.int8).view(np.uint8)
        >>> dequantize_q8_k(block)[:3]
        array([-32.  ,  31.75,   0.  ], dtype=float32)
    """
    d = np.ascontiguousarray(blocks[..., 0:4]).view("<f4").astype(np.float32)  # (..., 1)
    q = blocks[..., 4:260].view(np.int8)  # (..., 256)
    return d * q.astype(np.float32)


# --8<-- [end:dequantize_q8_k]


# ---------------------------------------------------------------------------------------------
# Ternary quants: TQ1_0 and TQ2_0
# ---------------------------------------------------------------------------------------------


# --8<-- [start:trits]
def trits(packed: np.ndarray, n: int) -> np.ndarray:
    r"""The ``n`` base-3 digits (trits) packed in each byte of TQ1_0, most significant first.

    ``quantize_row_tq1_0_ref`` writes 5 (or 4) trits $t_0 \ldots t_{n-1} \in \{0, 1, 2\}$ as
    a fixed-point fraction of 256: $b = \lceil 256 \cdot v / 243 \rceil$ with
    $v = \sum_k t_k 3^{4-k}$ (the 4-trit bytes are padded with $t_4 = 0$). Multiplying by
    $3^k$ modulo 256 shifts trit $k$ to the front, and times 3 over 256 reads it:

    $$t_k = \left\lfloor \frac{3 \cdot (b \cdot 3^k \bmod 256)}{256} \right\rfloor$$

    (uint8 arithmetic wraps, as in ggml's ``uint8_t q = x * pow3[n]``.)

    Args:
        packed: uint8 ``(..., m)``.
        n: trits per byte, 5 or 4.

    Returns:
        uint8 ``(..., n, m)``: ``[..., k, i]`` is trit ``k`` of byte ``i``.

    Examples:
        >>> trits(np.array([171, 128], dtype=np.uint8), 5)[:, 0]   # 162 = 2*81; 121 = 11111_3
        array([2, 0, 0, 0, 0], dtype=uint8)
        >>> trits(np.array([128], dtype=np.uint8), 5)[:, 0]
        array([1, 1, 1, 1, 1], dtype=uint8)
    """
    pow3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)[:n, None]  # (n, 1)
    shifted = packed[..., None, :] * pow3  # (..., n, m), modulo 256
    return ((shifted.astype(np.uint16) * 3) >> 8).astype(np.uint8)


# --8<-- [end:trits]


# --8<-- [start:dequantize_tq1_0]
def dequantize_tq1_0(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_tq1_0``: ternary weights, 5 per byte (1.6875 bits/weight).

    ``block_tq1_0`` (54 bytes, 256 weights):

    | byte offset | field | type       | meaning                                               |
    |------------:|-------|------------|-------------------------------------------------------|
    | 0           | `qs`  | uint8[48]  | 5 trits per byte ([`trits`][]), weights 0-239         |
    | 48          | `qh`  | uint8[4]   | 4 trits per byte, weights 240-255                     |
    | 52          | `d`   | f16        | scale                                                 |

    Trit $k$ of byte $i$ is weight $32k + i$ for ``qs`` bytes $i < 32$, weight
    $160 + 16k + (i - 32)$ for ``qs`` bytes $32 \le i < 48$, and weight $240 + 4k + i$ for
    ``qh`` byte $i$.

    $$w_j = d \cdot (t_j - 1), \qquad t_j \in \{0, 1, 2\}$$

    Args:
        blocks: uint8 ``(..., 54)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(54, dtype=np.uint8)
        >>> block[52:54] = np.array([0.5], dtype="<f2").view(np.uint8)   # d
        >>> block[0], block[1] = 171, 128   # trits 2,0,0,0,0 and 1,1,1,1,1
        >>> w = dequantize_tq1_0(block)
        >>> float(w[0]), float(w[32]), float(w[1]), float(w[33])
        (0.5, -0.5, 0.0, 0.0)
    """
    lead = blocks.shape[:-1]
    t = np.concatenate(
        [
            trits(blocks[..., 0:32], 5).reshape(*lead, 160),  # weights 0..159
            trits(blocks[..., 32:48], 5).reshape(*lead, 80),  # weights 160..239
            trits(blocks[..., 48:52], 4).reshape(*lead, 16),  # weights 240..255
        ],
        axis=-1,
    )  # (..., 256)
    d = _f16(blocks[..., 52:54])  # (..., 1)
    return (t.astype(np.int8) - np.int8(1)).astype(np.float32) * d


# --8<-- [end:dequantize_tq1_0]


# --8<-- [start:dequantize_tq2_0]
def dequantize_tq2_0(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_tq2_0``: ternary weights in 2 bits each (2.0625 bits/weight).

    ``block_tq2_0`` (66 bytes, 256 weights):

    | byte offset | field | type       | meaning                                              |
    |------------:|-------|------------|------------------------------------------------------|
    | 0           | `qs`  | uint8[64]  | 2-bit $q$, packed as Q2_K's `qs`                     |
    | 64          | `d`   | f16        | scale                                                |

    $$w_j = d \cdot (q_j - 1), \qquad q_j \in [0, 3]$$

    The quantizer only writes $q \in \{0, 1, 2\}$; $q = 3$ reads $2d$.

    Args:
        blocks: uint8 ``(..., 66)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(66, dtype=np.uint8)
        >>> block[64:66] = np.array([0.5], dtype="<f2").view(np.uint8)   # d
        >>> block[0] = 0b10_01_00_11           # q_0 = 3, q_32 = 0, q_64 = 1, q_96 = 2
        >>> dequantize_tq2_0(block)[[0, 32, 64, 96]]
        array([ 1. , -0.5,  0. ,  0.5], dtype=float32)
    """
    q = _two_bit_quants(blocks[..., 0:64])  # (..., 256)
    d = _f16(blocks[..., 64:66])  # (..., 1)
    return (q.astype(np.int8) - np.int8(1)).astype(np.float32) * d


# --8<-- [end:dequantize_tq2_0]


# ---------------------------------------------------------------------------------------------
# Non-linear 4-bit quants: IQ4_NL and IQ4_XS
# ---------------------------------------------------------------------------------------------

# --8<-- [start:KVALUES_IQ4NL]
# ``kvalues_iq4nl`` (ggml-common.h): 16 levels, denser near 0, where most weights are.
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
# --8<-- [end:KVALUES_IQ4NL]


# --8<-- [start:dequantize_iq4_nl]
def dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_iq4_nl``: a 4-bit index into `KVALUES_IQ4NL` per weight (4.5 bits/weight).

    ``block_iq4_nl`` (18 bytes, 32 weights), laid out as Q4_0:

    | byte offset | field | type       | meaning                                          |
    |------------:|-------|------------|--------------------------------------------------|
    | 0           | `d`   | f16        | scale                                            |
    | 2           | `qs`  | uint8[16]  | byte $j$: $q_j$ in bits 0-3, $q_{j+16}$ in 4-7   |

    $$w_j = d \cdot K[q_j], \qquad K = \texttt{kvalues\_iq4nl}$$

    Args:
        blocks: uint8 ``(..., 18)``.

    Returns:
        float32 ``(..., 32)``.

    Examples:
        >>> block = np.zeros(18, dtype=np.uint8)
        >>> block[0:2] = np.array([0.5], dtype="<f2").view(np.uint8)   # d
        >>> block[2] = 0xF8                    # q_0 = 8, q_16 = 15
        >>> dequantize_iq4_nl(block)[[0, 1, 16]]   # 0.5*1, 0.5*-127, 0.5*113
        array([  0.5, -63.5,  56.5], dtype=float32)
    """
    d = _f16(blocks[..., 0:2])  # (..., 1)
    q = _nibbles(blocks[..., 2:18])  # (..., 32)
    return d * KVALUES_IQ4NL[q].astype(np.float32)


# --8<-- [end:dequantize_iq4_nl]


# --8<-- [start:dequantize_iq4_xs]
def dequantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_iq4_xs``: IQ4_NL's levels, 6-bit scales per 32 (4.25 bits/weight).

    ``block_iq4_xs`` (136 bytes, 256 weights):

    | byte offset | field      | type       | meaning                                             |
    |------------:|------------|------------|-----------------------------------------------------|
    | 0           | `d`        | f16        | super-block scale                                   |
    | 2           | `scales_h` | uint16     | bits $2i, 2i{+}1$: bits 4-5 of $ls_i$               |
    | 4           | `scales_l` | uint8[4]   | bits 0-3 of $ls_i$: nibble $i \bmod 2$ of byte $i/2$ |
    | 8           | `qs`       | uint8[128] | 16 bytes per sub-block, packed as IQ4_NL's `qs`     |

    Sub-block $i$ (32 weights) has the 6-bit scale $ls_i$; ``scales_l`` holds $ls_0$ in the
    *low* nibble of byte 0 and $ls_1$ in its high nibble (not the all-low-then-all-high order
    of the quants).

    $$w_{32i+j} = \bigl(d \cdot (ls_i - 32)\bigr) \cdot K[q_{32i+j}],
      \qquad K = \texttt{kvalues\_iq4nl}$$

    Args:
        blocks: uint8 ``(..., 136)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(136, dtype=np.uint8)
        >>> block[0:2] = np.array([1.0], dtype="<f2").view(np.uint8)   # d
        >>> block[2], block[4] = 0b10_00, 0x10  # ls_1 = 0b10_0001 = 33; ls_0 = 0
        >>> block[24] = 0x08                    # sub-block 1: q_32 = 8, q_48 = 0
        >>> w = dequantize_iq4_xs(block)
        >>> float(w[0]), float(w[32]), float(w[48])   # -32*-127, 1*1, 1*-127
        (4064.0, 1.0, -127.0)
    """
    lead = blocks.shape[:-1]
    d = _f16(blocks[..., 0:2])[..., None]  # (..., 1, 1)
    scales_h = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")  # (..., 1)
    scales_l = blocks[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)  # (..., 4, 2)
    low = scales_l.reshape(*lead, 8) & 0x0F  # (..., 8)
    high = (scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # (..., 8)
    ls = low.astype(np.int8) | (high.astype(np.int8) << 4)  # (..., 8) in [0, 63]
    dl = d * (ls - np.int8(32))[..., None].astype(np.float32)  # (..., 8, 1)
    q = _nibbles(blocks[..., 8:136].reshape(*lead, 8, 16))  # (..., 8, 32)
    w = dl * KVALUES_IQ4NL[q].astype(np.float32)  # (..., 8, 32)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_iq4_xs]


# ---------------------------------------------------------------------------------------------
# FP4 with microscaling: MXFP4 and NVFP4
# ---------------------------------------------------------------------------------------------

# --8<-- [start:KVALUES_MXFP4]
# ``kvalues_mxfp4`` (ggml-common.h): the 16 FP4 (E2M1) values, *doubled* so they are integers.
# Code 8 is E2M1's -0, read as 0. The scales below are halved to make up for the doubling.
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
# --8<-- [end:KVALUES_MXFP4]


# --8<-- [start:e8m0_to_fp32_half]
def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    r"""``ggml_e8m0_to_fp32_half``: an E8M0 byte (a bare exponent, bias 127), halved.

    $$\operatorname{e8m0}(e) / 2 = 2^{e - 127} / 2 = 2^{e - 128}, \qquad e \in [0, 255]$$

    exactly, as a float32 ($e = 0, 1$ give the subnormals $2^{-128}, 2^{-127}$; ggml builds
    the bits). The OCP MX format reserves $e = 255$ for NaN; ggml does not, and reads
    $2^{127}$.

    Args:
        e: uint8 ``(...)``.

    Returns:
        float32 ``(...)``.

    Examples:
        >>> e8m0_to_fp32_half(np.array([127, 130, 0], dtype=np.uint8))
        array([5.000000e-01, 4.000000e+00, 2.938736e-39], dtype=float32)
    """
    return np.ldexp(np.float32(1), e.astype(np.int32) - 128)


# --8<-- [end:e8m0_to_fp32_half]


# --8<-- [start:ue4m3_to_fp32]
def ue4m3_to_fp32(x: np.ndarray) -> np.ndarray:
    r"""``ggml_ue4m3_to_fp32``: an unsigned E4M3 byte, *halved* (like E8M0 for MXFP4).

    | bits | field    | meaning                                       |
    |------|----------|-----------------------------------------------|
    | 7    | (unused) | ignored: the scale is unsigned                |
    | 6-3  | exponent | bias 7; 0 is subnormal                        |
    | 2-0  | mantissa | 3 bits                                        |

    $$\operatorname{ue4m3}(x) / 2 = \begin{cases}
      0 & x = \texttt{0x00} \text{ or } x = \texttt{0x7F} \text{ (E4M3's NaN)} \\
      m \cdot 2^{-9} / 2 & e = 0 \\
      (1 + m/8) \cdot 2^{e - 7} / 2 & \text{otherwise}
    \end{cases}$$

    Only the byte ``0x7F`` reads 0: ``0xFF`` (the same code with bit 7 set) reads
    $1.875 \cdot 2^8 / 2 = 240$, as in ggml. Every value is exact in float32.

    Args:
        x: uint8 ``(...)``.

    Returns:
        float32 ``(...)``.

    Examples:
        >>> ue4m3_to_fp32(np.array([0x38, 0x7E, 0x7F, 0xFF, 0x01], dtype=np.uint8))
        array([5.000000e-01, 2.240000e+02, 0.000000e+00, 2.400000e+02,
               9.765625e-04], dtype=float32)
    """
    exp = ((x >> 3) & 0x0F).astype(np.int32)
    man = (x & 0x07).astype(np.float32)
    raw = np.where(
        exp == 0,
        np.ldexp(man, -9),  # subnormal
        np.ldexp(np.float32(1) + man / np.float32(8), exp - 7),
    )
    return np.where((x == 0) | (x == 0x7F), np.float32(0), raw * np.float32(0.5))


# --8<-- [end:ue4m3_to_fp32]


# --8<-- [start:dequantize_mxfp4]
def dequantize_mxfp4(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_mxfp4``: 32 FP4 (E2M1) values sharing a power of two (4.25 bits/weight).

    ``block_mxfp4`` (17 bytes, 32 weights), the OCP Microscaling MXFP4 block:

    | byte offset | field | type       | meaning                                          |
    |------------:|-------|------------|--------------------------------------------------|
    | 0           | `e`   | E8M0       | shared exponent: scale $2^{e - 127}$             |
    | 1           | `qs`  | uint8[16]  | byte $j$: $q_j$ in bits 0-3, $q_{j+16}$ in 4-7   |

    $$w_j = \frac{2^{e - 127}}{2} \cdot K[q_j]
         = 2^{e - 127} \cdot \operatorname{E2M1}(q_j), \qquad K = \texttt{kvalues\_mxfp4}$$

    Args:
        blocks: uint8 ``(..., 17)``.

    Returns:
        float32 ``(..., 32)``.

    Examples:
        >>> block = np.zeros(17, dtype=np.uint8)
        >>> block[0] = 127                     # scale 2^0
        >>> block[1] = 0xF7                    # q_0 = 7 (E2M1 6.0), q_16 = 15 (-6.0)
        >>> dequantize_mxfp4(block)[[0, 1, 16]]
        array([ 6.,  0., -6.], dtype=float32)
    """
    d = e8m0_to_fp32_half(blocks[..., 0:1])  # (..., 1)
    q = _nibbles(blocks[..., 1:17])  # (..., 32)
    with np.errstate(over="ignore"):  # e = 254 and |K| = 12 overflow to inf, as in ggml
        return KVALUES_MXFP4[q].astype(np.float32) * d


# --8<-- [end:dequantize_mxfp4]


# --8<-- [start:dequantize_nvfp4]
def dequantize_nvfp4(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_nvfp4``: FP4 (E2M1) values, a UE4M3 scale per 16 (4.5 bits/weight).

    ``block_nvfp4`` (36 bytes, 64 weights = 4 sub-blocks $s$ of 16):

    | byte offset | field | type       | meaning                                                |
    |------------:|-------|------------|--------------------------------------------------------|
    | 0           | `d`   | UE4M3[4]   | scale of sub-block $s$ ([`ue4m3_to_fp32`][])           |
    | 4           | `qs`  | uint8[32]  | byte $8s{+}j$: $q_{16s+j}$ in bits 0-3, $q_{16s+j+8}$ 4-7 |

    $$w_{16s+j} = \frac{\operatorname{ue4m3}(d_s)}{2} \cdot K[q_{16s+j}],
      \qquad K = \texttt{kvalues\_mxfp4}$$

    NVIDIA's format also has a float32 scale per tensor; ggml's block has none.

    Args:
        blocks: uint8 ``(..., 36)``.

    Returns:
        float32 ``(..., 64)``.

    Examples:
        >>> block = np.zeros(36, dtype=np.uint8)
        >>> block[0], block[1] = 0x38, 0x40    # d_0 = 1.0, d_1 = 2.0
        >>> block[4], block[12] = 0x71, 0x0D   # q_0 = 1, q_8 = 7; q_16 = 13
        >>> dequantize_nvfp4(block)[[0, 8, 16]]   # 0.5*1, 0.5*12, 1.0*-6
        array([ 0.5,  6. , -6. ], dtype=float32)
    """
    lead = blocks.shape[:-1]
    d = ue4m3_to_fp32(blocks[..., 0:4])[..., None]  # (..., 4, 1)
    q = _nibbles(blocks[..., 4:36].reshape(*lead, 4, 8))  # (..., 4, 16)
    w = KVALUES_MXFP4[q].astype(np.float32) * d  # (..., 4, 16)
    return w.reshape(*lead, QK_NVFP4)  # (..., 64)


# --8<-- [end:dequantize_nvfp4]


# ---------------------------------------------------------------------------------------------
# Dispatch by type
# ---------------------------------------------------------------------------------------------

# --8<-- [start:dispatch]
DEQUANTIZE: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.F32: dequantize_f32,
    T.F16: dequantize_f16,
    T.BF16: dequantize_bf16,
    T.Q4_0: dequantize_q4_0,
    T.Q4_1: dequantize_q4_1,
    T.Q5_0: dequantize_q5_0,
    T.Q5_1: dequantize_q5_1,
    T.Q8_0: dequantize_q8_0,
    T.Q2_K: dequantize_q2_k,
    T.Q3_K: dequantize_q3_k,
    T.Q4_K: dequantize_q4_k,
    T.Q5_K: dequantize_q5_k,
    T.Q6_K: dequantize_q6_k,
    T.Q8_K: dequantize_q8_k,
    T.TQ1_0: dequantize_tq1_0,
    T.TQ2_0: dequantize_tq2_0,
    T.IQ4_NL: dequantize_iq4_nl,
    T.IQ4_XS: dequantize_iq4_xs,
    T.MXFP4: dequantize_mxfp4,
    T.NVFP4: dequantize_nvfp4,
    # ---- grid I-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) ----
    # from reference/quants_iq.py (their block sizes come from gguf's table through _layout,
    # so BLOCK_LAYOUTS need not list them)
    **{t: fn for t, (fn, _) in IQ_DEQUANTIZERS.items()},
}

QUANTIZE: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.F32: quantize_f32,
    T.F16: quantize_f16,
    T.BF16: quantize_bf16,
    T.Q4_0: quantize_q4_0,
    T.Q4_1: quantize_q4_1,
    T.Q8_0: quantize_q8_0,
    T.Q5_0: quantize_q5_0,
    T.Q5_1: quantize_q5_1,
    **K_QUANTIZERS,  # Q2_K, Q3_K, Q4_K, Q5_K, Q6_K from reference/quants_k.py
}
# --8<-- [end:dispatch]


def _names(table: dict[GGMLQuantizationType, object]) -> str:
    return ", ".join(t.name for t in table)


def _check_qtype(qtype: object) -> GGMLQuantizationType:
    if not isinstance(qtype, GGMLQuantizationType):
        raise QuantError(f"qtype must be a gguf.GGMLQuantizationType, got {qtype!r}")
    return qtype


# --8<-- [start:dequantize]
def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Raw GGUF bytes -> float32 weights, row by row (``type_traits[qtype].to_float``).

    The same contract as ``gguf.quants.dequantize``, except that F32, F16 and BF16 are raw
    bytes here too.

    Args:
        data: uint8 ``(..., n_bytes)``; ``n_bytes`` a multiple of the type's block bytes.
        qtype: one of the keys of `DEQUANTIZE`.

    Returns:
        float32 ``(..., n_weights)`` with ``n_weights = n_bytes // type_size * block_size``.

    Raises:
        QuantError: if the type is not supported, ``data`` is not uint8, or a row is not a
            whole number of blocks.

    Examples:
        >>> x = np.arange(64, dtype=np.float32).reshape(2, 32)
        >>> data = quantize(x, GGMLQuantizationType.Q8_0)
        >>> data.shape
        (2, 34)
        >>> dequantize(data, GGMLQuantizationType.Q8_0)[1, :3]   # d = 63/127 stored as f16
        array([32.246094, 33.23828 , 34.23047 ], dtype=float32)
    """
    qtype = _check_qtype(qtype)
    if qtype not in DEQUANTIZE:
        raise QuantError(
            f"dequantizing {qtype.name} is not implemented; supported: {_names(DEQUANTIZE)}"
        )
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim == 0:
        raise QuantError(
            f"{qtype.name} data must be raw bytes: a uint8 array with at least one dimension, "
            f"got {data.dtype} of shape {data.shape}"
        )
    layout = _layout(qtype)
    n_bytes = data.shape[-1]
    if n_bytes % layout.type_size != 0:
        raise QuantError(
            f"{qtype.name} rows of {n_bytes} bytes are not a whole number of blocks "
            f"({layout.type_size} bytes each)"
        )
    n_blocks = n_bytes // layout.type_size
    lead = data.shape[:-1]
    blocks = np.ascontiguousarray(data).reshape(*lead, n_blocks, layout.type_size)
    w = DEQUANTIZE[qtype](blocks)  # (..., n_blocks, block_size)
    return w.reshape(*lead, n_blocks * layout.block_size)  # (..., n_weights)


# --8<-- [end:dequantize]


# --8<-- [start:quantize]
def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float weights -> raw GGUF bytes, row by row, with ggml's reference quantizers.

    Byte-identical to ``gguf.quants.quantize`` (and ggml's ``quantize_row_*_ref``) for the
    supported types; F32/F16/BF16 come back as raw bytes.

    Args:
        x: float ``(..., n)``, converted to float32 first; ``n`` a multiple of the block size.
        qtype: one of the keys of `QUANTIZE`.

    Returns:
        uint8 ``(..., n // block_size * type_size)``.

    Raises:
        QuantError: if quantizing to the type is not implemented, ``x`` is not a float
            array, or a row is not a whole number of blocks.

    Examples:
        >>> x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
        >>> quantize(x, GGMLQuantizationType.Q4_1).shape
        (2, 20)
        >>> quantize(x, GGMLQuantizationType.IQ2_XXS)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.common.QuantError: quantizing to IQ2_XXS is not implemented; supported: F32, ...
    """
    qtype = _check_qtype(qtype)
    if qtype not in QUANTIZE:
        raise QuantError(
            f"quantizing to {qtype.name} is not implemented; supported: {_names(QUANTIZE)}"
        )
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating) or x.ndim == 0:
        raise QuantError(
            f"quantize needs a float array with at least one dimension, "
            f"got {x.dtype} of shape {x.shape}"
        )
    layout = BLOCK_LAYOUTS[qtype]
    n = x.shape[-1]
    if n % layout.block_size != 0:
        raise QuantError(
            f"rows of {n} weights are not a whole number of {qtype.name} blocks "
            f"({layout.block_size} weights each)"
        )
    n_blocks = n // layout.block_size
    lead = x.shape[:-1]
    blocks = x.astype(np.float32).reshape(*lead, n_blocks, layout.block_size)
    data = QUANTIZE[qtype](blocks)  # (..., n_blocks, type_size)
    return data.reshape(*lead, n_blocks * layout.type_size)  # (..., n_bytes)


# --8<-- [end:quantize]


# --8<-- [start:QuantizedTensor]
@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A weight tensor as GGUF stores it: a type, a logical shape and the raw blocks.

    ``eq=False``: the dataclass-generated ``==`` and ``hash`` would compare NumPy arrays;
    compare ``.data`` explicitly instead.

    Attributes:
        qtype: the block format.
        shape: logical shape in NumPy order (ggml's ``ne`` reversed); ``shape[-1]`` is the row
            length in weights, a multiple of the block size.
        data: uint8 ``(*shape[:-1], bytes_per_row)``.

    Raises:
        QuantError: on construction, if the type is unsupported, the row length is not a
            whole number of blocks, or ``data`` is not uint8 of the matching shape.

    Examples:
        >>> x = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)
        >>> t = QuantizedTensor.from_float(x, GGMLQuantizationType.Q8_0)
        >>> t.data.shape                   # 2 rows of 2 blocks of 34 bytes
        (2, 68)
        >>> bool(np.abs(t.dequantize() - x).max() < 0.01)
        True
        >>> bad = np.zeros((2, 27), np.uint8)
        >>> QuantizedTensor(GGMLQuantizationType.Q4_0, (2, 48), bad)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.common.QuantError: a row of 48 weights is not a whole number of Q4_0 blocks ...
    """

    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self) -> None:
        qtype = _check_qtype(self.qtype)  # any ggml type: dequantize() checks support
        try:
            shape = tuple(operator.index(n) for n in self.shape)  # ints, NumPy ints too
        except TypeError:
            shape = ()
        if len(shape) == 0 or min(shape) < 0:
            raise QuantError(f"shape must be a non-empty tuple of sizes >= 0, got {self.shape!r}")
        expected = (*shape[:-1], row_size(qtype, shape[-1]))
        if not isinstance(self.data, np.ndarray) or self.data.dtype != np.uint8:
            raise QuantError(f"data must be a uint8 array, got {type(self.data).__name__}")
        if self.data.shape != expected:
            raise QuantError(
                f"{qtype.name} data of logical shape {shape} must have shape {expected}, "
                f"got {self.data.shape}"
            )
        object.__setattr__(self, "shape", shape)

    @classmethod
    def from_float(cls, x: np.ndarray, qtype: GGMLQuantizationType) -> QuantizedTensor:
        """Quantize ``x`` ``(..., n)`` with [`quantize`][] and keep its shape."""
        return cls(qtype, tuple(int(n) for n in np.shape(x)), quantize(x, qtype))

    def dequantize(self) -> np.ndarray:
        """The float32 weights, of shape ``self.shape``."""
        return dequantize(self.data, self.qtype)


# --8<-- [end:QuantizedTensor]
