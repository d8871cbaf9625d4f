r"""The Llama block: llama.cpp's ``llm_build_llama`` (and qwen2, qwen3, qwen3moe) in NumPy.

The graph of ``src/models/llama.cpp`` built from the helpers of ``src/llama-graph.cpp``
(``build_norm``, ``build_qkv``, ``build_attn``, ``build_ffn``, ``build_inp_out_ids``). For a
ubatch of tokens $t_1 \dots t_n$ at positions $p_1 \dots p_n$:

$$
\begin{aligned}
x^{(0)} &= E[t] && \text{token\_embd, get\_rows} \\
h &= \mathrm{rms\_norm}(x^{(l)}) \odot g_{attn} \\
q, k, v &= h W_q^T (+ b_q),\; h W_k^T (+ b_k),\; h W_v^T (+ b_v) && \text{per head} \\
q, k &= \mathrm{rope}(q, p),\; \mathrm{rope}(k, p) \\
a &= \mathrm{softmax}\!\left(\frac{q K^T}{\sqrt{d}} + M\right) V
  && K, V, M \text{ from the memory} \\
y &= x^{(l)} + a W_o^T (+ b_o) \\
x^{(l+1)} &= y + \left(\mathrm{silu}(u W_{gate}^T) \odot u W_{up}^T\right) W_{down}^T,
  \quad u = \mathrm{rms\_norm}(y) \odot g_{ffn} \\
\mathrm{logits} &= \mathrm{rms\_norm}(x^{(L)}) \odot g_{out} \; W_{out}^T
  && W_{out} = E \text{ when tied}
\end{aligned}
$$

Four architectures share this graph: ``llama`` (interleaved "normal" RoPE, optional
``attn_output``/FFN biases, Mistral's sliding window through the mask), ``qwen2`` (Q/K/V
biases, NeoX RoPE, optional ``output.bias``), ``qwen3`` (``llm_build_qwen3``: NeoX RoPE, no
biases, and an RMS norm of every query and key *head* before RoPE, with gains
``attn_q_norm``/``attn_k_norm`` of one head's width $d$):

$$ q_h \leftarrow \mathrm{rms\_norm}(q_h) \odot g_q, \qquad
   k_h \leftarrow \mathrm{rms\_norm}(k_h) \odot g_k \qquad (q_h, k_h \in \mathbb{R}^d), $$

and ``qwen3moe`` (``llm_build_qwen3moe``: qwen3's attention, a mixture of experts for the FFN).
A ``llama`` model with experts (``n_expert > 0``) is Mixtral. The experts' FFN is
[`reference.ops.moe.build_moe_ffn`][reference.ops.moe.build_moe_ffn] (softmax router, top-k,
weights normalised, SwiGLU experts through ``mul_mat_id``); its expert tensors
``ffn_{gate,up,down}_exps`` stay as stored (quantized ones dequantize one expert at a time,
only for the experts a token chose). The RoPE mode comes from ``hparams.rope_type``.

Only the *output rows* (``out_ids``) go through the last layer's residual add, the FFN of
the last layer, the final norm and the lm_head: llama.cpp ``get_rows``'s them out right
after the last attention (``build_inp_out_ids``).

The memory is not part of the model. ``build_attn`` writes the new K/V through an
[`AttnInput`][] and reads back all visible K/V and the KQ mask from it
(``llm_graph_input_attn_kv``):
[`reference.models.simple_cache.SimpleKVCache`][reference.models.simple_cache.SimpleKVCache] is the
single-sequence one, the multi-sequence KV cache plugs into the same calls.

Weights are a dict keyed by GGUF tensor names (``"blk.0.attn_q.weight"``), matrices in
NumPy order ``(n_out, n_in)``. A weight may be a quantized tensor (anything with
``.dequantize()``); it is dequantized when used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from reference.common import LlamarefError
from reference.hparams import QWEN3_ARCHS, LlamaHParams, rope_cparams
from reference.models.simple_cache import SimpleKVCache
from reference.ops import add, build_attn_mha, get_rows, mul, mul_mat, rms_norm, swiglu
from reference.ops.moe import build_moe_ffn
from reference.ops.rope import RopeParams, check_rope_args, rope_cache, rope_dtype, rotate_pairs

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")


class LlamaForwardError(LlamarefError, ValueError):
    """The inputs of a forward pass are invalid (unknown arch, token out of range, ...)."""


# --8<-- [start:AttnInput]
class AttnInput(Protocol):
    """What the memory provides to the graph for one ubatch (``llm_graph_input_attn_kv``).

    Per layer ``il``, ``build_attn`` first stores the ubatch's new keys/values, then reads
    back every cell the ubatch may attend to, and the mask that says which it may:

    - ``cpy_k(il, k_cur)`` / ``cpy_v(il, v_cur)``: store ``(n_tokens, n_head_kv, d)`` at the
      ubatch's cells (``ggml_set_rows`` at ``k_idxs``, ``llama_kv_cache::cpy_k``);
    - ``get_k(il)`` / ``get_v(il)``: views ``(n_kv, n_head_kv, d_k)`` / ``(n_kv, n_head_kv, d_v)``
      (``llama_kv_cache::get_k`` / ``get_v``), or with several streams one block per stream
      in front, ``(n_stream, n_kv / n_stream, n_head_kv, d)``;
    - ``get_kq_mask(il)``: additive mask ``(n_tokens, n_kv)``, 0 where a token sees a cell and
      ``-inf`` where it does not (causal, same sequence, sliding window of SWA layers);
    - ``n_stream``: the KV streams of the ubatch (1 for a unified cache): its tokens and the
      cells in view come in ``n_stream`` equal blocks, and a token attends to its own
      stream's block only (``build_attn_mha``'s ``n_stream``).
    """

    n_stream: int

    def cpy_k(self, il: int, k_cur: np.ndarray) -> None: ...

    def cpy_v(self, il: int, v_cur: np.ndarray) -> None: ...

    def get_k(self, il: int) -> np.ndarray: ...

    def get_v(self, il: int) -> np.ndarray: ...

    def get_kq_mask(self, il: int) -> np.ndarray: ...
# --8<-- [end:AttnInput]


# --8<-- [start:model_dtype]
def model_dtype(weights: dict) -> np.dtype:
    """The dtype the forward computes in: that of ``token_embd.weight`` (float32 if quantized).

    Examples:
        >>> model_dtype({"token_embd.weight": np.zeros((2, 2), np.float64)})
        dtype('float64')
    """
    w = weights["token_embd.weight"]
    return w.dtype if isinstance(w, np.ndarray) else np.dtype(np.float32)
# --8<-- [end:model_dtype]


# --8<-- [start:get_weight]
def get_weight(
    weights: dict, name: str, dtype: DTypeLike, required: bool = True
) -> np.ndarray | None:
    """Weight ``name`` as an array of ``dtype``, dequantized if it is quantized.

    Args:
        weights: GGUF-named weights.
        name: e.g. ``"blk.0.attn_q.weight"``.
        dtype: the forward's dtype.
        required: when False, a missing weight gives None (llama.cpp's ``TENSOR_NOT_REQUIRED``).

    Returns:
        The array (not a copy when it already has ``dtype``), or None.

    Raises:
        LlamaForwardError: if a required weight is missing.

    Examples:
        >>> get_weight({"a.weight": np.ones(2)}, "a.weight", np.float32)
        array([1., 1.], dtype=float32)
        >>> get_weight({}, "a.bias", np.float32, required=False) is None
        True
    """
    w = weights.get(name)
    if w is None:
        if required:
            raise LlamaForwardError(f"missing weight {name!r}")
        return None
    if hasattr(w, "dequantize"):
        w = w.dequantize()
    return np.asarray(w).astype(dtype, copy=False)
# --8<-- [end:get_weight]


# --8<-- [start:LLAMA_LAYER_TENSORS]
# A block's tensors: llama_layer's field name -> (GGUF name after "blk.{il}.", required).
LLAMA_LAYER_TENSORS = {
    "attn_norm": ("attn_norm.weight", True),
    "wq": ("attn_q.weight", True),
    "wk": ("attn_k.weight", True),
    "wv": ("attn_v.weight", True),
    "wo": ("attn_output.weight", True),
    "bq": ("attn_q.bias", False),
    "bk": ("attn_k.bias", False),
    "bv": ("attn_v.bias", False),
    "bo": ("attn_output.bias", False),
    "ffn_norm": ("ffn_norm.weight", True),
    "ffn_gate": ("ffn_gate.weight", True),
    "ffn_up": ("ffn_up.weight", True),
    "ffn_down": ("ffn_down.weight", True),
    "ffn_gate_b": ("ffn_gate.bias", False),
    "ffn_up_b": ("ffn_up.bias", False),
    "ffn_down_b": ("ffn_down.bias", False),
}
# --8<-- [end:LLAMA_LAYER_TENSORS]


# --8<-- [start:MOE_LAYER_TENSORS]
# qwen3/qwen3moe: the per-head norms of Q and K, each (n_embd_head_k,).
QWEN3_LAYER_TENSORS = {
    "attn_q_norm": ("attn_q_norm.weight", True),
    "attn_k_norm": ("attn_k_norm.weight", True),
}
# A mixture-of-experts FFN (n_expert > 0) instead of ffn_gate/ffn_up/ffn_down and their
# biases: the router (n_expert, n_embd) and the experts (n_expert, n_ff_exp, n_embd) /
# (n_expert, n_embd, n_ff_exp). llama's gate experts are optional (then silu(up)).
MOE_LAYER_TENSORS = {
    "ffn_gate_inp": ("ffn_gate_inp.weight", True),
    "ffn_gate_exps": ("ffn_gate_exps.weight", True),
    "ffn_up_exps": ("ffn_up_exps.weight", True),
    "ffn_down_exps": ("ffn_down_exps.weight", True),
}
# The experts are kept as stored: mul_mat_id reads one expert at a time.
EXPERT_TENSORS = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})
# --8<-- [end:MOE_LAYER_TENSORS]


# --8<-- [start:layer_tensors]
def layer_tensors(hparams: LlamaHParams | None = None) -> dict:
    """The tensors of a block of ``hparams``' model: field -> (GGUF name, required).

    ``LLAMA_LAYER_TENSORS`` (``None``: a dense llama), with qwen3's Q/K norms, and with a
    mixture of experts (``n_expert > 0``) in place of the dense FFN (``load_arch_tensors``
    of ``src/models/llama.cpp``, ``qwen3.cpp``, ``qwen3moe.cpp``).

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> hp = tiny_hparams("qwen3moe", n_expert=4, n_expert_used=2)
        >>> sorted(set(layer_tensors(hp)) - set(LLAMA_LAYER_TENSORS))[:3]
        ['attn_k_norm', 'attn_q_norm', 'ffn_down_exps']
        >>> sorted(set(LLAMA_LAYER_TENSORS) - set(layer_tensors(hp)))[:3]
        ['ffn_down', 'ffn_down_b', 'ffn_gate']
    """
    table = dict(LLAMA_LAYER_TENSORS)
    if hparams is None:
        return table
    if hparams.arch in QWEN3_ARCHS:
        table.update(QWEN3_LAYER_TENSORS)
    if hparams.n_expert:
        for field in ("ffn_gate", "ffn_up", "ffn_down", "ffn_gate_b", "ffn_up_b", "ffn_down_b"):
            del table[field]
        table.update(MOE_LAYER_TENSORS)
        if hparams.arch == "llama":  # TENSOR_NOT_REQUIRED in llama's loader
            table["ffn_gate_exps"] = ("ffn_gate_exps.weight", False)
    return table
# --8<-- [end:layer_tensors]


# --8<-- [start:layer_weights]
def layer_weights(
    weights: dict, il: int, dtype: DTypeLike, hparams: LlamaHParams | None = None
) -> dict:
    """The weights of block ``il`` under ``llama_layer``'s field names (None when absent).

    ``attn_norm``/``ffn_norm`` ``(n_embd,)``; ``wq`` ``(n_head * d, n_embd)``, ``wk``/``wv``
    ``(n_head_kv * d, n_embd)``, ``wo`` ``(n_embd, n_head * d)``; ``ffn_gate``/``ffn_up``
    ``(n_ff, n_embd)``, ``ffn_down`` ``(n_embd, n_ff)``; biases ``bq``, ``bk``, ``bv``,
    ``bo``, ``ffn_gate_b``, ``ffn_up_b``, ``ffn_down_b`` are optional. With ``hparams``, the
    tables of [`layer_tensors`][]: qwen3's ``attn_q_norm``/``attn_k_norm`` ``(d,)``, and
    for experts ``ffn_gate_inp`` (dequantized) and the ``*_exps`` tensors as stored
    (arrays or quantized, read one expert at a time by ``mul_mat_id``).

    Examples:
        >>> sorted(layer_weights({}, 0, np.float32))[:3]
        Traceback (most recent call last):
        ...
        reference.models.llama.LlamaForwardError: missing weight 'blk.0.attn_norm.weight'
    """
    layer = {}
    for field, (name, required) in layer_tensors(hparams).items():
        if field in EXPERT_TENSORS:
            layer[field] = get_expert_weight(weights, f"blk.{il}.{name}", required)
        else:
            layer[field] = get_weight(weights, f"blk.{il}.{name}", dtype, required)
    return layer
# --8<-- [end:layer_weights]


def get_expert_weight(weights: dict, name: str, required: bool):
    """A 3-D expert tensor as stored (not dequantized), or None when absent and optional.

    Raises:
        LlamaForwardError: a required tensor is missing, or it is not 3-D.
    """
    w = weights.get(name)
    if w is None:
        if required:
            raise LlamaForwardError(f"missing weight {name!r}")
        return None
    if len(w.shape) != 3:
        raise LlamaForwardError(f"{name!r} must be 3-D (n_expert, rows, cols), got {w.shape}")
    return w




# --8<-- [start:build_norm]
def build_norm(cur: np.ndarray, mw: np.ndarray, eps: float) -> np.ndarray:
    r"""RMS norm then the learned gain: ``build_norm(..., LLM_NORM_RMS)``.

    $$ y = \frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}} \odot g $$

    Args:
        cur: activations ``(n_tokens, n_embd)``.
        mw: gain ``(n_embd,)``.
        eps: ``hparams.f_norm_rms_eps``.

    Returns:
        ``(n_tokens, n_embd)``.

    Examples:
        >>> build_norm(np.array([[3.0, 4.0]]), np.array([1.0, 2.0]), 0.0).round(4)
        array([[0.8485, 2.2627]])
    """
    return mul(rms_norm(cur, eps), mw)
# --8<-- [end:build_norm]


# --8<-- [start:build_qkv]
def build_qkv(
    layer: dict, cur: np.ndarray, n_embd_head: int, n_head: int, n_head_kv: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Q, K, V projections (separate weights, optional biases), split into heads.

    Args:
        layer: [`layer_weights`][] of the block.
        cur: normed activations ``(n_tokens, n_embd)``.
        n_embd_head: head width ``d``.
        n_head: query heads.
        n_head_kv: key/value heads.

    Returns:
        ``Qcur (n_tokens, n_head, d)``, ``Kcur (n_tokens, n_head_kv, d)``,
        ``Vcur (n_tokens, n_head_kv, d)``.

    Examples:
        >>> layer = {"wq": np.ones((4, 2)), "wk": np.ones((2, 2)), "wv": np.ones((2, 2)),
        ...          "bq": None, "bk": None, "bv": np.array([0.0, 1.0])}
        >>> q, k, v = build_qkv(layer, np.array([[1.0, 2.0]]), 2, 2, 1)
        >>> q.shape, k.shape, v.tolist()
        ((1, 2, 2), (1, 1, 2), [[[3.0, 4.0]]])
    """
    n_tokens = cur.shape[0]
    q = mul_mat(layer["wq"], cur)  # (n_tokens, n_head * d)
    if layer["bq"] is not None:
        q = add(q, layer["bq"])
    k = mul_mat(layer["wk"], cur)  # (n_tokens, n_head_kv * d)
    if layer["bk"] is not None:
        k = add(k, layer["bk"])
    v = mul_mat(layer["wv"], cur)  # (n_tokens, n_head_kv * d)
    if layer["bv"] is not None:
        v = add(v, layer["bv"])
    q = q.reshape(n_tokens, n_head, n_embd_head)  # (n_tokens, n_head, d)
    k = k.reshape(n_tokens, n_head_kv, n_embd_head)  # (n_tokens, n_head_kv, d)
    v = v.reshape(n_tokens, n_head_kv, n_embd_head)  # (n_tokens, n_head_kv, d)
    return q, k, v
