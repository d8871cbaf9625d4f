r"""The twin registry: every operator of ``accelerated.ops`` against ``reference.ops``.

In the style of llama.cpp's ``tests/test-backend-ops.cpp``: each case has a readable id
(``RMS_NORM(shape=[5,4,64],eps=1e-06)``), its own input initialiser (odd shapes, non-contiguous
views, GQA broadcasts, masks with -inf, negative positions, YaRN, ALiBi) and its own NMSE
threshold (1e-7 by default, 1e-6 for softmax, 5e-4 for matmul and attention). One comparison
routine decides: NaN anywhere fails, infinities must match (same positions, same signs), then
$\mathrm{NMSE} = \sum (a - b)^2 / \sum a^2 \le$ threshold, with $a$ the reference. Inputs are
float32 and the reference computes in float32 too.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import accelerated.ops as A
import reference.ops as R
from accelerated.ops import attention as A_attn
from accelerated.ops import moe as A_moe
from accelerated.ops import rope as A_rope
from accelerated.ops import ssm as A_ssm
from reference.ops import attention as R_attn
from reference.ops import rope as R_rope
from reference.ops import ssm as R_ssm
from reference.ops.errors import OpIndexError, OpShapeError, OpValueError
from reference.testing import nmse_check  # the one comparison routine (test-backend-ops')

F32 = np.float32


@dataclasses.dataclass
class Case:
    """One registry entry: ``init(rng) -> (ref_args, twin_args, kwargs)``."""

    id: str
    ref: Callable
    twin: Callable
    init: Callable
    max_nmse: float = 1e-7


def _same(*arrays):
    """The same NumPy inputs for both sides (the twin converts with ``mx.array``)."""
    return arrays, arrays


def _fmt(shape) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def _normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


def _causal_mask(n_rows, n_kv, n_past, swa=0):
    """(n_rows, n_kv): 0 where key j <= n_past + t (and inside the SWA window), else -inf."""
    t = np.arange(n_rows)[:, None] + n_past
    j = np.arange(n_kv)[None, :]
    visible = j <= t
    if swa:
        visible &= t - j < swa
    return np.where(visible, F32(0), F32(-np.inf)).astype(F32)


CASES: list[Case] = []


def case(id_, ref, twin, max_nmse=1e-7):
    def register(init):
        CASES.append(Case(id_, ref, twin, init, max_nmse))
        return init
    return register


# --- MUL_MAT -----------------------------------------------------------------------------------
for a_shape, b_shape in [((3, 64, 32), (6, 7, 32)), ((33, 17), (5, 17)), ((2, 1, 16, 8),
                         (2, 3, 5, 8)), ((1, 100, 65), (4, 1, 65)), ((129, 256), (3, 256))]:
    @case(f"MUL_MAT(a={_fmt(a_shape)},b={_fmt(b_shape)})", R.mul_mat, A.mul_mat, 5e-4)
    def _(rng, a_shape=a_shape, b_shape=b_shape):
        return _same(_normal(rng, a_shape), _normal(rng, b_shape)) + ({},)


@case("MUL_MAT(a=[2,48,16],b=[4,16,9]^T,view)", R.mul_mat, A.mul_mat, 5e-4)
def _(rng):
    a, base = _normal(rng, (2, 48, 16)), _normal(rng, (4, 16, 9))
    # b is a transposed (non-contiguous) view (4, 9, 16) on both sides
    return (a, base.swapaxes(-1, -2)), (a, mx.array(base).swapaxes(-1, -2)), {}


# --- MUL_MAT_ID, ARGSORT, ARGSORT_TOP_K (mixtures of experts) ---------------------------------
for n_b in (1, 2):
    @case(f"MUL_MAT_ID(as=[4,6,8],b=[5,{n_b},8],ids=[5,2])", R.mul_mat_id, A.mul_mat_id, 5e-4)
    def _(rng, n_b=n_b):
        ids = np.stack([rng.permutation(4)[:2] for _ in range(5)]).astype(np.int32)
        return _same(_normal(rng, (4, 6, 8)), _normal(rng, (5, n_b, 8)), ids) + ({},)


@case("ARGSORT_TOP_K(a=[7,8],k=2)", R.argsort_top_k, A.argsort_top_k)
def _(rng):
    return _same(_normal(rng, (7, 8))) + ({"k": 2},)


def _argsort_on_the_host(a, order="desc"):
    """The twin's argsort is the reference's (ties as ``std::sort``), on host values."""
    return mx.array(A_moe.argsort(np.asarray(a), order))


@case("ARGSORT(a=[3,20],desc)", R.argsort, _argsort_on_the_host)
def _(rng):
    return _same(_normal(rng, (3, 20))) + ({},)


# --- GET_ROWS / SET_ROWS -----------------------------------------------------------------------
@case("GET_ROWS(a=[50,33],rows=[11],repeats)", R.get_rows, A.get_rows)
def _(rng):
    return _same(_normal(rng, (50, 33)), rng.integers(0, 50, 11).astype(np.int32)) + ({},)


@case("GET_ROWS(a=[3,10,7],rows=[3,4])", R.get_rows, A.get_rows)
def _(rng):
    return _same(_normal(rng, (3, 10, 7)), rng.integers(0, 10, (3, 4))) + ({},)


@case("GET_ROWS(a=[20,9]f16,rows=[5])", R.get_rows, A.get_rows)
def _(rng):
    a = _normal(rng, (20, 9)).astype(np.float16)
    return (a, np.array([19, 0, 7, 7, 3])), (mx.array(a), np.array([19, 0, 7, 7, 3])), {}


def _set_rows_init(dst_shape, src_shape, rows_shape, dst_dtype=F32):
    def init(rng):
        dst = _normal(rng, dst_shape).astype(dst_dtype)
        src = _normal(rng, src_shape)
        n_rows, n = dst_shape[-2], rows_shape[-1]
        rows = np.stack([rng.permutation(n_rows)[:n] for _ in range(int(np.prod(rows_shape[:-1])))])
        rows = rows.reshape(rows_shape).astype(np.int64)
        return (dst.copy(), src, rows), (mx.array(dst), src, rows), {}
    return init


for dst_s, src_s, rows_s, dt in [((16, 24), (5, 24), (5,), F32),
                                 ((2, 3, 8, 5), (2, 3, 4, 5), (3, 4), F32),
                                 ((31, 12), (7, 12), (7,), np.float16)]:
    CASES.append(Case(
        f"SET_ROWS(dst={_fmt(dst_s)}{'f16' if dt == np.float16 else ''},src={_fmt(src_s)},"
        f"rows={_fmt(rows_s)})", R.set_rows, A.set_rows, _set_rows_init(dst_s, src_s, rows_s, dt)))


@case("GET_ROWS_BACK(grad=[9,13],rows=[9],repeats,n_rows=6)", R.get_rows_back, A.get_rows_back)
def _(rng):
    return _same(_normal(rng, (9, 13)), rng.integers(0, 6, 9).astype(np.int32), 6) + ({},)


# --- ADD / MUL / SCALE -------------------------------------------------------------------------
for name, ref, twin in [("ADD", R.add, A.add), ("MUL", R.mul, A.mul)]:
    for a_shape, b_shape in [((5, 4, 64), (64,)), ((6, 8), (2, 4)), ((3, 6, 10), (1, 3, 5)),
                             ((7, 13), (7, 13))]:
        @case(f"{name}(a={_fmt(a_shape)},b={_fmt(b_shape)})", ref, twin)
        def _(rng, a_shape=a_shape, b_shape=b_shape):
            return _same(_normal(rng, a_shape), _normal(rng, b_shape)) + ({},)


@case("SCALE(shape=[9,31],s=0.125)", R.scale, A.scale)
def _(rng):
    return _same(_normal(rng, (9, 31)), 0.125) + ({},)


# --- NORM / RMS_NORM ---------------------------------------------------------------------------
for name, ref, twin in [("NORM", R.norm, A.norm), ("RMS_NORM", R.rms_norm, A.rms_norm)]:
    for shape, eps, offset in [((5, 4, 64), 1e-6, 0.0), ((3, 4097), 1e-5, 3.0), ((2, 7), 0.0, 0.0),
                               ((1, 576), 1e-5, 0.0)]:
        @case(f"{name}(shape={_fmt(shape)},eps={eps:g},mean={offset})", ref, twin)
        def _(rng, shape=shape, eps=eps, offset=offset):
            return _same(_normal(rng, shape) + F32(offset)) + ({"eps": eps},)


@case("RMS_NORM(shape=[6,96]^T,eps=1e-06,view)", R.rms_norm, A.rms_norm)
def _(rng):
    base = _normal(rng, (96, 6))
    return (base.T,), (mx.array(base).T,), {"eps": 1e-6}


# --- activations -------------------------------------------------------------------------------
def _activation_input(rng, shape):
    x = _normal(rng, shape, 4.0)
    x.flat[:6] = [-100.0, -20.0, -10.0, 10.0, 20.0, 100.0]  # ggml's table edges and beyond
    return x


for name, ref, twin in [("SILU", R.silu, A.silu), ("GELU", R.gelu, A.gelu)]:
    @case(f"{name}(shape=[7,130])", ref, twin)
    def _(rng):
        return _same(_activation_input(rng, (7, 130))) + ({},)

for name, ref, twin in [("SWIGLU", R.swiglu, A.swiglu), ("GEGLU", R.geglu, A.geglu)]:
    @case(f"{name}(shape=[5,3,96])", ref, twin)
    def _(rng):
        return _same(_activation_input(rng, (5, 3, 96)), _normal(rng, (5, 3, 96))) + ({},)


@case("SOFTPLUS(shape=[300])", R_ssm.compute_softplus, A_ssm.compute_softplus)
def _(rng):
    return _same(np.linspace(-40, 40, 300).astype(F32)) + ({},)


# --- TANH / SOFTCAP ----------------------------------------------------------------------------
@case("TANH(shape=[7,130])", R.tanh, A.tanh)
def _(rng):
    return _same(_activation_input(rng, (7, 130))) + ({},)


for shape, cap in [((4, 9, 33), 50.0), ((3, 257), 30.0), ((2, 5, 7), 0.5)]:
    @case(f"SOFTCAP(shape={_fmt(shape)},cap={cap})", R.softcap, A.softcap)
    def _(rng, shape=shape, cap=cap):
        x = _normal(rng, shape, 2.0 * cap)  # the tanh's linear part and its saturation
        x.flat[:2] = [np.inf, -np.inf]
        return _same(x, cap) + ({},)


# --- SOFT_MAX ----------------------------------------------------------------------------------
def _soft_max_init(x_shape, mask_kind, scale, max_bias):
    def init(rng):
        x = _normal(rng, x_shape, 3.0)
        n_tokens, n_kv = x_shape[-2:]
        if mask_kind == "none":
            mask = None
        elif mask_kind == "causal":
            mask = _causal_mask(n_tokens + 3, n_kv, n_kv - n_tokens)  # padded rows
        elif mask_kind == "alibi":  # -|i - j| distances, -inf above the diagonal
            t = np.arange(n_tokens)[:, None] + (n_kv - n_tokens)
            dist = -np.abs(t - np.arange(n_kv)[None, :]).astype(F32)
            mask = np.where(np.arange(n_kv)[None, :] <= t, dist, -np.inf).astype(F32)
        elif mask_kind == "fully_masked_row":
            mask = _causal_mask(n_tokens, n_kv, n_kv - n_tokens)
            mask[1] = -np.inf
        else:  # "lead": a (2, n_tokens, n_kv) mask tiled over 4 heads
            mask = np.stack([_causal_mask(n_tokens, n_kv, n_kv - n_tokens),
                             _causal_mask(n_tokens, n_kv, n_kv - n_tokens, swa=4)])
        return _same(x, mask) + ({"scale": scale, "max_bias": max_bias},)
    return init


for x_shape, mask_kind, sc, mb in [
    ((4, 7, 33), "causal", 0.125, 0.0), ((3, 5, 17), "none", 1.0, 0.0),
    ((6, 7, 19), "alibi", 0.25, 8.0), ((2, 4, 9), "fully_masked_row", 1.0, 0.0),
    ((4, 5, 12), "lead", 0.5, 0.0), ((11, 64), "causal", 1.0, 0.0),
]:
    CASES.append(Case(f"SOFT_MAX(x={_fmt(x_shape)},mask={mask_kind},scale={sc},max_bias={mb})",
                      R.soft_max_ext, A.soft_max_ext, _soft_max_init(x_shape, mask_kind, sc, mb),
                      1e-6))

CASES.append(Case("ALIBI_SLOPES(n_head=12,max_bias=8.0)", R_attn.alibi_slopes,
                  A_attn.alibi_slopes, lambda rng: ((12, 8.0), (12, 8.0), {})))


for x_shape, sc in [((4, 7, 33), 0.125), ((11, 64), 1.0)]:
    @case(f"SOFT_MAX_BACK(y=[{_fmt(x_shape)}],causal,scale={sc})", R.soft_max_ext_back,
          A.soft_max_ext_back, 1e-6)
    def _(rng, x_shape=x_shape, sc=sc):
        n_tokens, n_kv = x_shape[-2:]
        mask = _causal_mask(n_tokens, n_kv, n_kv - n_tokens)
        y = R.soft_max_ext(_normal(rng, x_shape, 3.0), mask, sc)  # hidden keys: y = 0
        return _same(_normal(rng, x_shape), y) + ({"scale": sc},)


# --- ROPE --------------------------------------------------------------------------------------
def _rope_init(x_shape, n_dims, pos_range, params, view=False):
    def init(rng):
        n_tokens = x_shape[-3]
        pos = rng.integers(pos_range[0], pos_range[1], n_tokens).astype(np.int32)
        rope = R_rope.RopeParams(n_dims, **{k: v for k, v in params.items() if k != "freq_factors"})
        kw = {}
        if params.get("freq_factors"):
            kw["freq_factors"] = rng.uniform(1.0, 8.0, n_dims // 2).astype(F32)
        if view:  # (n_tokens, n_head, head_dim) as a transposed view of (n_head, n_tokens, hd)
            base = _normal(rng, (x_shape[1], x_shape[0], x_shape[2]))
            return ((base.transpose(1, 0, 2), pos, rope),
                    (mx.array(base).transpose(1, 0, 2), pos, rope), kw)
        return _same(_normal(rng, x_shape), pos, rope) + (kw,)
    return init


_MODES = {0: "norm", 2: "neox"}
for mode in (R.ROPE_TYPE_NORM, R.ROPE_TYPE_NEOX):
    for x_shape, n_dims, pos_range, extra, view in [
        ((7, 4, 64), 48, (-50, 200), {}, False),
        ((9, 3, 128), 128, (0, 4096), {"freq_base": 500000.0, "freq_scale": 0.25}, False),
        ((2, 5, 3, 32), 32, (-4096, 4096), {"attn_factor": 0.7}, False),
        ((6, 2, 64), 64, (0, 8192), {"freq_factors": True, "freq_base": 500000.0}, False),
        ((8, 4, 64), 64, (0, 32768), {"n_ctx_orig": 4096, "freq_scale": 0.25, "ext_factor": 1.0,
                                      "beta_fast": 32.0, "beta_slow": 1.0}, False),
        ((5, 2, 80), 64, (-300, 300), {"n_ctx_orig": 2048, "freq_scale": 0.5, "ext_factor": 0.5,
                                       "attn_factor": 0.9}, False),
        ((5, 6, 64), 64, (0, 1000), {}, True),
        ((3, 2, 16), 0, (0, 10), {}, False),
    ]:
        kw_id = ",".join(f"{k}={v}" for k, v in extra.items())
        CASES.append(Case(
            f"ROPE(mode={_MODES[mode]},n_dims={n_dims},head_dim={x_shape[-1]},x={_fmt(x_shape)},"
            f"pos=[{pos_range[0]},{pos_range[1]}){',' + kw_id if kw_id else ''}"
            f"{',view' if view else ''})",
            R.rope_ext, A.rope_ext, _rope_init(x_shape, n_dims, pos_range,
                                               dict(extra, mode=mode), view)))


for mode in (R.ROPE_TYPE_NORM, R.ROPE_TYPE_NEOX):
    for extra in ({}, {"n_ctx_orig": 4096, "freq_scale": 0.25, "ext_factor": 1.0}):
        kw_id = ",yarn" if extra else ""
        CASES.append(Case(
            f"ROPE_BACK(mode={_MODES[mode]},n_dims=48,head_dim=64,grad=[7,4,64],pos=[-50,200)"
            f"{kw_id})", R.rope_back, A.rope_back,
            _rope_init((7, 4, 64), 48, (-50, 200), dict(extra, mode=mode))))


@case("ROPE_THETA(n_tokens=9,n_dims=64,base=10000)", R_rope.rope_theta, A_rope.rope_theta)
def _(rng):
    return _same(rng.integers(-2000, 2000, 9), 64, 10000.0) + ({},)


@case("ROPE_CACHE_INIT(n_dims=32,yarn,freq_factors)", R_rope.rope_cache_init,
      A_rope.rope_cache_init)
def _(rng):
    corr = R_rope.rope_yarn_corr_dims(32, 2048, 10000.0, 32.0, 1.0)
    ff = rng.uniform(1.0, 4.0, 16).astype(F32)
    return _same(rng.integers(0, 3000, 6), 32, 10000.0, 0.25, ff, corr, 1.0, 1.0) + ({},)


@case("ROPE_YARN_RAMP(low=3,high=11)", R_rope.rope_yarn_ramp, A_rope.rope_yarn_ramp)
def _(rng):
    return _same(3.0, 11.0, np.arange(0, 64, 2)) + ({},)


for mode in (R.ROPE_TYPE_NORM, R.ROPE_TYPE_NEOX):
    @case(f"ROTATE_PAIRS(mode={_MODES[mode]},x=[2,5,3,40],n_dims=24)", R_rope.rotate_pairs,
          A_rope.rotate_pairs)
    def _(rng, mode=mode):
        theta = rng.uniform(-4, 4, (5, 12)).astype(F32)
        return _same(_normal(rng, (2, 5, 3, 40)), np.cos(theta), np.sin(theta), 24, mode) + ({},)


# --- attention ---------------------------------------------------------------------------------
def _attn_init(n_tokens, n_head, n_head_kv, d_k, d_v, n_kv, max_bias=0.0, masked_row=False,
               softcap=0.0):
    def init(rng):
        q = _normal(rng, (n_tokens, n_head, d_k))
        k = _normal(rng, (n_kv, n_head_kv, d_k))
        v = _normal(rng, (n_kv, n_head_kv, d_v))
        mask = _causal_mask(n_tokens + (-n_tokens) % 8, n_kv, n_kv - n_tokens)  # padded rows
        if max_bias:
            t = np.arange(mask.shape[0])[:, None] + (n_kv - n_tokens)
            mask = np.where(np.isfinite(mask), -np.abs(t - np.arange(n_kv)), -np.inf).astype(F32)
        if masked_row:
            mask[0] = -np.inf
        kw = {"max_bias": max_bias} | ({"softcap": softcap} if softcap else {})
        return _same(q, k, v, mask, d_k ** -0.5) + (kw,)
    return init


for args, kw in [((7, 8, 2, 64, 48, 19), {}), ((1, 4, 4, 32, 32, 5), {}),
                 ((13, 6, 3, 16, 24, 13), {}), ((5, 6, 2, 32, 32, 9), {"max_bias": 8.0}),
                 ((4, 4, 1, 8, 8, 6), {"masked_row": True}),
                 ((7, 8, 2, 64, 48, 19), {"softcap": 50.0}),
                 ((5, 6, 3, 16, 16, 9), {"softcap": 0.5}),
                 ((5, 6, 2, 32, 32, 9), {"max_bias": 8.0, "softcap": 2.0}),
                 ((4, 4, 1, 8, 8, 6), {"masked_row": True, "softcap": 30.0})]:
    n_tokens, n_head, n_head_kv, d_k, d_v, n_kv = args
    extra = "".join(f",{k}={v}" for k, v in kw.items())
    CASES.append(Case(
        f"ATTN(n_tokens={n_tokens},n_head={n_head},n_head_kv={n_head_kv},d_k={d_k},d_v={d_v},"
        f"n_kv={n_kv}{extra})", R.build_attn_mha, A.build_attn_mha, _attn_init(*args, **kw), 5e-4))


# --- SSM_CONV / SSM_SCAN -----------------------------------------------------------------------
for n_seqs, conv_dim, d_conv, n_t in [(3, 40, 4, 9), (1, 24, 4, 1), (2, 17, 3, 0)]:
    @case(f"SSM_CONV(sx=[{n_seqs},{conv_dim},{d_conv - 1 + n_t}],c=[{conv_dim},{d_conv}])",
          R.ssm_conv, A.ssm_conv)
    def _(rng, n_seqs=n_seqs, conv_dim=conv_dim, d_conv=d_conv, n_t=n_t):
        sx = _normal(rng, (n_seqs, conv_dim, d_conv - 1 + n_t))
        return _same(sx, _normal(rng, (conv_dim, d_conv))) + ({},)


@case("SSM_CONV(sx=[2,32,12]^T,c=[32,4],view)", R.ssm_conv, A.ssm_conv)
def _(rng):
    base, c = _normal(rng, (2, 12, 32)), _normal(rng, (32, 4))
    return (base.transpose(0, 2, 1), c), (mx.array(base).transpose(0, 2, 1), c), {}


def _scan_init(n_rs, n_seqs, n_t, n_head, head_dim, d_state, n_group, mamba2, ids):
    def init(rng):
        s = _normal(rng, (n_rs, n_head, head_dim, d_state))
        x = _normal(rng, (n_seqs, n_t, n_head, head_dim))
        dt = _normal(rng, (n_seqs, n_t, n_head), 3.0)
        dt.flat[:2] = [25.0, -25.0]  # both sides of the softplus threshold
        a_cols = 1 if mamba2 else d_state
        A_ = -np.exp(rng.uniform(-2, 1, (n_head, a_cols))).astype(F32)
        B = _normal(rng, (n_seqs, n_t, n_group, d_state))
        C = _normal(rng, (n_seqs, n_t, n_group, d_state))
        return _same(s, x, dt, A_, B, C, np.array(ids, dtype=np.int32)) + ({},)
    return init


for name, args in [
    ("mamba1", (4, 2, 9, 24, 1, 16, 1, False, [3, 1])),
    ("mamba2", (2, 3, 7, 8, 16, 32, 2, True, [0, 0, 1])),
    ("mamba2,n_t=0", (1, 1, 0, 4, 8, 16, 1, True, [0])),
    # one token per sequence: the scan's per-token operands are reshapes, not slices
    ("mamba1,n_t=1", (3, 2, 1, 24, 1, 16, 1, False, [2, 0])),
    ("mamba2,n_t=1", (2, 2, 1, 8, 16, 32, 2, True, [1, 0])),
]:
    n_rs, n_seqs, n_t, n_head, head_dim, d_state, n_group, _m2, ids = args
    CASES.append(Case(
        f"SSM_SCAN({name},s=[{n_rs},{n_head},{head_dim},{d_state}],x=[{n_seqs},{n_t},{n_head},"
        f"{head_dim}],n_group={n_group},ids={ids})", R.ssm_scan, A.ssm_scan, _scan_init(*args)))





def _outputs(result):
    return list(result) if isinstance(result, tuple) else [result]


# --- CROSS_ENTROPY_LOSS ------------------------------------------------------------------------
def _cross_entropy_init(n_rows, n_classes, one_hot, grad=None):
    """logits and labels (one-hot rows, or a probability row per token); ``grad`` first for
    the backward."""
    def init(rng):
        logits = _normal(rng, (n_rows, n_classes), 4.0)
        if one_hot:
            labels = np.eye(n_classes, dtype=F32)[rng.integers(0, n_classes, n_rows)]
        else:
            labels = rng.dirichlet(np.ones(n_classes), n_rows).astype(F32)
        return _same(*(() if grad is None else (grad,)), logits, labels) + ({},)
    return init


for n_rows, n_classes, one_hot in [(5, 32, True), (3, 200, False)]:
    kind = "one_hot" if one_hot else "soft"
    CASES.append(Case(f"CROSS_ENTROPY_LOSS(logits=[{n_rows},{n_classes}],labels={kind})",
                      R.cross_entropy_loss, A.cross_entropy_loss,
                      _cross_entropy_init(n_rows, n_classes, one_hot), 1e-6))
    CASES.append(Case(f"CROSS_ENTROPY_LOSS_BACK(logits=[{n_rows},{n_classes}],labels={kind})",
                      R.cross_entropy_loss_back, A.cross_entropy_loss_back,
                      _cross_entropy_init(n_rows, n_classes, one_hot, grad=1.5), 1e-6))


NMSE_MEASURED: dict[str, float] = {}


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_twin_matches_reference(c: Case):
    rng = np.random.default_rng(zlib.crc32(c.id.encode()))
    ref_args, twin_args, kwargs = c.init(rng)
    ref_out = _outputs(c.ref(*ref_args, **kwargs))
    twin_out = _outputs(c.twin(*twin_args, **kwargs))
    assert len(ref_out) == len(twin_out)
    for r, t in zip(ref_out, twin_out, strict=True):
        assert isinstance(t, mx.array), f"the twin returned {type(t).__name__}, not mx.array"
        r = np.asarray(r)
        if r.dtype in (np.float16, np.float32):  # float64 references only for host scalars
            assert np.dtype(str(t.dtype).split(".")[-1]) == r.dtype, (t.dtype, r.dtype)
        NMSE_MEASURED[c.id] = max(NMSE_MEASURED.get(c.id, 0.0),
                                  nmse_check(r, np.array(t.astype(mx.float32)), c.max_nmse))


def test_registry_covers_every_public_op():
    """Every name ``reference.ops`` exports that is an operator has at least one case."""
    tested = {c.ref.__name__ for c in CASES}
    ops = {name for name in R.__all__ if callable(getattr(R, name))}
    assert ops <= tested, f"no twin case for {sorted(ops - tested)}"


# --- the comparison routine is strict ----------------------------------------------------------
def test_nmse_check_rejects_nan_and_mismatched_infinities():
    a = np.array([1.0, -np.inf, 2.0])
    assert nmse_check(a, a.copy(), 1e-7) == 0.0
    for bad in ([1.0, -np.inf, np.nan], [1.0, np.inf, 2.0], [-np.inf, 1.0, 2.0]):
        with pytest.raises(AssertionError):
            nmse_check(a, np.array(bad), 1e-7)
    with pytest.raises(AssertionError, match="NMSE"):
        nmse_check(np.ones(4), np.ones(4) * 1.001, 1e-7)


# --- the twin raises the reference's errors ----------------------------------------------------
@pytest.mark.parametrize("call, error", [
    (lambda m: m.mul_mat(np.ones((3, 4, 5), F32), np.ones((4, 2, 5), F32)), OpShapeError),
    (lambda m: m.get_rows(np.ones((4, 2), F32), np.array([4])), OpIndexError),
    (lambda m: m.set_rows(np.zeros((4, 2), F32), np.ones((2, 2), F32), np.array([1, 1])),
     OpIndexError),
    (lambda m: m.add(np.ones((4, 6), F32), np.ones((4,), F32)), OpShapeError),
    (lambda m: m.rope_ext(np.ones((2, 1, 4), F32), np.array([0, 1]), R_rope.RopeParams(3)),
     R_rope.RopeError),
    (lambda m: m.soft_max_ext(np.ones((2, 3), F32), None, 1.0, 8.0), OpShapeError),
    (lambda m: m.swiglu(np.ones(3, F32), np.ones(4, F32)), OpShapeError),
    (lambda m: m.ssm_conv(np.ones((1, 3, 1), F32), np.ones((3, 4), F32)), OpShapeError),
    (lambda m: m.softcap(np.ones(3, F32), 0.0), OpValueError),
], ids=["mul_mat", "get_rows", "set_rows", "add", "rope_ext", "soft_max_ext", "swiglu",
        "ssm_conv", "softcap"])
def test_twin_raises_the_reference_error(call, error):
    with pytest.raises(error) as ref_err:
        call(R)
    with pytest.raises(error) as twin_err:
        call(A)
    assert type(twin_err.value) is type(ref_err.value)


# --- properties re-run on the twin -------------------------------------------------------------
def test_rope_additivity_on_the_twin_test_rope_cpp_form():
    """tests/test-rope.cpp's check, on the twin: rope by 100 + i then by -67 vs rope by 33 + i,
    sum|r1 - r2| / sum|r1| < 1e-4 (and over sum|r2|), modes NORM and NEOX."""
    n_rot, n_past_0, n_past_2 = 128, 100, 33
    x = np.random.default_rng(0).uniform(-1.0, 1.0, (73, 32, 2 * n_rot)).astype(F32)
    i = np.arange(73, dtype=np.int32)
    defaults = dict(n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
                    attn_factor=1.0, beta_fast=0.0, beta_slow=0.0)
    for mode in (R.ROPE_TYPE_NORM, R.ROPE_TYPE_NEOX):
        rope = R_rope.RopeParams(n_rot, mode, **defaults)
        r0 = A.rope_ext(x, n_past_0 + i, rope)
        r1 = A.rope_ext(r0, np.full(73, n_past_2 - n_past_0, np.int32), rope)
        r2 = A.rope_ext(x, n_past_2 + i, rope)
        assert r1.dtype == mx.float32
        r1, r2 = np.array(r1, dtype=np.float64), np.array(r2, dtype=np.float64)
        diff = np.abs(r1 - r2).sum()
        assert diff / np.abs(r1).sum() < 1e-4
        assert diff / np.abs(r2).sum() < 1e-4


@pytest.mark.parametrize("extra", [{}, {"freq_scale": 0.25, "ext_factor": 1.0, "n_ctx_orig": 2048,
                                        "attn_factor": 1.0 / (1.0 + 0.1 * np.log(4.0))}],
                         ids=["plain", "yarn_mscale_1"])
def test_rope_additivity_on_the_twin_large_shifts(extra):
    """rope(rope(x, a), b) == rope(x, a + b) on the twin (test-rope's 1e-4 form), shifts
    of either sign up to 4096, with YaRN when its magnitude is 1 (what a K-shift needs)."""
    rng = np.random.default_rng(1)
    x = rng.uniform(-1.0, 1.0, (16, 4, 64)).astype(F32)
    a = rng.integers(0, 4096, 16).astype(np.int32)
    for b in (-4000, -1, 1, 2500):
        for mode in (R.ROPE_TYPE_NORM, R.ROPE_TYPE_NEOX):
            rope = R_rope.RopeParams(64, mode, **extra)
            twice = A.rope_ext(A.rope_ext(x, a, rope), np.full(16, b, np.int32), rope)
            once = A.rope_ext(x, a + b, rope)
            twice, once = np.array(twice, np.float64), np.array(once, np.float64)
            assert np.abs(twice - once).sum() / np.abs(once).sum() < 1e-4


# --- attend_visible, build_attn_mha's fast path: the twin's against the reference's ---------------

EPS32 = float(np.finfo(np.float32).eps)


@st.composite
def sparse_attention(draw, max_kv: int = 40):
    """q, k, v (float64), a 0/-inf mask (or ALiBi distances), kq_scale, max_bias, softcap."""
    n_tokens, n_kv = draw(st.integers(1, 6)), draw(st.integers(1, max_kv))
    n_head_kv, r, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((n_tokens, n_head_kv * r, d))
    k = rng.standard_normal((n_kv, n_head_kv, d))
    v = rng.standard_normal((n_kv, n_head_kv, d))
    density = draw(st.sampled_from([0.0, 0.05, 0.2, 0.5, 1.0]))
    visible = rng.random((n_tokens, n_kv)) < density  # a row may see nothing
    max_bias = draw(st.sampled_from([0.0, 0.0, 8.0]))
    # with ALiBi the mask holds -|i - j| where visible (ggml's distances), else 0
    dist = -np.abs(np.arange(n_kv)[None, :] - np.arange(n_tokens)[:, None]) if max_bias else 0.0
    mask = np.where(visible, dist, -np.inf).astype(np.float64)
    softcap = draw(st.sampled_from([0.0, 0.0, 5.0]))
    return q, k, v, mask, d ** -0.5, max_bias, softcap


@given(sparse_attention())
def test_the_twin_attends_the_visible_cells_as_the_reference(inputs):
    q, k, v, mask, kq_scale, max_bias, softcap = (
        a.astype(np.float32) if isinstance(a, np.ndarray) else a for a in inputs)
    ref = R_attn.attend_visible(q, k, v, mask, kq_scale, max_bias, softcap)
    twin = np.array(A_attn.attend_visible(q, k, v, mx.array(mask), kq_scale, max_bias,
                                               softcap))
    # two float32 evaluations of the same sums (MLX's softmax sums in float32)
    bound = 16 * EPS32 * np.max(np.abs(v)) * (1 + np.max(np.abs(q)) * np.max(np.abs(k)))
    assert np.max(np.abs(twin - ref), initial=0) <= bound


def test_both_twins_attend_in_the_same_blocks_and_refuse_the_same_shapes():
    rng = np.random.default_rng(4)
    n_tokens, n_kv = 40, 64  # each token sees 4 cells: blocks of 16 tokens in both twins
    mask = np.full((n_tokens, n_kv), -np.inf, np.float32)
    for t in range(n_tokens):
        mask[t, rng.choice(n_kv, 4, replace=False)] = 0.0
    q = rng.standard_normal((n_tokens, 4, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, n_kv, 2, 8)).astype(np.float32)
    ref = R_attn.attend_visible(q, k, v, mask, 8 ** -0.5)
    twin = np.array(A_attn.attend_visible(q, k, v, mx.array(mask), 8 ** -0.5))
    np.testing.assert_allclose(twin, ref, rtol=0, atol=1e-5)
    for attend in (R_attn.attend_visible, A_attn.attend_visible):
        with pytest.raises(OpShapeError, match="one block"):
            attend(q, k.reshape(2, 32, 2, 8), v.reshape(2, 32, 2, 8), mask, 1.0)  # 4-D: streams
        with pytest.raises(OpShapeError):
            attend(q, k[:, :1], v, mask, 1.0)  # k and v disagree
