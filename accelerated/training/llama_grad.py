r"""Twin of [`reference.training.llama_grad`][reference.training.llama_grad]: the training forward
on MLX, and every backward as MLX's automatic differentiation of its forward piece.

The forward is the same graph as the reference's (``llm_build_llama`` with the ubatch's own
keys and values under the causal mask), written with
[`accelerated.models.llama`][accelerated.models.llama]'s pieces; the tapes are the reference's
[`LayerTape`][reference.training.llama_grad.LayerTape] /
[`TrainTape`][reference.training.llama_grad.TrainTape] holding ``mx.array``. What differs: no
backward rule is written by hand. Each ``*_back`` function is ``mx.vjp`` of the forward piece it
inverts, and [`loss_and_grads`][] is ``mx.value_and_grad`` of the loss of the whole forward:

$$ (L, \nabla_W L) = \mathrm{value\_and\_grad}\Big(W \mapsto \frac{1}{\mathrm{opt\_period}}
   \,\mathrm{cross\_entropy\_loss}\big(z(W), \mathrm{onehot}(\ell)\big)\Big)(W) . $$

That both differentiate the same function is what ``tests/twin/test_training.py`` checks: the
gradients agree with the reference's chain rule to float32 rounding. Weights are float32
``mx.array`` (plain arrays: the prepared forms of the inference forward, quantized or
transposed, are not differentiable parameters); results are lazy ``mx.array``.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from accelerated.device import gpu_paths
from accelerated.models.llama import (
    attn_grouped,
    build_inp_embd,
    build_norm,
    get_weight,
    layer_weights,
    rope_in_graph,
)
from accelerated.ops import build_attn_mha, swiglu
from accelerated.ops.loss import cross_entropy_loss_ids
from reference.hparams import LlamaHParams, rope_cparams
from reference.models.llama import LLAMA_LAYER_TENSORS, check_forward_inputs, model_dtype
from reference.ops.rope import RopeParams
from reference.training.llama_grad import (  # the tapes and the checks, imported as they are
    LayerTape,
    TrainTape,
    check_train_inputs,
    kq_masks,
)

__all__ = [
    "LayerTape",
    "TrainTape",
    "check_train_inputs",
    "ffn_back",
    "layer_back",
    "layer_forward",
    "linear_back",
    "loss_and_grads",
    "norm_back",
    "self_attn_back",
    "train_backward",
    "train_forward",
]


def _lm_head(weights: dict, dtype) -> tuple[str, mx.array]:
    """The lm_head's GGUF name and matrix: ``output.weight``, or ``token_embd.weight`` when tied."""
    name = "output.weight" if "output.weight" in weights else "token_embd.weight"
    return name, get_weight(weights, name, dtype)


def _linear(w: mx.array, b: mx.array | None, x: mx.array) -> mx.array:
    """``mul_mat(w, x)`` then ``add(., b)`` when there is a bias: $x W^T (+ b)$."""
    y = x @ w.T  # (n_tokens, n_out)
    return y if b is None else y + b


# --8<-- [start:layer_forward]
def layer_forward(
    x: mx.array,
    layer: dict,
    hparams: LlamaHParams,
    pos: np.ndarray,
    kq_mask: mx.array,
    rope: RopeParams,
    freq_factors: mx.array | None = None,
) -> tuple[mx.array, LayerTape]:
    """Twin of
    [`reference.training.llama_grad.layer_forward`][reference.training.llama_grad.layer_forward].

    The attention is
    [`accelerated.models.llama.attn_grouped`][accelerated.models.llama.attn_grouped] on the
    CPU device and MLX's fused kernel on a GPU, as the inference forward chooses
    ([`accelerated.device.gpu_paths`][accelerated.device.gpu_paths]).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.models.simple_cache import build_kq_mask
        >>> hp = tiny_hparams(n_layer=1)
        >>> layer = layer_weights(random_weights(hp), 0, np.float32)
        >>> pos = np.arange(3)
        >>> rope = rope_cparams(hp)
        >>> x, tape = layer_forward(mx.ones((3, 16)), layer, hp, pos,
        ...                         mx.array(build_kq_mask(pos, pos)), rope)
        >>> x.shape, tape.q.shape, tape.act.shape
        ((3, 16), (3, 4, 4), (3, 24))
    """
    d = hparams.n_embd_head_k
    n_tokens = x.shape[0]
    kq_scale = hparams.f_attention_scale or 1.0 / math.sqrt(d)
    eps = hparams.f_norm_rms_eps
    attn_in = build_norm(x, layer["attn_norm"], eps)  # (n_tokens, n_embd)
    q = _linear(layer["wq"], layer["bq"], attn_in).reshape(n_tokens, hparams.n_head, d)
    k = _linear(layer["wk"], layer["bk"], attn_in).reshape(n_tokens, hparams.n_head_kv, d)
    v = _linear(layer["wv"], layer["bv"], attn_in).reshape(n_tokens, hparams.n_head_kv, -1)
    q = rope_in_graph(q, pos, rope, freq_factors)  # (n_tokens, n_head, d)
    k = rope_in_graph(k, pos, rope, freq_factors)  # (n_tokens, n_head_kv, d)
    mha = build_attn_mha if gpu_paths() else attn_grouped
    kqv = mha(q, k, v, kq_mask, kq_scale)  # (n_tokens, n_head * d_v)
    ffn_inp = _linear(layer["wo"], layer["bo"], kqv) + x  # (n_tokens, n_embd)
    ffn_in = build_norm(ffn_inp, layer["ffn_norm"], eps)  # (n_tokens, n_embd)
    gate = _linear(layer["ffn_gate"], layer["ffn_gate_b"], ffn_in)  # (n_tokens, n_ff)
    up = _linear(layer["ffn_up"], layer["ffn_up_b"], ffn_in)  # (n_tokens, n_ff)
    act = swiglu(gate, up)  # (n_tokens, n_ff)
    x_next = _linear(layer["ffn_down"], layer["ffn_down_b"], act) + ffn_inp
    tape = LayerTape(x, pos, rope, freq_factors, attn_in, q, k, v, kq_mask, kqv, ffn_inp, ffn_in,
                     gate, up, act)
    return x_next, tape
