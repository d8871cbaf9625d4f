r"""``ggml_soft_max_ext`` and llama.cpp's attention, ``llm_graph_context::build_attn_mha``.

**Softmax with mask, scale and ALiBi.** ``ggml_soft_max_ext(x, mask, scale, max_bias)``
normalizes every row (last axis) of ``x`` of shape ``(..., n_head, n_tokens, n_kv)``:

$$
w_{h,t,j} = \mathrm{scale}\cdot x_{h,t,j} + m_h\, \mathrm{mask}_{t,j},\qquad
\mathrm{soft\_max\_ext}(x)_{h,t,j} = \frac{e^{w_{h,t,j} - \max_{j'} w_{h,t,j'}}}
    {\sum_{j'} e^{w_{h,t,j'} - \max_{j'} w_{h,t,j'}}}.
$$

The mask is additive: $0$ where key $j$ is visible to query $t$, $-\infty$ where it is not, so
a hidden key gets exactly zero weight. It is shared by all heads (its leading dimensions tile
into ``x``'s, ``i12 = i02 % ne12``). $m_h$ is the ALiBi slope of head $h$; it is 1 for every
head when ``max_bias == 0`` (no ALiBi). Otherwise, with $n_h$ heads (ggml's
``n_head_log2`` is the largest power of two $\le n_h$, $H = 2^{\lfloor\log_2 n_h\rfloor}$):

$$
m_0 = 2^{-\mathrm{max\_bias}/H},\quad m_1 = 2^{-\mathrm{max\_bias}/(2H)},\qquad
m_h = \begin{cases} m_0^{\,h+1} & h < H\\ m_1^{\,2(h-H)+1} & h \ge H \end{cases}
$$

and the mask holds $-|i - j|$-style distances instead of zeros, so the slope scales a distance.

Precision, as in ``ggml_compute_forward_soft_max_f32``: $w$ and the exponentials are float,
their sum is accumulated in double (``ggml_float``), and the row is multiplied by
``float(1.0 / sum)``.

Its backward, for training, is ``ggml_soft_max_ext_back`` ([`soft_max_ext_back`][]): from the
forward's output $y$ alone, $\bar x = \mathrm{scale}\cdot y \odot (\bar y - \sum_j y_j \bar y_j)$.

**A fully masked row** (every key hidden from a query) has maximum $-\infty$; ggml's softmax
then computes $e^{-\infty - (-\infty)} = e^{\mathrm{NaN}}$ and returns NaN for the whole row
(a debug build asserts ``sum > 0``). ggml's own ``flash_attn_ext`` returns zeros for such a
row (``S_inv = S == 0 ? 0 : 1/S``). The specification follows the flash path: **the row is all
zeros** (nothing is visible, so nothing contributes). In llama.cpp this never happens for a
real token, which always sees at least its own cell.

**Attention.** ``build_attn_mha`` (the non-flash branch of ``src/llama-graph.cpp``) is built
from the ops above, in this order, with ``q`` ``(n_tokens, n_head, d_k)``, ``k``
``(n_kv, n_head_kv, d_k)``, ``v`` ``(n_kv, n_head_kv, d_v)``:

1. permute ``q``, ``k``, ``v`` to put the head first (``ggml_permute(.., 0, 2, 1, 3)``);
2. ``kq = mul_mat(k, q)``: $(n_\text{head}, n_\text{tokens}, n_\text{kv})$, GQA by
   ``mul_mat``'s block broadcast (query head $h$ uses KV head
   $\lfloor h / (n_\text{head}/n_\text{head\_kv}) \rfloor$);
3. with a soft-cap $c > 0$ (Gemma 2's ``attn_soft_cap``): ``kq = softcap(kq, c)``,
   $c \tanh(kq / c)$ ([`reference.ops.softcap.softcap`][reference.ops.softcap.softcap]), on
   the scores *before* ``kq_scale`` and the mask (Gemma scales $q$ beforehand and passes
   ``kq_scale = 1``);
4. ``kq = soft_max_ext(kq, kq_mask, kq_scale, max_bias)``;
5. ``kqv = mul_mat(v^T, kq)``: $(n_\text{head}, n_\text{tokens}, d_v)$ (llama.cpp's cache stores
   V already transposed when flash attention is off; otherwise it transposes here);
6. permute back and make contiguous: $(n_\text{tokens}, n_\text{head} \cdot d_v)$.

$$
\mathrm{out}_{t,h} = \sum_j \mathrm{softmax}_j\!\big(\mathrm{kq\_scale}\; q_{t,h}\cdot k_{j,g(h)}
    + \mathrm{mask}_{t,j}\big)\, v_{j,g(h)},\qquad g(h) = \lfloor h\, n_\text{head\_kv} /
    n_\text{head} \rfloor.
$$

**Streams.** A KV cache with one stream per sequence (``kv_unified = false``) gives a ubatch
whose tokens come in ``n_stream`` equal blocks, one per stream, and whose cells in view come in
``n_stream`` blocks of ``n_kv`` cells. llama.cpp views ``q``, ``k``, ``v`` and the mask as 4-D
tensors with the stream as the outermost dimension (``ggml_view_4d(q, d, n_head,
n_tokens/n_stream, n_stream)``), so every step above runs once per stream and a token's block
attends to its own stream's cells only. Here ``n_stream`` does the same: the mask rows of
stream $s$ are read at stream $s$'s columns (the other streams' columns are $-\infty$ there
anyway), and the work is $n_\text{stream}$ times smaller than one attention over every cell.

**Reading only the visible cells.** A hidden cell has weight exactly 0 ($e^{-\infty} = 0$), so
it adds nothing to a token's output, and the attention over the cells a token sees equals the
attention over every cell in view:

$$
\mathrm{out}_{t,h} = \sum_{j \in V_t} \mathrm{softmax}_{j \in V_t}\!\big(\mathrm{kq\_scale}\;
    q_{t,h}\cdot k_{j,g(h)} + \mathrm{mask}_{t,j}\big)\, v_{j,g(h)},\qquad
    V_t = \{\,j : \mathrm{mask}_{t,j} > -\infty\,\}.
$$

When every token sees few of the cells in view, ``build_attn_mha`` computes this form
([`attend_visible`][reference.ops.attention.attend_visible]): each token reads its own cells
and nothing else. That is the case of parallel decoding in a unified cache, where each of 32
sequences sees about $1/32$ of the cells; ggml's CPU flash attention, which llama.cpp picks on
the CPU (``flash_attn_type`` ``auto``), skips the same cells (``if (mv == -INFINITY)
continue;``, ``ggml/src/ggml-cpu/ops.cpp``). The values are those of the full product up to
the order of float additions.

Not covered here (other ``build_attn_mha`` branches): Grok's soft-capping, ``kq_b``,
attention sinks, MLA.
"""

