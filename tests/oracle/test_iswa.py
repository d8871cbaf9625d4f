"""The iSWA memory against llama.cpp's own (low-level API): tiny random float32 Gemma models.

The scripted scenarios of :mod:`tests.support.scenarios` run on
:class:`llamaref.llamacpp.LlamaCppContext` and on :class:`reference.context.Context` with a
Gemma 2 (SWA and full layers 1:1) or Gemma 3 (5:1, another RoPE base on the SWA layers) model
whose window is 4: every return code, every ``seq_rm`` result, every ``(seq_pos_min,
seq_pos_max)`` after every step and the logits of every decode (NMSE <= 1e-6) agree. With
``swa_full = False`` the SWA cache has 256 cells, so the scenarios that go past 256 positions
make both memories reuse the cells the window hides, and ``seq_pos_min`` (which llama.cpp
reads from the SWA cache) shows that they forget the same positions.

The extended state API is held to llama.cpp's behaviour too: a ``PARTIAL_ONLY`` checkpoint
restored onto the sequence after a rewind continues as llama.cpp's does. (The bytes differ:
the formats are not compatible, ``reference/memory/state.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest

from reference.batch import Batch
from reference.context import Context
from reference.model_loader import load_model
from reference.testing import random_gemma_weights, tiny_gemma_hparams, write_tiny_gguf
from tests.support.scenarios import (
    ContextShift,
    Decode,
    Scenario,
    SeqAdd,
    SeqCp,
    SeqKeep,
    SeqRm,
    all_logits,
    compare_observations,
    interleave,
    run,
    toks,
)
from tests.support.tiny_models import nmse

pytest.importorskip("llama_cpp")

from llamaref.llamacpp import LlamaCppContext  # noqa: E402

MAX_NMSE = 1e-6
N_SWA = 4
GEMMA_MODELS = {  # name -> tiny_gemma_hparams arguments (random_gemma_weights seed 1)
    "gemma2": dict(arch="gemma2", n_vocab=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2,
                   n_ff=48, n_swa=N_SWA),
    "gemma3": dict(arch="gemma3", n_vocab=64, n_embd=32, n_layer=6, n_head=4, n_head_kv=2,
                   n_ff=48, n_swa=N_SWA),
}


def long(seed: int, n: int, chunk: int, start: int = 0, seq: int = 0) -> tuple[Decode, ...]:
    """``n`` seeded tokens of one sequence from ``start``, in batches of ``chunk``, every
    token an output."""
    tokens = toks(seed, n)
    return tuple(all_logits(tokens[i:i + chunk], range(start + i, start + i + len(
        tokens[i:i + chunk])), seq) for i in range(0, n, chunk))


def interleaved(seed: int, n_seqs: int, n: int, chunk: int) -> tuple[Decode, ...]:
    """``n_seqs`` sequences of ``n`` tokens, interleaved, ``chunk`` tokens of each per batch."""
    seqs = [toks(seed + s, n) for s in range(n_seqs)]
    return tuple(interleave([t[i:i + chunk] for t in seqs], [i] * n_seqs)
                 for i in range(0, n, chunk))


ISWA_SCENARIOS = {sc.name: sc for sc in [
    # one sequence past the SWA cache's 256 cells: reuse, then a rewind and a new branch
    Scenario("long_reuse", (*long(1, 300, 60), SeqRm(0, 290, -1),
                            all_logits(toks(2, 7), range(290, 297))),
             model="gemma2", n_ctx=512, n_batch=64, n_ubatch=16, swa_full=False),
    # three sequences past 256 cells together; seq_cp shares cells that can no longer be
    # reused, seq_keep frees them again (then one ubatch per batch: see the divergence below)
    Scenario("multi_seq_reuse", (*interleaved(3, 3, 96, 24), SeqRm(2, -1, -1),
                                 SeqCp(0, 2, -1, -1),
                                 interleave([toks(7, 5), toks(8, 5), toks(9, 5)], [96, 96, 96]),
                                 SeqKeep(2), *long(10, 40, 16, start=101, seq=2)),
             model="gemma2", n_ctx=512, n_batch=128, n_ubatch=16, n_seq_max=3,
             swa_full=False),
    # one stream per sequence, each past its SWA stream's 256 cells
    Scenario("streams_reuse", interleaved(11, 2, 280, 40),
             model="gemma2", n_ctx=1024, n_batch=128, n_ubatch=16, n_seq_max=2,
             kv_unified=False, swa_full=False),
    # the base cache is full: rc 1, nothing changed, and the decode goes on
    Scenario("base_full", (*long(12, 250, 125), all_logits(toks(13, 10)),
                           all_logits(toks(14, 6))),
             model="gemma2", n_ctx=256, n_batch=256, n_ubatch=16, swa_full=False),
    # equal sizes (swa_full): the context shift and seq_add re-rope both caches
    Scenario("context_shift", (*long(15, 40, 40), ContextShift(0, 4, 10),
                               all_logits(toks(16, 5)), SeqAdd(0, 10, -1, 3),
                               all_logits(toks(17, 3))),
             model="gemma2", n_ctx=256, n_batch=256, n_ubatch=8, swa_full=True),
    # Gemma 3: five SWA layers per full one, the SWA layers with another RoPE base
    Scenario("gemma3_reuse", (*long(18, 280, 70), all_logits(toks(19, 4))),
             model="gemma3", n_ctx=512, n_batch=128, n_ubatch=16, swa_full=False),
    Scenario("gemma3_context_shift", (*long(20, 30, 30), ContextShift(0, 2, 8),
                                      all_logits(toks(21, 4))),
             model="gemma3", n_ctx=256, n_batch=256, n_ubatch=8, swa_full=True),
]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``name -> (gguf path, hparams, weights)``, the weights as our loader reads them back."""
    folder = tmp_path_factory.mktemp("oracle_iswa")
    out = {}
    for name, kw in GEMMA_MODELS.items():
        hp = tiny_gemma_hparams(**kw)
        path = write_tiny_gguf(folder / f"{name}.gguf", hp, random_gemma_weights(hp, seed=1))
        hp_file, weights = load_model(path)
        assert hp_file.is_swa_any() and not hp_file.is_swa_all()
        out[name] = (path, hp_file, weights)
    return out


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(ISWA_SCENARIOS))
def test_reference_equals_llamacpp(models, name):
    sc = ISWA_SCENARIOS[name]
    path, hp, weights = models[sc.model]
    with LlamaCppContext(path, **sc.context_kwargs()) as ll:
        theirs = run(sc, ll)
    ours = run(sc, Context(hp, weights, **sc.context_kwargs()))
    problems = compare_observations(theirs, ours, MAX_NMSE)
    assert not problems, "\n".join(problems[:5])