# --8<-- [end:layer_forward]


# --8<-- [start:train_forward]
def train_forward(
    weights: dict, hparams: LlamaHParams, tokens: np.ndarray
) -> tuple[mx.array, TrainTape]:
    """Twin of
    [`reference.training.llama_grad.train_forward`][reference.training.llama_grad.train_forward].
    Lazy MLX logits.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights, reference_logits
        >>> hp = tiny_hparams(n_layer=1)
        >>> w = random_weights(hp, seed=0)
        >>> logits, tape = train_forward(w, hp, np.array([1, 5, 7]))
        >>> bool(np.allclose(logits, reference_logits(w, hp, [1, 5, 7]), atol=1e-5))
        True
    """
    pos = np.arange(len(np.asarray(tokens)))
    tokens, pos, _, _ = check_forward_inputs(hparams, tokens, pos, None, None)
    dtype = model_dtype(weights)
    causal, windowed = (mx.array(m) for m in kq_masks(hparams, pos, np.float32))
    freq_factors = get_weight(weights, "rope_freqs.weight", dtype, required=False)
    rope = rope_cparams(hparams)
    x = build_inp_embd(weights, tokens, None, dtype)  # (n_tokens, n_embd)
    tapes = []
    for il in range(hparams.n_layer):
        mask = windowed if hparams.is_swa(il) else causal
        x, tape = layer_forward(x, layer_weights(weights, il, dtype), hparams, pos, mask, rope,
                                freq_factors)
        tapes.append(tape)
    out_norm = get_weight(weights, "output_norm.weight", dtype)
    out_in = build_norm(x, out_norm, hparams.f_norm_rms_eps)  # (n_tokens, n_embd)
    output_b = get_weight(weights, "output.bias", dtype, required=False)
    logits = _linear(_lm_head(weights, dtype)[1], output_b, out_in)  # (n_tokens, n_vocab)
    return logits, TrainTape(tokens, pos, tapes, x, out_in)
# --8<-- [end:train_forward]


def _acc(grads: dict, name: str, g: mx.array) -> None:
    """Add ``g`` to the gradient of ``name`` (ggml's ``ggml_add_or_set``)."""
    grads[name] = g if name not in grads else grads[name] + g


def _vjp(fn, primals: list, cotangent: mx.array) -> list[mx.array]:
    """The gradients of ``fn``'s inputs for the cotangent of its one output (``mx.vjp``)."""
    _, grads = mx.vjp(lambda *a: fn(*a), primals, [cotangent])
    return grads


