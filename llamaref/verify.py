r"""``llamaref verify``: the equivalence harness, run on *your* model.

The test suite proves its claims on tiny random models and on SmolLM2. This module runs the
same checks on any model you give it, with that model's own shapes and weights, and prints a
table: check, measured value, threshold, PASS or FAIL. Four groups:

1. **Op twins** (test-backend-ops style): each operator of ``accelerated.ops`` against
   ``reference.ops`` on the model's tensors: ``get_rows`` on ``token_embd`` for the prompt,
   ``rms_norm`` with the model's ``attn_norm`` gain and ``eps``, ``mul_mat`` with each layer-0
   weight (quantized on the MLX side when MLX holds it quantized), ``rope_ext`` with the
   model's RoPE parameters, ``soft_max_ext`` and attention with its head counts, ``swiglu``
   on its FFN; ``ssm_conv`` / ``ssm_scan`` with a Mamba model's conv kernel and $A$. The
   verdict is test-backend-ops': NaN fails, infinities must match, then

    $$ \mathrm{NMSE} = \frac{\sum (a - b)^2}{\sum a^2} \le \tau, $$

    with $a$ the reference and $\tau$ = 1e-7 (5e-4 for ``mul_mat`` and attention, 1e-6 for
    ``soft_max_ext``).
2. **Context twin**: the accelerated Context against the reference Context on a short prompt,
   every position's logits: NMSE <= 1e-6 and the same argmax (a position whose reference
   top-2 margin is below 1e-3 logits is a tie and does not count), and the next-token
   distributions: KL divergence <= 1e-4 nats at every position (the measure
   ``llamaref perplexity --kl-divergence`` reports over a whole text).
3. **Properties** of decoding, on the chosen backend: a batch of two sequences in small
   ubatches equals each sequence alone; token-by-token decoding equals one prefill; a branch
   made by ``seq_cp`` equals an independent decode; a K-shift (``seq_add``) equals a fresh
   decode at the shifted positions; a state saved and restored gives the same next logits.
   The four first are float32 computations of the same values in another order: NMSE <= 1e-6;
   the state round trip recomputes the very same thing: identical logits (NMSE <= 1e-6 when
   a sliding window shorter than the prompt drops cells from the saved state: the restore
   packs the rest from cell 0, so the same values are summed over other cells).
4. **Oracles**, when installed: llama.cpp (llama-cpp-python) for a GGUF, with a float32 KV
   cache; an all-float32 model must match its logits (NMSE <= 1e-6); llama.cpp quantizes the
   activations inside quantized (and float16) matmuls, so there the check is top-1 agreement
   >= 0.95 and mean $\mathrm{KL}(\text{ours} \,\|\, \text{llama.cpp}) \le$ 5e-3. HF
   transformers for a HF folder: NMSE <= 1e-6. A missing oracle is reported as
   "skipped (not installed)", never as a pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

import accelerated.ops as A
import reference.ops as R
from accelerated.context import Context as AContext
from accelerated.models import llama as AL
from llamaref.backends import make_context, pick_backend, prepare_weights
from reference.batch import Batch
from reference.common import MAX_NMSE_OP, MAX_NMSE_TWIN, LlamarefError
from reference.context import Context, is_recurrent
from reference.model_loader import load_model
from reference.models import llama as RL
from reference.models.gemma import GEMMA_ARCHS
from reference.testing import nmse
from reference.tokenizer import TokenizerError, load_tokenizer

#: the prompt of every check (tokenized with the model's tokenizer, cut to ``n_tokens``)
PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
          "steps as his father had taught him. There were one hundred and twelve of them.")
#: the llama.cpp oracle compares this many positions (top-1 agreement needs a few dozen)
N_ORACLE_TOKENS = 64

MAX_NMSE = MAX_NMSE_OP  # per operator (test-backend-ops)
MAX_NMSE_CONTEXT = MAX_NMSE_TWIN  # the twin Context against the reference
MAX_NMSE_PROPERTY = MAX_NMSE_TWIN  # one float32 decode against another order of it
TIE_MARGIN = 1e-3
#: the twin's next-token distribution against the reference's, in nats per position: the
#: lossless 4-bit path measures ~1e-10 on SmolLM2, llama.cpp's Q4_1 inference 3e-3 on average
#: (docs/perplexity.md), so 1e-4 tells "the same model" from "another quantization"
MAX_KLD_CONTEXT = 1e-4
MIN_TOP1 = 0.95
MAX_KL = 5e-3


class VerifyError(LlamarefError, ValueError):
    """A harness run that cannot start (a prompt length out of range)."""


# --8<-- [start:Check]
@dataclass
class Check:
    """One line of the report.

    Attributes:
        group: ``ops``, ``context``, ``properties`` or ``oracles``.
        name: what was compared, e.g. ``MUL_MAT(blk.0.attn_q, Q4_1)``.
        measured: the measured value, formatted.
        threshold: what it must satisfy, formatted.
        status: ``PASS``, ``FAIL`` or ``skipped (reason)``.
    """

    group: str
    name: str
    measured: str
    threshold: str
    status: str


@dataclass
class Report:
    """The checks of one run; `passed` unless a check failed (skips do not fail)."""

    model: str
    backend: str
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)

    def table(self) -> str:
        """The checks as a Markdown table."""
        rows = [("group", "check", "measured", "threshold", "result")]
        rows += [(c.group, c.name, c.measured, c.threshold, c.status) for c in self.checks]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + " |"
                 for r in rows]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        return "\n".join(lines)
# --8<-- [end:Check]




def _nmse_check(group: str, name: str, ref, out, max_nmse: float) -> Check:
    err = nmse(ref, out)
    return Check(group, name, f"NMSE {err:.2e}", f"<= {max_nmse:.0e}",
                 "PASS" if err <= max_nmse else "FAIL")


def _dense(w) -> np.ndarray:
    if hasattr(w, "dequantize"):
        return w.dequantize().astype(np.float32)
    return np.asarray(w).astype(np.float32)


def _kind(w) -> str:
    q = getattr(w, "qtype", None)
    return q.name if q is not None else str(np.asarray(w).dtype).replace("float", "f")


# ---- 1. op twins -----------------------------------------------------------------------------

# --8<-- [start:op_checks]
def op_checks(hparams, weights: dict, tokens: np.ndarray) -> list[Check]:
    """Group 1: every operator the model runs, MLX against NumPy, on the model's tensors."""
    if is_recurrent(hparams):
        return _mamba_op_checks(hparams, weights, tokens)
    checks = []
    emb = RL.build_inp_embd({"token_embd.weight": _dense(weights["token_embd.weight"])},
                            tokens, None, np.float32)  # (n_tokens, n_embd)
    twin = AL.build_inp_embd(AL.prepare_weights({"token_embd.weight":
                                                 weights["token_embd.weight"]}),
                             tokens, None, np.float32)
    checks.append(_nmse_check("ops", f"GET_ROWS(token_embd, {_kind(weights['token_embd.weight'])}"
                              f", n={len(tokens)})", emb, np.array(twin), MAX_NMSE["default"]))
    eps = hparams.f_norm_rms_eps
    g = _dense(weights["blk.0.attn_norm.weight"])  # (n_embd,)
    cur = R.mul(R.rms_norm(emb, eps), g)  # (n_tokens, n_embd)
    twin = A.mul(A.rms_norm(mx.array(emb), eps), mx.array(g))
    checks.append(_nmse_check("ops", f"RMS_NORM*attn_norm(n_embd={hparams.n_embd},eps={eps:g})",
                              cur, np.array(twin), MAX_NMSE["default"]))
    layer = RL.layer_weights({k: _dense(v) for k, v in weights.items() if k.startswith("blk.0.")},
                             0, np.float32, hparams)
    d, n_head, n_head_kv = hparams.n_embd_head_k, hparams.n_head, hparams.n_head_kv
    q, k, v = RL.build_qkv(layer, cur, d, n_head, n_head_kv)  # (n_tokens, n_head(_kv), d)
    pos = np.arange(len(tokens))  # (n_tokens,)
    rope = RL.rope_cparams(hparams)
    ff = weights.get("rope_freqs.weight")
    ff = None if ff is None else _dense(ff)
    q_r = R.rope_ext(q, pos, rope, ff)  # (n_tokens, n_head, d)
    k_r = R.rope_ext(k, pos, rope, ff)  # (n_tokens, n_head_kv, d)
    twin = A.rope_ext(mx.array(q), mx.array(pos), rope, None if ff is None else mx.array(ff))
    checks.append(_nmse_check("ops", f"ROPE_EXT(q=[{len(tokens)},{n_head},{d}],n_dims="
                              f"{rope.n_dims},mode={rope.mode},base="
                              f"{rope.freq_base:g})", q_r, np.array(twin), MAX_NMSE["default"]))
    checks += _attention_checks(hparams, q_r, k_r, v)
    attn = R.build_attn_mha(q_r, k_r, v, _causal_mask(len(tokens)), _kq_scale(hparams))
    if hparams.n_expert:  # Mixtral, Qwen3-MoE: the experts instead of a dense FFN
        return checks + _moe_checks(hparams, weights, layer, cur, attn)
    gate = R.mul_mat(layer["ffn_gate"], cur)  # (n_tokens, n_ff)
    up = R.mul_mat(layer["ffn_up"], cur)  # (n_tokens, n_ff)
    glu = "geglu" if hparams.arch in GEMMA_ARCHS else "swiglu"  # Gemma: GELU-gated FFN
    act = getattr(R, glu)(gate, up)  # (n_tokens, n_ff)
    checks.append(_nmse_check("ops", f"{glu.upper()}(n_ff={hparams.n_ff})", act,
                              np.array(getattr(A, glu)(mx.array(gate), mx.array(up))),
                              MAX_NMSE["default"]))
    for cap, what in ((hparams.f_attn_logit_softcapping, "attention scores"),
                      (hparams.f_final_logit_softcapping, "logits")):
        if cap > 0:  # Gemma 2: c tanh(x / c), on scores of the size a logit row has
            x = R.mul_mat(k_r[:, 0], q_r[:, 0])  # (n_tokens, n_tokens): head 0's scores
            checks.append(_nmse_check("ops", f"SOFTCAP({what}, c={cap:g})", R.softcap(x, cap),
                                      np.array(A.softcap(mx.array(x), cap)),
                                      MAX_NMSE["default"]))
    inputs = {"attn_q": cur, "attn_k": cur, "attn_v": cur, "attn_output": attn,
              "ffn_gate": cur, "ffn_up": cur, "ffn_down": act}
    for name, x in inputs.items():
        w = weights[f"blk.0.{name}.weight"]
        ref = R.mul_mat(_dense(w), x)  # (n_tokens, n_out)
        out = AL.linear(AL.prepare_weights({"w": w})["w"], mx.array(x))
        checks.append(_nmse_check("ops", f"MUL_MAT(blk.0.{name}, {_kind(w)}, "
                                  f"{tuple(w.shape)})", ref, np.array(out), MAX_NMSE["mul_mat"]))
    return checks
