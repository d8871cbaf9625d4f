r"""Rotary position embedding: ``ggml_rope_ext``, as ggml's CPU backend computes it.

RoPE encodes the position $p$ of a token by rotating pairs of dimensions of its query and key
head vectors by angles proportional to $p$. Writing one pair $(x_a, x_b)$ as the complex number
$z = x_a + i\,x_b$, rope multiplies it by a unit complex number:

$$
z' = z \cdot m\,e^{i\theta_j(p)}, \qquad
\begin{pmatrix} x'_a \\ x'_b \end{pmatrix} = m
\begin{pmatrix} \cos\theta_j & -\sin\theta_j \\ \sin\theta_j & \cos\theta_j \end{pmatrix}
\begin{pmatrix} x_a \\ x_b \end{pmatrix},
$$

with $m = 1$ unless YaRN or ``attn_factor`` scale it. Pair $j$ ($0 \le j < n_{dims}/2$) turns
at the frequency $\theta_j(p) = p \cdot b^{-2j/n_{dims}}$ with $b$ = ``freq_base``.

This module mirrors ``ggml/src/ggml-cpu/ops.cpp`` at the pinned commit:
``ggml_compute_forward_rope_flt`` (the loop over tokens and heads), ``ggml_rope_cache_init``
(one cos/sin cache per token), ``rope_yarn`` and ``rope_yarn_ramp`` (YaRN), ``rotate_pairs``
(the two layouts), and ``ggml_rope_yarn_corr_dims`` from ``ggml/src/ggml.c``. The nine numbers
that configure the op travel together as one frozen [`RopeParams`][]; its backward,
``ggml_rope_ext_back`` ([`rope_back`][], for training), is the same kernel turning the other
way.

Two layouts (``mode``) decide which dimensions pair up:

- ``ROPE_TYPE_NORM`` (0): interleaved pairs $(x_{2j}, x_{2j+1})$, the layout of llama's GGUF
  files (``convert_hf_to_gguf.py`` permutes the Q/K weights into it).
- ``ROPE_TYPE_NEOX`` (2): halves $(x_j, x_{j + n_{dims}/2})$, HF's ``rotate_half``.

Only the first ``n_dims`` dimensions of each head rotate; the rest pass through unchanged.

Arithmetic: ggml computes in float32 whatever the tensor type (float16 is widened and rounded
back). The reference computes in float32 for every input except float64, which it keeps, so
that property tests can take rounding out of the way. Each float32 step is done in the same
order as ggml, including the angle recurrence $\theta_{j+1} = \theta_j \cdot s$ with
$s$ = ``theta_scale``, and ``cosf``/``sinf``/``logf``/``powf`` are rounded once as a C library
rounds them. Float32 results then agree with ggml's CPU backend to one or two ulps; what is left
is the compiler's fusing of ``x0*cos - x1*sin`` into an FMA and glibc's ``cosf`` rounding (see
the chapter), which a specification does not copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference.common import LlamarefError

# --8<-- [start:rope_types]
ROPE_TYPE_NORM = 0  # interleaved pairs (x0, x1), (x2, x3), ...: llama's GGUF layout
ROPE_TYPE_NEOX = 2  # halves (x_i, x_{i + n_dims/2}): HF's rotate_half
# --8<-- [end:rope_types]


# --8<-- [start:RopeError]
class RopeError(LlamarefError, ValueError):
    """Invalid arguments to [`rope_ext`][] (odd ``n_dims``, wrong ``pos`` length, bad mode)."""


# --8<-- [end:RopeError]


# --8<-- [start:RopeParams]
@dataclass(frozen=True)
class RopeParams:
    r"""The numbers of ``ggml_rope_ext``: how a model turns positions into angles.

    ``ggml_rope_ext(ctx, x, pos, freq_factors, n_dims, mode, n_ctx_orig, freq_base, freq_scale,
    ext_factor, attn_factor, beta_fast, beta_slow)`` takes three tensors and these nine
    numbers. A model passes the same nine to every rope of its graph (the ``q`` and ``k`` of
    every layer, the K-shift of the cache), from the context's parameters: one frozen record
    of them is what [`rope_ext`][], [`rope_back`][], the models and the K-shift share.
    [`reference.hparams.rope_cparams`][reference.hparams.rope_cparams] builds it from a model's
    hyperparameters; the defaults are ggml's.

    Attributes:
        n_dims: rotated dims per head (``n_rot``); even, at most the head size.
        mode: ``ROPE_TYPE_NORM`` (interleaved pairs) or ``ROPE_TYPE_NEOX`` (halves).
        n_ctx_orig: training context length (YaRN's correction dims).
        freq_base: base $b$ of the frequency schedule (``rope_freq_base``).
        freq_scale: linear interpolation factor $s$ (``rope_freq_scale`` = 1 / factor).
        ext_factor: YaRN mix $\epsilon$; 0 disables YaRN.
        attn_factor: magnitude $m$ of the rotated dims.
        beta_fast: YaRN's extrapolation boundary (turns).
        beta_slow: YaRN's interpolation boundary (turns).

    Examples:
        >>> p = RopeParams(64, ROPE_TYPE_NEOX)
        >>> p.freq_base, p.ext_factor, p == RopeParams(n_dims=64, mode=2)
        (10000.0, 0.0, True)
    """

    n_dims: int
    mode: int = ROPE_TYPE_NORM
    n_ctx_orig: int = 0
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


# --8<-- [end:RopeParams]


def rope_dtype(dtype: np.dtype) -> type:
    """The dtype rope computes in: ggml's float32, except that float64 stays float64.

    Property tests run in float64 to take rounding out of the way.

    Examples:
        >>> rope_dtype(np.float16), rope_dtype(np.float64)
        (<class 'numpy.float32'>, <class 'numpy.float64'>)
    """
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


# --8<-- [start:libm]
def libm(f, *args):
    """``f`` (``np.cos``, ``np.sin``, ``np.log``, ``np.power``) rounded once to the args' dtype.

    ggml calls C's ``cosf``/``sinf``/``logf``/``powf``; glibc's are (almost always) correctly
    rounded, NumPy's float32 loops are not (``np.power(np.float32(1e4), np.float32(-1/32))``
    is one ulp off). Evaluating in float64 and rounding once reproduces the C library. The
    MLX twin computes its host-side scalars with it too.

    Examples:
        >>> x = np.float32(1e4), np.float32(-1 / 32)
        >>> bool(libm(np.power, *x) == np.float32(1e4 ** (-1 / 32)))
        True
    """
    dt = np.result_type(*args).type
    return f(*(np.asarray(a, dtype=np.float64) for a in args)).astype(dt)


# --8<-- [end:libm]


# --8<-- [start:rope_yarn_corr_dims]
def rope_yarn_corr_dims(
    n_dims: int,
    n_ctx_orig: int,
    freq_base: float,
    beta_fast: float,
    beta_slow: float,
    dtype: type = np.float32,
) -> tuple[float, float]:
    r"""The range of pair indices over which YaRN blends interpolation into extrapolation.

    Mirrors ``ggml_rope_yarn_corr_dims`` (``ggml.c``). Pair $j$ turns
    $n_{ctx\_orig} / (2\pi\, b^{2j/n_{dims}})$ times over the training context; solving
    "turns $= \beta$" for $j$ gives

    $$
    d(\beta) = \frac{n_{dims} \ln\big(n_{ctx\_orig} / (2\pi\beta)\big)}{2 \ln b},
    \qquad
    \text{low} = \max(0, \lfloor d(\beta_{fast}) \rfloor),\quad
    \text{high} = \min(n_{dims} - 1, \lceil d(\beta_{slow}) \rceil).
    $$

    With ``n_ctx_orig == 0`` (ggml's default), $\ln 0 = -\infty$ gives ``(0.0, -inf)``, as in C.
    The clamps are C's ``MAX``/``MIN`` macros (``a > b ? a : b``), through which a NaN passes:
    ``n_ctx_orig == 0`` with a zero $\beta$ ($0/0$) or with ``n_dims == 0`` ($0 \cdot \ln 0$)
    gives ``(nan, nan)``, as in ggml (YaRN's angles are then NaN).

    Args:
        n_dims: number of rotated dimensions.
        n_ctx_orig: context length the model was trained with (``n_ctx_orig_yarn``).
        freq_base: the base $b$ of the frequency schedule.
        beta_fast: pairs turning more than this many times extrapolate (low end).
        beta_slow: pairs turning fewer than this many times interpolate (high end).
        dtype: arithmetic type (ggml: float32).

    Returns:
        ``(low, high)`` as Python floats.

    Examples:
        >>> rope_yarn_corr_dims(128, 4096, 10000.0, 32.0, 1.0)
        (20.0, 46.0)
    """
    dt = np.dtype(dtype).type

    def corr_dim(n_rot: float) -> np.floating:
        # ggml_rope_yarn_corr_dim: n_dims * log(n_ctx_orig / (n_rot * 2 pi)) / (2 log(base))
        # n_ctx_orig == 0 (ggml's default) gives log(0) = -inf, exactly as in C
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = libm(np.log, dt(n_ctx_orig) / (dt(n_rot) * dt(2) * dt(np.pi)))
            return dt(n_dims) * ratio / (dt(2) * libm(np.log, dt(freq_base)))

    start = np.floor(corr_dim(beta_fast))
    end = np.ceil(corr_dim(beta_slow))
    # C's MAX(a, b) is `a > b ? a : b` and MIN(a, b) `a < b ? a : b`: a NaN passes through
    low = dt(0) if dt(0) > start else start
    high = dt(n_dims - 1) if dt(n_dims - 1) < end else end
    return float(low), float(high)


# --8<-- [end:rope_yarn_corr_dims]


# --8<-- [start:rope_yarn_ramp]
def rope_yarn_ramp(low: float, high: float, i0: np.ndarray, dtype: type = np.float32) -> np.ndarray:
    r"""YaRN's ramp: 1 for pairs below ``low`` (extrapolate), 0 above ``high`` (interpolate).

    Mirrors ``rope_yarn_ramp`` (``ops.cpp``), where ``i0`` is the even dimension index and
    $j = i_0/2$ the pair index:

    $$
    \text{ramp}(j) = 1 - \operatorname{clamp}\!\left(\frac{j - \text{low}}
    {\max(0.001,\ \text{high} - \text{low})},\ 0,\ 1\right).
    $$

    Args:
        low: first correction dim (from [`rope_yarn_corr_dims`][]).
        high: last correction dim.
        i0: even dimension indices, any shape, integer.
        dtype: arithmetic type (ggml: float32).

    Returns:
        The ramp, same shape as ``i0``, in ``dtype``.

    Examples:
        >>> rope_yarn_ramp(1.0, 3.0, np.arange(0, 10, 2)).tolist()
        [1.0, 1.0, 0.5, 0.0, 0.0]
    """
    dt = np.dtype(dtype).type
    # C evaluates `i0 / 2 - low` as an int converted to float, then float arithmetic
    j = (np.asarray(i0) // 2).astype(dt)
    y = (j - dt(low)) / np.maximum(dt(0.001), dt(high) - dt(low))
    return (dt(1) - np.minimum(dt(1), np.maximum(dt(0), y))).astype(dt)


# --8<-- [end:rope_yarn_ramp]


# --8<-- [start:rope_yarn]
def rope_yarn(
    theta_extrap: np.ndarray,
    freq_scale: float,
    corr_dims: tuple[float, float],
    i0: np.ndarray,
    ext_factor: float,
    mscale: float,
) -> tuple[np.ndarray, np.ndarray]:
    r"""cos and sin of the (YaRN-corrected) angle, times the magnitude scale.

    Mirrors ``rope_yarn`` (``ops.cpp``). Linear interpolation ("position interpolation")
    shrinks every angle, $\theta_{interp} = s\,\theta_{extrap}$ with $s$ = ``freq_scale``.
    YaRN (``ext_factor`` $= \epsilon \ne 0$) keeps the fast pairs extrapolated and blends:

    $$
    r = \text{ramp}(j)\,\epsilon, \qquad
    \theta = \theta_{interp} (1 - r) + \theta_{extrap}\, r, \qquad
    m \leftarrow m \,\big(1 + 0.1 \ln(1/s)\big).
    $$

    Args:
        theta_extrap: unscaled angles, any shape, float32 or float64.
        freq_scale: $s$; 1 means no interpolation.
        corr_dims: ``(low, high)`` from [`rope_yarn_corr_dims`][].
        i0: even dimension index of each angle, broadcastable to ``theta_extrap``.
        ext_factor: YaRN's mix $\epsilon$; 0 disables YaRN (then $m$ is left as given).
        mscale: magnitude $m$ (``attn_factor`` when called from [`rope_cache_init`][]).

    Returns:
        ``(cos_theta, sin_theta)``, each shaped like ``theta_extrap``: $m\cos\theta$, $m\sin\theta$.

    Examples:
        >>> c, s = rope_yarn(np.float32([0.0, np.pi / 2]), 1.0, (0.0, 1.0), np.int64([0, 2]),
        ...                  0.0, 1.0)
        >>> np.round(c, 6).tolist(), np.round(s, 6).tolist()
        ([1.0, -0.0], [0.0, 1.0])
    """
    dt = theta_extrap.dtype.type
    theta_interp = dt(freq_scale) * theta_extrap
    theta = theta_interp
    mscale = dt(mscale)
    if ext_factor != 0.0:
        ramp_mix = rope_yarn_ramp(corr_dims[0], corr_dims[1], i0, dt) * dt(ext_factor)
        theta = theta_interp * (dt(1) - ramp_mix) + theta_extrap * ramp_mix
        # magnitude correction for interpolation; it multiplies every rotated value
        mscale = mscale * (dt(1) + dt(0.1) * libm(np.log, dt(1) / dt(freq_scale)))
    return libm(np.cos, theta) * mscale, libm(np.sin, theta) * mscale


# --8<-- [end:rope_yarn]


# --8<-- [start:rope_theta]
def rope_theta(
    pos: np.ndarray, n_dims: int, freq_base: float, dtype: type = np.float32
) -> np.ndarray:
    r"""Unscaled angles $\theta_j(p) = p \cdot b^{-2j/n_{dims}}$, built the way ggml builds them.

    ``ggml_rope_cache_init`` does not evaluate the closed form: it starts at $\theta_0 = p$ and
    multiplies by ``theta_scale`` $= b^{-2/n_{dims}}$ (one ``powf``) once per pair, in float32:

    $$
    \theta_0 = p, \qquad \theta_{j+1} = \mathrm{fl}(\theta_j \cdot \mathrm{fl}(b^{-2/n_{dims}})).
    $$

    Each step rounds, so $\theta_j$ carries a relative error of up to
    $j\,(2 + 2\ln b / n_{dims})\,2^{-24}$ against the exact closed form (``rope.md`` measures
    it). The reference repeats the recurrence to agree with ggml; in float64 the two forms agree
    to ~1e-15 relative.

    Args:
        pos: positions, shape (n_tokens,), integer (any sign).
        n_dims: number of rotated dimensions (even).
        freq_base: the base $b$.
        dtype: arithmetic type (ggml: float32).

    Returns:
        Angles, shape (n_tokens, n_dims // 2), in ``dtype``.

    Examples:
        >>> rope_theta(np.array([0, 1, 2]), 4, 100.0).tolist()
        [[0.0, 0.0], [1.0, 0.10000000149011612], [2.0, 0.20000000298023224]]
    """
    dt = np.dtype(dtype).type
    with np.errstate(divide="ignore"):  # n_dims == 0: -2/0 = -inf, and there are no pairs
        theta_scale = libm(np.power, dt(freq_base), dt(-2.0) / dt(n_dims))
    theta = np.empty((len(pos), n_dims // 2), dtype=dt)  # (n_tokens, n_dims/2)
    theta_j = np.asarray(pos).astype(dt)  # (n_tokens,)
    for j in range(n_dims // 2):
        theta[:, j] = theta_j
        theta_j = theta_j * theta_scale
    return theta


# --8<-- [end:rope_theta]


# --8<-- [start:rope_cache_init]
def rope_cache_init(
    pos: np.ndarray,
    n_dims: int,
    freq_base: float,
    freq_scale: float,
    freq_factors: np.ndarray | None,
    corr_dims: tuple[float, float],
    ext_factor: float,
    attn_factor: float,
    dtype: type = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    r"""The per-token cos/sin cache: ``ggml_rope_cache_init`` for every position at once.

    Pair $j$ of a token at position $p$ gets angle $\theta_j(p) / f_j$ (``freq_factors`` $f$,
    used by Llama 3 and Phi-3 long-context scaling; 1 when absent), then [`rope_yarn`][].

    Args:
        pos: positions, shape (n_tokens,), integer.
        n_dims: number of rotated dimensions (even).
        freq_base: the base $b$.
        freq_scale: linear interpolation factor $s$.
        freq_factors: per-pair divisors, shape (>= n_dims // 2,), or None.
        corr_dims: ``(low, high)`` from [`rope_yarn_corr_dims`][].
        ext_factor: YaRN mix $\epsilon$.
        attn_factor: magnitude $m$ before YaRN's correction.
        dtype: arithmetic type (ggml: float32).

    Returns:
        ``(cos_theta, sin_theta)``, each of shape (n_tokens, n_dims // 2).

    Examples:
        >>> c, s = rope_cache_init(np.array([0, 1]), 2, 10000.0, 1.0, None, (0.0, 1.0), 0.0, 1.0)
        >>> c.shape, s.dtype, bool(s[1, 0] == np.float32(np.sin(1.0)))
        ((2, 1), dtype('float32'), True)
    """
    dt = np.dtype(dtype).type
    theta_extrap = rope_theta(pos, n_dims, freq_base, dt)  # (n_tokens, n_dims/2)
    if freq_factors is not None:
        ff = np.asarray(freq_factors)[: n_dims // 2].astype(dt)  # (n_dims/2,)
        theta_extrap = theta_extrap / ff
    i0 = 2 * np.arange(n_dims // 2)  # (n_dims/2,) the even dimension index of each pair
    return rope_yarn(theta_extrap, freq_scale, corr_dims, i0, ext_factor, attn_factor)


# --8<-- [end:rope_cache_init]


# --8<-- [start:rotate_pairs]
def rotate_pairs(
    x: np.ndarray, cos_theta: np.ndarray, sin_theta: np.ndarray, n_dims: int, mode: int
) -> np.ndarray:
    r"""Rotate the pairs of the first ``n_dims`` dims of every head; copy the rest.

    Mirrors ``rotate_pairs`` and the pass-through loop of ``ggml_compute_forward_rope_flt``.
    Pair $j$ is $(x_{2j}, x_{2j+1})$ for ``ROPE_TYPE_NORM``, $(x_j, x_{j+n_{dims}/2})$ for
    ``ROPE_TYPE_NEOX``; each becomes $(x_a c - x_b s,\ x_a s + x_b c)$.

    Args:
        x: (..., n_tokens, n_head, head_dim), in the compute dtype.
        cos_theta: (n_tokens, n_dims // 2), from [`rope_cache_init`][].
        sin_theta: (n_tokens, n_dims // 2).
        n_dims: number of rotated dimensions (even, <= head_dim).
        mode: ``ROPE_TYPE_NORM`` or ``ROPE_TYPE_NEOX``.

    Returns:
        The rotated copy, same shape and dtype as ``x``.

    Examples:
        >>> x = np.arange(6, dtype=np.float32).reshape(1, 1, 6)
        >>> c, s = np.float32([[0.0, 0.0]]), np.float32([[1.0, 1.0]])  # a quarter turn
        >>> rotate_pairs(x, c, s, 4, ROPE_TYPE_NORM).tolist()
        [[[-1.0, 0.0, -3.0, 2.0, 4.0, 5.0]]]
        >>> rotate_pairs(x, c, s, 4, ROPE_TYPE_NEOX).tolist()
        [[[-2.0, -3.0, 0.0, 1.0, 4.0, 5.0]]]
    """
    half = n_dims // 2
    if mode == ROPE_TYPE_NORM:
        a, b = np.s_[..., 0:n_dims:2], np.s_[..., 1:n_dims:2]  # x[2j], x[2j+1]
    else:
        a, b = np.s_[..., 0:half], np.s_[..., half:n_dims]  # x[j], x[j + n_dims/2]
    c = cos_theta[:, None, :]  # (n_tokens, 1, n_dims/2): the same angles for every head
    s = sin_theta[:, None, :]  # (n_tokens, 1, n_dims/2)
    x0, x1 = x[a], x[b]  # (..., n_tokens, n_head, n_dims/2) each
    out = x.copy()  # dims n_dims.. pass through unchanged
    out[a] = x0 * c - x1 * s
    out[b] = x0 * s + x1 * c
    return out


# --8<-- [end:rotate_pairs]


def check_rope_args(x: np.ndarray, pos: np.ndarray, params: RopeParams,
                    freq_factors: np.ndarray | None) -> None:
    """Raise [`RopeError`][] for arguments ggml would assert on (or silently misuse).

    Shared by [`rope_ext`][], [`rope_back`][], the models' one-cache rope and the MLX twin.

    Args:
        x: ``(..., n_tokens, n_head, head_dim)`` (only its shape is read).
        pos: the positions, ``(n_tokens,)`` integers.
        params: the [`RopeParams`][].
        freq_factors: ``(>= n_dims // 2,)`` or None.

    Raises:
        RopeError: ``x`` with fewer than 3 dims; ``n_dims`` odd, negative or > head_dim;
            ``mode`` not NORM/NEOX; ``pos`` not ``(n_tokens,)`` integers; ``freq_factors``
            too short.

    Examples:
        >>> check_rope_args(np.zeros((2, 1, 4)), np.array([0, 1]), RopeParams(3), None)
        Traceback (most recent call last):
        ...
        reference.ops.rope.RopeError: n_dims must be even and in [0, head_dim=4], got 3
    """
    n_dims, mode = params.n_dims, params.mode
    if x.ndim < 3:
        raise RopeError(f"x must be (..., n_tokens, n_head, head_dim), got shape {x.shape}")
    head_dim = x.shape[-1]
    if n_dims < 0 or n_dims % 2 != 0 or n_dims > head_dim:
        raise RopeError(f"n_dims must be even and in [0, head_dim={head_dim}], got {n_dims}")
    if mode not in (ROPE_TYPE_NORM, ROPE_TYPE_NEOX):
        raise RopeError(
            f"mode must be ROPE_TYPE_NORM (0) or ROPE_TYPE_NEOX (2), got {mode} "
            "(multi-section rope is not part of this specification)"
        )
    if pos.ndim != 1 or len(pos) != x.shape[-3]:
        raise RopeError(f"pos must have shape (n_tokens,) = ({x.shape[-3]},), got {pos.shape}")
    if not np.issubdtype(pos.dtype, np.integer):
        raise RopeError(f"pos must be integer positions, got dtype {pos.dtype}")
    if freq_factors is not None:
        ff = np.asarray(freq_factors)
        if ff.ndim != 1 or len(ff) < n_dims // 2:
            raise RopeError(f"freq_factors must have shape (>= {n_dims // 2},), got {ff.shape}")


# --8<-- [start:rope_cache]
def rope_cache(
    pos: np.ndarray,
    params: RopeParams,
    freq_factors: np.ndarray | None = None,
    dtype: type = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    r"""The cos/sin cache of one rope: YaRN's correction dims, then [`rope_cache_init`][].

    What ``ggml_compute_forward_rope_flt`` computes before its loop over the heads, from the
    nine numbers of [`RopeParams`][]: [`rope_yarn_corr_dims`][] (from ``n_ctx_orig``,
    ``freq_base``, ``beta_fast``, ``beta_slow``), then the cache of every position.

    Args:
        pos: positions, shape (n_tokens,), integer.
        params: the [`RopeParams`][].
        freq_factors: per-pair divisors, shape (>= n_dims // 2,), or None.
        dtype: arithmetic type (ggml: float32).

    Returns:
        ``(cos_theta, sin_theta)``, each of shape (n_tokens, n_dims // 2).

    Examples:
        >>> c, s = rope_cache(np.array([0, 1]), RopeParams(2))
        >>> c.shape, bool(s[1, 0] == np.float32(np.sin(1.0)))
        ((2, 1), True)
    """
    dt = np.dtype(dtype).type
    p = params
    corr_dims = rope_yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast,
                                    p.beta_slow, dt)
    return rope_cache_init(pos, p.n_dims, p.freq_base, p.freq_scale, freq_factors, corr_dims,
                           p.ext_factor, p.attn_factor, dt)  # (n_tokens, n_dims/2) each


# --8<-- [end:rope_cache]


# --8<-- [start:rope_ext]
def rope_ext(
    x: np.ndarray,
    pos: np.ndarray,
    params: RopeParams,
    freq_factors: np.ndarray | None = None,
) -> np.ndarray:
    r"""Rotate the first ``n_dims`` dims of every head of every token by its position.

    ``ggml_rope_ext(ctx, x, pos, freq_factors, n_dims, mode, n_ctx_orig, freq_base, freq_scale,
    ext_factor, attn_factor, beta_fast, beta_slow)`` on the CPU backend, its nine numbers
    held by ``params``. All heads of a token share one cos/sin cache
    ([`rope_cache`][], ``ggml_rope_cache_init``); a pair $j$ of a token at position $p$
    becomes $m\,R(\theta_j(p))$ times the pair. Without YaRN ($\epsilon = 0$), $m$ is
    ``attn_factor``.

    Args:
        x: (..., n_tokens, n_head, head_dim), any float dtype (ggml computes in float32;
            float64 input is computed in float64).
        pos: (n_tokens,), integer positions; any sign (the K-shift passes deltas).
        params: the [`RopeParams`][]: ``n_dims`` (even, <= head_dim), ``mode``, the base and
            scale of the frequencies, YaRN's numbers.
        freq_factors: (>= n_dims // 2,) per-pair frequency divisors, or None.

    Returns:
        Same shape and dtype as ``x``.

    Raises:
        RopeError: ``n_dims`` odd, negative or > head_dim; ``pos`` not (n_tokens,) integers;
            ``mode`` not NORM/NEOX; ``freq_factors`` too short; ``x`` with fewer than 3 dims.

    Examples:
        >>> x = np.ones((2, 1, 4), dtype=np.float32)  # two tokens, one head, head_dim 4
        >>> y = rope_ext(x, np.array([0, 1]), RopeParams(n_dims=2))  # rotate only dims 0, 1
        >>> y[0].tolist() == x[0].tolist(), y[1, 0, 2:].tolist()
        (True, [1.0, 1.0])
        >>> np.allclose(y[1, 0, :2], [np.cos(1) - np.sin(1), np.sin(1) + np.cos(1)])
        True
    """
    x = np.asarray(x)
    pos = np.asarray(pos)
    check_rope_args(x, pos, params, freq_factors)
    dt = rope_dtype(x.dtype)
    cos_theta, sin_theta = rope_cache(pos, params, freq_factors, dt)  # (n_tokens, n_dims/2) each
    out = rotate_pairs(x.astype(dt), cos_theta, sin_theta, params.n_dims, params.mode)
    return out.astype(x.dtype, copy=False)


# --8<-- [end:rope_ext]


# --8<-- [start:rope_back]
def rope_back(
    grad: np.ndarray,
    pos: np.ndarray,
    params: RopeParams,
    freq_factors: np.ndarray | None = None,
) -> np.ndarray:
    r"""``ggml_rope_ext_back``: the gradient of ``rope_ext`` for ``x``, the inverse rotation.

    RoPE maps each pair by $m R(\theta)$ with $R$ a rotation, a linear map whose transpose is
    $m R(\theta)^T = m R(-\theta)$. So the backward is the same kernel with the sine negated
    (``sin_sign = -1`` in ``ggml_rope_cache_init``, ``ggml_compute_forward_rope_flt(...,
    forward=false)``):

    $$
    \begin{pmatrix} \bar x_a \\ \bar x_b \end{pmatrix} = m
    \begin{pmatrix} \cos\theta_j & \sin\theta_j \\ -\sin\theta_j & \cos\theta_j \end{pmatrix}
    \begin{pmatrix} \bar y_a \\ \bar y_b \end{pmatrix}.
    $$

    Every step of the angle computation is odd in the position, so this equals
    ``rope_ext(grad, -pos, ...)`` exactly. The dimensions past ``n_dims`` pass through. The
    arguments are those of the forward; there is no gradient for ``pos`` or ``freq_factors``
    (ggml asserts the latter).

    Args:
        grad: $\bar y$, ``(..., n_tokens, n_head, head_dim)``.
        pos: the forward's positions ``(n_tokens,)``.
        params: the forward's [`RopeParams`][].
        freq_factors: the forward's, or None.

    Returns:
        $\bar x$, same shape and dtype as ``grad``.

    Raises:
        RopeError: the arguments ``rope_ext`` refuses.

    Examples:
        >>> x = np.random.default_rng(0).standard_normal((3, 2, 4))
        >>> pos, p = np.array([0, 5, 9]), RopeParams(n_dims=4)
        >>> bool(np.allclose(rope_back(rope_ext(x, pos, p), pos, p), x))
        True
    """
    grad = np.asarray(grad)
    pos = np.asarray(pos)
    check_rope_args(grad, pos, params, freq_factors)
    dt = rope_dtype(grad.dtype)
    cos_theta, sin_theta = rope_cache(pos, params, freq_factors, dt)  # (n_tokens, n_dims/2) each
    out = rotate_pairs(grad.astype(dt), cos_theta, -sin_theta, params.n_dims, params.mode)
    return out.astype(grad.dtype, copy=False)  # R(-theta)


# --8<-- [end:rope_back]