from __future__ import annotations

import numpy as np

from reference.ops.errors import OpShapeError, OpValueError
from reference.ops.matmul import mul_mat
from reference.ops.softcap import softcap as softcap_op


# --8<-- [start:alibi_slopes]
def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    r"""The per-head ALiBi slopes of ``ggml_soft_max_ext``, as float32 (``powf`` in ggml).

    Args:
        n_head: number of heads ($\ge 1$).
        max_bias: ``f_max_alibi_bias``; ``0`` disables ALiBi (every slope is 1).

    Returns:
        ``(n_head,)`` float32.

    Raises:
        OpShapeError: if ``n_head < 1``.

    Examples:
        >>> alibi_slopes(4, 8.0)
        array([0.25      , 0.0625    , 0.015625  , 0.00390625], dtype=float32)
        >>> alibi_slopes(3, 0.0)
        array([1., 1., 1.], dtype=float32)
    """
    if n_head < 1:
        raise OpShapeError(f"alibi_slopes: n_head must be at least 1, got {n_head}")
    if max_bias <= 0.0:
        return np.ones(n_head, dtype=np.float32)
    f32 = np.float32
    n_head_log2 = 1 << int(np.floor(np.log2(n_head)))  # largest power of 2 <= n_head
    # One float32 power per head, as ggml's powf: NumPy's scalar float32 power is C's powf,
    # its vectorized loop over an array is not (one ulp off, e.g. head 9 of 12 at bias 8).
    m0 = f32(2.0) ** f32(-max_bias / n_head_log2)
    m1 = f32(2.0) ** f32(-(max_bias / 2.0) / n_head_log2)
    slopes = [m0 ** f32(h + 1) if h < n_head_log2 else m1 ** f32(2 * (h - n_head_log2) + 1)
              for h in range(n_head)]
    return np.array(slopes, dtype=f32)  # (n_head,)


# --8<-- [end:alibi_slopes]


