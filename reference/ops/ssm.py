r"""``ggml_ssm_conv`` and ``ggml_ssm_scan``: the two operators of a Mamba layer.

A Mamba layer keeps, per sequence, a fixed-size memory instead of a KV cache: the last
$d_{conv} - 1$ inputs of its short causal convolution (the *conv state*) and the hidden state
$h$ of its selective state space model (the *ssm state*). Both operators read the previous
state and return the next one, so a prompt can be processed in any number of chunks.

**The causal depthwise convolution** (``ggml_ssm_conv``, ``ggml_compute_forward_ssm_conv_f32``).
The model concatenates the conv state (the previous $d_{conv}-1$ inputs) with the new inputs
along the token axis, giving ``sx`` with $d_{conv} - 1 + T$ columns per channel. Output token
$t$ of channel $d$ is the dot product of the $d_{conv}$ columns $t, \dots, t + d_{conv} - 1$
with the channel's filter:

$$
y_{t,d} = \sum_{k=0}^{d_{conv}-1} sx_{d,\,t+k}\; c_{d,k}.
$$

**The selective scan** (``ggml_ssm_scan``, ``ggml_compute_forward_ssm_scan_f32``). For every
head $h$, every channel $p$ of the head and every state index $n$, with
$\Delta_t = \mathrm{softplus}(dt_t)$ computed *inside* the op:

$$
\mathbf{h}_t = e^{\Delta_t A}\odot \mathbf{h}_{t-1} + \Delta_t\, x_t\, B_t,
\qquad
y_t = \mathbf{h}_t \cdot C_t ,
$$

that is $h_{t,p,n} = e^{\Delta_t A_{n}} h_{t-1,p,n} + \Delta_t x_{t,p} B_{t,n}$ and
$y_{t,p} = \sum_n h_{t,p,n} C_{t,n}$. Mamba-1 has one decay per state index
($A$ is ``(d_inner, d_state)``, one "head" per channel, ``head_dim = 1``); Mamba-2 (SSD) has
one scalar decay per head ($A$ is ``(n_head, 1)``), heads of ``head_dim > 1`` channels, and
``n_group`` groups of $B$/$C$ shared by consecutive heads. The op has no $D$ skip and no
gate: the model adds $D \odot x$ and applies $\mathrm{silu}(z)$ (and, for Mamba-2, a grouped
RMS norm) afterwards (``build_mamba_layer`` / ``build_mamba2_layer`` in
``src/models/mamba-base.cpp``).

Shapes are in NumPy order (ggml's ``ne`` reversed). A ubatch of a recurrent memory comes from
``split_equal``: ``n_seqs`` sequence sets of ``n_seq_tokens`` tokens each, token ``i`` of set
``s`` at ubatch index ``s * n_seq_tokens + i``, so ``(n_tokens, ...)`` reshapes to
``(n_seqs, n_seq_tokens, ...)``.
"""

from __future__ import annotations

import numpy as np

from reference.ops.errors import OpIndexError, OpShapeError, OpTypeError


def ssm_conv_sizes(sx_shape: tuple, c_shape: tuple) -> tuple[int, int, int, int]:
    """``(n_seqs, conv_dim, n_seq_tokens, d_conv)`` of an ``ssm_conv``, checked.

    Pure shape bookkeeping, shared with the MLX twin.

    Args:
        sx_shape: ``(n_seqs, conv_dim, d_conv - 1 + n_seq_tokens)``.
        c_shape: ``(conv_dim, d_conv)``.

    Raises:
        OpShapeError: the shapes do not fit each other.

    Examples:
        >>> ssm_conv_sizes((2, 8, 6), (8, 4))
        (2, 8, 3, 4)
    """
    if len(sx_shape) != 3 or len(c_shape) != 2:
        raise OpShapeError(
            f"ssm_conv: sx must be (n_seqs, conv_dim, d_conv - 1 + n_seq_tokens) and c "
            f"(conv_dim, d_conv), got sx {tuple(sx_shape)} and c {tuple(c_shape)}"
        )
    n_seqs, conv_dim, n_cols = sx_shape
    d_conv = c_shape[1]
    n_seq_tokens = n_cols - (d_conv - 1)
    if c_shape[0] != conv_dim or n_seq_tokens < 0:
        raise OpShapeError(
            f"ssm_conv: sx {tuple(sx_shape)} does not fit c {tuple(c_shape)}: need "
            f"sx.shape[1] == c.shape[0] and at least d_conv - 1 = {d_conv - 1} columns in sx"
        )
    return n_seqs, conv_dim, n_seq_tokens, d_conv


