"""Mamba and Mamba-2 with the recurrent memory, through our Context and llama.cpp's.

The tiny random models of :data:`tests.support.scenarios.MAMBA_MODELS` are written as float32
GGUF and run by llama.cpp (:class:`llamaref.llamacpp.LlamaCppContext`, ``n_seq_max = 3``, so three
recurrent cells) and by :class:`reference.context.Context` on the same file. Each scenario of
:func:`tests.support.scenarios.mamba_scenarios` (three sequences interleaved in one batch for
several
``n_ubatch``, then their continuations; ``seq_cp`` and divergence; ``seq_rm`` of a whole
sequence and a refused partial ``seq_rm``; coupled sequences (return code 1); invalid batches
(-1); ``clear``) must give the same return codes, ``seq_rm`` results and position ranges, and
logits with NMSE <= 1e-6.

llama.cpp's own laws are checked too (each sequence of a batch equals it decoded alone), and
the recurrent divergences of ``docs/divergences.md`` are measured: llama.cpp's behaviour is
pinned next to ours, so a test fails when either side changes.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.scenarios import (
    MAMBA_SCENARIOS,
    A,
    B,
    C,
    all_logits,
    compare_observations,
    interleave,
    run,
    tiny_mamba_model,
)
from tests.support.tiny_models import nmse, write_tiny_mamba_gguf

pytest.importorskip("llama_cpp")

from llamaref.llamacpp import LlamaCppContext  # noqa: E402

pytestmark = pytest.mark.oracle

MAX_NMSE = 1e-6
MODELS = ("mamba", "mamba2")
KW = dict(n_ctx=256, n_batch=256, n_ubatch=256, n_seq_max=3)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """The tiny Mamba and Mamba-2 models, written as GGUF."""
    folder = tmp_path_factory.mktemp("oracle_mamba_memory")
    return {m: write_tiny_mamba_gguf(folder / f"{m}.gguf", *tiny_mamba_model(m)) for m in MODELS}


@pytest.fixture(scope="module")
def llamacpp(ggufs):
    """``llamacpp(name)``: the observations of scenario ``name`` on llama.cpp (memoized)."""
    done = {}

    def get(name):
        if name not in done:
            sc = MAMBA_SCENARIOS[name]
            with LlamaCppContext(ggufs[sc.model], **sc.context_kwargs()) as ctx:
                done[name] = run(sc, ctx)
        return done[name]

    return get


def reference_context(ggufs, model, **kwargs):
    """Our float32 Context on the GGUF llama.cpp loads."""
    from reference.context import Context
    from reference.model_loader import load_model

    hp, weights = load_model(ggufs[model])
    return Context(hp, weights, dtype=np.float32, **kwargs)


def llamacpp_alone(path, tokens) -> np.ndarray:
    """llama.cpp's logits of every token of one sequence decoded alone, in one batch."""
    with LlamaCppContext(path, **KW) as ctx:
        assert ctx.decode(all_logits(tokens)) == 0
        return ctx.get_logits()  # (n_tokens, n_vocab)


# ---------------------------------------------------------------------------------------------
# The reference Context against llama.cpp, scenario by scenario


@pytest.mark.parametrize("name", sorted(MAMBA_SCENARIOS))
def test_reference_matches_llamacpp(llamacpp, ggufs, name):
    sc = MAMBA_SCENARIOS[name]
    ours = run(sc, reference_context(ggufs, sc.model, **sc.context_kwargs()))
    assert compare_observations(llamacpp(name), ours, MAX_NMSE) == []


@pytest.mark.parametrize("model", MODELS)
def test_llamacpp_scenarios_show_the_recurrent_rules(llamacpp, model):
    """What the scenarios pin in llama.cpp itself: the refused partial seq_rm, rc 1 for coupled
    sequences, rc -1 for every invalid batch."""
    rm = llamacpp(f"{model}_seq_rm")
    assert [o.value for o in rm if o.value is not None] == [True, False, True, True, True, True]
    assert rm[3].pos == rm[2].pos  # the refused seq_rm changed nothing
    cp = llamacpp(f"{model}_seq_cp")
    assert cp[3].rc == 1 and cp[3].pos == cp[2].pos  # coupled sequences: no split, no change
    inv = llamacpp(f"{model}_invalid")
    assert [o.rc for o in inv] == [0, -1, -1, -1, -1, -1, -1, 0]
    assert all(o.pos == inv[0].pos for o in inv[1:-1])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("n_ubatch", [256, 2, 1])