def check_soft_max_args(x: np.ndarray, mask: np.ndarray | None, max_bias: float) -> None:
    """The asserts of ``ggml_soft_max_impl``, as exceptions (shared with the MLX twin).

    Args:
        x: the scores ``(..., n_head, n_tokens, n_kv)`` (only the shape is read).
        mask: the mask, or None.
        max_bias: the ALiBi maximum bias.

    Raises:
        OpShapeError: ``x`` is 0-D, ALiBi without a mask, or a mask that does not fit ``x``
            (``(..., n_rows >= n_tokens, n_kv)`` with leading dimensions dividing ``x``'s).

    Examples:
        >>> check_soft_max_args(np.zeros((2, 3, 4)), np.zeros((3, 4)), 0.0)
        >>> check_soft_max_args(np.zeros((2, 3, 4)), None, 8.0)
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpShapeError: soft_max_ext: ALiBi (max_bias > 0) needs a mask
    """
    if x.ndim < 1:
        raise OpShapeError("soft_max_ext: x must have at least one dimension")
    if mask is None:
        if max_bias > 0.0:
            raise OpShapeError("soft_max_ext: ALiBi (max_bias > 0) needs a mask")
        return
    ok = mask.ndim >= 2 and x.ndim >= 2 and mask.ndim <= x.ndim
    ok = ok and mask.shape[-1] == x.shape[-1] and mask.shape[-2] >= x.shape[-2]
    if ok:
        lead_x = x.shape[: x.ndim - 2][x.ndim - mask.ndim:]
        ok = all(m and dx % m == 0 for dx, m in zip(lead_x, mask.shape[:-2], strict=True))
    if not ok:
        raise OpShapeError(
            f"soft_max_ext: mask must be (..., n_rows >= n_tokens, n_kv) with leading dims "
            f"dividing x's; got x.shape={x.shape}, mask.shape={mask.shape}"
        )


# --8<-- [start:soft_max_ext]
def soft_max_ext(
    x: np.ndarray,
    mask: np.ndarray | None = None,
    scale: float = 1.0,
    max_bias: float = 0.0,
) -> np.ndarray:
    r"""``ggml_soft_max_ext(x, mask, scale, max_bias)``: softmax of ``scale*x + slope*mask``.

    Args:
        x: ``(..., n_head, n_tokens, n_kv)`` (a 2-D ``(n_tokens, n_kv)`` is one head).
        mask: additive mask ``(n_tokens_pad, n_kv)`` (``0`` visible, ``-inf`` hidden), or with
            leading dimensions that tile into ``x``'s; only its first ``n_tokens`` rows are
            read (llama.cpp pads the mask's rows). ``None``: no mask.
        scale: multiplies ``x`` before the mask is added (``kq_scale``, $1/\sqrt{d_k}$).
        max_bias: ALiBi maximum bias; ``0`` disables ALiBi. Needs a mask when ``> 0``.

    Returns:
        Same shape and dtype as ``x``; every row sums to 1, except a fully masked row,
        which is all zeros (ggml's non-flash kernel gives NaN there, see the module docstring).

    Raises:
        OpShapeError: if the mask does not fit ``x``, or ``max_bias > 0`` without a mask.

    Examples:
        >>> import numpy as np
        >>> kq = np.zeros((1, 2, 3))                      # (n_head, n_tokens, n_kv)
        >>> causal = np.array([[0.0, -np.inf, -np.inf],
        ...                    [0.0, 0.0, -np.inf]])      # (n_tokens, n_kv)
        >>> soft_max_ext(kq, causal)
        array([[[1. , 0. , 0. ],
                [0.5, 0.5, 0. ]]])
    """
    check_soft_max_args(x, mask, max_bias)
    t = x.dtype.type
    # w is the one array of x's size made here: every later step updates it in place (at
    # long context x is the largest array of a forward, n_head * n_tokens * n_kv floats)
    w = x * t(scale)  # (..., n_head, n_tokens, n_kv)
    if mask is not None:
        m = _mask_over(mask[..., : x.shape[-2], :], x.shape).astype(x.dtype, copy=False)
        if max_bias > 0.0:
            n_head = x.shape[-3] if x.ndim >= 3 else 1  # a 2-D x is head 0 of 1
            slope = alibi_slopes(n_head, max_bias).astype(x.dtype)  # (n_head,)
            slope = slope.reshape((n_head, 1, 1)[3 - min(x.ndim, 3):])  # (n_head, 1, 1)
            w += slope * m  # (..., n_head, n_tokens, n_kv)
        else:  # no ALiBi: every slope is 1, and 1 * m is m (ggml multiplies by 1.0f)
            w += m  # (..., n_head, n_tokens, n_kv)
    row_max = np.max(w, axis=-1, keepdims=True)  # (..., n_tokens, 1)
    visible = np.isfinite(row_max)  # False for a fully masked row
    w -= np.where(visible, row_max, t(0))
    e = np.exp(w, out=w)  # (..., n_tokens, n_kv)
    total = np.sum(e, axis=-1, dtype=np.float64, keepdims=True)  # ggml_float accumulation
    # 1/sum in double, applied in float (ggml_vec_scale_f32); a fully masked row stays zero
    with np.errstate(divide="ignore"):
        inv = np.where(total > 0, 1.0 / total, 0.0).astype(x.dtype)  # (..., n_tokens, 1)
    e *= inv
    return e  # (..., n_head, n_tokens, n_kv)


