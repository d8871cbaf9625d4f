r"""K-quant quantizers: float32 weights -> Q2_K, Q3_K, Q4_K, Q5_K and Q6_K blocks.

This is what ``llama-quantize`` does to a weight matrix when it writes a ``Q4_K_M``,
``Q5_K_M`` or ``Q6_K`` file without an importance matrix: ``ggml_quantize_chunk`` calls
``quantize_q4_K`` & co., which call the reference quantizers ``quantize_row_q4_K_ref``,
``quantize_row_q5_K_ref``, ``quantize_row_q6_K_ref`` (and ``..._q2_K_ref``,
``..._q3_K_ref``) of ``ggml/src/ggml-quants.c``. They are mirrored here byte for byte
(tested against that C through the ``libggml-base`` that llama-cpp-python ships).

Every K-quant cuts a super-block of ``QK_K = 256`` weights into sub-blocks (8 of 32 for
Q4_K and Q5_K, 16 of 16 for Q2_K, Q3_K and Q6_K) and quantizes in two levels:

1. **a search per sub-block** finds the float scale (and, for the types with a minimum, the
   float minimum) that fits the sub-block best: [`make_qkx2_quants`][] for Q2_K, Q4_K and
   Q5_K (weights $q \in [0, n_{\max}]$, $x \approx s\,q - m$), [`make_qx_quants`][] for Q6_K
   and [`make_q3_quants`][] for Q3_K (signed $q \in [-n_{\max}, n_{\max} - 1]$,
   $x \approx s\,q$);
2. **the sub-block scales are themselves quantized** to 4, 6 or 8 bits against one float16
   super-block scale ``d`` (and ``dmin``), and then every weight is quantized *again*, this
   time against the scale the file will really hold, $\mathrm{f16}(d) \cdot sc_i$.

There is no randomness and no data-dependent iteration count: the search tries a fixed list
of candidate scales, so the same floats always give the same bytes. What must be copied
exactly is the float32 arithmetic: every sum is a left-to-right C loop in float32
([`c_sum`][], not NumPy's pairwise ``np.sum``), products are rounded in C's order
(``w*x*l`` is ``(w*x)*l``), the pinned ``libggml-base`` has no fused multiply-adds, and
rounding to an integer is [`nearest_int`][], ggml's bit trick.

Non-finite weights are refused ([`QuantError`][reference.common.QuantError]): ggml quantizes them
without complaint into blocks that are either rejected afterwards by its own
``ggml_validate_row_data`` (an infinite float16 scale; ``llama-quantize`` then stops with
"quantized data validation failed") or silently wrong (a NaN makes the whole sub-block's
search compare against NaN, and Q3_K and Q6_K turn an infinity into finite garbage).
Finite weights whose range overflows float32 or float16 are quantized as ggml does,
infinite scales included.

This module does not import ``reference.quants`` at load time (that module imports this one
to register the types in its ``QUANTIZE`` table); the few helpers both need are repeated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

from reference.common import QuantError

# --8<-- [start:constants]
QK_K = 256  # weights per super-block
GROUP_MAX_EPS = np.float32(1e-15)  # below this largest magnitude a sub-block counts as zero
MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: nearest_int's rounding constant
# --8<-- [end:constants]

F32 = np.float32


def _c_float_semantics(fn: Callable) -> Callable:
    """Run ``fn`` with NumPy's floating-point warnings off, as C runs ggml's quantizers.

    Overflow to infinity, division by zero and ``inf - inf`` are part of what ggml computes
    (``1/iscale`` of a zero scale, the range of a row near float32's limits); the results
    are masked or kept exactly as the C keeps them, so NumPy's warnings would only be noise.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    return run


# ---------------------------------------------------------------------------------------------
# C's float32 arithmetic
# ---------------------------------------------------------------------------------------------


# --8<-- [start:nearest_int]
def nearest_int(fval: np.ndarray) -> np.ndarray:
    r"""ggml's ``nearest_int``: round float32 to the nearest integer, ties to even.

    Adding $1.5 \cdot 2^{23}$ pushes the fraction bits out of the float32 mantissa, so the
    hardware's round-to-nearest-even does the rounding; the integer is then read from the
    low 23 bits of the sum:

    $$\mathrm{nearest\_int}(v) = \mathrm{bits}(v + 12582912) \mathbin{\&} \mathtt{0x7fffff}
      - \mathtt{0x400000}$$

    ggml asserts $|v| \le 4194303$ in debug builds only; beyond that (and for infinities and
    NaN, which give $-2^{22}$ and $0$) the release build returns these bits, and so does this
    function. Inside that range it is ``np.rint``.

    Args:
        fval: float32 array, any shape.

    Returns:
        int32 array of the same shape.

    Examples:
        >>> nearest_int(np.array([0.5, 1.5, 2.5, -0.5, -1.7, 3.49], dtype=np.float32))
        array([ 0,  2,  2,  0, -2,  3], dtype=int32)
        >>> nearest_int(np.array([4194304.0, np.inf, np.nan], dtype=np.float32))   # outside
        array([-4194304, -4194304,        0], dtype=int32)
    """
    val = np.asarray(fval, dtype=F32) + MAGIC  # float32
    return (val.view(np.int32) & 0x007FFFFF) - 0x00400000


# --8<-- [end:nearest_int]


# --8<-- [start:c_sum]
def c_sum(terms: np.ndarray, initial: np.ndarray | float = 0.0) -> np.ndarray:
    """``float s = initial; for (i = 0; i < n; ++i) s += terms[i];``: float32, left to right.

    ``np.sum`` adds in pairs (a different rounding); ``np.add.accumulate`` adds in order,
    so its last element is C's sum.

    Args:
        terms: float32 ``(..., n)``.
        initial: the starting value, a scalar or float32 ``(...)``.

    Returns:
        float32 ``(...)``.

    Examples:
        >>> t = np.array([1e8] + [1.0] * 15, dtype=np.float32)
        >>> float(c_sum(t)), float(np.sum(t))    # each 1e8 + 1 rounds back to 1e8
        (100000000.0, 100000008.0)
    """
    start = np.broadcast_to(np.asarray(initial, dtype=F32), terms.shape[:-1])[..., None]
    return np.add.accumulate(np.concatenate([start, terms], axis=-1), axis=-1)[..., -1]


# --8<-- [end:c_sum]


def _c_max(values: np.ndarray) -> np.ndarray:
    """``float m = 0; for (j...) if (v[j] > m) m = v[j];`` over the last axis (NaN never wins)."""
    m = np.zeros(values.shape[:-1], dtype=F32)
    for j in range(values.shape[-1]):
        m = np.where(values[..., j] > m, values[..., j], m)
    return m


def _c_argmax_abs(values: np.ndarray) -> np.ndarray:
    """The value of the first largest magnitude: ``if (fabsf(v) > amax) { amax = ...; max = v; }``.

    Starts from ``amax = 0, max = 0``, so an all-zero (or all-NaN) row gives ``max = 0``.
    """
    amax = np.zeros(values.shape[:-1], dtype=F32)
    max = np.zeros(values.shape[:-1], dtype=F32)
    for j in range(values.shape[-1]):
        bigger = np.abs(values[..., j]) > amax
        amax = np.where(bigger, np.abs(values[..., j]), amax)
        max = np.where(bigger, values[..., j], max)
    return max


def _f16_round(v: np.ndarray) -> np.ndarray:
    """``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v))``: the value a float16 field reads back as."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 ``(...)`` -> little-endian float16 bytes ``(..., 2)`` (round to nearest even)."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=F32).astype("<f2")[..., None].view(np.uint8)


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """Quants ``(..., 256)`` in 0-3 -> ``qs`` ``(..., 64)``: byte ``32h + l`` holds weights
    ``128h + 32s + l`` in bits ``2s, 2s+1`` (the layout of Q2_K and Q3_K)."""
    q = L.reshape(*L.shape[:-1], 2, 4, 32).astype(np.uint8)  # (..., 2, 4, 32)
    qs = q[..., 0, :] | (q[..., 1, :] << 2) | (q[..., 2, :] << 4) | (q[..., 3, :] << 6)
    return qs.reshape(*L.shape[:-1], 64)  # (..., 64)


# ---------------------------------------------------------------------------------------------
# The searches for one sub-block's scale
# ---------------------------------------------------------------------------------------------


def _weighted_error(scale, L, min, x, weights, use_mad: bool) -> np.ndarray:
    """``sum_i w_i * err(scale * L_i + min - x_i)``, err = ``fabsf`` or the square."""
    diff = (scale[..., None] * L + min[..., None]) - x  # (..., n)
    diff = np.abs(diff) if use_mad else diff * diff
    return c_sum(weights * diff)


# --8<-- [start:make_qkx2_quants]
@_c_float_semantics
def make_qkx2_quants(
    x: np.ndarray,
    weights: np.ndarray,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""``make_qkx2_quants``: the scale and minimum of a sub-block with unsigned quants.

    Fit $x_i \approx s\,q_i + b$ with $q_i \in [0, n_{\max}]$ and $b \le 0$, minimising the
    weighted error $E = \sum_i w_i\,|s\,q_i + b - x_i|^p$ ($p = 1$ with ``use_mad``, else 2).

    1. Start from the range: $b = \min(0, \min_i x_i)$, $s = (\max_i x_i - b) / n_{\max}$,
       $q_i = \mathrm{clip}(\mathrm{nearest\_int}((x_i - b)/s), 0, n_{\max})$.
    2. Try ``nstep + 1`` other grids: for $k = 0 \ldots$ ``nstep``, the inverse scale
       $(n_{\max} + r_{\min} + k\,r_\delta) / (\max_i x_i - b)$ rounds the weights to quants
       $q_i$, and for these quants the weighted least-squares line is
       $s = (S_w S_{xq} - S_x S_q)/D$, $b = (S_{qq} S_x - S_q S_{xq})/D$ with
       $D = S_w S_{qq} - S_q^2$ (sums of $w_i$, $w_i x_i$, $w_i q_i$, $w_i q_i^2$,
       $w_i q_i x_i$); if $b > 0$ it is clamped to 0 and $s = S_{xq}/S_{qq}$. The candidate
       replaces the best so far when $D > 0$ and its error $E$ is strictly smaller.

    A sub-block with $\max_i x_i = b$ (a constant $\le 0$, zeros included) gets $s = 0$
    and all quants 0. The minimum is returned negated, as the C's ``the_min``:
    $x_i \approx s\,q_i - m$ with $m = -b \ge 0$.

    Args:
        x: float32 ``(..., n)``, the sub-blocks (any leading dimensions).
        weights: float32 ``(..., n)``, $w_i$.
        nmax: the largest quant (3 for Q2_K, 15 for Q4_K, 31 for Q5_K).
        rmin: the first grid offset tried (-1 for Q4_K).
        rdelta: the step between offsets (0.1 for Q4_K).
        nstep: how many offsets (20 for Q4_K).
        use_mad: absolute error instead of squared error (Q2_K).

    Returns:
        ``(scale, the_min, L)``: float32 ``(...)``, float32 ``(...)``, uint8 ``(..., n)``.

    Examples:
        >>> x = np.array([[-1.0, 0.0, 1.0, 2.0]], dtype=np.float32)
        >>> scale, the_min, L = make_qkx2_quants(x, np.ones_like(x), 3, -0.5, 0.1, 5, False)
        >>> float(scale[0]), float(the_min[0]), L[0].tolist()   # x = 1.0 * q - 1.0
        (1.0, 1.0, [0, 1, 2, 3])
    """
    x = np.asarray(x, dtype=F32)
    w = np.asarray(weights, dtype=F32)
    min = np.min(x, axis=-1)  # (...)
    max = np.max(x, axis=-1)  # (...)
    min = np.where(min > 0, F32(0), min)
    flat, min_of_flat = max == min, min
    sum_w = c_sum(w[..., 1:], initial=w[..., 0])
    sum_x = c_sum(w[..., 1:] * x[..., 1:], initial=w[..., 0] * x[..., 0])
    iscale = F32(nmax) / (max - min)
    scale = F32(1) / iscale
    L = np.clip(nearest_int(iscale[..., None] * (x - min[..., None])), 0, nmax)
    best_error = _weighted_error(scale, L.astype(F32), min, x, w, use_mad)
    for step in range(nstep + 1) if nstep >= 1 else ():
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (max - min)
        Laux = np.clip(nearest_int(iscale[..., None] * (x - min[..., None])), 0, nmax)
        q = Laux.astype(F32)
        sum_l, sum_l2, sum_xl = c_sum(w * q), c_sum(w * q * q), c_sum(w * q * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        clamp = this_min > 0
        this_min = np.where(clamp, F32(0), this_min)
        this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
        cur_error = _weighted_error(this_scale, q, this_min, x, w, use_mad)
        better = (D > 0) & (cur_error < best_error)
        L = np.where(better[..., None], Laux, L)
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        min = np.where(better, this_min, min)
    L = np.where(flat[..., None], 0, L).astype(np.uint8)
    scale = np.where(flat, F32(0), scale)
    return scale, -np.where(flat, min_of_flat, min), L


# --8<-- [end:make_qkx2_quants]


def _qx_sums(x: np.ndarray, iscale: np.ndarray, nmax: int):
    """Quants of ``x`` on the grid ``iscale`` and their weighted sums (weights $x_i^2$)."""
    l = np.clip(nearest_int(iscale[..., None] * x), -nmax, nmax - 1)  # (..., n)
    lf = l.astype(F32)
    w = x * x
    return l, c_sum(w * x * lf), c_sum(w * lf * lf)


# --8<-- [start:make_qx_quants]
@_c_float_semantics
def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    r"""``make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)``: a signed scale for Q6_K.

    Fit $x_i \approx s\,q_i$ with $q_i \in [-n_{\max}, n_{\max} - 1]$, weighting each weight
    by $w_i = x_i^2$ (large weights matter most). Let $x_M$ be the first weight of largest
    magnitude. For the 19 grids $t \in \{-(n_{\max} + 0.1k)/x_M : k = 0, \pm 1 \ldots \pm 9\}$
    (first $k = 0$), the quants are $q_i = \mathrm{clip}(\mathrm{nearest\_int}(t\,x_i))$ and
    the best scale for them is $s = S_{xq} / S_{qq}$ ($S_{xq} = \sum w_i x_i q_i$,
    $S_{qq} = \sum w_i q_i^2$), which lowers the weighted squared error by
    $S_{xq}^2 / S_{qq}$. A grid replaces the best so far when $S_{qq} > 0$ and
    $S_{xq}^2 > \mathrm{best} \cdot S_{qq}$, where $\mathrm{best} = s\,S_{xq}$ of the best.

    The sign of $s$ is chosen so that $x_M$ maps to $-n_{\max}$, the level that has no
    positive twin. A sub-block whose largest magnitude is below ``GROUP_MAX_EPS`` gets
    $s = 0$ and all stored quants 0.

    Args:
        x: float32 ``(..., n)``.
        nmax: 32 for Q6_K.

    Returns:
        ``(scale, L)``: float32 ``(...)`` and the stored quants $q_i + n_{\max}$, uint8
        ``(..., n)``.

    Examples:
        >>> x = np.array([[-4.0, 1.0, 2.0, 3.0]], dtype=np.float32)
        >>> scale, L = make_qx_quants(x, 4)
        >>> float(scale[0]), (L[0].astype(int) - 4).tolist()   # x = 1.0 * q
        (1.0, [-4, 1, 2, 3])
    """
    x = np.asarray(x, dtype=F32)
    max = _c_argmax_abs(x)  # (...)
    zero = np.abs(max) < GROUP_MAX_EPS
    iscale = F32(-nmax) / max
    l, sumlx, suml2 = _qx_sums(x, iscale, nmax)
    L = l + nmax
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for k in (*range(-9, 0), *range(1, 10)):
        iscale = -(F32(nmax) + F32(0.1) * F32(k)) / max
        l, sumlx, suml2 = _qx_sums(x, iscale, nmax)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better[..., None], l + nmax, L)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    L = np.where(zero[..., None], 0, L).astype(np.uint8)
    return np.where(zero, F32(0), scale), L


# --8<-- [end:make_qx_quants]


# --8<-- [start:make_q3_quants]
@_c_float_semantics
def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    r"""``make_q3_quants(n, nmax, x, L, do_rmse=true)``: a signed scale for Q3_K.

    Start as [`make_qx_quants`][] does with $k = 0$: $q_i = \mathrm{clip}(\mathrm{nearest\_int}
    (-n_{\max} x_i / x_M), -n_{\max}, n_{\max} - 1)$, weights $w_i = x_i^2$. Then improve the
    quants one at a time (coordinate descent, at most 5 passes over the sub-block, in order):
    with $S_{xq}$ and $S_{qq}$ the sums *without* weight $i$, if $S_{xq} > 0$ the best quant
    for $x_i$ given the others is $\mathrm{nearest\_int}(x_i S_{qq} / S_{xq})$ (clipped); it
    is taken if, with it, $S_{qq} > 0$ and $S_{xq}^2 / S_{qq}$ (the error removed by the
    best scale) grows. A pass that changes nothing ends the search. The scale is
    $S_{xq}/S_{qq}$ of the final quants (0 when $S_{qq} \le 0$).

    A sub-block whose largest magnitude is below ``GROUP_MAX_EPS`` gets $s = 0$ and all
    stored quants 0.

    Args:
        x: float32 ``(..., n)``.
        nmax: 4 for Q3_K.

    Returns:
        ``(scale, L)``: float32 ``(...)`` and the stored quants $q_i + n_{\max}$, uint8
        ``(..., n)``.

    Examples:
        >>> x = np.array([[-4.0, -2.0, 1.0, 3.0]], dtype=np.float32)
        >>> scale, L = make_q3_quants(x, 4)
        >>> float(scale[0]), (L[0].astype(int) - 4).tolist()
        (1.0, [-4, -2, 1, 3])
    """
    x = np.asarray(x, dtype=F32)
    max = _c_argmax_abs(x)
    zero = np.abs(max) < GROUP_MAX_EPS
    l, sumlx, suml2 = _qx_sums(x, F32(-nmax) / max, nmax)
    for _ in range(5):
        n_changed = np.zeros(max.shape, dtype=bool)
        for i in range(x.shape[-1]):
            xi, li = x[..., i], l[..., i].astype(F32)
            w = xi * xi
            slx = sumlx - w * xi * li
            sl2 = suml2 - w * li * li
            new_l = np.clip(nearest_int(xi * sl2 / slx), -nmax, nmax - 1)
            nl = new_l.astype(F32)
            slx_new = slx + w * xi * nl
            sl2_new = sl2 + w * nl * nl
            take = (slx > 0) & (new_l != l[..., i]) & (sl2_new > 0)
            take &= slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new
            l[..., i] = np.where(take, new_l, l[..., i])
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)
            n_changed |= take
        if not n_changed.any():  # a sub-block with no change would not change again
            break
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    L = np.where(zero[..., None], 0, l + nmax).astype(np.uint8)
    return np.where(zero, F32(0), scale), L


