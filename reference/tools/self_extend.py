r"""Self-Extend: reading past the trained context by grouping old positions.

A model trained on $n_{ctx\_train}$ positions has never seen a relative distance larger than
that. Self-Extend (Jin et al. 2024, arXiv 2401.01325) keeps the distances it has seen: near a
query, keys keep their exact positions; far away, $G$ consecutive positions share one
(floor division by the *group size* $G$). Two formulations exist, and this module holds both.

**llama.cpp's: grouping the cache positions** (``tools/completion/completion.cpp``,
``--grp-attn-n G --grp-attn-w W``). Between two decodes, while the cache holds a complete
block of $W$ ungrouped positions, three memory ops group it ([`group_attention_step`][]):

```
while (n_past >= ga_i + ga_w) {
    ib = (ga_n*ga_i)/ga_w;  bd = (ga_w/ga_n)*(ga_n - 1);  dd = (ga_w/ga_n) - ib*bd - ga_w;
    seq_add(0, ga_i,                n_past,         ib*bd);   // ungroup the tail back to t
    seq_div(0, ga_i + ib*bd,        ga_i + ib*bd + ga_w, ga_n);  // group one block
    seq_add(0, ga_i + ib*bd + ga_w, n_past + ib*bd, dd);      // pull the tail after it
    n_past -= bd;  ga_i += ga_w/ga_n;
}
```

The keys are re-roped at the next decode (the K-shift). Our ``seq_div`` records the shift
$p_{new} - p_{old}$; llama.cpp's records the opposite sign, so its grouped keys are rotated to
$2p - \lfloor p / G \rfloor$ instead of $\lfloor p / G \rfloor$ (divergence 7).

**The closed form.** Write $w = W / G$ and $b_d = W - w$. Iteration $k$ (from 0) finds the
tokens $t < kW$ at $\lfloor t / G \rfloor$ and the tokens $t \ge kW$ at $t - k b_d$; it moves
the tail back to $t$, groups $[kW, (k+1)W)$ to $\lfloor t/G \rfloor \in [kw, (k+1)w)$, and
puts the rest at $t - (k+1) b_d$. Its condition $n_{past} \ge ga_i + W$ reads
$N - k b_d \ge kw + W$, i.e. $N \ge (k+1)W$. So after the loop, with $N$ tokens decoded so far,
$K = \lfloor N / W \rfloor$ blocks are grouped and token $t$ sits at

$$
\mathrm{pos}(t) = \begin{cases}
  \lfloor t / G \rfloor & t < K W \\
  t - K\,(W - W/G) & t \ge K W
\end{cases}
\qquad n_{past} = N - K\,(W - W/G),\quad ga_i = K\,W/G
$$

([`self_extend_positions`][]): every *complete* block is grouped, and the ungrouped
neighbours are only the trailing partial block, $N - KW$ tokens, between 0 and $W - 1$.
The sequence stays contiguous: the last grouped token is at $Kw - 1$, the first ungrouped
one at $Kw$. Grouping happens between decodes only, so a decode of more than $W$ tokens
first runs them at their ungrouped positions.

**The paper's: two attentions merged by the mask** ([`self_extend_attention`][]). For query
$i$ and key $j \le i$, with a fixed neighbour window $W_n$:

$$
s_{ij} = \begin{cases}
  \langle R_{i}\, q_i,\; R_{j}\, k_j \rangle & i - j < W_n \quad\text{(neighbour attention)} \\
  \langle R_{\lfloor i/G \rfloor + W_n - \lfloor W_n / G \rfloor}\, q_i,\;
          R_{\lfloor j/G \rfloor}\, k_j \rangle & i - j \ge W_n \quad\text{(grouped attention)}
\end{cases}
$$

then one softmax over the merged scores. RoPE scores depend only on the difference of the
two rotations, so the grouped distance is
$\lfloor i/G \rfloor - \lfloor j/G \rfloor + W_n - \lfloor W_n/G \rfloor$, which continues the
neighbour distances past $W_n$ with slope $1/G$.

**What llama.cpp's version is.** Its query $i$ decodes at $n_{past}$ over the closed-form
positions: with $r = i - KW$ (the query's place in the partial block), keys $j \ge KW$ are at
distance $i - j \le r$ and grouped keys at $Kw + r - \lfloor j / G \rfloor$. That is the
paper's formula with a neighbour window $W_n = r + 1$ that grows from 1 to $W$ and falls back
to 1 at every grouping, exactly when $G$ divides $r + 1$ (else one position apart). The
other differences: the paper's window never shrinks, and its hidden states of earlier
tokens were computed with the same rule, while llama.cpp's were computed at the positions of
their own time. The chapter ``docs/self-extend.md`` measures what that changes.

**Models with sliding-window layers** (Gemma 2, Gemma 3: the iSWA cache). llama.cpp's loop
calls the memory's ``seq_add`` / ``seq_div``, which move the cells of *both* caches, so the
SWA cache must keep every position (``--swa-full``; without it ``can_shift()`` is False and
the loop is refused, [`check_self_extend_memory`][]). A SWA layer then masks by the grouped
positions: query $i = KW + r$ sits at $Kw + r$ and sees key $j$ when
$\mathrm{pos}(i) - \mathrm{pos}(j) < n_{swa}$, that is

$$
\begin{aligned}
j &\ge i - n_{swa} + 1 && (j \ge KW), \\
\lfloor j/G \rfloor \ge Kw + r + 1 - n_{swa} \iff j &\ge KW - G\,(n_{swa} - r - 1) && (j < KW).
\end{aligned}
$$

When $r + 1 < n_{swa}$ the window reaches into the grouped tokens and holds
$(r + 1) + G\,(n_{swa} - r - 1)$ tokens instead of $n_{swa}$: $(G - 1)(n_{swa} - r - 1)$
older tokens than the layer was trained to see, at grouped distances. (When $r + 1 \ge n_{swa}$
it is the last $n_{swa}$ tokens at their exact distances, as without Self-Extend.)

A SWA layer never meets a distance beyond $n_{swa} \le n_{ctx\_train}$, so the paper's reason
to group does not apply to it: Self-Extend's form for iSWA ([`SWA_EXACT`][], ``--grp-attn-swa
exact``) groups the full-attention layers only and leaves the SWA layers their exact window.
It moves the base cache alone ([`group_attention_step_exact`][]): token $t$ sits at

$$
\mathrm{pos}_{base}(t) = \mathrm{pos}(t) + K\,(W - W/G), \qquad \mathrm{pos}_{swa}(t) = t,
$$

the closed form moved up by the $K b_d$ positions it gave back, so the tail stays at $t$ in
both caches and the query, at $i$, sees the full-attention keys at llama.cpp's distances
$Kw + r - \lfloor j/G \rfloor$ and $i - j$ (RoPE scores and the causal mask depend on
differences only) and the SWA keys at $i - j < n_{swa}$, exactly. The SWA cache never moves,
so this form runs without ``--swa-full``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from reference.common import LlamarefError
from reference.hparams import LlamaHParams, rope_cparams
from reference.memory import Memory
from reference.models.llama import (
    build_ffn,
    build_inp_embd,
    build_norm,
    build_qkv,
    get_weight,
    layer_weights,
    model_dtype,
)
from reference.ops import add, mul_mat, rope_ext, soft_max_ext
from reference.ops.rope import RopeParams


class SelfExtendError(LlamarefError, ValueError):
    """Bad group-attention parameters, or a memory that cannot move positions.

    Raised before any state changes.
    """


#: one memory op of the grouping loop: (name, p0, p1, shift or divisor)
Op = tuple[str, int, int, int]

SWA_GROUPED = "grouped"
"""llama.cpp's form: every cell's position is grouped, in the SWA cache too (``--swa-full``)."""
SWA_EXACT = "exact"
"""The form for iSWA: the full-attention layers' positions are grouped, the SWA layers keep
their window at exact positions (the SWA cache never moves)."""
SWA_MODES = (SWA_GROUPED, SWA_EXACT)
"""What ``--grp-attn-swa`` takes."""


# --8<-- [start:check_self_extend_memory]
def check_self_extend_memory(memory: Memory, recurrent: bool, swa: str = SWA_GROUPED) -> None:
    """Whether Self-Extend can group this memory's positions with ``swa``; raises if not.

    Args:
        memory: the Context's memory.
        recurrent: the Context's ``recurrent`` (a state per sequence, no cells).
        swa: [`SWA_GROUPED`][] (llama.cpp) or [`SWA_EXACT`][].

    Raises:
        SelfExtendError: an unknown ``swa``; a recurrent memory; an iSWA cache whose SWA
            part cannot move (no ``--swa-full``) with [`SWA_GROUPED`][]; any other memory
            that cannot shift.

    Examples:
        >>> import dataclasses
        >>> from reference.memory import create_memory
        >>> from reference.testing import tiny_gemma_hparams
        >>> hp = tiny_gemma_hparams("gemma2", n_swa=4)
        >>> mem = create_memory(hp, n_ctx_seq=512, swa_full=False, n_ubatch=8)
        >>> check_self_extend_memory(mem, False, SWA_EXACT)
        >>> try:
        ...     check_self_extend_memory(mem, False)
        ... except SelfExtendError as e:
        ...     print(e)  # doctest: +ELLIPSIS
        Self-Extend moves the positions of ... use --swa-full, or --grp-attn-swa exact ...
    """
    if swa not in SWA_MODES:
        raise SelfExtendError(f"--grp-attn-swa {swa!r}: use one of {', '.join(SWA_MODES)}")
    if recurrent:
        raise SelfExtendError("Self-Extend groups the positions of a KV cache: a recurrent "
                              "model has none to group (use --grp-attn-n 1)")
    base = _base_cache(memory)
    if base is not memory and swa == SWA_EXACT:
        if not base.can_shift():
            raise SelfExtendError("Self-Extend moves cache positions: this memory cannot "
                                  "(can_shift() is False)")
        return
    if base is not memory and not memory.can_shift():
        raise SelfExtendError("Self-Extend moves the positions of every cell, and this "
                              "model's sliding-window cache keeps only its window (it cannot "
                              "move them): use --swa-full, or --grp-attn-swa exact (the SWA "
                              "layers keep their exact positions)")
    if not memory.can_shift():
        raise SelfExtendError("Self-Extend moves cache positions: this memory cannot "
                              "(can_shift() is False)")
# --8<-- [end:check_self_extend_memory]


def _base_cache(memory: Memory):
    """The full-attention cache of an iSWA memory (``get_base``); else the memory itself."""
    get_base = getattr(memory, "get_base", None)
    return memory if get_base is None else get_base()


# --8<-- [start:check_group_attention]
def check_group_attention(ga_n: int, ga_w: int) -> None:
    """The asserts of ``llama-completion``: ``ga_n >= 1`` and, when grouping, ``ga_w % ga_n == 0``.

    llama.cpp also accepts ``ga_w = 0`` (then divides by it); here ``ga_w`` must be a positive
    multiple of ``ga_n``.

    Raises:
        SelfExtendError: ``ga_n < 1``, or ``ga_n > 1`` with ``ga_w`` not a positive multiple
            of ``ga_n``.

    Examples:
        >>> check_group_attention(4, 512)
        >>> try:
        ...     check_group_attention(3, 512)
        ... except SelfExtendError as e:
        ...     print(e)
        --grp-attn-w 512 must be a positive multiple of --grp-attn-n 3
    """
    if ga_n < 1:
        raise SelfExtendError(f"--grp-attn-n {ga_n} must be >= 1 (1: no Self-Extend)")
    if ga_n > 1 and (ga_w < 1 or ga_w % ga_n != 0):
        raise SelfExtendError(f"--grp-attn-w {ga_w} must be a positive multiple of "
                              f"--grp-attn-n {ga_n}")
# --8<-- [end:check_group_attention]


# --8<-- [start:group_attention_step]
def group_attention_step(ga_i: int, n_past: int, ga_n: int, ga_w: int) -> tuple[list[Op], int,
                                                                               int]:
    """One pass of ``llama-completion``'s group-attention loop: its three memory ops.

    Args:
        ga_i: positions grouped so far (``K * ga_w / ga_n`` after ``K`` blocks).
        n_past: the next position of the sequence (``seq_pos_max + 1``).
        ga_n: the group size ``G``.
        ga_w: the block width ``W`` (a multiple of ``G``).

    Returns:
        ``(ops, ga_i, n_past)``: ``seq_add`` / ``seq_div`` / ``seq_add`` as ``(name, p0, p1,
        x)``, then the state after them.

    Examples:
        >>> ops, ga_i, n_past = group_attention_step(0, 10, 2, 8)
        >>> ops
        [('seq_add', 0, 10, 0), ('seq_div', 0, 8, 2), ('seq_add', 8, 10, -4)]
        >>> ga_i, n_past
        (4, 6)
    """
    ib = (ga_n * ga_i) // ga_w  # blocks grouped before this one
    bd = (ga_w // ga_n) * (ga_n - 1)  # how much one grouped block shrinks
    dd = (ga_w // ga_n) - ib * bd - ga_w  # what the tail moves by, from ungrouped positions
    ops = [
        ("seq_add", ga_i, n_past, ib * bd),
        ("seq_div", ga_i + ib * bd, ga_i + ib * bd + ga_w, ga_n),
        ("seq_add", ga_i + ib * bd + ga_w, n_past + ib * bd, dd),
    ]
    return ops, ga_i + ga_w // ga_n, n_past - bd
# --8<-- [end:group_attention_step]


# --8<-- [start:group_attention_ops]
def group_attention_ops(ga_i: int, n_past: int, ga_n: int, ga_w: int) -> tuple[list[Op], int,
                                                                              int]:
    """The whole loop: [`group_attention_step`][] while ``n_past >= ga_i + ga_w``.

    Returns:
        ``(ops, ga_i, n_past)``: every op in order, and the state after the loop.

    Raises:
        SelfExtendError: bad ``ga_n`` / ``ga_w`` ([`check_group_attention`][]).

    Examples:
        >>> ops, ga_i, n_past = group_attention_ops(0, 20, 2, 8)
        >>> len(ops), ga_i, n_past
        (6, 8, 12)
    """
    check_group_attention(ga_n, ga_w)
    ops: list[Op] = []
    while ga_n > 1 and n_past >= ga_i + ga_w:
        step, ga_i, n_past = group_attention_step(ga_i, n_past, ga_n, ga_w)
        ops += step
    return ops, ga_i, n_past
# --8<-- [end:group_attention_ops]


# --8<-- [start:group_attention_step_exact]
def group_attention_step_exact(ga_i: int, ga_n: int, ga_w: int) -> tuple[list[Op], int]:
    r"""Group block $k = ga_i / w$ of the full-attention cache alone ([`SWA_EXACT`][]).

    Before: the grouped tokens at $\lfloor t/G \rfloor + k b_d \in [k b_d, kW)$, the rest at
    $t \ge kW$. Three ops: the grouped tokens down to $[0, kw)$, the block $[kW, (k+1)W)$
    divided to $[kw, (k+1)w)$, all of them up by $(k+1) b_d$, under the tail that stays at
    $t$. The ranges never overlap, so no op moves a cell another one meant to leave alone.

    Returns:
        ``(ops, ga_i)``: the ops as ``(name, p0, p1, x)``, and ``ga_i + w``.

    Examples:
        >>> group_attention_step_exact(4, 2, 8)  # the second block: k = 1, w = 4, b_d = 4
        ([('seq_add', 4, 8, -4), ('seq_div', 8, 16, 2), ('seq_add', 0, 8, 8)], 8)
    """
    w = ga_w // ga_n
    bd = ga_w - w
    k = ga_i // w
    ops = [
        ("seq_add", k * bd, k * ga_w, -k * bd),  # the grouped tokens down to [0, kw)
        ("seq_div", k * ga_w, (k + 1) * ga_w, ga_n),  # the block to [kw, (k + 1)w)
        ("seq_add", 0, (k + 1) * w, (k + 1) * bd),  # both up, under the tail
    ]
    return ops, ga_i + w
# --8<-- [end:group_attention_step_exact]


def group_attention_ops_exact(ga_i: int, n_tokens: int, ga_n: int, ga_w: int
                              ) -> tuple[list[Op], int]:
    r"""[`group_attention_step_exact`][] while a complete block is ungrouped:
    $N \ge (K + 1) W$ with $K = ga_i / w$ (the condition of llama.cpp's loop, in tokens).

    Examples:
        >>> ops, ga_i = group_attention_ops_exact(0, 20, 2, 8)
        >>> len(ops), ga_i
        (6, 8)
    """
    check_group_attention(ga_n, ga_w)
    ops: list[Op] = []
    while ga_n > 1 and n_tokens >= ga_i * ga_n + ga_w:
        step, ga_i = group_attention_step_exact(ga_i, ga_n, ga_w)
        ops += step
    return ops, ga_i


def self_extend_positions_exact(n_tokens: int, ga_n: int, ga_w: int) -> np.ndarray:
    r"""The full-attention cache's positions with [`SWA_EXACT`][]: the closed form plus
    $K (W - W/G)$ (the SWA cache holds token $t$ at $t$).

    Examples:
        >>> self_extend_positions_exact(10, 2, 4).tolist()
        [4, 4, 5, 5, 6, 6, 7, 7, 8, 9]
    """
    n_blocks = n_tokens // ga_w if ga_n > 1 else 0
    return self_extend_positions(n_tokens, ga_n, ga_w) + n_blocks * (ga_w - ga_w // ga_n)


# --8<-- [start:apply_group_attention]
def apply_group_attention(memory: Memory, ga_i: int, n_past: int, ga_n: int, ga_w: int,
                          seq_id: int = 0, swa: str = SWA_GROUPED) -> tuple[int, int]:
    """Run the loop on sequence ``seq_id`` of a memory (before a decode); the new state.

    With [`SWA_EXACT`][] and an iSWA memory, only its full-attention cache moves
    ([`group_attention_ops_exact`][]); ``n_past`` is then the token count (the SWA cache's
    ``seq_pos_max + 1``) and stays so.

    Args:
        memory: a memory that can shift positions (a KV cache), e.g. ``ctx.memory``.
        ga_i: positions grouped so far.
        n_past: the next position of the sequence (``seq_pos_max + 1``).
        ga_n: the group size ``G``.
        ga_w: the block width ``W``.
        seq_id: the sequence (``llama-completion``: 0).
        swa: [`SWA_GROUPED`][] (llama.cpp) or [`SWA_EXACT`][].

    Returns:
        ``(ga_i, n_past)`` after the loop.

    Raises:
        SelfExtendError: bad parameters, or a memory that cannot move what ``swa`` moves
            ([`check_self_extend_memory`][]); nothing changed.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.context import Context
        >>> from reference.batch import Batch
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), n_ctx=64)
        >>> ctx.decode(Batch(token=list(range(10))))
        0
        >>> apply_group_attention(ctx.memory, 0, 10, 2, 8)
        (4, 6)
        >>> ctx.memory.seq_pos_max(0)
        5
    """
    check_group_attention(ga_n, ga_w)
    if ga_n > 1:
        check_self_extend_memory(memory, False, swa)
    base = _base_cache(memory)
    if swa == SWA_EXACT and base is not memory:
        ops, ga_i = group_attention_ops_exact(ga_i, n_past, ga_n, ga_w)
        target = base
    else:
        ops, ga_i, n_past = group_attention_ops(ga_i, n_past, ga_n, ga_w)
        target = memory
    for name, p0, p1, x in ops:
        getattr(target, name)(seq_id, p0, p1, x)
    return ga_i, n_past
# --8<-- [end:apply_group_attention]


# --8<-- [start:self_extend_positions]
def self_extend_positions(n_tokens: int, ga_n: int, ga_w: int) -> np.ndarray:
    r"""The closed form: the position of each of ``n_tokens`` tokens after the loop.

    $K = \lfloor N/W \rfloor$; $\lfloor t/G \rfloor$ for $t < KW$, else $t - K(W - W/G)$.

    Returns:
        ``(n_tokens,)`` int64.

    Raises:
        SelfExtendError: bad ``ga_n`` / ``ga_w``.

    Examples:
        >>> self_extend_positions(10, 2, 4).tolist()
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 5]
        >>> self_extend_positions(5, 1, 512).tolist()
        [0, 1, 2, 3, 4]
    """
    check_group_attention(ga_n, ga_w)
    t = np.arange(n_tokens, dtype=np.int64)  # (n_tokens,)
    if ga_n == 1:
        return t
    n_blocks = n_tokens // ga_w  # K
    bd = ga_w - ga_w // ga_n
    return np.where(t < n_blocks * ga_w, t // ga_n, t - n_blocks * bd)  # (n_tokens,)
# --8<-- [end:self_extend_positions]


def self_extend_state(n_tokens: int, ga_n: int, ga_w: int) -> tuple[int, int]:
    """``(ga_i, n_past)`` after the loop with ``n_tokens`` decoded (the closed form's).

    Examples:
        >>> self_extend_state(20, 2, 8)
        (8, 12)
    """
    check_group_attention(ga_n, ga_w)
    if ga_n == 1:
        return 0, n_tokens
    n_blocks = n_tokens // ga_w
    return n_blocks * (ga_w // ga_n), n_tokens - n_blocks * (ga_w - ga_w // ga_n)


# ---- the paper's formulation -----------------------------------------------------------------

# --8<-- [start:self_extend_attention]
def self_extend_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    pos: np.ndarray,
    ga_n: int,
    w_n: int,
    kq_scale: float,
    rope: RopeParams,
    freq_factors: np.ndarray | None = None,
) -> np.ndarray:
    r"""The paper's Self-Extend attention of a whole causal sequence (arXiv 2401.01325).

    Neighbour scores from exact positions, grouped scores from ``pos // G`` (the query
    shifted by $W_n - \lfloor W_n/G \rfloor$), merged by the mask $i - j < W_n$, one softmax:

    $$ a_i = \sum_j \mathrm{softmax}_j\!\left(s_{ij} \cdot \mathrm{scale}
       + M_{ij}\right) v_j,\quad M_{ij} = 0 \text{ if } j \le i \text{ else } -\infty $$

    Args:
        q: queries ``(n_tokens, n_head, d_k)``, *not* roped.
        k: keys ``(n_tokens, n_head_kv, d_k)``, not roped.
        v: values ``(n_tokens, n_head_kv, d_v)``.
        pos: positions ``(n_tokens,)``, increasing (the causal order).
        ga_n: the group size ``G`` (1: ordinary attention).
        w_n: the neighbour window ``W_n`` (keys at distance ``< W_n`` are exact).
        kq_scale: the scale of $QK^T$.
        rope: the model's [`RopeParams`][reference.ops.rope.RopeParams] (``rope_cparams``).
        freq_factors: ``rope_freqs`` or None.

    Returns:
        ``(n_tokens, n_head * d_v)``, as ``build_attn_mha``.

    Raises:
        SelfExtendError: ``ga_n < 1`` or ``w_n < 1``.

    Examples:
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal((6, 2, 4)) for _ in range(3))
        >>> from reference.ops.rope import RopeParams
        >>> rope = RopeParams(n_dims=4)
        >>> plain = self_extend_attention(q, k, v, np.arange(6), 1, 1, 0.5, rope)
        >>> wide = self_extend_attention(q, k, v, np.arange(6), 2, 6, 0.5, rope)
        >>> bool(np.allclose(plain, wide))  # every key inside the window: no grouping
        True
    """
    if ga_n < 1 or w_n < 1:
        raise SelfExtendError(f"self_extend_attention needs G >= 1 and W_n >= 1, got G = {ga_n}, "
                              f"W_n = {w_n}")
    pos = np.asarray(pos, dtype=np.int64)  # (n_tokens,)
    n_tokens = len(pos)
    q_pos_g = pos // ga_n + w_n - w_n // ga_n  # (n_tokens,) the grouped queries' positions
    q_n = rope_ext(q, pos, rope, freq_factors)  # (n_tokens, n_head, d_k)
    k_n = rope_ext(k, pos, rope, freq_factors)  # (n_tokens, n_head_kv, d_k)
    q_g = rope_ext(q, q_pos_g, rope, freq_factors)  # (n_tokens, n_head, d_k)
    k_g = rope_ext(k, pos // ga_n, rope, freq_factors)  # (n_tokens, n_head_kv, d_k)
    kq_n = mul_mat(k_n.transpose(1, 0, 2), q_n.transpose(1, 0, 2))  # (n_head, n_tokens, n_tokens)
    kq_g = mul_mat(k_g.transpose(1, 0, 2), q_g.transpose(1, 0, 2))  # (n_head, n_tokens, n_tokens)
    dist = pos[:, None] - pos[None, :]  # (n_tokens, n_tokens): query i, key j
    kq = np.where(dist < w_n, kq_n, kq_g)  # (n_head, n_tokens, n_tokens) merged by the window
    mask = np.where(dist >= 0, 0.0, -np.inf).astype(kq.dtype)  # (n_tokens, n_tokens) causal
    kq = soft_max_ext(kq, mask, kq_scale)  # (n_head, n_tokens, n_tokens)
    v_t = np.ascontiguousarray(v.transpose(1, 2, 0))  # (n_head_kv, d_v, n_tokens)
    kqv = mul_mat(v_t, kq)  # (n_head, n_tokens, d_v)
    return np.ascontiguousarray(kqv.transpose(1, 0, 2)).reshape(n_tokens, -1)
# --8<-- [end:self_extend_attention]


# --8<-- [start:self_extend_forward]
def self_extend_forward(weights: dict, hparams: LlamaHParams, tokens: ArrayLike, ga_n: int,
                        w_n: int) -> np.ndarray:
    """A Llama forward of one whole sequence with the paper's attention in every layer.

    ``llm_build_llama``'s graph (norm, QKV, attention, FFN, output) with
    [`self_extend_attention`][] in place of RoPE plus ``build_attn``, no cache, every token
    an output.

    Args:
        weights: GGUF-named weights.
        hparams: a ``llama`` / ``qwen2`` model's hyperparameters.
        tokens: token ids ``(n_tokens,)`` at positions ``0 .. n_tokens - 1``.
        ga_n: the group size ``G``.
        w_n: the neighbour window ``W_n``.

    Returns:
        logits ``(n_tokens, n_vocab)``.

    Raises:
        SelfExtendError: another architecture (this graph has no Q/K norms, no experts).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> self_extend_forward(random_weights(hp), hp, [1, 2, 3], 2, 2).shape
        (3, 32)
    """
    if hparams.arch not in ("llama", "qwen2") or hparams.n_expert:
        raise SelfExtendError(f"self_extend_forward builds a dense llama / qwen2 graph, not "
                              f"{hparams.arch!r}" + (" with experts" if hparams.n_expert else ""))
    dtype = model_dtype(weights)
    tokens = np.asarray(tokens, dtype=np.int64)  # (n_tokens,)
    pos = np.arange(len(tokens))  # (n_tokens,)
    d = hparams.n_embd_head_k
    kq_scale = hparams.f_attention_scale or 1.0 / math.sqrt(d)
    rope = rope_cparams(hparams)
    factors = get_weight(weights, "rope_freqs.weight", dtype, required=False)
    x = build_inp_embd(weights, tokens, None, dtype)  # (n_tokens, n_embd)
    for il in range(hparams.n_layer):
        layer = layer_weights(weights, il, dtype)
        cur = build_norm(x, layer["attn_norm"], hparams.f_norm_rms_eps)
        q, k, v = build_qkv(layer, cur, d, hparams.n_head, hparams.n_head_kv)
        cur = self_extend_attention(q, k, v, pos, ga_n, w_n, kq_scale, rope, factors)
        cur = mul_mat(layer["wo"], cur)  # (n_tokens, n_embd)
        if layer["bo"] is not None:
            cur = add(cur, layer["bo"])
        ffn_inp = add(cur, x)
        cur = build_ffn(build_norm(ffn_inp, layer["ffn_norm"], hparams.f_norm_rms_eps), layer)
        x = add(cur, ffn_inp)  # (n_tokens, n_embd)
    cur = build_norm(x, get_weight(weights, "output_norm.weight", dtype), hparams.f_norm_rms_eps)
    output = get_weight(weights, "output.weight", dtype, required=False)
    if output is None:  # tied embeddings
        output = get_weight(weights, "token_embd.weight", dtype)
    logits = mul_mat(output, cur)  # (n_tokens, n_vocab)
    output_b = get_weight(weights, "output.bias", dtype, required=False)
    return logits if output_b is None else add(logits, output_b)
# --8<-- [end:self_extend_forward]


__all__ = [
    "SWA_EXACT",
    "SWA_GROUPED",
    "SWA_MODES",
    "SelfExtendError",
    "apply_group_attention",
    "check_group_attention",
    "check_self_extend_memory",
    "group_attention_ops",
    "group_attention_ops_exact",
    "group_attention_step",
    "group_attention_step_exact",
    "self_extend_attention",
    "self_extend_forward",
    "self_extend_positions",
    "self_extend_positions_exact",
    "self_extend_state",
]