def test_llamacpp_each_sequence_equals_it_decoded_alone(llamacpp, ggufs, model, n_ubatch):
    """llama.cpp's own law, which the reference is held to in tests/laws/test_decode.py."""
    from tests.support.scenarios import A2, B2, C2

    obs = llamacpp(f"{model}_multi_seq_ub{n_ubatch}")
    for s, (prompt, cont) in enumerate([(A, A2), (B, B2), (C, C2)]):
        alone = llamacpp_alone(ggufs[model], prompt + cont)
        first = [i for i, ids in enumerate(obs[0].step.seq_id) if ids == (s,)]
        second = [i for i, ids in enumerate(obs[1].step.seq_id) if ids == (s,)]
        got = np.concatenate([obs[0].logits[first], obs[1].logits[second]])
        assert nmse(alone, got) <= MAX_NMSE


# ---------------------------------------------------------------------------------------------
# The recurrent divergences (docs/divergences.md), measured


@pytest.mark.parametrize("model", MODELS)
def test_seq_rm_of_every_sequence_divergence(ggufs, model):
    """Row 15: llama.cpp's ``seq_rm(-1, ...)`` returns False and changes nothing; ours
    empties the memory for the whole range and is a no-op for an empty range."""
    batch = interleave([A, B])
    with LlamaCppContext(ggufs[model], **KW) as ll:
        assert ll.decode(batch) == 0
        assert ll.seq_rm(-1, -1, -1) is False
        assert ll.seq_rm(-1, 0, 0) is False
        assert [ll.seq_pos_max(s) for s in range(3)] == [8, 6, -1]
    ours = reference_context(ggufs, model, **KW)
    assert run_batch(ours, batch) == 0
    assert ours.memory.seq_rm(-1, 0, 0) is True
    assert [ours.memory.seq_pos_max(s) for s in range(3)] == [8, 6, -1]
    assert ours.memory.seq_rm(-1, -1, -1) is True
    assert [ours.memory.seq_pos_max(s) for s in range(3)] == [-1, -1, -1]


@pytest.mark.parametrize("model", MODELS)
def test_seq_add_below_zero_divergence(ggufs, model):
    """Row 16: after ``seq_add`` moves the state below position 0, llama.cpp reports
    ``seq_pos_max == -1`` but keeps the cell (``seq_pos_min`` is negative, ``seq_rm(s, -1,
    -1)`` says True and leaves it), and a token at position 0 continues the old state: its
    logits are those of the prompt's continuation, not of a fresh start. Ours frees the cell:
    the token starts from zeros."""
    tok = (5,)
    with LlamaCppContext(ggufs[model], **KW) as ll:
        assert ll.decode(all_logits(A)) == 0
        ll.seq_add(0, 0, -1, -100)
        assert (ll.seq_pos_min(0), ll.seq_pos_max(0)) == (len(A) - 1 - 100, -1)
        assert ll.seq_rm(0, -1, -1) is True
        assert ll.seq_pos_min(0) == len(A) - 1 - 100  # still there
        assert ll.decode(all_logits(tok, pos=(0,))) == 0
        ll_after = ll.get_logits()
        ll.clear()
        assert ll.decode(all_logits(A + tok)) == 0
        continued = ll.get_logits()[-1:]
        ll.clear()
        assert ll.decode(all_logits(tok)) == 0
        fresh = ll.get_logits()
    assert nmse(continued, ll_after) <= MAX_NMSE  # llama.cpp continued the old state
    assert nmse(fresh, ll_after) > 1e-3  # ... which is not a fresh start
    ours = reference_context(ggufs, model, **KW)
    assert run_batch(ours, all_logits(A)) == 0
    ours.memory.seq_add(0, 0, -1, -100)
    assert (ours.memory.seq_pos_min(0), ours.memory.seq_pos_max(0)) == (-1, -1)
    assert run_batch(ours, all_logits(tok, pos=(0,))) == 0
    assert nmse(fresh, ours.get_logits()) <= MAX_NMSE


