r"""Twin of [`reference.ops.rope`][reference.ops.rope]: ``ggml_rope_ext`` on MLX.

**The fused kernel on a GPU.** Without YaRN (``ext_factor == 0``) on a GPU
([`accelerated.device.gpu_paths`][accelerated.device.gpu_paths]), [`rope_ext`][] calls
``mx.fast.rope`` with one "batch" entry per token and ``offset = pos`` (a vector of per-token
positions), where the kernel computes it right ([`fast_rope_fits`][]: no negative offsets,
and on CUDA at least 32 rotated dims):

- ``traditional=True`` is ggml's ``ROPE_TYPE_NORM`` (interleaved pairs $(x_{2j}, x_{2j+1})$),
  ``traditional=False`` is ``ROPE_TYPE_NEOX`` (halves);
- ``mx.fast.rope``'s ``scale`` multiplies the positions, which is ggml's ``freq_scale``
  multiplying the angles ($s\,p\,b^{-2j/n}$ either way);
- ``freq_factors`` $f_j$ are passed as MLX's ``freqs`` (periods): $b^{2j/n_{dims}} f_j$;
- ``attn_factor`` (no parameter in MLX) multiplies the rotated dims afterwards.

The kernel evaluates the closed form $p\,b^{-2j/n_{dims}}$ where ggml repeats a float32
recurrence (see [`reference.ops.rope.rope_theta`][reference.ops.rope.rope_theta]); the angles differ
by a few ulps, which the twin registry bounds (NMSE below $10^{-8}$ up to positions of 30000).

**The cos/sin cache on the CPU.** MLX's CPU backend has no rope kernel: there
``mx.fast.rope`` is a fallback of about 19 plain ops per call. The CPU device takes the path of
YaRN with ``ext_factor = 0`` instead: ggml's own recurrence for the angles (bit for bit the
reference's, ``tests/twin/test_rope_graph.py``), then [`rotate_pairs`][]. A graph builds the
cache once for all its ``q`` and ``k``
([`accelerated.models.llama.graph_rope`][accelerated.models.llama.graph_rope]).

**YaRN is not in ``mx.fast.rope``.** With ``ext_factor != 0`` the twin builds the cos/sin
cache with plain MLX ops, mirroring the reference function by function (the float32 angle
recurrence, ``rope_yarn_ramp``, ``rope_yarn``, ``rotate_pairs``). The correction dims are
host scalars: [`reference.ops.rope.rope_yarn_corr_dims`][reference.ops.rope.rope_yarn_corr_dims] is
imported, not re-written.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from accelerated.device import gpu_paths, on_cuda
from accelerated.ops.convert import as_mx, to_mx_dtype
from reference.ops.rope import (
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    RopeError,
    RopeParams,
    check_rope_args,
    libm,
    rope_yarn_corr_dims,
)

__all__ = [
    "ROPE_TYPE_NEOX",
    "ROPE_TYPE_NORM",
    "CUDA_ROPE_MIN_DIMS",
    "RopeError",
    "RopeParams",
    "check_rope_args",
    "fast_rope_fits",
    "libm",
    "rope_back",
    "rope_cache",
    "rope_cache_init",
    "rope_dtype",
    "rope_ext",
    "rope_theta",
    "rope_yarn",
    "rope_yarn_corr_dims",
    "rope_yarn_ramp",
    "rotate_pairs",
]


# --8<-- [start:rope_yarn_ramp]
def rope_yarn_ramp(low: float, high: float, i0: mx.array, dtype: type = np.float32) -> mx.array:
    r"""Twin of [`reference.ops.rope.rope_yarn_ramp`][reference.ops.rope.rope_yarn_ramp].

    Examples:
        >>> rope_yarn_ramp(1.0, 3.0, mx.arange(0, 10, 2)).tolist()
        [1.0, 1.0, 0.5, 0.0, 0.0]
    """
    dt = to_mx_dtype(dtype)
    j = (as_mx(i0) // 2).astype(dt)
    y = (j - mx.array(low, dt)) / mx.maximum(mx.array(0.001, dt), mx.array(high - low, dt))
    return 1 - mx.minimum(1, mx.maximum(0, y))


# --8<-- [end:rope_yarn_ramp]


# --8<-- [start:rope_yarn]
def rope_yarn(
    theta_extrap: mx.array,
    freq_scale: float,
    corr_dims: tuple[float, float],
    i0: mx.array,
    ext_factor: float,
    mscale: float,
) -> tuple[mx.array, mx.array]:
    r"""Twin of [`reference.ops.rope.rope_yarn`][reference.ops.rope.rope_yarn].

    ``mx.cos``/``mx.sin`` in the array's dtype (the reference rounds a float64 evaluation
    once; MLX's float32 functions may differ by an ulp).

    Examples:
        >>> c, s = rope_yarn(mx.array([0.0, 1.5707964]), 1.0, (0.0, 1.0), mx.array([0, 2]),
        ...                  0.0, 1.0)
        >>> [round(v, 6) for v in c.tolist()], [round(v, 6) for v in s.tolist()]
        ([1.0, -0.0], [0.0, 1.0])
    """
    theta_extrap = as_mx(theta_extrap)
    dt = theta_extrap.dtype
    theta = mx.array(freq_scale, dt) * theta_extrap
    m = mx.array(mscale, dt)
    if ext_factor != 0.0:
        ramp_mix = rope_yarn_ramp(corr_dims[0], corr_dims[1], i0, dt) * mx.array(ext_factor, dt)
        theta = theta * (1 - ramp_mix) + theta_extrap * ramp_mix
        m = m * (1 + mx.array(0.1, dt) * mx.log(1 / mx.array(freq_scale, dt)))
    return mx.cos(theta) * m, mx.sin(theta) * m


# --8<-- [end:rope_yarn]


# --8<-- [start:rope_theta]
def rope_theta(
    pos: mx.array, n_dims: int, freq_base: float, dtype: type = np.float32
) -> mx.array:
    r"""Twin of [`reference.ops.rope.rope_theta`][reference.ops.rope.rope_theta].

    The same recurrence $\theta_{j+1} = \mathrm{fl}(\theta_j s)$, written as the cumulative
    product of the row $(p, s, s, \dots, s)$: MLX's CPU scan multiplies left to right, one
    rounding per step, so each column is ggml's float32 value bit for bit
    (``tests/twin/test_ops.py``), in two graph nodes where a loop of ``n_dims // 2``
    multiplies and a stack took about ``n_dims``. A GPU's scan may group the products
    differently (a few ulps; the GPU takes this path only for YaRN). ``theta_scale`` is the
    reference's host scalar, ``powf(b, -2.0f / n_dims)`` with the exponent in float32 as ggml
    writes it.

    Examples:
        >>> rope_theta(mx.array([0, 1, 2]), 4, 100.0).tolist()
        [[0.0, 0.0], [1.0, 0.10000000149011612], [2.0, 0.20000000298023224]]
    """
    dt = to_mx_dtype(dtype)
    pos = as_mx(pos)
    if n_dims < 2:
        return mx.zeros((pos.shape[0], 0), dtype=dt)  # (n_tokens, 0)
    nt = np.float64 if dt == mx.float64 else np.float32
    theta_scale = mx.array(float(libm(np.power, nt(freq_base), nt(-2.0) / nt(n_dims))), dt)
    steps = mx.broadcast_to(theta_scale, (pos.shape[0], n_dims // 2 - 1))  # (n_tokens, n/2 - 1)
    row = mx.concatenate([pos.astype(dt)[:, None], steps], axis=1)  # (n_tokens, n_dims/2)
    return mx.cumprod(row, axis=1)  # theta_j = fl(theta_{j-1} * s)


# --8<-- [end:rope_theta]


# --8<-- [start:rope_cache_init]
def rope_cache_init(
    pos: mx.array,
    n_dims: int,
    freq_base: float,
    freq_scale: float,
    freq_factors: mx.array | None,
    corr_dims: tuple[float, float],
    ext_factor: float,
    attn_factor: float,
    dtype: type = np.float32,
) -> tuple[mx.array, mx.array]:
    r"""Twin of [`reference.ops.rope.rope_cache_init`][reference.ops.rope.rope_cache_init].

    Examples:
        >>> c, s = rope_cache_init(mx.array([0, 1]), 2, 10000.0, 1.0, None, (0.0, 1.0), 0.0, 1.0)
        >>> c.shape, s.dtype
        ((2, 1), mlx.core.float32)
    """
    dt = to_mx_dtype(dtype)
    theta_extrap = rope_theta(pos, n_dims, freq_base, dt)  # (n_tokens, n_dims/2)
    if freq_factors is not None:
        ff = as_mx(freq_factors)[: n_dims // 2].astype(dt)  # (n_dims/2,)
        theta_extrap = theta_extrap / ff
    i0 = 2 * mx.arange(n_dims // 2)  # (n_dims/2,) the even dimension index of each pair
    return rope_yarn(theta_extrap, freq_scale, corr_dims, i0, ext_factor, attn_factor)


# --8<-- [end:rope_cache_init]


# --8<-- [start:rotate_pairs]
def rotate_pairs(
    x: mx.array, cos_theta: mx.array, sin_theta: mx.array, n_dims: int, mode: int
) -> mx.array:
    r"""Twin of [`reference.ops.rope.rotate_pairs`][reference.ops.rope.rotate_pairs].

    NORM (interleaved pairs): ``x`` is seen as pairs ``(..., n_dims/2, 2)`` and turned in one
    expression, $y = x \cdot c + \bar{x} \cdot (\mp s)$, where $\bar{x}$ is each pair
    swapped (a reversed view): $y_{2j} = x_{2j} c_j + x_{2j+1} (-s_j)$ and
    $y_{2j+1} = x_{2j+1} c_j + x_{2j} s_j$, which are the reference's $x_0 c - x_1 s$ and
    $x_0 s + x_1 c$ bit for bit (a negated product added is the difference, and the sum
    commutes). Four graph nodes where slicing the pairs apart and stacking them back took
    seven. NEOX (halves): the two halves turned and concatenated, as the reference writes it.

    Examples:
        >>> x = mx.arange(6, dtype=mx.float32).reshape(1, 1, 6)
        >>> c, s = mx.array([[0.0, 0.0]]), mx.array([[1.0, 1.0]])  # a quarter turn
        >>> rotate_pairs(x, c, s, 4, ROPE_TYPE_NORM).tolist()
        [[[-1.0, 0.0, -3.0, 2.0, 4.0, 5.0]]]
        >>> rotate_pairs(x, c, s, 4, ROPE_TYPE_NEOX).tolist()
        [[[-2.0, -3.0, 0.0, 1.0, 4.0, 5.0]]]
    """
    x = as_mx(x)
    half = n_dims // 2
    c = as_mx(cos_theta)[:, None, :]  # (n_tokens, 1, n_dims/2): same angles for every head
    s = as_mx(sin_theta)[:, None, :]  # (n_tokens, 1, n_dims/2)
    turned = x if n_dims == x.shape[-1] else x[..., :n_dims]  # (..., n_dims)
    lead = turned.shape[:-1]
    if mode == ROPE_TYPE_NORM:
        pairs = turned.reshape(*lead, half, 2)  # (..., n_dims/2, 2): (x[2j], x[2j+1])
        sign = mx.array([-1.0, 1.0], dtype=s.dtype)  # -s_j for x[2j], +s_j for x[2j+1]
        rot = pairs * c[..., None] + pairs[..., ::-1] * (s[..., None] * sign)  # (..., n/2, 2)
        rot = rot.reshape(*lead, n_dims)  # (..., n_dims)
    else:
        x0, x1 = turned[..., :half], turned[..., half:]  # x[j], x[j + n_dims/2]
        y0 = x0 * c - x1 * s  # (..., n_tokens, n_head, n_dims/2)
        y1 = x0 * s + x1 * c  # (..., n_tokens, n_head, n_dims/2)
        rot = mx.concatenate([y0, y1], axis=-1)  # (..., n_dims)
    if n_dims == x.shape[-1]:
        return rot  # every dimension turns (no untouched tail to append)
    return mx.concatenate([rot, x[..., n_dims:]], axis=-1)  # (..., head_dim)


# --8<-- [end:rotate_pairs]


# --8<-- [start:fast_rope_fits]
CUDA_ROPE_MIN_DIMS = 32
"""The fewest rotated dims with which MLX's CUDA rope kernel launches for any token count."""


