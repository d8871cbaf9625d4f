r"""Twin of [`reference.ops.moe`][reference.ops.moe]: ``argsort_top_k``, ``mul_mat_id`` and
``build_moe_ffn`` on MLX.

What differs:

- ``mul_mat_id`` is one ``mx.gather_mm`` (``mx.gather_qmm`` for a quantized
  [`accelerated.quants.MLXQuantized`][accelerated.quants.MLXQuantized] expert tensor), as
  mlx-lm's ``SwitchLinear`` (``mlx_lm/models/switch_layers.py``): the expert index selects
  the matrix inside the kernel, so a token reads only its experts' weights and the packed
  experts stay packed; from `SORT_MIN_ROWS` rows on, the rows are sorted by expert first
  ([`experts_sorted`][], mlx-lm's ``_gather_sort``);
- ``argsort_top_k`` takes the largest value $k$ times (``mx.argmax``, which returns the first
  of equal values): the reference's order whenever a row has no ties or at most 16 values
  (libstdc++'s insertion sort keeps equal values in index order). Equal values in a row of
  more than 16 come in index order here, in introsort's order in the reference;
- the router's softmax sums in float32 (``mx.softmax(precise=True)``), the chosen weights'
  sum too; values that differ by a rounding may then choose another expert than the
  reference would (never seen on random models).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from accelerated.ops.attention import soft_max_ext
from accelerated.ops.convert import as_mx
from accelerated.ops.ffn import silu, swiglu
from accelerated.ops.matmul import mul_mat
from accelerated.quants import MLXQuantized
from reference.ops.errors import OpShapeError, OpValueError
from reference.ops.moe import (  # the host-side sort (ties) and checks, imported as they are
    MOE_WEIGHTS_SUM_MIN,
    STD_SORT_THRESHOLD,
    argsort,
    argsort_fast,
    check_mul_mat_id,
    expert_matrix,
    moe_weights,
    std_sort,
)


# --8<-- [start:argsort_top_k]
def argsort_top_k(a: mx.array, k: int) -> mx.array:
    """Twin of [`reference.ops.moe.argsort_top_k`][reference.ops.moe.argsort_top_k]. Equal
    values in index order (the module docstring).

    Examples:
        >>> argsort_top_k(mx.array([[0.1, 0.5, 0.3, 0.5]]), 2).tolist()
        [[1, 3]]
    """
    a = as_mx(a)
    n = a.shape[-1]
    if not 1 <= k <= n:
        raise OpValueError(f"argsort_top_k: k={k} must be in [1, {n}] (the row length)")
    if a.size == 0:  # no rows (a ubatch without outputs, after the last layer's get_rows)
        return mx.zeros((*a.shape[:-1], k), dtype=mx.int32)
    cols = mx.arange(n)  # (n,)
    picked = []
    for _ in range(k):
        j = mx.argmax(a, axis=-1, keepdims=True).astype(mx.int32)  # (..., 1): first of equals
        picked.append(j)
        a = mx.where(cols == j, -mx.inf, a)  # (..., n)
    return mx.concatenate(picked, axis=-1)  # (..., k)
# --8<-- [end:argsort_top_k]


def _shape(as_) -> tuple[int, ...]:
    return tuple(as_.shape)


# --8<-- [start:mul_mat_id]
def mul_mat_id(as_: Any, b: mx.array, ids: mx.array) -> mx.array:
    """Twin of [`reference.ops.moe.mul_mat_id`][reference.ops.moe.mul_mat_id]. One
    ``mx.gather_mm`` (``mx.gather_qmm`` for quantized experts).

    ``b`` ``(n_tokens, n_b, K)`` is taken as ``(n_tokens, n_ids, 1, K)`` (row ``e % n_b`` for
    the ``e``-th id) and multiplied by the transposed expert ``ids[t, e]``.

    Args:
        as_: ``(n_as, M, K)``: an ``mx.array`` or an ``MLXQuantized``.
        b: ``(n_tokens, n_b, K)``.
        ids: ``(n_tokens, n_ids)`` integers; checked on the host only when given as NumPy
            (inside a traced graph they are not read).

    Returns:
        float32 ``(n_tokens, n_ids, M)``, lazy.

    Examples:
        >>> as_ = mx.array(np.stack([np.eye(2), 2 * np.eye(2), 3 * np.eye(2)]))
        >>> mul_mat_id(as_, mx.array([[[1.0, 2.0]]]), mx.array([[2, 0]])).tolist()
        [[[3.0, 6.0], [1.0, 2.0]]]
    """
    if isinstance(ids, np.ndarray):
        check_mul_mat_id(_shape(as_), tuple(b.shape), ids)
    b, ids = as_mx(b), as_mx(ids)
    n_b, n_ids = b.shape[1], ids.shape[1]
    if n_b not in (1, n_ids):
        b = mx.take(b, mx.arange(n_ids) % n_b, axis=1)  # (n_tokens, n_ids, K): e % n_b
    x = mx.expand_dims(b, -2)  # (n_tokens, n_b, 1, K)
    return gather_matmul(as_, x, ids).squeeze(-2)  # (n_tokens, n_ids, M)
# --8<-- [end:mul_mat_id]


def gather_matmul(as_, x: mx.array, ids: mx.array, sorted_indices: bool = False) -> mx.array:
    """``x @ as_[ids]^T`` by ``mx.gather_mm`` / ``mx.gather_qmm`` (mlx-lm's ``SwitchLinear``):
    ``x`` ``(..., 1, K)`` broadcast with ``ids`` ``(...)``, the result ``(..., 1, M)``.

    Examples:
        >>> as_ = mx.array(np.stack([np.eye(2), 2 * np.eye(2)]))
        >>> gather_matmul(as_, mx.array([[[1.0, 2.0]]]), mx.array([1])).tolist()
        [[[2.0, 4.0]]]
    """
    if isinstance(as_, MLXQuantized):
        return mx.gather_qmm(x, as_.w_q, as_.scales, as_.biases, rhs_indices=ids,
                             transpose=True, group_size=as_.group_size, bits=as_.bits,
                             mode=as_.mode, sorted_indices=sorted_indices)
    return mx.gather_mm(x, as_mx(as_).swapaxes(-1, -2), rhs_indices=ids,
                        sorted_indices=sorted_indices)


#: from this many (token, expert) rows on, the experts run on rows sorted by expert
#: ([`experts_sorted`][]), as mlx-lm's ``SwitchGLU`` does from 64
SORT_MIN_ROWS = 64


# --8<-- [start:experts_ffn]
def experts_ffn(x: mx.array, up_exps: Any, gate_exps: Any, down_exps: Any,
                selected: mx.array) -> mx.array:
    """The chosen experts' SwiGLU FFNs of every token, before their weights: ``mul_mat_id``
    for up and gate, ``swiglu`` (``silu`` of up without gate experts), ``mul_mat_id`` for down.

    Args:
        x: ``(n_tokens, 1, n_embd)``, or ``(n_tokens, k, n_embd)`` (weighted before the FFN).
        up_exps: the up experts.
        gate_exps: the gate experts (may be None).
        down_exps: the down experts.
        selected: ``(n_tokens, k)`` expert ids.

    Returns:
        ``(n_tokens, k, n_embd)``.
    """
    up = mul_mat_id(up_exps, x, selected)  # (n_tokens, k, n_ff_exp)
    if gate_exps is not None:
        act = swiglu(mul_mat_id(gate_exps, x, selected), up)  # (n_tokens, k, n_ff_exp)
    else:
        act = silu(up)
    return mul_mat_id(down_exps, act, selected)  # (n_tokens, k, n_embd)
# --8<-- [end:experts_ffn]


# --8<-- [start:experts_sorted]
def experts_sorted(x: mx.array, up_exps, gate_exps, down_exps, selected: mx.array) -> mx.array:
    """Fast path of [`experts_ffn`][]: the (token, expert) rows sorted by expert, so that
    ``gather_mm`` reads each expert's matrix once for a run of rows (``sorted_indices``), then
    put back in order (mlx-lm's ``_gather_sort`` / ``_scatter_unsort``). The same products
    row by row: ``tests/twin/test_moe.py::test_sorted_experts_are_the_experts`` holds the two
    equal.
    """
    n_tokens, k = selected.shape
    flat = selected.flatten()  # (n_tokens * k,)
    order = mx.argsort(flat)  # rows grouped by expert
    inverse = mx.argsort(order)
    rows = x.reshape(-1, x.shape[-1])  # (n_tokens * n_b, n_embd)
    src = order // k if x.shape[1] == 1 else order  # the row of x each sorted row reads
    xs = mx.expand_dims(rows[src], -2)  # (n_rows, 1, n_embd)
    ids = flat[order]  # (n_rows,)
    up = gather_matmul(up_exps, xs, ids, sorted_indices=True)  # (n_rows, 1, n_ff_exp)
    if gate_exps is not None:
        act = swiglu(gather_matmul(gate_exps, xs, ids, sorted_indices=True), up)
    else:
        act = silu(up)
    out = gather_matmul(down_exps, act, ids, sorted_indices=True)  # (n_rows, 1, n_embd)
    return out[inverse].reshape(n_tokens, k, -1)  # (n_tokens, k, n_embd)
# --8<-- [end:experts_sorted]


# --8<-- [start:build_moe_ffn]
def build_moe_ffn(
    cur: mx.array,
    gate_inp: mx.array,
    up_exps,
    gate_exps,
    down_exps,
    n_expert_used: int,
    norm_w: bool = True,
    w_scale: float = 0.0,
    weight_before_ffn: bool = False,
) -> mx.array:
    """Twin of [`reference.ops.moe.build_moe_ffn`][reference.ops.moe.build_moe_ffn]. The same
    op order, on MLX; the experts through [`mul_mat_id`][] (``gather_mm``), on rows sorted by
    expert from `SORT_MIN_ROWS` (token, expert) rows on ([`experts_sorted`][]).

    Examples:
        >>> rng = np.random.default_rng(0)
        >>> up, gate = rng.normal(size=(2, 4, 8, 3))
        >>> down = rng.normal(size=(4, 3, 8))
        >>> x = mx.array(rng.normal(size=(5, 3)))
        >>> build_moe_ffn(x, mx.array(rng.normal(size=(4, 3))), mx.array(up), mx.array(gate),
        ...               mx.array(down), 2).shape
        (5, 3)
    """
    cur, gate_inp = as_mx(cur), as_mx(gate_inp)
    n_expert = gate_inp.shape[0]
    for name, t in (("up_exps", up_exps), ("gate_exps", gate_exps), ("down_exps", down_exps)):
        if t is not None and _shape(t)[0] != n_expert:
            raise OpShapeError(f"build_moe_ffn: {name} has {_shape(t)[0]} experts, the "
                               f"router ffn_gate_inp {n_expert}")
    probs = soft_max_ext(mul_mat(gate_inp, cur))  # (n_tokens, n_expert)
    selected = argsort_top_k(probs, n_expert_used)  # (n_tokens, k)
    weights = mx.take_along_axis(probs, selected, axis=-1)  # (n_tokens, k)
    if norm_w:
        weights = weights / mx.maximum(weights.sum(axis=-1, keepdims=True), MOE_WEIGHTS_SUM_MIN)
    if w_scale not in (0.0, 1.0):
        weights = weights * w_scale
    x = mx.expand_dims(cur, 1)  # (n_tokens, 1, n_embd)
    if weight_before_ffn:
        x = x * mx.expand_dims(weights, -1)  # (n_tokens, k, n_embd)
    run = experts_sorted if selected.size >= SORT_MIN_ROWS else experts_ffn
    experts = run(x, up_exps, gate_exps, down_exps, selected)  # (n_tokens, k, n_embd)
    if not weight_before_ffn:
        experts = experts * mx.expand_dims(weights, -1)  # (n_tokens, k, n_embd)
    moe_out = experts[:, 0]  # (n_tokens, n_embd)
    for i in range(1, n_expert_used):
        moe_out = moe_out + experts[:, i]
    return moe_out
# --8<-- [end:build_moe_ffn]


__all__ = [
    "MOE_WEIGHTS_SUM_MIN",
    "SORT_MIN_ROWS",
    "STD_SORT_THRESHOLD",
    "argsort",
    "argsort_fast",
    "argsort_top_k",
    "build_moe_ffn",
    "check_mul_mat_id",
    "expert_matrix",
    "experts_ffn",
    "experts_sorted",
    "gather_matmul",
    "moe_weights",
    "mul_mat_id",
    "std_sort",
]