# --8<-- [start:norm_back]
def norm_back(
    grad: mx.array, x: mx.array, gain: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    r"""Twin of
    [`reference.training.llama_grad.norm_back`][reference.training.llama_grad.norm_back].
    ``mx.vjp`` of ``build_norm``.

    Examples:
        >>> gx, gg = norm_back(mx.ones((2, 2)), mx.array([[3.0, 4.0], [1.0, 1.0]]), mx.ones(2),
        ...                    0.0)
        >>> [round(g, 4) for g in gg.tolist()]
        [1.8485, 2.1314]
    """
    grad_x, grad_gain = _vjp(lambda x, g: build_norm(x, g, eps), [x, gain], grad)
    return grad_x, grad_gain
# --8<-- [end:norm_back]


# --8<-- [start:linear_back]
def linear_back(
    grad: mx.array, w: mx.array, b: mx.array | None, x: mx.array, name: str, grads: dict
) -> mx.array:
    r"""Twin of
    [`reference.training.llama_grad.linear_back`][reference.training.llama_grad.linear_back].
    ``mx.vjp`` of the product (and bias).

    Examples:
        >>> grads = {}
        >>> gx = linear_back(mx.ones((1, 2)), mx.eye(2), None, mx.array([[3.0, 4.0]]), "w", grads)
        >>> gx.tolist(), grads["w.weight"].tolist()
        ([[1.0, 1.0]], [[3.0, 4.0], [3.0, 4.0]])
    """
    if b is None:
        grad_w, grad_x = _vjp(lambda w, x: _linear(w, None, x), [w, x], grad)
    else:
        grad_w, grad_b, grad_x = _vjp(_linear, [w, b, x], grad)
        _acc(grads, f"{name}.bias", grad_b)
    _acc(grads, f"{name}.weight", grad_w)
    return grad_x
# --8<-- [end:linear_back]


def _names(il: int) -> dict:
    """``llama_layer`` field -> GGUF name without the ``.weight``/``.bias`` suffix."""
    return {field: f"blk.{il}.{name.rsplit('.', 1)[0]}" for field, (name, _) in
            LLAMA_LAYER_TENSORS.items()}


def _vjp_fields(fn, layer: dict, fields: tuple, x: mx.array, grad: mx.array, il: int,
                grads: dict) -> mx.array:
    """``mx.vjp`` of ``fn(x, layer)`` for ``x`` and the present ``fields`` of ``layer``; the
    weights' gradients go into ``grads`` under their GGUF names."""
    present = [f for f in fields if layer[f] is not None]

    def piece(x, *ws):
        return fn(x, {**layer, **dict(zip(present, ws, strict=True))})

    grad_x, *grad_ws = _vjp(piece, [x, *(layer[f] for f in present)], grad)
    names = {f: n for f, (n, _) in LLAMA_LAYER_TENSORS.items()}
    for f, g in zip(present, grad_ws, strict=True):
        _acc(grads, f"blk.{il}.{names[f]}", g)
    return grad_x


_FFN_FIELDS = ("ffn_gate", "ffn_gate_b", "ffn_up", "ffn_up_b", "ffn_down", "ffn_down_b")
_ATTN_FIELDS = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo")


def _ffn(ffn_in: mx.array, layer: dict) -> mx.array:
    gate = _linear(layer["ffn_gate"], layer["ffn_gate_b"], ffn_in)  # (n_tokens, n_ff)
    up = _linear(layer["ffn_up"], layer["ffn_up_b"], ffn_in)  # (n_tokens, n_ff)
    return _linear(layer["ffn_down"], layer["ffn_down_b"], swiglu(gate, up))  # (n_tokens, n_embd)


# --8<-- [start:ffn_back]
def ffn_back(grad: mx.array, tape: LayerTape, layer: dict, il: int, grads: dict) -> mx.array:
    r"""Twin of [`reference.training.llama_grad.ffn_back`][reference.training.llama_grad.ffn_back].
    ``mx.vjp`` of the FFN from its normed input.
    """
    return _vjp_fields(_ffn, layer, _FFN_FIELDS, tape.ffn_in, grad, il, grads)
# --8<-- [end:ffn_back]


# --8<-- [start:self_attn_back]
def self_attn_back(
    grad: mx.array, tape: LayerTape, layer: dict, hparams: LlamaHParams, il: int, grads: dict
) -> mx.array:
    r"""Twin of
    [`reference.training.llama_grad.self_attn_back`][reference.training.llama_grad.self_attn_back].
    ``mx.vjp`` of the attention half, from the normed input to ``wo``'s output.
    """
    d = hparams.n_embd_head_k
    kq_scale = hparams.f_attention_scale or 1.0 / math.sqrt(d)
    mha = build_attn_mha if gpu_paths() else attn_grouped

    def attn(attn_in: mx.array, layer: dict) -> mx.array:
        n = attn_in.shape[0]
        q = _linear(layer["wq"], layer["bq"], attn_in).reshape(n, hparams.n_head, d)
        k = _linear(layer["wk"], layer["bk"], attn_in).reshape(n, hparams.n_head_kv, d)
        v = _linear(layer["wv"], layer["bv"], attn_in).reshape(n, hparams.n_head_kv, -1)
        q = rope_in_graph(q, tape.pos, tape.rope, tape.freq_factors)  # (n_tokens, n_head, d)
        k = rope_in_graph(k, tape.pos, tape.rope, tape.freq_factors)  # (n_tokens, n_head_kv, d)
        kqv = mha(q, k, v, tape.kq_mask, kq_scale)  # (n_tokens, n_head * d_v)
        return _linear(layer["wo"], layer["bo"], kqv)  # (n_tokens, n_embd)

    return _vjp_fields(attn, layer, _ATTN_FIELDS, tape.attn_in, grad, il, grads)
# --8<-- [end:self_attn_back]


# --8<-- [start:layer_back]
def layer_back(
    grad: mx.array, tape: LayerTape, layer: dict, hparams: LlamaHParams, il: int, grads: dict
) -> mx.array:
    r"""Twin of
    [`reference.training.llama_grad.layer_back`][reference.training.llama_grad.layer_back].
    The same composition of the MLX pieces above.
    """
    eps = hparams.f_norm_rms_eps
    grad_ffn_in = ffn_back(grad, tape, layer, il, grads)
    grad_y, grad_gain = norm_back(grad_ffn_in, tape.ffn_inp, layer["ffn_norm"], eps)
    _acc(grads, f"blk.{il}.ffn_norm.weight", grad_gain)
    grad_y = grad_y + grad  # the residual y -> x^(l+1)
    grad_attn_in = self_attn_back(grad_y, tape, layer, hparams, il, grads)
    grad_x, grad_gain = norm_back(grad_attn_in, tape.x, layer["attn_norm"], eps)
    _acc(grads, f"blk.{il}.attn_norm.weight", grad_gain)
    return grad_x + grad_y  # the residual x^(l) -> y
# --8<-- [end:layer_back]


def _differentiable(weights: dict) -> dict:
    """The weights that get a gradient: every float array but ``rope_freqs.weight``, as
    float32 ``mx.array`` (quantized tensors stay constants, as ggml cannot train them)."""
    out = {}
    for name, w in weights.items():
        if name == "rope_freqs.weight" or not isinstance(w, (np.ndarray, mx.array)):
            continue
        a = mx.array(w)
        if mx.issubdtype(a.dtype, mx.floating):
            out[name] = a.astype(mx.float32)
    return out


# --8<-- [start:train_backward]
def train_backward(
    weights: dict, hparams: LlamaHParams, tape: TrainTape, grad_logits: mx.array
) -> dict[str, mx.array]:
    r"""Twin of
    [`reference.training.llama_grad.train_backward`][reference.training.llama_grad.train_backward].
    ``mx.vjp`` of the whole forward for the weights (the tape's tokens).

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1, tied=True)
        >>> w = random_weights(hp, seed=0)
        >>> logits, tape = train_forward(w, hp, np.array([3, 1]))
        >>> grads = train_backward(w, hp, tape, mx.ones_like(logits))
        >>> sorted(grads) == sorted(w), grads["token_embd.weight"].shape
        (True, (32, 16))
    """
    params = _differentiable(weights)
    names = sorted(params)

    def forward(*ws):
        return train_forward({**weights, **dict(zip(names, ws, strict=True))}, hparams,
                             tape.tokens)[0]

    return dict(zip(names, _vjp(forward, [params[n] for n in names], grad_logits), strict=True))
# --8<-- [end:train_backward]


# --8<-- [start:loss_and_grads]
def loss_and_grads(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray,
    labels: np.ndarray,
    opt_period: int = 1,
) -> tuple[float, dict[str, mx.array], mx.array]:
    r"""Twin of
    [`reference.training.llama_grad.loss_and_grads`][reference.training.llama_grad.loss_and_grads].
    ``mx.value_and_grad`` of the scaled loss.

    The loss is $\frac{1}{\mathrm{opt\_period}}$ times the mean of
    $\log\sum_c e^{z_{t,c}} - z_{t,\ell_t}$ (``mx.logsumexp``, the same cross-entropy as the
    reference's one-hot product); the gradients are every float weight's but
    ``rope_freqs.weight``'s, lazy; the logits are returned lazy too.

    Raises:
        TrainGraphError: if ``labels`` is not one in-range id per token, or ``opt_period < 1``.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1)
        >>> loss, grads, _ = loss_and_grads(random_weights(hp), hp, [1, 2, 3], [2, 3, 4])
        >>> 2.0 < loss < 6.0, sorted(grads)[:2]
        (True, ['blk.0.attn_k.weight', 'blk.0.attn_norm.weight'])
    """
    labels = check_train_inputs(hparams, tokens, labels, opt_period)
    params = _differentiable(weights)
    label_ids = mx.array(labels.astype(np.int32))

    def loss_fn(params: dict):
        logits, _ = train_forward({**weights, **params}, hparams, tokens)
        return cross_entropy_loss_ids(logits, label_ids) * (1.0 / opt_period), logits

    (loss, logits), grads = mx.value_and_grad(loss_fn)(params)
    mx.eval(loss, grads, logits)
    return float(loss.item()), grads, logits
# --8<-- [end:loss_and_grads]