def fast_rope_fits(n_dims: int, cuda: bool | None = None) -> bool:
    r"""Whether ``mx.fast.rope`` can turn ``n_dims`` dims of any number of tokens here.

    Two limits of MLX's GPU rope kernel (0.32; ``scripts/mlx_cuda_checks.py`` shows both on
    an NVIDIA GPU, and ``mlx/backend/cuda/rope.cu`` and ``mlx/backend/common/utils.cpp``
    say why):

    - **Negative offsets.** With a vector of offsets the kernel adds each one to the
      thread's unsigned position (``pos.y + batch_offset``), so an offset of -3 becomes
      about $2^{32}$. The Metal kernel has the same expression. Positions in a batch are
      never negative (the batch checks refuse them), but the K-shift's deltas are (a
      context shift moves cells back): [`rope_ext`][] gives those to the cos/sin cache.
    - **Few dims on CUDA.** The block of threads gets up to
      $2^{10 - \lfloor\log_2(n_{dims}/2)\rfloor}$ threads on its third axis, where CUDA
      allows 64, so below 32 rotated dims a call fails to launch
      (``cudaGraphAddKernelNode ... invalid argument``) once its tokens times its groups of
      four heads reach 128: a prompt of 128 tokens on a model of 4 heads. The tiny test
      models have 16.

    Args:
        n_dims: the rotated dims.
        cuda: whether the device is MLX's CUDA backend (None: the default device's,
            [`accelerated.device.on_cuda`][accelerated.device.on_cuda]).

    Examples:
        >>> fast_rope_fits(64, cuda=True), fast_rope_fits(16, cuda=True)
        (True, False)
        >>> fast_rope_fits(16, cuda=False)  # Metal, or the CPU's fallback
        True
    """
    if cuda is None:
        cuda = on_cuda()
    return not cuda or n_dims >= CUDA_ROPE_MIN_DIMS
