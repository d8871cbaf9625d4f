"""Self-Extend (``reference.tools.self_extend``, the Generator's group attention, ``-gan/-gaw``).

- the loop of ``llama-completion``, run on a list of positions, leaves the closed form of the
  module docstring after every decode, whatever the chunking;
- on both twins, the cache after the loop holds every token at its closed-form position and
  equals a fresh decode of the tokens at those positions (one layer: K/V depend only on the
  token and its position), logits to the flavour's verdict and the twins to 1e-6;
- the paper's attention equals its pairwise definition, is ordinary attention when nothing is
  grouped, and on one layer llama.cpp's last query equals it with ``W_n = r + 1`` when ``G``
  divides ``r + 1``;
- bad parameters are typed errors raised before anything changes; ``llamaref generate
  --grp-attn-n`` runs the loop and refuses bad flags in one line.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.batch import Batch
from reference.context import Context
from reference.hparams import rope_cparams
from reference.ops import rope_ext
from reference.ops.rope import RopeParams
from reference.testing import random_gemma_weights, tiny_gemma_hparams, write_tiny_gguf
from reference.tools.generate import Generator
from reference.tools.self_extend import (
    SWA_EXACT,
    SWA_GROUPED,
    SWA_MODES,
    SelfExtendError,
    apply_group_attention,
    check_group_attention,
    group_attention_ops,
    self_extend_attention,
    self_extend_forward,
    self_extend_positions,
    self_extend_positions_exact,
    self_extend_state,
)
from tests.support.helpers import (
    MLX,
    REF_F32,
    REF_F64,
    apply_op,
    assert_same,
    assert_twins_agree,
    cells_of,
    decode_seq,
    every_flavour,
    fresh_cache,
    llama_model,
    make,
    make_mamba,
    snapshot,
)
from tests.tools.test_generate import cached_tokenizers, tiny_smol_gguf  # noqa: F401  (a fixture)


class Greedy:
    def sample(self, logits):
        return int(np.argmax(logits))

    def accept(self, token):
        pass


group_st = st.integers(2, 4).flatmap(
    lambda g: st.tuples(st.just(g), st.integers(1, 5).map(lambda m: g * m)))


# ---- the loop on positions alone -------------------------------------------------------------

@given(group_st, st.lists(st.integers(1, 40), min_size=1, max_size=12))
def test_loop_leaves_the_closed_form(gw, chunks):
    """Decode chunks, run the loop before each one (and once at the end): the positions are
    the closed form, and (ga_i, n_past) are the closed form's."""
    ga_n, ga_w = gw
    cells: list[tuple[int, int]] = []  # (token index, pos)
    ga_i, n_past, n = 0, 0, 0
    for size in [*chunks, 0]:
        ops, ga_i, n_past = group_attention_ops(ga_i, n_past, ga_n, ga_w)
        for op in ops:
            cells = apply_op(cells, op)
        assert [p for _, p in cells] == self_extend_positions(n, ga_n, ga_w).tolist()
        assert (ga_i, n_past) == self_extend_state(n, ga_n, ga_w)
        assert n_past == (max((p for _, p in cells), default=-1) + 1)  # seq_pos_max + 1
        cells += [(n + j, n_past + j) for j in range(size)]
        n, n_past = n + size, n_past + size


def test_closed_form_examples():
    # G = 2, W = 4, 10 tokens: two blocks grouped, two neighbours after them
    assert self_extend_positions(10, 2, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 5]
    assert self_extend_state(10, 2, 4) == (4, 6)
    # exactly K blocks: all grouped, no neighbour left
    assert self_extend_positions(8, 4, 8).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


# ---- the loop in a Context, both twins ---------------------------------------------------------

def grouped_run(flavour, ga_n, ga_w, prompt, n_batch, n_gen):
    """One-layer Context: prompt in chunks of ``n_batch``, ``n_gen`` greedy tokens, the loop
    once more; returns (ctx, tokens)."""
    ctx = make(flavour, n_layer=1, n_batch=n_batch)
    gen = Generator(ctx, Greedy(), shift=False, ga_n=ga_n, ga_w=ga_w)
    gen.eval_prompt(prompt)
    list(gen.generate(n_gen, is_eog=lambda t: False))
    gen.group_attention()  # what runs before the next decode
    return ctx, gen.tokens


@every_flavour
@given(group_st, st.lists(st.integers(0, 31), min_size=1, max_size=70), st.integers(1, 40),
       st.integers(0, 4))
