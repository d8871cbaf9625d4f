"""Speculative decoding (``reference.tools.speculative``): exactness, on both twins.

- greedy speculative (a chain and a tree of 3 branches), and speculative-simple, give
  plain greedy generation token for token, with a draft that is another tiny model of the
  same vocabulary or the target's own first layer;
- Mamba / Mamba-2 roll back a partial acceptance by restoring a saved state;
- the stochastic acceptance step preserves the target distribution: a chi-square test
  over 20,000 seeded runs per configuration, top-k making the candidate sets differ;
  llama.cpp's residual (subtraction by list position) fails the same test (divergence 21).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from reference.batch import Batch
from reference.context import Context
from reference.sampling import Mt19937, SamplerChain, SamplerParams
from reference.testing import random_weights, tiny_hparams
from reference.tools.generate import Generator
from reference.tools.speculative import (
    DraftVocabError,
    Speculative,
    SpeculativeError,
    SpeculativeSimple,
    chain_probs,
    check_draft_vocab,
    draft_layers,
    draw,
    residual,
    residual_llamacpp,
    verify_candidates,
)
from tests.support.helpers import FLAVOURS, MLX, REF_F32, mamba_model

GREEDY = SamplerParams(temp=0.0)
PROMPT = [1, 5, 9, 3, 7, 1, 5]
N_PREDICT = 32
TWINS = [REF_F32, MLX]
twins = pytest.mark.parametrize("flavour", TWINS, ids=str)
every = pytest.mark.parametrize("flavour", FLAVOURS, ids=str)


def target(flavour):
    """A 3-layer tiny Llama (32 tokens), weights in the flavour's dtype."""
    hp = tiny_hparams(n_vocab=32, n_layer=3, n_ctx_train=4096)
    return hp, random_weights(hp, seed=7, dtype=flavour.dtype)


def drafts(flavour):
    """The two drafts: the target's first layer, and another model of the same vocab."""
    hp, w = target(flavour)
    other = tiny_hparams(n_vocab=32, n_layer=1, n_embd=8, n_head=2, n_head_kv=1, n_ff=12,
                         n_ctx_train=4096)
    return {"first-layer": (draft_layers(hp, 1), w),
            "other-model": (other, random_weights(other, seed=11, dtype=flavour.dtype))}


def plain_greedy(flavour, hp, w, prompt, n):
    gen = Generator(flavour.make(hp, w, n_ctx=256), SamplerChain.from_params(GREEDY, 32),
                    shift=False)
    gen.eval_prompt(prompt)
    return list(gen.generate(n, lambda t: False))


# ---- greedy: exactly plain generation ----------------------------------------------------------