# --8<-- [start:ssm_conv]
def ssm_conv(sx: np.ndarray, c: np.ndarray) -> np.ndarray:
    r"""``ggml_ssm_conv(sx, c)``: the causal depthwise 1-D convolution of a ubatch.

    ``sx`` is the conv state of each sequence concatenated with its new inputs along the
    token axis (``ggml_concat(conv, transpose(x), 0)`` in the model graph). Window $t$ is
    ``sx[..., t : t + d_conv]``:

    $$
    y_{s,t,d} = \sum_{k=0}^{d_{conv}-1} sx_{s,d,t+k}\,c_{d,k},
    \qquad t = 0, \dots, T - 1 .
    $$

    **The self-overlapping view.** ggml does not copy the windows out (no im2col): its kernel
    points at column $t$ and reads $d_{conv}$ consecutive floats. As an array this is a view of
    shape ``(n_seqs, conv_dim, T, d_conv)`` whose token axis and tap axis have the *same*
    stride (one column): window $t + 1$ starts one element after window $t$, so consecutive
    windows overlap in $d_{conv} - 1$ elements of the same memory.

    **The state update** is not part of the op: the model copies the last $d_{conv} - 1$
    columns of ``sx`` (``sx[..., T:]``, the inputs the next chunk's first windows need) back
    into the recurrent memory. Convolving in chunks and carrying that slice gives the same
    result as convolving at once.

    The sum runs over the taps in order, in the input dtype (ggml: a float ``sumf``, not
    ``ggml_vec_dot_f32``, whose sum is double). The bias and the SiLU come after, in the model.

    Args:
        sx: ``(n_seqs, conv_dim, d_conv - 1 + n_seq_tokens)`` [ggml ``ne`` =
            ``[d_conv - 1 + n_t, conv_dim, n_s]``]; ``conv_dim`` is ``d_inner`` for Mamba-1,
            ``d_inner + 2 * n_group * d_state`` for Mamba-2.
        c: ``(conv_dim, d_conv)``, the ``ssm_conv1d`` weight.

    Returns:
        ``(n_seqs, n_seq_tokens, conv_dim)``, in the dtype of ``sx`` and ``c``.

    Raises:
        OpShapeError: ``sx`` is not 3-D, ``c`` not 2-D, their ``conv_dim`` differ, or ``sx``
            has fewer than ``d_conv - 1`` columns.

    Examples:
        >>> import numpy as np
        >>> conv_state = np.zeros((1, 2, 2))                     # (n_seqs, conv_dim, d_conv - 1)
        >>> x = np.array([[[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]])  # (n_seqs, T, conv_dim)
        >>> sx = np.concatenate([conv_state, x.transpose(0, 2, 1)], axis=-1)  # (1, 2, 5)
        >>> c = np.array([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])     # (conv_dim, d_conv)
        >>> ssm_conv(sx, c)                       # channel 0: identity; channel 1: running sum
        array([[[ 1., 10.],
                [ 2., 30.],
                [ 3., 60.]]])
        >>> sx[..., 3:]                           # the new conv state: the last d_conv - 1 columns
        array([[[ 2.,  3.],
                [20., 30.]]])
    """
    n_seqs, conv_dim, n_seq_tokens, d_conv = ssm_conv_sizes(sx.shape, c.shape)
    # The self-overlapping view: the token axis steps one column, like the tap axis.
    step = sx.strides[-1]
    windows = np.lib.stride_tricks.as_strided(
        sx, shape=(n_seqs, conv_dim, n_seq_tokens, d_conv), strides=(*sx.strides, step),
        writeable=False,
    )  # (n_seqs, conv_dim, n_seq_tokens, d_conv)
    y = np.sum(windows * c[:, None, :], axis=-1)  # (n_seqs, conv_dim, n_seq_tokens)
    return y.transpose(0, 2, 1)  # (n_seqs, n_seq_tokens, conv_dim)