# --8<-- [end:op_checks]


def _moe_checks(hparams, weights: dict, layer: dict, cur: np.ndarray,
                attn: np.ndarray) -> list[Check]:
    """The block's experts (router, top-k, ``mul_mat_id``, gating) whole, MLX against NumPy,
    and the matmuls around them."""
    blk = {k: v for k, v in weights.items() if k.startswith("blk.0.")}
    twin_layer = AL.layer_weights(AL.prepare_weights(blk), 0, np.float32, hparams)
    ref = RL.build_moe(cur, layer, hparams)  # (n_tokens, n_embd)
    out = AL.build_moe(mx.array(cur), twin_layer, hparams)
    checks = [_nmse_check("ops", f"MOE_FFN(n_expert={hparams.n_expert},used="
                          f"{hparams.n_expert_used},n_ff_exp={hparams.n_ff_expert()})", ref,
                          np.array(out), MAX_NMSE["mul_mat"])]
    for name, x in {"attn_q": cur, "attn_k": cur, "attn_v": cur, "attn_output": attn,
                    "ffn_gate_inp": cur}.items():
        w = weights[f"blk.0.{name}.weight"]
        ref = R.mul_mat(_dense(w), x)  # (n_tokens, n_out)
        out = AL.linear(AL.prepare_weights({"w": w})["w"], mx.array(x))
        checks.append(_nmse_check("ops", f"MUL_MAT(blk.0.{name}, {_kind(w)}, "
                                  f"{tuple(w.shape)})", ref, np.array(out), MAX_NMSE["mul_mat"]))
    return checks


