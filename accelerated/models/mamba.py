r"""Twin of [`reference.models.mamba`][reference.models.mamba]: Mamba and Mamba-2
(``llm_build_mamba``) on MLX.

The same graph, function for function, with the operators of [`accelerated.ops`][accelerated.ops]
(``ssm_conv``, ``ssm_scan``, ``rms_norm``, ``mul_mat``, ...). What differs:

- **Weights** are MLX arrays, prepared once by [`prepare_weights`][] (each GGUF tensor
  through [`accelerated.quants.load_weight`][accelerated.quants.load_weight]: the types MLX
  holds exactly stay quantized and run in ``mx.quantized_matmul``, other types are dequantized
  once). A dict that still holds NumPy arrays or quantized tensors is converted tensor by tensor
  on each call, which is correct but slower.
- **Compute dtype** is float32 (MLX's float64 is CPU-only); float64 weights are rounded.
- **Laziness**: the forward builds one lazy graph per ubatch; [`mamba_forward`][] evaluates
  the logits, and the states written back through the [`RecurrentInput`][] stay lazy until
  the memory evaluates them ([`SimpleRecurrentState`][], or
  [`accelerated.memory.recurrent.RecurrentMemory`][accelerated.memory.recurrent.RecurrentMemory]).

Input checks, the error class and the ``RecurrentInput`` protocol are the reference's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from accelerated.models.llama import build_norm, get_weight, linear, prepare_weights, weight_values
from accelerated.ops import add, get_rows, mul, rms_norm, silu, ssm_conv, ssm_scan, swiglu
from accelerated.ops.convert import as_mx
from accelerated.quants import MLXQuantized
from reference.hparams import MAMBA_ARCHS, MambaHParams
from reference.models.mamba import MambaForwardError, RecurrentInput, mamba_layer_tensors

__all__ = [
    "MambaForwardError",
    "RecurrentInput",
    "SimpleRecurrentState",
    "build_conv",
    "build_mamba2_layer",
    "build_mamba_layer",
    "build_rs_conv",
    "build_rs_scan",
    "check_mamba_inputs",
    "llm_build_mamba",
    "mamba_forward",
    "mamba_layer_weights",
    "prepare_weights",
]

Weight = mx.array | MLXQuantized


# --8<-- [start:mamba_layer_weights]
def mamba_layer_weights(weights: dict, il: int, hparams: MambaHParams, dtype: object) -> dict:
    """Twin of
    [`reference.models.mamba.mamba_layer_weights`][reference.models.mamba.mamba_layer_weights].

    The fields are ``mx.array`` (or
    [`accelerated.quants.MLXQuantized`][accelerated.quants.MLXQuantized] for the matrices of an
    exact quant type); ``dtype`` is accepted for the same signature and ignored: the twin computes
    in float32.

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
        field: get_weight(weights, f"blk.{il}.{name}", np.float32, required)
        for field, (name, required) in names.items()
    }
    for field in ("attn_norm", "ssm_conv1d", "ssm_conv1d_b", "ssm_dt_b", "ssm_a", "ssm_d",
                  "ssm_norm"):
        if layer[field] is not None:
            layer[field] = weight_values(layer[field])  # elementwise operands: plain arrays
    if mamba2:
        layer["ssm_x"] = layer["ssm_dt"] = None  # Mamba-2 projects dt, B, C with ssm_in
    return layer
# --8<-- [end:mamba_layer_weights]


