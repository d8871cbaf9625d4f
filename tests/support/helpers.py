"""What the law files share: the Context flavours, the laws' tiny models, snapshots, verdicts.

A law is written once and runs on every **flavour** of the Context, one pytest case each
(``@every_flavour``):

| flavour | Context | dtype | a law's verdict (two results of this flavour) |
|---|---|---|---|
| ``ref-f64`` | ``reference.context.Context`` | float64 | max error <= 1e-10 (rounding only) |
| ``ref-f32`` | ``reference.context.Context`` | float32 | NMSE <= ``MAX_NMSE_SELF_F32`` = 1e-10 |
| ``mlx`` | ``accelerated.context.Context`` | float32 | NMSE <= ``MAX_NMSE_SELF_F32`` = 1e-10 |

A twin flavour names the reference flavour it is held to (``mlx`` -> ``ref-f32``): where a
law decodes a scenario on the twin, :func:`assert_twins_agree` decodes it on the reference
too and the two agree to NMSE <= ``MAX_NMSE_TWIN`` (1e-6, float32 end to end).

The laws' models: a tiny Llama (:func:`make`, :func:`alone`, :func:`fresh_cache`) and tiny
Mamba / Mamba-2 (:func:`make_mamba`, :func:`mamba_alone`), with seeded weights drawn in the
flavour's dtype. :func:`snapshot` / :func:`assert_same`: everything a failed operation must
not change, bit for bit, on either twin. :func:`deep`: the hypothesis settings of the
stateful machines and the state laws (the ``ci-deep`` profile in CI).
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import settings

from accelerated.context import Context as MLXContext
from reference.batch import Batch
from reference.common import MAX_NMSE_SELF_F32, MAX_NMSE_TWIN
from reference.context import Context as RefContext
from reference.context import context_shift
from reference.testing import (
    mamba_reference_logits,
    nmse,
    random_mamba_weights,
    random_weights,
    tiny_hparams,
    tiny_mamba_hparams,
)

#: float64: the largest |want - got| a law allows (only rounding differs)
MAX_ERR_F64 = 1e-10


# ---- the flavours ------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class Flavour:
    """One Context a law runs on.

    Attributes:
        name: the pytest id (``ref-f64``, ``ref-f32``, ``mlx``).
        context: the Context class.
        dtype: the dtype of its weights, memory and logits.
        package: ``reference`` or ``accelerated``: where its ops and models live.
        reference: for a twin, the reference flavour it must agree with (else None).
    """

    name: str
    context: type
    dtype: np.dtype
    package: str
    reference: Flavour | None = None

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        return f"Flavour({self.name!r})"

    def make(self, hparams, weights, **kwargs):
        """A Context of this flavour."""
        return self.context(hparams, weights, dtype=self.dtype, **kwargs)

    def assert_close(self, want, got) -> None:
        """A law's verdict between two results of this flavour: float64 to a max error of
        1e-10, float32 to NMSE <= 1e-10; shapes equal, no NaN or infinity."""
        want, got = np.asarray(want), np.asarray(got)
        assert want.shape == got.shape, (want.shape, got.shape)
        assert np.isfinite(got).all()
        if want.size == 0:
            return
        if self.dtype == np.float64:
            err = float(np.abs(want - got).max())
            assert err <= MAX_ERR_F64, f"max error {err:.3g} > {MAX_ERR_F64} ({self})"
        else:
            err = nmse(want, got)
            assert err <= MAX_NMSE_SELF_F32, f"NMSE {err:.3g} > {MAX_NMSE_SELF_F32} ({self})"


REF_F64 = Flavour("ref-f64", RefContext, np.dtype(np.float64), "reference")
REF_F32 = Flavour("ref-f32", RefContext, np.dtype(np.float32), "reference")
MLX = Flavour("mlx", MLXContext, np.dtype(np.float32), "accelerated", reference=REF_F32)
FLAVOURS = (REF_F64, REF_F32, MLX)

#: parametrize a law over every flavour, one visible case each (works under ``@given``)
every_flavour = pytest.mark.parametrize("flavour", FLAVOURS, ids=str)


def same_dtype(flavour: Flavour) -> list[Flavour]:
    """The flavours whose state blobs ``flavour`` can read (a blob carries its dtype)."""
    return [f for f in FLAVOURS if f.dtype == flavour.dtype]


def assert_nmse(want, got, tol: float) -> None:
    want, got = np.asarray(want), np.asarray(got)
    assert want.shape == got.shape, (want.shape, got.shape)
    assert np.isfinite(got).all()
    assert want.size == 0 or nmse(want, got) <= tol, f"NMSE {nmse(want, got):.3g} > {tol}"


def assert_between(a: Flavour, b: Flavour, want, got) -> None:
    """Results of ``a`` and ``b`` on one scenario: the law's verdict if they are the same
    flavour, the twins' bound (NMSE <= 1e-6) if not."""
    if a == b:
        a.assert_close(want, got)
    else:
        assert_nmse(want, got, MAX_NMSE_TWIN)