# --8<-- [end:build_qkv]


# --8<-- [start:build_attn]
def build_attn(
    inp: AttnInput,
    wo: np.ndarray,
    wo_b: np.ndarray | None,
    q_cur: np.ndarray,
    k_cur: np.ndarray,
    v_cur: np.ndarray,
    kq_scale: float,
    il: int,
) -> np.ndarray:
    """Attention of layer ``il`` through the memory, then the output projection.

    Stores ``k_cur``/``v_cur`` in the memory, reads back every visible K/V with the mask,
    runs ``build_attn_mha`` (GQA: head ``h`` reads KV head ``h // n_gqa``), then ``wo``.

    Args:
        inp: the attention input of the ubatch ([`AttnInput`][]).
        wo: output projection ``(n_embd, n_head * d_v)``.
        wo_b: optional output bias ``(n_embd,)``.
        q_cur: roped queries ``(n_tokens, n_head, d_k)``.
        k_cur: roped keys ``(n_tokens, n_head_kv, d_k)``.
        v_cur: values ``(n_tokens, n_head_kv, d_v)``.
        kq_scale: scale of $QK^T$ (``1/sqrt(d_k)``).
        il: layer index.

    Returns:
        ``(n_tokens, n_embd)``.
    """
    inp.cpy_k(il, k_cur)
    inp.cpy_v(il, v_cur)
    k = inp.get_k(il)  # (n_kv, n_head_kv, d_k)
    v = inp.get_v(il)  # (n_kv, n_head_kv, d_v)
    kq_mask = inp.get_kq_mask(il)  # (n_tokens, n_kv)
    cur = build_attn_mha(q_cur, k, v, kq_mask, kq_scale,
                         n_stream=inp.n_stream)  # (n_tokens, n_head * d_v)
    cur = mul_mat(wo, cur)  # (n_tokens, n_embd)
    if wo_b is not None:
        cur = add(cur, wo_b)
    return cur
