"""The reference's laws, re-run on the accelerated (MLX) path.

The laws of ``tests/test_rope.py``, ``tests/test_decode_properties.py`` and
``tests/test_kv_cache.py``, stated again as hypothesis properties of
:class:`accelerated.context.Context` and :func:`accelerated.ops.rope_ext`. The twin computes
in float32, so each law is checked with the bound of the reference's float32 variant:

- **RoPE additivity** ``rope(rope(x, a), b) == rope(x, a + b)`` in test-rope.cpp's form
  (``sum|r1 - r2| / sum|r| < 1e-4``), normal and NeoX modes, partial ``n_rot``,
  ``freq_scale``, ``freq_factors`` and YaRN (``ext_factor != 0``, with the magnitude
  ``attn_factor * mscale`` one, which is what a K-shift needs);
- **batched == unbatched** (``split_simple`` on one stream, ``split_equal`` on one stream per
  sequence, any ``n_ubatch``, explicit or automatic positions), **token by token == one
  prefill**, **shifts** (``seq_add`` / ``seq_div`` / ``seq_rm`` / context shift == a fresh
  cache holding the same (token, position) cells: the K-shift on MLX tensors),
  ``seq_cp`` branches, ``seq_keep``, partial ``seq_rm``: NMSE <= 1e-10 between two MLX
  decodes, what the reference's float32 variants assert;
- return code 1 (no slot) and -1 (invalid batch) leave the MLX tensors bit-identical; an
  abort (2) keeps the ubatches computed before it and removes the aborted one;
- Mamba and Mamba-2 on the recurrent memory (``split_equal(sequential=True)``): chunked ==
  token by token == one prefill, interleaved sequences == each alone, ``seq_cp`` branches
  and ``seq_keep``, a partial ``seq_rm`` refused, failed decodes change no MLX state row;
- where a property already decodes a scenario, the reference decodes it too and the two
  twins agree (NMSE <= 1e-6, the end-to-end bound of ``tests/test_twin_llama.py``);
- a state machine drives both twins in lock-step through random decodes (valid and mostly
  invalid ones) and memory operations (``seq_*``, context shift): the same cells and return codes
  on both after every step, the same logits, and an MLX memory left bit-identical by every
  failure.

``split_seq`` is not exercised: the Context only uses it for embedding outputs, which it
never asks for (see ``reference/context.py``). Every Context here runs with its defaults,
so the Llama ubatches go through the compiled, reused graphs.

State blobs and files that cross between the twins are in ``tests/test_twin_state.py``.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from accelerated.context import Context as MLXContext
from accelerated.ops import rope_ext
from reference.batch import Batch
from reference.context import Context as RefContext
from reference.context import ContextError, context_shift
from reference.memory import KVCacheError
from reference.ops.rope import ROPE_TYPE_NEOX, ROPE_TYPE_NORM
from tests.test_decode_properties import apply_op, interleavings, ops_st, tokens_st
from tests.tiny_models import (
    nmse,
    random_mamba_weights,
    random_weights,
    tiny_hparams,
    tiny_mamba_hparams,
)

N_VOCAB = 32
SELF_TOL = 1e-10  # NMSE between two MLX decodes: the reference's float32 bound
TWIN_TOL = 1e-6  # NMSE between the twins (float32 end to end)
MODELS = {}


def model(n_layer: int):
    if n_layer not in MODELS:
        hp = tiny_hparams(n_vocab=N_VOCAB, n_layer=n_layer, n_ctx_train=4096)
        MODELS[n_layer] = hp, random_weights(hp, seed=7)
    return MODELS[n_layer]


def make(n_layer: int = 2, cls=MLXContext, **kwargs):
    """A float32 context of the tiny model (the MLX twin unless ``cls`` says otherwise)."""
    hp, w = model(n_layer)
    kwargs = dict(dict(n_ctx=256, n_batch=256, n_ubatch=256), **kwargs)
    return cls(hp, w, **kwargs)


def assert_close(want: np.ndarray, got: np.ndarray, tol: float = SELF_TOL) -> None:
    assert want.shape == got.shape
    assert np.isfinite(got).all()
    assert want.size == 0 or nmse(want, got) <= tol


def alone(tokens, n_layer: int = 2, pos0: int = 0, cls=MLXContext) -> np.ndarray:
    """Logits of every token of one sequence decoded alone, in one batch, from ``pos0``."""
    ctx = make(n_layer, cls)
    n = len(tokens)
    assert ctx.decode(Batch(token=list(tokens), pos=list(range(pos0, pos0 + n)),
                            logits=[True] * n)) == 0
    return ctx.get_logits().copy()  # (n_tokens, n_vocab)


def snapshot(ctx):
    """Everything a decode may change, MLX tensors brought back as NumPy."""
    mem = ctx.memory
    return (
        [(list(c.pos), [frozenset(s) for s in c.seq], list(c.shift)) for c in mem.v_cells],
        list(mem.v_heads),
        [np.array(k) for k in mem.k_l],
        [np.array(v) for v in mem.v_l],
        ctx.get_logits().copy(),
        ctx._output_ids.copy(),
    )


def assert_same(a, b) -> None:
    """Bit-identical snapshots."""
    assert a[0] == b[0] and a[1] == b[1]
    for x, y in zip(a[2] + a[3] + [a[4], a[5]], b[2] + b[3] + [b[4], b[5]], strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


# ---- RoPE additivity on accelerated.ops.rope_ext ----------------------------------------------


def additivity_error(x, a, b, n_dims, **params) -> float:
    """test-rope.cpp's measure: ``sum|r1 - r2| / min(sum|r1|, sum|r2|)``, r1 = rope twice."""
    r1 = np.array(rope_ext(rope_ext(x, a, n_dims, **params), np.full_like(a, b), n_dims,
                           **params), dtype=np.float64)
    r2 = np.array(rope_ext(x, a + b, n_dims, **params), dtype=np.float64)
    return float(np.abs(r1 - r2).sum() / min(np.abs(r1).sum(), np.abs(r2).sum()))


