r"""Twin of [`reference.ops.ssm`][reference.ops.ssm]: ``ggml_ssm_conv`` and ``ggml_ssm_scan`` on
MLX.

No fused kernel: both are written with lazy MLX ops. The convolution is MLX's depthwise
``conv1d`` (one group per channel), the same windows as the reference's self-overlapping view;
the scan is a Python loop over the ubatch's tokens that builds one lazy graph (one decay, one
update and one readout per token), evaluated once. The shape checks are the reference's;
``ids`` is bookkeeping and is read on the host to be validated.

Each op of a graph costs the host a microsecond or two on a small model (``docs/performance.md``,
"Fewer nodes per token"), so both keep their node count low: one convolution node instead of a
slice, a product and a sum per tap, and for a one-token ubatch (generation) the scan's
per-token operands are reshapes of the whole, not slices, and a single group of ``B``/``C``
is broadcast over the heads rather than repeated for each.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from accelerated.ops.convert import as_mx
from reference.ops.ssm import SOFTPLUS_THRESHOLD, check_scan_args, ssm_conv_sizes

__all__ = ["SOFTPLUS_THRESHOLD", "compute_softplus", "ssm_conv", "ssm_scan"]


def _result_dtype(*arrays: mx.array) -> mx.Dtype:
    """MLX's promoted dtype of ``arrays`` (``np.result_type``), from a lazy 0-d sum."""
    total = mx.zeros((), dtype=arrays[0].dtype)
    for a in arrays[1:]:
        total = total + mx.zeros((), dtype=a.dtype)
    return total.dtype


# --8<-- [start:ssm_conv]
def ssm_conv(sx: mx.array, c: mx.array) -> mx.array:
    r"""Twin of [`reference.ops.ssm.ssm_conv`][reference.ops.ssm.ssm_conv].

    ``mx.conv1d`` with ``groups = conv_dim``: channel $c$'s output at token $t$ is
    $\sum_k sx_{c, t + k}\, c_{c, k}$, a cross-correlation as ggml's (no flipped kernel). One
    graph node; the sum's order is the kernel's, so it agrees with the reference's tap order to
    float32 rounding.

    Examples:
        >>> import numpy as np
        >>> sx = np.array([[[0, 0, 1, 2, 3], [0, 0, 10, 20, 30]]], dtype=np.float32)
        >>> c = np.array([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=np.float32)
        >>> ssm_conv(sx, c).tolist()
        [[[1.0, 10.0], [2.0, 30.0], [3.0, 60.0]]]
    """
    sx, c = as_mx(sx), as_mx(c)
    n_seqs, conv_dim, n_seq_tokens, d_conv = ssm_conv_sizes(sx.shape, c.shape)
    dtype = _result_dtype(sx, c)
    if n_seq_tokens == 0:
        return mx.zeros((n_seqs, 0, conv_dim), dtype=dtype)
    x = sx.astype(dtype).transpose(0, 2, 1)  # (n_seqs, d_conv - 1 + n_t, conv_dim): channels last
    w = c.astype(dtype)[:, :, None]  # (conv_dim, d_conv, 1): one input channel per group
    return mx.conv1d(x, w, groups=conv_dim)  # (n_seqs, n_seq_tokens, conv_dim)


# --8<-- [end:ssm_conv]


# --8<-- [start:compute_softplus]
def compute_softplus(dt: mx.array) -> mx.array:
    r"""Twin of [`reference.ops.ssm.compute_softplus`][reference.ops.ssm.compute_softplus].

    The same ``log(1 + exp(x))`` below the threshold (not ``log1p``), so
    ``compute_softplus(-20) == 0`` in float32 here too.

    Examples:
        >>> compute_softplus(mx.array([0.0, 25.0, -20.0])).tolist()
        [0.6931471824645996, 25.0, 0.0]
    """
    dt = as_mx(dt)
    below = mx.minimum(dt, SOFTPLUS_THRESHOLD)  # no overflow in exp
    return mx.where(dt > SOFTPLUS_THRESHOLD, dt, mx.log(1 + mx.exp(below)))


# --8<-- [end:compute_softplus]


