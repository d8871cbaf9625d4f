r"""Mixture of experts: ``ggml_argsort``, ``ggml_argsort_top_k``, ``ggml_mul_mat_id`` and
llama.cpp's ``build_moe_ffn``.

A mixture-of-experts layer replaces the one feed-forward network of a block by $E$ of them
(the *experts*) and a *router* $W_r$ ``(n_expert, n_embd)`` that picks $k$ of them per token
(``n_expert_used``). ``llm_graph_context::build_moe_ffn`` (``src/llama-graph.cpp``) computes,
for a token $x$, with the softmax gating of Mixtral and Qwen3-MoE:

$$
\begin{aligned}
p &= \mathrm{softmax}(W_r x) && \text{soft\_max, over the } E \text{ experts} \\
S &= \mathrm{top}_k(p) && \text{argsort\_top\_k: the indices of the } k \text{ largest} \\
w_i &= p_{S_i} \Big/ \max\Big(\textstyle\sum_{j} p_{S_j},\ 2^{-14}\Big)
  && \text{when } \mathrm{norm\_w} \text{ (llama.cpp's } \mathrm{expert\_weights\_norm)} \\
y &= \textstyle\sum_{i=1}^{k} w_i\, W^{down}_{S_i}\big(\mathrm{silu}(W^{gate}_{S_i} x) \odot
  W^{up}_{S_i} x\big) && \text{mul\_mat\_id, summed in the order of } S
\end{aligned}
$$

Mixtral (arch ``llama`` with experts) and Qwen3-MoE (``qwen3moe``) both pass
``norm_w = true``: the softmax is over all experts, then the $k$ chosen weights are scaled to
sum to 1 (HF's Qwen3-MoE ``norm_topk_prob``; a HF Qwen3-MoE with ``norm_topk_prob = false``
keeps the softmax values, which no GGUF of these archs can say). The weights multiply the
experts' outputs after ``ffn_down``; Llama 4 multiplies the *inputs* before
(``weight_before_ffn``), which is the same for a linear expert but not for SwiGLU.

**ggml_mul_mat_id** is the expert matmul: one matrix per expert in a 3-D tensor, and for every
row of the activations the expert its ``ids`` entry names. In NumPy order (``ne`` reversed):
``as_`` ``(n_as, M, K)``, ``b`` ``(n_tokens, n_b, K)``, ``ids`` ``(n_tokens, n_ids)`` int32,
``n_ids`` a multiple of ``n_b``, and

$$ \mathrm{out}_{t,e} = \mathrm{as}_{\mathrm{ids}_{t,e}}\; b_{t,\ e \bmod n_b}
   \qquad \mathrm{out}: (n_\text{tokens}, n_\text{ids}, M) $$

(``ggml_mul_mat_id``'s comment: ``c ~= as[:,:,i] @ b[:,i%r,t], i = ids[e,t]``). The CPU kernel
groups the rows by expert and multiplies each expert's rows with its one matrix, so a token
reads only its experts' weights; so does [`mul_mat_id`][] (a quantized expert is dequantized
alone, [`expert_matrix`][]).

**Ties in the top-k.** ``ggml_argsort_top_k`` is a full ``ggml_argsort`` (descending) and a
view of its first $k$ columns. The CPU kernel sorts the indices ``0 .. n-1`` of each row with
``std::sort`` and the comparison ``x[a] > x[b]``; ``std::sort`` is not stable, so which of two
equal values comes first is whatever the C++ library's algorithm does. With GCC's libstdc++
(Linux builds, the llama.cpp of our oracle tests), a row of at most 16 values is sorted by
insertion sort alone, which keeps equal values in index order (the lower expert first); a
longer row is first partitioned by introsort (median-of-three pivots, heap sort past a depth
of $2\lfloor\log_2 n\rfloor$), which moves equal values around. [`argsort`][] is that
algorithm, step for step ([`std_sort`][]); the order is not llama.cpp's everywhere (macOS
builds use libc++, whose ``std::sort`` differs). Equal router probabilities are rare in real
models, but happen (a zero router row gives every expert $1/E$).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from reference.ops.attention import soft_max_ext
from reference.ops.errors import OpIndexError, OpShapeError, OpTypeError, OpValueError
from reference.ops.ffn import silu, swiglu
from reference.ops.matmul import mul_mat

#: libstdc++'s ``_S_threshold``: introsort leaves runs of at most this many to insertion sort
STD_SORT_THRESHOLD = 16
#: ``build_moe_ffn`` clamps the sum of the chosen weights to the smallest normal float16
MOE_WEIGHTS_SUM_MIN = 6.103515625e-5


# ---------------------------------------------------------------------------------------------
# std::sort, as GCC's libstdc++ (bits/stl_algo.h, bits/stl_heap.h) runs it
# ---------------------------------------------------------------------------------------------


def _insertion_sort(v: list, first: int, last: int, comp: Callable) -> None:
    """``std::__insertion_sort``: a value moves left only past values it strictly precedes."""
    for i in range(first + 1, last):
        val = v[i]
        if comp(val, v[first]):
            v[first + 1 : i + 1] = v[first:i]
            v[first] = val
        else:
            _unguarded_linear_insert(v, i, comp)


def _unguarded_linear_insert(v: list, last: int, comp: Callable) -> None:
    """``std::__unguarded_linear_insert``: shift ``v[last]`` left while it precedes."""
    val = v[last]
    nxt = last - 1
    while comp(val, v[nxt]):
        v[last] = v[nxt]
        last = nxt
        nxt -= 1
    v[last] = val


def _move_median_to_first(v: list, result: int, a: int, b: int, c: int, comp: Callable) -> None:
    """``std::__move_median_to_first``: swap the median of ``v[a], v[b], v[c]`` to ``result``."""
    if comp(v[a], v[b]):
        if comp(v[b], v[c]):
            m = b
        elif comp(v[a], v[c]):
            m = c
        else:
            m = a
    elif comp(v[a], v[c]):
        m = a
    elif comp(v[b], v[c]):
        m = c
    else:
        m = b
    v[result], v[m] = v[m], v[result]


def _unguarded_partition(v: list, first: int, last: int, pivot: int, comp: Callable) -> int:
    """``std::__unguarded_partition`` around ``v[pivot]``: the cut."""
    while True:
        while comp(v[first], v[pivot]):
            first += 1
        last -= 1
        while comp(v[pivot], v[last]):
            last -= 1
        if not first < last:
            return first
        v[first], v[last] = v[last], v[first]
        first += 1


def _adjust_heap(v: list, first: int, hole: int, length: int, value, comp: Callable) -> None:
    """``std::__adjust_heap``: sift the hole down to a leaf, then push ``value`` up."""
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if comp(v[first + child], v[first + child - 1]):
            child -= 1
        v[first + hole] = v[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        v[first + hole] = v[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2  # std::__push_heap
    while hole > top and comp(v[first + parent], value):
        v[first + hole] = v[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    v[first + hole] = value


def _heap_sort(v: list, first: int, last: int, comp: Callable) -> None:
    """``std::__partial_sort(first, last, last)``: ``make_heap`` then ``sort_heap``."""
    length = last - first
    if length >= 2:
        for parent in range((length - 2) // 2, -1, -1):
            _adjust_heap(v, first, parent, length, v[first + parent], comp)
    while last - first > 1:
        last -= 1
        value = v[last]  # std::__pop_heap
        v[last] = v[first]
        _adjust_heap(v, first, 0, last - first, value, comp)


def _introsort_loop(v: list, first: int, last: int, depth_limit: int, comp: Callable) -> None:
    """``std::__introsort_loop``: partition runs longer than 16, heap sort past the depth."""
    while last - first > STD_SORT_THRESHOLD:
        if depth_limit == 0:
            _heap_sort(v, first, last, comp)
            return
        depth_limit -= 1
        mid = first + (last - first) // 2
        _move_median_to_first(v, first, first + 1, mid, last - 1, comp)
        cut = _unguarded_partition(v, first + 1, last, first, comp)
        _introsort_loop(v, cut, last, depth_limit, comp)
        last = cut


# --8<-- [start:std_sort]
def std_sort(v: list, comp: Callable) -> None:
    r"""``std::sort(v.begin(), v.end(), comp)`` as GCC's libstdc++ runs it, in place.

    Introsort with depth limit $2\lfloor\log_2 n\rfloor$ on runs longer than 16, then one
    insertion sort over the whole range (``std::__final_insertion_sort``). ``comp(a, b)`` is
    "``a`` goes before ``b``" (a strict weak order). The result is sorted; the order of
    equivalent items is this algorithm's, step for step.

    Examples:
        >>> v = list(range(5)); std_sort(v, lambda a, b: a % 2 < b % 2); v  # short: stable
        [0, 2, 4, 1, 3]
        >>> v = list(range(20)); std_sort(v, lambda a, b: False); v[:5]  # long: moved
        [10, 19, 18, 17, 16]
    """
    n = len(v)
    if n > 1:
        _introsort_loop(v, 0, n, 2 * (n.bit_length() - 1), comp)
        if n > STD_SORT_THRESHOLD:
            _insertion_sort(v, 0, STD_SORT_THRESHOLD, comp)
            for i in range(STD_SORT_THRESHOLD, n):  # std::__unguarded_insertion_sort
                _unguarded_linear_insert(v, i, comp)
        else:
            _insertion_sort(v, 0, n, comp)
# --8<-- [end:std_sort]


# ---------------------------------------------------------------------------------------------
# ggml_argsort, ggml_argsort_top_k
# ---------------------------------------------------------------------------------------------


def _check_argsort(a: np.ndarray, order: str) -> None:
    """``order`` is ``"asc"`` or ``"desc"`` and ``a`` has rows to sort."""
    if order not in ("asc", "desc"):
        raise OpValueError(f"argsort: order must be 'asc' or 'desc', got {order!r}")
    if a.ndim == 0:
        raise OpShapeError("argsort: a needs at least one axis (the rows to sort)")


# --8<-- [start:argsort]
def argsort(a: np.ndarray, order: str = "desc") -> np.ndarray:
    """``ggml_argsort(a, order)``: per row, the indices that sort it (CPU kernel, libstdc++).

    ``ggml_compute_forward_argsort_f32`` fills each row with ``0 .. n-1`` and calls
    ``std::sort`` with ``a[i] > a[j]`` (``GGML_SORT_ORDER_DESC``) or ``a[i] < a[j]``
    (``ASC``): [`std_sort`][], so equal values come in libstdc++'s order (module docstring).

    Args:
        a: ``(..., n)`` floats.
        order: ``"desc"`` or ``"asc"``.

    Returns:
        int32 ``(..., n)``.

    Raises:
        OpValueError: another order.
        OpShapeError: a 0-d ``a``.

    Examples:
        >>> argsort(np.array([[0.1, 0.7, 0.1, 0.7]]))
        array([[1, 3, 0, 2]], dtype=int32)
        >>> argsort(np.array([3.0, 1.0, 2.0]), "asc")
        array([1, 2, 0], dtype=int32)
    """
    a = np.asarray(a)
    _check_argsort(a, order)
    rows = a.reshape(-1, a.shape[-1])  # (n_rows, n)
    out = np.empty(rows.shape, dtype=np.int32)
    for r, row in enumerate(rows):
        x = row.tolist()
        if order == "desc":
            def comp(i, j, x=x):
                return x[i] > x[j]
        else:
            def comp(i, j, x=x):
                return x[i] < x[j]
        idx = list(range(len(x)))
        std_sort(idx, comp)
        out[r] = idx
    return out.reshape(a.shape)
# --8<-- [end:argsort]


# --8<-- [start:argsort_fast]
def argsort_fast(a: np.ndarray, order: str = "desc") -> np.ndarray:
    """Fast path of [`argsort`][]: NumPy's stable sort where it gives ``std::sort``'s order.

    A row of distinct values has one sorted order, whatever the algorithm; a row of at most
    16 values is sorted by insertion sort alone, which is stable. Only the other rows (ties
    in a row of more than 16, or a NaN) go through [`std_sort`][]. Held equal to
    [`argsort`][] by ``tests/laws/test_moe.py::test_argsort_fast_is_argsort``.

    Examples:
        >>> argsort_fast(np.array([[0.1, 0.7, 0.1, 0.7]]))
        array([[1, 3, 0, 2]], dtype=int32)
    """
    a = np.asarray(a)
    _check_argsort(a, order)
    rows = a.reshape(-1, a.shape[-1])  # (n_rows, n)
    out = np.argsort(-rows if order == "desc" else rows, axis=-1, kind="stable").astype(np.int32)
    n = rows.shape[-1]
    if n > STD_SORT_THRESHOLD:
        srt = np.take_along_axis(rows, out, axis=-1)  # (n_rows, n)
        tied = (srt[:, 1:] == srt[:, :-1]).any(axis=-1) | np.isnan(rows).any(axis=-1)
        for r in np.nonzero(tied)[0]:
            out[r] = argsort(rows[r], order)
    return out.reshape(a.shape)
# --8<-- [end:argsort_fast]


# --8<-- [start:argsort_top_k]
def argsort_top_k(a: np.ndarray, k: int) -> np.ndarray:
    """``ggml_argsort_top_k(a, k)``: the first ``k`` indices of the descending argsort.

    Args:
        a: ``(..., n)`` floats.
        k: how many, ``1 <= k <= n`` (``GGML_ASSERT(a->ne[0] >= k)``).

    Returns:
        int32 ``(..., k)``: the indices of the ``k`` largest values, largest first.

    Raises:
        OpValueError: ``k`` outside ``[1, n]``.

    Examples:
        >>> argsort_top_k(np.array([[0.1, 0.5, 0.3, 0.1]]), 2)
        array([[1, 2]], dtype=int32)
    """
    a = np.asarray(a)
    n = a.shape[-1]
    if not 1 <= k <= n:
        raise OpValueError(f"argsort_top_k: k={k} must be in [1, {n}] (the row length)")
    return argsort_fast(a, "desc")[..., :k]
# --8<-- [end:argsort_top_k]


# ---------------------------------------------------------------------------------------------
# ggml_mul_mat_id
# ---------------------------------------------------------------------------------------------


def _as_shape(as_) -> tuple[int, ...]:
    return tuple(as_.shape)


# --8<-- [start:expert_matrix]
def expert_matrix(as_: Any, e: int, dtype: DTypeLike) -> np.ndarray:
    """Expert ``e``'s matrix ``(M, K)`` of ``as_``, in ``dtype``: only that expert's weights
    are read (a quantized 3-D tensor dequantizes its ``e``-th block of rows alone).

    Args:
        as_: ``(n_as, M, K)``: an array, or a quantized tensor (``qtype``, ``shape``,
            ``data`` ``(n_as, M, row_bytes)``, as GGUF stores ``ffn_*_exps``).
        e: the expert.
        dtype: the compute dtype.

    Examples:
        >>> expert_matrix(np.arange(8.0).reshape(2, 2, 2), 1, np.float32)
        array([[4., 5.],
               [6., 7.]], dtype=float32)
    """
    if hasattr(as_, "qtype"):
        one = type(as_)(as_.qtype, tuple(as_.shape[1:]), as_.data[e])  # (M, K) quantized
        return one.dequantize().astype(dtype, copy=False)
    return np.asarray(as_[e]).astype(dtype, copy=False)  # (M, K)
# --8<-- [end:expert_matrix]


def check_mul_mat_id(as_shape: tuple, b_shape: tuple, ids: np.ndarray) -> None:
    """The ``GGML_ASSERT``s of ``ggml_mul_mat_id`` and of its CPU kernel (shared with the twin).

    Raises:
        OpShapeError: ``as_`` not 3-D, ``b`` not 3-D, ``ids`` not 2-D, a row length ``K``
            that differs, ``ids`` rows other than ``b``'s tokens, or ``n_ids`` not a
            multiple of ``n_b``.
        OpTypeError: ``ids`` not integers.
        OpIndexError: an id outside ``[0, n_as)``.

    Examples:
        >>> check_mul_mat_id((4, 3, 2), (5, 1, 2), np.full((5, 2), 4))
        Traceback (most recent call last):
        ...
        reference.ops.errors.OpIndexError: mul_mat_id: expert id 4 out of range [0, 4)
    """
    where = f"as_.shape={as_shape}, b.shape={b_shape}, ids.shape={ids.shape}"
    if len(as_shape) != 3 or len(b_shape) != 3 or ids.ndim != 2:
        raise OpShapeError(f"mul_mat_id needs a 3-D as_, a 3-D b and 2-D ids: {where}")
    if as_shape[2] != b_shape[2]:
        raise OpShapeError(f"mul_mat_id: as_ and b must have the same row length K: {where}")
    if ids.shape[0] != b_shape[0] or b_shape[1] == 0 or ids.shape[1] % b_shape[1]:
        raise OpShapeError("mul_mat_id: ids must have one row per token of b and a multiple "
                           f"of b's {b_shape[1]} rows per token: {where}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise OpTypeError(f"mul_mat_id: ids must be integers, got {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= as_shape[0])]
    if len(bad):
        raise OpIndexError(f"mul_mat_id: expert id {bad[0]} out of range [0, {as_shape[0]})")


# --8<-- [start:mul_mat_id]
def mul_mat_id(as_: Any, b: np.ndarray, ids: np.ndarray) -> np.ndarray:
    r"""``ggml_mul_mat_id(as, b, ids)``: each row of ``b`` times the expert ``ids`` names.

    $\mathrm{out}_{t,e} = \mathrm{mul\_mat}(\mathrm{as}_{\mathrm{ids}_{t,e}},
    b_{t,\,e \bmod n_b})$. As the CPU kernel, the rows are grouped by expert and each
    expert's matrix is read once ([`expert_matrix`][]); experts no row names are not read.

    Args:
        as_: the experts ``(n_as, M, K)`` (ggml ``ne = [K, M, n_as]``), an array or a
            3-D quantized tensor.
        b: ``(n_tokens, n_b, K)`` (ggml ``ne = [K, n_b, n_tokens]``); ``n_b = 1``: one row per
            token, shared by all its experts.
        ids: ``(n_tokens, n_ids)`` integers in ``[0, n_as)``; ``n_ids`` a multiple of ``n_b``.

    Returns:
        ``(n_tokens, n_ids, M)`` in ``b``'s dtype (ggml: F32).

    Raises:
        OpShapeError, OpTypeError, OpIndexError: see [`check_mul_mat_id`][].

    Examples:
        >>> as_ = np.stack([np.eye(2), 2 * np.eye(2), 3 * np.eye(2)])  # 3 experts (2, 2)
        >>> b = np.array([[[1.0, 2.0]]])                               # 1 token, n_b = 1
        >>> mul_mat_id(as_, b, np.array([[2, 0]]))
        array([[[3., 6.],
                [1., 2.]]])
    """
    b = np.asarray(b)
    ids = np.asarray(ids)
    check_mul_mat_id(_as_shape(as_), b.shape, ids)
    n_tokens, n_b, _ = b.shape
    n_ids, m = ids.shape[1], _as_shape(as_)[1]
    out = np.zeros((n_tokens, n_ids, m), dtype=b.dtype)  # (n_tokens, n_ids, M)
    for e in np.unique(ids):
        t, i = np.nonzero(ids == e)  # the rows that chose expert e
        out[t, i] = mul_mat(expert_matrix(as_, int(e), b.dtype), b[t, i % n_b])  # (n_rows, M)
    return out
# --8<-- [end:mul_mat_id]


# ---------------------------------------------------------------------------------------------
# build_moe_ffn
# ---------------------------------------------------------------------------------------------


# --8<-- [start:moe_weights]
def moe_weights(
    probs: np.ndarray, n_expert_used: int, norm_w: bool, w_scale: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    r"""The chosen experts and their weights: the routing half of ``build_moe_ffn``.

    ``selected = argsort_top_k(probs, k)``; ``weights = get_rows(probs, selected)``; with
    ``norm_w`` divided by their sum (``ggml_sum_rows``: accumulated in double, rounded to
    the dtype) clamped to at least $2^{-14}$ (``MOE_WEIGHTS_SUM_MIN``, against a division by
    0); then scaled by ``w_scale`` unless it is 0 or 1.

    Args:
        probs: ``(n_tokens, n_expert)``, the gating function's output.
        n_expert_used: $k$.
        norm_w: scale the $k$ weights to sum to 1 (``expert_weights_norm``).
        w_scale: ``expert_weights_scale`` (0: none).

    Returns:
        ``selected`` int32 ``(n_tokens, k)``, ``weights`` ``(n_tokens, k)``.

    Examples:
        >>> sel, w = moe_weights(np.array([[0.1, 0.6, 0.3]]), 2, norm_w=True)
        >>> sel.tolist(), w.round(4).tolist()
        ([[1, 2]], [[0.6667, 0.3333]])
    """
    selected = argsort_top_k(probs, n_expert_used)  # (n_tokens, k)
    weights = np.take_along_axis(probs, selected, axis=-1)  # (n_tokens, k)
    if norm_w:
        weights_sum = weights.sum(axis=-1, keepdims=True, dtype=np.float64)  # (n_tokens, 1)
        weights_sum = np.maximum(weights_sum.astype(weights.dtype), MOE_WEIGHTS_SUM_MIN)
        weights = (weights / weights_sum).astype(probs.dtype, copy=False)
    if w_scale not in (0.0, 1.0):
        weights = weights * weights.dtype.type(w_scale)
    return selected, weights
# --8<-- [end:moe_weights]


# --8<-- [start:build_moe_ffn]
def build_moe_ffn(
    cur: np.ndarray,
    gate_inp: np.ndarray,
    up_exps: Any,
    gate_exps: Any,
    down_exps: Any,
    n_expert_used: int,
    norm_w: bool = True,
    w_scale: float = 0.0,
    weight_before_ffn: bool = False,
) -> np.ndarray:
    r"""``llm_graph_context::build_moe_ffn`` with softmax gating and SiLU experts.

    The math of the module docstring, in llama.cpp's op order: ``mul_mat`` (router),
    ``soft_max``, [`moe_weights`][] (top-k, normalise, scale), ``mul_mat_id`` for up and
    gate, ``swiglu`` (``silu`` of up alone when there are no gate experts), ``mul_mat_id``
    for down, the weights multiplied in (after down; before up/gate with
    ``weight_before_ffn``), and the $k$ expert outputs added in the order of ``selected``.

    Args:
        cur: normed activations ``(n_tokens, n_embd)``.
        gate_inp: the router ``ffn_gate_inp`` ``(n_expert, n_embd)``.
        up_exps: ``ffn_up_exps`` ``(n_expert, n_ff_exp, n_embd)`` (array or quantized).
        gate_exps: ``ffn_gate_exps``, same shape, or None.
        down_exps: ``ffn_down_exps`` ``(n_expert, n_embd, n_ff_exp)``.
        n_expert_used: experts per token, ``1 <= k <= n_expert``.
        norm_w: normalise the chosen weights (Mixtral, Qwen3-MoE: True).
        w_scale: ``expert_weights_scale`` (0: none).
        weight_before_ffn: weight the inputs instead of the outputs (Llama 4).

    Returns:
        ``(n_tokens, n_embd)``.

    Raises:
        OpShapeError: a router that is not ``(n_expert, n_embd)``, experts of another count.
        OpValueError: ``n_expert_used`` outside ``[1, n_expert]``.

    Examples:
        >>> rng = np.random.default_rng(0)
        >>> up, gate = rng.normal(size=(2, 4, 8, 3))     # 4 experts, n_ff_exp 8, n_embd 3
        >>> down = rng.normal(size=(4, 3, 8))
        >>> x = rng.normal(size=(5, 3))                   # 5 tokens
        >>> build_moe_ffn(x, rng.normal(size=(4, 3)), up, gate, down, 2).shape
        (5, 3)
    """
    n_expert = gate_inp.shape[0]
    for name, t in (("up_exps", up_exps), ("gate_exps", gate_exps), ("down_exps", down_exps)):
        if t is not None and _as_shape(t)[0] != n_expert:
            raise OpShapeError(f"build_moe_ffn: {name} has {_as_shape(t)[0]} experts, the "
                               f"router ffn_gate_inp {n_expert}")
    logits = mul_mat(gate_inp, cur)  # (n_tokens, n_expert)
    probs = soft_max_ext(logits)  # (n_tokens, n_expert)
    selected, weights = moe_weights(probs, n_expert_used, norm_w, w_scale)  # (n_tokens, k)
    x = cur[:, None, :]  # (n_tokens, 1, n_embd)
    if weight_before_ffn:
        x = x * weights[:, :, None]  # (n_tokens, k, n_embd)
    up = mul_mat_id(up_exps, x, selected)  # (n_tokens, k, n_ff_exp)
    if gate_exps is not None:
        gate = mul_mat_id(gate_exps, x, selected)  # (n_tokens, k, n_ff_exp)
        act = swiglu(gate, up)  # (n_tokens, k, n_ff_exp)
    else:
        act = silu(up)
    experts = mul_mat_id(down_exps, act, selected)  # (n_tokens, k, n_embd)
    if not weight_before_ffn:
        experts = experts * weights[:, :, None]  # (n_tokens, k, n_embd)
    moe_out = experts[:, 0]  # (n_tokens, n_embd)
    for i in range(1, n_expert_used):
        moe_out = moe_out + experts[:, i]
    return moe_out
# --8<-- [end:build_moe_ffn]