# --8<-- [end:ssm_conv]


# --8<-- [start:compute_softplus]
SOFTPLUS_THRESHOLD = 20.0


def compute_softplus(dt: np.ndarray) -> np.ndarray:
    r"""``ggml_compute_softplus_f32``: the softplus ``ssm_scan`` applies to ``dt``.

    $$
    \mathrm{softplus}(x) = \begin{cases} x & x > 20 \\ \log(1 + e^x) & x \le 20 \end{cases}
    $$

    The threshold 20 is the official Mamba kernel's (``mamba_ssm/ops/triton/softplus.py``),
    where $\log(1 + e^{20}) - 20 \approx 2 \cdot 10^{-9}$ is below float32 resolution. ggml
    writes ``logf(1 + expf(x))`` where the official kernel writes ``log1p(exp(x))``: for
    $x \lesssim -17$ in float32, $1 + e^x$ rounds to 1 and ggml's softplus is exactly 0 (the
    official one is $\approx e^x$). The reference follows ggml.

    Args:
        dt: any shape, floating point.

    Returns:
        Same shape and dtype as ``dt``.

    Examples:
        >>> import numpy as np
        >>> compute_softplus(np.array([0.0, 25.0], dtype=np.float32))
        array([ 0.6931472, 25.       ], dtype=float32)
        >>> float(compute_softplus(np.float32(-20.0)))  # 1 + exp(-20) == 1 in float32
        0.0
    """
    dt = np.asarray(dt)
    below = np.minimum(dt, dt.dtype.type(SOFTPLUS_THRESHOLD))  # no overflow in exp
    return np.where(dt > SOFTPLUS_THRESHOLD, dt, np.log(1 + np.exp(below)))


# --8<-- [end:compute_softplus]


