r"""Twin of [`reference.quants`][reference.quants]: GGUF weights on MLX, quantized where that costs
nothing.

MLX stores a quantized matrix with *affine group quantization*: each row is cut into groups
of ``group_size`` consecutive weights, every group has a float ``scale`` $s$ and ``bias``
$b$, and weight $j$ of a group is an unsigned ``bits``-bit integer $q_j$:

$$w_j = s \cdot q_j + b, \qquad q_j \in [0, 2^{\text{bits}} - 1]$$

The GGUF types below are this map, exactly ([`FORMS`][]); [`to_mlx`][] only *moves bits*
(unpacks ggml's fields and repacks them in MLX's order: a little-endian bit stream of
``uint32`` words, the first weight in the lowest bits) and computes the float32 scales and
biases:

| GGUF | ggml's dequantization | $q^{\text{MLX}}$ | bits, group | $s$ | $b$ |
| --- | --- | --- | --- | --- | --- |
| Q4_0 | $d (q - 8)$, $q \in [0, 15]$ | $q$ | 4, 32 | $d$ | $-8d$ |
| Q4_1 | $d q + m$, $q \in [0, 15]$ | $q$ | 4, 32 | $d$ | $m$ |
| Q5_0 | $d (q - 16)$, $q \in [0, 31]$ | $q$ | 5, 32 | $d$ | $-16d$ |
| Q5_1 | $d q + m$, $q \in [0, 31]$ | $q$ | 5, 32 | $d$ | $m$ |
| Q8_0 | $d q$, $q \in [-128, 127]$ | $q + 128$ | 8, 32 | $d$ | $-128d$ |
| Q4_K | $(d\,sc) q - d_{\min} m$, $q \in [0, 15]$ | $q$ | 4, 32 | $d\,sc$ | $-(d_{\min} m)$ |
| Q5_K | $(d\,sc) q - d_{\min} m$, $q \in [0, 31]$ | $q$ | 5, 32 | $d\,sc$ | $-(d_{\min} m)$ |
| Q3_K | $(d (sc - 32)) q_3$, $q_3 \in [-4, 3]$ | $(sc - 32) q_3 + 124$ | 8, 128 | $d$ | $-124d$ |
| MXFP4 | $\mathrm{e2m1}(q) \cdot 2^{e - 127}$ | $q$ | 4, 32 | $e$ | (mxfp4 mode) |
| IQ4_NL | $d\,K[q]$, $K$ = ``kvalues_iq4nl`` | $K[q] + 128$ | 8, 32 | $d$ | $-128d$ |
| IQ4_XS | $(d (ls - 32)) K[q]$ | $K[q] + 128$ | 8, 32 | $d (ls - 32)$ | $-128 \cdot s$ |
| TQ2_0 | $d (q - 1)$, $q \in [0, 3]$ | $q$ | 2, 128 | $d$ | $-d$ |

($d$, $m$, $d_{\min}$ float16; $sc$, $m$ of Q4_K/Q5_K 6-bit from ``get_scale_min_k4``, one per
sub-block of 32; Q3_K's $sc$ 6-bit, one per sub-block of 16, which is why its *product*
$(sc - 32) q_3 \in [-124, 128]$ is the quant, under the super-block's single $d$.)

Why the values are *identical*, not merely close (all arithmetic float32, round to nearest;
fused or not, a multiply-add rounds the same here, because every product below is exact):

- $d$, $m$, $d_{\min}$ are float16, so exact in float32; $-8d$, $-16d$, $-128d$ are exact
  (powers of two), and so are $124d$ (7 bits times 11), $d \cdot sc$ and $d_{\min} m$ (6 bits
  times 11): ggml's own ``d1 = d * sc`` and ``m1 = dmin * m`` are these exact products;
- $s \cdot q^{\text{MLX}}$ is exact: at most 17 significant bits times an integer of at most
  8 bits is at most 24 bits, float32's significand (IQ4_XS's $d (ls - 32)$ has at most 16:
  $|ls - 32| \le 32$ is 5 bits or a power of two), and float16's range keeps it far from
  over- and underflow;
- Q4_1, Q5_1: MLX computes $\mathrm{fl}(d q + m)$, ggml $\mathrm{fl}(q d + m)$; Q4_K, Q5_K:
  MLX $\mathrm{fl}(s q + (-m_1))$, ggml $\mathrm{fl}(d_1 q - m_1)$, and IEEE defines
  $x - y$ as $x + (-y)$: one rounding of the same exact operands, the same bits, zeros
  included;
- Q4_0, Q5_0, Q8_0, Q3_K, IQ4_NL, IQ4_XS, TQ2_0: $s\,q^{\text{MLX}} + b$ equals $d (q - 8)$,
  $d (q - 16)$, $d q$, $d (sc - 32) q_3$, $d K[q]$, $(d (ls - 32)) K[q]$, $d (q - 1)$
  exactly, values of at most 23 significant bits (ggml's own exact products), so the sum is
  not rounded at all;
- MXFP4: ggml multiplies its doubled e2m1 table by $2^{e - 128}$ (a float32 built from the
  bits, subnormal for $e < 2$), MLX multiplies e2m1 by $2^{e - 127}$: both products are the
  exact value (at most 2 significant bits times a power of two; an overflow is $\pm\infty$ in
  both).

One thing differs, and only in bits, never in value: *the sign of zero*. IEEE addition of two
non-zero numbers that cancel gives $+0$, so MLX's $s q + b$ is $+0$ where ggml's product
$d \cdot (q - 8)$ is $-0$ (a Q4_0 block with $d < 0$ and $q = 8$, or $d = \pm 0$ with the
matching sign of $q - 8$; likewise Q5_0 at $q = 16$, Q8_0 at $q = 0$, Q3_K at
$(sc - 32) q_3 = 0$, TQ2_0 at $q = 1$, and IQ4_NL, IQ4_XS where the scale is $\pm 0$). No
scale and bias can fix that: a zero that is $s q + b$ with $s \ne 0$ is $-0$ only when
$q = 0$ and $b = -0$, and the zero of these types is an *interior* level, while
$q^{\text{MLX}} = 0$ must be an end of the range (and a zero IQ4 scale gives ggml zeros of
both signs in one group, by the sign of $K[q]$, where MLX has one bias). MXFP4 has the
opposite case: e2m1 code 8 is $-0$ in MLX and $+0$ in ggml's integer table. Since $-0 = +0$,
every product and every sum that has a non-zero term is unchanged. Q4_1, Q5_1, Q4_K and Q5_K
have no such case: they are bit-identical everywhere. Non-finite scales (an infinite or NaN
float16 $d$, an E8M0 $e = 255$: never written by a quantizer) are outside the proof:
$\infty \cdot q - 8\infty$ is NaN where ggml gives $\pm\infty$, and MLX reads $e = 255$ as
NaN where ggml reads $2^{127}$.

Two types have no exact form that MLX's kernels can run at fewer bytes than float16: Q6_K
and Q2_K give each *16* weights their own scale, and MLX's smallest group is 32. They are
*requantized* when asked (``bounded=True``), within a stated bound:

- Q6_K ($d\,sc\,(q - 32)$, $sc$ int8): 8 bits, groups of 128 *anchored* on the sub-block
  scale $S$ of largest magnitude in the group: scale $S/4$, bias $-32S$. The anchor
  sub-block is exact, every other weight is within $|S|/8$ ($|S|/4$ for the one value,
  $32|S|$, beyond the grid), plus float32 rounding ($< 2^{-16}|S|$);
- Q2_K ($(d\,sc) q - d_{\min} m$, 4-bit $sc$, $m$): 4 bits, groups of 32 spanning the group,
  scale $(\max - \min)/15$, bias $\min$: within $(\max - \min)/30$ plus float32 rounding.

Every other type (F16, BF16, the IQ grid types, and Q6_K/Q2_K unless ``bounded``) is dequantized
once, at load, by [`reference.quants.dequantize`][reference.quants.dequantize]
([`load_weight`][]). ``docs/mlx-quantization.md`` has the measured bytes per weight and the
errors of every option tried.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """A weight in one of MLX's quantized forms: ``w = scales * q + biases`` per group
    (``mode="affine"``), or ``w = e2m1(q) * 2**(scales - 127)`` (``mode="mxfp4"``).

    Attributes:
        w_q: uint32 ``(*lead, n * bits // 32)``: the packed quants, a little-endian bit
            stream, weight ``i`` in bits ``bits*i`` and up; ``lead`` is ``shape[:-1]``, or
            ``(1,)`` for a 1-D weight (MLX wants at least two dimensions).
        scales: float32 ``(*lead, n // group_size)`` (uint8 E8M0 exponents for MXFP4).
        biases: float32 ``(*lead, n // group_size)``, or None for MXFP4.
        group_size: weights per group: 32, or 128 where one float16 scale spans them
            ([`FORMS`][]).
        bits: 2 to 8.
        shape: the logical shape in NumPy order, ``(*shape[:-1], n)``.
        qtype: the GGUF type it came from.
        mode: ``"affine"`` or ``"mxfp4"``.
    """

    w_q: mx.array
    scales: mx.array
    biases: mx.array | None
    group_size: int
    bits: int
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    mode: str = "affine"

    @property
    def nbytes(self) -> int:
        """Resident bytes: quants, scales and biases."""
        extra = 0 if self.biases is None else self.biases.nbytes
        return self.w_q.nbytes + self.scales.nbytes + extra


# --8<-- [end:MLXQuantized]


# --8<-- [start:FORMS]
@dataclass(frozen=True)
class MLXForm:
    """How one GGUF type is held in MLX.

    Attributes:
        bits: MLX's ``bits``.
        group_size: MLX's ``group_size``.
        exact: every weight has the reference's value (up to the sign of a zero); otherwise
            the type is *requantized* within the bound stated in the module docstring, and only
            kept quantized when asked (``bounded=True``).
        mode: MLX's quantization mode.
    """

    bits: int
    group_size: int
    exact: bool = True
    mode: str = "affine"


FORMS: dict[GGMLQuantizationType, MLXForm] = {
    T.Q4_0: MLXForm(4, 32),
    T.Q4_1: MLXForm(4, 32),
    T.Q5_0: MLXForm(5, 32),
    T.Q5_1: MLXForm(5, 32),
    T.Q8_0: MLXForm(8, 32),
    T.Q4_K: MLXForm(4, 32),
    T.Q5_K: MLXForm(5, 32),
    T.Q3_K: MLXForm(8, 128),
    T.MXFP4: MLXForm(4, 32, mode="mxfp4"),
    T.IQ4_NL: MLXForm(8, 32),
    T.IQ4_XS: MLXForm(8, 32),
    T.TQ2_0: MLXForm(2, 128),
    T.Q6_K: MLXForm(8, 128, exact=False),
    T.Q2_K: MLXForm(4, 32, exact=False),
}
"""The MLX form of every GGUF type that can stay quantized; every other type (F16, BF16, the
IQ grid types, ...) is dequantized at load."""

EXACT_TYPES: dict[GGMLQuantizationType, int] = {q: f.bits for q, f in FORMS.items() if f.exact}
"""The GGUF types that run quantized in MLX without loss, and their MLX ``bits``."""

BOUNDED_TYPES: dict[GGMLQuantizationType, int] = {
    q: f.bits for q, f in FORMS.items() if not f.exact
}
"""The GGUF types requantized within a stated bound (``bounded=True``), and their ``bits``."""
# --8<-- [end:FORMS]


# ---------------------------------------------------------------------------------------------
# Bits
# ---------------------------------------------------------------------------------------------


def _pack_words(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned quants ``(..., n)`` (values < ``2**bits``) -> MLX words ``(..., n*bits/32)``.

    MLX's order is a little-endian bit stream: weight ``i`` occupies bits ``bits*i`` to
    ``bits*i + bits - 1`` of the row, bit ``k`` of the row being bit ``k % 32`` of word
    ``k // 32``. With 4 bits, byte ``k`` holds weight ``2k`` in its low nibble and ``2k + 1``
    in its high one; with 8 bits, byte ``k`` is weight ``k``.
    """
    q = q.astype(np.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)  # (..., n // 2) bytes
    elif bits != 8:
        stream = np.unpackbits(q[..., None], axis=-1, bitorder="little")[..., :bits]
        q = np.packbits(stream.reshape(*q.shape[:-1], -1), axis=-1, bitorder="little")
    return np.ascontiguousarray(q).view("<u4").astype(np.uint32)  # (..., n * bits // 32)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block ``(..., n_blocks, type_size)``, as float32."""
    return (
        np.ascontiguousarray(blocks[..., start : start + 2]).view("<f2")[..., 0].astype(np.float32)
    )  # (..., n_blocks)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 ``qh`` ``(..., 4)`` -> bit 4 of each of the 32 quants ``(..., 32)``."""
    return np.unpackbits(qh, axis=-1, bitorder="little")  # (..., 32)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """K-quant 2-bit field ``(..., 64)`` -> ``(..., 256)`` in weight order.

    Byte ``32h + l`` holds weight ``128h + 32s + l`` in bits ``2s, 2s + 1`` (Q2_K's and
    Q3_K's ``qs``).
    """
    chunks = qs.reshape(*qs.shape[:-1], 2, 1, 32)  # (..., 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]  # (4, 1)
    return ((chunks >> shifts) & 3).reshape(*qs.shape[:-1], 256)  # (..., 256)


# ---------------------------------------------------------------------------------------------
# The exact forms: (q, scales, biases) per block, weight order
# ---------------------------------------------------------------------------------------------

# An encoder takes blocks (..., n_blocks, type_size) and returns the MLX quants (..., n_blocks,
# block_size) and the scales and biases (..., n_blocks, block_size // group_size).
Encoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _encode_q4_0(blocks: np.ndarray) -> Encoded:
    """$d (q - 8)$: quants $q$, scale $d$, bias $-8d$ (exact: a power of two)."""
    d = _f16_field(blocks, 0)[..., None]  # (..., nb, 1)
    return ref._nibbles(blocks[..., 2:18]), d, np.float32(-8) * d


def _encode_q4_1(blocks: np.ndarray) -> Encoded:
    """$d q + m$: quants $q$, scale $d$, bias $m$."""
    d, m = _f16_field(blocks, 0)[..., None], _f16_field(blocks, 2)[..., None]  # (..., nb, 1)
    return ref._nibbles(blocks[..., 4:20]), d, m


def _encode_q5_0(blocks: np.ndarray) -> Encoded:
    """$d (q - 16)$: quants $q$ (5 bits), scale $d$, bias $-16d$ (exact: a power of two)."""
    d = _f16_field(blocks, 0)[..., None]  # (..., nb, 1)
    q = ref._nibbles(blocks[..., 6:22]) | (_fifth_bits(blocks[..., 2:6]) << 4)  # (..., nb, 32)
    return q, d, np.float32(-16) * d


def _encode_q5_1(blocks: np.ndarray) -> Encoded:
    """$d q + m$: quants $q$ (5 bits), scale $d$, bias $m$."""
    d, m = _f16_field(blocks, 0)[..., None], _f16_field(blocks, 2)[..., None]  # (..., nb, 1)
    q = ref._nibbles(blocks[..., 8:24]) | (_fifth_bits(blocks[..., 4:8]) << 4)  # (..., nb, 32)
    return q, d, m


def _encode_q8_0(blocks: np.ndarray) -> Encoded:
    """$d q$, $q$ int8: quants $q + 128$ (the sign bit flipped), scale $d$, bias $-128d$."""
    d = _f16_field(blocks, 0)[..., None]  # (..., nb, 1)
    return blocks[..., 2:34] ^ np.uint8(0x80), d, np.float32(-128) * d


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""Q4_K/Q5_K: the sub-block scales $d \cdot sc_i$ and biases $-(d_{\min} m_i)$, ``(..., 8)``.

    Both products are exact in float32 (11-bit times 6-bit integers), as ggml's ``d1``, ``m1``.
    """
    d, dmin = _f16_field(blocks, 0)[..., None], _f16_field(blocks, 2)[..., None]  # (..., nb, 1)
    sc, m = ref.get_scale_min_k4(blocks[..., 4:16])  # (..., nb, 8) each
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _encode_q4_k(blocks: np.ndarray) -> Encoded:
    r"""$(d\,sc_i) q - d_{\min} m_i$ per sub-block of 32: one MLX group per sub-block."""
    scales, biases = _k_scales(blocks)  # (..., nb, 8) each
    q = ref._subblocks_of_64(blocks[..., 16:144])  # (..., nb, 8, 32)
    return q.reshape(*blocks.shape[:-1], 256), scales, biases


def _encode_q5_k(blocks: np.ndarray) -> Encoded:
    """Q4_K with a fifth bit: bit $i$ of ``qh`` byte $j$ is bit 4 of weight $32i + j$."""
    scales, biases = _k_scales(blocks)  # (..., nb, 8) each
    qh = blocks[..., None, 16:48]  # (..., nb, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (..., nb, 8, 32)
    q = ref._subblocks_of_64(blocks[..., 48:176]) | (high << 4)  # (..., nb, 8, 32)
    return q.reshape(*blocks.shape[:-1], 256), scales, biases


def _q3_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""``block_q3_K`` -> ``d`` ``(..., 1)``, signed scales $sc - 32$ ``(..., 16)`` and the
    signed quants $q_3 \in [-4, 3]$ ``(..., 256)``, as ``dequantize_row_q3_K`` reads them.

    ``hmask`` (bytes 0-31): bit $i$ of byte $l$ is the high bit of weight $32i + l$, and a
    *clear* bit subtracts 4; ``qs`` (32-95): 2-bit low parts (``_crumbs``); ``scales``
    (96-107): 16 6-bit scales, low nibbles in bytes 0-7 (sub-blocks 0-7 low, 8-15 high
    nibbles), top 2 bits in bytes 8-11 (bits $2k, 2k + 1$ of byte $8 + (i \bmod 4)$ for
    $i = 4k + (i \bmod 4)$); ``d`` (108): float16.
    """
    d = _f16_field(blocks, 108)[..., None]  # (..., nb, 1)
    packed = blocks[..., 96:108]  # (..., nb, 12)
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)  # (..., 16)
    high = (packed[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    sc = (low | (high.reshape(*packed.shape[:-1], 16) << 4)).astype(np.int16) - 32  # (..., 16)
    hm = blocks[..., None, 0:32]  # (..., nb, 1, 32)
    hbit = ((hm >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(*hm.shape[:-2], 256)
    q3 = _crumbs(blocks[..., 32:96]).astype(np.int16) - 4 * (1 - hbit.astype(np.int16))
    return d, sc, q3  # (..., nb, 1), (..., nb, 16), (..., nb, 256)


def _encode_q3_k(blocks: np.ndarray) -> Encoded:
    r"""$d (sc - 32) q_3$ as *one integer* per weight: $(sc - 32) q_3 \in [-124, 128]$, so
    8-bit quants $(sc - 32) q_3 + 124$ with scale $d$ and bias $-124d$, groups of 128 (one
    $d$ per 256 weights)."""
    d, sc, q3 = _q3_k_fields(blocks)
    prod = sc.repeat(16, axis=-1) * q3 + 124  # (..., nb, 256) in [0, 252]
    scales = d.repeat(2, axis=-1)  # (..., nb, 2)
    return prod.astype(np.uint8), scales, np.float32(-124) * scales


def _encode_mxfp4(blocks: np.ndarray) -> Encoded:
    """E8M0 exponent $e$ and e2m1 codes: MLX's ``mxfp4`` as they are (scales uint8 $e$)."""
    return ref._nibbles(blocks[..., 1:17]), blocks[..., 0:1].copy(), None


KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16
)
"""ggml's ``kvalues_iq4nl``: the 16 levels of IQ4_NL and IQ4_XS (no zero among them)."""


def _encode_iq4_nl(blocks: np.ndarray) -> Encoded:
    r"""$d K[q]$: 8-bit quants $K[q] + 128 \in [1, 241]$, scale $d$, bias $-128d$."""
    d = _f16_field(blocks, 0)[..., None]  # (..., nb, 1)
    q = KVALUES_IQ4NL[ref._nibbles(blocks[..., 2:18])] + 128  # (..., nb, 32)
    return q.astype(np.uint8), d, np.float32(-128) * d


def _encode_iq4_xs(blocks: np.ndarray) -> Encoded:
    r"""$(d (ls - 32)) K[q]$ per sub-block of 32: quants $K[q] + 128$, scale $d (ls - 32)$
    (at most 16 significant bits: 11 times 5, or a power of two), bias $-128$ times it.

    ``block_iq4_xs`` (136 bytes): ``d`` (0), ``scales_h`` (2, uint16: bits $2i, 2i + 1$ are
    bits 4-5 of $ls_i$), ``scales_l`` (4-7: nibble $i \bmod 2$ of byte $i / 2$ is bits 0-3 of
    $ls_i$), ``qs`` (8-135: 16 bytes per sub-block, packed as IQ4_NL's).
    """
    lead = blocks.shape[:-1]  # (..., nb)
    d = _f16_field(blocks, 0)[..., None]  # (..., nb, 1)
    scales_h = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")  # (..., nb, 1)
    low = (blocks[..., 4:8, None] >> np.array([0, 4], np.uint8)).reshape(*lead, 8) & 0x0F
    high = (scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # (..., nb, 8)
    ls = low.astype(np.int16) | (high.astype(np.int16) << 4)  # (..., nb, 8) in [0, 63]
    scales = d * (ls - 32).astype(np.float32)  # (..., nb, 8) exact
    q = KVALUES_IQ4NL[ref._nibbles(blocks[..., 8:136].reshape(*lead, 8, 16))] + 128
    return q.reshape(*lead, 256).astype(np.uint8), scales, np.float32(-128) * scales


def _encode_tq2_0(blocks: np.ndarray) -> Encoded:
    r"""$d (q - 1)$, $q \in [0, 3]$ (ternary: 0, 1, 2 in practice): 2-bit quants $q$ with scale
    $d$ and bias $-d$, groups of 128 (one $d$ per 256). ``block_tq2_0`` (66 bytes): ``qs``
    (0-63, ``_crumbs``), ``d`` (64)."""
    d = _f16_field(blocks, 64)[..., None].repeat(2, axis=-1)  # (..., nb, 2)
    return _crumbs(blocks[..., 0:64]), d, -d


# ---------------------------------------------------------------------------------------------
# The bounded forms: requantized
# ---------------------------------------------------------------------------------------------


def _encode_q6_k(blocks: np.ndarray) -> Encoded:
    """Q6_K requantized to 8 bits, groups of 128 (8 sub-blocks of 16), *anchored* on the
    sub-block scale $S$ of largest magnitude in the group: the grid is $(S/4)(q - 128)$.

    The anchor sub-block is exact ($4(q - 32) + 128$); every other weight is rounded to the
    nearest grid point (the grid spans $[-32S, 31.75S]$, so only $32|S|$ is clipped).
    """
    w = ref.dequantize_q6_k(blocks).astype(np.float64)  # (..., nb, 256)
    d = _f16_field(blocks, 208)[..., None]  # (..., nb, 1)
    sub = (d * blocks[..., 192:208].view(np.int8).astype(np.float32)).reshape(
        *blocks.shape[:-1], 2, 8
    )  # (..., nb, 2 groups, 8 sub-blocks)
    pick = np.abs(sub).argmax(axis=-1)[..., None]  # (..., nb, 2, 1)
    grid = np.take_along_axis(sub, pick, axis=-1) / np.float32(4)  # (..., nb, 2, 1) exact
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.rint(w.reshape(*grid.shape[:-1], 128) / grid) + 128  # (..., nb, 2, 128)
    q = np.where(np.isfinite(r), r, 128).clip(0, 255).astype(np.uint8)
    grid = grid[..., 0]  # (..., nb, 2)
    return q.reshape(*blocks.shape[:-1], 256), grid, np.float32(-128) * grid


def _q2_k_values(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_q2_K``: $(d \cdot sc) q - (d_{\min} m)$ per sub-block of 16.

    ``block_q2_K`` (84 bytes): ``scales`` (0-15, low nibble $sc$, high nibble $m$), ``qs``
    (16-79, ``_crumbs``), ``d`` (80) and ``dmin`` (82), float16.
    """
    d, dmin = _f16_field(blocks, 80)[..., None], _f16_field(blocks, 82)[..., None]
    sc = blocks[..., 0:16]  # (..., nb, 16)
    dl = (d * (sc & 0x0F).astype(np.float32))[..., None]  # (..., nb, 16, 1)
    ml = (dmin * (sc >> 4).astype(np.float32))[..., None]  # (..., nb, 16, 1)
    q = _crumbs(blocks[..., 16:80]).reshape(*sc.shape, 16).astype(np.float32)
    return (dl * q - ml).reshape(*blocks.shape[:-1], 256)  # (..., nb, 256)


def _encode_q2_k(blocks: np.ndarray) -> Encoded:
    r"""Q2_K requantized to 4 bits, groups of 32 (2 sub-blocks): the grid spans the group,
    $s = (\max - \min) / 15$, $b = \min$, $q = \mathrm{round}((w - b) / s)$."""
    w = _q2_k_values(blocks).reshape(*blocks.shape[:-1], 8, 32)  # (..., nb, 8, 32)
    lo, hi = w.min(axis=-1), w.max(axis=-1)  # (..., nb, 8)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s = ((hi.astype(np.float64) - lo) / 15).astype(np.float32)  # (..., nb, 8)
        r = np.rint((w - lo[..., None].astype(np.float64)) / s[..., None])  # (..., nb, 8, 32)
    q = np.where(np.isfinite(r), r, 0).clip(0, 15).astype(np.uint8)
    return q.reshape(*blocks.shape[:-1], 256), s, lo


ENCODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], Encoded]] = {
    T.Q4_0: _encode_q4_0,
    T.Q4_1: _encode_q4_1,
    T.Q5_0: _encode_q5_0,
    T.Q5_1: _encode_q5_1,
    T.Q8_0: _encode_q8_0,
    T.Q4_K: _encode_q4_k,
    T.Q5_K: _encode_q5_k,
    T.Q3_K: _encode_q3_k,
    T.MXFP4: _encode_mxfp4,
    T.IQ4_NL: _encode_iq4_nl,
    T.IQ4_XS: _encode_iq4_xs,
    T.TQ2_0: _encode_tq2_0,
    T.Q6_K: _encode_q6_k,
    T.Q2_K: _encode_q2_k,
}


# --8<-- [start:to_mlx]
def to_mlx(t: QuantizedTensor, bounded: bool = False) -> MLXQuantized:
    r"""Twin of
    [`reference.quants.QuantizedTensor.dequantize`][reference.quants.QuantizedTensor.dequantize],
    without dequantizing.

    Re-encodes a tensor of one of the [`FORMS`][] in MLX's quantization: for the exact types
    [`dequantize_mlx`][] gives back the reference's float32 weights (the same values, and the
    same bits except the sign of a zero; see the module docstring), for the bounded ones
    (``bounded=True``) values within the stated bound.

    Args:
        t: the GGUF tensor, ``t.shape == (..., n)``, ``n`` a whole number of blocks.
        bounded: also requantize the [`BOUNDED_TYPES`][].

    Returns:
        The [`MLXQuantized`][] weight.

    Raises:
        QuantError: if ``t.qtype`` has no exact form (and, with ``bounded``, no bounded one).

    Examples:
        >>> x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
        >>> t = QuantizedTensor.from_float(x, GGMLQuantizationType.Q4_0)
        >>> m = to_mlx(t)
        >>> m.w_q.shape, m.scales.shape, m.bits
        ((2, 4), (2, 1), 4)
        >>> bool(np.array_equal(np.array(dequantize_mlx(m)), t.dequantize()))
        True
    """
    form = FORMS.get(t.qtype)
    if form is None or not (form.exact or bounded):
        extra = f"; bounded (bounded=True): {', '.join(q.name for q in BOUNDED_TYPES)}"
        raise QuantError(
            f"{t.qtype.name} has no exact MLX affine form; exact types: "
            f"{', '.join(q.name for q in EXACT_TYPES)}{extra} (use load_weight to dequantize it)"
        )
    lead = t.shape[:-1] if len(t.shape) > 1 else (1,)
    n = t.shape[-1]
    n_blocks = n // ref._layout(t.qtype).block_size
    blocks = np.ascontiguousarray(t.data).reshape(*lead, n_blocks, -1)
    q, scales, biases = ENCODERS[t.qtype](blocks)  # (*lead, nb, block), (*lead, nb, groups)
    w_q = _pack_words(q.reshape(*lead, n), form.bits)  # (*lead, n * bits // 32)
    scales = mx.array(scales.reshape(*lead, n // form.group_size))
    if biases is not None:
        biases = mx.array(biases.reshape(*lead, n // form.group_size))
    return MLXQuantized(
        mx.array(w_q), scales, biases, form.group_size, form.bits, t.shape, t.qtype, form.mode
    )


# --8<-- [end:to_mlx]


# --8<-- [start:dequantize_mlx]
def dequantize_mlx(m: MLXQuantized) -> mx.array:
    """The float32 weights of ``m`` via ``mx.dequantize``:
    [`reference.quants.dequantize`][reference.quants.dequantize]'s for the exact types.

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
    w = mx.dequantize(
        m.w_q, m.scales, m.biases, group_size=m.group_size, bits=m.bits, mode=m.mode,
        dtype=mx.float32,
    )
    return w.reshape(m.shape)  # shape


# --8<-- [end:dequantize_mlx]


# --8<-- [start:take_rows]
def take_rows(m: MLXQuantized, idx: mx.array) -> mx.array:
    """``get_rows`` on a quantized 2-D weight: the float32 rows ``idx``, dequantizing only them.

    The same values as ``dequantize_mlx(m)[idx]`` (the packed rows are gathered first).

    Args:
        m: the weight, ``m.shape == (n_rows, n)``.
        idx: int32 ``(n_idx,)``.

    Returns:
        float32 ``(n_idx, n)``.

    Examples:
        >>> w = 127 * np.eye(32, dtype=np.float32)   # d = 1 in every block
        >>> t = QuantizedTensor.from_float(w, GGMLQuantizationType.Q8_0)
        >>> take_rows(to_mlx(t), mx.array([3]))[0, 2:5].tolist()
        [0.0, 127.0, 0.0]
    """
    biases = None if m.biases is None else m.biases[idx]
    return mx.dequantize(
        m.w_q[idx], m.scales[idx], biases, group_size=m.group_size, bits=m.bits, mode=m.mode,
        dtype=mx.float32,
    )  # (n_idx, n)


# --8<-- [end:take_rows]


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
        x, m.w_q, m.scales, m.biases, transpose=True, group_size=m.group_size, bits=m.bits,
        mode=m.mode,
    )  # (..., n_out)


# --8<-- [end:quantized_matmul]


# --8<-- [start:load_weight]
def load_weight(
    t: QuantizedTensor | np.ndarray,
    dtype: mx.Dtype = mx.float32,
    keep_quantized: bool = True,
    bounded: bool = False,
) -> MLXQuantized | mx.array:
    """One GGUF tensor as MLX will use it: quantized if exact (or bounded, when asked), else
    dequantized once.

    The [`EXACT_TYPES`][] become [`MLXQuantized`][] ([`to_mlx`][], lossless) unless
    ``keep_quantized`` is false; with ``bounded`` the [`BOUNDED_TYPES`][] (Q6_K, Q2_K) are
    requantized too. Every other type is dequantized by the reference
    ([`reference.quants.dequantize`][reference.quants.dequantize], float32) and cast to ``dtype``:
    F16 and F32 arrays keep their values in float16, other types are rounded to it.

    Args:
        t: a [`reference.quants.QuantizedTensor`][reference.quants.QuantizedTensor], or a float
            array (GGUF's F32 tensors are read as NumPy arrays).
        dtype: ``mx.float32`` or ``mx.float16`` (or ``mx.bfloat16``) for dequantized weights.
        keep_quantized: keep the exact types quantized.
        bounded: keep the bounded types quantized too (requantized; needs ``keep_quantized``).

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
        if keep_quantized and (t.qtype in EXACT_TYPES or (bounded and t.qtype in BOUNDED_TYPES)):
            return to_mlx(t, bounded)
        w = t.dequantize()  # float32, shape
    else:
        w = np.asarray(t)
    return mx.array(w).astype(dtype)


# --8<-- [end:load_weight]