def _kq_scale(hparams) -> float:
    return hparams.f_attention_scale or 1.0 / math.sqrt(hparams.n_embd_head_k)


def _causal_mask(n: int) -> np.ndarray:
    """(n, n): 0 where key j <= query i, -inf above the diagonal."""
    return np.where(np.tri(n, dtype=bool), np.float32(0), np.float32(-np.inf)).astype(np.float32)


def _attention_checks(hparams, q_r, k_r, v) -> list[Check]:
    n_tokens, n_head, d = q_r.shape
    n_gqa = n_head // hparams.n_head_kv
    mask, scale = _causal_mask(n_tokens), _kq_scale(hparams)
    k_h = np.repeat(k_r, n_gqa, axis=1)  # (n_tokens, n_head, d): head h reads kv head h // n_gqa
    kq = np.einsum("thd,shd->hts", q_r, k_h)  # (n_head, n_tokens, n_kv)
    ref = R.soft_max_ext(kq, mask, scale)
    out = A.soft_max_ext(mx.array(kq), mx.array(mask), scale)
    checks = [_nmse_check("ops", f"SOFT_MAX_EXT(x=[{n_head},{n_tokens},{n_tokens}],causal,"
                          f"scale={scale:.4g})", ref, np.array(out), MAX_NMSE["soft_max_ext"])]
    ref = R.build_attn_mha(q_r, k_r, v, mask, scale)
    out = A.build_attn_mha(mx.array(q_r), mx.array(k_r), mx.array(v), mx.array(mask), scale)
    checks.append(_nmse_check("ops", f"ATTN(n_head={n_head},n_head_kv={hparams.n_head_kv},"
                              f"d={d})", ref, np.array(out), MAX_NMSE["attention"]))
    return checks


