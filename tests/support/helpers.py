"""What the law files share: the Context flavours, the models, snapshots, verdicts.

A law is written once and runs on every **flavour** of the Context (``@every_flavour``) and
on every **model** that has what it needs (``@for_models(...)``), one pytest case each
(``test_law[mlx-iswa]``), the way llama.cpp's test-backend-ops runs a case on every backend
whose ``supports_op`` says yes:

| flavour | Context | dtype | a law's verdict (two results of this flavour) |
|---|---|---|---|
| ``ref-f64`` | ``reference.context.Context`` | float64 | max error <= 1e-10 (rounding only) |
| ``ref-f32`` | ``reference.context.Context`` | float32 | NMSE <= ``MAX_NMSE_SELF_F32`` = 1e-10 |
| ``mlx`` | ``accelerated.context.Context`` | float32 | NMSE <= ``MAX_NMSE_SELF_F32`` = 1e-10 |

| model | memory | capabilities |
|---|---|---|
| ``llama`` | ``KVCache`` | cells, partial ``seq_rm``, K-shift, streams, embeddings |
| ``iswa`` | ``KVCacheISWA`` (window on some layers) | the same, and SWA |
| ``mamba``, ``mamba2`` | ``RecurrentMemory`` | recurrent |
| ``qwen3moe`` | ``KVCache`` | as ``llama`` (Qwen3's Q/K norms; 4 experts, 2 per token) |

A twin flavour names the reference flavour it is held to (``mlx`` -> ``ref-f32``): where a
law decodes a scenario on the twin, :func:`assert_twins_agree` decodes it on the reference
too and the two agree to NMSE <= ``MAX_NMSE_TWIN`` (1e-6, float32 end to end).

A model lacking a capability a law needs gets no case: it is left out when the
parametrization is built, not skipped when the case runs (CI counts a skip as a failure,
``tests/conftest.py``); :func:`for_models` names the capabilities in the law's source.

The models' tiny weights are seeded and drawn in the flavour's dtype: a tiny Llama
(:func:`make`, :func:`alone`, :func:`fresh_cache`), the same with a window on some layers
(:func:`iswa_model`), tiny Mamba / Mamba-2 (:func:`make_mamba`, :func:`mamba_alone`).
:func:`snapshot` / :func:`assert_same`: everything a failed operation must not change, bit
for bit, on either twin and every memory. :func:`deep`: the hypothesis settings of the
stateful machines and the state laws (the ``ci-deep`` profile in CI).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from accelerated.context import Context as MLXContext
from reference.batch import Batch
from reference.common import MAX_NMSE_SELF_F32, MAX_NMSE_TWIN
from reference.context import Context as RefContext
from reference.context import context_shift
from reference.hparams import swa_pattern
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
    when ``HYPOTHESIS_PROFILE=ci`` (more examples, still derandomized), ``mutation-deep``
    when it is ``mutation``, else the loaded profile (``dev``, ``thorough``); ``kwargs``
    override either."""
    profile = os.environ.get("HYPOTHESIS_PROFILE")
    if profile in ("ci", "mutation"):
        return settings(settings.get_profile(f"{profile}-deep"), **kwargs)
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


def fresh_cache(flavour: Flavour, cells: list[tuple[int, int]], model=None, variant=None):
    """A one-layer Context whose sequence 0 holds exactly ``cells`` = (token, pos) pairs: of
    the tiny Llama, or of ``model``'s one-layer ``variant``.

    Decode can only append contiguous positions, so each contiguous run is decoded as
    sequence 1 (an empty sequence may start anywhere), copied to 0 and removed from 1.
    """
    if model is None:
        ctx = make(flavour, n_layer=1, n_seq_max=2)
    else:
        ctx = model.make(flavour, variant, n_seq_max=2)
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
    """The sorted positions of the cells that hold ``seq_id`` (a KV cache; of an iSWA memory,
    its base cache, which keeps every position)."""
    cache = kv_caches(ctx.memory)[0]
    return sorted(c.pos[i] for c in cache.v_cells for i in range(c.size())
                  if c.seq_has(i, seq_id))


# ---- the laws' tiny Mamba and Mamba-2 ----------------------------------------------------------

ARCHS = ("mamba", "mamba2")


@functools.cache
def mamba_model(arch: str, dtype: np.dtype, n_layer: int = 2):
    """The tiny Mamba / Mamba-2 of the laws (seed 3), weights drawn in ``dtype``."""
    kw = dict(n_vocab=N_VOCAB, n_embd=16, n_layer=n_layer, d_state=4)
    if arch == "mamba2":
        kw.update(head_dim=8, n_group=2)
    hp = tiny_mamba_hparams(arch, **kw)
    return hp, random_mamba_weights(hp, seed=3, dtype=dtype)


