r"""Mamba and Mamba-2: llama.cpp's ``llm_build_mamba`` in NumPy.

The graph of ``src/models/mamba.cpp`` with the layers of ``src/models/mamba-base.cpp``
(``build_mamba_layer`` for the GGUF architecture ``mamba``, ``build_mamba2_layer`` for
``mamba2``) and the state plumbing of ``build_rs`` (``src/llama-graph.cpp``). A block is a
pre-norm residual around one *mixer*; there is no attention and no feed-forward network:

$$
x^{(l+1)} = x^{(l)} + \mathrm{mixer}\big(\mathrm{rms\_norm}(x^{(l)}) \odot g^{(l)}\big),
\qquad
\mathrm{logits} = \mathrm{rms\_norm}(x^{(L)}) \odot g_{out}\; W_{out}^T .
$$

The mixer of one sequence, token by token ($t$), with $d_{inner}$ channels:

$$
\begin{aligned}
[x_t; z_t] &= W_{in} u_t && \text{(Mamba-2 also: } B_t, C_t, dt_t \text{)} \\
\bar x_t &= \mathrm{silu}\Big(\textstyle\sum_{k=0}^{d_{conv}-1} w_k\, x_{t - d_{conv} + 1 + k}
  + b\Big) && \text{causal depthwise conv (ssm\_conv)} \\
\Delta_t &= \mathrm{softplus}(dt_t), \quad
h_t = e^{\Delta_t A} h_{t-1} + \Delta_t\, B_t\, \bar x_t && \text{selective scan (ssm\_scan)} \\
y_t &= C_t h_t + D \odot \bar x_t \\
\mathrm{out}_t &= W_{out}\big(y_t \odot \mathrm{silu}(z_t)\big)
  && \text{Mamba-2: then a grouped RMS norm}
\end{aligned}
$$

Mamba-1 computes $dt_t$, $B_t$, $C_t$ from $\bar x_t$ (``ssm_x`` then ``ssm_dt``) and has one
$A$ per channel and state index; Mamba-2 projects them from $u_t$ together with $x$ and $z$,
convolves $x$, $B$, $C$ together, has one scalar $A$ per head of ``head_dim`` channels, and
normalizes $y \odot \mathrm{silu}(z)$ by groups before ``ssm_out``.

**The memory.** A recurrent model carries two states per layer and sequence, not a KV cache:
the conv state (the last $d_{conv} - 1$ inputs of the convolution) and the ssm state $h$.
llama.cpp stores them as one *row per cell* (``r_l[il]``: ``n_embd_r()`` values, ``s_l[il]``:
``n_embd_s()`` values); only the model knows a row's shape. In NumPy order a conv row is
``(conv_dim, d_conv - 1)`` (ggml views it as ``ne = [d_conv - 1, conv_dim]``) and an ssm row is
``(n_head, head_dim, d_state)``. The graph reads the rows of the ubatch's sequences and writes
the final ones back through a [`RecurrentInput`][] (``llm_graph_input_rs``).

**The ubatch** comes from ``split_equal``
([`reference.batch.BatchAllocr.split_equal`][reference.batch.BatchAllocr.split_equal]): ``n_seqs``
sequence sets of ``n_seq_tokens`` tokens each, set after set, so token $i$ of set $s$ is row $s
\cdot n_{seq\_tokens} + i$ of the flat ubatch and ``tokens.reshape(n_seqs, n_seq_tokens)`` gives one
row per sequence. Every set has the same number of tokens (``ubatch.equal_seqs()``), which is what
lets the conv and the scan run on ``(n_seqs, n_seq_tokens, ...)`` arrays.

Weights are a dict keyed by GGUF tensor names (``blk.{il}.ssm_in.weight``,
``blk.{il}.ssm_a`` without suffix, ...), matrices in NumPy order ``(n_out, n_in)``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from reference.common import LlamarefError
from reference.hparams import MAMBA_ARCHS, MambaHParams
from reference.models.llama import build_norm, get_weight, model_dtype
from reference.ops import add, get_rows, mul, mul_mat, rms_norm, silu, ssm_conv, ssm_scan, swiglu


class MambaForwardError(LlamarefError, ValueError):
    """The inputs of a Mamba forward pass are invalid (token out of range, uneven sets, ...)."""


# --8<-- [start:RecurrentInput]
class RecurrentInput(Protocol):
    """What the recurrent memory provides to the graph for one ubatch (``llm_graph_input_rs``).

    Per layer ``il``, in the order of the ubatch's sequence sets:

    - ``get_r(il)``: the conv states ``(n_seqs, n_embd_r)``; a new sequence starts from zeros;
    - ``get_s(il)``: the ssm states ``(n_seqs, n_embd_s)``, same order;
    - ``cpy_r(il, r)`` / ``cpy_s(il, s)``: write back the final states of the ubatch,
      ``(n_seqs, n_embd_r)`` / ``(n_seqs, n_embd_s)``.

    The graph always reads a layer's states before it writes them.
    """

    def get_r(self, il: int) -> np.ndarray: ...

    def get_s(self, il: int) -> np.ndarray: ...

    def cpy_r(self, il: int, r: np.ndarray) -> None: ...

    def cpy_s(self, il: int, s: np.ndarray) -> None: ...
# --8<-- [end:RecurrentInput]


# --8<-- [start:mamba_layer_tensors]
def mamba_layer_tensors(mamba2: bool) -> dict[str, tuple[str, bool]]:
    """A block's tensors: field name -> (GGUF name after ``"blk.{il}."``, required).

    Mamba-1 projects ``dt``, ``B``, ``C`` with ``ssm_x``/``ssm_dt``; Mamba-2 does it inside
    ``ssm_in`` and adds the grouped ``ssm_norm``.

    Examples:
        >>> mamba_layer_tensors(mamba2=True)["ssm_norm"], mamba_layer_tensors(False)["ssm_x"]
        (('ssm_norm.weight', True), ('ssm_x.weight', True))
    """
    return {
        "attn_norm": ("attn_norm.weight", True),
        "ssm_in": ("ssm_in.weight", True),
        "ssm_conv1d": ("ssm_conv1d.weight", True),
        "ssm_conv1d_b": ("ssm_conv1d.bias", True),
        "ssm_x": ("ssm_x.weight", not mamba2),
        "ssm_dt": ("ssm_dt.weight", not mamba2),
        "ssm_dt_b": ("ssm_dt.bias", True),
        "ssm_a": ("ssm_a", True),
        "ssm_d": ("ssm_d", True),
        "ssm_norm": ("ssm_norm.weight", mamba2),
        "ssm_out": ("ssm_out.weight", True),
    }
# --8<-- [end:mamba_layer_tensors]


# --8<-- [start:mamba_layer_weights]
def mamba_layer_weights(weights: dict, il: int, hparams: MambaHParams, dtype: DTypeLike) -> dict:
    """The weights of block ``il`` under ``llama_layer``'s field names (None when absent).

    Shapes in NumPy order (``conv_dim`` and ``d_in_proj`` as in the module docstring,
    ``n_head = ssm_dt_rank`` for Mamba-2):

    | field | GGUF name | Mamba-1 | Mamba-2 |
    |---|---|---|---|
    | ``attn_norm`` | ``attn_norm.weight`` | ``(n_embd,)`` | ``(n_embd,)`` |
    | ``ssm_in`` | ``ssm_in.weight`` | ``(2 d_inner, n_embd)`` | ``(d_in_proj, n_embd)`` |
    | ``ssm_conv1d`` | ``ssm_conv1d.weight`` | ``(d_inner, d_conv)`` | ``(conv_dim, d_conv)`` |
    | ``ssm_conv1d_b`` | ``ssm_conv1d.bias`` | ``(d_inner,)`` | ``(conv_dim,)`` |
    | ``ssm_x`` | ``ssm_x.weight`` | ``(dt_rank + 2 d_state, d_inner)`` | — |
    | ``ssm_dt`` | ``ssm_dt.weight`` | ``(d_inner, dt_rank)`` | — |
    | ``ssm_dt_b`` | ``ssm_dt.bias`` | ``(d_inner,)`` | ``(n_head,)`` |
    | ``ssm_a`` | ``ssm_a`` | ``(d_inner, d_state)`` | ``(n_head, 1)`` |
    | ``ssm_d`` | ``ssm_d`` | ``(d_inner,)`` | ``(n_head, 1)`` |
    | ``ssm_norm`` | ``ssm_norm.weight`` | — | ``(n_group, d_inner / n_group)`` |
    | ``ssm_out`` | ``ssm_out.weight`` | ``(n_embd, d_inner)`` | ``(n_embd, d_inner)`` |

    Raises:
        reference.models.llama.LlamaForwardError: a required weight is missing.

    Examples:
        >>> from reference.testing import tiny_mamba_hparams, random_mamba_weights
        >>> hp = tiny_mamba_hparams("mamba2", n_group=2)
        >>> layer = mamba_layer_weights(random_mamba_weights(hp), 0, hp, np.float32)
        >>> layer["ssm_a"].shape, layer["ssm_norm"].shape, layer["ssm_x"]
        ((4, 1), (2, 16), None)
    """
    mamba2 = hparams.arch == "mamba2"
    names = mamba_layer_tensors(mamba2)
    layer = {
        field: get_weight(weights, f"blk.{il}.{name}", dtype, required)
        for field, (name, required) in names.items()
    }
    if mamba2:
        layer["ssm_x"] = layer["ssm_dt"] = None  # Mamba-2 projects dt, B, C with ssm_in
    return layer
# --8<-- [end:mamba_layer_weights]


# --8<-- [start:build_conv]
def build_conv(
    conv_state: np.ndarray, x: np.ndarray, ssm_conv1d: np.ndarray, ssm_conv1d_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    r"""The conv step of both mixers: prepend the state, convolve, add the bias, SiLU.

    ``conv_x = concat(conv_state, transpose(x))`` holds, per sequence and channel, the last
    $d_{conv} - 1$ inputs of the previous ubatch followed by the new ones; ``ssm_conv`` slides
    the $d_{conv}$-wide window over it (one output per new input); the new conv state is the
    last $d_{conv} - 1$ columns of ``conv_x`` (``ggml_view_3d(conv_x, ..., n_seq_tokens *
    nb[0])`` copied into ``r_l`` in ``build_mamba_layer``).

    Args:
        conv_state: ``(n_seqs, conv_dim, d_conv - 1)``, the rows from the memory.
        x: the conv's new inputs ``(n_seqs, n_seq_tokens, conv_dim)``.
        ssm_conv1d: ``(conv_dim, d_conv)``.
        ssm_conv1d_b: ``(conv_dim,)``.

    Returns:
        ``(silu(conv + b), new_conv_state)``: ``(n_seqs, n_seq_tokens, conv_dim)`` and
        ``(n_seqs, conv_dim, d_conv - 1)``.

    Examples:
        >>> state = np.zeros((1, 1, 2))
        >>> x = np.array([[[1.0], [2.0], [3.0]]])
        >>> y, new_state = build_conv(state, x, np.array([[1.0, 1.0, 1.0]]), np.zeros(1))
        >>> (y / silu(np.array([1.0, 3.0, 6.0]))[None, :, None]).ravel(), new_state.ravel()
        (array([1., 1., 1.]), array([2., 3.]))
    """
    n_seq_tokens = x.shape[1]
    # (n_seqs, conv_dim, d_conv - 1 + n_seq_tokens)
    conv_x = np.concatenate([conv_state, x.transpose(0, 2, 1)], axis=2)
    new_state = conv_x[:, :, n_seq_tokens:]  # (n_seqs, conv_dim, d_conv - 1)
    cur = ssm_conv(conv_x, ssm_conv1d)  # (n_seqs, n_seq_tokens, conv_dim)
    cur = add(cur, ssm_conv1d_b)
    return silu(cur), new_state
# --8<-- [end:build_conv]


# --8<-- [start:build_rs_conv]
def build_rs_conv(
    inp: RecurrentInput, il: int, hparams: MambaHParams, x: np.ndarray, layer: dict
) -> np.ndarray:
    """The conv step through the memory: read the conv rows, [`build_conv`][], write back.

    Args:
        inp: the ubatch's recurrent input.
        il: layer index.
        hparams: the model's hyperparameters (``conv_dim()``, ``ssm_d_conv``).
        x: the conv's inputs ``(n_seqs, n_seq_tokens, conv_dim)``.
        layer: [`mamba_layer_weights`][] of the block.

    Returns:
        ``(n_seqs, n_seq_tokens, conv_dim)``.
    """
    n_seqs = x.shape[0]
    r = inp.get_r(il).astype(x.dtype, copy=False)  # (n_seqs, n_embd_r)
    d_conv, conv_dim = hparams.ssm_d_conv, hparams.conv_dim()
    conv_state = r.reshape(n_seqs, conv_dim, d_conv - 1)  # (n_seqs, conv_dim, d_conv - 1)
    cur, new_state = build_conv(conv_state, x, layer["ssm_conv1d"], layer["ssm_conv1d_b"])
    inp.cpy_r(il, new_state.reshape(n_seqs, hparams.n_embd_r()))  # (n_seqs, n_embd_r)
    return cur
# --8<-- [end:build_rs_conv]


# --8<-- [start:build_rs_scan]
def build_rs_scan(
    inp: RecurrentInput,
    il: int,
    x: np.ndarray,
    dt: np.ndarray,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
) -> np.ndarray:
    """The selective scan through the memory: read the ssm rows, ``ssm_scan``, write back.

    ``build_rs`` with ``get_ssm_rows``: the ubatch's states are rows ``0 .. n_seqs - 1`` of
    what `RecurrentInput.get_s` returns, so the scan's ``ids`` are ``0, 1, ...``.

    Args:
        inp: the ubatch's recurrent input.
        il: layer index.
        x: ``(n_seqs, n_seq_tokens, n_head, head_dim)``.
        dt: ``(n_seqs, n_seq_tokens, n_head)`` before the softplus, bias added.
        A: ``(n_head, d_state)`` (Mamba-1) or ``(n_head, 1)`` (Mamba-2).
        B: ``(n_seqs, n_seq_tokens, n_group, d_state)``.
        C: same shape as ``B``.

    Returns:
        ``y`` ``(n_seqs, n_seq_tokens, n_head, head_dim)``.
    """
    n_seqs, _, n_head, head_dim = x.shape
    d_state = B.shape[-1]
    s = inp.get_s(il).astype(x.dtype, copy=False)  # (n_seqs, n_embd_s)
    s = s.reshape(n_seqs, n_head, head_dim, d_state)  # (n_seqs, n_head, head_dim, d_state)
    y, states = ssm_scan(s, x, dt, A, B, C, np.arange(n_seqs))
    inp.cpy_s(il, states.reshape(n_seqs, -1))  # (n_seqs, n_embd_s)
    return y
# --8<-- [end:build_rs_scan]


# --8<-- [start:build_mamba_layer]
def build_mamba_layer(
    inp: RecurrentInput, cur: np.ndarray, layer: dict, hparams: MambaHParams, il: int
) -> np.ndarray:
    r"""The Mamba-1 mixer of layer ``il`` (``build_mamba_layer``).

    The scan runs with ``n_head = d_inner`` heads of ``head_dim = 1`` channel and one group:
    every channel $d$ has its own row $A_{d,:}$ of $N$ decays.

    $$
    [x; z] = W_{in} u, \quad \bar x = \mathrm{silu}(\mathrm{conv}(x)), \quad
    [dt_r; B; C] = W_x \bar x, \quad dt = W_{dt}\, dt_r + b_{dt},
    $$

    $$
    y = \mathrm{scan}(\bar x, dt, A, B, C) + D \odot \bar x, \qquad
    \mathrm{out} = W_{out}\,(y \odot \mathrm{silu}(z)).
    $$

    With ``ssm_dt_b_c_rms`` (FalconMamba) $dt_r$, $B$ and $C$ are RMS-normalized (no gain).

    Args:
        inp: the ubatch's recurrent input.
        cur: normed activations ``(n_seqs, n_seq_tokens, n_embd)``.
        layer: [`mamba_layer_weights`][] of the block.
        hparams: the model's hyperparameters.
        il: layer index.

    Returns:
        ``(n_seqs, n_seq_tokens, n_embd)``.
    """
    d_inner, d_state, dt_rank = hparams.ssm_d_inner, hparams.ssm_d_state, hparams.ssm_dt_rank
    n_seqs, n_seq_tokens, _ = cur.shape
    xz = mul_mat(layer["ssm_in"], cur)  # (n_seqs, n_seq_tokens, 2 * d_inner)
    x, z = xz[..., :d_inner], xz[..., d_inner:]  # (n_seqs, n_seq_tokens, d_inner) each

    x = build_rs_conv(inp, il, hparams, x, layer)  # (n_seqs, n_seq_tokens, d_inner)

    x_db = mul_mat(layer["ssm_x"], x)  # (n_seqs, n_seq_tokens, dt_rank + 2 * d_state)
    dt = x_db[..., :dt_rank]  # (n_seqs, n_seq_tokens, dt_rank)
    B = x_db[..., None, dt_rank : dt_rank + d_state]  # (n_seqs, n_seq_tokens, 1, d_state)
    C = x_db[..., None, dt_rank + d_state :]  # (n_seqs, n_seq_tokens, 1, d_state)
    if hparams.ssm_dt_b_c_rms:
        eps = hparams.f_norm_rms_eps
        dt, B, C = rms_norm(dt, eps), rms_norm(B, eps), rms_norm(C, eps)
    dt = add(mul_mat(layer["ssm_dt"], dt), layer["ssm_dt_b"])  # (n_seqs, n_seq_tokens, d_inner)

    x_heads = x.reshape(n_seqs, n_seq_tokens, d_inner, 1)  # (n_seqs, n_seq_tokens, n_head, 1)
    y = build_rs_scan(inp, il, x_heads, dt, layer["ssm_a"], B, C)  # (.., d_inner, 1)
    y = y.reshape(n_seqs, n_seq_tokens, d_inner)  # (n_seqs, n_seq_tokens, d_inner)
    y = add(y, mul(x, layer["ssm_d"]))  # the D skip connection
    y = swiglu(z, y)  # y * silu(z)
    return mul_mat(layer["ssm_out"], y)  # (n_seqs, n_seq_tokens, n_embd)
# --8<-- [end:build_mamba_layer]


# --8<-- [start:build_mamba2_layer]
def build_mamba2_layer(
    inp: RecurrentInput, cur: np.ndarray, layer: dict, hparams: MambaHParams, il: int
) -> np.ndarray:
    r"""The Mamba-2 mixer of layer ``il`` (``build_mamba2_layer``).

    One projection gives the gate $z$, the conv input $xBC$ and $dt$ (one per head):
    ``d_in_proj = d_inner + conv_dim + n_head``. After the conv, $xBC$ splits into $x$
    (``n_head`` heads of ``head_dim``), $B$ and $C$ (``n_group`` groups of ``d_state``; head
    $h$ reads group $h / (n_{head} / n_{group})$). $A$ is one scalar per head.

    $$
    y = \mathrm{scan}(x, dt + b_{dt}, A, B, C) + D_h\, x, \quad
    \mathrm{out} = W_{out}\, \Big(\mathrm{rms\_norm}_{group}\big(y \odot \mathrm{silu}(z)\big)
      \odot g\Big).
    $$

    The gated RMS norm normalizes each group of ``d_inner / n_group`` channels separately
    (``ggml_reshape_4d(y, d_inner / n_group, n_group, ...)`` then ``build_norm``), the gate
    applied *before* the norm (``norm_before_gate=False`` in the official implementation).

    Args:
        inp: the ubatch's recurrent input.
        cur: normed activations ``(n_seqs, n_seq_tokens, n_embd)``.
        layer: [`mamba_layer_weights`][] of the block.
        hparams: the model's hyperparameters.
        il: layer index.

    Returns:
        ``(n_seqs, n_seq_tokens, n_embd)``.
    """
    d_inner, d_state, n_group = hparams.ssm_d_inner, hparams.ssm_d_state, hparams.ssm_n_group
    n_head, head_dim, conv_dim = hparams.n_head(), hparams.head_dim(), hparams.conv_dim()
    n_seqs, n_seq_tokens, _ = cur.shape
    zxBCdt = mul_mat(layer["ssm_in"], cur)  # (n_seqs, n_seq_tokens, d_in_proj)
    z = zxBCdt[..., :d_inner]
    z = z.reshape(n_seqs, n_seq_tokens, n_head, head_dim)  # (.., n_head, head_dim)
    xBC = zxBCdt[..., d_inner : d_inner + conv_dim]  # (n_seqs, n_seq_tokens, conv_dim)
    dt = zxBCdt[..., d_inner + conv_dim :]  # (n_seqs, n_seq_tokens, n_head)

    xBC = build_rs_conv(inp, il, hparams, xBC, layer)  # (n_seqs, n_seq_tokens, conv_dim)

    # x, B, C: the V, K, Q of the state space duality
    x = xBC[..., :d_inner].reshape(n_seqs, n_seq_tokens, n_head, head_dim)  # (.., n_head, head_dim)
    B = xBC[..., d_inner : d_inner + n_group * d_state]
    B = B.reshape(n_seqs, n_seq_tokens, n_group, d_state)  # (.., n_group, d_state)
    C = xBC[..., d_inner + n_group * d_state :]
    C = C.reshape(n_seqs, n_seq_tokens, n_group, d_state)  # (.., n_group, d_state)
    dt = add(dt, layer["ssm_dt_b"])

    y = build_rs_scan(inp, il, x, dt, layer["ssm_a"], B, C)  # (.., n_head, head_dim)
    y = add(y, mul(x, layer["ssm_d"]))  # the D skip connection, one D per head
    y = swiglu(z, y)  # y * silu(z)

    # grouped RMS norm
    y = y.reshape(n_seqs, n_seq_tokens, n_group, -1)  # (.., n_group, d_inner / n_group)
    y = build_norm(y, layer["ssm_norm"], hparams.f_norm_rms_eps)
    y = y.reshape(n_seqs, n_seq_tokens, d_inner)  # (n_seqs, n_seq_tokens, d_inner)
    return mul_mat(layer["ssm_out"], y)  # (n_seqs, n_seq_tokens, n_embd)
# --8<-- [end:build_mamba2_layer]


# --8<-- [start:llm_build_mamba]
def llm_build_mamba(
    weights: dict,
    hparams: MambaHParams,
    tokens: np.ndarray,
    n_seqs: int,
    inp_rs: RecurrentInput,
    out_ids: np.ndarray,
) -> np.ndarray:
    """The graph of ``llm_build_mamba`` (``src/models/mamba.cpp``) for one ubatch.

    Args:
        weights: GGUF-named weights (arrays or quantized tensors).
        hparams: the model's hyperparameters (``mamba`` or ``mamba2``).
        tokens: token ids ``(n_tokens,)``, ``n_seqs`` sets of ``n_seq_tokens`` one after the
            other.
        n_seqs: number of sequence sets.
        inp_rs: the memory's recurrent input for this ubatch.
        out_ids: indices (into the ubatch) of the tokens that get logits ``(n_outputs,)``.

    Returns:
        logits ``(n_outputs, n_vocab)`` in the dtype of
        [`reference.models.llama.model_dtype`][reference.models.llama.model_dtype].
    """
    dtype = model_dtype(weights)
    n_tokens = len(tokens)
    n_seq_tokens = n_tokens // n_seqs
    build_layer = build_mamba2_layer if hparams.arch == "mamba2" else build_mamba_layer

    inpL = get_rows(get_weight(weights, "token_embd.weight", dtype), tokens)  # (n_tokens, n_embd)
    for il in range(hparams.n_layer):
        layer = mamba_layer_weights(weights, il, hparams, dtype)
        cur = build_norm(inpL, layer["attn_norm"], hparams.f_norm_rms_eps)
        cur = cur.reshape(n_seqs, n_seq_tokens, hparams.n_embd)  # (n_seqs, n_seq_tokens, n_embd)
        cur = build_layer(inp_rs, cur, layer, hparams, il)
        cur = cur.reshape(n_tokens, hparams.n_embd)  # (n_tokens, n_embd)
        if il == hparams.n_layer - 1:
            # only the output rows go on: llama.cpp's inp_out_ids
            cur = get_rows(cur, out_ids)  # (n_outputs, n_embd)
            inpL = get_rows(inpL, out_ids)  # (n_outputs, n_embd)
        inpL = add(cur, inpL)  # the residual

    cur = build_norm(inpL, get_weight(weights, "output_norm.weight", dtype), hparams.f_norm_rms_eps)
    output = get_weight(weights, "output.weight", dtype, required=False)
    if output is None:  # tied embeddings: the lm_head is token_embd
        output = get_weight(weights, "token_embd.weight", dtype)
    return mul_mat(output, cur)  # (n_outputs, n_vocab)
# --8<-- [end:llm_build_mamba]


# --8<-- [start:mamba_forward]
def mamba_forward(
    weights: dict,
    hparams: MambaHParams,
    tokens: np.ndarray,
    inp_rs: RecurrentInput,
    out_ids: np.ndarray | None = None,
    n_seqs: int | None = None,
) -> np.ndarray:
    """One forward pass of a ubatch: checks the inputs, then [`llm_build_mamba`][].

    Args:
        weights: GGUF-named weights; their dtype (``token_embd.weight``'s) is the compute
            dtype, float32 for quantized weights.
        hparams: [`reference.hparams.MambaHParams`][reference.hparams.MambaHParams] (arch ``mamba``
            or ``mamba2``).
        tokens: ``(n_seqs, n_seq_tokens)`` token ids, one row per sequence set, or flat
            ``(n_tokens,)`` (set after set, as ``split_equal`` lays them out) with ``n_seqs``.
        inp_rs: the memory's recurrent input for this ubatch, its rows in the order of the
            sets (e.g. ``SimpleRecurrentState.init_batch()``).
        out_ids: which tokens of the flat ubatch get logits ``(n_outputs,)``; None means all.
        n_seqs: number of sequence sets of flat ``tokens`` (default 1); must match a 2-D
            ``tokens``.

    Returns:
        logits ``(n_outputs, n_vocab)``, rows in flat ubatch order.

    Raises:
        MambaForwardError: unsupported arch, an empty ubatch, ``n_tokens`` not a multiple of
            ``n_seqs`` (unequal sets), a token id out of range, ``out_ids`` out of range.

    Examples:
        >>> from reference.testing import tiny_mamba_hparams, random_mamba_weights
        >>> hp = tiny_mamba_hparams("mamba")
        >>> w = random_mamba_weights(hp, seed=0)
        >>> state = SimpleRecurrentState(hp, n_seqs=2)
        >>> mamba_forward(w, hp, np.array([[1, 5, 7], [2, 3, 4]]), state.init_batch()).shape
        (6, 32)
        >>> mamba_forward(w, hp, np.array([1, 5, 7]), state.init_batch(), n_seqs=2)
        Traceback (most recent call last):
        ...
        reference.models.mamba.MambaForwardError: 3 tokens do not split into 2 equal sequence sets
    """
    if hparams.arch not in MAMBA_ARCHS:
        raise MambaForwardError(f"arch {hparams.arch!r} is not one of {MAMBA_ARCHS}")
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim == 2:
        if n_seqs is not None and n_seqs != tokens.shape[0]:
            raise MambaForwardError(f"n_seqs={n_seqs} but tokens has {tokens.shape[0]} rows")
        n_seqs = tokens.shape[0]
        tokens = tokens.reshape(-1)  # (n_tokens,) set after set
    n_seqs = 1 if n_seqs is None else n_seqs
    if tokens.ndim != 1 or len(tokens) == 0 or n_seqs <= 0:
        raise MambaForwardError(f"need a non-empty ubatch, got tokens {tokens.shape}, "
                                f"n_seqs={n_seqs}")
    if len(tokens) % n_seqs:
        raise MambaForwardError(
            f"{len(tokens)} tokens do not split into {n_seqs} equal sequence sets"
        )
    bad = tokens[(tokens < 0) | (tokens >= hparams.n_vocab)]
    if len(bad):
        raise MambaForwardError(f"token id {bad[0]} out of range [0, {hparams.n_vocab})")
    n_tokens = len(tokens)
    out_ids = np.arange(n_tokens) if out_ids is None else np.asarray(out_ids, dtype=np.int64)
    if out_ids.ndim != 1 or ((out_ids < 0) | (out_ids >= n_tokens)).any():
        raise MambaForwardError(f"out_ids {out_ids.tolist()} out of range [0, {n_tokens})")
    return llm_build_mamba(weights, hparams, tokens, n_seqs, inp_rs, out_ids)
# --8<-- [end:mamba_forward]


# --8<-- [start:SimpleRecurrentState]
class SimpleRecurrentState:
    """The simplest recurrent memory: ``n_seqs`` sequences, sequence set ``i`` is row ``i``.

    Per layer, ``r_l[il]`` is ``(n_seqs, n_embd_r)`` and ``s_l[il]`` is ``(n_seqs, n_embd_s)``,
    zero at the start (a new sequence starts from a zero state). Every ubatch must hold all
    ``n_seqs`` sequences, in row order, with the same number of tokens each. There is no
    ``seq_rm``/``seq_cp`` and no cell search: that is the recurrent memory's job
    (``llama_memory_recurrent``); the model does not see the difference.

    It is its own [`RecurrentInput`][]: ``init_batch()`` returns ``self``.

    Args:
        hparams: the model's hyperparameters.
        n_seqs: number of sequences.
        dtype: dtype of the stored states (float32 as llama.cpp's ``r_l``/``s_l``).

    Examples:
        >>> from reference.testing import tiny_mamba_hparams
        >>> hp = tiny_mamba_hparams("mamba2")
        >>> state = SimpleRecurrentState(hp, n_seqs=2)
        >>> state.get_r(0).shape == (2, hp.n_embd_r()), state.get_s(1).shape == (2, hp.n_embd_s())
        (True, True)
    """

    def __init__(self, hparams: MambaHParams, n_seqs: int = 1, dtype: DTypeLike = np.float32):
        self.hparams = hparams
        self.n_seqs = n_seqs
        self.dtype = np.dtype(dtype)
        n_layer = hparams.n_layer
        self.r_l = [np.zeros((n_seqs, hparams.n_embd_r()), self.dtype) for _ in range(n_layer)]
        self.s_l = [np.zeros((n_seqs, hparams.n_embd_s()), self.dtype) for _ in range(n_layer)]

    def init_batch(self) -> SimpleRecurrentState:
        """The recurrent input of the next ubatch (this object)."""
        return self

    def get_r(self, il: int) -> np.ndarray:
        """The conv states of layer ``il``: ``(n_seqs, n_embd_r)``."""
        return self.r_l[il]

    def get_s(self, il: int) -> np.ndarray:
        """The ssm states of layer ``il``: ``(n_seqs, n_embd_s)``."""
        return self.s_l[il]

    def cpy_r(self, il: int, r: np.ndarray) -> None:
        """Store the final conv states ``(n_seqs, n_embd_r)`` of layer ``il``."""
        self.r_l[il] = np.array(r, dtype=self.dtype).reshape(self.n_seqs, -1)

    def cpy_s(self, il: int, s: np.ndarray) -> None:
        """Store the final ssm states ``(n_seqs, n_embd_s)`` of layer ``il``."""
        self.s_l[il] = np.array(s, dtype=self.dtype).reshape(self.n_seqs, -1)
# --8<-- [end:SimpleRecurrentState]