# --8<-- [start:build_conv]
def build_conv(
    conv_state: mx.array, x: mx.array, ssm_conv1d: mx.array, ssm_conv1d_b: mx.array
) -> tuple[mx.array, mx.array]:
    r"""Twin of [`reference.models.mamba.build_conv`][reference.models.mamba.build_conv].

    Lazy ``mx.concatenate`` and slices; the convolution is
    [`accelerated.ops.ssm_conv`][accelerated.ops.ssm.ssm_conv].

    Examples:
        >>> state = np.zeros((1, 1, 2), np.float32)
        >>> x = np.array([[[1.0], [2.0], [3.0]]], np.float32)
        >>> w, b = np.ones((1, 3), np.float32), np.zeros(1, np.float32)
        >>> y, new_state = build_conv(state, x, w, b)
        >>> new_state.reshape(-1).tolist()
        [2.0, 3.0]
    """
    conv_state, x = as_mx(conv_state), as_mx(x)
    n_seq_tokens = x.shape[1]
    # (n_seqs, conv_dim, d_conv - 1 + n_seq_tokens)
    conv_x = mx.concatenate([conv_state, x.transpose(0, 2, 1)], axis=2)
    new_state = conv_x[:, :, n_seq_tokens:]  # (n_seqs, conv_dim, d_conv - 1)
    cur = ssm_conv(conv_x, ssm_conv1d)  # (n_seqs, n_seq_tokens, conv_dim)
    cur = add(cur, ssm_conv1d_b)
    return silu(cur), new_state
# --8<-- [end:build_conv]


# --8<-- [start:build_rs_conv]
def build_rs_conv(
    inp: RecurrentInput, il: int, hparams: MambaHParams, x: mx.array, layer: dict
) -> mx.array:
    """Twin of [`reference.models.mamba.build_rs_conv`][reference.models.mamba.build_rs_conv].

    ``inp.get_r`` may return NumPy or MLX rows; ``inp.cpy_r`` receives a lazy ``mx.array``.
    """
    n_seqs = x.shape[0]
    r = as_mx(inp.get_r(il)).astype(x.dtype)  # (n_seqs, n_embd_r)
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
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
) -> mx.array:
    """Twin of [`reference.models.mamba.build_rs_scan`][reference.models.mamba.build_rs_scan].

    The scan is [`accelerated.ops.ssm_scan`][accelerated.ops.ssm.ssm_scan]; ``inp.cpy_s`` receives a
    lazy ``mx.array``.
    """
    n_seqs, _, n_head, head_dim = x.shape
    d_state = B.shape[-1]
    s = as_mx(inp.get_s(il)).astype(x.dtype)  # (n_seqs, n_embd_s)
    s = s.reshape(n_seqs, n_head, head_dim, d_state)  # (n_seqs, n_head, head_dim, d_state)
    y, states = ssm_scan(s, x, dt, A, B, C, np.arange(n_seqs))
    inp.cpy_s(il, states.reshape(n_seqs, -1))  # (n_seqs, n_embd_s)
    return y
# --8<-- [end:build_rs_scan]