@every
@pytest.mark.parametrize("n_seq_dft", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("draft", ["first-layer", "other-model"])
def test_greedy_speculative_is_plain_generation(flavour, n_seq_dft, draft):
    hp, w = target(flavour)
    want = plain_greedy(flavour, hp, w, PROMPT, N_PREDICT)
    d_hp, d_w = drafts(flavour)[draft]
    spec = Speculative(flavour.make(hp, w, n_ctx=256, n_seq_max=n_seq_dft),
                       flavour.make(d_hp, d_w, n_ctx=256, n_seq_max=n_seq_dft), GREEDY,
                       n_draft=5, n_seq_dft=n_seq_dft)
    assert list(spec.generate(PROMPT, N_PREDICT)) == want
    assert spec.stats.n_predict == N_PREDICT
    assert 0 < spec.stats.n_accept < N_PREDICT  # some drafts kept, some rejected
    if n_seq_dft > 1:
        assert spec.n_split > 0  # the tree did branch


@every
@pytest.mark.parametrize("draft", ["first-layer", "other-model"])
def test_speculative_simple_is_plain_generation(flavour, draft):
    hp, w = target(flavour)
    want = plain_greedy(flavour, hp, w, PROMPT, N_PREDICT)
    d_hp, d_w = drafts(flavour)[draft]
    spec = SpeculativeSimple(flavour.make(hp, w, n_ctx=256), flavour.make(d_hp, d_w, n_ctx=256),
                             GREEDY, n_max=5)
    assert list(spec.generate(PROMPT, N_PREDICT)) == want
    assert spec.stats.n_accept > 0 and spec.stats.n_drafted > spec.stats.n_accept


def test_p_min_and_n_min_cut_the_drafts():
    """p_min = 1 drafts nothing; n_min above n_max drops every draft: still plain output."""
    hp, w = target(REF_F32)
    want = plain_greedy(REF_F32, hp, w, PROMPT, 12)
    for kw in (dict(p_min=1.0), dict(n_max=2, n_min=3)):
        spec = SpeculativeSimple(Context(hp, w, n_ctx=256), Context(draft_layers(hp, 1), w,
                                                                    n_ctx=256), GREEDY, **kw)
        assert list(spec.generate(PROMPT, 12)) == want
        assert spec.stats.n_drafted == 0


@twins
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_mamba_rolls_back_by_restoring_a_saved_state(flavour, arch):
    """A recurrent target refuses partial seq_rm: partial acceptances are undone from the
    checkpoint and replayed; the output is still plain greedy generation."""
    hp, w = mamba_model(arch, flavour.dtype)
    want = plain_greedy(flavour, hp, w, PROMPT, N_PREDICT)
    spec = SpeculativeSimple(flavour.make(hp, w, n_ctx=256),
                             flavour.make(draft_layers(hp, 1), w, n_ctx=256), GREEDY, n_max=4)
    assert list(spec.generate(PROMPT, N_PREDICT)) == want
    assert spec.n_restored > 0


def test_stochastic_runs_are_seeded():
    hp, w = target(REF_F32)
    params = SamplerParams(temp=1.0, seed=5, top_k=0, top_p=1.0, min_p=0.0)

    def run(n_seq):
        spec = Speculative(Context(hp, w, n_ctx=256, n_seq_max=n_seq),
                           Context(draft_layers(hp, 1), w, n_ctx=256, n_seq_max=n_seq), params,
                           n_draft=4, n_seq_dft=n_seq)
        return list(spec.generate(PROMPT, 40)), spec.stats
    (a, stats), (b, _) = run(3), run(3)
    assert a == b and len(a) == 40 and 0 < stats.n_accept < stats.n_drafted


# ---- errors, before anything changes -----------------------------------------------------------


def vocab(**kw):
    base = dict(model="gpt2", n_vocab=300, tokens=[f"t{i}" for i in range(300)], add_bos=False,
                bos_id=1, add_eos=False, eos_id=2)
    return SimpleNamespace(**dict(base, **kw))


@pytest.mark.parametrize("kw, message", [
    (dict(model="llama"), "vocabulary type is 'llama'"),
    (dict(add_bos=True), "BOS differs"),
    (dict(n_vocab=100, tokens=[f"t{i}" for i in range(100)]), "difference 200 > 128"),
    (dict(tokens=[f"t{i}" for i in range(299)] + ["x"]), "token 299 is 'x'"),
])
def test_an_incompatible_draft_vocabulary_says_what_to_change(kw, message):
    check_draft_vocab(vocab(), vocab(tokens=["?"] * 5 + vocab().tokens[5:]))  # ids < 5 free
    with pytest.raises(DraftVocabError, match=message) as err:
        check_draft_vocab(vocab(), vocab(**kw))
    assert "--draft-layers" in str(err.value)


def test_bad_contexts_are_refused():
    hp, w = target(REF_F32)
    mh, mw = mamba_model("mamba", np.dtype(np.float32))
    with pytest.raises(SpeculativeError, match="recurrent"):
        Speculative(Context(mh, mw), Context(mh, mw), GREEDY)
    with pytest.raises(SpeculativeError, match="n_seq_max >= 3"):
        Speculative(Context(hp, w), Context(hp, w), GREEDY, n_seq_dft=3)
    with pytest.raises(SpeculativeError, match="unified"):
        Speculative(Context(hp, w, n_seq_max=2, kv_unified=False),
                    Context(hp, w, n_seq_max=2), GREEDY, n_seq_dft=2)
    with pytest.raises(SpeculativeError, match="draft-layers 0"):
        draft_layers(hp, 0)
    with pytest.raises(SpeculativeError, match="prompt too long"):
        list(Speculative(Context(hp, w, n_ctx=256), Context(hp, w, n_ctx=256),
                         GREEDY).generate([1] * 253))


# ---- stochastic acceptance: the target's distribution, exactly ---------------------------------


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x): the regularized upper incomplete gamma Q(df/2, x/2)."""
    a, z = df / 2.0, x / 2.0
    if z < a + 1:  # series for P
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= z / (a + n)
            total += term
        return 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a))
    b, c, d = z + 1 - a, 1e300, 1.0 / (z + 1 - a)  # continued fraction for Q
    h = d
    for n in range(1, 1000):
        an = -n * (n - a)
        b += 2
        d = 1.0 / (an * d + b)
        c = b + an / c
        h *= d * c
    return h * math.exp(-z + a * math.log(z) - math.lgamma(a))


def chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    """Pearson's test of ``counts`` against ``p``; bins expecting < 5 are pooled."""
    n = counts.sum()
    assert counts[p == 0].sum() == 0, "a token the target gives probability 0"
    small = (p > 0) & (p * n < 5)
    obs = np.append(counts[(p * n >= 5)], counts[small].sum())
    exp = np.append(p[(p * n >= 5)] * n, p[small].sum() * n)
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def logits_pair():
    """The target's and the draft's logits after the same prompt (a tiny model and its
    first layer): two different, realistic distributions over 32 tokens."""
    hp, w = target(REF_F32)
    rows = []
    for h in (hp, draft_layers(hp, 1)):
        ctx = Context(h, w, n_ctx=256)
        ctx.decode_token(1)
        assert ctx.decode(Batch(token=PROMPT[1:])) == 0
        rows.append(ctx.get_logits_ith(-1).copy())
    return rows