@settings(max_examples=20, deadline=None)
def test_grouped_cache_equals_fresh_decode(flavour, gw, prompt, n_batch, n_gen):
    ga_n, ga_w = gw

    def scenario(fl):
        ctx, tokens = grouped_run(fl, ga_n, ga_w, prompt, n_batch, n_gen)
        want = self_extend_positions(len(tokens), ga_n, ga_w)
        # cells are taken in decode order: cell t holds token t
        assert ctx.memory.v_cells[0].pos[: len(tokens)].tolist() == want.tolist()
        fresh = fresh_cache(fl, list(zip(tokens, want.tolist(), strict=True)))
        fl.assert_close(decode_seq(fresh, [7]), got := decode_seq(ctx, [7]))
        return got

    assert_twins_agree(flavour, scenario(flavour), scenario)


# ---- the paper's attention ----------------------------------------------------------------------

def pairwise_attention(q, k, v, g, w_n, scale, rope):
    """The definition, one pair at a time: key j roped at 0, query i at the pair's distance."""
    n, n_head, _ = q.shape
    n_gqa = n_head // k.shape[1]
    out = np.zeros((n, n_head, v.shape[2]))
    for i in range(n):
        d = np.array([i - j if i - j < w_n else i // g - j // g + w_n - w_n // g
                      for j in range(i + 1)])
        qi = rope_ext(np.repeat(q[i : i + 1], i + 1, axis=0), d, rope)  # (i + 1, n_head, d)
        kj = rope_ext(k[: i + 1], np.zeros(i + 1, np.int64), rope)  # (i + 1, n_head_kv, d)
        for h in range(n_head):
            s = scale * np.einsum("jd,jd->j", qi[:, h], kj[:, h // n_gqa])
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[: i + 1, h // n_gqa]
    return out.reshape(n, -1)


@pytest.mark.parametrize("g, w_n", [(2, 3), (3, 6), (4, 1), (1, 2)])
def test_paper_attention_is_its_pairwise_definition(g, w_n):
    rng = np.random.default_rng(g * 10 + w_n)
    q = rng.standard_normal((13, 4, 8))  # (n_tokens, n_head, d)
    k = rng.standard_normal((13, 2, 8))  # (n_tokens, n_head_kv, d): GQA
    v = rng.standard_normal((13, 2, 5))
    rope = RopeParams(n_dims=8, freq_base=100.0)
    got = self_extend_attention(q, k, v, np.arange(13), g, w_n, 0.3, rope)
    want = pairwise_attention(q, k, v, g, w_n, 0.3, rope)
    assert np.abs(got - want).max() < 1e-12


def test_paper_forward_without_grouping_is_the_model():
    """G = 1 (or a window over everything): the Context's own logits, every row."""
    hp, w = llama_model(2, np.dtype(np.float64))
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    ctx = make(REF_F64, n_layer=2)
    want = decode_seq(ctx, tokens)
    for g, w_n in [(1, 1), (4, len(tokens))]:
        got = self_extend_forward(w, hp, tokens, g, w_n)
        assert np.abs(got - want).max() < 1e-10


@pytest.mark.parametrize("ga_n, ga_w, n", [(2, 8, 20), (2, 8, 22), (4, 8, 36), (3, 6, 21)])
def test_one_layer_llamacpp_is_paper_with_growing_window(ga_n, ga_w, n):
    """llama.cpp's last query sees distances ``i - j`` for ``j >= KW`` and ``Kw + r - j // G``
    before: the paper with ``W_n = r + 1``, when ``G`` divides ``r + 1``."""
    hp, w = llama_model(1, np.dtype(np.float64))
    tokens = [int(t) for t in np.random.default_rng(n).integers(0, 32, n)]
    ctx = make(REF_F64, n_layer=1, n_batch=5)
    gen = Generator(ctx, Greedy(), shift=False, ga_n=ga_n, ga_w=ga_w)
    gen.eval_prompt(tokens[:-1])
    gen.eval_prompt(tokens[-1:])  # the last query, alone, after the loop
    r = (n - 1) % ga_w
    assert (r + 1) % ga_n == 0, "choose n so that G divides r + 1"
    paper = self_extend_forward(w, hp, tokens, ga_n, r + 1)[-1]
    assert np.abs(ctx.get_logits_ith(-1) - paper).max() < 1e-10
    # a fixed window of W is another attention
    assert np.abs(ctx.get_logits_ith(-1) - self_extend_forward(w, hp, tokens, ga_n, ga_w)[-1]
                  ).max() > 1e-6


def test_rope_cparams_feed_the_paper_attention():
    """The forward uses the model's RoPE (not a default): a different base changes it."""
    hp, w = llama_model(1, np.dtype(np.float64))
    assert rope_cparams(hp).freq_base == hp.rope_freq_base_train
    assert math.isfinite(float(self_extend_forward(w, hp, [1, 2, 3], 2, 1).sum()))


# ---- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, n_expert, message", [
    ("qwen3", 0, "not 'qwen3'"),
    ("llama", 4, "not 'llama' with experts"),
])
def test_the_papers_forward_refuses_what_its_graph_lacks(arch, n_expert, message):
    """``self_extend_forward`` is llama / qwen2's dense graph: Qwen3's Q/K norms and experts
    are not in it, so such a model is refused, not silently computed wrong."""
    from reference.testing import random_weights, tiny_hparams
    hp = tiny_hparams(arch, n_expert=n_expert, n_expert_used=2 if n_expert else 0)
    with pytest.raises(SelfExtendError, match=message):
        self_extend_forward(random_weights(hp), hp, [1, 2, 3], 2, 2)


@pytest.mark.parametrize("ga_n, ga_w", [(0, 512), (-1, 4), (3, 512), (2, 0), (2, -4)])
def test_bad_parameters_are_typed_errors(ga_n, ga_w):
    with pytest.raises(SelfExtendError):
        check_group_attention(ga_n, ga_w)
    with pytest.raises(SelfExtendError):
        self_extend_positions(10, ga_n, ga_w)
    ctx = make(REF_F64, n_layer=1)
    assert ctx.decode(Batch(token=[1, 2, 3])) == 0
    before = snapshot(ctx)
    with pytest.raises(SelfExtendError):
        Generator(ctx, Greedy(), shift=False, ga_n=ga_n, ga_w=ga_w)
    with pytest.raises(SelfExtendError):
        apply_group_attention(ctx.memory, 0, 3, ga_n, ga_w)
    assert_same(before, snapshot(ctx))


def test_no_context_shift_with_self_extend():
    ctx = make(REF_F64, n_layer=1)
    with pytest.raises(SelfExtendError, match="context shift"):
        Generator(ctx, Greedy(), shift=True, ga_n=2, ga_w=8)
    Generator(ctx, Greedy(), shift=True, ga_n=1, ga_w=7)  # W is ignored without grouping


def test_recurrent_memory_refuses_self_extend():
    ctx = make_mamba(REF_F64, "mamba")
    assert ctx.decode(Batch(token=[1, 2, 3])) == 0
    before = cells_of(ctx)
    with pytest.raises(SelfExtendError, match="recurrent"):
        Generator(ctx, Greedy(), shift=False, ga_n=2, ga_w=8)
    assert cells_of(ctx) == before


def test_full_context_stops_generation():
    """Every token keeps its cell: with G > 1 a full context stops, it does not shift."""
    ctx = make(REF_F64, n_layer=1)  # 256 cells
    gen = Generator(ctx, Greedy(), shift=False, ga_n=2, ga_w=8)
    gen.eval_prompt([1] * 200)
    out = list(gen.generate(100, is_eog=lambda t: False))
    assert len(out) == 56 and gen.stopped and "context full" in gen.stopped
    assert len(gen.tokens) == 255
    with pytest.raises(SelfExtendError):
        gen.sync_prefix([1, 2])


# ---- llamaref generate --grp-attn-n / --grp-attn-w ----------------------------------------------

@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory):
    return tiny_smol_gguf(tmp_path_factory.mktemp("se") / "tiny-smol.gguf")