def make_mamba(flavour: Flavour, arch: str, n_ubatch: int = 64, n_seq_max: int = 3, **kwargs):
    hp, w = mamba_model(arch, flavour.dtype)
    return flavour.make(hp, w, n_ctx=256, n_batch=64, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                        **kwargs)


def mamba_alone(flavour: Flavour, arch: str, tokens, n_layer: int = 2) -> np.ndarray:
    """Every token's logits of one sequence without a Context: the flavour's own
    ``mamba_forward`` on a ``SimpleRecurrentState``, in one ubatch."""
    hp, w = mamba_model(arch, flavour.dtype, n_layer)
    if flavour.package == "reference":
        return mamba_reference_logits(w, hp, tokens)  # (n_tokens, n_vocab)
    from accelerated.models.mamba import SimpleRecurrentState, mamba_forward, prepare_weights

    state = SimpleRecurrentState(hp, 1)
    return np.array(mamba_forward(prepare_weights(w), hp, np.asarray(tokens), state.init_batch()))


# ---- the laws' tiny iSWA model -----------------------------------------------------------------

#: (n_layer, n_pattern) of ``swa_pattern``: Gemma 2's 1:1, Gemma 3's 5:1, every layer SWA, and
#: one SWA layer alone (a cell's K and V depend only on its token and position)
PATTERNS = {"1:1": (2, 2), "5:1": (6, 6), "all": (2, 0), "one": (1, 0)}


@functools.cache
def iswa_model(pattern: str, n_swa: int, dtype: np.dtype = REF_F64.dtype):
    """A tiny llama-arch model (seed 11) with window ``n_swa`` on the layers of ``pattern``
    (a key of :data:`PATTERNS`), weights drawn in ``dtype``."""
    n_layer, n_pattern = PATTERNS[pattern]
    hp = dataclasses.replace(
        tiny_hparams(n_vocab=N_VOCAB, n_layer=n_layer, n_swa=n_swa, n_ctx_train=4096),
        swa_layers=swa_pattern(n_layer, n_pattern))
    return hp, random_weights(hp, seed=11, dtype=dtype)


# ---- the models: the architecture axis ---------------------------------------------------------

#: a KV cache: a cell per token position, so a decode can find no slot (rc 1); a recurrent
#: memory has a cell per sequence and always has room
CELLS = "cells"
#: ``seq_rm`` of part of a sequence returns True (a recurrent state cannot forget its last tokens)
PARTIAL_SEQ_RM = "partial_seq_rm"
#: ``memory.can_shift()`` and keys turned by the K-shift: ``seq_add`` / ``seq_div`` / a context
#: shift change what attention sees (a recurrent memory can shift, but has no key to turn)
K_SHIFT = "k_shift"
#: ``kv_unified=False`` gives each sequence a stream of its own
STREAMS = "streams"
#: a sliding window on some layers (the iSWA pair): a sequence's state keeps only its window
SWA = "swa"
#: a recurrent state: ubatches from ``split_equal(sequential=True)``, one cell per sequence
RECURRENT = "recurrent"
#: decodes a batch of embeddings (``Batch(embd=...)``) as the batch of their tokens
EMBD = "embd"