def test_the_scenarios_reach_what_they_are_for(models):
    """The observations show what each scenario is for: reuse (``seq_pos_min`` above 0 with
    nothing removed), an rc 1, a moved sequence."""
    def observe(name):
        sc = ISWA_SCENARIOS[name]
        _, hp, weights = models[sc.model]
        return run(sc, Context(hp, weights, **sc.context_kwargs()))

    assert observe("long_reuse")[4].pos[0][0] > 0  # 300 positions, 256 SWA cells
    assert observe("streams_reuse")[-1].pos == ((24, 279), (24, 279))
    assert [o.rc for o in observe("base_full") if o.rc is not None] == [0, 0, 1, 0]
    assert observe("context_shift")[1].pos == ((0, 29),)
    assert observe("gemma3_reuse")[-1].pos[0][0] > 0


# ---- a divergence: llama.cpp's prepare leaks the SWA purge of the ubatches it tries ------------


@pytest.mark.oracle
def test_llamacpp_prepare_leaks_the_swa_purge_divergence(models):
    """A batch of several ubatches that reuses SWA cells near the window of its first ubatch.

    ``llama_kv_cache::prepare`` places every ubatch (``apply_ubatch``) to find the next one's
    slot, then restores only the cells of the slots. When a later ubatch reuses a cell,
    ``apply_ubatch`` also removes the sequence's positions up to the overwritten one
    (``seq_rm``), and that removal is not undone: when the first ubatch is then computed,
    positions its window needs are gone. Here, after ``seq_keep``, the head sits before the
    sequence's old cells, the second ubatch of 16 reuses cells up to position 28, and the
    first ubatch's token at 29 loses 26..28. llama.cpp's logits then depend on
    ``n_ubatch`` (the law "batched == unbatched" breaks); ours (``KVCache.prepare`` restores
    everything) are those of one ubatch, which llama.cpp also gives.
    """
    path, hp, weights = models["gemma2"]
    steps = (*interleaved(3, 3, 24, 24), SeqRm(2, -1, -1), SeqCp(0, 2, -1, -1),
             interleave([toks(7, 5), toks(8, 5), toks(9, 5)], [24] * 3), SeqKeep(2),
             all_logits(toks(10, 40), range(29, 69), 2))

    def last_logits(ctx, n_ubatch):
        sc = Scenario("purge", steps, model="gemma2", n_ctx=512, n_batch=128, n_ubatch=n_ubatch,
                      n_seq_max=3, swa_full=False)
        if ctx is None:
            with LlamaCppContext(path, **sc.context_kwargs()) as ll:
                return run(sc, ll)[-1].logits
        return run(sc, ctx(hp, weights, **sc.context_kwargs()))[-1].logits

    theirs_one, theirs_many = last_logits(None, 128), last_logits(None, 16)
    ours_one, ours_many = last_logits(Context, 128), last_logits(Context, 16)
    assert nmse(theirs_one, ours_one) <= MAX_NMSE  # one ubatch: no purge to leak
    assert nmse(theirs_one, ours_many) <= MAX_NMSE  # ours: the same with 16
    assert nmse(theirs_one[:1], theirs_many[:1]) > 1e-4  # llama.cpp's token at 29 lost 26..28