def _mamba_op_checks(hparams, weights: dict, tokens: np.ndarray) -> list[Check]:
    """Group 1 for Mamba: get_rows, rms_norm, the in/out projections, ssm_conv, ssm_scan."""
    rng = np.random.default_rng(0)
    n = len(tokens)
    emb = R.get_rows(_dense(weights["token_embd.weight"]), tokens)  # (n, n_embd)
    twin = A.get_rows(mx.array(_dense(weights["token_embd.weight"])), mx.array(tokens))
    checks = [_nmse_check("ops", f"GET_ROWS(token_embd, n={n})", emb, np.array(twin),
                          MAX_NMSE["default"])]
    eps = hparams.f_norm_rms_eps
    cur = R.rms_norm(emb, eps)  # (n, n_embd)
    checks.append(_nmse_check("ops", f"RMS_NORM(n_embd={hparams.n_embd},eps={eps:g})", cur,
                              np.array(A.rms_norm(mx.array(emb), eps)), MAX_NMSE["default"]))
    w = weights["blk.0.ssm_in.weight"]
    out = AL.linear(AL.prepare_weights({"w": w})["w"], mx.array(cur))
    checks.append(_nmse_check("ops", f"MUL_MAT(blk.0.ssm_in, {_kind(w)}, {tuple(w.shape)})",
                              R.mul_mat(_dense(w), cur), np.array(out), MAX_NMSE["mul_mat"]))
    c = _dense(weights["blk.0.ssm_conv1d.weight"])  # (conv_dim, d_conv)
    conv_dim, d_conv = c.shape
    sx = rng.standard_normal((1, conv_dim, d_conv - 1 + n)).astype(np.float32)
    checks.append(_nmse_check("ops", f"SSM_CONV(sx=[1,{conv_dim},{d_conv - 1 + n}])",
                              R.ssm_conv(sx, c), np.array(A.ssm_conv(mx.array(sx), mx.array(c))),
                              MAX_NMSE["default"]))
    a = _dense(weights["blk.0.ssm_a"])  # (n_head, d_state) or (n_head, 1)
    n_head = a.shape[0]
    d_state = hparams.ssm_d_state
    head_dim = hparams.ssm_d_inner // n_head
    n_group = max(1, hparams.ssm_n_group)
    args = (rng.standard_normal((1, n_head, head_dim, d_state)),  # s
            rng.standard_normal((1, n, n_head, head_dim)),  # x
            rng.standard_normal((1, n, n_head)),  # dt
            a,
            rng.standard_normal((1, n, n_group, d_state)),  # B
            rng.standard_normal((1, n, n_group, d_state)))  # C
    args = tuple(np.asarray(t, np.float32) for t in args) + (np.array([0], np.int32),)
    ref = R.ssm_scan(*args)
    out = A.ssm_scan(*(mx.array(t) for t in args))
    checks.append(_nmse_check("ops", f"SSM_SCAN(n_head={n_head},head_dim={head_dim},"
                              f"d_state={d_state},n_group={n_group})",
                              np.concatenate([np.ravel(t) for t in ref]),
                              np.concatenate([np.ravel(np.array(t)) for t in out]),
                              MAX_NMSE["default"]))
    return checks