def dists(top_k_tgt: int, top_k_dft: int):
    """``p`` and ``q`` as the two chains end with them (temperature 1, top-k)."""
    z_tgt, z_dft = logits_pair()
    out = []
    for z, k in ((z_tgt, top_k_tgt), (z_dft, top_k_dft)):
        chain = SamplerChain.from_params(SamplerParams(seed=0, temp=1.0, top_k=k, top_p=1.0,
                                                       min_p=0.0), 32)
        out.append(chain_probs(chain, z)[1])
    return out


#: (target top-k, draft top-k, candidates per position): full vocabulary, sets that differ
#: both ways, and a tree of 3 candidates
CONFIGS = [(0, 0, 1), (5, 8, 1), (8, 3, 1), (4, 6, 3)]
N_RUNS = 20_000
ALPHA = 1e-3  # fixed seeds: each verdict is deterministic


def sample_outputs(p, q, m: int, seed: int, rule) -> np.ndarray:
    rng = Mt19937(seed)
    counts = np.zeros(p.size, np.int64)
    for _ in range(N_RUNS):
        cands = [(draw(q, rng), q) for _ in range(m)]
        counts[rule(p, cands, rng)[1]] += 1
    return counts


@pytest.mark.parametrize("top_k_tgt, top_k_dft, m", CONFIGS)
def test_stochastic_acceptance_preserves_the_target_distribution(top_k_tgt, top_k_dft, m):
    p, q = dists(top_k_tgt, top_k_dft)
    if top_k_tgt != top_k_dft:
        assert set(np.flatnonzero(p)) != set(np.flatnonzero(q))  # the sets differ
    counts = sample_outputs(p, q, m, seed=1234 + top_k_tgt, rule=verify_candidates)
    assert chi2_pvalue(counts, p) > ALPHA


def verify_llamacpp(p, cands, rng):
    """llama.cpp's step for one candidate: ``r <= p/q``, else its residual."""
    (token, q), = cands
    if rng.uniform_double() * q[token] <= p[token]:
        return 0, token
    ids_p, ids_q = np.flatnonzero(p), np.flatnonzero(q)
    r = residual_llamacpp(ids_p, p[ids_p], ids_q, q[ids_q])
    dense = np.zeros(p.size)
    dense[: r.size] = r
    return -1, draw(dense, rng)


def llamacpp_output_distribution(p, q) -> np.ndarray:
    """Exactly: min(p, q) accepted, plus (1 - beta) times llama.cpp's residual."""
    ids_p, ids_q = np.flatnonzero(p), np.flatnonzero(q)
    r = np.zeros(p.size)
    rr = residual_llamacpp(ids_p, p[ids_p], ids_q, q[ids_q])
    r[: rr.size] = rr
    accept = np.minimum(p, q)
    return accept + (1.0 - accept.sum()) * r