# ---- the extended state API: a partial checkpoint, as a server keeps one -----------------------


@pytest.mark.oracle
@pytest.mark.parametrize("n_prompt", [20, 270])
def test_partial_checkpoint_equals_llamacpp(models, n_prompt):
    """Prompt, ``PARTIAL_ONLY`` checkpoint, a detour, rewind both caches, restore, continue:
    the same positions and logits as llama.cpp (past 256 positions the detour overwrote the
    checkpoint's SWA cells)."""
    path, hp, weights = models["gemma2"]
    kw = dict(n_ctx=1024, n_batch=128, n_ubatch=16, swa_full=False)
    prompt, detour, tail = toks(30, n_prompt), toks(31, 260), toks(32, 5)
    results = []
    with LlamaCppContext(path, **kw) as ll:
        for ctx in (ll, Context(hp, weights, **kw)):  # the same extended state API
            for i in range(0, n_prompt, 100):
                assert ctx.decode(Batch(token=list(prompt[i:i + 100]))) == 0
            blob = ctx.state_seq_get_data_ext(0, 1)  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
            for i in range(0, len(detour), 100):
                assert ctx.decode(Batch(token=list(detour[i:i + 100]))) == 0
            assert ctx.memory.seq_rm(0, n_prompt, -1)
            assert ctx.state_seq_set_data_ext(blob, 0, 1) == len(blob)
            pos = (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0))
            assert ctx.decode(Batch(token=list(tail), logits=[True] * len(tail))) == 0
            results.append((pos, np.array(ctx.get_logits(), dtype=np.float32)))
    (pos_ll, logits_ll), (pos_ours, logits_ours) = results
    assert pos_ll == pos_ours == (n_prompt - N_SWA, n_prompt - 1)
    assert nmse(logits_ll, logits_ours) <= MAX_NMSE