def test_rope_test_cpp_additivity_float32():
    """tests/test-rope.cpp, modes 0 and 2, on the twin: rope by 100 + i then by -67 versus
    rope by 33 + i; x uniform in [-1, 1], ne = {2*128, 32, 73}, n_rot 128."""
    x = np.random.default_rng(0).uniform(-1.0, 1.0, (73, 32, 256)).astype(np.float32)
    i = np.arange(73, dtype=np.int32)
    defaults = dict(n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
                    attn_factor=1.0, beta_fast=0.0, beta_slow=0.0)
    for mode in (ROPE_TYPE_NORM, ROPE_TYPE_NEOX):
        err = additivity_error(x, 100 + i, 33 - 100, 128, mode=mode, **defaults)
        assert 0.0 < err < 1e-4  # float32 rounding is there; the law holds to the bound


@st.composite
def rope_case(draw, max_pos: int = 2048):
    """x (n_tokens, n_head, head_dim) float32, positions, a partial or full n_dims, params."""
    head_dim = 2 * draw(st.integers(1, 32))
    n_dims = 2 * draw(st.integers(1, head_dim // 2))
    n_tokens = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.uniform(-1.0, 1.0, (n_tokens, draw(st.integers(1, 3)), head_dim)).astype(np.float32)
    pos = np.array(draw(st.lists(st.integers(-max_pos, max_pos), min_size=n_tokens,
                                 max_size=n_tokens)), dtype=np.int32)
    params = dict(
        mode=draw(st.sampled_from([ROPE_TYPE_NORM, ROPE_TYPE_NEOX])),
        freq_base=draw(st.sampled_from([10000.0, 500000.0, 100.0])),
        freq_scale=draw(st.sampled_from([1.0, 0.5, 0.25])),
    )
    if draw(st.booleans()):
        params["freq_factors"] = rng.uniform(1.0, 8.0, n_dims // 2).astype(np.float32)
    return x, pos, n_dims, params


@given(case=rope_case(), b=st.integers(-2048, 2048), ext_factor=st.sampled_from([0.0, 0.5, 1.0]))
def test_rope_additivity_float32(case, b, ext_factor):
    """Both code paths of the twin: ``mx.fast.rope`` (no YaRN) and the YaRN cos/sin cache.

    With YaRN the magnitude ``attn_factor * mscale`` is set to one (a K-shift's rope), where
    the angle is linear in the position; positions stay within test-rope's few thousands,
    where float32 angles keep the bound.
    """
    x, a, n_dims, params = case
    if ext_factor != 0.0:
        mscale = 1.0 + 0.1 * math.log(1.0 / params["freq_scale"])
        params = dict(params, ext_factor=ext_factor, n_ctx_orig=512, attn_factor=1.0 / mscale)
    assert additivity_error(x, a, b, n_dims, **params) < 1e-4


@given(case=rope_case(), b=st.integers(-2048, 2048), freq_scale=st.sampled_from([0.5, 0.25]))
def test_rope_yarn_magnitude_breaks_additivity_by_mscale(case, b, freq_scale):
    """attn_factor 1 under YaRN: twice applies mscale^2, once mscale: off by mscale exactly."""
    x, a, n_dims, params = case
    params = dict(params, freq_scale=freq_scale, ext_factor=1.0, n_ctx_orig=512)
    mscale = 1.0 + 0.1 * math.log(1.0 / freq_scale)
    twice = np.array(rope_ext(rope_ext(x, a, n_dims, **params), np.full_like(a, b), n_dims,
                              **params))
    once = np.array(rope_ext(x, a + b, n_dims, **params))
    err = np.abs(twice[..., :n_dims] - mscale * once[..., :n_dims]).sum()
    assert err / np.abs(twice[..., :n_dims]).sum() < 1e-4
    np.testing.assert_array_equal(twice[..., n_dims:], x[..., n_dims:])  # copied through


# ---- batched == unbatched, token by token == prefill -----------------------------------------


@given(case=interleavings(), n_ubatch=st.integers(1, 8), kv_unified=st.booleans(),
       auto_pos=st.booleans())
def test_batched_equals_unbatched(case, n_ubatch, kv_unified, auto_pos):
    """One stream splits with ``split_simple``, one stream per sequence with ``split_equal``."""
    seqs, order, cut = case
    n_seq = len(seqs)
    kw = dict(n_ubatch=n_ubatch, n_seq_max=n_seq, kv_unified=kv_unified,
              n_ctx=256 * (1 if kv_unified else n_seq))
    ctx, ref = make(**kw), make(cls=RefContext, **kw)
    got: dict[int, list] = {s: [] for s in range(n_seq)}
    k = [0] * n_seq
    for part in (order[:cut], order[cut:]):
        if not part:
            continue
        token, pos = [], []
        for s in part:
            token.append(seqs[s][k[s]])
            pos.append(k[s])
            k[s] += 1
        b = Batch(token=token, pos=None if auto_pos else pos, seq_id=[[s] for s in part],
                  logits=[True] * len(part))
        assert ctx.decode(b) == 0 and ref.decode(b) == 0
        assert_close(ref.get_logits(), ctx.get_logits(), TWIN_TOL)
        for i, s in enumerate(part):
            got[s].append(ctx.get_logits_ith(i))
    for s, t in enumerate(seqs):
        assert_close(alone(t), np.stack(got[s]))


@given(tokens=st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=10))
def test_token_by_token_equals_one_prefill(tokens):
    ctx = make()
    rows = []
    for t in tokens:
        assert ctx.decode(Batch(token=[t])) == 0
        rows.append(ctx.get_logits_ith(-1))
    prefill = alone(tokens)
    assert_close(prefill, np.stack(rows))
    assert_close(alone(tokens, cls=RefContext), prefill, TWIN_TOL)


# ---- shifts: the MLX K-shift after seq_add / seq_div / context shift == a fresh cache ------------


def fresh_cache(cells: list[tuple[int, int]], cls=MLXContext):
    """A one-layer context whose sequence 0 holds exactly ``cells`` = (token, pos) pairs.

    Each contiguous run is decoded as sequence 1 (an empty sequence may start anywhere),
    copied to 0 and removed from 1 (as in ``tests/test_decode_properties.py``).
    """
    ctx = make(n_layer=1, cls=cls, n_seq_max=2)
    runs: list[list[tuple[int, int]]] = []
    for c in sorted(cells, key=lambda c: c[1]):
        if runs and c[1] <= runs[-1][-1][1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    for run in runs:
        assert ctx.decode(Batch(token=[t for t, _ in run], pos=[p for _, p in run],
                                seq_id=[[1]] * len(run))) == 0
        ctx.memory.seq_cp(1, 0, -1, -1)
        ctx.memory.seq_rm(1, -1, -1)
    return ctx


def apply_ops(ctx, ops) -> None:
    for name, a, b, x in ops:
        if name == "shift":  # n_keep = a, n_discard = b
            context_shift(ctx, 0, a, b)
        elif name == "seq_rm":
            ctx.memory.seq_rm(0, a, b)
        else:
            getattr(ctx.memory, name)(0, a, b, x)


@given(prompt=st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=12), ops=ops_st,
       cont=tokens_st, kv_unified=st.booleans())
def test_shifted_cache_equals_fresh_decode_at_shifted_positions(prompt, ops, cont, kv_unified):
    """One layer: a cell's K and V depend only on its token and position, so after the
    K-shift the cache equals a fresh one holding the same (token, position) cells."""
    kw = dict(n_layer=1, n_seq_max=2, kv_unified=kv_unified, n_ctx=256 * (1 if kv_unified else 2))
    ctx, ref = make(**kw), make(cls=RefContext, **kw)
    cells = [(t, p) for p, t in enumerate(prompt)]
    for c in (ctx, ref):
        assert c.decode(Batch(token=prompt)) == 0
        apply_ops(c, ops)
    for op in ops:
        name, a, b, _ = op
        if name == "shift":
            cells = apply_op(apply_op(cells, ("seq_rm", a, a + b, 0)), ("seq_add", a + b, -1, -b))
        else:
            cells = apply_op(cells, op)
    mem_pos = sorted(c.pos[i] for c in ctx.memory.v_cells for i in range(c.size())
                     if c.seq_has(i, 0))
    assert mem_pos == sorted(p for _, p in cells)
    fresh = fresh_cache(cells)
    n = len(cont)
    for c in (ctx, ref, fresh):
        assert c.decode(Batch(token=cont, logits=[True] * n)) == 0
    assert not ctx.memory.get_has_shift()  # the K-shift ran
    assert_close(fresh.get_logits(), ctx.get_logits())
    assert_close(ref.get_logits(), ctx.get_logits(), TWIN_TOL)


@given(prompt=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=12),
       d=st.integers(2, 4), cont=tokens_st)
def test_seq_div_equals_fresh_decode_at_divided_positions(prompt, d, cont):
    """The law llama.cpp breaks (docs/divergences.md); the twin keeps it, as the reference."""
    ctx = make(n_layer=1, n_seq_max=2)
    assert ctx.decode(Batch(token=prompt)) == 0
    ctx.memory.seq_div(0, 0, -1, d)
    assert ctx.memory.get_has_shift()
    fresh = fresh_cache([(t, p // d) for p, t in enumerate(prompt)])
    for c in (ctx, fresh):
        assert c.decode(Batch(token=cont, logits=[True] * len(cont))) == 0
    assert_close(fresh.get_logits(), ctx.get_logits())


# ---- seq_cp, seq_keep, seq_rm -----------------------------------------------------------------


@given(prefix=tokens_st, conts=st.lists(tokens_st, min_size=2, max_size=3),
       tail=tokens_st, kv_unified=st.booleans(), n_ubatch=st.integers(1, 8),
       keep=st.integers(0, 2))
def test_seq_cp_branches_equal_independent_decodes(prefix, conts, tail, kv_unified, n_ubatch,
                                                   keep):
    """Shared cells (one stream) or copied streams (one per sequence, copied at the next
    update): every branch goes on as if alone; after ``seq_keep`` the kept one too."""
    n_seq = len(conts)
    keep = keep % n_seq
    ctx = make(n_seq_max=n_seq, kv_unified=kv_unified, n_ubatch=n_ubatch,
               n_ctx=256 * (1 if kv_unified else n_seq))
    assert ctx.decode(Batch(token=prefix)) == 0
    for s in range(1, n_seq):
        ctx.memory.seq_cp(0, s, -1, -1)
    token, seq_id, where = [], [], []
    for k in range(max(map(len, conts))):  # the continuations interleaved in one batch
        for s, c in enumerate(conts):
            if k < len(c):
                where.append((s, len(token)))
                token.append(c[k])
                seq_id.append([s])
    assert ctx.decode(Batch(token=token, seq_id=seq_id, logits=[True] * len(token))) == 0
    for s, c in enumerate(conts):
        rows = np.stack([ctx.get_logits_ith(i) for s2, i in where if s2 == s])
        assert_close(alone(prefix + c)[len(prefix):], rows)
    ctx.memory.seq_keep(keep)
    for s in range(n_seq):
        gone = kv_unified and s != keep
        assert ctx.memory.seq_pos_max(s) == (-1 if gone else len(prefix) + len(conts[s]) - 1)
    n = len(tail)
    assert ctx.decode(Batch(token=tail, seq_id=[[keep]] * n, logits=[True] * n)) == 0
    assert_close(alone(prefix + conts[keep] + tail)[-n:], ctx.get_logits())


@given(prompt=st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=12),
       k=st.integers(0, 12), cont=tokens_st, kv_unified=st.booleans())
def test_partial_seq_rm_then_redecode_equals_fresh(prompt, k, cont, kv_unified):
    k = min(k, len(prompt))
    ctx = make(kv_unified=kv_unified, n_ubatch=3)
    assert ctx.decode(Batch(token=prompt)) == 0
    assert ctx.memory.seq_rm(0, k, -1) is True
    assert ctx.memory.seq_pos_max(0) == k - 1
    n = len(cont)
    assert ctx.decode(Batch(token=cont, logits=[True] * n)) == 0
    assert_close(alone(prompt[:k] + cont)[k:], ctx.get_logits())


# ---- failures change nothing --------------------------------------------------------------------


@settings(max_examples=max(6, settings().max_examples // 3))  # 400 tokens an example
@given(n_ubatch=st.sampled_from([16, 32, 64]), extra=st.integers(57, 120),
       kv_unified=st.booleans())
def test_no_slot_leaves_mlx_memory_bit_identical(n_ubatch, extra, kv_unified):
    """rc 1 (200 cells used of 256, then 57 to 120 more): the ubatches placed before the one
    that found no slot are undone, and the MLX tensors are bit-identical."""
    rng = np.random.default_rng(extra)
    prompt = rng.integers(0, N_VOCAB, 200).tolist()
    ctx = make(n_ubatch=n_ubatch, kv_unified=kv_unified)
    assert ctx.decode(Batch(token=prompt)) == 0
    before = snapshot(ctx)
    assert ctx.decode(Batch(token=rng.integers(0, N_VOCAB, extra).tolist())) == 1
    assert_same(before, snapshot(ctx))
    assert ctx.decode(Batch(token=[1, 2], logits=[True, True])) == 0
    straight = make(n_ubatch=n_ubatch, kv_unified=kv_unified)
    assert straight.decode(Batch(token=prompt)) == 0
    assert straight.decode(Batch(token=[1, 2], logits=[True, True])) == 0
    np.testing.assert_array_equal(straight.get_logits(), ctx.get_logits())


batch_st = st.fixed_dictionaries({
    "token": st.lists(st.integers(-1, N_VOCAB), min_size=1, max_size=5),
    "pos": st.one_of(st.none(), st.lists(st.integers(0, 8), min_size=5, max_size=5)),
    "seq_id": st.one_of(st.none(), st.lists(st.lists(st.integers(-1, 2), min_size=1,
                                                      max_size=2), min_size=5, max_size=5)),
})


@given(prompt=st.lists(tokens_st, min_size=2, max_size=2), b=batch_st,
       kv_unified=st.booleans())
def test_invalid_batch_leaves_mlx_memory_bit_identical(prompt, b, kv_unified):
    ctx = make(n_seq_max=2, kv_unified=kv_unified, n_ctx=256 * (1 if kv_unified else 2))
    for s, t in enumerate(prompt):
        assert ctx.decode(Batch(token=t, seq_id=[[s]] * len(t), logits=[True] * len(t))) == 0
    n = len(b["token"])
    batch = Batch(token=b["token"], pos=None if b["pos"] is None else b["pos"][:n],
                  seq_id=None if b["seq_id"] is None else b["seq_id"][:n])
    ctx.memory_update()
    before = snapshot(ctx)
    rc = ctx.decode(batch)
    assert rc in (0, -1)
    if rc == -1:
        assert_same(before, snapshot(ctx))
    else:
        assert ctx.n_outputs == 1


@pytest.mark.parametrize("kv_unified", [True, False])
def test_invalid_batch_after_a_pending_shift_keeps_the_shift_pending(kv_unified):
    """A rejected batch returns before the memory update: the K-shift stays pending and the
    MLX tensors keep the keys roped at the old positions."""
    ctx = make(n_layer=1, n_seq_max=2, kv_unified=kv_unified,
               n_ctx=256 * (1 if kv_unified else 2))
    assert ctx.decode(Batch(token=[1, 2, 3, 4, 5, 6])) == 0
    ctx.memory.seq_add(0, 2, -1, 3)
    before = snapshot(ctx)
    assert ctx.decode(Batch(token=[7], pos=[4])) == -1  # seq 0 must go on at 8
    assert ctx.memory.get_has_shift()
    assert_same(before, snapshot(ctx))
    assert ctx.decode(Batch(token=[7], logits=[True])) == 0
    fresh = fresh_cache([(1, 0), (2, 1), (3, 5), (4, 6), (5, 7), (6, 8)])
    assert fresh.decode(Batch(token=[7], logits=[True])) == 0
    assert_close(fresh.get_logits(), ctx.get_logits())


# ---- Mamba and Mamba-2 through the accelerated Context (recurrent memory) -----------------------

ARCHS = ("mamba", "mamba2")
MAMBA = {}


def mamba_model(arch: str):
    """The tiny models of ``tests/test_context_mamba.py``, in float32."""
    if arch not in MAMBA:
        kw = dict(n_vocab=N_VOCAB, n_embd=16, n_layer=2, d_state=4)
        if arch == "mamba2":
            kw.update(head_dim=8, n_group=2)
        hp = tiny_mamba_hparams(arch, **kw)
        MAMBA[arch] = hp, random_mamba_weights(hp, seed=3)
    return MAMBA[arch]


def make_mamba(arch: str, cls=MLXContext, n_ubatch: int = 64, n_seq_max: int = 3):
    hp, w = mamba_model(arch)
    return cls(hp, w, n_ctx=256, n_batch=64, n_ubatch=n_ubatch, n_seq_max=n_seq_max)


def decode_seq(ctx, tokens, seq: int = 0) -> np.ndarray:
    """Decode ``tokens`` for one sequence (positions from the memory); every token's logits."""
    n = len(tokens)
    assert ctx.decode(Batch(token=list(tokens), seq_id=[[seq]] * n, logits=[True] * n)) == 0
    return ctx.get_logits().copy()  # (n, n_vocab)


def mamba_snapshot(ctx):
    """Cells, counters, the MLX rows (as NumPy) and the outputs."""
    mem = ctx.memory
    return (copy.deepcopy(mem.cells), mem.used, mem.head,
            [np.array(t) for t in mem.r_l + mem.s_l], ctx.get_logits().copy())


def assert_same_mamba(a, b) -> None:
    assert a[0] == b[0] and a[1:3] == b[1:3]
    for x, y in zip(a[3] + [a[4]], b[3] + [b[4]], strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


arch_st = st.sampled_from(ARCHS)
mamba_tokens = st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=8)
mamba_ubatch = st.sampled_from([1, 2, 3, 64])


@given(arch=arch_st, tokens=mamba_tokens, n_ubatch=mamba_ubatch, data=st.data())
def test_mamba_chunked_equals_token_by_token_equals_one_prefill(arch, tokens, n_ubatch, data):
    """A recurrent state carries everything: any cut of the prompt gives the same logits."""
    one = decode_seq(make_mamba(arch, n_ubatch=n_ubatch), tokens)
    assert_close(decode_seq(make_mamba(arch, RefContext, n_ubatch=n_ubatch), tokens), one,
                 TWIN_TOL)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(tokens) - 1)), max_size=3)))
    ctx, rows, start = make_mamba(arch, n_ubatch=n_ubatch), [], 0
    for end in [c for c in cuts if c < len(tokens)] + [len(tokens)]:
        rows.append(decode_seq(ctx, tokens[start:end]))
        start = end
    assert_close(one, np.concatenate(rows))
    step = make_mamba(arch, n_ubatch=n_ubatch)
    assert_close(one, np.concatenate([decode_seq(step, [t]) for t in tokens]))