@dataclass(frozen=True, eq=False, repr=False)
class Model:
    """One architecture a law runs on, with the capabilities of its memory.

    Attributes:
        name: the pytest id (``llama``, ``iswa``, ``mamba``, ``mamba2``).
        build: ``(variant, dtype) -> (hparams, weights)``, seeded, cached.
        variants: the hyperparameters a law's hypothesis draws (:meth:`draw`; the iSWA
            pattern and window); the first is the one a law without hypothesis gets.
        capabilities: what the memory can do (:data:`CELLS`, :data:`PARTIAL_SEQ_RM`, ...).
        memory: the class name of the memory the Context builds for the model.
        sizes: the Context's sizes unless a law says otherwise (``n_ctx`` per stream).
        one_layer: the variants with one layer, where a cell's K and V depend only on its
            token and position (the K-shift laws compare against a fresh cache).
        other: a variant of the same architecture whose state blobs the model refuses.
        n_prompt: ``(min, max)`` tokens of every prompt (the iSWA's: longer than the window),
            or None: what each law asks.
        forward: the logits of one sequence without a Context, or None: one batch on a
            fresh Context (:meth:`alone`).
    """

    name: str
    build: Callable[[Any, np.dtype], tuple]
    variants: tuple
    capabilities: frozenset[str]
    memory: str
    sizes: dict = field(default_factory=dict)
    one_layer: tuple = ()
    other: Any = None
    n_prompt: tuple[int, int] | None = None
    forward: Callable | None = None

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        return f"Model({self.name!r})"

    def has(self, *capabilities: str) -> bool:
        """Whether the model has every one of ``capabilities``."""
        return set(capabilities) <= self.capabilities

    def weights(self, dtype: np.dtype, variant=None) -> tuple:
        """``(hparams, weights)`` of ``variant`` (default: the first), weights in ``dtype``."""
        return self.build(self.variants[0] if variant is None else variant, np.dtype(dtype))

    def make(self, flavour: Flavour, variant=None, **kwargs):
        """A Context of ``flavour`` for ``variant``: :attr:`sizes` unless told, ``n_ctx``
        cells per stream (one stream, or one per sequence with ``kv_unified=False``)."""
        hp, w = self.weights(flavour.dtype, variant)
        kwargs = dict(self.sizes, **kwargs)
        if kwargs.get("kv_unified") is False:
            kwargs["n_ctx"] = kwargs["n_ctx"] * kwargs.get("n_seq_max", 1)
        return flavour.make(hp, w, **kwargs)

    def alone(self, flavour: Flavour, tokens, variant=None) -> np.ndarray:
        """The logits of every token of one sequence decoded alone, from position 0: the
        flavour's forward without a Context (:attr:`forward`), else one batch on a fresh
        Context."""
        if self.forward is not None:
            return self.forward(self, flavour, variant, tokens)  # (n_tokens, n_vocab)
        return decode_seq(self.make(flavour, variant), tokens)  # (n_tokens, n_vocab)

    def draw(self, data, one_layer: bool = False):
        """A variant drawn by hypothesis (``data = st.data()``); no draw if there is one."""
        pool = self.one_layer if one_layer else self.variants
        if len(pool) == 1:
            return pool[0]
        return data.draw(st.sampled_from(pool), label=f"{self} variant")

    def prompt_st(self, min_size: int = 1, max_size: int = 6):
        """A strategy for a prompt: ``min_size..max_size`` token ids, or :attr:`n_prompt`."""
        lo, hi = self.n_prompt or (min_size, max_size)
        return st.lists(st.integers(0, N_VOCAB - 1), min_size=lo, max_size=hi)


@functools.cache
def _llama_like(arch: str, n_layer: int, dtype: np.dtype):
    """A tiny model of ``arch`` for the laws (seed 13): a Qwen3-MoE has per-head Q/K norms
    and 4 experts, 2 per token, each 8 wide."""
    experts = dict(n_expert=4, n_expert_used=2, n_ff_exp=8) if arch == "qwen3moe" else {}
    hp = tiny_hparams(arch, n_vocab=N_VOCAB, n_layer=n_layer, n_ctx_train=4096, **experts)
    return hp, random_weights(hp, seed=13, dtype=dtype)


def _mamba_build(arch: str) -> Callable[[int, np.dtype], tuple]:
    """The ``build`` of :func:`mamba_model` for ``arch``: variants are ``n_layer``."""
    return lambda n_layer, dtype: mamba_model(arch, dtype, n_layer)


def _mamba_forward(model: Model, flavour: Flavour, variant, tokens) -> np.ndarray:
    n_layer = model.variants[0] if variant is None else variant
    return mamba_alone(flavour, model.name, tokens, n_layer)


_LLAMA_SIZES = dict(n_ctx=256, n_batch=256, n_ubatch=256)
_KV = frozenset({CELLS, PARTIAL_SEQ_RM, K_SHIFT, STREAMS, EMBD})

LLAMA = Model("llama", llama_model, variants=(2,), capabilities=_KV, memory="KVCache",
              sizes=_LLAMA_SIZES, one_layer=(1,), other=1)
ISWA = Model(
    "iswa", lambda v, dtype: iswa_model(*v, dtype),
    variants=tuple((p, n) for p in ("1:1", "5:1", "all") for n in range(4, 9)),
    capabilities=_KV | {SWA}, memory="KVCacheISWA", sizes=_LLAMA_SIZES,
    one_layer=tuple(("one", n) for n in range(4, 9)), other=("1:1", 5), n_prompt=(9, 14))
MAMBA, MAMBA2 = (
    Model(arch, _mamba_build(arch), variants=(2,), capabilities=frozenset({RECURRENT}),
          memory="RecurrentMemory", sizes=dict(n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=3),
          other=1, forward=_mamba_forward)
    for arch in ARCHS)