# --8<-- [end:fast_rope_fits]


# --8<-- [start:rope_fused]
def rope_fused(
    xt: mx.array,
    offset: mx.array,
    params: RopeParams,
    freq_factors: mx.array | None = None,
) -> mx.array:
    """The ``ext_factor == 0`` path: ``mx.fast.rope`` on a GPU, the cos/sin cache on the CPU.

    On a GPU ([`accelerated.device.gpu_paths`][accelerated.device.gpu_paths]) one
    ``mx.fast.rope`` kernel with one offset per token, where it launches for any token count
    ([`fast_rope_fits`][]; the offsets must not be negative, which the callers see to).
    MLX's CPU backend has no rope kernel:
    there ``mx.fast.rope`` is a fallback of plain ops (19 graph nodes per call, which compute
    the angles in closed form), so the CPU device takes the path of YaRN with
    ``ext_factor = 0``: [`rope_cache_init`][] (ggml's float32 recurrence for the angles, the
    reference's values) and [`rotate_pairs`][]. Of ``params`` this path reads ``n_dims``,
    ``mode``, ``freq_base``, ``freq_scale`` and ``attn_factor``.

    No checks and no host reads (``offset`` may be a traced placeholder), so a compiled
    graph can call it; [`rope_ext`][] checks its arguments first.

    Args:
        xt: ``(n_tokens, B, 1, head_dim)``: batch = token, sequence length 1.
        offset: ``(n_tokens,)`` int32 positions.
        params: the [`RopeParams`][reference.ops.rope.RopeParams], ``ext_factor == 0``.
        freq_factors: per-pair frequency divisors, or None.

    Returns:
        ``xt`` rotated, then ``attn_factor`` on the rotated dims (same shape).

    Examples:
        >>> x = mx.random.normal((3, 2, 8), key=mx.random.key(0))  # (n_tokens, n_head, d)
        >>> pos, p = np.array([0, 5, 9]), RopeParams(8)
        >>> y = rope_fused(x.reshape(3, 2, 1, 8), mx.array(pos), p)  # (n_tokens, n_head, 1, d)
        >>> mx.array_equal(y.reshape(3, 2, 8), rope_ext(x, pos, p)).item()
        True
    """
    n_dims, mode = params.n_dims, params.mode
    if not gpu_paths() or not fast_rope_fits(n_dims):
        n_tokens, b, _, head_dim = xt.shape
        dt = np.float64 if xt.dtype == mx.float64 else np.float32
        cos_theta, sin_theta = rope_cache_init(
            offset, n_dims, params.freq_base, params.freq_scale, freq_factors, (0.0, 0.0), 0.0,
            params.attn_factor, dt,
        )  # (n_tokens, n_dims/2) each
        y = rotate_pairs(xt.reshape(n_tokens, b, head_dim), cos_theta, sin_theta, n_dims, mode)
        return y.reshape(xt.shape)  # (n_tokens, B, 1, head_dim)
    freqs = None
    if freq_factors is not None:
        j = mx.arange(n_dims // 2, dtype=mx.float32)
        ff = as_mx(freq_factors)[: n_dims // 2].astype(mx.float32)
        freqs = mx.power(mx.array(params.freq_base, mx.float32), 2 * j / n_dims) * ff  # (n/2,)
    y = mx.fast.rope(
        xt, n_dims, traditional=(mode == ROPE_TYPE_NORM),
        base=None if freqs is not None else params.freq_base, scale=params.freq_scale,
        offset=offset, freqs=freqs,
    )  # (n_tokens, B, 1, head_dim)
    if params.attn_factor != 1.0:
        y = mx.concatenate([y[..., :n_dims] * params.attn_factor, y[..., n_dims:]], axis=-1)
    return y
# --8<-- [end:rope_fused]


# --8<-- [start:rope_cache]
def rope_cache(
    pos: mx.array,
    params: RopeParams,
    freq_factors: mx.array | None = None,
    dtype: type = np.float32,
) -> tuple[mx.array, mx.array]:
    r"""Twin of [`reference.ops.rope.rope_cache`][reference.ops.rope.rope_cache].

    The correction dims are the reference's host scalars; the cache is [`rope_cache_init`][]'s.

    Examples:
        >>> c, s = rope_cache(mx.array([0, 1]), RopeParams(2))
        >>> c.shape, s.dtype
        ((2, 1), mlx.core.float32)
    """
    p = params
    nt = np.float64 if to_mx_dtype(dtype) == mx.float64 else np.float32
    corr_dims = rope_yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast,
                                    p.beta_slow, nt)
    return rope_cache_init(pos, p.n_dims, p.freq_base, p.freq_scale, freq_factors, corr_dims,
                           p.ext_factor, p.attn_factor, dtype)  # (n_tokens, n_dims/2) each


# --8<-- [end:rope_cache]


def rope_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """Twin of [`reference.ops.rope.rope_dtype`][reference.ops.rope.rope_dtype]. The MLX dtype:
    float32, except that float64 stays float64 (MLX's CPU has it).

    Examples:
        >>> rope_dtype(mx.float16), rope_dtype(mx.float64)
        (mlx.core.float32, mlx.core.float64)
    """
    return mx.float64 if dtype == mx.float64 else mx.float32


# --8<-- [start:rope_ext]
def rope_ext(
    x: mx.array,
    pos: mx.array,
    params: RopeParams,
    freq_factors: mx.array | None = None,
) -> mx.array:
    r"""Twin of [`reference.ops.rope.rope_ext`][reference.ops.rope.rope_ext].

    ``ext_factor == 0`` and no negative position: [`rope_fused`][], on a GPU one fused
    ``mx.fast.rope`` call (``traditional`` = NORM mode, ``scale`` = ``freq_scale``,
    ``offset`` = ``pos`` per token, ``freqs`` from ``freq_factors``) then ``attn_factor`` on
    the rotated dims, on the CPU the cos/sin cache. ``ext_factor != 0`` (YaRN), or a
    negative position (a K-shift's delta, which MLX's GPU kernel turns wrong:
    [`fast_rope_fits`][]): the plain-MLX cos/sin cache and [`rotate_pairs`][] (with
    ``ext_factor = 0`` the same angles). ``pos`` is read on the host to be
    validated. Computes in float32 for float16/bfloat16 input, like ggml.

    Examples:
        >>> import numpy as np
        >>> y = rope_ext(np.ones((2, 1, 4), dtype=np.float32), np.array([0, 1]), RopeParams(2))
        >>> y[0].tolist(), y[1, 0, 2:].tolist()
        ([[1.0, 1.0, 1.0, 1.0]], [1.0, 1.0])
        >>> np.allclose(y[1, 0, :2], [np.cos(1) - np.sin(1), np.sin(1) + np.cos(1)])
        True
    """
    x = as_mx(x)
    pos_np = np.asarray(pos)
    check_rope_args(x, pos_np, params, freq_factors)
    in_dtype = x.dtype
    dt = rope_dtype(in_dtype)
    xc = x.astype(dt)
    if params.n_dims == 0:
        return x
    if params.ext_factor == 0.0 and not (pos_np < 0).any():
        lead = x.shape[:-3]
        n_tokens, n_head, head_dim = x.shape[-3:]
        # (n_tokens, n_head, head_dim) per leading index -> batch = token, T = 1
        xt = mx.moveaxis(xc.reshape(-1, n_tokens, n_head, head_dim), 1, 0)  # (n_t, L, H, D)
        xt = xt.reshape(n_tokens, -1, 1, head_dim)  # (n_tokens, L*n_head, 1, head_dim)
        y = rope_fused(xt, mx.array(pos_np.astype(np.int32)), params,
                       freq_factors)  # (n_tokens, L*n_head, 1, head_dim)
        y = mx.moveaxis(y.reshape(n_tokens, -1, n_head, head_dim), 0, 1)  # (L, n_t, H, D)
        return y.reshape(*lead, n_tokens, n_head, head_dim).astype(in_dtype)
    cos_theta, sin_theta = rope_cache(
        as_mx(pos_np), params, freq_factors, np.float64 if dt == mx.float64 else np.float32
    )  # (n_tokens, n_dims/2) each
    return rotate_pairs(xc, cos_theta, sin_theta, params.n_dims, params.mode).astype(in_dtype)


# --8<-- [end:rope_ext]


# --8<-- [start:rope_back]
def rope_back(
    grad: mx.array,
    pos: mx.array,
    params: RopeParams,
    freq_factors: mx.array | None = None,
) -> mx.array:
    r"""Twin of [`reference.ops.rope.rope_back`][reference.ops.rope.rope_back].

    Always the plain-MLX cos/sin cache ([`rope_cache`][]) and [`rotate_pairs`][] with the
    sine negated, $R(-\theta)$: ``mx.fast.rope`` has no backward form, and a negated position
    is what its GPU kernel turns wrong. ``pos`` is read on the host to be validated.

    Examples:
        >>> x = mx.random.normal((3, 2, 4), key=mx.random.key(0))
        >>> pos, p = np.array([0, 5, 9]), RopeParams(4)
        >>> mx.allclose(rope_back(rope_ext(x, pos, p), pos, p), x, atol=1e-6).item()
        True
    """
    grad = as_mx(grad)
    pos_np = np.asarray(pos)
    check_rope_args(grad, pos_np, params, freq_factors)
    in_dtype = grad.dtype
    dt = rope_dtype(in_dtype)
    cos_theta, sin_theta = rope_cache(
        as_mx(pos_np), params, freq_factors, np.float64 if dt == mx.float64 else np.float32
    )  # (n_tokens, n_dims/2) each
    out = rotate_pairs(grad.astype(dt), cos_theta, -sin_theta, params.n_dims, params.mode)
    return out.astype(in_dtype)  # R(-theta)


# --8<-- [end:rope_back]