@given(arch=arch_st, seqs=st.lists(mamba_tokens, min_size=2, max_size=3), n_ubatch=mamba_ubatch,
       conts=st.lists(mamba_tokens, min_size=3, max_size=3))
def test_mamba_interleaved_sequences_equal_each_alone(arch, seqs, n_ubatch, conts):
    """``split_equal(sequential=True)`` cuts the batch into equal sets: each sequence's logits
    are those it gets alone, over two batches (positions from the memory)."""
    ctx, ref = make_mamba(arch, n_ubatch=n_ubatch), make_mamba(arch, RefContext, n_ubatch=n_ubatch)
    token, seq_id = [], []
    for k in range(max(map(len, seqs))):
        for s, t in enumerate(seqs):
            if k < len(t):
                token.append(t[k])
                seq_id.append([s])
    b1 = Batch(token=token, seq_id=seq_id, logits=[True] * len(token))
    token2 = [t for s in range(len(seqs)) for t in conts[s]]
    seq2 = [[s] for s in range(len(seqs)) for _ in conts[s]]
    b2 = Batch(token=token2, seq_id=seq2, logits=[True] * len(token2))
    out = []
    for b in (b1, b2):
        assert ctx.decode(b) == 0 and ref.decode(b) == 0
        assert_close(ref.get_logits(), ctx.get_logits(), TWIN_TOL)
        out.append(ctx.get_logits().copy())
    for s, t in enumerate(seqs):
        got = np.concatenate([out[0][[i for i, x in enumerate(seq_id) if x == [s]]],
                              out[1][[i for i, x in enumerate(seq2) if x == [s]]]])
        assert_close(decode_seq(make_mamba(arch), list(t) + list(conts[s])), got)