# --8<-- [end:make_q3_quants]


# ---------------------------------------------------------------------------------------------
# The super-blocks
# ---------------------------------------------------------------------------------------------


def _check(x: np.ndarray, name: str) -> np.ndarray:
    """Rows of whole super-blocks of finite weights, as float32 ``(..., n_blocks, 256)``."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating) or x.ndim == 0:
        raise QuantError(
            f"quantizing to {name} needs a float array with at least one dimension, "
            f"got {x.dtype} of shape {x.shape}"
        )
    if x.shape[-1] % QK_K != 0:
        raise QuantError(
            f"rows of {x.shape[-1]} weights are not a whole number of {name} super-blocks "
            f"({QK_K} weights each)"
        )
    with np.errstate(over="ignore"):
        x = x.astype(F32)  # a float64 beyond float32's range becomes infinite, and is refused
    bad = ~np.isfinite(x)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise QuantError(
            f"cannot quantize to {name}: weight {where} is {x[where]}; only finite weights "
            f"can be quantized (ggml's quantize_row_{name[:2].lower()}_K_ref would write an "
            f"infinite scale or wrong quants)"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // QK_K, QK_K)


def _rows(blocks: np.ndarray, x_shape: tuple[int, ...]) -> np.ndarray:
    """Blocks ``(..., n_blocks, type_size)`` -> rows ``(..., n_blocks * type_size)``."""
    return blocks.reshape(*x_shape[:-1], blocks.shape[-2] * blocks.shape[-1])


# --8<-- [start:pack_scale_min_k4]
def pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    r"""The inverse of ``get_scale_min_k4``: 8 six-bit scales and mins -> 12 bytes.

    | byte $k$ | bits 7-6                     | bits 5-0 (or 3-0, 7-4)                   |
    |---------:|------------------------------|------------------------------------------|
    | 0-3      | bits 5-4 of $sc_{k+4}$       | $sc_k$                                   |
    | 4-7      | bits 5-4 of $m_k$            | $m_{k-4}$                                |
    | 8-11     | bits 3-0 of $m_{k-4}$ (7-4)  | bits 3-0 of $sc_{k-4}$ (3-0)             |

    Args:
        ls: uint8 ``(..., 8)`` scales in ``[0, 63]``.
        lm: uint8 ``(..., 8)`` mins in ``[0, 63]``.

    Returns:
        uint8 ``(..., 12)``.

    Examples:
        >>> from reference.quants import get_scale_min_k4
        >>> ls = np.array([1, 2, 3, 4, 52, 6, 7, 63], dtype=np.uint8)
        >>> lm = np.array([0, 9, 10, 11, 37, 13, 14, 15], dtype=np.uint8)
        >>> [a.tolist() for a in get_scale_min_k4(pack_scale_min_k4(ls, lm))]
        [[1, 2, 3, 4, 52, 6, 7, 63], [0, 9, 10, 11, 37, 13, 14, 15]]
    """
    lo = ls[..., :4] | ((ls[..., 4:] >> 4) << 6)  # (..., 4)
    hi = lm[..., :4] | ((lm[..., 4:] >> 4) << 6)  # (..., 4)
    packed = (ls[..., 4:] & 0x0F) | ((lm[..., 4:] & 0x0F) << 4)  # (..., 4)
    return np.concatenate([lo, hi, packed], axis=-1)  # (..., 12)


# --8<-- [end:pack_scale_min_k4]


@_c_float_semantics
def _quantize_scales_mins(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Steps shared by Q4_K and Q5_K: search 8 sub-blocks, quantize their scales and mins
    to 6 bits, then requantize every weight against the stored scales.

    Returns ``(d, dmin, scales, L)``: float16 bytes ``(..., 2)`` twice, the 12 packed bytes,
    and the quants ``(..., 8, 32)``.
    """
    xs = x.reshape(*x.shape[:-1], 8, 32)  # (..., 8, 32)
    sum_x2 = c_sum(xs * xs)  # (..., 8)
    av_x = np.sqrt(sum_x2 / F32(32))
    weights = av_x[..., None] + np.abs(xs)  # (..., 8, 32)
    scales, mins, L = make_qkx2_quants(xs, weights, nmax, rmin, 0.1, nstep, False)
    max_scale, max_min = _c_max(scales), _c_max(mins)  # (...)
    inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
    inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    # uint8_t ls = nearest_int(...): the conversion keeps the low 8 bits
    ls = np.minimum(nearest_int(inv_scale[..., None] * scales).astype(np.uint8), 63)
    lm = np.minimum(nearest_int(inv_min[..., None] * mins).astype(np.uint8), 63)
    d, dmin = max_scale / F32(63), max_min / F32(63)
    # requantize against what the file holds: f16(d) * sc and f16(dmin) * m
    sub_d = _f16_round(d)[..., None] * ls.astype(F32)  # (..., 8)
    sub_m = _f16_round(dmin)[..., None] * lm.astype(F32)  # (..., 8)
    l = nearest_int((xs + sub_m[..., None]) / sub_d[..., None])
    L = np.where(sub_d[..., None] == 0, L, np.clip(l, 0, nmax))  # "if (!d) continue;"
    return _f16_bytes(d), _f16_bytes(dmin), pack_scale_min_k4(ls, lm), L.astype(np.uint8)


