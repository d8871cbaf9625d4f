r"""Twin of :mod:`reference.models.llama`: ``llm_build_llama`` / ``llm_build_qwen2`` on MLX.

The same graph, function for function, on ``accelerated.ops``. What differs:

- weights are prepared once by :func:`prepare_weights`: GGUF Q4_0/Q4_1/Q8_0 tensors become
  :class:`accelerated.quants.MLXQuantized` (lossless) and every matmul with them is
  :func:`accelerated.quants.quantized_matmul`; other tensors are ``mx.array`` (float32;
  other GGUF types dequantized once at load);
- ``get_rows`` on a quantized ``token_embd`` gathers the *packed* rows of the needed tokens
  and dequantizes only those (``mx.dequantize``), the same values as the reference's full
  dequantization; a tied lm_head runs quantized on the packed table;
- the result is a lazy ``mx.array`` (the caller evaluates it, e.g. ``np.array(logits)``).

Compute is float32 (MLX's dtype), whatever the dtype of the reference weights.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from numpy.typing import DTypeLike

from accelerated.memory.kv_cache import mx_dtype
from accelerated.ops import add, build_attn_mha, get_rows, mul, mul_mat, rms_norm, rope_ext, swiglu
from accelerated.quants import MLXQuantized, load_weight, quantized_matmul
from reference.hparams import LlamaHParams
from reference.models.llama import (  # host-side pieces, imported as they are
    LLAMA_LAYER_TENSORS,
    SUPPORTED_ARCHS,
    AttnInput,
    LlamaForwardError,
    check_forward_inputs,
    model_dtype,
    rope_cparams,
)

__all__ = [
    "SUPPORTED_ARCHS",
    "AttnInput",
    "LlamaForwardError",
    "build_attn",
    "build_ffn",
    "build_inp_embd",
    "build_norm",
    "build_qkv",
    "get_weight",
    "greedy",
    "layer_weights",
    "linear",
    "llama_forward",
    "llm_build_llama",
    "model_dtype",
    "prepare_weights",
    "rope_cparams",
]

Weight = mx.array | MLXQuantized


# --8<-- [start:prepare_weights]
def prepare_weights(weights: dict) -> dict:
    """The weights as the MLX forward uses them, converted once.

    Args:
        weights: GGUF-named weights: NumPy arrays, :class:`reference.quants.QuantizedTensor`
            or already prepared values (kept as they are).

    Returns:
        The same keys; values :class:`MLXQuantized` (Q4_0, Q4_1, Q8_0) or float32 ``mx.array``.

    Examples:
        >>> w = prepare_weights({"a.weight": np.ones((2, 3), np.float64)})
        >>> w["a.weight"].dtype, w["a.weight"].shape
        (mlx.core.float32, (2, 3))
    """
    out = {}
    for name, w in weights.items():
        if isinstance(w, (mx.array, MLXQuantized)):
            out[name] = w
        elif isinstance(w, np.ndarray) and not np.issubdtype(w.dtype, np.floating):
            out[name] = mx.array(w)
        else:
            out[name] = load_weight(w, mx.float32)
    return out
# --8<-- [end:prepare_weights]


def get_weight(
    weights: dict, name: str, dtype: DTypeLike, required: bool = True
) -> Weight | None:
    """Twin of :func:`reference.models.llama.get_weight`. Not dequantized.

    A prepared :class:`MLXQuantized` weight is returned as it is (it is used quantized); a
    dense one as an ``mx.array`` of ``dtype`` (float64 gives float32, MLX's dtype).

    Raises:
        LlamaForwardError: if a required weight is missing.

    Examples:
        >>> get_weight({}, "a.bias", np.float32, required=False) is None
        True
        >>> get_weight({"a": np.ones(2)}, "a", np.float64).dtype
        mlx.core.float32
    """
    w = weights.get(name)
    if w is None:
        if required:
            raise LlamaForwardError(f"missing weight {name!r}")
        return None
    if isinstance(w, MLXQuantized):
        return w
    return mx.array(w).astype(mx_dtype(dtype))


def linear(w: Weight, cur: mx.array) -> mx.array:
    """``ggml_mul_mat(w, cur)``: ``cur @ w.T``, quantized when ``w`` is.

    Examples:
        >>> linear(mx.array([[1.0, 0.0], [0.0, 2.0]]), mx.array([[3.0, 4.0]])).tolist()
        [[3.0, 8.0]]
    """
    if isinstance(w, MLXQuantized):
        return quantized_matmul(cur, w)  # (n_tokens, n_out)
    return mul_mat(w, cur)  # (n_tokens, n_out)


def layer_weights(weights: dict, il: int, dtype: DTypeLike) -> dict:
    """Twin of :func:`reference.models.llama.layer_weights`. Prepared weights, same fields.

    Examples:
        >>> layer_weights({}, 0, np.float32)
        Traceback (most recent call last):
        ...
        reference.models.llama.LlamaForwardError: missing weight 'blk.0.attn_norm.weight'
    """
    return {
        field: get_weight(weights, f"blk.{il}.{name}", dtype, required)
        for field, (name, required) in LLAMA_LAYER_TENSORS.items()
    }


def _bias(cur: mx.array, b: Weight | None) -> mx.array:
    return cur if b is None else add(cur, b)


def _dense(w: Weight) -> mx.array:
    if isinstance(w, MLXQuantized):
        from accelerated.quants import dequantize_mlx

        return dequantize_mlx(w)
    return w


# --8<-- [start:build_norm]
def build_norm(cur: mx.array, mw: Weight, eps: float) -> mx.array:
    """Twin of :func:`reference.models.llama.build_norm`.

    Examples:
        >>> [round(x, 4) for x in build_norm(mx.array([[3.0, 4.0]]), mx.array([1.0, 2.0]), 0.0)
        ...  .tolist()[0]]
        [0.8485, 2.2627]
    """
    return mul(rms_norm(cur, eps), _dense(mw))
# --8<-- [end:build_norm]


# --8<-- [start:build_qkv]
def build_qkv(
    layer: dict, cur: mx.array, n_embd_head: int, n_head: int, n_head_kv: int
) -> tuple[mx.array, mx.array, mx.array]:
    """Twin of :func:`reference.models.llama.build_qkv`. Quantized matmuls where quantized.

    Examples:
        >>> layer = {"wq": mx.ones((4, 2)), "wk": mx.ones((2, 2)), "wv": mx.ones((2, 2)),
        ...          "bq": None, "bk": None, "bv": mx.array([0.0, 1.0])}
        >>> q, k, v = build_qkv(layer, mx.array([[1.0, 2.0]]), 2, 2, 1)
        >>> q.shape, k.shape, v.tolist()
        ((1, 2, 2), (1, 1, 2), [[[3.0, 4.0]]])
    """
    n_tokens = cur.shape[0]
    q = _bias(linear(layer["wq"], cur), layer["bq"])  # (n_tokens, n_head * d)
    k = _bias(linear(layer["wk"], cur), layer["bk"])  # (n_tokens, n_head_kv * d)
    v = _bias(linear(layer["wv"], cur), layer["bv"])  # (n_tokens, n_head_kv * d)
    q = q.reshape(n_tokens, n_head, n_embd_head)  # (n_tokens, n_head, d)
    k = k.reshape(n_tokens, n_head_kv, n_embd_head)  # (n_tokens, n_head_kv, d)
    v = v.reshape(n_tokens, n_head_kv, n_embd_head)  # (n_tokens, n_head_kv, d)
    return q, k, v
# --8<-- [end:build_qkv]


# --8<-- [start:build_attn]
def build_attn(
    inp: AttnInput,
    wo: Weight,
    wo_b: Weight | None,
    q_cur: mx.array,
    k_cur: mx.array,
    v_cur: mx.array,
    kq_scale: float,
    il: int,
) -> mx.array:
    """Twin of :func:`reference.models.llama.build_attn`. ``inp`` holds MLX tensors.

    Returns:
        ``(n_tokens, n_embd)``.
    """
    inp.cpy_k(il, k_cur)
    inp.cpy_v(il, v_cur)
    k = inp.get_k(il)  # (n_kv, n_head_kv, d_k)
    v = inp.get_v(il)  # (n_kv, n_head_kv, d_v)
    kq_mask = inp.get_kq_mask(il)  # (n_tokens, n_kv)
    cur = build_attn_mha(q_cur, k, v, kq_mask, kq_scale)  # (n_tokens, n_head * d_v)
    return _bias(linear(wo, cur), wo_b)  # (n_tokens, n_embd)
# --8<-- [end:build_attn]


# --8<-- [start:build_ffn]
def build_ffn(cur: mx.array, layer: dict) -> mx.array:
    """Twin of :func:`reference.models.llama.build_ffn`. SwiGLU.

    Examples:
        >>> layer = {"ffn_up": mx.eye(2), "ffn_gate": mx.eye(2), "ffn_down": mx.eye(2),
        ...          "ffn_up_b": None, "ffn_gate_b": None, "ffn_down_b": None}
        >>> [round(x, 4) for x in build_ffn(mx.array([[0.0, 1.0]]), layer).tolist()[0]]
        [0.0, 0.7311]
    """
    up = _bias(linear(layer["ffn_up"], cur), layer["ffn_up_b"])  # (n_tokens, n_ff)
    gate = _bias(linear(layer["ffn_gate"], cur), layer["ffn_gate_b"])  # (n_tokens, n_ff)
    cur = swiglu(gate, up)  # (n_tokens, n_ff)
    return _bias(linear(layer["ffn_down"], cur), layer["ffn_down_b"])  # (n_tokens, n_embd)
# --8<-- [end:build_ffn]


# --8<-- [start:build_inp_embd]
def build_inp_embd(
    weights: dict, tokens: np.ndarray | None, embd: np.ndarray | None, dtype: DTypeLike
) -> mx.array:
    """Twin of :func:`reference.models.llama.build_inp_embd`.

    A quantized ``token_embd`` is not dequantized whole: the packed rows of ``tokens`` are
    gathered, then dequantized (the same values, row by row).

    Examples:
        >>> w = {"token_embd.weight": mx.eye(3)}
        >>> build_inp_embd(w, np.array([2, 0]), None, np.float32).tolist()
        [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    """
    if embd is not None:
        return mx.array(np.asarray(embd)).astype(mx_dtype(dtype))  # (n_tokens, n_embd)
    tok_embd = get_weight(weights, "token_embd.weight", dtype)
    if isinstance(tok_embd, MLXQuantized):
        idx = mx.array(np.asarray(tokens, dtype=np.int32))  # (n_tokens,)
        m = tok_embd
        return mx.dequantize(
            m.w_q[idx], m.scales[idx], m.biases[idx], group_size=m.group_size, bits=m.bits
        )  # (n_tokens, n_embd)
    return get_rows(tok_embd, tokens)  # (n_tokens, n_embd)
# --8<-- [end:build_inp_embd]


# --8<-- [start:llm_build_llama]
def llm_build_llama(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray,
    embd: np.ndarray | None = None,
) -> mx.array:
    """Twin of :func:`reference.models.llama.llm_build_llama`. On prepared weights.

    Returns:
        logits ``(n_outputs, n_vocab)`` float32, lazy.
    """
    dtype = model_dtype(weights)
    n_embd_head = hparams.n_embd_head_k
    kq_scale = hparams.f_attention_scale or 1.0 / math.sqrt(n_embd_head)
    rope = rope_cparams(hparams)
    rope_factors = get_weight(weights, "rope_freqs.weight", dtype, required=False)
    if rope_factors is not None:
        rope_factors = _dense(rope_factors)
    eps = hparams.f_norm_rms_eps
    inpL = build_inp_embd(weights, tokens, embd, dtype)  # (n_tokens, n_embd)
    for il in range(hparams.n_layer):
        layer = layer_weights(weights, il, dtype)
        inpSA = inpL
        cur = build_norm(inpL, layer["attn_norm"], eps)
        q, k, v = build_qkv(layer, cur, n_embd_head, hparams.n_head, hparams.n_head_kv)
        q = rope_ext(q, pos, freq_factors=rope_factors, **rope)  # (n_tokens, n_head, d)
        k = rope_ext(k, pos, freq_factors=rope_factors, **rope)  # (n_tokens, n_head_kv, d)
        cur = build_attn(inp_attn, layer["wo"], layer["bo"], q, k, v, kq_scale, il)
        if il == hparams.n_layer - 1:
            cur = get_rows(cur, out_ids)  # (n_outputs, n_embd)
            inpSA = get_rows(inpSA, out_ids)  # (n_outputs, n_embd)
        ffn_inp = add(cur, inpSA)
        cur = build_norm(ffn_inp, layer["ffn_norm"], eps)
        cur = build_ffn(cur, layer)
        inpL = add(cur, ffn_inp)
    cur = build_norm(inpL, get_weight(weights, "output_norm.weight", dtype), eps)
    output = get_weight(weights, "output.weight", dtype, required=False)
    if output is None:  # tied embeddings: the lm_head is token_embd
        output = get_weight(weights, "token_embd.weight", dtype)
    logits = linear(output, cur)  # (n_outputs, n_vocab)
    return _bias(logits, get_weight(weights, "output.bias", dtype, required=False))
# --8<-- [end:llm_build_llama]


# --8<-- [start:llama_forward]
def llama_forward(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray | None,
    pos: np.ndarray,
    inp_attn: AttnInput,
    out_ids: np.ndarray | None = None,
    embd: np.ndarray | None = None,
) -> mx.array:
    """Twin of :func:`reference.models.llama.llama_forward`. The same checks, then MLX.

    ``weights`` may be raw (NumPy / quantized tensors: :func:`prepare_weights` runs on every
    call then) or prepared once by :func:`prepare_weights` (what a caller should do).

    Returns:
        logits ``(n_outputs, n_vocab)``, a lazy float32 ``mx.array``.

    Raises:
        LlamaForwardError: as the reference (arch, tokens/embd, ranges, shapes).

    Examples:
        >>> from tests.tiny_models import tiny_hparams, random_weights
        >>> from accelerated.memory import KVCache
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = prepare_weights(random_weights(hp, seed=0))
        >>> llama_forward(w, hp, np.array([99]), np.array([3]), None)
        Traceback (most recent call last):
        ...
        reference.models.llama.LlamaForwardError: token id 99 out of range [0, 32)
    """
    tokens, pos, out_ids, embd = check_forward_inputs(hparams, tokens, pos, out_ids, embd)
    weights = prepare_weights(weights)
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
    """Twin of :func:`reference.models.llama.greedy`. The MLX forward and KV cache.

    The single-sequence cache is :class:`accelerated.memory.KVCache` with one stream; the
    argmax is taken on the host after each step.

    Examples:
        >>> from tests.tiny_models import tiny_hparams, random_weights
        >>> from reference.models.llama import greedy as ref_greedy
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp, seed=0)
        >>> greedy(w, hp, [1], n_predict=5) == ref_greedy(w, hp, [1], n_predict=5)
        True
    """
    from accelerated.memory import KVCache
    from reference.batch import Batch, BatchAllocr

    weights = prepare_weights(weights)
    cache = KVCache(hparams, kv_size=n_ctx or len(prompt) + n_predict)
    tokens = [int(t) for t in prompt]
    out: list[int] = []
    while len(out) < n_predict:
        balloc = BatchAllocr(Batch(token=tokens), n_vocab=hparams.n_vocab, n_seq_max=1,
                             memory=cache)
        ubatch = balloc.split_simple(len(tokens))
        sinfo = cache.prepare([ubatch])[0]
        cache.apply_ubatch(sinfo, ubatch)
        logits = llama_forward(weights, hparams, ubatch.token, ubatch.pos,
                               cache.attn_input(ubatch, sinfo), [len(tokens) - 1])
        token = int(mx.argmax(logits[-1]).item())
        if token in stop:
            break
        out.append(token)
        tokens = [token]
    return out
# --8<-- [end:greedy]