@given(arch=arch_st, prefix=mamba_tokens, branches=st.lists(mamba_tokens, min_size=3, max_size=3),
       n_ubatch=mamba_ubatch, keep=st.integers(0, 2))
def test_mamba_seq_cp_branches_equal_independent_decodes(arch, prefix, branches, n_ubatch, keep):
    """``seq_cp`` shares the state, the next ubatch copies it on write."""
    ctx = make_mamba(arch, n_ubatch=n_ubatch)
    decode_seq(ctx, prefix)
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.memory.seq_cp(1, 2, -1, -1)
    token = [t for b in branches for t in b]
    seq_id = [[s] for s, b in enumerate(branches) for _ in b]
    assert ctx.decode(Batch(token=token, seq_id=seq_id, logits=[True] * len(token))) == 0
    for s, b in enumerate(branches):
        want = decode_seq(make_mamba(arch), list(prefix) + list(b))[len(prefix):]
        assert_close(want, ctx.get_logits()[[i for i, x in enumerate(seq_id) if x == [s]]])
    ctx.memory.seq_keep(keep)
    assert [ctx.memory.seq_pos_max(s) == -1 for s in range(3)] == [s != keep for s in range(3)]
    more = decode_seq(ctx, [5, 6], seq=keep)
    full = list(prefix) + list(branches[keep]) + [5, 6]
    assert_close(decode_seq(make_mamba(arch), full)[-2:], more)