@pytest.mark.parametrize("model", MODELS)
def test_failed_restore_divergence(ggufs, model):
    """Row 17: a truncated blob is refused by both, but llama.cpp has already removed the
    destination sequence (or cleared the whole memory); ours changes nothing."""
    from reference.memory.state import StateError

    batch = interleave([A, B])
    with LlamaCppContext(ggufs[model], **KW) as ll:
        assert ll.decode(batch) == 0
        blob = ll.state_seq_get_data(0)
        assert ll.state_seq_set_data(blob[: len(blob) // 2], 1) == 0
        assert [ll.seq_pos_max(s) for s in range(3)] == [8, -1, -1]  # seq 1 is gone
        whole = ll.state_get_data()
        assert ll.state_set_data(whole[: len(whole) // 2]) == 0
        assert [ll.seq_pos_max(s) for s in range(3)] == [-1, -1, -1]  # everything is gone
    ours = reference_context(ggufs, model, **KW)
    assert run_batch(ours, batch) == 0
    before = [ours.memory.seq_pos_max(s) for s in range(3)]
    blob = ours.state_seq_get_data(0)
    with pytest.raises(StateError):
        ours.state_seq_set_data(blob[: len(blob) // 2], 1)
    whole = ours.state_get_data()
    with pytest.raises(StateError):
        ours.state_set_data(whole[: len(whole) // 2])
    assert [ours.memory.seq_pos_max(s) for s in range(3)] == before == [8, 6, -1]


@pytest.mark.parametrize("model", MODELS)
def test_abort_divergence(ggufs, model):
    """An aborted ubatch of a sequence that goes on: llama.cpp's ``seq_rm(s, pos_min, -1)`` is
    a partial removal, refused by the recurrent memory, so the cell keeps the ubatch's last
    position over the state from before it (the next tokens continue *that* state at the new
    positions). Ours restores the cell and rows: the sequence is where it was."""
    cont = all_logits(B, pos=range(len(A), len(A) + len(B)))
    late = all_logits(C, pos=range(len(A) + len(B), len(A) + len(B) + len(C)))
    with LlamaCppContext(ggufs[model], **KW) as ll:
        assert ll.decode(all_logits(A)) == 0
        ll.set_abort_callback(lambda: True)
        assert ll.decode(cont) == 2
        assert ll.seq_pos_max(0) == len(A) + len(B) - 1  # as if B had been absorbed
        ll.set_abort_callback(None)
        assert ll.decode(late) == 0
        ll_late = ll.get_logits()
        ll.clear()
        assert ll.decode(all_logits(A + C)) == 0
        skipped = ll.get_logits()[-len(C):]
    assert nmse(skipped, ll_late) <= MAX_NMSE  # the state never saw B

    calls = []
    ours = reference_context(ggufs, model, **KW)
    assert run_batch(ours, all_logits(A)) == 0
    ours.abort_callback = lambda: calls.append(1) or True
    assert run_batch(ours, cont) == 2
    assert ours.memory.seq_pos_max(0) == len(A) - 1  # the ubatch is gone
    ours.abort_callback = None
    assert run_batch(ours, late) == -1  # B was not absorbed: C cannot start after it
    assert run_batch(ours, all_logits(C, pos=range(len(A), len(A) + len(C)))) == 0
    assert nmse(skipped, ours.get_logits()) <= MAX_NMSE


def run_batch(ctx, step) -> int:
    """Decode a :class:`tests.support.scenarios.Decode` on our Context."""
    from tests.support.scenarios import _batch_for

    return ctx.decode(_batch_for(ctx, step))