def test_cli_generate_runs_the_grouping_loop(capsys, tiny_smol):
    """Greedy text of ``generate -gan 2 -gaw 8`` is the Generator's with the same loop, and
    the prompt (> W tokens) did go through it."""
    from llamaref.cli import main
    from reference.model_loader import load_model
    from reference.tokenizer import load_tokenizer

    prompt = "one two three four five six seven eight nine ten eleven twelve"
    argv = ["generate", prompt, "-m", str(tiny_smol), "--temp", "0", "-n", "6",
            "--backend", "reference", "--no-display-prompt", "-b", "4"]
    assert main([*argv, "-gan", "2", "-gaw", "8"]) == 0
    out = capsys.readouterr().out
    hp, w = load_model(tiny_smol)
    tok = load_tokenizer(tiny_smol)
    ctx = Context(hp, w, n_ctx=4096, n_batch=4)
    gen = Generator(ctx, Greedy(), shift=False, ga_n=2, ga_w=8)
    tokens = tok.tokenize(prompt, add_special=True, parse_special=True)
    gen.eval_prompt(tokens)
    want = list(gen.generate(6, tok.is_eog))
    assert gen.ga_i == 4 * ((len(tokens) + 5) // 8)  # blocks of 8 grouped, 4 positions each
    assert out == tok.detokenize(want) + "\n"


@pytest.mark.parametrize("flags, message", [
    (["-gan", "3", "-gaw", "8"], "multiple of --grp-attn-n 3"),
    (["-gan", "0"], "--grp-attn-n 0"),
    (["-gan", "2", "-gaw", "0"], "--grp-attn-w 0"),
])
def test_cli_generate_bad_group_flags(capsys, flags, message):
    from llamaref.cli import main

    assert main(["generate", "hi", "-m", "/nonexistent.gguf", *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


# ---- sliding-window models: Gemma 2 and Gemma 3 (the iSWA cache) ---------------------------------

#: (arch, n_layer): Gemma 2's 1:1 pattern, Gemma 3's 5:1 (tiny_gemma_hparams' defaults)
GEMMAS = [("gemma2", 2), ("gemma3", 6)]


@functools.cache
def gemma_model(arch: str, n_layer: int, n_swa: int, swa_layers: tuple | None, dtype):
    """A random Gemma 2 / Gemma 3 (seed 5), its window ``n_swa``; ``swa_layers`` None: the
    architecture's own pattern."""
    hp = tiny_gemma_hparams(arch, n_vocab=32, n_layer=n_layer, n_swa=n_swa,
                            swa_layers=swa_layers, n_ctx_train=4096)
    return hp, random_gemma_weights(hp, seed=5, dtype=np.dtype(dtype))


def gemma_ctx(flavour, arch, n_layer, n_swa, swa_layers=None, swa_full=True, n_batch=256,
              n_ctx=256):
    hp, w = gemma_model(arch, n_layer, n_swa, swa_layers, flavour.dtype)
    return flavour.make(hp, w, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                        swa_full=swa_full, n_seq_max=2)


def gemma_run(ctx, tokens, n_batch, ga_n, ga_w, swa, n_gen=0):
    """Prompt in chunks of ``n_batch``, ``n_gen`` greedy tokens, the loop once more."""
    gen = Generator(ctx, Greedy(), shift=False, ga_n=ga_n, ga_w=ga_w, ga_swa=swa)
    gen.eval_prompt(tokens)
    list(gen.generate(n_gen, is_eog=lambda t: False))
    gen.group_attention()  # what runs before the next decode
    return gen


def cache_positions(cache, seq_id: int = 0) -> list[int]:
    """The positions of ``seq_id``'s cells, in cell order (cell t holds token t)."""
    cells = cache.v_cells[0]
    return [int(cells.pos[i]) for i in range(cells.size()) if cells.seq_has(i, seq_id)]


def decode_at(ctx, tokens, pos) -> None:
    """Put ``tokens`` at ``pos`` in sequence 0 of a fresh Context (contiguous runs through
    sequence 1, as ``fresh_cache``: an empty sequence may start anywhere)."""
    runs: list[list[tuple[int, int]]] = []
    for t, p in zip(tokens, pos, strict=True):
        if runs and p <= runs[-1][-1][1] + 1:
            runs[-1].append((t, p))
        else:
            runs.append([(t, p)])
    for run in runs:
        assert ctx.decode(Batch(token=[t for t, _ in run], pos=[p for _, p in run],
                                seq_id=[[1]] * len(run))) == 0
        ctx.memory.seq_cp(1, 0, -1, -1)
        ctx.memory.seq_rm(1, -1, -1)


gemma_st = st.sampled_from(GEMMAS)


@pytest.mark.parametrize("flavour", [REF_F64, MLX], ids=str)
@given(gemma_st, group_st, st.integers(3, 9), st.lists(st.integers(0, 31), min_size=1,
                                                          max_size=60),
       st.integers(1, 24), st.integers(0, 3), st.sampled_from(SWA_MODES), st.booleans())
@settings(max_examples=12, deadline=None)
def test_gemma_loop_leaves_the_closed_form_in_both_caches(flavour, model, gw, n_swa, prompt,
                                                          n_batch, n_gen, swa, swa_full):
    """Random Gemma 2 / Gemma 3, any chunking: with ``grouped`` (llama.cpp, --swa-full) both
    caches hold the closed form; with ``exact`` the full-attention cache holds it moved up by
    ``K (W - W/G)`` and the SWA cache every token at its own index, with or without
    --swa-full."""
    (arch, n_layer), (ga_n, ga_w) = model, gw
    if swa == SWA_GROUPED:
        swa_full = True
    ctx = gemma_ctx(flavour, arch, n_layer, n_swa, swa_full=swa_full, n_batch=n_batch)
    gen = gemma_run(ctx, prompt, n_batch, ga_n, ga_w, swa, n_gen)
    n = len(gen.tokens)
    base, swa_cache = ctx.memory.get_base(), ctx.memory.get_swa()
    if swa == SWA_GROUPED:
        want = self_extend_positions(n, ga_n, ga_w).tolist()
        assert cache_positions(base) == want
        # the SWA cache holds the last of them: its slot search reuses a cell once the window
        # hides it (llama.cpp's find_slot; after a seq_add it starts at cell 0), and
        # apply_ubatch then removes every position up to the reused cell's
        held = sorted(cache_positions(swa_cache))
        assert held and held == want[len(want) - len(held):]
    else:
        assert cache_positions(base) == self_extend_positions_exact(n, ga_n, ga_w).tolist()
        held = cache_positions(swa_cache)  # a small SWA cache forgets what the window hides
        assert held == list(range(n - len(held), n)) and len(held) >= min(n, n_swa)


#: (G, W, n_swa, prompt, n_batch, n_gen); the last one has llama.cpp's SWA cache forget tokens
#: its grouped window reaches again
FRESH_CASES = [(2, 8, 5, 21, 5, 0), (4, 8, 5, 30, 5, 0), (3, 6, 5, 25, 5, 3), (4, 4, 6, 15, 15, 6)]


@pytest.mark.parametrize("flavour", [REF_F64, REF_F32, MLX], ids=str)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("swa_layer", [True, False], ids=["swa-layer", "full-layer"])
@pytest.mark.parametrize("ga_n, ga_w, n_swa, n, n_batch, n_gen", FRESH_CASES)
def test_gemma_grouped_cache_equals_fresh_decode(flavour, arch, swa_layer, ga_n, ga_w, n_swa, n,
                                                 n_batch, n_gen):
    """The law of the Llama above on a one-layer Gemma 2 / Gemma 3 (a cell's K and V depend
    only on its token and position), SWA layer or full-attention layer.

    After llama.cpp's loop (``grouped``) the next logits equal a fresh decode of the tokens
    the layer's cache still holds, at the closed-form positions: every token for a full
    layer; for a SWA layer the last ones, those its slot search has not reused (a suffix:
    ``apply_ubatch`` removes every position up to a reused cell's). After ``exact`` they
    equal a fresh decode of every token at the exact positions (SWA layer: Self-Extend
    changed nothing) or at llama.cpp's (full layer: the same distances)."""
    prompt = [int(t) for t in np.random.default_rng(n).integers(0, 32, n)]
    model = (arch, 1, n_swa, (swa_layer,))

    def scenario(fl):
        got, held = {}, {}
        for swa in SWA_MODES:
            ctx = gemma_ctx(fl, *model, n_batch=n_batch)
            gen = gemma_run(ctx, prompt, n_batch, ga_n, ga_w, swa, n_gen)
            cache = ctx.memory.get_swa() if swa_layer else ctx.memory.get_base()
            held[swa], tokens = len(cache_positions(cache)), gen.tokens
            got[swa] = decode_seq(ctx, [7])
        assert held[SWA_EXACT] == len(tokens)  # swa_full: the exact window forgets nothing
        grouped = self_extend_positions(len(tokens), ga_n, ga_w)
        exact = np.arange(len(tokens)) if swa_layer else grouped
        for swa, pos in ((SWA_GROUPED, grouped), (SWA_EXACT, exact)):
            first = len(tokens) - held[swa]
            fresh = gemma_ctx(fl, *model)
            decode_at(fresh, tokens[first:], pos[first:].tolist())
            fl.assert_close(decode_seq(fresh, [7]), got[swa])
        return got[SWA_EXACT]

    assert_twins_agree(flavour, scenario(flavour), scenario)


def test_gemma_grouped_swa_window_can_reach_tokens_its_cache_forgot():
    """llama.cpp's form on a SWA layer: the slot search reuses a cell once the window hides
    it (even with --swa-full), and a later grouping brings its position back into the
    window. Here (G = W = 4, window 6, a 15-token prompt, 6 tokens generated) the next query
    at 5 sees positions 0..4, and the cache holds only 2..4: the first 8 tokens are gone.
    Grouping only the full-attention layers (``exact``) keeps the SWA layer what it was."""
    prompt = [int(t) for t in np.random.default_rng(15).integers(0, 32, 15)]
    ctx = gemma_ctx(REF_F64, "gemma2", 1, 6, (True,), n_batch=15)
    gen = gemma_run(ctx, prompt, 15, 4, 4, SWA_GROUPED, n_gen=6)
    assert ctx.memory.seq_pos_max(0) + 1 == 5  # the next query's position
    assert sorted(cache_positions(ctx.memory.get_swa())) == [2] * 4 + [3] * 4 + [4] * 4
    everything = gemma_ctx(REF_F64, "gemma2", 1, 6, (True,))
    decode_at(everything, gen.tokens, self_extend_positions(20, 4, 4).tolist())
    assert np.abs(decode_seq(everything, [7]) - decode_seq(ctx, [7])).max() > 1e-3


@pytest.mark.parametrize("arch, n_layer", GEMMAS)
@pytest.mark.parametrize("swa_full", [False, True])
def test_gemma_exact_leaves_an_all_swa_model_unchanged(arch, n_layer, swa_full):
    """Every layer SWA (any number of layers): Self-Extend's ``exact`` form groups nothing
    the model reads, so generation is plain generation's, logits for logits, with or without
    --swa-full."""
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 32, 40)]
    swa_layers = (True,) * n_layer
    plain = gemma_ctx(REF_F64, arch, n_layer, 6, swa_layers, swa_full=swa_full, n_batch=7)
    Generator(plain, Greedy(), shift=False).eval_prompt(tokens)
    grouped = gemma_ctx(REF_F64, arch, n_layer, 6, swa_layers, swa_full=swa_full, n_batch=7)
    gemma_run(grouped, tokens, 7, 2, 8, SWA_EXACT)
    REF_F64.assert_close(decode_seq(plain, [7, 3, 9]), decode_seq(grouped, [7, 3, 9]))


@pytest.mark.parametrize("arch, n_layer", GEMMAS)
def test_gemma_exact_is_llamacpp_on_the_full_attention_layers(arch, n_layer):
    """No layer SWA (any number of layers): ``exact`` moves only the full-attention cache,
    by a constant from llama.cpp's positions, so it is llama.cpp's Self-Extend exactly."""
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, 32, 45)]
    runs = []
    for swa in SWA_MODES:
        ctx = gemma_ctx(REF_F64, arch, n_layer, 6, (False,) * n_layer, n_batch=6)
        gen = gemma_run(ctx, tokens, 6, 2, 8, swa, n_gen=5)
        runs.append((gen.tokens, decode_seq(ctx, [7])))
    assert runs[0][0] == runs[1][0]
    REF_F64.assert_close(runs[0][1], runs[1][1])