@given(arch=arch_st, tokens=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=8),
       p0=st.integers(1, 7))
def test_mamba_partial_seq_rm_is_refused_and_leaves_mlx_rows_bit_identical(arch, tokens, p0):
    ctx = make_mamba(arch)
    decode_seq(ctx, tokens)
    p0 = min(p0, len(tokens) - 1)
    before = mamba_snapshot(ctx)
    assert ctx.memory.seq_rm(0, p0, -1) is False
    assert_same_mamba(before, mamba_snapshot(ctx))
    assert ctx.memory.seq_rm(0, -1, -1) is True  # the whole sequence: a zero state again
    assert_close(decode_seq(make_mamba(arch), [3, 4]), decode_seq(ctx, [3, 4]))


@pytest.mark.parametrize("arch", ARCHS)
def test_mamba_failed_decodes_leave_mlx_rows_bit_identical(arch):
    """-1 for invalid batches, 1 for a token of two coupled sequences (``split_equal`` with
    ``sequential=True`` cannot split them; no recurrent model decodes them); the MLX rows are
    bit-identical after each, and the decode goes on as if they never happened."""
    ctx = make_mamba(arch)
    decode_seq(ctx, [1, 2, 3, 4])
    ctx.memory.seq_cp(0, 1, -1, -1)
    decode_seq(ctx, [5], seq=1)  # sequence 1 has its own state now
    ctx.memory.seq_cp(0, 2, -1, -1)  # sequence 2 shares sequence 0's
    before = mamba_snapshot(ctx)
    for bad in (Batch(token=[1], seq_id=[[3]]), Batch(token=[1], pos=[6]),
                Batch(token=[1], pos=[3]), Batch(token=[N_VOCAB], pos=[4]),
                Batch(token=[1, 2], pos=[4, 6])):
        assert ctx.decode(bad) == -1
        assert_same_mamba(before, mamba_snapshot(ctx))
    assert ctx.decode(Batch(token=[7], seq_id=[[0, 2]], pos=[4])) == 1
    assert_same_mamba(before, mamba_snapshot(ctx))
    straight = make_mamba(arch)
    decode_seq(straight, [1, 2, 3, 4])
    assert_close(decode_seq(straight, [9]), decode_seq(ctx, [9]))