# --8<-- [end:build_attn]


# --8<-- [start:build_ffn]
def build_ffn(cur: np.ndarray, layer: dict) -> np.ndarray:
    r"""The gated FFN, ``build_ffn(..., LLM_FFN_SILU, LLM_FFN_PAR)`` (SwiGLU).

    $$ y = \left(\mathrm{silu}(x W_{gate}^T + b_{gate}) \odot (x W_{up}^T + b_{up})\right)
       W_{down}^T + b_{down} $$

    Args:
        cur: normed activations ``(n_tokens, n_embd)``.
        layer: [`layer_weights`][] of the block (``ffn_up``, ``ffn_gate``, ``ffn_down`` and
            optional biases).

    Returns:
        ``(n_tokens, n_embd)``.

    Examples:
        >>> layer = {"ffn_up": np.eye(2), "ffn_gate": np.eye(2), "ffn_down": np.eye(2),
        ...          "ffn_up_b": None, "ffn_gate_b": None, "ffn_down_b": None}
        >>> build_ffn(np.array([[0.0, 1.0]]), layer).round(4)
        array([[0.    , 0.7311]])
    """
    up = mul_mat(layer["ffn_up"], cur)  # (n_tokens, n_ff)
    if layer["ffn_up_b"] is not None:
        up = add(up, layer["ffn_up_b"])
    gate = mul_mat(layer["ffn_gate"], cur)  # (n_tokens, n_ff)
    if layer["ffn_gate_b"] is not None:
        gate = add(gate, layer["ffn_gate_b"])
    cur = swiglu(gate, up)  # (n_tokens, n_ff)
    cur = mul_mat(layer["ffn_down"], cur)  # (n_tokens, n_embd)
    if layer["ffn_down_b"] is not None:
        cur = add(cur, layer["ffn_down_b"])
    return cur
