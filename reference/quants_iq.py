r"""The grid I-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M.

The K-quants store one small integer per weight. The I-quants store one *index per group of
weights*: 8 consecutive weights (4 for the IQ3 types) are replaced by the number of a point in
a fixed table, the **grid** (a codebook written in ggml's source, the same for every model),
plus the signs of the weights and a scale. A group of 8 IQ2_XXS weights costs 8 bits of index
and 7 bits of signs, under 2 bits a weight, and its 256 points are chosen ones, not all
$3^8$ combinations of its three magnitudes.

Every type here has super-blocks of ``QK_K = 256`` weights with one float16 scale $d$, cut
into 8 sub-blocks of 32 weights, each with a small integer scale; within a sub-block, 4 groups
of 8 weights each take one grid point (IQ3: two 4-dimensional points) and 8 signs:

$$w = d_b \cdot G[q]_j \cdot \sigma_j \qquad\text{(IQ2, IQ3)}, \qquad
w = d_b \cdot (G[q]_j + \delta) \qquad\text{(IQ1)}$$

with $d_b$ the sub-block's scale, $G[q]_j$ coordinate $j$ of grid point $q$ (a positive
magnitude for IQ2/IQ3, one of $-1, 0, 1$ for IQ1), $\sigma_j = \pm 1$ and $\delta = \pm 1/8$.

This module mirrors ggml at the pinned commit:

- the block structs ``block_iq2_xxs`` ... ``block_iq1_m`` of ``ggml/src/ggml-common.h``
  (lines 381-441) become the byte tables in each function's docstring and `IQ_DEQUANTIZERS`;
- ``dequantize_row_iq2_xxs`` ... ``dequantize_row_iq1_m`` of ``ggml/src/ggml-quants.c``
  (lines 2488-2723) become ``dequantize_iq2_xxs`` ... ``dequantize_iq1_m``, bit-identical to
  ``gguf.quants.dequantize`` and to ggml's C loops evaluated as written (float32 arithmetic in
  the same order);
- the tables of ``ggml-common.h`` (``iq2xxs_grid``, ``iq2xs_grid``, ``iq2s_grid``,
  ``iq3xxs_grid``, ``iq3s_grid``, ``iq1s_grid``, ``ksigns_iq2xs``, ``kmask_iq2xs``,
  ``IQ1S_DELTA``, ``IQ1M_DELTA``) become `IQ2XXS_GRID` ... `IQ1S_GRID`, `KSIGNS_IQ2XS`,
  `KMASK_IQ2XS`, `IQ1S_DELTA`, `IQ1M_DELTA`. The grids are not retyped from the header's
  ``uint64`` words: they are unpacked by one rule ([`unpack_grid`][]) from the 16-bit ``kgrid_*``
  tables that ggml's own quantizer starts from (``iq2xs_init_impl`` and ``iq3xs_init_impl``
  in ``ggml-quants.c``), which the end of this module copies with their file and line.

The per-format functions take raw blocks ``(..., type_size)`` (uint8, any leading
dimensions) and return float32 ``(..., 256)``, like ``reference.quants.dequantize_q4_k``;
``reference.quants`` registers them for its ``dequantize`` (which checks the bytes first).
This module does not import ``reference.quants`` (that one imports this one).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

# --8<-- [start:constants]
QK_K = 256  # weights per super-block (as in reference.quants, which imports this module)
F16_SIZE = 2  # sizeof(ggml_half)
IQ1S_DELTA = np.float32(0.125)  # ggml-common.h:1132: the shift of an IQ1_S sub-block
IQ1M_DELTA = np.float32(0.125)  # ggml-common.h:1133 (dequantize_row_iq1_m uses IQ1S_DELTA)
# --8<-- [end:constants]


# ---------------------------------------------------------------------------------------------
# Reading the fields of a block
# ---------------------------------------------------------------------------------------------


def _f16(field: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes ``(..., 2)`` -> float32 ``(..., 1)`` (GGML_FP16_TO_FP32)."""
    return np.ascontiguousarray(field).view("<f2").astype(np.float32)


def _u16(field: np.ndarray) -> np.ndarray:
    """Little-endian bytes ``(..., 2n)`` -> ``uint16`` ``(..., n)`` (ggml's ``uint16_t``)."""
    return np.ascontiguousarray(field).view("<u2")


def _u32(field: np.ndarray) -> np.ndarray:
    """Little-endian bytes ``(..., 4n)`` -> ``uint32`` ``(..., n)`` (ggml's ``aux32``)."""
    return np.ascontiguousarray(field).view("<u4")


# --8<-- [start:sign_factors]
def sign_factors(sign_bits: np.ndarray) -> np.ndarray:
    r"""Bytes of sign bits ``(...)`` -> float32 factors ``(..., 8)``: bit $j$ set means $-1$.

    This is ggml's ``signs & kmask_iq2xs[j] ? -1.f : 1.f``; the weight is multiplied by the
    factor, as in C.

    Examples:
        >>> sign_factors(np.uint8(0b1000_0101)).tolist()
        [-1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, -1.0]
    """
    return np.where(sign_bits[..., None] & KMASK_IQ2XS, np.float32(-1), np.float32(1))


# --8<-- [end:sign_factors]


def _nibbles(x: np.ndarray) -> np.ndarray:
    """Bytes ``(..., n)`` -> 4-bit values ``(..., n, 2)``: each byte's low nibble, then its high."""
    return np.stack([x & 0x0F, x >> 4], axis=-1)


# ---------------------------------------------------------------------------------------------
# The grids and the sign table
# ---------------------------------------------------------------------------------------------


# --8<-- [start:unpack_grid]
def unpack_grid(
    kgrid: tuple[int, ...], levels: np.ndarray | tuple[int, ...], bits: int, dim: int
) -> np.ndarray:
    r"""A dequantization grid from ggml's packed form: point $k$, coordinate $i$ is
    ``levels[(kgrid[k] >> bits*i) & (2**bits - 1)]``.

    ggml's quantizer (``iq2xs_init_impl``, ``iq3xs_init_impl`` in ``ggml-quants.c``) keeps
    each grid point as a ``uint16`` of ``dim`` level numbers of ``bits`` bits each, level $l$
    standing for the odd integer $2l + 1$ of the lattice. The tables that dequantization reads
    (``ggml-common.h``) hold the same points with each level replaced by its stored value,
    one byte per coordinate, packed into a ``uint64`` (8 coordinates) or ``uint32`` (4).

    Args:
        kgrid: the packed points, ``uint16`` values.
        levels: the value of each level number; its dtype is the grid's.
        bits: bits per coordinate in ``kgrid`` (2 or 3).
        dim: coordinates per point (8 or 4).

    Returns:
        ``(len(kgrid), dim)``: the grid, one point per row.

    Examples:
        >>> unpack_grid((0, 0b01_01, 0b10_01_00), (0x08, 0x19, 0x2b), bits=2, dim=4).tolist()
        [[8, 8, 8, 8], [25, 25, 8, 8], [8, 25, 43, 8]]
    """
    packed = np.asarray(kgrid, dtype=np.uint16)[:, None]  # (n, 1)
    level = (packed >> (bits * np.arange(dim, dtype=np.uint16))) & ((1 << bits) - 1)  # (n, dim)
    return np.asarray(levels)[level]  # (n, dim)


# --8<-- [end:unpack_grid]


# --8<-- [start:ksigns]
# ggml-common.h:509, kmask_iq2xs: bit j of a sign byte is the sign of weight j.
KMASK_IQ2XS = (1 << np.arange(8)).astype(np.uint8)
# ggml-common.h:513, ksigns_iq2xs: 7 stored sign bits -> 8, the 8th making the number of
# minus signs even (ksigns_iq2xs[i] = i | parity(i) << 7).
KSIGNS_IQ2XS = np.array([i | (bin(i).count("1") & 1) << 7 for i in range(128)], dtype=np.uint8)
# --8<-- [end:ksigns]


# ---------------------------------------------------------------------------------------------
# IQ2: 8-dimensional grids of the levels 0x08, 0x19, 0x2b
# ---------------------------------------------------------------------------------------------