@given(prompt=tokens_st, cont=st.lists(st.integers(0, N_VOCAB - 1), min_size=2, max_size=9),
       n_ubatch=st.integers(1, 4), abort_at=st.integers(0, 3), arch=st.sampled_from(
           ["llama", *ARCHS]))
def test_abort_keeps_earlier_ubatches_and_removes_the_aborted_one(prompt, cont, n_ubatch,
                                                                  abort_at, arch):
    """rc 2: the ubatches computed before the abort stay (their MLX K/V or state rows too),
    the aborted one is removed, and the decode goes on as if only the kept tokens had come."""
    calls = []

    def abort() -> bool:
        calls.append(1)
        return len(calls) > abort_at

    new = (lambda: make(n_ubatch=n_ubatch)) if arch == "llama" else (
        lambda: make_mamba(arch, n_ubatch=n_ubatch))
    ctx = new()
    decode_seq(ctx, prompt)
    ctx.abort_callback = abort
    n_ub = -(-len(cont) // n_ubatch)
    rc = ctx.decode(Batch(token=cont, logits=[True] * len(cont)))
    kept = len(cont) if abort_at >= n_ub else abort_at * n_ubatch
    assert rc == (0 if abort_at >= n_ub else 2)
    assert ctx.memory.seq_pos_max(0) == len(prompt) + kept - 1
    ctx.abort_callback = None
    straight = new()
    assert_close(decode_seq(straight, list(prompt) + list(cont[:kept]) + [1])[-1:],
                 decode_seq(ctx, [1]))


# ---- both twins in lock-step: random decodes and memory operations ------------------------------

MACHINE_HP = tiny_hparams(n_vocab=16, n_embd=8, n_head=2, n_head_kv=1, n_layer=2, n_ff=8,
                          n_ctx_train=4096)
MACHINE_W = random_weights(MACHINE_HP, seed=5)
MACHINE_SEQ = 3


def cells_of(ctx):
    """The cells (positions, sequence sets, pending shifts) and heads of every stream."""
    mem = ctx.memory
    return ([(list(c.pos), [frozenset(s) for s in c.seq], list(c.shift)) for c in mem.v_cells],
            list(mem.v_heads))


class TwinMachine(RuleBasedStateMachine):
    """The reference and the MLX Context driven by the same random steps (the rules of
    ``tests/test_decode_stateful.py``). After every step both hold the same cells; every
    decode returns the same code on both, with logits that agree (NMSE <= 1e-6); a failed
    decode or a refused memory operation leaves the MLX tensors bit-identical."""

    @initialize(kv_unified=st.booleans(), n_ubatch=st.integers(1, 9))
    def setup(self, kv_unified, n_ubatch):
        kw = dict(n_ctx=256 * (1 if kv_unified else MACHINE_SEQ), n_batch=64, n_ubatch=n_ubatch,
                  n_seq_max=MACHINE_SEQ, kv_unified=kv_unified)
        self.ref = RefContext(MACHINE_HP, MACHINE_W, **kw)
        self.acc = MLXContext(MACHINE_HP, MACHINE_W, **kw)

    def both(self, fn):
        """``fn(ctx)`` on both twins: the same result or the same exception type."""
        outcome = []
        for ctx in (self.ref, self.acc):
            try:
                outcome.append(("ok", fn(ctx)))
            except (KVCacheError, ContextError) as e:
                outcome.append(("raised", type(e)))
        assert outcome[0] == outcome[1]
        return outcome[1]

    def decode(self, batch: Batch) -> int:
        self.both(lambda c: c.memory_update())
        before = snapshot(self.acc)
        _, rc = self.both(lambda c: c.decode(batch))
        if rc == 0:
            assert_close(self.ref.get_logits(), self.acc.get_logits(), TWIN_TOL)
        else:
            assert_same(before, snapshot(self.acc))
        return rc

    @rule(data=st.data(), seqs=st.sets(st.integers(0, MACHINE_SEQ - 1), min_size=1),
          n_each=st.integers(1, 3))
    def decode_valid(self, data, seqs, n_each):
        if sum(c.get_used() for c in self.acc.memory.v_cells) > 150:
            self.both(lambda c: c.memory.clear())
        order = data.draw(st.permutations([s for s in sorted(seqs) for _ in range(n_each)]))
        token = [data.draw(st.integers(0, MACHINE_HP.n_vocab - 1)) for _ in order]
        logits = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
        assert self.decode(Batch(token=token, seq_id=[[s] for s in order], logits=logits)) == 0

    @rule(token=st.lists(st.integers(-1, MACHINE_HP.n_vocab), min_size=1, max_size=4),
          pos=st.lists(st.integers(0, 12), min_size=4, max_size=4),
          seq_id=st.lists(st.lists(st.integers(-1, MACHINE_SEQ), min_size=1, max_size=2),
                          min_size=4, max_size=4))
    def decode_any(self, token, pos, seq_id):
        n = len(token)
        assert self.decode(Batch(token=token, pos=pos[:n], seq_id=seq_id[:n])) in (0, 1, -1)

    def guarded(self, fn):
        before = snapshot(self.acc)
        if self.both(fn)[0] == "raised":
            assert_same(before, snapshot(self.acc))

    @rule(seq=st.integers(-1, MACHINE_SEQ - 1), p0=st.integers(-1, 12), p1=st.integers(-1, 12))
    def seq_rm(self, seq, p0, p1):
        self.guarded(lambda c: c.memory.seq_rm(seq, p0, p1))

    @rule(src=st.integers(0, MACHINE_SEQ - 1), dst=st.integers(0, MACHINE_SEQ - 1),
          p0=st.integers(-1, 12), p1=st.integers(-1, 12))
    def seq_cp(self, src, dst, p0, p1):
        self.guarded(lambda c: c.memory.seq_cp(src, dst, p0, p1))

    @rule(seq=st.integers(0, MACHINE_SEQ - 1))
    def seq_keep(self, seq):
        self.guarded(lambda c: c.memory.seq_keep(seq))

    @rule(seq=st.integers(0, MACHINE_SEQ - 1), p0=st.integers(-1, 12), p1=st.integers(-1, 12),
          shift=st.integers(-6, 6))
    def seq_add(self, seq, p0, p1, shift):
        self.guarded(lambda c: c.memory.seq_add(seq, p0, p1, shift))

    @rule(seq=st.integers(0, MACHINE_SEQ - 1), p0=st.integers(-1, 12), p1=st.integers(-1, 12),
          d=st.integers(0, 4))
    def seq_div(self, seq, p0, p1, d):
        self.guarded(lambda c: c.memory.seq_div(seq, p0, p1, d))

    @rule(seq=st.integers(-1, MACHINE_SEQ), n_keep=st.integers(-1, 6), n_discard=st.integers(0, 6))
    def shift(self, seq, n_keep, n_discard):
        self.guarded(lambda c: context_shift(c, seq, n_keep, n_discard))

    @invariant()
    def same_cells(self):
        if hasattr(self, "acc"):
            assert cells_of(self.ref) == cells_of(self.acc)


TestTwinMachine = TwinMachine.TestCase
TestTwinMachine.settings = settings(
    settings(), max_examples=max(5, settings().max_examples // 3), stateful_step_count=20,
    deadline=None,
)