# ---- 2. context twin -------------------------------------------------------------------------

def all_logits(ctx: Context, tokens, pos=None, seq_id: int = 0) -> np.ndarray:
    """Decode ``tokens`` (one batch) with every token's logits; ``(n_tokens, n_vocab)``."""
    n = len(tokens)
    batch = Batch(token=[int(t) for t in tokens], pos=None if pos is None else list(pos),
                  seq_id=[[seq_id]] * n, logits=[True] * n)
    ret = ctx.decode(batch)
    if ret != 0:
        raise RuntimeError(f"decode returned {ret}: {ctx.last_error}")
    return np.array(ctx.get_logits())


# --8<-- [start:context_checks]
def context_checks(hparams, weights_ref: dict, weights_acc: dict | None, tokens) -> list[Check]:
    """Group 2: the accelerated Context's logits against the reference Context's."""
    if weights_acc is None:
        reason = ("skipped (recurrent: the accelerated Context runs llama/qwen2)"
                  if is_recurrent(hparams) else "skipped (MLX not installed)")
        return [Check("context", "accelerated vs reference logits", "-", "-", reason)]
    ref = all_logits(Context(hparams, weights_ref, n_ctx=256), tokens)  # (n, n_vocab)
    out = all_logits(AContext(hparams, weights_acc, n_ctx=256), tokens)  # (n, n_vocab)
    checks = [_nmse_check("context", f"accelerated vs reference logits (n={len(tokens)})", ref,
                          out, MAX_NMSE_CONTEXT)]
    top2 = np.sort(ref, axis=-1)[:, -2:]  # (n, 2)
    decided = (top2[:, 1] - top2[:, 0]) >= TIE_MARGIN  # (n,)
    agree = (ref.argmax(-1) == out.argmax(-1)) | ~decided  # (n,)
    checks.append(Check("context", "argmax agreement (ties excluded)",
                        f"{int(agree.sum())}/{len(agree)}", f"{len(agree)}/{len(agree)}",
                        "PASS" if agree.all() else "FAIL"))
    checks.append(kld_check(ref, out))
    return checks