MODELS = (LLAMA, ISWA, MAMBA, MAMBA2)
#: Qwen3's per-head Q/K norms and a mixture of experts in one model (qwen3moe's attention is
#: qwen3's): one more model rather than two keeps the laws' time down. The decode laws run
#: on it (``DECODE_MODELS``); the state laws need its foreign model first (``FOREIGN`` in
#: ``tests/laws/test_state.py``)
QWEN3MOE = Model("qwen3moe", functools.partial(_llama_like, "qwen3moe"), variants=(2,),
                 capabilities=_KV, memory="KVCache", sizes=_LLAMA_SIZES, one_layer=(1,), other=1)
DECODE_MODELS = (*MODELS, QWEN3MOE)


def for_models(*needs: str, lacking: tuple[str, ...] = (), models: tuple = MODELS):
    """Parametrize a law over the models that have every capability of ``needs`` and none of
    ``lacking`` (among ``models``), one case each (works under ``@given``). The others get no
    case at all: the
    capability is checked here, when the cases are built, the way test-backend-ops asks
    ``supports_op`` before it builds a case, not by a skip when the case runs.

    >>> [m.name for m in for_models(K_SHIFT).args[1]]
    ['llama', 'iswa']
    >>> [m.name for m in for_models(K_SHIFT, models=DECODE_MODELS).args[1]]
    ['llama', 'iswa', 'qwen3moe']
    >>> [m.name for m in for_models(lacking=(PARTIAL_SEQ_RM,)).args[1]]
    ['mamba', 'mamba2']
    """
    return pytest.mark.parametrize("model", _models(needs, lacking, models), ids=str)


def for_layouts(*needs: str, lacking: tuple[str, ...] = (), models: tuple = MODELS):
    """As :func:`for_models`, over ``(model, kv_unified)``: one unified stream for every
    model, and one stream per sequence for the models with :data:`STREAMS`.

    >>> [f"{m}-{u}" for m, u in for_layouts(K_SHIFT).args[1]][:4]
    ['llama-True', 'llama-False', 'iswa-True', 'iswa-False']
    """
    cases = [(m, u) for m in _models(needs, lacking, models)
             for u in ((True, False) if m.has(STREAMS) else (True,))]
    return pytest.mark.parametrize(("model", "kv_unified"), cases,
                                   ids=[f"{m}-{'unified' if u else 'streams'}" for m, u in cases])


def _models(needs, lacking, pool=MODELS) -> list[Model]:
    models = [m for m in pool if m.has(*needs) and not set(lacking) & m.capabilities]
    assert models, f"no model has {needs} without {lacking}"
    return models


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


def kv_caches(mem) -> list:
    """The KV caches of a memory: the cache itself, the iSWA pair's base and SWA caches (in
    that order), none for a recurrent memory."""
    if hasattr(mem, "caches"):
        return list(mem.caches())
    return [mem] if hasattr(mem, "v_cells") else []


def pending_shift(mem) -> bool:
    """Whether some cache of the memory has a K-shift to apply at the next update."""
    return any(cache.get_has_shift() for cache in kv_caches(mem))


def _cache_cells(cache):
    return ([(list(c.pos), [c.seq_get_all(i) for i in range(c.size())], list(c.shift))
             for c in cache.v_cells], list(cache.v_heads))


def cells_of(ctx):
    """The bookkeeping of the memory: a KV cache's cells (positions, sequence sets, pending
    shifts) and heads of every stream (for an iSWA memory, of both caches), or a recurrent
    memory's cells and counters."""
    mem = ctx.memory
    caches = kv_caches(mem)
    if len(caches) == 1:
        return _cache_cells(caches[0])
    if caches:
        return tuple(_cache_cells(c) for c in caches)
    return copy.deepcopy(mem.cells), mem.used, mem.head


def snapshot(ctx):
    """Everything a failed decode, memory op or restore must not change, tensors brought back
    as NumPy: the cells (:func:`cells_of`), K/V (or the state rows), the outputs."""
    mem = ctx.memory
    caches = kv_caches(mem)
    if caches:
        tensors = [t for c in caches for t in (*c.k_l, *c.v_l)]
    else:
        tensors = [*mem.r_l, *mem.s_l]
    outputs = [ctx.get_logits(), ctx._output_ids]
    return cells_of(ctx), [np.array(t, copy=True) for t in tensors + outputs]


def assert_same(a, b) -> None:
    """Bit-identical snapshots."""
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1], strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