# --8<-- [start:dequantize_iq2_xxs]
def dequantize_iq2_xxs(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_iq2_xxs``: 256 grid points of 8 weights, 7 sign bits (2.0625 bits/weight).

    ``block_iq2_xxs`` (66 bytes, 256 weights); ``qs`` is read as 8 pairs of little-endian
    ``uint32`` $(a_b, c_b)$, one pair per sub-block $b$ of 32 weights:

    | byte offset | field | type        | meaning                                            |
    |------------:|-------|-------------|----------------------------------------------------|
    | 0           | `d`   | f16         | super-block scale                                  |
    | 2 + 8b      | $a_b$ | uint8[4]    | grid indices $q_{b,g}$ of the 4 groups of 8        |
    | 6 + 8b      | $c_b$ | uint32      | 4 sign indices of 7 bits, then the scale $s_b$     |

    Bits $7g \ldots 7g+6$ of $c_b$ are the sign index of group $g$, bits 28-31 the scale.

    The 7 stored sign bits of a group become 8 by ``ksigns_iq2xs`` (an even number of minus
    signs). For weight $j$ of group $g$ of sub-block $b$:

    $$d_b = d \cdot (0.5 + s_b) \cdot 0.25, \qquad
    w_{32b+8g+j} = d_b \cdot G[q_{b,g}]_j \cdot \sigma_{b,g,j}, \qquad G = \text{IQ2XXS\_GRID}$$

    Args:
        blocks: uint8 ``(..., 66)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(66, dtype=np.uint8)
        >>> block[0:2] = np.array([2.0], dtype="<f2").view(np.uint8)       # d = 2
        >>> block[2] = 1                                 # group 0: point 1 = (43, 8, ..., 8)
        >>> block[6:10] = np.array([3 << 28 | 1], dtype="<u4").view(np.uint8)  # s = 3, signs 1
        >>> w = dequantize_iq2_xxs(block)     # d_0 = 2 * 3.5 * 0.25 = 1.75; signs of 0 and 7
        >>> w[:8].tolist()
        [-75.25, 14.0, 14.0, 14.0, 14.0, 14.0, 14.0, -14.0]
    """
    lead = blocks.shape[:-1]
    d = _f16(blocks[..., 0:2])  # (..., 1)
    qs = blocks[..., 2:66].reshape(*lead, 8, 8)  # (..., 8, 8): a_b then c_b, per sub-block
    index = qs[..., 0:4]  # (..., 8, 4)
    aux = _u32(qs[..., 4:8])[..., 0]  # (..., 8)
    sign_index = (aux[..., None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 127  # (..., 8, 4)
    db = d * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.25)  # (..., 8)
    g = IQ2XXS_GRID[index].astype(np.float32)  # (..., 8, 4, 8)
    w = db[..., None, None] * g * sign_factors(KSIGNS_IQ2XS[sign_index])  # (..., 8, 4, 8)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_iq2_xxs]


def _iq2_scales(d: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """IQ2_XS/IQ2_S: ``d * (0.5 + s) * 0.25`` per group of 8, from 4-bit scales ``(..., 8)``.

    The low nibble of ``scales[b]`` scales groups 0 and 1 of sub-block ``b``, the high
    nibble groups 2 and 3: the result is ``(..., 8, 4)``.
    """
    s = _nibbles(scales).astype(np.float32)  # (..., 8, 2)
    db = d[..., None] * (np.float32(0.5) + s) * np.float32(0.25)  # (..., 8, 2)
    return np.repeat(db, 2, axis=-1)  # (..., 8, 4)


# --8<-- [start:dequantize_iq2_xs]
def dequantize_iq2_xs(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_iq2_xs``: 512 grid points, a scale per 16 weights (2.3125 bits/weight).

    ``block_iq2_xs`` (74 bytes, 256 weights):

    | byte offset | field    | type       | meaning                                         |
    |------------:|----------|------------|-------------------------------------------------|
    | 0           | `d`      | f16        | super-block scale                               |
    | 2           | `qs`     | uint16[32] | group $k$: bits 0-8 grid index, 9-15 sign index |
    | 66          | `scales` | uint8[8]   | sub-block $b$: low nibble for groups 0-1, high for 2-3 |

    Group $k = 4b + g$ holds weights $8k \ldots 8k+7$; its scale $s$ is a nibble of
    ``scales[b]``:

    $$w_{8k+j} = d \cdot (0.5 + s) \cdot 0.25 \cdot G[q_k]_j \cdot \sigma_{k,j}, \qquad
    G = \text{IQ2XS\_GRID}$$

    Args:
        blocks: uint8 ``(..., 74)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(74, dtype=np.uint8)
        >>> block[0:2] = np.array([1.0], dtype="<f2").view(np.uint8)
        >>> block[2:4] = np.array([5 << 9 | 2], dtype="<u2").view(np.uint8)  # point 2, signs 5
        >>> block[66] = 0x21                    # scales 1 (weights 0-15) and 2 (16-31)
        >>> w = dequantize_iq2_xs(block)        # point 2 = (25, 25, 8, ..., 8); 0.375 * it
        >>> w[:4].tolist(), w[16:18].tolist()
        ([-9.375, 9.375, -3.0, 3.0], [5.0, 5.0])
    """
    lead = blocks.shape[:-1]
    d = _f16(blocks[..., 0:2])  # (..., 1)
    qs = _u16(blocks[..., 2:66]).reshape(*lead, 8, 4)  # (..., 8, 4)
    db = _iq2_scales(d, blocks[..., 66:74])  # (..., 8, 4)
    g = IQ2XS_GRID[qs & 511].astype(np.float32)  # (..., 8, 4, 8)
    w = db[..., None] * g * sign_factors(KSIGNS_IQ2XS[qs >> 9])  # (..., 8, 4, 8)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_iq2_xs]


# --8<-- [start:dequantize_iq2_s]
def dequantize_iq2_s(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_iq2_s``: 1024 grid points, 8 explicit sign bits (2.5625 bits/weight).

    ``block_iq2_s`` (82 bytes, 256 weights):

    | byte offset | field    | type      | meaning                                          |
    |------------:|----------|-----------|--------------------------------------------------|
    | 0           | `d`      | f16       | super-block scale                                |
    | 2           | `qs`     | uint8[32] | group $k$: bits 0-7 of its grid index            |
    | 34          | `signs`  | uint8[32] | group $k$: bit $j$ is the sign of weight $8k+j$  |
    | 66          | `qh`     | uint8[8]  | bits 8-9 of the grid indices                     |
    | 74          | `scales` | uint8[8]  | as in IQ2_XS                                     |

    Bits $2g, 2g+1$ of ``qh[b]`` are bits 8-9 of the index of group $4b+g$. (ggml declares
    ``qs`` as 64 bytes and reads its second half as ``signs``.)

    $$w_{8k+j} = d \cdot (0.5 + s) \cdot 0.25 \cdot G[q_k]_j \cdot \sigma_{k,j}, \qquad
    G = \text{IQ2S\_GRID}$$

    Args:
        blocks: uint8 ``(..., 82)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(82, dtype=np.uint8)
        >>> block[0:2] = np.array([1.0], dtype="<f2").view(np.uint8)
        >>> block[2], block[66] = 3, 0b10       # group 0: index 3 | 2 << 8 = 515
        >>> block[34] = 0x01                    # weight 0 negative
        >>> IQ2S_GRID[515].tolist()
        [43, 25, 8, 25, 25, 8, 8, 25]
        >>> dequantize_iq2_s(block)[:8].tolist()     # d_0 = 1 * 0.5 * 0.25
        [-5.375, 3.125, 1.0, 3.125, 3.125, 1.0, 1.0, 3.125]
    """
    lead = blocks.shape[:-1]
    d = _f16(blocks[..., 0:2])  # (..., 1)
    low = blocks[..., 2:34].reshape(*lead, 8, 4).astype(np.uint16)  # (..., 8, 4)
    sign_bits = blocks[..., 34:66].reshape(*lead, 8, 4)  # (..., 8, 4)
    qh = blocks[..., 66:74, None]  # (..., 8, 1)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3  # (..., 8, 4)
    db = _iq2_scales(d, blocks[..., 74:82])  # (..., 8, 4)
    g = IQ2S_GRID[low | high.astype(np.uint16) << 8].astype(np.float32)  # (..., 8, 4, 8)
    w = db[..., None] * g * sign_factors(sign_bits)  # (..., 8, 4, 8)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_iq2_s]


# ---------------------------------------------------------------------------------------------
# IQ3: 4-dimensional grids, two points per group of 8 weights
# ---------------------------------------------------------------------------------------------


# --8<-- [start:dequantize_iq3_xxs]
def dequantize_iq3_xxs(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_iq3_xxs``: 256 points of 4 weights, 7 sign bits per 8 (3.0625 bits/weight).

    ``block_iq3_xxs`` (98 bytes, 256 weights):

    | byte offset | field   | type      | meaning                                            |
    |------------:|---------|-----------|----------------------------------------------------|
    | 0           | `d`     | f16       | super-block scale                                  |
    | 2           | `qs`    | uint8[64] | grid index of each 4 weights                       |
    | 66 + 4b     | $c_b$   | uint32    | 4 sign indices of 7 bits, then the scale $s_b$     |

    Bits $7g \ldots 7g+6$ of $c_b$ are the sign index of group $g$ of sub-block $b$, bits
    28-31 its scale. (ggml declares one ``qs`` of 96 bytes and reads its last 32 as
    ``scales_and_signs``.)
    Group $g$ of sub-block $b$ (8 weights) is the two points $q_{8b+2g}$ and $q_{8b+2g+1}$
    side by side, with the 8 signs of ``ksigns_iq2xs``:

    $$d_b = d \cdot (0.5 + s_b) \cdot 0.5, \qquad
    w_{32b+8g+4h+j} = d_b \cdot G[q_{8b+2g+h}]_j \cdot \sigma_{b,g,4h+j}, \qquad
    G = \text{IQ3XXS\_GRID}$$

    Args:
        blocks: uint8 ``(..., 98)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(98, dtype=np.uint8)
        >>> block[0:2] = np.array([0.5], dtype="<f2").view(np.uint8)
        >>> block[2:4] = [255, 1]               # (4, 28, 52, 62) and (20, 4, 4, 4)
        >>> block[66:70] = np.array([1 << 28 | 127], dtype="<u4").view(np.uint8)  # all minus
        >>> dequantize_iq3_xxs(block)[:8].tolist()   # d_0 = 0.5 * 1.5 * 0.5 = 0.375
        [-1.5, -10.5, -19.5, -23.25, -7.5, -1.5, -1.5, -1.5]
    """
    lead = blocks.shape[:-1]
    d = _f16(blocks[..., 0:2])  # (..., 1)
    index = blocks[..., 2:66].reshape(*lead, 8, 8)  # (..., 8, 8)
    aux = _u32(blocks[..., 66:98])  # (..., 8)
    sign_index = (aux[..., None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 127  # (..., 8, 4)
    db = d * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)  # (..., 8)
    g = IQ3XXS_GRID[index].reshape(*lead, 8, 4, 8).astype(np.float32)  # (..., 8, 4, 8)
    w = db[..., None, None] * g * sign_factors(KSIGNS_IQ2XS[sign_index])  # (..., 8, 4, 8)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_iq3_xxs]


# --8<-- [start:dequantize_iq3_s]
def dequantize_iq3_s(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_iq3_s``: 512 points of 4 weights, 8 explicit signs (3.4375 bits/weight).

    ``block_iq3_s`` (110 bytes, 256 weights):

    | byte offset | field    | type      | meaning                                          |
    |------------:|----------|-----------|--------------------------------------------------|
    | 0           | `d`      | f16       | super-block scale                                |
    | 2           | `qs`     | uint8[64] | bits 0-7 of the grid index of each 4 weights     |
    | 66          | `qh`     | uint8[8]  | sub-block $b$: bit $i$ is bit 8 of index $8b+i$  |
    | 74          | `signs`  | uint8[32] | group $k$: bit $j$ is the sign of weight $8k+j$  |
    | 106         | `scales` | uint8[4]  | 4-bit scales $s_b$, low nibble first             |

    Sub-block $b$'s scale is nibble $b \bmod 2$ of ``scales[b // 2]``; the factors are odd
    integers, not the halves of IQ2/IQ3_XXS:

    $$w_{8k+4h+j} = d \cdot (1 + 2 s_b) \cdot G[q_{2k+h}]_j \cdot \sigma_{k,4h+j}, \qquad
    G = \text{IQ3S\_GRID}$$

    Args:
        blocks: uint8 ``(..., 110)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(110, dtype=np.uint8)
        >>> block[0:2] = np.array([0.25], dtype="<f2").view(np.uint8)
        >>> block[3], block[66] = 7, 0b10       # weights 4-7: index 7 | 1 << 8 = 263
        >>> block[106] = 0x05                   # sub-block 0: s = 5, d_0 = 0.25 * 11
        >>> IQ3S_GRID[0].tolist(), IQ3S_GRID[263].tolist()
        ([1, 1, 1, 1], [3, 3, 11, 5])
        >>> dequantize_iq3_s(block)[:8].tolist()
        [2.75, 2.75, 2.75, 2.75, 8.25, 8.25, 30.25, 13.75]
    """
    lead = blocks.shape[:-1]
    d = _f16(blocks[..., 0:2])  # (..., 1)
    low = blocks[..., 2:66].reshape(*lead, 8, 8).astype(np.uint16)  # (..., 8, 8)
    qh = blocks[..., 66:74, None]  # (..., 8, 1)
    high = (qh >> np.arange(8, dtype=np.uint8)) & 1  # (..., 8, 8)
    sign_bits = blocks[..., 74:106].reshape(*lead, 8, 4)  # (..., 8, 4)
    s = _nibbles(blocks[..., 106:110]).reshape(*lead, 8)  # (..., 8)
    db = d * (1 + 2 * s).astype(np.float32)  # (..., 8)
    g = IQ3S_GRID[low | high.astype(np.uint16) << 8]  # (..., 8, 8, 4)
    g = g.reshape(*lead, 8, 4, 8).astype(np.float32)  # (..., 8, 4, 8)
    w = db[..., None, None] * g * sign_factors(sign_bits)  # (..., 8, 4, 8)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_iq3_s]


# ---------------------------------------------------------------------------------------------
# IQ1: an 8-dimensional grid of -1, 0, 1, shifted by +-1/8
# ---------------------------------------------------------------------------------------------


# --8<-- [start:dequantize_iq1_s]
def dequantize_iq1_s(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_iq1_s``: 2048 ternary points, a shift per 32 weights (1.5625 bits/weight).

    ``block_iq1_s`` (50 bytes, 256 weights):

    | byte offset | field | type      | meaning                                            |
    |------------:|-------|-----------|----------------------------------------------------|
    | 0           | `d`   | f16       | super-block scale                                  |
    | 2           | `qs`  | uint8[32] | group $k$: bits 0-7 of its grid index              |
    | 34          | `qh`  | uint16[8] | per sub-block: index bits 8-10, scale, shift sign  |

    Bits $3g \ldots 3g+2$ of ``qh[b]`` are bits 8-10 of the index of group $4b+g$, bits
    12-14 the scale $s_b$, bit 15 the sign of the shift.

    No signs: the grid's coordinates are $-1, 0, 1$ themselves, and the whole sub-block moves
    by $\delta_b = \pm$ ``IQ1S_DELTA`` ($-$ when bit 15 is set):

    $$w_{32b+8g+j} = d \cdot (2 s_b + 1) \cdot (G[q_{4b+g}]_j + \delta_b), \qquad
    G = \text{IQ1S\_GRID}$$

    Args:
        blocks: uint8 ``(..., 50)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(50, dtype=np.uint8)
        >>> block[0:2] = np.array([0.5], dtype="<f2").view(np.uint8)
        >>> block[34:36] = np.array([2 << 12 | 1], dtype="<u2").view(np.uint8)  # s=2; 1 << 8
        >>> IQ1S_GRID[256].tolist()             # group 0's point; d_0 = 0.5 * 5 = 2.5
        [-1, 0, 1, 0, 1, -1, 0, -1]
        >>> dequantize_iq1_s(block)[:8].tolist()    # 2.5 * (g + 0.125)
        [-2.1875, 0.3125, 2.8125, 0.3125, 2.8125, -2.1875, 0.3125, -2.1875]
    """
    lead = blocks.shape[:-1]
    d = _f16(blocks[..., 0:2])  # (..., 1)
    low = blocks[..., 2:34].reshape(*lead, 8, 4).astype(np.uint16)  # (..., 8, 4)
    qh = _u16(blocks[..., 34:50])  # (..., 8)
    high = (qh[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7  # (..., 8, 4)
    dl = d * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)  # (..., 8)
    delta = np.where(qh & 0x8000, -IQ1S_DELTA, IQ1S_DELTA)  # (..., 8)
    g = IQ1S_GRID[low | high << 8].astype(np.float32)  # (..., 8, 4, 8)
    w = dl[..., None, None] * (g + delta[..., None, None])  # (..., 8, 4, 8)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_iq1_s]


# --8<-- [start:iq1m_scale]
def iq1m_scale(scales: np.ndarray) -> np.ndarray:
    r"""IQ1_M's super-block scale: a float16 kept in the top nibbles of its 4 scale words.

    ``iq1m_scale_t`` (``ggml-common.h``:441): nibble $k$ of the float16 is bits 12-15 of
    ``scales[k]`` (``scale.u16 = (sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ...``).

    Args:
        scales: uint16 ``(..., 4)``, the ``scales`` field read as little-endian words.

    Returns:
        float32 ``(..., 1)``.

    Examples:
        >>> iq1m_scale(np.array([0x0fff, 0x0fff, 0x4fff, 0x3fff], dtype=np.uint16))  # 0x3400
        array([0.25], dtype=float32)
    """
    nibbles = scales >> 12  # (..., 4)
    u16 = nibbles[..., 0] | nibbles[..., 1] << 4 | nibbles[..., 2] << 8 | nibbles[..., 3] << 12
    return u16.astype("<u2")[..., None].view("<f2").astype(np.float32)  # (..., 1)


# --8<-- [end:iq1m_scale]


# --8<-- [start:dequantize_iq1_m]
def dequantize_iq1_m(blocks: np.ndarray) -> np.ndarray:
    r"""``dequantize_row_iq1_m``: IQ1_S's grid, scales per 16 and shifts per 8 (1.75 bits/weight).

    ``block_iq1_m`` (56 bytes, 256 weights; no separate ``d``):

    | byte offset | field    | type      | meaning                                       |
    |------------:|----------|-----------|-----------------------------------------------|
    | 0           | `qs`     | uint8[32] | group $k$: bits 0-7 of its grid index         |
    | 32          | `qh`     | uint8[16] | a nibble per group: index bits 8-10, shift sign |
    | 48          | `scales` | uint16[4] | 3-bit scales per 16 weights; the float16 $d$  |

    Group $k$'s nibble is nibble $k \bmod 2$ of ``qh[k // 2]``: bits 0-2 are bits 8-10 of
    its index, bit 3 the sign of its shift. Word $c$ of ``scales`` holds the 3-bit scales
    of the 16-weight halves $4c \ldots 4c+3$ at bits 0, 3, 6, 9, and in bits 12-15 nibble
    $c$ of the float16 $d$ ([`iq1m_scale`][]).

    $$w_{8k+j} = d \cdot (2 s_{\lfloor k/2 \rfloor} + 1) \cdot (G[q_k]_j + \delta_k), \qquad
    \delta_k = \pm\,\text{IQ1M\_DELTA}, \qquad G = \text{IQ1S\_GRID}$$

    Args:
        blocks: uint8 ``(..., 56)``.

    Returns:
        float32 ``(..., 256)``.

    Examples:
        >>> block = np.zeros(56, dtype=np.uint8)
        >>> block[53], block[55] = 0x40, 0x40   # d = 0x4400 = 4.0
        >>> block[32] = 0b1001_0000             # group 1: index 1 << 8, shift -1/8
        >>> block[48] = 0b010_000               # weights 16-31: s = 2, 4 * 5 = 20
        >>> w = dequantize_iq1_m(block)
        >>> IQ1S_GRID[0][0].item(), IQ1S_GRID[256][0].item(), IQ1S_GRID[256][4].item()
        (-1, -1, 1)
        >>> w[0].item(), w[8].item(), w[12].item(), w[16].item()   # 4(-1+1/8), 4(-1-1/8), ...
        (-3.5, -4.5, 3.5, -17.5)
    """
    lead = blocks.shape[:-1]
    low = blocks[..., 0:32].reshape(*lead, 8, 4).astype(np.uint16)  # (..., 8, 4)
    qh = _nibbles(blocks[..., 32:48]).reshape(*lead, 8, 4)  # (..., 8, 4): a nibble per group
    scales = _u16(blocks[..., 48:56])  # (..., 4)
    d = iq1m_scale(scales)  # (..., 1)
    s = (scales[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7  # (..., 4, 4)
    dl = d[..., None] * (2 * s + 1).astype(np.float32)  # (..., 4, 4): per 16 weights
    dl = np.repeat(dl.reshape(*lead, 8, 2), 2, axis=-1)  # (..., 8, 4): per group of 8
    delta = np.where(qh & 0x08, -IQ1M_DELTA, IQ1M_DELTA)  # (..., 8, 4)
    g = IQ1S_GRID[low | (qh & 7).astype(np.uint16) << 8].astype(np.float32)  # (..., 8, 4, 8)
    w = dl[..., None] * (g + delta[..., None])  # (..., 8, 4, 8)
    return w.reshape(*lead, QK_K)  # (..., 256)


# --8<-- [end:dequantize_iq1_m]


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

# --8<-- [start:IQ_DEQUANTIZERS]
T = GGMLQuantizationType

#: type -> (dequantize function, bytes per block of 256 weights); sizes as the static_asserts
#: of ggml-common.h spell them
IQ_DEQUANTIZERS: dict[GGMLQuantizationType, tuple[Callable[[np.ndarray], np.ndarray], int]] = {
    T.IQ2_XXS: (dequantize_iq2_xxs, F16_SIZE + QK_K // 8 * 2),
    T.IQ2_XS: (dequantize_iq2_xs, F16_SIZE + QK_K // 8 * 2 + QK_K // 32),
    T.IQ2_S: (dequantize_iq2_s, F16_SIZE + QK_K // 4 + QK_K // 16),
    T.IQ3_XXS: (dequantize_iq3_xxs, F16_SIZE + 3 * (QK_K // 8)),
    T.IQ3_S: (dequantize_iq3_s, F16_SIZE + 13 * (QK_K // 32) + QK_K // 64),
    T.IQ1_S: (dequantize_iq1_s, F16_SIZE + QK_K // 8 + QK_K // 16),
    T.IQ1_M: (dequantize_iq1_m, QK_K // 8 + QK_K // 16 + QK_K // 32),
}
# --8<-- [end:IQ_DEQUANTIZERS]


# ---------------------------------------------------------------------------------------------
# The grids' data: ggml's packed points, copied from ggml/src/ggml-quants.c
# ---------------------------------------------------------------------------------------------
# Each entry is one grid point: coordinate i is bits (2i, 2i+1) (the 2-bit tables) or
# (3i ... 3i+2) (the 3-bit ones) of the number, a level number l. The tables are sorted, as in
# ggml; gguf-py stores the same numbers as hex text (``grid_hex`` in gguf/quants.py).

# fmt: off
# ggml/src/ggml-quants.c:2859, ``kgrid_2bit_256`` (256 points)
_KGRID_2BIT_256 = (
        0,     2,     5,     8,    10,    17,    20,    32,    34,    40,    42,    65,
       68,    80,    88,    97,   100,   128,   130,   138,   162,   257,   260,   272,
      277,   320,   388,   408,   512,   514,   546,   642,  1025,  1028,  1040,  1057,
     1060,  1088,  1090,  1096,  1120,  1153,  1156,  1168,  1188,  1280,  1282,  1288,
     1312,  1350,  1385,  1408,  1425,  1545,  1552,  1600,  1668,  1700,  2048,  2053,
     2056,  2068,  2088,  2113,  2116,  2128,  2130,  2184,  2308,  2368,  2562,  2580,
     4097,  4100,  4112,  4129,  4160,  4192,  4228,  4240,  4245,  4352,  4360,  4384,
     4432,  4442,  4480,  4644,  4677,  5120,  5128,  5152,  5157,  5193,  5248,  5400,
     5474,  5632,  5654,  6145,  6148,  6160,  6208,  6273,  6400,  6405,  6560,  6737,
     8192,  8194,  8202,  8260,  8289,  8320,  8322,  8489,  8520,  8704,  8706,  9217,
     9220,  9232,  9280,  9302,  9472,  9537,  9572,  9872, 10248, 10272, 10388, 10820,
    16385, 16388, 16400, 16408, 16417, 16420, 16448, 16456, 16470, 16480, 16513, 16516,
    16528, 16640, 16672, 16737, 16768, 16773, 16897, 16912, 16968, 16982, 17000, 17408,
    17416, 17440, 17536, 17561, 17682, 17700, 17920, 18433, 18436, 18448, 18496, 18501,
    18688, 18776, 18785, 18818, 19013, 19088, 20480, 20488, 20497, 20505, 20512, 20608,
    20616, 20740, 20802, 20900, 21137, 21648, 21650, 21770, 22017, 22100, 22528, 22545,
    22553, 22628, 22848, 23048, 24580, 24592, 24640, 24680, 24832, 24917, 25112, 25184,
    25600, 25605, 25872, 25874, 25988, 26690, 32768, 32770, 32778, 32833, 32898, 33028,
    33048, 33088, 33297, 33793, 33796, 33808, 33813, 33856, 33888, 34048, 34118, 34196,
    34313, 34368, 34400, 34818, 35076, 35345, 36868, 36880, 36900, 36928, 37025, 37142,
    37248, 37445, 37888, 37922, 37956, 38225, 39041, 39200, 40962, 41040, 41093, 41225,
    41472, 42008, 43088, 43268,
)

# ggml/src/ggml-quants.c:2877, ``kgrid_2bit_512`` (512 points)
_KGRID_2BIT_512 = (
        0,     2,     5,     8,    10,    17,    20,    22,    25,    32,    34,    37,
       40,    65,    68,    70,    73,    80,    82,    85,    88,    97,   100,   128,
      130,   133,   136,   145,   148,   153,   160,   257,   260,   262,   265,   272,
      274,   277,   280,   282,   289,   292,   320,   322,   325,   328,   337,   340,
      352,   360,   385,   388,   400,   512,   514,   517,   520,   529,   532,   544,
      577,   580,   592,   597,   640,   650,  1025,  1028,  1030,  1033,  1040,  1042,
     1045,  1048,  1057,  1060,  1088,  1090,  1093,  1096,  1105,  1108,  1110,  1120,
     1153,  1156,  1168,  1280,  1282,  1285,  1288,  1297,  1300,  1312,  1345,  1348,
     1360,  1377,  1408,  1537,  1540,  1552,  1574,  1600,  1602,  1668,  2048,  2050,
     2053,  2056,  2058,  2065,  2068,  2080,  2085,  2113,  2116,  2128,  2136,  2176,
     2208,  2218,  2305,  2308,  2320,  2368,  2433,  2441,  2560,  2592,  2600,  2710,
     2720,  4097,  4100,  4102,  4105,  4112,  4114,  4117,  4120,  4129,  4132,  4160,
     4162,  4165,  4168,  4177,  4180,  4192,  4202,  4225,  4228,  4240,  4352,  4354,
     4357,  4360,  4369,  4372,  4384,  4417,  4420,  4432,  4480,  4500,  4502,  4609,
     4612,  4614,  4624,  4672,  4704,  5120,  5122,  5125,  5128,  5137,  5140,  5152,
     5185,  5188,  5193,  5200,  5220,  5248,  5377,  5380,  5392,  5440,  5632,  5652,
     5705,  6145,  6148,  6160,  6162,  6208,  6228,  6278,  6400,  6405,  6502,  6737,
     6825,  8192,  8194,  8197,  8200,  8202,  8209,  8212,  8224,  8257,  8260,  8272,
     8320,  8352,  8449,  8452,  8464,  8512,  8520,  8549,  8704,  8738,  8832,  8872,
     9217,  9220,  9232,  9257,  9280,  9472,  9537,  9554,  9625,  9729,  9754,  9894,
    10240, 10248, 10250, 10272, 10325, 10376, 10402, 10600, 10640, 10760, 10784, 10882,
    10888, 10890, 16385, 16388, 16390, 16393, 16400, 16402, 16405, 16408, 16417, 16420,
    16448, 16450, 16453, 16456, 16458, 16465, 16468, 16480, 16485, 16513, 16516, 16528,
    16640, 16642, 16645, 16648, 16657, 16660, 16672, 16705, 16708, 16720, 16768, 16773,
    16802, 16897, 16900, 16912, 16914, 16937, 16960, 17408, 17410, 17413, 17416, 17425,
    17428, 17433, 17440, 17473, 17476, 17488, 17536, 17556, 17665, 17668, 17680, 17700,
    17728, 17818, 17920, 17930, 17988, 18000, 18433, 18436, 18448, 18496, 18501, 18516,
    18530, 18688, 18705, 18756, 18768, 18793, 18948, 20480, 20482, 20485, 20488, 20497,
    20500, 20512, 20520, 20545, 20548, 20560, 20608, 20737, 20740, 20752, 20757, 20800,
    20802, 20992, 21060, 21162, 21505, 21508, 21520, 21537, 21568, 21600, 21633, 21665,
    21760, 21768, 21888, 21896, 22049, 22120, 22177, 22528, 22548, 22593, 22608, 22681,
    22810, 22848, 22850, 23173, 24577, 24580, 24592, 24640, 24660, 24674, 24710, 24745,
    24832, 25124, 25162, 25234, 25600, 25622, 25872, 25920, 25925, 26020, 26625, 26730,
    26917, 27142, 27220, 27234, 32768, 32770, 32773, 32776, 32785, 32788, 32800, 32810,
    32833, 32836, 32848, 32896, 32898, 32936, 32938, 33025, 33028, 33030, 33040, 33088,
    33105, 33113, 33280, 33312, 33408, 33410, 33440, 33448, 33793, 33796, 33808, 33810,
    33813, 33856, 33888, 33929, 34048, 34116, 34213, 34328, 34410, 34816, 34824, 34853,
    34906, 34944, 34946, 34984, 35078, 35362, 35456, 35464, 35478, 35496, 36865, 36868,
    36880, 36928, 36950, 36996, 37120, 37154, 37220, 37462, 37513, 37888, 37893, 37956,
    37968, 37976, 38185, 38288, 38290, 38465, 38993, 39078, 39241, 39445, 39520, 40960,
    40962, 40968, 40970, 40992, 41002, 41120, 41297, 41305, 41382, 41472, 41474, 41480,
    41514, 41600, 41632, 42048, 42133, 42597, 42648, 43018, 43040, 43042, 43048, 43168,
    43176, 43268, 43396, 43398, 43560, 43562, 43665, 43690,
)

# ggml/src/ggml-quants.c:3041, ``kgrid_2bit_1024`` (1024 points)
_KGRID_2BIT_1024 = (
        0,     2,     5,     8,    10,    17,    20,    22,    25,    32,    34,    37,
       40,    65,    68,    70,    73,    80,    82,    85,    88,    97,   100,   102,
      105,   128,   130,   133,   136,   145,   148,   160,   165,   170,   257,   260,
      262,   265,   272,   274,   277,   280,   289,   292,   320,   322,   325,   328,
      337,   340,   342,   345,   352,   357,   360,   385,   388,   400,   402,   405,
      417,   420,   512,   514,   517,   520,   529,   532,   544,   554,   577,   580,
      582,   585,   592,   597,   640,   645,   650,   660,   674,  1025,  1028,  1030,
     1033,  1040,  1042,  1045,  1048,  1057,  1060,  1062,  1065,  1088,  1090,  1093,
     1096,  1098,  1105,  1108,  1110,  1113,  1120,  1122,  1125,  1153,  1156,  1158,
     1161,  1168,  1173,  1176,  1185,  1188,  1280,  1282,  1285,  1288,  1290,  1297,
     1300,  1302,  1305,  1312,  1317,  1320,  1345,  1348,  1350,  1353,  1360,  1362,
     1365,  1368,  1377,  1380,  1408,  1410,  1413,  1416,  1425,  1428,  1440,  1537,
     1540,  1542,  1545,  1552,  1557,  1600,  1605,  1608,  1617,  1620,  1632,  1665,
     1668,  1680,  2048,  2050,  2053,  2056,  2065,  2068,  2070,  2073,  2080,  2085,
     2090,  2113,  2116,  2118,  2121,  2128,  2130,  2133,  2136,  2145,  2148,  2176,
     2181,  2196,  2218,  2305,  2308,  2320,  2322,  2325,  2328,  2337,  2368,  2373,
     2376,  2385,  2388,  2400,  2433,  2448,  2560,  2577,  2580,  2594,  2600,  2602,
     2640,  2713,  4097,  4100,  4102,  4105,  4112,  4114,  4117,  4120,  4129,  4132,
     4134,  4160,  4162,  4165,  4168,  4177,  4180,  4182,  4185,  4192,  4194,  4197,
     4200,  4225,  4228,  4230,  4240,  4245,  4248,  4257,  4260,  4352,  4354,  4357,
     4360,  4362,  4369,  4372,  4374,  4377,  4384,  4386,  4389,  4392,  4417,  4420,
     4422,  4425,  4432,  4434,  4437,  4440,  4449,  4452,  4480,  4482,  4485,  4488,
     4497,  4500,  4609,  4612,  4617,  4624,  4629,  4641,  4644,  4672,  4677,  4689,
     4692,  4737,  4740,  4752,  5120,  5122,  5125,  5128,  5137,  5140,  5142,  5145,
     5152,  5157,  5160,  5185,  5188,  5190,  5193,  5200,  5202,  5205,  5208,  5217,
     5220,  5248,  5250,  5253,  5256,  5265,  5268,  5280,  5377,  5380,  5382,  5385,
     5392,  5394,  5397,  5400,  5409,  5412,  5440,  5442,  5445,  5448,  5457,  5460,
     5472,  5505,  5508,  5520,  5632,  5637,  5640,  5649,  5652,  5664,  5697,  5700,
     5712,  5760,  5802,  6145,  6148,  6150,  6153,  6160,  6165,  6168,  6177,  6208,
     6210,  6213,  6216,  6225,  6228,  6240,  6273,  6276,  6400,  6402,  6405,  6408,
     6417,  6420,  6432,  6465,  6468,  6480,  6505,  6562,  6660,  6672,  6720,  6742,
     8192,  8194,  8197,  8200,  8209,  8212,  8214,  8217,  8224,  8229,  8234,  8257,
     8260,  8272,  8274,  8277,  8292,  8320,  8330,  8340,  8362,  8449,  8452,  8464,
     8466,  8469,  8481,  8512,  8514,  8517,  8529,  8532,  8544,  8577,  8580,  8592,
     8704,  8714,  8738,  8744,  8746,  8772,  8784,  8840,  8842,  8872,  9217,  9220,
     9222,  9225,  9232,  9237,  9240,  9249,  9252,  9280,  9282,  9285,  9288,  9297,
     9300,  9312,  9345,  9348,  9360,  9472,  9477,  9480,  9489,  9492,  9504,  9537,
     9540,  9552,  9574,  9600,  9729,  9732,  9744,  9792,  9817, 10240, 10245, 10257,
    10260, 10305, 10308, 10320, 10378, 10410, 10497, 10500, 10512, 10645, 10762, 10786,
    10852, 10888, 10890, 16385, 16388, 16390, 16393, 16400, 16402, 16405, 16408, 16410,
    16417, 16420, 16422, 16448, 16450, 16453, 16456, 16458, 16465, 16468, 16470, 16473,
    16480, 16482, 16485, 16513, 16516, 16528, 16533, 16536, 16545, 16548, 16640, 16642,
    16645, 16648, 16657, 16660, 16662, 16665, 16672, 16674, 16677, 16705, 16708, 16710,
    16713, 16720, 16722, 16725, 16728, 16737, 16740, 16768, 16770, 16773, 16776, 16785,
    16788, 16800, 16897, 16900, 16912, 16914, 16917, 16920, 16932, 16960, 16965, 16968,
    16977, 16980, 16992, 17025, 17028, 17408, 17410, 17413, 17416, 17418, 17425, 17428,
    17430, 17433, 17440, 17442, 17445, 17448, 17473, 17476, 17478, 17481, 17488, 17490,
    17493, 17496, 17505, 17508, 17536, 17538, 17541, 17544, 17553, 17556, 17568, 17665,
    17668, 17670, 17673, 17680, 17682, 17685, 17688, 17697, 17700, 17728, 17730, 17733,
    17736, 17745, 17748, 17760, 17770, 17793, 17796, 17808, 17920, 17922, 17925, 17928,
    17937, 17940, 17952, 17985, 17988, 18000, 18048, 18085, 18433, 18436, 18441, 18448,
    18450, 18453, 18456, 18465, 18468, 18496, 18498, 18501, 18504, 18513, 18516, 18528,
    18564, 18576, 18688, 18690, 18693, 18696, 18705, 18708, 18720, 18753, 18756, 18768,
    18816, 18838, 18945, 18948, 18960, 19008, 20480, 20482, 20485, 20488, 20497, 20500,
    20502, 20505, 20512, 20514, 20517, 20520, 20545, 20548, 20550, 20553, 20560, 20562,
    20565, 20568, 20577, 20580, 20608, 20610, 20613, 20616, 20625, 20628, 20737, 20740,
    20742, 20745, 20752, 20754, 20757, 20760, 20769, 20772, 20800, 20802, 20805, 20808,
    20817, 20820, 20832, 20865, 20868, 20880, 20992, 20997, 21000, 21009, 21012, 21024,
    21057, 21060, 21072, 21097, 21120, 21505, 21508, 21510, 21513, 21520, 21522, 21525,
    21528, 21537, 21540, 21568, 21570, 21573, 21576, 21585, 21588, 21600, 21633, 21636,
    21648, 21760, 21762, 21765, 21768, 21777, 21780, 21792, 21825, 21828, 21840, 21888,
    22017, 22020, 22032, 22054, 22080, 22528, 22530, 22533, 22536, 22545, 22548, 22560,
    22593, 22596, 22608, 22618, 22656, 22785, 22788, 22800, 22848, 23040, 23065, 23173,
    23208, 24577, 24580, 24582, 24592, 24594, 24597, 24600, 24609, 24612, 24640, 24645,
    24648, 24657, 24660, 24672, 24708, 24720, 24832, 24834, 24837, 24840, 24849, 24852,
    24864, 24897, 24900, 24912, 24960, 24985, 25092, 25104, 25152, 25174, 25249, 25600,
    25605, 25608, 25617, 25620, 25632, 25665, 25668, 25680, 25728, 25857, 25860, 25872,
    25920, 25930, 25960, 26002, 26112, 26260, 26625, 26628, 26640, 26725, 26776, 26880,
    26922, 27202, 27297, 32768, 32770, 32773, 32776, 32785, 32788, 32793, 32800, 32805,
    32833, 32836, 32848, 32850, 32853, 32856, 32865, 32896, 32901, 32913, 32916, 33025,
    33028, 33033, 33040, 33042, 33045, 33048, 33057, 33060, 33088, 33090, 33093, 33096,
    33105, 33108, 33153, 33156, 33168, 33193, 33280, 33285, 33290, 33297, 33300, 33345,
    33348, 33360, 33793, 33796, 33798, 33801, 33808, 33810, 33813, 33816, 33825, 33856,
    33858, 33861, 33864, 33873, 33876, 33888, 33921, 33924, 33936, 34048, 34050, 34053,
    34056, 34065, 34068, 34080, 34113, 34116, 34128, 34176, 34186, 34305, 34308, 34320,
    34345, 34368, 34816, 34821, 34833, 34836, 34881, 34884, 34896, 34978, 35073, 35076,
    35136, 35173, 35362, 35416, 35418, 35458, 35490, 36865, 36868, 36873, 36880, 36882,
    36885, 36888, 36900, 36928, 36930, 36933, 36936, 36945, 36948, 36960, 36993, 36996,
    37008, 37120, 37125, 37137, 37140, 37185, 37188, 37200, 37210, 37377, 37380, 37392,
    37440, 37542, 37888, 37890, 37893, 37896, 37905, 37908, 37920, 37953, 37956, 37968,
    38016, 38038, 38145, 38148, 38160, 38208, 38296, 38305, 38400, 38470, 38500, 38913,
    38916, 38928, 38950, 38976, 39081, 39168, 39241, 39250, 39568, 40960, 40965, 40970,
    40980, 40994, 41002, 41025, 41028, 41040, 41122, 41130, 41280, 41317, 41474, 41482,
    41506, 41512, 41514, 41602, 41608, 41610, 41640, 41985, 41988, 42000, 42048, 42121,
    42148, 42240, 42265, 42577, 43018, 43048, 43170, 43348, 43398, 43528, 43530, 43552,
    43554, 43560, 43656, 43690,
)

# ggml/src/ggml-quants.c:3708, ``kgrid_256`` (256 points)
_KGRID_256 = (
        0,     2,     4,     9,    11,    15,    16,    18,    25,    34,    59,    61,
       65,    67,    72,    74,    81,    85,    88,    90,    97,   108,   120,   128,
      130,   132,   137,   144,   146,   153,   155,   159,   169,   175,   189,   193,
      199,   200,   202,   213,   248,   267,   287,   292,   303,   315,   317,   321,
      327,   346,   362,   413,   436,   456,   460,   462,   483,   497,   513,   515,
      520,   522,   529,   531,   536,   538,   540,   551,   552,   576,   578,   585,
      592,   594,   641,   643,   648,   650,   657,   664,   698,   704,   706,   720,
      729,   742,   758,   769,   773,   808,   848,   852,   870,   889,   901,   978,
      992,  1024,  1026,  1033,  1035,  1040,  1042,  1046,  1049,  1058,  1089,  1091,
     1093,  1096,  1098,  1105,  1112,  1139,  1143,  1144,  1152,  1154,  1161,  1167,
     1168,  1170,  1183,  1184,  1197,  1217,  1224,  1228,  1272,  1276,  1309,  1323,
     1347,  1367,  1377,  1404,  1473,  1475,  1486,  1509,  1537,  1544,  1546,  1553,
     1555,  1576,  1589,  1594,  1600,  1602,  1616,  1625,  1636,  1638,  1665,  1667,
     1672,  1685,  1706,  1722,  1737,  1755,  1816,  1831,  1850,  1856,  1862,  1874,
     1901,  1932,  1950,  1971,  2011,  2032,  2052,  2063,  2077,  2079,  2091,  2095,
     2172,  2192,  2207,  2208,  2224,  2230,  2247,  2277,  2308,  2345,  2356,  2389,
     2403,  2424,  2501,  2504,  2506,  2520,  2570,  2593,  2616,  2624,  2630,  2646,
     2669,  2700,  2714,  2746,  2754,  2795,  2824,  2835,  2839,  2874,  2882,  2905,
     2984,  3028,  3042,  3092,  3108,  3110,  3124,  3153,  3185,  3215,  3252,  3288,
     3294,  3364,  3397,  3434,  3483,  3523,  3537,  3587,  3589,  3591,  3592,  3610,
     3626,  3670,  3680,  3722,  3749,  3754,  3776,  3789,  3803,  3824,  3857,  3873,
     3904,  3906,  3924,  3992,
)

# ggml/src/ggml-quants.c:3726, ``kgrid_512`` (512 points)
_KGRID_512 = (
        0,     1,     2,     5,     7,     8,     9,    10,    12,    14,    16,    17,
       21,    27,    32,    34,    37,    39,    41,    43,    48,    50,    57,    60,
       63,    64,    65,    66,    68,    72,    73,    77,    80,    83,    87,    89,
       93,   100,   113,   117,   122,   128,   129,   133,   135,   136,   139,   142,
      145,   149,   152,   156,   162,   165,   167,   169,   171,   184,   187,   195,
      201,   205,   208,   210,   217,   219,   222,   228,   232,   234,   247,   249,
      253,   256,   267,   271,   273,   276,   282,   288,   291,   297,   312,   322,
      324,   336,   338,   342,   347,   353,   357,   359,   374,   379,   390,   393,
      395,   409,   426,   441,   448,   450,   452,   464,   466,   470,   475,   488,
      492,   512,   513,   514,   516,   520,   521,   523,   525,   527,   528,   530,
      537,   540,   542,   556,   558,   561,   570,   576,   577,   579,   582,   584,
      588,   593,   600,   603,   609,   616,   618,   632,   638,   640,   650,   653,
      655,   656,   660,   666,   672,   675,   685,   688,   698,   705,   708,   711,
      712,   715,   721,   727,   728,   732,   737,   754,   760,   771,   773,   778,
      780,   793,   795,   802,   806,   808,   812,   833,   840,   843,   849,   856,
      858,   873,   912,   916,   919,   932,   934,   961,   963,   968,   970,   977,
      989,   993,  1010,  1016,  1024,  1025,  1027,  1029,  1031,  1032,  1034,  1036,
     1038,  1041,  1043,  1047,  1048,  1050,  1057,  1059,  1061,  1064,  1066,  1079,
     1080,  1083,  1085,  1088,  1090,  1096,  1099,  1103,  1106,  1109,  1113,  1116,
     1122,  1129,  1153,  1156,  1159,  1169,  1171,  1176,  1183,  1185,  1195,  1199,
     1209,  1212,  1216,  1218,  1221,  1225,  1234,  1236,  1241,  1243,  1250,  1256,
     1270,  1281,  1287,  1296,  1299,  1306,  1309,  1313,  1338,  1341,  1348,  1353,
     1362,  1375,  1376,  1387,  1400,  1408,  1410,  1415,  1425,  1453,  1457,  1477,
     1481,  1494,  1496,  1507,  1512,  1538,  1545,  1547,  1549,  1551,  1554,  1561,
     1563,  1565,  1570,  1572,  1575,  1577,  1587,  1593,  1601,  1603,  1605,  1612,
     1617,  1619,  1632,  1648,  1658,  1662,  1664,  1674,  1680,  1690,  1692,  1704,
     1729,  1736,  1740,  1745,  1747,  1751,  1752,  1761,  1763,  1767,  1773,  1787,
     1795,  1801,  1806,  1810,  1817,  1834,  1840,  1844,  1857,  1864,  1866,  1877,
     1882,  1892,  1902,  1915,  1934,  1953,  1985,  1987,  2000,  2002,  2013,  2048,
     2052,  2058,  2064,  2068,  2071,  2074,  2081,  2088,  2104,  2114,  2119,  2121,
     2123,  2130,  2136,  2141,  2147,  2153,  2157,  2177,  2179,  2184,  2189,  2193,
     2203,  2208,  2223,  2226,  2232,  2244,  2249,  2251,  2256,  2258,  2265,  2269,
     2304,  2306,  2324,  2335,  2336,  2361,  2373,  2375,  2385,  2418,  2443,  2460,
     2480,  2504,  2509,  2520,  2531,  2537,  2562,  2568,  2572,  2578,  2592,  2596,
     2599,  2602,  2614,  2620,  2625,  2627,  2629,  2634,  2641,  2650,  2682,  2688,
     2697,  2707,  2712,  2718,  2731,  2754,  2759,  2760,  2775,  2788,  2793,  2805,
     2811,  2817,  2820,  2832,  2842,  2854,  2890,  2902,  2921,  2923,  2978,  3010,
     3012,  3026,  3081,  3083,  3085,  3097,  3099,  3120,  3136,  3152,  3159,  3188,
     3210,  3228,  3234,  3245,  3250,  3256,  3264,  3276,  3281,  3296,  3349,  3363,
     3378,  3392,  3395,  3420,  3440,  3461,  3488,  3529,  3531,  3584,  3588,  3591,
     3600,  3602,  3614,  3616,  3628,  3634,  3650,  3657,  3668,  3683,  3685,  3713,
     3716,  3720,  3726,  3729,  3736,  3753,  3778,  3802,  3805,  3819,  3841,  3845,
     3851,  3856,  3880,  3922,  3938,  3970,  3993,  4032,
)

# ggml/src/ggml-quants.c:2911, ``kgrid_1bit_2048`` (2048 points)
_KGRID_1BIT_2048 = (
        0,     2,     5,     8,    10,    17,    21,    32,    34,    40,    42,    69,
       81,    84,    86,   101,   128,   130,   136,   138,   149,   160,   162,   168,
      170,   260,   261,   273,   276,   278,   281,   282,   293,   321,   326,   329,
      338,   341,   346,   353,   356,   358,   360,   389,   401,   404,   406,   421,
      512,   514,   520,   522,   533,   544,   546,   552,   554,   581,   593,   601,
      612,   617,   640,   642,   648,   650,   657,   661,   665,   672,   674,   680,
      682,  1041,  1044,  1046,  1061,  1089,  1097,  1109,  1114,  1124,  1125,  1169,
     1177,  1189,  1281,  1284,  1285,  1286,  1301,  1304,  1306,  1321,  1344,  1349,
     1354,  1360,  1361,  1364,  1365,  1366,  1369,  1376,  1378,  1381,  1384,  1386,
     1409,  1425,  1429,  1432,  1434,  1441,  1444,  1445,  1446,  1449,  1556,  1561,
     1601,  1604,  1616,  1618,  1621,  1624,  1632,  1633,  1638,  1641,  1669,  1681,
     1684,  1689,  2048,  2050,  2056,  2058,  2069,  2080,  2082,  2088,  2090,  2117,
     2129,  2134,  2149,  2176,  2178,  2184,  2186,  2197,  2208,  2210,  2216,  2218,
     2309,  2321,  2324,  2329,  2340,  2341,  2369,  2384,  2385,  2389,  2401,  2404,
     2409,  2449,  2452,  2454,  2457,  2469,  2560,  2562,  2568,  2570,  2581,  2592,
     2594,  2600,  2602,  2629,  2641,  2649,  2657,  2661,  2688,  2690,  2693,  2696,
     2698,  2709,  2720,  2722,  2728,  2730,  4112,  4113,  4116,  4121,  4132,  4133,
     4161,  4164,  4176,  4181,  4184,  4193,  4196,  4197,  4201,  4241,  4244,  4246,
     4257,  4261,  4353,  4356,  4358,  4361,  4368,  4370,  4373,  4376,  4385,  4388,
     4393,  4421,  4426,  4432,  4433,  4434,  4436,  4437,  4438,  4441,  4448,  4453,
     4484,  4498,  4501,  4513,  4516,  4625,  4628,  4630,  4645,  4672,  4678,  4681,
     4690,  4693,  4696,  4698,  4708,  4710,  4741,  4753,  4756,  4758,  4773,  5121,
     5126,  5129,  5140,  5141,  5144,  5145,  5153,  5158,  5185,  5189,  5190,  5192,
     5194,  5201,  5204,  5205,  5206,  5209,  5218,  5221,  5224,  5252,  5257,  5264,
     5268,  5269,  5272,  5273,  5274,  5281,  5284,  5285,  5289,  5378,  5381,  5386,
     5393,  5396,  5397,  5398,  5401,  5408,  5410,  5413,  5416,  5418,  5441,  5444,
     5445,  5446,  5457,  5458,  5460,  5461,  5462,  5465,  5466,  5473,  5476,  5477,
     5478,  5481,  5504,  5506,  5508,  5509,  5512,  5514,  5520,  5521,  5524,  5525,
     5526,  5529,  5530,  5536,  5538,  5541,  5633,  5636,  5637,  5638,  5653,  5654,
     5656,  5658,  5665,  5670,  5696,  5698,  5700,  5701,  5704,  5706,  5713,  5717,
     5718,  5720,  5721,  5729,  5732,  5733,  5736,  5737,  5738,  5766,  5770,  5778,
     5781,  5796,  5801,  6161,  6166,  6181,  6209,  6212,  6214,  6217,  6224,  6229,
     6232,  6234,  6240,  6241,  6244,  6246,  6249,  6277,  6289,  6292,  6309,  6416,
     6418,  6421,  6426,  6433,  6437,  6466,  6468,  6469,  6472,  6481,  6484,  6485,
     6486,  6489,  6490,  6496,  6501,  6506,  6537,  6545,  6546,  6549,  6552,  6561,
     6566,  6569,  6665,  6678,  6692,  6694,  6724,  6726,  6729,  6736,  6738,  6741,
     6744,  6753,  6758,  6761,  6789,  6801,  6806,  6810,  8192,  8194,  8200,  8202,
     8213,  8224,  8226,  8229,  8232,  8234,  8261,  8273,  8281,  8289,  8293,  8320,
     8322,  8328,  8330,  8341,  8352,  8354,  8357,  8360,  8362,  8453,  8465,  8468,
     8473,  8485,  8514,  8516,  8521,  8533,  8536,  8538,  8545,  8548,  8549,  8550,
     8581,  8592,  8598,  8601,  8613,  8705,  8712,  8714,  8721,  8725,  8736,  8738,
     8744,  8746,  8773,  8785,  8790,  8793,  8805,  8833,  8840,  8842,  8849,  8853,
     8864,  8866,  8872,  8874,  9221,  9236,  9238,  9241,  9253,  9284,  9285,  9286,
     9289,  9298,  9301,  9304,  9306,  9318,  9349,  9361,  9364,  9369,  9377,  9381,
     9481,  9493,  9505,  9513,  9536,  9541,  9544,  9553,  9556,  9557,  9561,  9570,
     9573,  9576,  9609,  9616,  9620,  9621,  9624,  9626,  9633,  9636,  9638,  9641,
     9733,  9744,  9746,  9753,  9765,  9793,  9801,  9813,  9824,  9825,  9833,  9860,
     9862,  9872,  9882, 10240, 10242, 10248, 10250, 10261, 10272, 10274, 10280, 10282,
    10309, 10321, 10324, 10341, 10368, 10370, 10376, 10378, 10400, 10402, 10408, 10410,
    10505, 10513, 10516, 10521, 10533, 10566, 10569, 10578, 10581, 10593, 10596, 10598,
    10601, 10629, 10640, 10646, 10649, 10660, 10661, 10752, 10754, 10760, 10762, 10784,
    10786, 10792, 10794, 10821, 10833, 10838, 10841, 10853, 10880, 10882, 10888, 10890,
    10901, 10912, 10914, 10920, 10922, 16389, 16401, 16406, 16421, 16457, 16466, 16469,
    16472, 16474, 16481, 16484, 16486, 16532, 16537, 16545, 16550, 16640, 16641, 16644,
    16646, 16649, 16658, 16661, 16662, 16664, 16666, 16673, 16678, 16681, 16709, 16712,
    16714, 16721, 16724, 16725, 16726, 16729, 16730, 16741, 16744, 16746, 16769, 16772,
    16774, 16784, 16786, 16789, 16800, 16801, 16802, 16901, 16913, 16916, 16918, 16933,
    16961, 16978, 16981, 16986, 16996, 17001, 17033, 17044, 17061, 17409, 17429, 17433,
    17449, 17477, 17480, 17482, 17489, 17492, 17493, 17494, 17505, 17506, 17509, 17512,
    17514, 17537, 17542, 17545, 17552, 17554, 17557, 17568, 17569, 17577, 17665, 17666,
    17669, 17674, 17681, 17684, 17685, 17686, 17689, 17696, 17701, 17706, 17729, 17732,
    17733, 17734, 17737, 17744, 17745, 17748, 17749, 17750, 17752, 17753, 17761, 17764,
    17765, 17766, 17769, 17794, 17796, 17797, 17800, 17809, 17812, 17813, 17814, 17817,
    17818, 17829, 17832, 17834, 17921, 17925, 17929, 17940, 17941, 17944, 17946, 17953,
    17956, 17961, 17984, 17986, 17989, 17992, 18000, 18001, 18002, 18005, 18006, 18009,
    18018, 18021, 18024, 18049, 18053, 18058, 18068, 18069, 18081, 18084, 18086, 18437,
    18449, 18453, 18458, 18469, 18498, 18505, 18512, 18517, 18520, 18529, 18532, 18534,
    18537, 18565, 18577, 18580, 18582, 18585, 18597, 18689, 18693, 18694, 18698, 18704,
    18708, 18709, 18712, 18721, 18724, 18726, 18752, 18757, 18762, 18769, 18770, 18772,
    18773, 18774, 18777, 18784, 18786, 18789, 18790, 18794, 18822, 18825, 18834, 18837,
    18838, 18840, 18849, 18852, 18854, 18857, 18966, 19012, 19014, 19017, 19029, 19032,
    19034, 19044, 19049, 19092, 19109, 20481, 20484, 20485, 20486, 20489, 20498, 20501,
    20506, 20513, 20516, 20521, 20544, 20549, 20552, 20561, 20564, 20565, 20566, 20569,
    20581, 20584, 20614, 20617, 20629, 20632, 20640, 20641, 20646, 20649, 20741, 20744,
    20745, 20746, 20753, 20756, 20757, 20758, 20760, 20761, 20768, 20773, 20774, 20776,
    20778, 20801, 20804, 20805, 20806, 20809, 20816, 20817, 20818, 20820, 20821, 20822,
    20824, 20825, 20826, 20833, 20836, 20837, 20838, 20841, 20866, 20869, 20881, 20884,
    20885, 20886, 20889, 20896, 20901, 20906, 20993, 20998, 21010, 21013, 21018, 21025,
    21028, 21058, 21061, 21066, 21073, 21076, 21077, 21078, 21081, 21090, 21093, 21125,
    21136, 21138, 21141, 21145, 21146, 21156, 21508, 21509, 21521, 21524, 21525, 21526,
    21528, 21529, 21537, 21541, 21544, 21546, 21569, 21572, 21573, 21574, 21577, 21578,
    21584, 21585, 21588, 21589, 21590, 21592, 21593, 21594, 21601, 21602, 21604, 21605,
    21606, 21609, 21632, 21640, 21642, 21649, 21652, 21653, 21654, 21657, 21665, 21668,
    21669, 21674, 21761, 21762, 21764, 21765, 21766, 21769, 21776, 21777, 21778, 21780,
    21781, 21782, 21785, 21786, 21793, 21796, 21797, 21798, 21801, 21824, 21825, 21826,
    21828, 21829, 21830, 21832, 21833, 21840, 21841, 21842, 21844, 21845, 21846, 21848,
    21849, 21850, 21856, 21857, 21860, 21861, 21862, 21864, 21865, 21866, 21889, 21892,
    21893, 21897, 21898, 21904, 21905, 21908, 21909, 21910, 21912, 21913, 21921, 21924,
    21925, 21926, 21929, 22016, 22017, 22018, 22020, 22022, 22024, 22025, 22033, 22036,
    22037, 22040, 22041, 22048, 22049, 22050, 22052, 22053, 22054, 22056, 22057, 22081,
    22085, 22086, 22088, 22089, 22090, 22096, 22097, 22098, 22100, 22101, 22102, 22104,
    22105, 22106, 22113, 22116, 22117, 22121, 22146, 22149, 22150, 22152, 22153, 22154,
    22161, 22165, 22170, 22178, 22181, 22182, 22184, 22185, 22532, 22533, 22534, 22537,
    22544, 22549, 22552, 22561, 22570, 22597, 22600, 22602, 22609, 22612, 22613, 22614,
    22616, 22617, 22624, 22626, 22628, 22629, 22658, 22665, 22672, 22674, 22677, 22680,
    22689, 22697, 22785, 22786, 22789, 22794, 22801, 22804, 22805, 22806, 22809, 22821,
    22849, 22852, 22853, 22854, 22857, 22864, 22865, 22866, 22868, 22869, 22870, 22872,
    22873, 22874, 22881, 22884, 22885, 22886, 22889, 22913, 22917, 22921, 22929, 22932,
    22933, 22934, 22936, 22937, 22949, 23044, 23048, 23061, 23066, 23072, 23077, 23078,
    23081, 23109, 23112, 23113, 23121, 23125, 23126, 23128, 23129, 23138, 23141, 23144,
    23146, 23169, 23178, 23186, 23189, 23190, 23192, 23194, 23201, 24581, 24596, 24598,
    24601, 24613, 24644, 24656, 24661, 24662, 24664, 24666, 24673, 24676, 24678, 24681,
    24705, 24726, 24741, 24833, 24836, 24838, 24841, 24850, 24853, 24865, 24866, 24870,
    24873, 24901, 24905, 24913, 24917, 24918, 24921, 24933, 24934, 24938, 24964, 24970,
    24978, 24981, 24993, 24998, 25001, 25105, 25110, 25113, 25152, 25153, 25158, 25173,
    25174, 25176, 25184, 25221, 25233, 25238, 25253, 25617, 25618, 25621, 25622, 25626,
    25633, 25638, 25641, 25664, 25666, 25669, 25672, 25674, 25681, 25684, 25685, 25686,
    25689, 25690, 25696, 25698, 25701, 25732, 25733, 25737, 25744, 25746, 25748, 25749,
    25750, 25752, 25754, 25761, 25764, 25769, 25861, 25864, 25866, 25873, 25877, 25878,
    25881, 25924, 25925, 25926, 25929, 25936, 25937, 25940, 25941, 25942, 25945, 25953,
    25956, 25957, 25958, 25961, 25990, 25993, 25994, 26001, 26005, 26006, 26009, 26010,
    26018, 26021, 26022, 26024, 26114, 26121, 26133, 26144, 26150, 26152, 26153, 26176,
    26181, 26184, 26186, 26193, 26196, 26197, 26198, 26200, 26202, 26208, 26213, 26216,
    26240, 26242, 26245, 26250, 26260, 26262, 26264, 26265, 26272, 26276, 26278, 26282,
    26646, 26649, 26661, 26689, 26706, 26709, 26714, 26721, 26729, 26757, 26769, 26776,
    26790, 26881, 26884, 26896, 26901, 26913, 26916, 26918, 26921, 26944, 26945, 26949,
    26950, 26952, 26961, 26964, 26965, 26966, 26969, 26976, 26981, 26986, 27010, 27012,
    27018, 27029, 27041, 27044, 27045, 27049, 27153, 27158, 27160, 27201, 27204, 27209,
    27216, 27221, 27224, 27226, 27236, 27237, 27241, 27270, 27284, 27288, 27290, 27302,
    32768, 32770, 32776, 32778, 32800, 32802, 32808, 32810, 32837, 32848, 32849, 32852,
    32854, 32857, 32869, 32896, 32898, 32904, 32906, 32917, 32928, 32930, 32936, 32938,
    33029, 33041, 33044, 33046, 33049, 33061, 33089, 33092, 33097, 33104, 33106, 33109,
    33110, 33112, 33113, 33124, 33126, 33129, 33157, 33161, 33172, 33174, 33177, 33189,
    33280, 33282, 33288, 33290, 33301, 33312, 33314, 33320, 33322, 33361, 33364, 33369,
    33381, 33408, 33410, 33416, 33418, 33429, 33440, 33442, 33448, 33450, 33812, 33817,
    33857, 33860, 33873, 33877, 33882, 33889, 33892, 33897, 33940, 33945, 34049, 34057,
    34066, 34069, 34074, 34086, 34089, 34112, 34113, 34117, 34120, 34129, 34132, 34133,
    34134, 34137, 34138, 34149, 34150, 34152, 34154, 34177, 34180, 34182, 34185, 34192,
    34194, 34197, 34200, 34214, 34321, 34326, 34329, 34341, 34369, 34372, 34377, 34378,
    34384, 34389, 34393, 34394, 34401, 34406, 34410, 34437, 34449, 34458, 34468, 34816,
    34818, 34824, 34826, 34837, 34848, 34850, 34856, 34858, 34881, 34885, 34897, 34900,
    34905, 34917, 34921, 34944, 34946, 34952, 34954, 34965, 34976, 34978, 34984, 34986,
    35077, 35078, 35089, 35092, 35094, 35109, 35137, 35140, 35142, 35145, 35152, 35154,
    35157, 35162, 35169, 35172, 35205, 35222, 35225, 35237, 35328, 35330, 35336, 35338,
    35349, 35360, 35362, 35368, 35370, 35397, 35409, 35412, 35414, 35456, 35458, 35464,
    35466, 35477, 35488, 35490, 35496, 35498, 36869, 36881, 36886, 36888, 36889, 36901,
    36929, 36934, 36937, 36949, 36952, 36954, 36969, 36970, 36997, 37009, 37012, 37014,
    37017, 37029, 37121, 37124, 37126, 37129, 37136, 37141, 37144, 37146, 37153, 37156,
    37158, 37161, 37184, 37189, 37200, 37201, 37204, 37205, 37206, 37209, 37218, 37221,
    37252, 37254, 37266, 37269, 37272, 37281, 37284, 37286, 37289, 37381, 37393, 37396,
    37401, 37413, 37444, 37446, 37449, 37456, 37458, 37461, 37464, 37478, 37481, 37509,
    37524, 37526, 37545, 37889, 37892, 37894, 37904, 37909, 37912, 37926, 37952, 37962,
    37969, 37972, 37973, 37974, 37976, 37977, 37984, 37985, 37986, 37989, 38020, 38022,
    38034, 38036, 38037, 38040, 38049, 38057, 38144, 38149, 38152, 38154, 38160, 38161,
    38164, 38165, 38166, 38169, 38177, 38181, 38185, 38186, 38209, 38212, 38213, 38214,
    38217, 38224, 38225, 38226, 38228, 38229, 38230, 38232, 38233, 38234, 38241, 38244,
    38245, 38246, 38249, 38273, 38277, 38280, 38289, 38290, 38292, 38293, 38294, 38297,
    38298, 38304, 38306, 38309, 38312, 38314, 38401, 38404, 38416, 38421, 38425, 38432,
    38438, 38441, 38469, 38472, 38473, 38481, 38482, 38485, 38486, 38489, 38501, 38504,
    38530, 38532, 38537, 38538, 38546, 38548, 38549, 38564, 38566, 38569, 38917, 38934,
    38937, 38949, 38977, 38982, 38992, 38994, 38997, 38998, 39002, 39012, 39013, 39045,
    39057, 39062, 39065, 39077, 39172, 39174, 39177, 39184, 39186, 39189, 39192, 39194,
    39200, 39201, 39204, 39206, 39232, 39234, 39237, 39240, 39242, 39249, 39252, 39253,
    39254, 39257, 39266, 39269, 39270, 39274, 39297, 39300, 39312, 39314, 39317, 39322,
    39329, 39334, 39429, 39445, 39461, 39492, 39494, 39497, 39504, 39509, 39512, 39521,
    39557, 39569, 39572, 39573, 39574, 40960, 40962, 40968, 40970, 40981, 40992, 40994,
    41000, 41002, 41029, 41041, 41044, 41046, 41049, 41088, 41090, 41096, 41098, 41109,
    41120, 41122, 41128, 41130, 41221, 41225, 41233, 41236, 41238, 41241, 41242, 41286,
    41289, 41297, 41301, 41304, 41306, 41313, 41316, 41349, 41360, 41362, 41366, 41369,
    41474, 41480, 41482, 41488, 41497, 41506, 41512, 41514, 41541, 41553, 41558, 41561,
    41573, 41600, 41602, 41608, 41610, 41621, 41632, 41634, 41640, 41642, 42009, 42021,
    42049, 42052, 42064, 42068, 42069, 42072, 42074, 42081, 42085, 42086, 42088, 42089,
    42117, 42246, 42249, 42256, 42258, 42261, 42264, 42278, 42281, 42306, 42309, 42321,
    42324, 42325, 42326, 42329, 42341, 42346, 42369, 42372, 42373, 42374, 42377, 42386,
    42389, 42392, 42501, 42513, 42518, 42522, 42529, 42533, 42564, 42566, 42570, 42578,
    42581, 42582, 42584, 42592, 42594, 42630, 42640, 42645, 42646, 42649, 42657, 42660,
    42662, 43008, 43010, 43016, 43018, 43040, 43042, 43048, 43050, 43089, 43092, 43094,
    43097, 43136, 43138, 43144, 43146, 43157, 43168, 43170, 43176, 43178, 43269, 43284,
    43289, 43297, 43301, 43329, 43344, 43349, 43354, 43361, 43366, 43369, 43408, 43414,
    43520, 43522, 43528, 43530, 43552, 43554, 43560, 43562, 43601, 43604, 43606, 43648,
    43650, 43656, 43658, 43669, 43680, 43682, 43688, 43690,
)
# fmt: on

# --8<-- [start:grids]
# The value of each level number in the tables ggml-common.h hands to dequantization. The
# lattice has the odd integers 2l + 1 = 1, 3, 5, ...; IQ2 stores 8 * (1, 3.125, 5.375) and
# IQ3_XXS 4 * (1, 3, ..., 13, 15.5) (slightly stretched outer levels); IQ3_S stores the odd
# integers themselves, IQ1 the centred values l - 1.
IQ2_LEVELS = np.array([0x08, 0x19, 0x2B], dtype=np.uint8)
IQ3XXS_LEVELS = np.array([0x04, 0x0C, 0x14, 0x1C, 0x24, 0x2C, 0x34, 0x3E], dtype=np.uint8)
IQ3S_LEVELS = np.array([0x01, 0x03, 0x05, 0x07, 0x09, 0x0B, 0x0D, 0x0F], dtype=np.uint8)
IQ1_LEVELS = np.array([-1, 0, 1], dtype=np.int8)

IQ2XXS_GRID = unpack_grid(_KGRID_2BIT_256, IQ2_LEVELS, 2, 8)  # ggml-common.h:560 iq2xxs_grid
IQ2XS_GRID = unpack_grid(_KGRID_2BIT_512, IQ2_LEVELS, 2, 8)  # ggml-common.h:627 iq2xs_grid
IQ2S_GRID = unpack_grid(_KGRID_2BIT_1024, IQ2_LEVELS, 2, 8)  # ggml-common.h:758 iq2s_grid
IQ3XXS_GRID = unpack_grid(_KGRID_256, IQ3XXS_LEVELS, 3, 4)  # ggml-common.h:1017 iq3xxs_grid
IQ3S_GRID = unpack_grid(_KGRID_512, IQ3S_LEVELS, 3, 4)  # ggml-common.h:1052 iq3s_grid
IQ1S_GRID = unpack_grid(_KGRID_1BIT_2048, IQ1_LEVELS, 2, 8)  # ggml-common.h:1135 iq1s_grid
# --8<-- [end:grids]

for _table in (KMASK_IQ2XS, KSIGNS_IQ2XS, IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID, IQ3XXS_GRID,
               IQ3S_GRID, IQ1S_GRID):
    _table.setflags(write=False)  # shared tables: a stray write would corrupt every model
