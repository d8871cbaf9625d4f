r"""The gradient of a Llama's training loss: a recording forward, then the chain rule by hand.

**Which graph llama.cpp differentiates.** ``llama_context::opt_epoch_iter`` clears the memory
for every datapoint of ``n_ctx`` tokens at positions $0 \dots n_{ctx} - 1$, requests logits
for every token, and builds the *normal* ``llm_build_llama`` graph for the ubatch. When
``n_ubatch == n_ctx`` (the only case in which ``opt_init`` sets ``cparams.training``),
``build_attn`` reads ``k = k_cur``, ``v = v_cur`` directly instead of storing them in the
cache and reading them back (gradients cannot flow through the cache): the ubatch attends to
its own keys and values under the causal mask (windowed on SWA layers), exactly what
[`train_forward`][] computes without a memory. (With ``n_ubatch < n_ctx`` llama.cpp warns
that the K and V projections get no gradient: their path goes through ``set_rows`` into the
cache, which has no backward. That mode is not specified here.) The last layer's
``get_rows(out_ids)`` selects every row in order, so its backward (a scatter-add through the
identity) is left out.

**The loss.** ``ggml_opt`` appends ``cross_entropy_loss(logits, labels)`` with one-hot labels
of the next tokens, the mean over the ubatch's tokens (scaled by $1/\mathrm{opt\_period}$
when gradients are accumulated), and ``ggml_build_backward_expand`` runs
[`reference.training.grad`][reference.training.grad]'s rules from the loss back to the
parameters. [`train_backward`][] writes that walk out, block by block, in reverse:

$$
\begin{aligned}
\bar z &= \mathrm{cross\_entropy\_loss\_back}(\bar L, z, \ell)
  && z = \mathrm{norm}(x^{(L)}) W_{out}^T \\
\bar W_{out} &= \bar z^T u_{out},\quad \bar x^{(L)} = \mathrm{norm\_back}(\bar z\, W_{out})
  && u_{out} = \mathrm{norm}(x^{(L)}) \\
\bar y &= \bar x^{(l+1)} + \mathrm{norm\_back}\big(\mathrm{ffn\_back}(\bar x^{(l+1)})\big)
  && x^{(l+1)} = y + \mathrm{ffn}(\mathrm{norm}(y)) \\
\bar x^{(l)} &= \bar y + \mathrm{norm\_back}\big(\mathrm{qkv\_back}(\mathrm{rope\_back}(
  \mathrm{attn\_back}(\bar y\, W_o)))\big)
  && y = x^{(l)} + \mathrm{attn}(\mathrm{norm}(x^{(l)})) W_o^T \\
\bar E &= \mathrm{get\_rows\_back}(\bar x^{(0)}, t) \;(+\ \bar W_{out} \text{ when tied})
  && x^{(0)} = E[t]
\end{aligned}
$$

where "norm" is ``rms_norm`` times its gain. Every weight gets its gradient, keyed by its
GGUF name; which of them llama.cpp actually trains (not ``token_embd``) is
[`reference.training.opt.trainable_params`][reference.training.opt.trainable_params]'s
business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from reference.hparams import LlamaHParams, rope_cparams
from reference.models.llama import (
    LLAMA_LAYER_TENSORS,
    build_norm,
    check_forward_inputs,
    get_weight,
    layer_weights,
    model_dtype,
)
from reference.models.simple_cache import build_kq_mask
from reference.ops import (
    add,
    build_attn_mha,
    cross_entropy_loss,
    cross_entropy_loss_back,
    get_rows,
    get_rows_back,
    mul_mat,
    rms_norm,
    rope_back,
    rope_ext,
    swiglu,
)
from reference.ops.rope import RopeParams
from reference.training.errors import TrainGraphError
from reference.training.grad import (
    attn_back,
    mul_back,
    mul_mat_back,
    repeat_back,
    rms_norm_back,
    swiglu_back,
)


# --8<-- [start:LayerTape]
@dataclass
class LayerTape:
    """What the backward of one block needs from its forward (ggml keeps these tensors).

    ``rope`` is the model's [`RopeParams`][reference.ops.rope.RopeParams]
    (``rope_cparams(hparams)``), ``freq_factors`` its ``rope_freqs.weight`` (or None).
    Shapes: ``pos`` ``(n_tokens,)``; ``x``, ``attn_in``, ``ffn_inp``, ``ffn_in``
    ``(n_tokens, n_embd)``; ``q`` ``(n_tokens, n_head, d)``, ``k``/``v``
    ``(n_tokens, n_head_kv, d)`` (``q``, ``k`` after RoPE); ``kqv``
    ``(n_tokens, n_head * d)``; ``gate``, ``up``, ``act`` ``(n_tokens, n_ff)``; ``kq_mask``
    ``(n_tokens, n_tokens)``.
    """

    x: np.ndarray  # the block's input x^(l)
    pos: np.ndarray  # the positions RoPE used
    rope: RopeParams  # rope_cparams(hparams)
    freq_factors: np.ndarray | None  # rope_freqs.weight
    attn_in: np.ndarray  # rms_norm(x) * attn_norm
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kq_mask: np.ndarray
    kqv: np.ndarray  # the heads' outputs side by side, the input of wo
    ffn_inp: np.ndarray  # y = x + attention
    ffn_in: np.ndarray  # rms_norm(y) * ffn_norm
    gate: np.ndarray  # ffn_in W_gate^T (+ b)
    up: np.ndarray  # ffn_in W_up^T (+ b)
    act: np.ndarray  # swiglu(gate, up), the input of ffn_down
# --8<-- [end:LayerTape]


# --8<-- [start:TrainTape]
@dataclass
class TrainTape:
    """The forward's record: the tokens, every block's [`LayerTape`][], the lm_head's input."""

    tokens: np.ndarray  # (n_tokens,)
    pos: np.ndarray  # (n_tokens,) = 0 .. n_tokens - 1
    layers: list[LayerTape]
    out_x: np.ndarray  # x^(L), the last block's output (n_tokens, n_embd)
    out_in: np.ndarray  # rms_norm(x^(L)) * output_norm (n_tokens, n_embd)