def visible_tokens(n: int, ga_n: int, ga_w: int, n_swa: int, swa: str) -> set[int]:
    r"""The tokens ``j < n`` a SWA layer's query ``i = n`` sees after the loop, from the module
    docstring: ``exact``: $i - j < n_{swa}$; ``grouped``: $j \ge i - n_{swa} + 1$ in the tail,
    $j \ge KW - G(n_{swa} - r - 1)$ among the grouped tokens."""
    if swa == SWA_EXACT:
        return {j for j in range(n) if n - j < n_swa}
    k = n // ga_w
    r = n - k * ga_w
    return {j for j in range(n) if (n - j < n_swa if j >= k * ga_w
                                     else j >= k * ga_w - ga_n * (n_swa - r - 1))}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("swa", SWA_MODES)
@pytest.mark.parametrize("ga_n, ga_w, n, n_swa", [(2, 8, 34, 6), (4, 8, 41, 4), (3, 6, 38, 5)])
def test_gemma_swa_layer_sees_the_tokens_of_the_stated_window(arch, swa, ga_n, ga_w, n, n_swa):
    """What grouping does to a SWA layer, held by what the layer reads: on a one-layer SWA
    Gemma, changing token j changes the next logits exactly when j is in the window the
    module docstring states (``grouped``: $(r + 1) + G(n_{swa} - r - 1)$ tokens, reaching
    into the grouped ones; ``exact``: the last $n_{swa}$)."""
    tokens = [int(t) for t in np.random.default_rng(n).integers(0, 32, n)]
    model = (arch, 1, n_swa, (True,))

    def next_logits(toks):
        ctx = gemma_ctx(REF_F64, *model, n_batch=5)
        gemma_run(ctx, toks, 5, ga_n, ga_w, swa)
        return decode_seq(ctx, [7]), len(cache_positions(ctx.memory.get_swa()))

    want = visible_tokens(n, ga_n, ga_w, n_swa, swa)
    assert (len(want) > n_swa - 1) == (swa == SWA_GROUPED)  # the grouped window is wider
    base, n_held = next_logits(tokens)
    assert min(want) >= n - n_held  # these cases: the cache still holds the whole window
    lo = min(want)
    for j in {lo - 2, lo - 1, lo, lo + 1, n - 1}:
        changed = list(tokens)
        changed[j] = (changed[j] + 1) % 32
        seen = np.abs(next_logits(changed)[0] - base).max() > 1e-9
        assert seen == (j in want), (j, sorted(want))