def assert_twins_agree(flavour: Flavour, got, scenario: Callable[[Flavour], np.ndarray]) -> None:
    """Where ``flavour`` is a twin, run ``scenario`` on its reference too: ``got`` (the twin's
    result of ``scenario(flavour)``) and the reference's agree to NMSE <= ``MAX_NMSE_TWIN``."""
    if flavour.reference is not None:
        assert_nmse(scenario(flavour.reference), got, MAX_NMSE_TWIN)


# ---- hypothesis settings -----------------------------------------------------------------------


def deep(**kwargs) -> settings:
    """Settings of the stateful machines and the state laws: the ``ci-deep`` profile
    when ``HYPOTHESIS_PROFILE=ci`` (more examples, still derandomized), else the loaded
    profile (``dev``, ``thorough``); ``kwargs`` override either."""
    if os.environ.get("HYPOTHESIS_PROFILE") == "ci":
        return settings(settings.get_profile("ci-deep"), **kwargs)
    return settings(settings(), **kwargs)


# ---- the laws' tiny Llama ----------------------------------------------------------------------

N_VOCAB = 32


@functools.cache
def llama_model(n_layer: int, dtype: np.dtype):
    """The tiny Llama of the laws (seed 7), weights drawn in ``dtype``."""
    hp = tiny_hparams(n_vocab=N_VOCAB, n_layer=n_layer, n_ctx_train=4096)
    return hp, random_weights(hp, seed=7, dtype=dtype)


def make(flavour: Flavour, n_layer: int = 2, **kwargs):
    """A Context of the tiny Llama (``n_ctx = n_batch = n_ubatch = 256`` unless told)."""
    hp, w = llama_model(n_layer, flavour.dtype)
    kwargs = dict(dict(n_ctx=256, n_batch=256, n_ubatch=256), **kwargs)
    return flavour.make(hp, w, **kwargs)


def alone(flavour: Flavour, tokens, n_layer: int = 2, pos0: int = 0) -> np.ndarray:
    """Logits of every token of one sequence decoded alone, in one batch, from ``pos0``."""
    ctx = make(flavour, n_layer)
    n = len(tokens)
    assert ctx.decode(Batch(token=list(tokens), pos=list(range(pos0, pos0 + n)),
                            logits=[True] * n)) == 0
    return ctx.get_logits().copy()  # (n_tokens, n_vocab)


def fresh_cache(flavour: Flavour, cells: list[tuple[int, int]]):
    """A one-layer Context whose sequence 0 holds exactly ``cells`` = (token, pos) pairs.

    Decode can only append contiguous positions, so each contiguous run is decoded as
    sequence 1 (an empty sequence may start anywhere), copied to 0 and removed from 1.
    """
    ctx = make(flavour, n_layer=1, n_seq_max=2)
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


def apply_op(cells: list[tuple[int, int]], op: tuple) -> list[tuple[int, int]]:
    """A memory op on a list of (token, pos) cells of one sequence, from llama.h's definitions
    (``seq_rm`` / ``seq_add`` / ``seq_div`` over [p0, p1); ``shift`` is a context shift)."""
    name, p0, p1, x = op
    if name == "shift":  # n_keep = p0, n_discard = p1
        cells = apply_op(cells, ("seq_rm", p0, p0 + p1, 0))
        return apply_op(cells, ("seq_add", p0 + p1, -1, -p1))
    lo, hi = max(p0, 0), (10**9 if p1 < 0 else p1)
    out = []
    for t, p in cells:
        if lo <= p < hi:
            if name == "seq_rm":
                continue
            p = p + x if name == "seq_add" else p // x
            if p < 0:
                continue
        out.append((t, p))
    return out


def apply_ops(ctx, ops, seq_id: int = 0) -> None:
    """The ops of :func:`apply_op` on sequence ``seq_id`` of a Context."""
    for name, a, b, x in ops:
        if name == "shift":
            context_shift(ctx, seq_id, a, b)
        elif name == "seq_rm":
            ctx.memory.seq_rm(seq_id, a, b)
        else:
            getattr(ctx.memory, name)(seq_id, a, b, x)