def check_scan_args(s, x, dt, A, B, C, ids) -> None:
    """Raise before computing anything if the shapes do not fit (ggml's GGML_ASSERTs).

    The arguments of [`ssm_scan`][]; shared with the MLX twin, which reads ``ids`` on the host.

    Raises:
        OpShapeError: shapes that do not fit (every problem named in one message).
        OpTypeError: ``ids`` is not an integer array.
        OpIndexError: a state row of ``ids`` out of range.
    """
    if x.ndim != 4 or s.ndim != 4 or dt.ndim != 3 or A.ndim != 2 or B.ndim != 4:
        raise OpShapeError(
            "ssm_scan: need s (n_rs, n_head, head_dim, d_state), x (n_seqs, n_seq_tokens, "
            "n_head, head_dim), dt (n_seqs, n_seq_tokens, n_head), A (n_head, d_state or 1), "
            f"B and C (n_seqs, n_seq_tokens, n_group, d_state); got s {s.shape}, x {x.shape}, "
            f"dt {dt.shape}, A {A.shape}, B {B.shape}"
        )
    n_seqs, n_seq_tokens, n_head, head_dim = x.shape
    d_state = s.shape[3]
    n_group = B.shape[2]
    problems = []
    if s.shape[1:3] != (n_head, head_dim):
        problems.append(f"s {s.shape} must be (n_rs, {n_head}, {head_dim}, d_state)")
    if dt.shape != (n_seqs, n_seq_tokens, n_head):
        problems.append(f"dt {dt.shape} must be {(n_seqs, n_seq_tokens, n_head)}")
    if A.shape not in ((n_head, d_state), (n_head, 1)):
        problems.append(f"A {A.shape} must be ({n_head}, {d_state}) or ({n_head}, 1)")
    if B.shape != (n_seqs, n_seq_tokens, n_group, d_state) or C.shape != B.shape:
        problems.append(f"B {B.shape} and C {C.shape} must both be "
                        f"{(n_seqs, n_seq_tokens, 'n_group', d_state)}")
    if n_group == 0 or n_head % n_group != 0:
        problems.append(f"n_head = {n_head} must be a multiple of n_group = {n_group}")
    if ids.shape != (n_seqs,):
        problems.append(f"ids {ids.shape} must be ({n_seqs},)")
    if problems:
        raise OpShapeError("ssm_scan: " + "; ".join(problems))
    if not np.issubdtype(ids.dtype, np.integer):
        raise OpTypeError(f"ssm_scan: ids must be integers (ggml: I32), got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= s.shape[0]):
        raise OpIndexError(f"ssm_scan: ids {ids.tolist()} outside the {s.shape[0]} rows of s")


# --8<-- [start:ssm_scan]
def ssm_scan(
    s: np.ndarray,
    x: np.ndarray,
    dt: np.ndarray,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    r"""``ggml_ssm_scan(s, x, dt, A, B, C, ids, K=1)``: the selective scan of a ubatch.

    Sequence $i$ starts from state row ``s[ids[i]]`` and runs over its ``n_seq_tokens``
    tokens; for each token, with $\Delta = \mathrm{softplus}(dt)$ ([`compute_softplus`][],
    applied *inside* the op) and head $h$ reading group $g = \lfloor h / (n_{head} /
    n_{group}) \rfloor$ of $B$ and $C$ (consecutive heads share a group, like GQA;
    ggml's comment: ``repeat_interleave``):

    $$
    h_{h,p,n} \leftarrow e^{\Delta_h A_{h,n}}\, h_{h,p,n} + \Delta_h\, x_{h,p}\, B_{g,n},
    \qquad
    y_{h,p} = \sum_n h_{h,p,n}\, C_{g,n}.
    $$

    Mamba-1 passes ``A`` as ``(d_inner, d_state)`` with ``n_head = d_inner``, ``head_dim = 1``,
    ``n_group = 1``; Mamba-2 passes one scalar per head, ``A`` ``(n_head, 1)``, which
    broadcasts over the state index. ``A`` is already negative (the GGUF converter stores
    $-e^{A_{log}}$). No $D$ skip, no gate: those are in the model graph.

    **One output tensor in ggml.** ggml returns a flat float32 tensor: ``y``
    (``n_seqs * n_seq_tokens * n_head * head_dim`` values, ``(n_seqs, n_seq_tokens, n_head,
    head_dim)`` in C order) followed by the final states (``K`` blocks of ``(n_seqs, n_head,
    head_dim, d_state)``). The reference returns the pair ``(y, states)``; ``np.concatenate
    ([y.ravel(), states.ravel()])`` is ggml's tensor for ``K = 1``.

    **K** (at the pinned commit) is the number of state snapshots to return for rollback:
    block 0 is the final state, block $k$ for $0 < k < \min(K, T)$ the state after token
    $T - 1 - k$. Mamba-2 passes ``K = n_rs_seq + 1`` (``cparams.n_rs_seq`` snapshots for
    speculative rollback, 0 by default, so ``K = 1``); Mamba-1 must pass ``K = 1`` (ggml
    asserts it). The reference implements ``K = 1`` only.

    **Zero tokens.** With ``n_seq_tokens == 0`` the reference returns ``s[ids]`` (nothing was
    scanned); ggml leaves the state part of its output unwritten (llama.cpp never does this).

    Args:
        s: ``(n_rs, n_head, head_dim, d_state)`` [ne ``[d_state, head_dim, n_head, n_rs]``],
            the state rows; ``n_rs >= 1`` rows, any of which a sequence may start from.
        x: ``(n_seqs, n_seq_tokens, n_head, head_dim)`` [ne ``[head_dim, n_head, n_t, n_s]``].
        dt: ``(n_seqs, n_seq_tokens, n_head)``, *before* the softplus (bias already added).
        A: ``(n_head, d_state)`` (Mamba-1) or ``(n_head, 1)`` (Mamba-2) [ne reversed].
        B: ``(n_seqs, n_seq_tokens, n_group, d_state)``; ``n_head % n_group == 0``.
        C: same shape as ``B``.
        ids: ``(n_seqs,)`` integers: the state row of ``s`` each sequence starts from (rows
            may repeat: two sequences may start from one state).

    Returns:
        ``(y, states)``: ``y`` ``(n_seqs, n_seq_tokens, n_head, head_dim)`` and the final
        states ``(n_seqs, n_head, head_dim, d_state)`` in sequence order (row ``i`` is
        sequence ``i``'s, not row ``ids[i]``), in the common dtype of the float inputs.

    Raises:
        OpShapeError: the shapes do not fit together (ggml would assert).
        OpTypeError: ``ids`` is not an integer array.
        OpIndexError: an id is outside ``[0, n_rs)``.

    Examples:
        >>> import numpy as np
        >>> s = np.zeros((1, 1, 1, 1))                    # (n_rs, n_head, head_dim, d_state)
        >>> x = np.ones((1, 3, 1, 1))                     # (n_seqs, n_seq_tokens, n_head, head_dim)
        >>> dt = np.full((1, 3, 1), 30.0)                 # softplus(30) == 30: Δ = 30
        >>> A = np.array([[-np.log(2) / 30]])             # e^{ΔA} = 1/2: Mamba-2 form (n_head, 1)
        >>> B = C = np.full((1, 3, 1, 1), 1 / 30)         # Δ·B = 1, C = 1/30
        >>> y, states = ssm_scan(s, x, dt, A, B, C, ids=np.array([0]))
        >>> y[0, :, 0, 0] * 30                            # h = 1, 1.5, 1.75
        array([1.  , 1.5 , 1.75])
        >>> states.shape                                  # (n_seqs, n_head, head_dim, d_state)
        (1, 1, 1, 1)
    """
    ids = np.asarray(ids)
    check_scan_args(s, x, dt, A, B, C, ids)
    n_seqs, n_seq_tokens, n_head, head_dim = x.shape
    dtype = np.result_type(s, x, dt, A, B, C)
    delta = compute_softplus(dt.astype(dtype))  # (n_seqs, n_seq_tokens, n_head)
    # Head h reads group h // (n_head // n_group): repeat each group for its heads.
    heads_per_group = n_head // B.shape[2]
    B_h = np.repeat(B.astype(dtype), heads_per_group, axis=2)  # (n_seqs, n_t, n_head, d_state)
    C_h = np.repeat(C.astype(dtype), heads_per_group, axis=2)  # (n_seqs, n_t, n_head, d_state)
    A_h = A.astype(dtype)[:, None, :]  # (n_head, 1, d_state or 1)
    h = s[ids].astype(dtype)  # (n_seqs, n_head, head_dim, d_state)
    y = np.empty((n_seqs, n_seq_tokens, n_head, head_dim), dtype=dtype)
    for t in range(n_seq_tokens):
        d_t = delta[:, t, :, None, None]  # (n_seqs, n_head, 1, 1)
        dA = np.exp(d_t * A_h)  # (n_seqs, n_head, 1, d_state or 1)
        x_dt = x[:, t, :, :, None].astype(dtype) * d_t  # (n_seqs, n_head, head_dim, 1)
        h = h * dA + B_h[:, t, :, None, :] * x_dt  # (n_seqs, n_head, head_dim, d_state)
        y[:, t] = np.sum(h * C_h[:, t, :, None, :], axis=-1)  # (n_seqs, n_head, head_dim)
    return y, h


# --8<-- [end:ssm_scan]