# --8<-- [start:quantize_q4_k]
@_c_float_semantics
def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q4_K_ref``: float32 rows -> ``block_q4_K`` bytes (144 per 256 weights).

    For each of the 8 sub-blocks of 32, [`make_qkx2_quants`][] with $n_{\max} = 15$,
    ``rmin = -1``, ``rdelta = 0.1``, ``nstep = 20`` and weights $w_i = \bar x + |x_i|$
    ($\bar x$ the sub-block's root mean square) finds a scale $s_i \ge 0$ and a minimum
    $m_i \ge 0$. They are quantized to 6 bits against the largest of each:

    $$d = \frac{\max_i s_i}{63}, \quad sc_i = \min\Bigl(63, \mathrm{nearest\_int}
      \Bigl(\frac{63\,s_i}{\max_i s_i}\Bigr)\Bigr),$$

    $$d_{\min} = \frac{\max_i m_i}{63}, \quad mq_i = \min\Bigl(63, \mathrm{nearest\_int}
      \Bigl(\frac{63\,m_i}{\max_i m_i}\Bigr)\Bigr)$$

    ($sc_i = 0$ when no scale is positive, and likewise $mq_i$), packed by
    [`pack_scale_min_k4`][]; ``d`` and ``dmin`` are stored as float16, $\hat d$ and
    $\hat d_{\min}$. Every weight is then quantized again against the stored values,

    $$q = \mathrm{clip}\bigl(\mathrm{nearest\_int}((x + \hat d_{\min}\,mq_i) /
      (\hat d\,sc_i)),\ 0,\ 15\bigr),$$

    except in a sub-block whose stored scale $\hat d\,sc_i$ is 0, which keeps the search's
    quants. In ``qs``, bytes $32c \ldots 32c+31$ hold sub-block $2c$ in their low nibbles and
    $2c+1$ in their high nibbles.

    Args:
        x: float ``(..., n)``, ``n`` a multiple of 256, all finite; converted to float32.

    Returns:
        uint8 ``(..., n // 256 * 144)``.

    Raises:
        QuantError: ``x`` is not a float array, its rows are not whole super-blocks, or a
            weight is infinite or NaN.

    Examples:
        >>> from reference.quants import dequantize_q4_k
        >>> x = np.sin(np.arange(256, dtype=np.float32))
        >>> block = quantize_q4_k(x)
        >>> block.shape
        (144,)
        >>> bool(np.abs(dequantize_q4_k(block) - x).max() < 0.08)
        True
    """
    blocks = _check(x, "Q4_K")  # (..., nb, 256)
    d, dmin, scales, L = _quantize_scales_mins(blocks, 15, -1.0, 20)
    qs = L[..., 0::2, :] | (L[..., 1::2, :] << 4)  # (..., nb, 4, 32): sub-blocks 2c, 2c+1
    qs = qs.reshape(*blocks.shape[:-1], 128)
    return _rows(np.concatenate([d, dmin, scales, qs], axis=-1), np.shape(x))


# --8<-- [end:quantize_q4_k]


# --8<-- [start:quantize_q5_k]
@_c_float_semantics
def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q5_K_ref``: float32 rows -> ``block_q5_K`` bytes (176 per 256 weights).

    [`quantize_q4_k`][] with 5-bit quants: $n_{\max} = 31$, and the search tries
    ``rmin = -0.5``, ``nstep = 15``. Bits 0-3 of the quants are packed as Q4_K's ``qs``;
    bit 4 of weight $j$ of sub-block $i$ is bit $i$ of ``qh`` byte $j$.

    Args:
        x: float ``(..., n)``, ``n`` a multiple of 256, all finite; converted to float32.

    Returns:
        uint8 ``(..., n // 256 * 176)``.

    Raises:
        QuantError: as [`quantize_q4_k`][].

    Examples:
        >>> from reference.quants import dequantize_q5_k
        >>> x = np.sin(np.arange(256, dtype=np.float32))
        >>> bool(np.abs(dequantize_q5_k(quantize_q5_k(x)) - x).max() < 0.04)
        True
    """
    blocks = _check(x, "Q5_K")  # (..., nb, 256)
    d, dmin, scales, L = _quantize_scales_mins(blocks, 31, -0.5, 15)
    bit = np.arange(8, dtype=np.uint8)[:, None]  # (8, 1)
    qh = np.bitwise_or.reduce((L >> 4) << bit, axis=-2)  # (..., nb, 32)
    low = L & 0x0F
    qs = low[..., 0::2, :] | (low[..., 1::2, :] << 4)  # (..., nb, 4, 32)
    qs = qs.reshape(*blocks.shape[:-1], 128)
    return _rows(np.concatenate([d, dmin, scales, qh, qs], axis=-1), np.shape(x))


# --8<-- [end:quantize_q5_k]


# --8<-- [start:quantize_q6_k]
@_c_float_semantics
def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q6_K_ref``: float32 rows -> ``block_q6_K`` bytes (210 per 256 weights).

    For each of the 16 sub-blocks of 16, [`make_qx_quants`][] with $n_{\max} = 32$ finds a
    signed scale $s_g$. Let $s_M$ be the first of largest magnitude; if
    $|s_M| <$ ``GROUP_MAX_EPS`` the block is all zero bytes. Otherwise the scales become
    signed 8-bit integers against $d = s_M / -128$ (so $s_M$ itself becomes $-128$):

    $$sc_g = \min(127, \mathrm{nearest\_int}(-128\,s_g / s_M)), \qquad
      q = \mathrm{clip}(\mathrm{nearest\_int}(x / (\hat d\,sc_g)), -32, 31) + 32$$

    with $\hat d$ the float16 ``d``; a sub-block with $\hat d\,sc_g = 0$ keeps the search's
    quants. Bits 0-3 of $q$ go to ``ql`` and bits 4-5 to ``qh`` as
    ``reference.quants.dequantize_q6_k`` reads them.

    Args:
        x: float ``(..., n)``, ``n`` a multiple of 256, all finite; converted to float32.

    Returns:
        uint8 ``(..., n // 256 * 210)``.

    Raises:
        QuantError: as [`quantize_q4_k`][].

    Examples:
        >>> from reference.quants import dequantize_q6_k
        >>> x = np.sin(np.arange(256, dtype=np.float32))
        >>> bool(np.abs(dequantize_q6_k(quantize_q6_k(x)) - x).max() < 0.02)
        True
        >>> bool((quantize_q6_k(np.zeros(256, np.float32)) == 0).all())
        True
    """
    blocks = _check(x, "Q6_K")  # (..., nb, 256)
    xs = blocks.reshape(*blocks.shape[:-1], 16, 16)  # (..., nb, 16, 16)
    scales, L = make_qx_quants(xs, 32)  # (..., nb, 16), (..., nb, 16, 16)
    max_scale = _c_argmax_abs(scales)  # (..., nb)
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = F32(-128) / max_scale
    d = F32(1) / iscale
    sc = np.minimum(127, nearest_int(iscale[..., None] * scales)).astype(np.int8)
    sub_d = _f16_round(d)[..., None] * sc.astype(F32)  # (..., nb, 16)
    l = np.clip(nearest_int(xs / sub_d[..., None]), -32, 31) + 32
    L = np.where(sub_d[..., None] == 0, L, l).astype(np.uint8)  # "if (!d) continue;"
    q = L.reshape(*blocks.shape[:-1], 2, 4, 32)  # (..., nb, half, quarter, 32)
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4),
                         low[..., 1, :] | (low[..., 3, :] << 4)], axis=-1)  # (..., nb, 2, 64)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    lead = blocks.shape[:-1]
    out = np.concatenate(
        [ql.reshape(*lead, 128), qh.reshape(*lead, 64), sc.view(np.uint8), _f16_bytes(d)],
        axis=-1,
    )  # (..., nb, 210)
    out[zero] = 0  # memset(&y[i], 0, sizeof(block_q6_K))
    return _rows(out, np.shape(x))


# --8<-- [end:quantize_q6_k]


# --8<-- [start:quantize_q2_k]
@_c_float_semantics
def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q2_K_ref``: float32 rows -> ``block_q2_K`` bytes (84 per 256 weights).

    For each of the 16 sub-blocks of 16, [`make_qkx2_quants`][] with $n_{\max} = 3$,
    ``rmin = -0.5``, ``rdelta = 0.1``, ``nstep = 15``, weights $|x_i|$ and the absolute
    error finds $s_g \ge 0$ and $m_g \ge 0$. Both are quantized to 4 bits in one byte
    ($sc_g$ low nibble, $m'_g$ high nibble) against ``d`` $= \max_g s_g / 15$ and
    ``dmin`` $= \max_g m_g / 15$ (0 if that maximum is not positive), and the weights are
    requantized against the stored values as in [`quantize_q4_k`][], into $[0, 3]$.

    Args:
        x: float ``(..., n)``, ``n`` a multiple of 256, all finite; converted to float32.

    Returns:
        uint8 ``(..., n // 256 * 84)``.

    Raises:
        QuantError: as [`quantize_q4_k`][].

    Examples:
        >>> from reference.quants import dequantize_q2_k
        >>> x = np.sin(np.arange(256, dtype=np.float32))
        >>> bool(np.abs(dequantize_q2_k(quantize_q2_k(x)) - x).max() < 0.4)
        True
    """
    blocks = _check(x, "Q2_K")  # (..., nb, 256)
    xs = blocks.reshape(*blocks.shape[:-1], 16, 16)  # (..., nb, 16, 16)
    scales, mins, L = make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    max_scale, max_min = _c_max(scales), _c_max(mins)  # (..., nb)
    ls = np.where(max_scale[..., None] > 0,
                  nearest_int((F32(15) / max_scale)[..., None] * scales), 0)
    lm = np.where(max_min[..., None] > 0,
                  nearest_int((F32(15) / max_min)[..., None] * mins), 0)
    packed = (ls | (lm << 4)).astype(np.uint8)  # (..., nb, 16): C keeps the low 8 bits
    d = np.where(max_scale > 0, max_scale / F32(15), F32(0))
    dmin = np.where(max_min > 0, max_min / F32(15), F32(0))
    sub_d = _f16_round(d)[..., None] * (packed & 0x0F).astype(F32)  # (..., nb, 16)
    sub_m = _f16_round(dmin)[..., None] * (packed >> 4).astype(F32)
    l = nearest_int((xs + sub_m[..., None]) / sub_d[..., None])
    L = np.where(sub_d[..., None] == 0, L, np.clip(l, 0, 3))  # "if (!d) continue;"
    qs = _pack_2bit(L.reshape(*blocks.shape[:-1], QK_K))  # (..., nb, 64)
    out = np.concatenate([packed, qs, _f16_bytes(d), _f16_bytes(dmin)], axis=-1)
    return _rows(out, np.shape(x))


# --8<-- [end:quantize_q2_k]


# --8<-- [start:quantize_q3_k]
@_c_float_semantics
def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    r"""``quantize_row_q3_K_ref``: float32 rows -> ``block_q3_K`` bytes (110 per 256 weights).

    For each of the 16 sub-blocks of 16, [`make_q3_quants`][] with $n_{\max} = 4$ finds a
    signed scale $s_g$. With $s_M$ the first of largest magnitude (if it is 0, the scales
    and ``d`` are 0), the scales become 6-bit $sc_g - 32$ against $d = s_M / -32$:

    $$sc_g = \mathrm{clip}(\mathrm{nearest\_int}(-32\,s_g / s_M), -32, 31) + 32, \qquad
      q = \mathrm{clip}(\mathrm{nearest\_int}(x / (\hat d\,(sc_g - 32))), -4, 3) + 4$$

    (a sub-block with $\hat d\,(sc_g - 32) = 0$ keeps the search's quants). The low 4 bits
    of $sc_g$ fill the nibbles of ``scales`` bytes 0-7 (sub-blocks 0-7 low, 8-15 high), the
    top 2 bits bytes 8-11; bit 2 of $q$ goes to ``hmask`` (bit $i$ of byte $l$ for weight
    $32i + l$) and bits 0-1 to ``qs``.

    Args:
        x: float ``(..., n)``, ``n`` a multiple of 256, all finite; converted to float32.

    Returns:
        uint8 ``(..., n // 256 * 110)``.

    Raises:
        QuantError: as [`quantize_q4_k`][].

    Examples:
        >>> from reference.quants import dequantize_q3_k
        >>> x = np.sin(np.arange(256, dtype=np.float32))
        >>> bool(np.abs(dequantize_q3_k(quantize_q3_k(x)) - x).max() < 0.25)
        True
    """
    blocks = _check(x, "Q3_K")  # (..., nb, 256)
    lead = blocks.shape[:-1]
    xs = blocks.reshape(*lead, 16, 16)  # (..., nb, 16, 16)
    scales, L = make_q3_quants(xs, 4)  # (..., nb, 16), (..., nb, 16, 16)
    max_scale = _c_argmax_abs(scales)  # (..., nb)
    iscale = F32(-32) / max_scale
    # int8_t l = nearest_int(...): the conversion keeps the low 8 bits, then the clip
    l = nearest_int(iscale[..., None] * scales).astype(np.int8).astype(np.int32)
    l6 = np.where(max_scale[..., None] != 0, np.clip(l, -32, 31) + 32, 0)  # (..., nb, 16)
    d = np.where(max_scale != 0, F32(1) / iscale, F32(0))
    sub_d = _f16_round(d)[..., None] * (l6 - 32).astype(F32)
    q = np.clip(nearest_int(xs / sub_d[..., None]), -4, 3) + 4
    L = np.where(sub_d[..., None] == 0, L, q).astype(np.uint8).reshape(*lead, QK_K)
    l6 = l6.astype(np.uint8)
    low = (l6[..., :8] & 0x0F) | ((l6[..., 8:] & 0x0F) << 4)  # (..., nb, 8)
    top = (l6 >> 4).reshape(*lead, 4, 4)  # (..., nb, j // 4, j % 4)
    high = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    bit = np.arange(8, dtype=np.uint8)[:, None]  # (8, 1)
    hm = (L.reshape(*lead, 8, 32) >> 2) << bit  # (..., nb, 8, 32)
    hmask = np.bitwise_or.reduce(hm, axis=-2)  # (..., nb, 32)
    qs = _pack_2bit(L & 3)  # (..., nb, 64)
    out = np.concatenate([hmask, qs, low, high, _f16_bytes(d)], axis=-1)  # (..., nb, 110)
    return _rows(out, np.shape(x))


# --8<-- [end:quantize_q3_k]


# --8<-- [start:K_QUANTIZERS]
K_QUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.Q2_K: quantize_q2_k,
    GGMLQuantizationType.Q3_K: quantize_q3_k,
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}
# --8<-- [end:K_QUANTIZERS]