# --8<-- [start:ssm_scan]
def ssm_scan(
    s: mx.array,
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
    ids: mx.array,
) -> tuple[mx.array, mx.array]:
    r"""Twin of [`reference.ops.ssm.ssm_scan`][reference.ops.ssm.ssm_scan].

    A Python loop over tokens building one lazy MLX graph; groups of ``B``/``C`` are
    repeated for their heads with ``mx.repeat``, except a single group (Mamba-1, and
    Mamba-2 with ``n_group = 1``), which broadcasts over the heads as it is; returns
    ``(y, states)`` as MLX arrays.

    Examples:
        >>> import numpy as np
        >>> s = np.zeros((1, 1, 1, 1), dtype=np.float32)
        >>> x = np.ones((1, 3, 1, 1), dtype=np.float32)
        >>> dt = np.full((1, 3, 1), 30.0, dtype=np.float32)
        >>> A = np.array([[-np.log(2) / 30]], dtype=np.float32)
        >>> B = C = np.full((1, 3, 1, 1), 1 / 30, dtype=np.float32)
        >>> y, states = ssm_scan(s, x, dt, A, B, C, ids=np.array([0]))
        >>> [round(v * 30, 5) for v in y[0, :, 0, 0].tolist()], states.shape
        ([1.0, 1.5, 1.75], (1, 1, 1, 1))
    """
    ids_np = np.asarray(ids)
    s, x, dt, A, B, C = (as_mx(a) for a in (s, x, dt, A, B, C))
    check_scan_args(s, x, dt, A, B, C, ids_np)
    n_seqs, n_seq_tokens, n_head, head_dim = x.shape
    dtype = _result_dtype(s, x, dt, A, B, C)
    delta = compute_softplus(dt.astype(dtype))  # (n_seqs, n_seq_tokens, n_head)
    heads_per_group = n_head // B.shape[2]
    B_h, C_h = B.astype(dtype), C.astype(dtype)  # (n_seqs, n_t, n_group, d_state) each
    if heads_per_group > 1 and B.shape[2] > 1:  # one group broadcasts: no repeat nodes
        B_h = mx.repeat(B_h, heads_per_group, axis=2)  # (n_seqs, n_t, n_head, d_state)
        C_h = mx.repeat(C_h, heads_per_group, axis=2)  # (n_seqs, n_t, n_head, d_state)
    A_h = A.astype(dtype)[:, None, :]  # (n_head, 1, d_state or 1)
    if np.array_equal(ids_np, np.arange(s.shape[0])):  # every row in order: no gather
        h = s.astype(dtype)  # (n_seqs, n_head, head_dim, d_state)
    else:
        h = s[mx.array(ids_np.astype(np.int32))].astype(dtype)  # (n_seqs, n_head, hd, d_state)
    x = x.astype(dtype)
    d_state, n_bc = B_h.shape[-1], B_h.shape[2]  # n_bc: n_head, or 1 group for every head

    def token(a: mx.array, t: int, shape: tuple) -> mx.array:
        """Token ``t``'s slice of ``a`` ``(n_seqs, n_t, ...)``, as ``shape``: one reshape
        when the ubatch has one token per sequence."""
        return a.reshape(shape) if n_seq_tokens == 1 else a[:, t].reshape(shape)

    ys = []
    for t in range(n_seq_tokens):
        d_t = token(delta, t, (n_seqs, n_head, 1, 1))
        dA = mx.exp(d_t * A_h)  # (n_seqs, n_head, 1, d_state or 1)
        x_dt = token(x, t, (n_seqs, n_head, head_dim, 1)) * d_t  # (n_seqs, n_head, head_dim, 1)
        B_t = token(B_h, t, (n_seqs, n_bc, 1, d_state))
        h = h * dA + B_t * x_dt  # (n_seqs, n_head, head_dim, d_state)
        C_t = token(C_h, t, (n_seqs, n_bc, 1, d_state))
        ys.append(mx.sum(h * C_t, axis=-1))  # (n_seqs, n_head, head_dim)
    if len(ys) == 1:
        y = ys[0][:, None]  # (n_seqs, 1, n_head, head_dim)
    elif ys:
        y = mx.stack(ys, axis=1)  # (n_seqs, n_seq_tokens, n_head, head_dim)
    else:
        y = mx.zeros((n_seqs, 0, n_head, head_dim), dtype=dtype)
    return y, h


# --8<-- [end:ssm_scan]