# --8<-- [end:soft_max_ext]


def check_soft_max_back_args(grad_shape: tuple, y_shape: tuple, max_bias: float) -> None:
    """[`soft_max_ext_back`][]'s contract: one gradient per probability, no ALiBi.

    Shared with the MLX twin.

    Raises:
        OpShapeError: if the shapes differ.
        OpValueError: if ``max_bias != 0`` (ggml has no backward for ALiBi).

    Examples:
        >>> check_soft_max_back_args((2, 3), (2, 3), 8.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpValueError: soft_max_ext_back: ggml has no backward for ALiBi ...
    """
    if tuple(grad_shape) != tuple(y_shape):
        raise OpShapeError(f"soft_max_ext_back: grad {tuple(grad_shape)} and y {tuple(y_shape)} "
                           "differ")
    if max_bias != 0.0:
        raise OpValueError("soft_max_ext_back: ggml has no backward for ALiBi (max_bias != 0)")


# --8<-- [start:soft_max_ext_back]
def soft_max_ext_back(
    grad: np.ndarray, y: np.ndarray, scale: float = 1.0, max_bias: float = 0.0
) -> np.ndarray:
    r"""``ggml_soft_max_ext_back``: the gradient of ``soft_max_ext(x, mask, scale)`` for ``x``.

    The softmax's Jacobian is $\mathrm{diag}(y) - y y^T$ and $w = \mathrm{scale}\cdot x +
    \mathrm{mask}$, so per row

    $$ \bar x = \mathrm{scale}\cdot y \odot \left(\bar y - \textstyle\sum_j y_j \bar y_j\right). $$

    It needs only the forward's *output* $y$. Hidden keys ($y_j = 0$) get zero gradient; the
    mask itself gets none (ggml asserts that nothing asks for it). CPU kernel:
    ``ggml_compute_forward_soft_max_ext_back_f32`` (dot, subtract, multiply, scale).

    Args:
        grad: $\bar y$, ``(..., n_kv)``.
        y: the forward's output, same shape.
        scale: the forward's ``scale`` (``kq_scale``).
        max_bias: must be 0: ggml has no backward for ALiBi.

    Returns:
        $\bar x$, same shape and dtype as ``y``.

    Raises:
        OpShapeError: if the shapes differ.
        OpValueError: if ``max_bias != 0``.

    Examples:
        >>> import numpy as np
        >>> soft_max_ext_back(np.array([1.0, 0.0]), np.array([0.5, 0.5]), scale=2.0)
        array([ 0.5, -0.5])
    """
    check_soft_max_back_args(grad.shape, y.shape, max_bias)
    t = y.dtype.type
    dot = np.sum(y * grad, axis=-1, keepdims=True)  # (..., 1)
    return ((grad - dot) * y * t(scale)).astype(y.dtype, copy=False)


# --8<-- [end:soft_max_ext_back]