# --8<-- [end:build_ffn]


# --8<-- [start:build_moe]
def build_moe(cur: np.ndarray, layer: dict, hparams: LlamaHParams) -> np.ndarray:
    """The FFN of a block with experts: ``build_moe_ffn(..., LLM_FFN_SILU, norm_w = true,
    expert_weights_scale, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX)`` as ``llm_build_llama``
    (Mixtral) and ``llm_build_qwen3moe`` call it.

    Args:
        cur: normed activations ``(n_tokens, n_embd)``.
        layer: [`layer_weights`][] of the block (``ffn_gate_inp`` and the ``*_exps``).
        hparams: ``n_expert_used`` and ``expert_weights_norm``.

    Returns:
        ``(n_tokens, n_embd)``.
    """
    return build_moe_ffn(cur, layer["ffn_gate_inp"], layer["ffn_up_exps"],
                         layer["ffn_gate_exps"], layer["ffn_down_exps"],
                         hparams.n_expert_used, norm_w=hparams.expert_weights_norm)
# --8<-- [end:build_moe]


# --8<-- [start:build_inp_embd]
def build_inp_embd(
    weights: dict, tokens: np.ndarray | None, embd: np.ndarray | None, dtype: DTypeLike
) -> np.ndarray:
    """The input of the first layer (``llm_graph_context::build_inp_embd``).

    A batch carries either token ids, looked up as rows of ``token_embd`` (``get_rows``), or
    the embeddings themselves (``llama_batch.embd``, e.g. from a vision encoder), used as
    they are.

    Args:
        weights: GGUF-named weights.
        tokens: token ids ``(n_tokens,)``, or None.
        embd: embeddings ``(n_tokens, n_embd)``, or None; exactly one of the two is given.
        dtype: the forward's dtype.

    Returns:
        ``(n_tokens, n_embd)``.

    Examples:
        >>> w = {"token_embd.weight": np.eye(3)}
        >>> build_inp_embd(w, np.array([2, 0]), None, np.float64)
        array([[0., 0., 1.],
               [1., 0., 0.]])
        >>> build_inp_embd(w, None, np.ones((1, 3)), np.float64)
        array([[1., 1., 1.]])
    """
    if embd is not None:
        return np.asarray(embd, dtype=dtype)  # (n_tokens, n_embd)
    return get_rows(get_weight(weights, "token_embd.weight", dtype), tokens)  # (n_tokens, n_embd)