def seq_positions(ctx, seq_id: int) -> list[int]:
    """The sorted positions of the cells that hold ``seq_id`` (a KV cache)."""
    return sorted(c.pos[i] for c in ctx.memory.v_cells for i in range(c.size())
                  if c.seq_has(i, seq_id))


# ---- the laws' tiny Mamba and Mamba-2 ----------------------------------------------------------

ARCHS = ("mamba", "mamba2")


@functools.cache
def mamba_model(arch: str, dtype: np.dtype):
    """The tiny Mamba / Mamba-2 of the laws (seed 3), weights drawn in ``dtype``."""
    kw = dict(n_vocab=N_VOCAB, n_embd=16, n_layer=2, d_state=4)
    if arch == "mamba2":
        kw.update(head_dim=8, n_group=2)
    hp = tiny_mamba_hparams(arch, **kw)
    return hp, random_mamba_weights(hp, seed=3, dtype=dtype)


def make_mamba(flavour: Flavour, arch: str, n_ubatch: int = 64, n_seq_max: int = 3, **kwargs):
    hp, w = mamba_model(arch, flavour.dtype)
    return flavour.make(hp, w, n_ctx=256, n_batch=64, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                        **kwargs)


def mamba_alone(flavour: Flavour, arch: str, tokens) -> np.ndarray:
    """Every token's logits of one sequence without a Context: the flavour's own
    ``mamba_forward`` on a ``SimpleRecurrentState``, in one ubatch."""
    hp, w = mamba_model(arch, flavour.dtype)
    if flavour.package == "reference":
        return mamba_reference_logits(w, hp, tokens)  # (n_tokens, n_vocab)
    from accelerated.models.mamba import SimpleRecurrentState, mamba_forward, prepare_weights

    state = SimpleRecurrentState(hp, 1)
    return np.array(mamba_forward(prepare_weights(w), hp, np.asarray(tokens), state.init_batch()))


# ---- decoding ----------------------------------------------------------------------------------


def decode_seq(ctx, tokens, seq: int = 0, start: int | None = None) -> np.ndarray:
    """Decode ``tokens`` for one sequence (positions from ``start``, else from the memory);
    every token's logits."""
    n = len(tokens)
    pos = None if start is None else list(range(start, start + n))
    assert ctx.decode(Batch(token=list(tokens), pos=pos, seq_id=[[seq]] * n,
                            logits=[True] * n)) == 0, ctx.last_error
    return ctx.get_logits().copy()  # (n, n_vocab)


def logits_ith(ctx, i: int) -> np.ndarray:
    """``ctx.get_logits_ith(i)``; where the Context also keeps the logits on a device (the MLX
    twin's ``get_logits_ith_device``), that row is the same, bit for bit."""
    row = ctx.get_logits_ith(i)
    if hasattr(ctx, "get_logits_ith_device"):
        np.testing.assert_array_equal(np.array(ctx.get_logits_ith_device(i)), row)
    return row  # (n_vocab,)


def interleave(seqs: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """The tokens of ``seqs`` interleaved round-robin, and their seq ids."""
    token, seq_id = [], []
    for k in range(max(map(len, seqs))):
        for s, t in enumerate(seqs):
            if k < len(t):
                token.append(t[k])
                seq_id.append([s])
    return token, seq_id


def rows_of(logits: np.ndarray, seq_id: list[list[int]], s: int) -> np.ndarray:
    """The rows of sequence ``s`` in a batch whose every token was an output."""
    return logits[[i for i, x in enumerate(seq_id) if x == [s]]]


# ---- snapshots ---------------------------------------------------------------------------------


def cells_of(ctx):
    """The bookkeeping of the memory: a KV cache's cells (positions, sequence sets, pending
    shifts) and heads of every stream, or a recurrent memory's cells and counters."""
    mem = ctx.memory
    if hasattr(mem, "v_cells"):  # a KV cache
        return ([(list(c.pos), [c.seq_get_all(i) for i in range(c.size())], list(c.shift))
                 for c in mem.v_cells], list(mem.v_heads))
    return copy.deepcopy(mem.cells), mem.used, mem.head


def snapshot(ctx):
    """Everything a failed decode, memory op or restore must not change, tensors brought back
    as NumPy: the cells (:func:`cells_of`), K/V (or the state rows), the outputs."""
    mem = ctx.memory
    tensors = [*mem.k_l, *mem.v_l] if hasattr(mem, "v_cells") else [*mem.r_l, *mem.s_l]
    outputs = [ctx.get_logits(), ctx._output_ids]
    return cells_of(ctx), [np.array(t, copy=True) for t in tensors + outputs]


def assert_same(a, b) -> None:
    """Bit-identical snapshots."""
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1], strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