def kld_check(ref: np.ndarray, out: np.ndarray) -> Check:
    r"""The twin's next-token distributions against the reference's: the largest
    $\mathrm{KL}(P_{ref} \,\|\, P_{twin})$ over the positions, in nats, must stay below
    ``MAX_KLD_CONTEXT`` (llama-perplexity's KL divergence, taken here from the exact logits
    rather than its 16-bit base file).

    Examples:
        >>> ref = np.array([[0.0, 1.0, 2.0]])
        >>> kld_check(ref, ref).status, kld_check(ref, ref[:, ::-1]).status
        ('PASS', 'FAIL')
    """
    kl = kl_divergence(ref, out)  # (n,)
    return Check("context", f"max KL(reference || accelerated), nats (n={len(kl)})",
                 f"{kl.max():.2e}", f"<= {MAX_KLD_CONTEXT:.0e}",
                 "PASS" if kl.max() <= MAX_KLD_CONTEXT else "FAIL")
# --8<-- [end:context_checks]


# ---- 3. properties ---------------------------------------------------------------------------

# --8<-- [start:property_checks]
def property_checks(hparams, make_ctx: Callable[..., Context], tokens) -> list[Check]:
    """Group 3: the laws of decoding, on one backend's Context (``make_ctx(**kwargs)``)."""
    tokens = np.asarray(tokens)
    n = len(tokens)
    other = np.roll(tokens, 3)  # a second sequence, as long
    prefill = all_logits(make_ctx(), tokens)  # (n, n_vocab)
    checks = []

    # batched == unbatched: two sequences in one batch, in ubatches of 4 tokens
    ctx = make_ctx(n_seq_max=2, n_ubatch=4)
    both = Batch(token=[int(t) for t in np.concatenate([tokens, other])],
                 pos=list(range(n)) * 2, seq_id=[[0]] * n + [[1]] * n, logits=[True] * 2 * n)
    ret = ctx.decode(both)
    if ret != 0:
        raise RuntimeError(f"decode returned {ret}: {ctx.last_error}")
    got = np.array(ctx.get_logits())  # (2n, n_vocab)
    alone = np.concatenate([prefill, all_logits(make_ctx(), other)])  # (2n, n_vocab)
    checks.append(_nmse_check("properties", "2 sequences batched (n_ubatch=4) == each alone",
                              alone, got, MAX_NMSE_PROPERTY))

    # token by token == one prefill
    ctx = make_ctx()
    rows = np.concatenate([all_logits(ctx, [t]) for t in tokens])  # (n, n_vocab)
    checks.append(_nmse_check("properties", "token-by-token == prefill", prefill, rows,
                              MAX_NMSE_PROPERTY))

    # seq_cp branch == independent decode
    h = n // 2
    ctx = make_ctx(n_seq_max=2)
    all_logits(ctx, tokens[:h])
    ctx.memory.seq_cp(0, 1, -1, -1)
    branch = all_logits(ctx, tokens[h:], pos=range(h, n), seq_id=1)
    checks.append(_nmse_check("properties", f"seq_cp(0, 1) branch == independent decode "
                              f"(at {h})", prefill[h:], branch, MAX_NMSE_PROPERTY))

    if ctx.memory.can_shift():
        checks.append(_k_shift_check(make_ctx, tokens))
    else:
        checks.append(Check("properties", "K-shift (seq_add) == fresh decode", "-", "-",
                            "skipped (this memory cannot shift positions)"))
    checks.append(_state_check(make_ctx, tokens))
    return checks
# --8<-- [end:property_checks]


def _k_shift_check(make_ctx, tokens) -> Check:
    """``seq_add(0, 0, -1, +5)`` then one more token == a fresh decode at positions 5..."""
    n, delta, nxt = len(tokens), 5, [int(tokens[0])]
    ctx = make_ctx()
    all_logits(ctx, tokens)
    ctx.memory.seq_add(0, 0, -1, delta)
    shifted = all_logits(ctx, nxt)  # the K-shift is applied by this decode
    fresh = make_ctx()
    all_logits(fresh, tokens, pos=range(delta, n + delta))
    ref = all_logits(fresh, nxt)
    return _nmse_check("properties", f"K-shift seq_add(+{delta}) == fresh decode at shifted "
                       "positions", ref, shifted, MAX_NMSE_PROPERTY)