# --8<-- [end:TrainTape]


def _lm_head(weights: dict, dtype: np.dtype) -> tuple[str, np.ndarray]:
    """The lm_head's GGUF name and matrix: ``output.weight``, or ``token_embd.weight`` when tied."""
    name = "output.weight" if "output.weight" in weights else "token_embd.weight"
    return name, get_weight(weights, name, dtype)


def _linear(w: np.ndarray, b: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """``mul_mat(w, x)`` then ``add(., b)`` when there is a bias."""
    y = mul_mat(w, x)  # (n_tokens, n_out)
    return y if b is None else add(y, b)


# --8<-- [start:layer_forward]
def layer_forward(
    x: np.ndarray,
    layer: dict,
    hparams: LlamaHParams,
    pos: np.ndarray,
    kq_mask: np.ndarray,
    rope: RopeParams,
    freq_factors: np.ndarray | None = None,
) -> tuple[np.ndarray, LayerTape]:
    """One block of ``llm_build_llama`` with K/V of the ubatch itself, and its record.

    Args:
        x: the block's input ``(n_tokens, n_embd)``.
        layer: [`reference.models.llama.layer_weights`][reference.models.llama.layer_weights].
        hparams: the model's hyperparameters.
        pos: positions ``(n_tokens,)``.
        kq_mask: the causal (or windowed) mask ``(n_tokens, n_tokens)``.
        rope: the model's [`RopeParams`][reference.ops.rope.RopeParams] (``rope_cparams``).
        freq_factors: ``rope_freqs.weight``, or None.

    Returns:
        ``(x_next, tape)``.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> from reference.models.simple_cache import build_kq_mask
        >>> hp = tiny_hparams(n_layer=1)
        >>> layer = layer_weights(random_weights(hp), 0, np.float32)
        >>> pos = np.arange(3)
        >>> rope = rope_cparams(hp)
        >>> x, tape = layer_forward(np.ones((3, 16), np.float32), layer, hp, pos,
        ...                         build_kq_mask(pos, pos), rope)
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
    q = rope_ext(q, pos, rope, freq_factors)  # (n_tokens, n_head, d)
    k = rope_ext(k, pos, rope, freq_factors)  # (n_tokens, n_head_kv, d)
    kqv = build_attn_mha(q, k, v, kq_mask, kq_scale)  # (n_tokens, n_head * d_v)
    ffn_inp = add(_linear(layer["wo"], layer["bo"], kqv), x)  # (n_tokens, n_embd)
    ffn_in = build_norm(ffn_inp, layer["ffn_norm"], eps)  # (n_tokens, n_embd)
    gate = _linear(layer["ffn_gate"], layer["ffn_gate_b"], ffn_in)  # (n_tokens, n_ff)
    up = _linear(layer["ffn_up"], layer["ffn_up_b"], ffn_in)  # (n_tokens, n_ff)
    act = swiglu(gate, up)  # (n_tokens, n_ff)
    x_next = add(_linear(layer["ffn_down"], layer["ffn_down_b"], act), ffn_inp)
    tape = LayerTape(x, pos, rope, freq_factors, attn_in, q, k, v, kq_mask, kqv, ffn_inp, ffn_in,
                     gate, up, act)
    return x_next, tape
# --8<-- [end:layer_forward]


def kq_masks(hparams: LlamaHParams, pos: np.ndarray, dtype: np.dtype) -> tuple:
    """The causal mask and, when some layer is SWA, the windowed one (cells = the ubatch).

    Shared with the MLX twin.

    Returns:
        ``(causal, windowed)``, each ``(n_tokens, n_tokens)``; the same array twice without
        SWA layers.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> causal, windowed = kq_masks(tiny_hparams(), np.arange(3), np.float32)
        >>> causal[0].tolist(), causal is windowed
        ([0.0, -inf, -inf], True)
    """
    causal = build_kq_mask(pos, pos, dtype=dtype)  # (n_tokens, n_tokens)
    if not hparams.is_swa_any():
        return causal, causal
    return causal, build_kq_mask(pos, pos, hparams.n_swa, hparams.swa_type, dtype)


# --8<-- [start:train_forward]
def train_forward(
    weights: dict, hparams: LlamaHParams, tokens: np.ndarray
) -> tuple[np.ndarray, TrainTape]:
    """The forward of one datapoint as llama.cpp's training graph runs it, with its record.

    Args:
        weights: GGUF-named weights (their dtype, ``token_embd``'s, is the compute dtype).
        hparams: ``llama`` or ``qwen2`` hyperparameters.
        tokens: the datapoint ``(n_tokens,)``, at positions ``0 .. n_tokens - 1``.

    Returns:
        ``(logits, tape)``: logits ``(n_tokens, n_vocab)`` (equal to
        [`reference.models.llama.llama_forward`][reference.models.llama.llama_forward]'s for
        a fresh cache) and the [`TrainTape`][] for [`train_backward`][].

    Raises:
        LlamaForwardError: bad tokens or arch (as the forward).

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
    causal, windowed = kq_masks(hparams, pos, dtype)
    freq_factors = get_weight(weights, "rope_freqs.weight", dtype, required=False)
    rope = rope_cparams(hparams)
    x = get_rows(get_weight(weights, "token_embd.weight", dtype), tokens)  # (n_tokens, n_embd)
    tapes = []
    for il in range(hparams.n_layer):
        mask = windowed if hparams.is_swa(il) else causal
        x, tape = layer_forward(x, layer_weights(weights, il, dtype), hparams, pos, mask, rope,
                                freq_factors)
        tapes.append(tape)
    out_norm = get_weight(weights, "output_norm.weight", dtype)
    out_in = build_norm(x, out_norm, hparams.f_norm_rms_eps)  # (n_tokens, n_embd)
    logits = mul_mat(_lm_head(weights, dtype)[1], out_in)  # (n_tokens, n_vocab)
    output_b = get_weight(weights, "output.bias", dtype, required=False)
    if output_b is not None:
        logits = add(logits, output_b)
    return logits, TrainTape(tokens, pos, tapes, x, out_in)
# --8<-- [end:train_forward]


def _acc(grads: dict, name: str, g: np.ndarray) -> None:
    """Add ``g`` to the gradient of ``name`` (ggml's ``ggml_add_or_set``)."""
    grads[name] = g if name not in grads else grads[name] + g


# --8<-- [start:norm_back]
def norm_back(
    grad: np.ndarray, x: np.ndarray, gain: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    r"""The backward of ``build_norm``: $y = \mathrm{rms\_norm}(x) \odot g$.

    ``mul_back`` gives $\bar g = \sum_t \mathrm{rms\_norm}(x)_t \odot \bar y_t$ and the
    gradient of the normed rows, which ``rms_norm_back`` carries to $x$.

    Returns:
        ``(grad_x, grad_gain)``.

    Examples:
        >>> gx, gg = norm_back(np.ones((2, 2)), np.array([[3.0, 4.0], [1.0, 1.0]]), np.ones(2), 0.0)
        >>> gg.round(4)
        array([1.8485, 2.1314])
    """
    normed = rms_norm(x, eps)  # (n_tokens, n_embd)
    grad_normed, grad_gain = mul_back(grad, normed, gain)
    return rms_norm_back(grad_normed, x, eps), grad_gain
# --8<-- [end:norm_back]


# --8<-- [start:linear_back]
def linear_back(
    grad: np.ndarray, w: np.ndarray, b: np.ndarray | None, x: np.ndarray, name: str, grads: dict
) -> np.ndarray:
    r"""The backward of ``mul_mat(w, x)`` (``+ b``): $\bar W \mathrel{+}= \bar y^T x$,
    $\bar b \mathrel{+}= \sum_t \bar y_t$; returns $\bar x = \bar y\, W$.

    Args:
        grad: $\bar y$ ``(n_tokens, n_out)``.
        w: ``(n_out, n_in)``.
        b: ``(n_out,)`` or None.
        x: the forward's input ``(n_tokens, n_in)``.
        name: the GGUF name of ``w`` up to ``.weight`` (``"blk.0.attn_q"``).
        grads: the gradients, updated in place.

    Returns:
        $\bar x$ ``(n_tokens, n_in)``.
    """
    grad_w, grad_x = mul_mat_back(grad, w, x)
    _acc(grads, f"{name}.weight", grad_w)
    if b is not None:
        _acc(grads, f"{name}.bias", repeat_back(grad, b.shape))
    return grad_x
# --8<-- [end:linear_back]


def _names(il: int) -> dict:
    """``llama_layer`` field -> GGUF name without the ``.weight``/``.bias`` suffix."""
    return {field: f"blk.{il}.{name.rsplit('.', 1)[0]}" for field, (name, _) in
            LLAMA_LAYER_TENSORS.items()}


# --8<-- [start:ffn_back]
def ffn_back(grad: np.ndarray, tape: LayerTape, layer: dict, il: int, grads: dict) -> np.ndarray:
    r"""The backward of ``build_ffn``: ``ffn_down``, then SwiGLU, then ``ffn_gate`` and ``ffn_up``.

    $$ \bar a = \bar y\, W_{down},\quad (\bar g, \bar u) = \mathrm{swiglu\_back}(\bar a),\quad
       \bar x = \bar g\, W_{gate} + \bar u\, W_{up} . $$

    Returns:
        The gradient of the FFN's input (the normed ``ffn_inp``) ``(n_tokens, n_embd)``.
    """
    name = _names(il)
    grad_act = linear_back(grad, layer["ffn_down"], layer["ffn_down_b"], tape.act,
                           name["ffn_down"], grads)  # (n_tokens, n_ff)
    grad_gate, grad_up = swiglu_back(grad_act, tape.gate, tape.up)  # (n_tokens, n_ff) each
    grad_in = linear_back(grad_gate, layer["ffn_gate"], layer["ffn_gate_b"], tape.ffn_in,
                          name["ffn_gate"], grads)  # (n_tokens, n_embd)
    return grad_in + linear_back(grad_up, layer["ffn_up"], layer["ffn_up_b"], tape.ffn_in,
                                 name["ffn_up"], grads)
# --8<-- [end:ffn_back]


# --8<-- [start:self_attn_back]
def self_attn_back(
    grad: np.ndarray, tape: LayerTape, layer: dict, hparams: LlamaHParams, il: int, grads: dict
) -> np.ndarray:
    r"""The backward of the attention half of a block, from ``wo`` back to the normed input.

    ``wo``, then [`reference.training.grad.attn_back`][reference.training.grad.attn_back]
    (GQA: each KV head collects the gradients of the query heads that read it), then the
    inverse rotation on $\bar q$ and $\bar k$, then the three projections, whose input
    gradients add up.

    Returns:
        The gradient of ``attn_in`` ``(n_tokens, n_embd)``.
    """
    name = _names(il)
    n_tokens = grad.shape[0]
    kq_scale = hparams.f_attention_scale or 1.0 / math.sqrt(hparams.n_embd_head_k)
    grad_kqv = linear_back(grad, layer["wo"], layer["bo"], tape.kqv, name["wo"], grads)
    grad_q, grad_k, grad_v = attn_back(grad_kqv, tape.q, tape.k, tape.v, tape.kq_mask, kq_scale)
    grad_q = rope_back(grad_q, tape.pos, tape.rope, tape.freq_factors)  # (n_tokens, n_head, d)
    grad_k = rope_back(grad_k, tape.pos, tape.rope, tape.freq_factors)  # (n_tokens, n_head_kv, d)
    grad_in = linear_back(grad_q.reshape(n_tokens, -1), layer["wq"], layer["bq"], tape.attn_in,
                          name["wq"], grads)  # (n_tokens, n_embd)
    grad_in = grad_in + linear_back(grad_k.reshape(n_tokens, -1), layer["wk"], layer["bk"],
                                    tape.attn_in, name["wk"], grads)
    return grad_in + linear_back(grad_v.reshape(n_tokens, -1), layer["wv"], layer["bv"],
                                 tape.attn_in, name["wv"], grads)
# --8<-- [end:self_attn_back]


# --8<-- [start:layer_back]
def layer_back(
    grad: np.ndarray, tape: LayerTape, layer: dict, hparams: LlamaHParams, il: int, grads: dict
) -> np.ndarray:
    r"""The backward of block ``il``: the FFN half, then the attention half, residuals included.

    $$ \bar y = \bar x^{(l+1)} + \mathrm{norm\_back}(\mathrm{ffn\_back}(\bar x^{(l+1)})),
       \qquad
       \bar x^{(l)} = \bar y + \mathrm{norm\_back}(\mathrm{self\_attn\_back}(\bar y)). $$

    Args:
        grad: $\bar x^{(l+1)}$ ``(n_tokens, n_embd)``.
        tape: the block's [`LayerTape`][].
        layer: its weights.
        hparams: the model's hyperparameters.
        il: the block's index.
        grads: the gradients, updated in place.

    Returns:
        $\bar x^{(l)}$ ``(n_tokens, n_embd)``.
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


# --8<-- [start:train_backward]
def train_backward(
    weights: dict, hparams: LlamaHParams, tape: TrainTape, grad_logits: np.ndarray
) -> dict[str, np.ndarray]:
    r"""The gradient of every weight, from the gradient of the logits back to the embeddings.

    Args:
        weights: the weights of the forward.
        hparams: its hyperparameters.
        tape: the [`TrainTape`][] of [`train_forward`][].
        grad_logits: $\bar z$ ``(n_tokens, n_vocab)``, e.g. from
            [`cross_entropy_loss_back`][reference.ops.loss.cross_entropy_loss_back].

    Returns:
        GGUF name -> gradient, one entry per weight the forward used (``rope_freqs.weight``
        excepted: ggml has no gradient for RoPE frequency factors). With tied embeddings,
        ``token_embd.weight``'s gradient is the sum of the lm_head's and the lookup's.

    Examples:
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams(n_layer=1, tied=True)
        >>> w = random_weights(hp, seed=0, dtype=np.float64)
        >>> logits, tape = train_forward(w, hp, np.array([3, 1]))
        >>> grads = train_backward(w, hp, tape, np.ones_like(logits))
        >>> sorted(grads) == sorted(w), grads["token_embd.weight"].shape
        (True, (32, 16))
    """
    dtype = model_dtype(weights)
    grads: dict[str, np.ndarray] = {}
    head_name, head = _lm_head(weights, dtype)
    output_b = get_weight(weights, "output.bias", dtype, required=False)
    grad_x = linear_back(grad_logits, head, output_b, tape.out_in, head_name[:-len(".weight")],
                         grads)  # (n_tokens, n_embd)
    out_norm = get_weight(weights, "output_norm.weight", dtype)
    grad_x, grad_gain = norm_back(grad_x, tape.out_x, out_norm, hparams.f_norm_rms_eps)
    _acc(grads, "output_norm.weight", grad_gain)
    for il in reversed(range(hparams.n_layer)):
        layer = layer_weights(weights, il, dtype)
        grad_x = layer_back(grad_x, tape.layers[il], layer, hparams, il, grads)
    n_vocab = hparams.n_vocab
    _acc(grads, "token_embd.weight", get_rows_back(grad_x, tape.tokens, n_vocab))
    return grads
# --8<-- [end:train_backward]


def check_train_inputs(hparams: LlamaHParams, tokens, labels, opt_period: int) -> np.ndarray:
    """The labels as int64, checked: one in-range id per token, and ``opt_period >= 1``.

    Raises:
        TrainGraphError: otherwise, saying which.

    Examples:
        >>> from reference.testing import tiny_hparams
        >>> check_train_inputs(tiny_hparams(), [1, 2], [2, 99], 1)
        Traceback (most recent call last):
        ...
        reference.training.errors.TrainGraphError: labels must be one id in [0, 32) per token; ...
    """
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != np.shape(tokens) or ((labels < 0) | (labels >= hparams.n_vocab)).any():
        raise TrainGraphError(
            f"labels must be one id in [0, {hparams.n_vocab}) per token; got {labels.tolist()}"
        )
    if opt_period < 1:
        raise TrainGraphError(f"opt_period must be at least 1, got {opt_period}")
    return labels


# --8<-- [start:loss_and_grads]
def loss_and_grads(
    weights: dict,
    hparams: LlamaHParams,
    tokens: np.ndarray,
    labels: np.ndarray,
    opt_period: int = 1,
) -> tuple[float, dict[str, np.ndarray], np.ndarray]:
    r"""One ubatch of training: the loss ggml-opt reports and the gradients it accumulates.

    $$ L = \frac{1}{\mathrm{opt\_period}}\ \mathrm{cross\_entropy\_loss}(z, \mathrm{onehot}(\ell)),
       \qquad \bar L = \frac{1}{\mathrm{opt\_period}} . $$

    Args:
        weights: GGUF-named weights.
        hparams: their hyperparameters.
        tokens: the datapoint ``(n_tokens,)``.
        labels: the next tokens ``(n_tokens,)`` (the dataset's labels).
        opt_period: ubatches per optimizer step (``n_batch / n_ubatch``); the loss and its
            gradient are scaled by its inverse, as ggml-opt scales the loss node.

    Returns:
        ``(loss, grads, logits)``: the scaled loss, every weight's gradient
        ([`train_backward`][]) and the logits ``(n_tokens, n_vocab)``.

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
    logits, tape = train_forward(weights, hparams, tokens)
    onehot = np.zeros(logits.shape, dtype=logits.dtype)  # (n_tokens, n_vocab)
    onehot[np.arange(len(labels)), labels] = 1  # not np.eye(n_vocab)[labels]: n_vocab^2 floats
    t = logits.dtype.type
    loss = cross_entropy_loss(logits, onehot) * (t(1) / t(opt_period))
    grad_logits = cross_entropy_loss_back(t(1) / t(opt_period), logits, onehot)
    return float(loss), train_backward(weights, hparams, tape, grad_logits), logits
# --8<-- [end:loss_and_grads]
