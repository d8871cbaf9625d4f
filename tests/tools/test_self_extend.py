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
from reference.tools.generate import Generator
from reference.tools.self_extend import (
    SelfExtendError,
    apply_group_attention,
    check_group_attention,
    group_attention_ops,
    self_extend_attention,
    self_extend_forward,
    self_extend_positions,
    self_extend_state,
)
from tests.support.helpers import (
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