def _state_check(make_ctx, tokens) -> Check:
    """Save the state after the prompt; next logits here == next logits after a restore."""
    ctx = make_ctx()
    all_logits(ctx, tokens)
    blob = ctx.state_get_data()
    nxt = [int(tokens[0])]
    direct = all_logits(ctx, nxt)
    restored = make_ctx()
    restored.state_set_data(blob)
    again = all_logits(restored, nxt)
    name = f"state save/restore round trip ({len(blob):,} bytes)"
    hp = ctx.hparams
    if getattr(hp, "swa_type", 0) and hp.n_swa < len(tokens):
        # a SWA cache saves only the cells its window still sees (llama_kv_cache::state_write)
        # and the restore packs them from cell 0: the same values summed over other cells
        return _nmse_check("properties", name + ", SWA cells repacked", direct, again,
                           MAX_NMSE_PROPERTY)
    diff = float(np.abs(direct - again).max())
    return Check("properties", name, f"max abs diff {diff:.1e}", "== 0",
                 "PASS" if diff == 0 else "FAIL")


# ---- 4. oracles ------------------------------------------------------------------------------

def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, from logits, in float64.

    Examples:
        >>> float(kl_divergence(np.array([[0.0, 1.0]]), np.array([[0.0, 1.0]]))[0])
        0.0
    """
    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    log_p, log_q = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(log_p) * (log_p - log_q)).sum(-1)


# --8<-- [start:oracle_checks]
def oracle_checks(path: Path, hparams, weights: dict, weights_ref: dict, tokens) -> list[Check]:
    """Group 4: llama.cpp for a GGUF file, transformers for a HF folder."""
    ours = all_logits(Context(hparams, weights_ref, n_ctx=256), tokens)  # (n, n_vocab)
    if path.is_dir():
        return [_transformers_check(path, tokens, ours)]
    try:
        import llama_cpp
    except ImportError:
        return [Check("oracles", "llama.cpp logits", "-", "-", "skipped (not installed)")]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=len(tokens),
                          n_ubatch=len(tokens), logits_all=True, type_k=0, type_v=0,
                          flash_attn=False, verbose=False)
    try:
        llm.eval([int(t) for t in tokens])
        ref = np.array(llm.scores[: len(tokens)], dtype=np.float32)  # (n, n_vocab)
    finally:
        llm.close()
    kinds = {_kind(w) for w in weights.values() if _kind(w) not in ("int32", "int64")}
    if kinds <= {"f32"}:
        return [_nmse_check("oracles", f"llama.cpp logits (f32 weights, f32 KV, "
                            f"n={len(tokens)})", ref, ours, MAX_NMSE_CONTEXT)]
    top1 = float((ref.argmax(-1) == ours.argmax(-1)).mean())
    kl = float(kl_divergence(ours, ref).mean())
    label = "/".join(sorted(kinds))
    top2 = np.sort(ours, axis=-1)[:, -2:]  # (n, 2)
    margins = [f"{top2[i, 1] - top2[i, 0]:.2f}"
               for i in np.flatnonzero(ref.argmax(-1) != ours.argmax(-1))]
    where = f" (our top-2 margin where they differ: {', '.join(margins)})" if margins else ""
    return [
        Check("oracles", f"llama.cpp top-1 agreement ({label}, n={len(tokens)})",
              f"{top1:.3f}{where}", f">= {MIN_TOP1}", "PASS" if top1 >= MIN_TOP1 else "FAIL"),
        Check("oracles", "llama.cpp mean KL(ours, llama.cpp)", f"{kl:.2e}",
              f"<= {MAX_KL:.0e}", "PASS" if kl <= MAX_KL else "FAIL"),
    ]
# --8<-- [end:oracle_checks]


def _transformers_check(path: Path, tokens, ours: np.ndarray) -> Check:
    try:
        import torch
        import transformers
    except ImportError:
        return Check("oracles", "transformers logits", "-", "-", "skipped (not installed)")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        ref = model(torch.tensor(np.asarray(tokens, np.int64))[None]).logits[0].numpy()
    return _nmse_check("oracles", f"transformers logits (n={len(tokens)})", ref, ours,
                       MAX_NMSE_CONTEXT)


# ---- the run ---------------------------------------------------------------------------------

# --8<-- [start:run_verify]
def run_verify(path: str | Path, backend: str = "auto", n_tokens: int = 12,
               emit: Callable[[str], None] = print) -> Report:
    """Run the four groups on the model at ``path`` and print the report with ``emit``.

    Args:
        path: a GGUF file or a HF folder.
        backend: the backend whose Context the properties run on (``auto``, ``reference``,
            ``accelerated``; see
            [`llamaref.backends.pick_backend`][llamaref.backends.pick_backend]).
        n_tokens: the prompt length (4 to 256).
        emit: where the lines of the report go.

    Returns:
        The [`Report`][]; ``report.passed`` is False when a check failed.

    Raises:
        VerifyError: a bad ``n_tokens``; the errors of the loaders and the tokenizer.
    """
    if not 4 <= n_tokens <= 256:
        raise VerifyError(f"n_tokens = {n_tokens} must be in [4, 256]")
    t0 = time.perf_counter()
    path = Path(path)
    hparams, weights = load_model(path)
    backend = pick_backend(backend, hparams)
    report = Report(model=str(path), backend=backend)
    long, source = prompt_tokens(path, hparams.n_vocab, max(n_tokens, N_ORACLE_TOKENS))
    tokens = np.asarray(long[:n_tokens], np.int64)  # (n_tokens,)
    emit(f"model: {path} ({hparams.arch}, {len(weights)} tensors)")
    emit(f"prompt: {n_tokens} tokens ({source}); properties on the {backend} backend")
    weights_ref = prepare_weights(weights, "reference")
    weights_acc = None if is_recurrent(hparams) or not _has_mlx() else prepare_weights(
        weights, "accelerated", bounded=False)  # the twin holds the reference's values
    groups = [
        lambda: op_checks(hparams, weights, tokens) if _has_mlx() else [
            Check("ops", "op twins", "-", "-", "skipped (MLX not installed)")],
        lambda: context_checks(hparams, weights_ref, weights_acc, tokens),
        lambda: property_checks(hparams, lambda **kw: make_context(
            backend, hparams, weights_acc if backend == "accelerated" else weights_ref,
            **{"n_ctx": 256, **kw}), tokens),
        lambda: oracle_checks(path, hparams, weights, weights_ref,
                              np.asarray(long, np.int64)),
    ]
    for group in groups:
        report.checks += group()
    report.seconds = time.perf_counter() - t0
    emit("")
    emit(report.table())
    n_fail = sum(c.status == "FAIL" for c in report.checks)
    n_skip = sum(c.status.startswith("skipped") for c in report.checks)
    emit("")
    emit(f"{len(report.checks)} checks: {len(report.checks) - n_fail - n_skip} passed, "
         f"{n_fail} failed, {n_skip} skipped ({report.seconds:.1f} s)")
    return report
# --8<-- [end:run_verify]


def prompt_tokens(path: Path, n_vocab: int, n: int) -> tuple[list[int], str]:
    """``n`` tokens of `PROMPT` by the model's tokenizer; ids ``1, 2, ...`` (mod
    ``n_vocab``) for a model without one (a checkpoint folder with no tokenizer files)."""
    try:
        tokenizer = load_tokenizer(path)
    except (TokenizerError, OSError) as e:
        return [1 + i % (n_vocab - 1) for i in range(n)], f"no tokenizer ({e}): ids 1, 2, ..."
    tokens = tokenizer.tokenize(PROMPT * (1 + n // 16), add_special=True, parse_special=False)
    return [int(t) for t in tokens[:n]], "the model's tokenizer"


def _has_mlx() -> bool:
    import importlib.util

    return importlib.util.find_spec("mlx") is not None