@pytest.mark.parametrize("arch, n_layer", GEMMAS)
def test_gemma_without_swa_full_names_swa_full(arch, n_layer):
    """llama.cpp's loop moves every cell: a SWA cache that keeps only its window cannot
    (``can_shift()`` False). The error says so and names --swa-full (not "recurrent"),
    before anything changes; ``exact`` moves only the full-attention cache and runs."""
    ctx = gemma_ctx(REF_F64, arch, n_layer, 4, swa_full=False, n_batch=8, n_ctx=512)
    assert ctx.memory.get_swa().get_size() < ctx.memory.get_base().get_size()
    assert ctx.decode(Batch(token=[1, 2, 3])) == 0
    before = snapshot(ctx)
    with pytest.raises(SelfExtendError, match="--swa-full") as err:
        Generator(ctx, Greedy(), shift=False, ga_n=2, ga_w=16)
    assert "recurrent" not in str(err.value)
    with pytest.raises(SelfExtendError, match="--swa-full"):
        apply_group_attention(ctx.memory, 0, 3, 2, 16)
    assert_same(before, snapshot(ctx))
    Generator(ctx, Greedy(), shift=False, ga_n=2, ga_w=16, ga_swa=SWA_EXACT)
    with pytest.raises(SelfExtendError, match="--grp-attn-swa 'sideways'"):
        Generator(ctx, Greedy(), shift=False, ga_n=2, ga_w=16, ga_swa="sideways")


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    hp = tiny_gemma_hparams("gemma2", n_vocab=300, n_layer=2, n_swa=8, n_ctx_train=4096)
    return write_tiny_gguf(tmp_path_factory.mktemp("g2") / "g2.gguf", hp,
                           random_gemma_weights(hp, seed=1))


@pytest.mark.parametrize("flags, rc", [
    ([], 1), (["--swa-full"], 0), (["--grp-attn-swa", "exact"], 0),
    (["--swa-full", "--grp-attn-swa", "exact"], 0)])
def test_cli_generate_self_extend_on_gemma2(capsys, tiny_gemma2, flags, rc):
    """gemma.cpp #60's request: ``generate -gan 2 -gaw 16`` on a Gemma 2 model. Without
    --swa-full: one line naming --swa-full (it said "a recurrent model has none to group");
    with it, or with ``--grp-attn-swa exact``, it runs."""
    from llamaref.cli import main

    prompt = " ".join(["Hi there"] * 12)
    argv = ["generate", prompt, "-m", str(tiny_gemma2), "-n", "4", "--temp", "0", "-b", "8",
            "--backend", "reference", "-gan", "2", "-gaw", "16", "--no-display-prompt"]
    assert main([*argv, *flags]) == rc
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("llamaref: error")]
    assert len(errors) == rc
    if rc:
        assert "--swa-full" in errors[0] and "recurrent" not in errors[0]