def tile_reps(mask_shape: tuple[int, ...], x_shape: tuple[int, ...]) -> tuple[int, ...]:
    """How many times each dimension of the mask repeats to cover ``x`` (rows/cols once).

    ggml reads mask row ``i % dm`` for ``x``'s index ``i`` in a leading dimension; shared with
    the MLX twin, which tiles the mask by these counts.

    Examples:
        >>> tile_reps((2, 1, 3, 5), (2, 4, 3, 5)), tile_reps((3, 5), (4, 3, 5))
        ((1, 4, 1, 1), (4, 1, 1))
    """
    lead = (1,) * (len(x_shape) - len(mask_shape)) + tuple(mask_shape[:-2])
    return tuple(dx // dm for dx, dm in zip(x_shape[:-2], lead, strict=True)) + (1, 1)


def _mask_over(mask: np.ndarray, x_shape: tuple[int, ...]) -> np.ndarray:
    """The mask repeated over ``x``'s leading dimensions, as ggml reads it (row ``i % dm``).

    Where each leading dimension of the mask is 1 or ``x``'s own, NumPy's broadcasting is that
    repetition already, and the mask is returned as it is (no copy per head); only a dimension
    that repeats several rows of its own (``1 < dm < dx``) needs ``np.tile``.

    Examples:
        >>> m = np.array([[[0.0]], [[1.0]]])          # two masks of one cell
        >>> _mask_over(m, (4, 1, 1))[:, 0, 0]          # 4 heads: masks 0, 1, 0, 1
        array([0., 1., 0., 1.])
        >>> _mask_over(m, (2, 1, 1)) is m
        True
    """
    reps = tile_reps(mask.shape, x_shape)
    lead = (1,) * (len(x_shape) - mask.ndim) + tuple(mask.shape[:-2])
    if any(r > 1 and dm > 1 for r, dm in zip(reps[:-2], lead, strict=True)):
        return np.tile(mask, reps)
    return mask


# --8<-- [start:stream_blocks]
def stream_blocks(x: np.ndarray, n_stream: int) -> np.ndarray:
    """``x`` ``(n, ...)`` as ``n_stream`` equal blocks ``(n_stream, n / n_stream, ...)`` (a view).

    Examples:
        >>> stream_blocks(np.arange(6).reshape(6, 1), 2)[:, :, 0]
        array([[0, 1, 2],
               [3, 4, 5]])
    """
    return x.reshape((n_stream, x.shape[0] // n_stream) + x.shape[1:])


def stream_mask(kq_mask: np.ndarray, n_stream: int) -> np.ndarray:
    """The diagonal blocks of a ``(n_tokens, n_stream * n_kv)`` mask: stream $s$'s tokens at
    stream $s$'s cells, ``(n_stream, 1, n_tokens / n_stream, n_kv)`` (1: shared by the heads).

    Examples:
        >>> m = np.arange(16.0).reshape(4, 4)   # 2 streams: 2 tokens x 2 cells each
        >>> stream_mask(m, 2)[:, 0]
        array([[[ 0.,  1.],
                [ 4.,  5.]],
        <BLANKLINE>
               [[10., 11.],
                [14., 15.]]])
    """
    if n_stream == 1:
        return kq_mask[None, None]  # (1, 1, n_tokens, n_kv): a view, no copy per layer
    n_tokens, n_cols = kq_mask.shape
    m = kq_mask.reshape(n_stream, n_tokens // n_stream, n_stream, n_cols // n_stream)
    s = np.arange(n_stream)
    return m[s, :, s, :][:, None]  # (n_stream, 1, n_tokens/ns, n_kv)
# --8<-- [end:stream_blocks]


# --8<-- [start:build_attn_mha]
def build_attn_mha(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kq_mask: np.ndarray,
    kq_scale: float,
    max_bias: float = 0.0,
    softcap: float = 0.0,
    n_stream: int = 1,
) -> np.ndarray:
    r"""Multi-head attention as ``llm_graph_context::build_attn_mha`` builds it (no flash attn).

    Args:
        q: queries ``(n_tokens, n_head, d_k)``, already RoPE'd.
        k: keys ``(n_kv, n_head_kv, d_k)`` (the visible part of the cache plus the new ones),
            or already cut per stream, ``(n_stream, n_kv / n_stream, n_head_kv, d_k)``
            (the cache's streams side by side, a view: no copy of the cells).
        v: values ``(n_kv, n_head_kv, d_v)``, or ``(n_stream, n_kv / n_stream, n_head_kv,
            d_v)`` as ``k``.
        kq_mask: additive mask ``(n_tokens_pad >= n_tokens, n_kv)``, built by the memory.
        kq_scale: the scale applied to $QK^T$, usually $1/\sqrt{d_k}$.
        max_bias: ALiBi maximum bias (``f_max_alibi_bias``), 0 for none.
        softcap: the attention logit soft-cap $c$ (``f_attn_logit_softcapping`` when
            ``hparams.attn_soft_cap``): $QK^T \mapsto c \tanh(QK^T / c)$ before the softmax;
            0 for none (then nothing else changes).
        n_stream: the KV streams of the ubatch: tokens and cells come in ``n_stream`` equal
            blocks and block $s$ of the tokens attends to block $s$ of the cells only
            (the module docstring's *Streams*).

    Returns:
        ``(n_tokens, n_head * d_v)``: for every token, the heads' outputs side by side.

    Raises:
        OpShapeError: if ``q`` is not 3-D or ``k``, ``v`` are neither 3-D nor 4-D with one
            block per stream, the dimensions disagree, ``n_head`` is not a multiple of
            ``n_head_kv``, or the tokens or cells do not split into ``n_stream`` equal
            blocks.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((2, 4, 8))   # (n_tokens, n_head, d_k)
        >>> k = rng.standard_normal((2, 2, 8))   # (n_kv, n_head_kv, d_k): GQA, 2 heads per KV head
        >>> v = rng.standard_normal((2, 2, 3))   # (n_kv, n_head_kv, d_v)
        >>> causal = np.array([[0.0, -np.inf], [0.0, 0.0]])
        >>> out = build_attn_mha(q, k, v, causal, kq_scale=8 ** -0.5)
        >>> out.shape
        (2, 12)
        >>> bool(np.allclose(out[0].reshape(4, 3), v[0, [0, 0, 1, 1]]))   # token 0 sees key 0
        True
    """
    check_attn_args(q, k, v, kq_mask, n_stream)
    n_tokens, n_head, _ = q.shape
    if n_stream == 1 and k.ndim == 3 and sees_few_cells(kq_mask[:n_tokens]):
        # the same outputs, reading only each token's visible cells (module docstring)
        return attend_visible(q, k, v, kq_mask, kq_scale, max_bias, softcap)
    ns = n_stream
    q = stream_blocks(q, ns).transpose(0, 2, 1, 3)  # (ns, n_head, n_tokens/ns, d_k)
    if k.ndim == 3:  # one flat block of cells: cut it per stream (a view)
        k, v = stream_blocks(k, ns), stream_blocks(v, ns)  # (ns, n_kv/ns, n_head_kv, d)
    k = k.transpose(0, 2, 1, 3)  # (ns, n_head_kv, n_kv/ns, d_k)
    v = v.transpose(0, 2, 1, 3)  # (ns, n_head_kv, n_kv/ns, d_v)
    mask = stream_mask(kq_mask[:n_tokens], ns)  # (ns, 1, n_tokens/ns, n_kv/ns)
    kq = mul_mat(k, q)  # (ns, n_head, n_tokens/ns, n_kv/ns)
    if softcap > 0.0:
        kq = softcap_op(kq, softcap)  # (ns, n_head, n_tokens/ns, n_kv/ns)
    kq = soft_max_ext(kq, mask, kq_scale, max_bias)  # (ns, n_head, n_tokens/ns, n_kv/ns)
    # llama.cpp's cache holds V transposed for this product; here v^T is a view of the
    # cells' rows (mul_mat reads its rows back as v's columns: no copy of the whole V)
    v_t = v.transpose(0, 1, 3, 2)  # (ns, n_head_kv, d_v, n_kv/ns)
    kqv = mul_mat(v_t, kq)  # (ns, n_head, n_tokens/ns, d_v)
    cur = kqv.transpose(0, 2, 1, 3)  # (ns, n_tokens/ns, n_head, d_v)
    return np.ascontiguousarray(cur).reshape(n_tokens, -1)  # (n_tokens, n_head * d_v)


# --8<-- [end:build_attn_mha]


# --8<-- [start:attend_visible]
FEW_CELLS = 16
"""A token "sees few cells" when it sees at most ``1 / FEW_CELLS`` of the cells in view.

Gathering a token's cells copies their K and V; scoring every cell copies nothing. So the
gathered form wins only when tokens see a small share of the cells: the bound is measured
(``docs/performance.md``, *The reference's fast paths*), and parallel decoding of 32
sequences in a unified cache, where each sees about $1/32$ of the cells, is below it."""


def sees_few_cells(kq_mask: np.ndarray) -> bool:
    """Whether every row of the mask ``(n_tokens, n_kv)`` sees at most ``n_kv / FEW_CELLS``
    cells: when [`build_attn_mha`][reference.ops.attention.build_attn_mha] takes its fast path,
    [`attend_visible`][reference.ops.attention.attend_visible].

    Examples:
        >>> m = np.full((2, 32), -np.inf); m[0, 0] = m[1, :2] = 0.0
        >>> sees_few_cells(m), sees_few_cells(m[:, :16])   # 2 of 32 cells; 2 of 16
        (True, False)
    """
    n_tokens, n_kv = kq_mask.shape
    if n_tokens == 0 or n_kv == 0:
        return False
    visible = kq_mask > -np.inf  # (n_tokens, n_kv)
    # the widest row's cells (one row, as in generation: the plain count, cheaper than the
    # count per row)
    most = np.count_nonzero(visible) if n_tokens == 1 else np.count_nonzero(visible, axis=1).max()
    return int(most) * FEW_CELLS <= n_kv


def visible_cells(kq_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""Each token's visible cells, in cell order: ``idx`` ``(n_tokens, n_vis)``, the cell
    indices, and ``mask`` ``(n_tokens, n_vis)``, the mask's values there; ``n_vis`` is the most
    cells any token sees (at least 1). A token that sees fewer is padded with cell 0 at mask
    $-\infty$ (a hidden cell: weight 0, as in the full product).

    Examples:
        >>> m = np.array([[0.0, -np.inf, -1.0], [-np.inf, 0.0, -np.inf]])
        >>> idx, mask = visible_cells(m)
        >>> idx.tolist(), mask.tolist()
        ([[0, 2], [1, 0]], [[0.0, -1.0], [0.0, -inf]])
    """
    # row by row, cells in order (flat indices: NumPy's 2-D nonzero is much slower)
    rows, cols = np.divmod(np.flatnonzero(kq_mask > -np.inf), kq_mask.shape[1])
    counts = np.bincount(rows, minlength=kq_mask.shape[0])  # (n_tokens,)
    n_vis = max(1, int(counts.max(initial=0)))  # one hidden cell when no token sees any
    slot = np.arange(rows.size) - (np.cumsum(counts) - counts)[rows]  # place within its row
    idx = np.zeros((kq_mask.shape[0], n_vis), dtype=np.intp)
    idx[rows, slot] = cols
    mask = np.full(idx.shape, -np.inf, dtype=kq_mask.dtype)
    mask[rows, slot] = kq_mask[rows, cols]
    return idx, mask


def attend_visible(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kq_mask: np.ndarray,
    kq_scale: float,
    max_bias: float = 0.0,
    softcap: float = 0.0,
) -> np.ndarray:
    r"""Fast path of [`build_attn_mha`][reference.ops.attention.build_attn_mha] (one stream)
    when every token sees few cells: the same steps, reading only the cells each token sees,
    token $t$'s own cells $V_t$ in place of every cell (the module docstring's *Reading only
    the visible cells*).

    Each token gets a copy of its cells' K and V. So that the copies never take more memory
    than the K and V in view, the tokens go in blocks of ``n_kv // n_vis`` (``n_vis``: the most
    cells a token sees): 32 sequences that each see 1/32 of the cells are one block.
    ``build_attn_mha`` takes this path when [`sees_few_cells`][] (the attention over every
    cell is its plain form). The property test
    ``tests/laws/test_ops_attention.py::test_hidden_cells_add_nothing_float64`` holds the two
    equal to float64 rounding, for any mask, GQA, ALiBi and soft-cap; its float32 twin bounds
    the float32 difference.

    Args:
        q: queries ``(n_tokens, n_head, d_k)``.
        k: keys ``(n_kv, n_head_kv, d_k)``.
        v: values ``(n_kv, n_head_kv, d_v)``.
        kq_mask: additive mask ``(n_tokens_pad >= n_tokens, n_kv)``.
        kq_scale: the scale of $QK^T$, as in ``build_attn_mha``.
        max_bias: ALiBi maximum bias, as in ``build_attn_mha``.
        softcap: the attention logit soft-cap, as in ``build_attn_mha``.

    Returns:
        ``(n_tokens, n_head * d_v)``, as ``build_attn_mha``.

    Raises:
        OpShapeError: as ``build_attn_mha``, or if ``k`` is not one block of at least one cell.

    Examples:
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal(s) for s in ((3, 4, 8), (6, 2, 8), (6, 2, 8)))
        >>> m = np.full((3, 6), -np.inf); m[0, 0] = m[1, [1, 3]] = m[2, [2, 4, 5]] = 0.0
        >>> full = build_attn_mha(q, k, v, m, 8 ** -0.5)   # sees_few_cells(m) is False
        >>> bool(np.allclose(attend_visible(q, k, v, m, 8 ** -0.5), full))
        True
    """
    check_visible_args(q, k, v, kq_mask)
    n_tokens, n_head, d_k = q.shape
    n_head_kv = k.shape[1]
    r = n_head // n_head_kv  # query heads per KV head
    idx, mask = visible_cells(kq_mask[:n_tokens])  # (n_tokens, n_vis)
    n_vis = idx.shape[1]
    per_block = visible_block(k.shape[0], n_vis)
    if n_tokens > per_block:  # in blocks: what is gathered never outgrows the cells in view
        return np.concatenate([
            attend_visible(q[i:i + per_block], k, v, kq_mask[i:i + per_block], kq_scale,
                           max_bias, softcap)
            for i in range(0, n_tokens, per_block)])  # (n_tokens, n_head * d_v)
    k_t = np.take(k, idx, axis=0).transpose(0, 2, 1, 3)  # (n_tokens, n_head_kv, n_vis, d_k)
    v_t = np.take(v, idx, axis=0).transpose(0, 2, 3, 1)  # (n_tokens, n_head_kv, d_v, n_vis)
    # the r query heads of one KV head as r rows (h = g * r + i reads KV head g)
    q_t = q.reshape(n_tokens, n_head_kv, r, d_k)  # (n_tokens, n_head_kv, r, d_k)
    kq = mul_mat(k_t, q_t).reshape(n_tokens, n_head, 1, n_vis)  # (n_tokens, n_head, 1, n_vis)
    if softcap > 0.0:
        kq = softcap_op(kq, softcap)
    kq = soft_max_ext(kq, mask[:, None, None, :], kq_scale, max_bias)  # as kq
    kqv = mul_mat(v_t, kq.reshape(n_tokens, n_head_kv, r, n_vis))  # (n_tokens, n_head_kv, r, d_v)
    return kqv.reshape(n_tokens, -1)  # (n_tokens, n_head * d_v)
# --8<-- [end:attend_visible]


def check_visible_args(q, k, v, kq_mask) -> None:
    """Shape checks of [`attend_visible`][] (either twin): ``build_attn_mha``'s, and ``k`` one
    block of at least one cell.

    Raises:
        OpShapeError: the shapes [`check_attn_args`][] refuses, or ``k`` not
            ``(n_kv >= 1, n_head_kv, d_k)``.

    Examples:
        >>> q, k = np.zeros((2, 4, 8)), np.zeros((0, 2, 8))
        >>> check_visible_args(q, k, k, np.zeros((2, 0)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpShapeError: attend_visible: k must be one block of cells ...
    """
    check_attn_args(q, k, v, kq_mask)
    if k.ndim != 3 or k.shape[0] == 0:
        raise OpShapeError(f"attend_visible: k must be one block of cells (n_kv >= 1, "
                           f"n_head_kv, d_k); got {k.shape}")


def visible_block(n_kv: int, n_vis: int) -> int:
    """Tokens per block of [`attend_visible`][]: as many as have their gathered cells fill the
    view once (``n_kv // n_vis``, at least one), so the copies never outgrow K and V.

    Examples:
        >>> visible_block(1024, 40), visible_block(16, 40)
        (25, 1)
    """
    return max(1, n_kv // n_vis)


def check_attn_args(q: np.ndarray, k: np.ndarray, v: np.ndarray, kq_mask: np.ndarray,
                    n_stream: int = 1) -> None:
    """Shape checks of ``build_attn_mha``, with messages naming llama.cpp's dimensions.

    Shared with the MLX twin and with the backward of attention
    ([`reference.training.grad.attn_back`][reference.training.grad.attn_back]).

    Args:
        q: ``(n_tokens, n_head, d_k)``.
        k: ``(n_kv, n_head_kv, d_k)``, or ``(n_stream, n_kv / n_stream, n_head_kv, d_k)``.
        v: ``(n_kv, n_head_kv, d_v)``, or blocked like ``k``.
        kq_mask: ``(n_tokens_pad >= n_tokens, n_kv)``.
        n_stream: the number of streams, each one equal block of tokens and of cells.

    Raises:
        OpShapeError: the first shape that does not fit, with the dimensions it needed.

    Examples:
        >>> q, k = np.zeros((2, 4, 8)), np.zeros((5, 2, 8))
        >>> check_attn_args(q, k, k, np.zeros((2, 5)))
        >>> k3 = np.zeros((5, 3, 8))
        >>> check_attn_args(q, k3, k3, np.zeros((2, 5)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpShapeError: build_attn_mha: n_head=4 must be a multiple of ...
    """
    blocked = k.ndim == 4 and v.ndim == 4  # (n_stream, n_kv / n_stream, heads, dim)
    if q.ndim != 3 or not (blocked or (k.ndim == 3 and v.ndim == 3)):
        raise OpShapeError(
            f"build_attn_mha: q must be 3-D (tokens, heads, dim), k and v 3-D too or 4-D "
            f"(streams, cells, heads, dim); got q={q.shape}, k={k.shape}, v={v.shape}"
        )
    if blocked and (k.shape[0] != n_stream or v.shape[:2] != k.shape[:2]):
        raise OpShapeError(
            f"build_attn_mha: 4-D k and v need one block per stream (n_stream={n_stream}); "
            f"got k={k.shape}, v={v.shape}"
        )
    # the shapes of the flat (n_kv, heads, dim) form
    k_shape = (k.shape[0] * k.shape[1],) + k.shape[2:] if blocked else k.shape
    v_shape = (v.shape[0] * v.shape[1],) + v.shape[2:] if blocked else v.shape
    n_tokens, n_head, d_k = q.shape
    n_kv, n_head_kv, _ = k_shape
    if k_shape[2] != d_k or v_shape[:2] != (n_kv, n_head_kv):
        raise OpShapeError(
            f"build_attn_mha: need k (n_kv, n_head_kv, d_k={d_k}) and v (n_kv, n_head_kv, d_v); "
            f"got q={q.shape}, k={k.shape}, v={v.shape}"
        )
    if n_head_kv == 0 or n_head % n_head_kv != 0:
        raise OpShapeError(
            f"build_attn_mha: n_head={n_head} must be a multiple of n_head_kv={n_head_kv}"
        )
    if kq_mask.ndim != 2 or kq_mask.shape[1] != n_kv or kq_mask.shape[0] < n_tokens:
        raise OpShapeError(
            f"build_attn_mha: kq_mask must be (n_tokens_pad >= {n_tokens}, n_kv={n_kv}); "
            f"got {kq_mask.shape}"
        )
    if n_stream < 1 or n_tokens % n_stream or n_kv % n_stream:
        raise OpShapeError(
            f"build_attn_mha: n_stream={n_stream} must be >= 1 and divide n_tokens={n_tokens} "
            f"and n_kv={n_kv} (one equal block of tokens and of cells per stream)"
        )