def test_llamacpp_residual_is_biased_exactly_when_candidate_sets_differ():
    """Divergence 21: subtracting by list position after sorting by id."""
    p, q = dists(0, 0)  # the same candidates: llama.cpp's residual is right
    ids = np.arange(32)
    np.testing.assert_allclose(residual_llamacpp(ids, p, ids, q), residual(p, q), atol=1e-12)
    np.testing.assert_allclose(llamacpp_output_distribution(p, q), p, atol=1e-12)
    p, q = dists(5, 8)  # top-k: different sets
    biased = llamacpp_output_distribution(p, q)
    tv = 0.5 * np.abs(biased - p).sum()
    assert tv > 0.05, tv  # far from the target's distribution ...
    counts = sample_outputs(p, q, 1, seed=1239, rule=verify_llamacpp)
    assert chi2_pvalue(counts, p) < 1e-12  # ... and the test above rejects it
    assert chi2_pvalue(counts, biased) > ALPHA  # while it samples its own biased law


def test_the_chi_square_helper():
    assert abs(chi2_sf(3.841, 1) - 0.05) < 1e-3 and abs(chi2_sf(18.307, 10) - 0.05) < 1e-3
    assert abs(chi2_sf(0.5, 4) - 0.9735) < 1e-3


# ---- draft-simple over several sequences: one batch, the drafts of each alone ---------------

def _prompted(flavour, d_hp, d_w, prompts, decode_last: bool):
    """A draft Context with ``prompts[s]`` decoded on sequence ``s`` (without its last
    token unless ``decode_last``)."""
    ctx = flavour.make(d_hp, d_w, n_ctx=256, n_seq_max=len(prompts))
    for s, p in enumerate(prompts):
        toks = p if decode_last else p[:-1]
        if toks:
            assert ctx.decode(Batch(token=toks, pos=list(range(len(toks))),
                                    seq_id=[[s]] * len(toks))) == 0
    return ctx


def _seq_positions(ctx, s):
    mem = ctx.memory
    cells = mem.v_cells[mem.seq_to_stream[s]]
    return sorted(int(p) for p in cells.pos[cells.seq_cells(s, 0, 1 << 30)])


@every
@pytest.mark.parametrize("n_max, n_min, p_min", [(4, 0, 0.0), (6, 3, 0.13), (5, 0, 0.19)])
def test_drafting_sequences_together_is_drafting_each_alone(flavour, n_max, n_min, p_min):
    """``draft_simple`` over 3 sequences (with per-sequence limits, one with pending
    tokens) gives each sequence the draft ``draft_greedy`` gives it alone, leaves each
    sequence's cells at the same positions, and decodes at most 1 + the longest draft
    times."""
    from reference.tools.speculative import (
        DraftSeq,
        draft_greedy,
        draft_simple,
        draft_simple_chain,
    )
    d_hp, d_w = drafts(flavour)["other-model"]
    prompts = [[1, 5, 9, 3], [7, 7, 2, 30, 11, 4], [3]]
    limits = [n_max, 2, n_max]
    together = _prompted(flavour, d_hp, d_w, prompts, decode_last=False)
    calls = []
    decode = together.decode
    together.decode = lambda b: calls.append(len(b.token)) or decode(b)
    chains = {s: draft_simple_chain(32) for s in range(3)}
    # sequence 1 lacks its last two prompt tokens: they ride in the first batch
    mem = together.memory
    mem.seq_rm(1, 3, -1)
    seqs = [DraftSeq(0, prompts[0][-1], 3, limits[0]),
            DraftSeq(1, prompts[1][-1], 5, limits[1], pending=(30, 11)),
            DraftSeq(2, prompts[2][-1], 0, limits[2])]
    got = draft_simple(together, chains, seqs, n_max, n_min, p_min, 32)
    longest = max(len(v) for v in got.values()) if n_min == 0 else min(n_max, max(limits))
    assert len(calls) <= 1 + longest  # not one decode chain per sequence
    assert calls[0] == 3 + 2  # every sequence's first row, and the pending tokens
    for s, p in enumerate(prompts):
        alone = _prompted(flavour, d_hp, d_w, [p], decode_last=False)
        want = draft_greedy(alone, draft_simple_chain(32), p[-1], len(p) - 1,
                            min(n_max, limits[s]), n_min, p_min, 32)
        assert got[s] == want, s
        for ctx in (together, alone):
            ctx.memory.seq_rm(s if ctx is together else 0, len(p) + max(0, len(want) - 1), -1)
        assert _seq_positions(together, s) == _seq_positions(alone, 0), s