# --8<-- [end:build_inp_embd]


# --8<-- [start:graph_rope]
def graph_rope(
    pos: np.ndarray, params: RopeParams, freq_factors: np.ndarray | None = None
) -> Callable[[np.ndarray], np.ndarray]:
    r"""Fast path of [`rope_ext`][reference.ops.rope.rope_ext] for one forward's tokens: the
    function that turns each ``q`` and ``k``.

    ggml's graph has a ``rope_ext`` node for the ``q`` and the ``k`` of every layer, and each
    builds its own cos/sin cache (``ggml_rope_cache_init``) before it rotates. The angles
    depend on the positions and the hyperparameters only, so every one of those caches is the
    same: here the cache is built once (per compute dtype) and each call only rotates its pairs
    ([`rotate_pairs`][reference.ops.rope.rotate_pairs]). The values are ``rope_ext``'s, bit for
    bit (``tests/laws/test_rope.py::test_graph_rope_is_rope_ext_bit_for_bit``). The arguments
    are ``rope_ext``'s, less ``x``. (What building the caches cost a batched step:
    ``docs/performance.md``.)

    Args:
        pos: ``(n_tokens,)`` integer positions.
        params: the model's [`RopeParams`][reference.ops.rope.RopeParams].
        freq_factors: ``rope_freqs.weight``, or None.

    Returns:
        ``rope(x)``: ``rope_ext(x, pos, params, freq_factors)`` for any ``x`` of these tokens.

    Examples:
        >>> from reference.ops import rope_ext
        >>> x = np.random.default_rng(0).standard_normal((3, 4, 8)).astype(np.float32)
        >>> pos, p = np.array([0, 5, 9]), RopeParams(8)
        >>> bool(np.array_equal(graph_rope(pos, p)(x), rope_ext(x, pos, p)))
        True
    """
    pos = np.asarray(pos)
    caches: dict = {}  # compute dtype -> (cos_theta, sin_theta), each (n_tokens, n_dims/2)

    def rope(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        check_rope_args(x, pos, params, freq_factors)
        dt = rope_dtype(x.dtype)
        if dt not in caches:
            caches[dt] = rope_cache(pos, params, freq_factors, dt)
        out = rotate_pairs(x.astype(dt), *caches[dt], params.n_dims, params.mode)
        return out.astype(x.dtype, copy=False)

    return rope
# --8<-- [end:graph_rope]


# --8<-- [start:llm_build_llama]
def llm_build_llama(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray,
    embd: np.ndarray | None = None,
) -> np.ndarray:
    """The graph of ``llm_build_llama`` / ``llm_build_qwen2`` / ``llm_build_qwen3`` /
    ``llm_build_qwen3moe`` for one ubatch.

    Args:
        weights: GGUF-named weights (arrays or quantized tensors).
        hparams: the model's hyperparameters.
        tokens: token ids ``(n_tokens,)``, or None when ``embd`` is given.
        pos: their positions ``(n_tokens,)``.
        inp_attn: the memory's attention input for this ubatch.
        out_ids: indices (into the ubatch) of the tokens that get logits ``(n_outputs,)``.
        embd: input embeddings ``(n_tokens, n_embd)`` instead of token ids.

    Returns:
        logits ``(n_outputs, n_vocab)`` in the dtype of [`model_dtype`][].
    """
    dtype = model_dtype(weights)
    n_embd_head = hparams.n_embd_head_k
    kq_scale = hparams.f_attention_scale or 1.0 / math.sqrt(n_embd_head)
    rope_factors = get_weight(weights, "rope_freqs.weight", dtype, required=False)
    rope = graph_rope(pos, rope_cparams(hparams), rope_factors)  # one cos/sin cache

    inpL = build_inp_embd(weights, tokens, embd, dtype)  # (n_tokens, n_embd)
    for il in range(hparams.n_layer):
        layer = layer_weights(weights, il, dtype, hparams)
        inpSA = inpL
        cur = build_norm(inpL, layer["attn_norm"], hparams.f_norm_rms_eps)
        q, k, v = build_qkv(layer, cur, n_embd_head, hparams.n_head, hparams.n_head_kv)
        if hparams.arch in QWEN3_ARCHS:  # per head, before RoPE
            eps = hparams.f_norm_rms_eps
            q = build_norm(q, layer["attn_q_norm"], eps)  # (n_tokens, n_head, d)
            k = build_norm(k, layer["attn_k_norm"], eps)  # (n_tokens, n_head_kv, d)
        q = rope(q)  # rope_ext(q, pos, ...): (n_tokens, n_head, d)
        k = rope(k)  # rope_ext(k, pos, ...): (n_tokens, n_head_kv, d)
        cur = build_attn(inp_attn, layer["wo"], layer["bo"], q, k, v, kq_scale, il)
        if il == hparams.n_layer - 1:
            # only the output rows go on: llama.cpp's inp_out_ids
            cur = get_rows(cur, out_ids)  # (n_outputs, n_embd)
            inpSA = get_rows(inpSA, out_ids)  # (n_outputs, n_embd)
        ffn_inp = add(cur, inpSA)
        cur = build_norm(ffn_inp, layer["ffn_norm"], hparams.f_norm_rms_eps)
        cur = build_moe(cur, layer, hparams) if hparams.n_expert else build_ffn(cur, layer)
        inpL = add(cur, ffn_inp)

    cur = build_norm(inpL, get_weight(weights, "output_norm.weight", dtype), hparams.f_norm_rms_eps)
    output = get_weight(weights, "output.weight", dtype, required=False)
    if output is None:  # tied embeddings: the lm_head is token_embd
        output = get_weight(weights, "token_embd.weight", dtype)
    logits = mul_mat(output, cur)  # (n_outputs, n_vocab)
    output_b = get_weight(weights, "output.bias", dtype, required=False)
    if output_b is not None:
        logits = add(logits, output_b)
    return logits
# --8<-- [end:llm_build_llama]


# --8<-- [start:check_forward_inputs]
def check_forward_inputs(
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    out_ids: np.ndarray | None,
    embd: np.ndarray | None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray | None]:
    """The contract of a forward's inputs, checked on the host before any array work.

    Shared by [`llama_forward`][] and its MLX twin.

    Returns:
        ``(tokens, pos, out_ids, embd)`` as int64 / float arrays; ``out_ids`` defaults to every
        token.

    Raises:
        LlamaForwardError: unsupported arch, both or neither of ``tokens`` and ``embd``, an
            empty ubatch, a token id out of range, embeddings of the wrong width, ``pos`` of
            another length, or ``out_ids`` out of range.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> check_forward_inputs(tiny_hparams(), [3, 4], [0, 1], None, None)[2]
        array([0, 1])
    """
    if hparams.arch not in SUPPORTED_ARCHS:
        raise LlamaForwardError(f"arch {hparams.arch!r} is not one of {SUPPORTED_ARCHS}")
    return check_ubatch_inputs(hparams, tokens, pos, out_ids, embd)


def check_ubatch_inputs(
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    out_ids: np.ndarray | None,
    embd: np.ndarray | None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray | None]:
    """[`check_forward_inputs`][] less the arch check (shared with the Gemma graphs).

    Returns and raises as [`check_forward_inputs`][], for any arch.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> check_ubatch_inputs(tiny_hparams(), None, [0, 1], [1], np.zeros((2, 16)))[2]
        array([1])
    """
    pos = np.asarray(pos, dtype=np.int64)
    if (tokens is None) == (embd is None):
        raise LlamaForwardError("give exactly one of tokens and embd")
    if tokens is not None:
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise LlamaForwardError(f"tokens must be a non-empty 1-D array, got {tokens.shape}")
        bad = tokens[(tokens < 0) | (tokens >= hparams.n_vocab)]
        if len(bad):
            raise LlamaForwardError(f"token id {bad[0]} out of range [0, {hparams.n_vocab})")
        n_tokens = len(tokens)
    else:
        embd = np.asarray(embd)
        if embd.ndim != 2 or embd.shape[0] == 0 or embd.shape[1] != hparams.n_embd:
            raise LlamaForwardError(
                f"embd must be (n_tokens > 0, n_embd={hparams.n_embd}), got {embd.shape}"
            )
        n_tokens = embd.shape[0]
    if pos.shape != (n_tokens,):
        raise LlamaForwardError(f"pos has shape {pos.shape}, expected ({n_tokens},)")
    out_ids = np.arange(n_tokens) if out_ids is None else np.asarray(out_ids, dtype=np.int64)
    if out_ids.ndim != 1 or ((out_ids < 0) | (out_ids >= n_tokens)).any():
        raise LlamaForwardError(f"out_ids {out_ids.tolist()} out of range [0, {n_tokens})")
    return tokens, pos, out_ids, embd
# --8<-- [end:check_forward_inputs]


# --8<-- [start:llama_forward]
def llama_forward(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray | None = None,
    embd: np.ndarray | None = None,
) -> np.ndarray:
    """One forward pass of a ubatch: checks the inputs, then [`llm_build_llama`][].

    Args:
        weights: GGUF-named weights; their dtype (``token_embd.weight``'s) is the compute
            dtype, float32 for quantized weights.
        hparams: hyperparameters; ``hparams.arch`` must be one of `SUPPORTED_ARCHS`.
        tokens: token ids ``(n_tokens,)``, or None when ``embd`` is given.
        pos: positions ``(n_tokens,)``.
        inp_attn: the memory's attention input for this ubatch (e.g.
            ``SimpleKVCache.init_batch(pos)``).
        out_ids: which tokens of the ubatch get logits ``(n_outputs,)``; None means all.
        embd: input embeddings ``(n_tokens, n_embd)`` instead of token ids (exactly one of
            ``tokens`` and ``embd``).

    Returns:
        logits ``(n_outputs, n_vocab)``.

    Raises:
        LlamaForwardError: unsupported arch, both or neither of ``tokens`` and ``embd``, an
            empty ubatch, a token id out of range, embeddings of the wrong width, ``pos`` of
            another length, or ``out_ids`` out of range.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.models.simple_cache import SimpleKVCache
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp, seed=0)
        >>> cache = SimpleKVCache(hp, n_ctx=8)
        >>> pos = np.arange(3)
        >>> llama_forward(w, hp, np.array([1, 5, 7]), pos, cache.init_batch(pos)).shape
        (3, 32)
        >>> llama_forward(w, hp, np.array([99]), np.array([3]), None)
        Traceback (most recent call last):
        ...
        reference.models.llama.LlamaForwardError: token id 99 out of range [0, 32)
    """
    tokens, pos, out_ids, embd = check_forward_inputs(hparams, tokens, pos, out_ids, embd)
    return llm_build_llama(weights, hparams, tokens, pos, inp_attn, out_ids, embd)
# --8<-- [end:llama_forward]


# --8<-- [start:greedy]
def greedy(
    weights: dict,
    hparams: LlamaHParams,
    prompt: list[int],
    n_predict: int,
    stop: tuple[int, ...] = (),
    n_ctx: int | None = None,
) -> list[int]:
    """Greedy decoding with the single-sequence cache: the prompt in one ubatch, then one
    token per ubatch, each time the argmax of the last logits.

    Args:
        weights: GGUF-named weights.
        hparams: hyperparameters.
        prompt: prompt token ids (at least one, e.g. just BOS).
        n_predict: how many tokens to generate at most.
        stop: token ids that end generation (not included in the result).
        n_ctx: cache size; default ``len(prompt) + n_predict``.

    Returns:
        The generated token ids (without the prompt).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> len(greedy(random_weights(hp, seed=0), hp, [1], n_predict=5))
        5
    """
    cache = SimpleKVCache(hparams, n_ctx or len(prompt) + n_predict, model_dtype(weights))
    tokens = np.asarray(prompt, dtype=np.int64)
    out: list[int] = []
    while len(out) < n_predict:
        pos = np.arange(cache.n_past, cache.n_past + len(tokens))
        inp_attn = cache.init_batch(pos)
        logits = llama_forward(weights, hparams, tokens, pos, inp_attn, [len(tokens) - 1])
        token = int(np.argmax(logits[-1]))
        if token in stop:
            break
        out.append(token)
        tokens = np.array([token])
    return out
# --8<-- [end:greedy]