# --8<-- [start:build_mamba_layer]
def build_mamba_layer(
    inp: RecurrentInput, cur: mx.array, layer: dict, hparams: MambaHParams, il: int
) -> mx.array:
    r"""Twin of
    [`reference.models.mamba.build_mamba_layer`][reference.models.mamba.build_mamba_layer].

    The same steps on lazy MLX arrays; ``ssm_in``, ``ssm_x``, ``ssm_dt`` and ``ssm_out`` may
    be quantized (``mx.quantized_matmul``). ``cur`` is the normed activations as rows
    ``(n_tokens, n_embd)``, sequence set after set (the reference's
    ``(n_seqs, n_seq_tokens, n_embd)`` flattened), and so is the result: the projections
    multiply rows as they are (a matmul of a 3-D array costs MLX a flatten and an unflatten
    node), and only the convolution and the scan see the sets, ``n_seqs`` of them (one
    state row each: ``inp.get_r(il)``).
    """
    d_inner, d_state, dt_rank = hparams.ssm_d_inner, hparams.ssm_d_state, hparams.ssm_dt_rank
    n_tokens = cur.shape[0]
    n_seqs = inp.get_r(il).shape[0]
    sets = (n_seqs, n_tokens // n_seqs)  # (n_seqs, n_seq_tokens)
    xz = linear(layer["ssm_in"], cur)  # (n_tokens, 2 * d_inner)
    x, z = xz[:, :d_inner], xz[:, d_inner:]  # (n_tokens, d_inner) each

    x = build_rs_conv(inp, il, hparams, x.reshape(*sets, d_inner), layer)
    x = x.reshape(n_tokens, d_inner)  # (n_tokens, d_inner)

    x_db = linear(layer["ssm_x"], x)  # (n_tokens, dt_rank + 2 * d_state)
    dt = x_db[:, :dt_rank]  # (n_tokens, dt_rank)
    B = x_db[:, dt_rank : dt_rank + d_state]  # (n_tokens, d_state)
    C = x_db[:, dt_rank + d_state :]  # (n_tokens, d_state)
    if hparams.ssm_dt_b_c_rms:
        eps = hparams.f_norm_rms_eps
        dt, B, C = rms_norm(dt, eps), rms_norm(B, eps), rms_norm(C, eps)
    dt = add(linear(layer["ssm_dt"], dt), layer["ssm_dt_b"])  # (n_tokens, d_inner)

    y = build_rs_scan(inp, il, x.reshape(*sets, d_inner, 1), dt.reshape(*sets, d_inner),
                      layer["ssm_a"], B.reshape(*sets, 1, d_state),
                      C.reshape(*sets, 1, d_state))  # (n_seqs, n_seq_tokens, d_inner, 1)
    y = y.reshape(n_tokens, d_inner)  # (n_tokens, d_inner)
    y = add(y, mul(x, layer["ssm_d"]))  # the D skip connection
    y = swiglu(z, y)  # y * silu(z)
    return linear(layer["ssm_out"], y)  # (n_tokens, n_embd)
# --8<-- [end:build_mamba_layer]


# --8<-- [start:build_mamba2_layer]
def build_mamba2_layer(
    inp: RecurrentInput, cur: mx.array, layer: dict, hparams: MambaHParams, il: int
) -> mx.array:
    r"""Twin of
    [`reference.models.mamba.build_mamba2_layer`][reference.models.mamba.build_mamba2_layer].

    The same steps on lazy MLX arrays; ``ssm_in`` and ``ssm_out`` may be quantized. ``cur``
    and the result are rows ``(n_tokens, n_embd)``, as in [`build_mamba_layer`][].
    """
    d_inner, d_state, n_group = hparams.ssm_d_inner, hparams.ssm_d_state, hparams.ssm_n_group
    n_head, head_dim, conv_dim = hparams.n_head(), hparams.head_dim(), hparams.conv_dim()
    n_tokens = cur.shape[0]
    n_seqs = inp.get_r(il).shape[0]
    sets = (n_seqs, n_tokens // n_seqs)  # (n_seqs, n_seq_tokens)
    zxBCdt = linear(layer["ssm_in"], cur)  # (n_tokens, d_in_proj)
    z = zxBCdt[:, :d_inner].reshape(*sets, n_head, head_dim)  # (.., n_head, head_dim)
    xBC = zxBCdt[:, d_inner : d_inner + conv_dim]  # (n_tokens, conv_dim)
    dt = zxBCdt[:, d_inner + conv_dim :]  # (n_tokens, n_head)

    xBC = build_rs_conv(inp, il, hparams, xBC.reshape(*sets, conv_dim), layer)

    x = xBC[..., :d_inner].reshape(*sets, n_head, head_dim)  # (.., n_head, head_dim)
    B = xBC[..., d_inner : d_inner + n_group * d_state]
    B = B.reshape(*sets, n_group, d_state)  # (.., n_group, d_state)
    C = xBC[..., d_inner + n_group * d_state :]
    C = C.reshape(*sets, n_group, d_state)  # (.., n_group, d_state)
    dt = add(dt, layer["ssm_dt_b"]).reshape(*sets, n_head)  # (n_seqs, n_seq_tokens, n_head)

    y = build_rs_scan(inp, il, x, dt, layer["ssm_a"], B, C)  # (.., n_head, head_dim)
    y = add(y, mul(x, layer["ssm_d"]))  # the D skip connection, one D per head
    y = swiglu(z, y)  # y * silu(z)

    # grouped RMS norm
    y = y.reshape(n_tokens, n_group, -1)  # (n_tokens, n_group, d_inner / n_group)
    y = build_norm(y, layer["ssm_norm"], hparams.f_norm_rms_eps)
    y = y.reshape(n_tokens, d_inner)  # (n_tokens, d_inner)
    return linear(layer["ssm_out"], y)  # (n_tokens, n_embd)
# --8<-- [end:build_mamba2_layer]


# --8<-- [start:llm_build_mamba]
def llm_build_mamba(
    weights: dict,
    hparams: MambaHParams,
    tokens: np.ndarray,
    n_seqs: int,
    inp_rs: RecurrentInput,
    out_ids: np.ndarray | None,
) -> mx.array:
    """Twin of [`reference.models.mamba.llm_build_mamba`][reference.models.mamba.llm_build_mamba].

    Returns lazy float32 logits ``(n_outputs, n_vocab)``. ``tokens`` and ``out_ids`` are
    host (NumPy) indices, checked by ``get_rows``; or ``mx.array`` placeholders of a traced
    graph, already checked on the host ([`mamba_forward`][]'s checks, or the Context's),
    gathered with a plain ``mx.take``: [`accelerated.context.Context`][accelerated.context.Context]
    traces this function once with ``mx.compile`` and reuses it, as it does the Llama graph.
    ``out_ids`` None means every row, in order (no ``get_rows``). The activations stay rows
    ``(n_tokens, n_embd)`` through the layers ([`build_mamba_layer`][]); the ``n_seqs``
    sequence sets are the state rows each layer reads.
    """
    build_layer = build_mamba2_layer if hparams.arch == "mamba2" else build_mamba_layer
    rows = _take if isinstance(tokens, mx.array) else get_rows

    token_embd = get_weight(weights, "token_embd.weight", np.float32)
    inpL = rows(weight_values(token_embd), tokens)  # (n_tokens, n_embd)
    for il in range(hparams.n_layer):
        layer = mamba_layer_weights(weights, il, hparams, mx.float32)
        cur = build_norm(inpL, layer["attn_norm"], hparams.f_norm_rms_eps)
        cur = build_layer(inp_rs, cur, layer, hparams, il)  # on rows: (n_tokens, n_embd)
        if il == hparams.n_layer - 1 and out_ids is not None:
            # only the output rows go on: llama.cpp's inp_out_ids
            cur = rows(cur, out_ids)  # (n_outputs, n_embd)
            inpL = rows(inpL, out_ids)  # (n_outputs, n_embd)
        inpL = add(cur, inpL)  # the residual

    output_norm = get_weight(weights, "output_norm.weight", np.float32)
    cur = build_norm(inpL, output_norm, hparams.f_norm_rms_eps)
    output = get_weight(weights, "output.weight", np.float32, required=False)
    if output is None:  # tied embeddings: the lm_head is token_embd
        output = token_embd
    return linear(output, cur)  # (n_outputs, n_vocab)
# --8<-- [end:llm_build_mamba]


def _take(a: mx.array, idx: mx.array) -> mx.array:
    """``get_rows`` without its host check, for a traced graph: ``a[idx]``."""
    return mx.take(a, idx.astype(mx.int32), axis=0)


# --8<-- [start:mamba_forward]
def mamba_forward(
    weights: dict,
    hparams: MambaHParams,
    tokens: np.ndarray,
    inp_rs: RecurrentInput,
    out_ids: np.ndarray | None = None,
    n_seqs: int | None = None,
) -> mx.array:
    """Twin of [`reference.models.mamba.mamba_forward`][reference.models.mamba.mamba_forward].

    The same checks (on the host, before any array work), then [`llm_build_mamba`][];
    the logits are evaluated (``mx.eval``) before they are returned, float32. Pass
    [`prepare_weights`][] to convert the weights once.

    Examples:
        >>> from reference.testing import tiny_mamba_hparams, random_mamba_weights
        >>> hp = tiny_mamba_hparams("mamba")
        >>> w = prepare_weights(random_mamba_weights(hp, seed=0))
        >>> state = SimpleRecurrentState(hp, n_seqs=2)
        >>> mamba_forward(w, hp, np.array([[1, 5, 7], [2, 3, 4]]), state.init_batch()).shape
        (6, 32)
        >>> mamba_forward(w, hp, np.array([1, 5, 7]), state.init_batch(), n_seqs=2)
        Traceback (most recent call last):
        ...
        reference.models.mamba.MambaForwardError: 3 tokens do not split into 2 equal sequence sets
    """
    tokens, out_ids, n_seqs = check_mamba_inputs(hparams, tokens, out_ids, n_seqs)
    logits = llm_build_mamba(weights, hparams, tokens, n_seqs, inp_rs, out_ids)
    mx.eval(logits)
    return logits
# --8<-- [end:mamba_forward]


def check_mamba_inputs(hparams: MambaHParams, tokens, out_ids=None, n_seqs: int | None = None):
    """[`mamba_forward`][]'s checks on the host: ``(tokens, out_ids, n_seqs)`` normalized.

    Raises:
        MambaForwardError: see [`mamba_forward`][].
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
    return tokens, out_ids, n_seqs


# --8<-- [start:SimpleRecurrentState]
class SimpleRecurrentState:
    """Twin of
    [`reference.models.mamba.SimpleRecurrentState`][reference.models.mamba.SimpleRecurrentState].

    ``r_l``/``s_l`` are lists of ``mx.array``; ``cpy_r``/``cpy_s`` replace a layer's array
    by the (lazy) new one, and ``init_batch`` evaluates the states left by the previous
    ubatch, so the graph never grows beyond one ubatch. ``dtype`` is an MLX dtype.

    Examples:
        >>> from reference.testing import tiny_mamba_hparams
        >>> hp = tiny_mamba_hparams("mamba2")
        >>> state = SimpleRecurrentState(hp, n_seqs=2)
        >>> state.get_r(0).shape == (2, hp.n_embd_r()), state.get_s(1).shape == (2, hp.n_embd_s())
        (True, True)
    """

    def __init__(self, hparams: MambaHParams, n_seqs: int = 1, dtype: mx.Dtype = mx.float32):
        self.hparams = hparams
        self.n_seqs = n_seqs
        self.dtype = dtype
        n_layer = hparams.n_layer
        self.r_l = [mx.zeros((n_seqs, hparams.n_embd_r()), dtype) for _ in range(n_layer)]
        self.s_l = [mx.zeros((n_seqs, hparams.n_embd_s()), dtype) for _ in range(n_layer)]

    def init_batch(self) -> SimpleRecurrentState:
        """The recurrent input of the next ubatch (this object, its states evaluated)."""
        mx.eval(self.r_l + self.s_l)
        return self

    def get_r(self, il: int) -> mx.array:
        """The conv states of layer ``il``: ``(n_seqs, n_embd_r)``."""
        return self.r_l[il]

    def get_s(self, il: int) -> mx.array:
        """The ssm states of layer ``il``: ``(n_seqs, n_embd_s)``."""
        return self.s_l[il]

    def cpy_r(self, il: int, r: mx.array) -> None:
        """Store the final conv states ``(n_seqs, n_embd_r)`` of layer ``il``."""
        self.r_l[il] = as_mx(r).astype(self.dtype).reshape(self.n_seqs, -1)

    def cpy_s(self, il: int, s: mx.array) -> None:
        """Store the final ssm states ``(n_seqs, n_embd_s)`` of layer ``il``."""
        self.s_l[il] = as_mx(s).astype(self.dtype).reshape(self.n_seqs, -1)
# --8<-- [end:SimpleRecurrentState]
