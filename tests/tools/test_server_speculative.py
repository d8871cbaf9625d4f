"""Speculative decoding in the server's slots (reference/tools/server/scheduler.py with a
draft Context), driven step by step with no thread and no HTTP: a draft changes how many
decodes an answer takes, never the answer, nor the distribution of a sampled one, nor what
the slot's cache holds afterwards."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.sampling import SamplerParams
from reference.tools.server.params import SlotParams
from reference.tools.server.results import Final
from reference.tools.server.scheduler import SchedulerError
from reference.tools.server.slot import Task
from tests.support.server_support import (
    BACKENDS,
    alone,
    collect,
    finals,
    greedy,
    make_scheduler,
    make_spec_scheduler,
    run_scheduler,
    tokenizer,
    word_prompts,
)
from tests.tools.test_speculative import chi2_pvalue


def prompts(n: int, words: int = 5) -> list[list[int]]:
    return word_prompts(n, words, "sy", 4)


def run_arrivals(sched, ps, params, arrivals) -> dict[int, Final]:
    """Task ``i`` added at step ``arrivals[i]``; step until all are done."""
    out: dict = {}
    pending = sorted(enumerate(arrivals), key=lambda x: x[1])
    step = 0
    while pending or any(s.is_processing for s in sched.slots) or sched.waiting:
        while pending and pending[0][1] <= step:
            i, _ = pending.pop(0)
            sched.add_task(Task(i + 1, ps[i], params[i], collect(out, i)))
        sched.step()
        step += 1
        assert step < 5000
    return finals(out)


def seq_positions(sched, seq: int) -> list[int]:
    """The positions of the cells of sequence ``seq`` in a (non-iSWA) KV cache."""
    mem = sched.memory
    cells = mem.v_cells[mem.seq_to_stream[seq]]
    return sorted(int(p) for p in cells.pos[cells.seq_cells(seq, 0, 1 << 30)])


# ---- law 1: greedy answers with speculation are the answers without -------------------------

@settings(deadline=None, max_examples=10)
@given(arrivals=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       lengths=st.lists(st.integers(1, 12), min_size=4, max_size=4),
       n_slots=st.integers(1, 3), draft=st.sampled_from(["layers:1", "layers:2", "other"]),
       n_max=st.integers(1, 5), unified=st.booleans())
def test_greedy_answers_with_a_draft_equal_each_prompt_alone(arrivals, lengths, n_slots, draft,
                                                             n_max, unified):
    ps = prompts(len(arrivals))
    sched = make_spec_scheduler("reference64", draft=draft, n_slots=n_slots, n_ctx=512,
                                kv_unified=unified, draft_n_max=n_max)
    got = run_arrivals(sched, ps, [greedy(n) for n in lengths], arrivals)
    for i, p in enumerate(ps):
        assert got[i].tokens == alone("reference64", p, lengths[i]), (i, draft)
        assert got[i].n_decoded == len(got[i].tokens) == lengths[i]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_answers_with_a_draft_on_every_backend(backend):
    """Both twins (the MLX one samples on the device from the rows it kept)."""
    ps = prompts(2)
    for draft in ("layers:1", "other"):
        sched = make_spec_scheduler(backend, draft=draft, n_slots=2, draft_n_max=4)
        got = run_arrivals(sched, ps, [greedy(8)] * 2, [0, 1])
        for i, p in enumerate(ps):
            assert got[i].tokens == alone(backend, p, 8), (draft, i)


@pytest.mark.parametrize("draft", ["layers:1", "other"])
def test_an_iswa_target_speculates_with_the_same_answers(draft):
    """Gemma 2 (sliding window 8): the rejected tokens leave both caches, the answer is the
    plain one, past the window."""
    ps = prompts(3, words=8)
    sched = make_spec_scheduler("reference64", "gemma", draft=draft, n_slots=2, n_ctx=256,
                                draft_n_max=4)
    got = run_arrivals(sched, ps, [greedy(20)] * 3, [0, 0, 3])
    for i, p in enumerate(ps):
        assert got[i].tokens == alone("reference64", p, 20, kind="gemma"), i


def test_a_self_draft_of_every_layer_is_always_accepted_and_counted():
    """The draft is the target: every drafted token is accepted, and the step reports say so
    (``spec_decode_num_draft_tokens_total`` = ``..._accepted_tokens_total``); fewer target
    decodes than tokens."""
    ps = prompts(2)
    sched = make_spec_scheduler("reference64", draft="layers:2", n_slots=2, draft_n_max=4)
    out: dict = {}
    reports = run_scheduler(sched, [Task(i + 1, p, greedy(13), collect(out, i))
                                    for i, p in enumerate(ps)])
    n_draft = sum(r.n_draft for r in reports)
    assert n_draft > 0 and sum(r.n_draft_accepted for r in reports) == n_draft
    assert sum(r.n_draft_verified for r in reports) > 0
    assert sum(r.n_decode for r in reports) < 13
    for i, p in enumerate(ps):
        assert finals(out)[i].tokens == alone("reference64", p, 13)


def test_a_draft_that_disagrees_is_counted_as_rejected():
    sched = make_spec_scheduler("reference64", draft="other", n_slots=1, draft_n_max=4)
    reports = run_scheduler(sched, [Task(1, prompts(1)[0], greedy(12), lambda r: None)])
    assert sum(r.n_draft_accepted for r in reports) < sum(r.n_draft for r in reports)


# ---- law 2: seeded sampling keeps the target's distribution ---------------------------------

@settings(deadline=None, max_examples=3)
@given(seed=st.integers(0, 2**31 - 1),
       draft=st.sampled_from(["layers:1", "layers:2", "other", "ngram-simple", "ngram-cache"]),
       top_k=st.sampled_from([0, 2, 5]))
def test_seeded_sampling_with_a_draft_is_sampling_without(seed, draft, top_k):
    """Every emitted token is the target chain's own sample of its own row, the chain's
    random numbers drawn once per token in the same order: the same seed gives the same
    answer with or without a draft, whichever drafter drafts."""
    ps = prompts(2)
    ngram = draft.startswith("ngram")
    kw = dict(draft=None, spec_types=(draft,), spec_ngram_size_n=1) if ngram else dict(
        draft=draft)
    params = [SlotParams(n_predict=8, sampling=SamplerParams(seed=seed + i, temp=1.0,
                                                              top_k=top_k))
              for i in range(2)]
    plain = run_arrivals(make_scheduler("reference64", n_slots=2), ps, params, [0, 1])
    spec = run_arrivals(make_spec_scheduler("reference64", n_slots=2, draft_n_max=3, **kw),
                        ps, params, [0, 1])
    assert [spec[i].tokens for i in range(2)] == [plain[i].tokens for i in range(2)]


def exact_three_token_law(prompt: list[int], top_k: int) -> dict[tuple, float]:
    """P(t1, t2, t3) of top-k sampling at temperature 1 on the target, from its logits."""
    from reference.batch import Batch
    from reference.context import Context
    from tests.support.server_support import model

    hp, w = model("llama")

    def probs(tokens):
        ctx = Context(hp, w, n_ctx=64, dtype=np.float64)
        ctx.decode(Batch(token=tokens, logits=[False] * (len(tokens) - 1) + [True]))
        z = np.asarray(ctx.get_logits_ith(-1), np.float64)
        top = np.argsort(-z, kind="stable")[:top_k]
        p = np.exp(z[top] - z[top].max())
        return dict(zip(top.tolist(), (p / p.sum()).tolist(), strict=True))

    law = {}
    for a, pa in probs(prompt).items():
        for b, pb in probs([*prompt, a]).items():
            for c, pc in probs([*prompt, a, b]).items():
                law[(a, b, c)] = pa * pb * pc
    return law


def test_sampled_answers_with_a_draft_have_the_target_distribution():
    """The chi-square harness of the speculative laws: the first three sampled tokens of
    many seeded requests (4 slots at a time, a self-draft whose proposals are often
    accepted) against their exact law under the target."""
    prompt, top_k, n_runs = prompts(1)[0], 2, 30
    law = exact_three_token_law(prompt, top_k)
    keys = sorted(law)
    counts = np.zeros(len(keys), np.int64)
    sched = make_spec_scheduler("reference64", draft="layers:2", n_slots=4, draft_n_max=3)
    out: dict = {}
    tasks = [Task(i + 1, prompt, SlotParams(n_predict=3, sampling=SamplerParams(
        seed=1000 + i, temp=1.0, top_k=top_k)), collect(out, i)) for i in range(4 * n_runs)]
    reports = run_scheduler(sched, tasks)
    assert sum(r.n_draft_accepted for r in reports) > 0  # drafts were accepted
    for f in finals(out).values():
        counts[keys.index(tuple(f.tokens))] += 1
    assert chi2_pvalue(counts, np.array([law[k] for k in keys])) > 1e-3


# ---- law 3: stops inside an accepted draft end the answer where plain decoding does ---------

class EogAt:
    """SmolLM2's tokenizer, with ``eog`` tokens also ending the generation."""

    def __init__(self, eog: set[int]):
        self.base, self.eog = tokenizer(), eog

    def __getattr__(self, name):
        return getattr(self.base, name)

    def is_eog(self, t: int) -> bool:
        return t in self.eog or self.base.is_eog(t)


@settings(deadline=None, max_examples=8)
@given(n_predict=st.integers(1, 14), cut=st.integers(1, 13),
       kind=st.sampled_from(["n_predict", "stop", "eog"]), n_max=st.integers(1, 6))
def test_a_stop_inside_an_accepted_draft_ends_the_answer_where_plain_decoding_does(
        n_predict, cut, kind, n_max):
    """A self-draft of every layer is always accepted, so the stops fall inside drafts; the
    final result (tokens, text, stop type, word) and the slot's cache are the plain ones."""
    p = prompts(1)[0]
    ref = alone("reference64", p, 14)
    params, tok = greedy(n_predict), None
    if kind == "stop":
        text = b"".join(tokenizer().token_to_piece(t) for t in ref).decode("utf-8", "replace")
        cut = min(cut, len(text) - 1)
        params = greedy(14, stop=[text[cut:cut + 3]])
    elif kind == "eog":
        tok = EogAt({ref[min(cut, 13)]})
        params = greedy(14)
    plain = make_spec_scheduler("reference64", draft="layers:2", n_slots=1, tok=tok,
                                draft_n_max=0)
    spec = make_spec_scheduler("reference64", draft="layers:2", n_slots=1, tok=tok,
                               draft_n_max=n_max)
    a = run_arrivals(plain, [p], [params], [0])[0]
    b = run_arrivals(spec, [p], [params], [0])[0]
    assert dataclasses.replace(b, timings=None) == dataclasses.replace(a, timings=None)
    assert spec.slots[0].tokens == plain.slots[0].tokens
    assert seq_positions(spec, 0) == seq_positions(plain, 0)


def test_streamed_parts_with_a_draft_are_the_plain_parts():
    """Several tokens accepted in one step are streamed as plain decoding streams them:
    one partial result per token, the same text."""
    p = prompts(1)[0]
    outs = []
    for n_max in (0, 4):
        sched = make_spec_scheduler("reference64", draft="layers:2", n_slots=1,
                                    draft_n_max=n_max)
        out: dict = {}
        run_scheduler(sched, [Task(1, p, greedy(9, stream=True), collect(out, 0))])
        outs.append([(type(r).__name__, getattr(r, "content", None)) for r in out[0]])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("post", [False, True])
def test_tokens_of_a_draft_carry_their_probabilities(post):
    """``n_probs``: every token, drafted or not, reports its probability and top candidates
    as plain decoding does (llama.cpp leaves them unset for accepted draft tokens)."""
    p = prompts(1)[0]
    got = []
    for n_max in (0, 4):
        sched = make_spec_scheduler("reference64", draft="layers:2", n_slots=1,
                                    draft_n_max=n_max)
        out: dict = {}
        run_scheduler(sched, [Task(1, p, greedy(9, n_probs=3, post_sampling_probs=post),
                                   collect(out, 0))])
        got.append(finals(out)[0].probs)
    assert len(got[0]) == len(got[1]) == 9
    for a, b in zip(*got, strict=True):
        assert (a.id, [t.id for t in a.top]) == (b.id, [t.id for t in b.top])
        np.testing.assert_allclose([b.prob, *(t.prob for t in b.top)],
                                   [a.prob, *(t.prob for t in a.top)], rtol=1e-9)


# ---- law 4: the slot's cache after a speculative request is the plain one -------------------

@settings(deadline=None, max_examples=6)
@given(draft=st.sampled_from(["layers:1", "other"]), n_max=st.integers(1, 5),
       lengths=st.lists(st.integers(1, 10), min_size=3, max_size=3))
def test_the_cache_after_speculation_is_the_cache_of_plain_decoding(draft, n_max, lengths):
    """Positions, cells and ``seq_pos_max`` of every slot, and the tokens it holds, equal
    those of the same requests served without a draft; so does the next request's reuse."""
    ps = prompts(3)
    plain = make_scheduler("reference64", n_slots=3)
    spec = make_spec_scheduler("reference64", draft=draft, n_slots=3, draft_n_max=n_max)
    params = [greedy(n) for n in lengths]
    a = run_arrivals(plain, ps, params, [0, 1, 2])
    b = run_arrivals(spec, ps, params, [0, 1, 2])
    assert [b[i].tokens for i in range(3)] == [a[i].tokens for i in range(3)]
    for s in range(3):
        assert spec.slots[s].tokens == plain.slots[s].tokens
        assert spec.memory.seq_pos_max(s) == plain.memory.seq_pos_max(s)
        assert seq_positions(spec, s) == seq_positions(plain, s)
    again = [[*ps[0], *a[0].tokens[:-1]]]
    a2 = run_arrivals(plain, again, [greedy(4)], [0])[0]
    b2 = run_arrivals(spec, again, [greedy(4)], [0])[0]
    assert (b2.tokens, b2.n_cached) == (a2.tokens, a2.n_cached)


# ---- what cannot speculate ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_a_recurrent_target_refuses_a_draft_with_a_typed_error(kind):
    with pytest.raises(SchedulerError, match="recurrent model .Mamba. cannot"):
        make_spec_scheduler("reference", kind, draft="layers:1", n_slots=1, n_ctx=128)


@pytest.mark.parametrize("config, field", [
    (dict(draft_n_max=-1), "--draft-max = -1"),
    (dict(draft_n_min=-2), "--draft-min = -2"),
    (dict(draft_p_min=1.5), "--draft-p-min = 1.5"),
])
def test_bad_draft_flags_are_refused_naming_the_flag(config, field):
    with pytest.raises(SchedulerError, match=field):
        make_spec_scheduler("reference", n_slots=1, n_ctx=128, **config)


def test_a_draft_with_too_few_sequences_is_refused():
    from reference.tools.server.scheduler import Scheduler, SchedulerConfig
    from tests.support.server_support import make_context, make_draft, sampler_factory
    ctx = make_context("reference", n_ctx=128, n_seq_max=2)
    with pytest.raises(SchedulerError, match="draft Context with n_seq_max >= 2, got 1"):
        Scheduler(ctx, tokenizer(), sampler_factory("reference"), SchedulerConfig(n_slots=2),
                  draft=make_draft("reference", n_slots=1, n_ctx=128))


# ---- llamaref serve's flags -----------------------------------------------------------------

def serve_args(*argv: str):
    from llamaref.cli import build_parser
    from llamaref.server.main import check_serve_flags
    args = build_parser().parse_args(["serve", *argv])
    check_serve_flags(args)
    return args


@pytest.mark.parametrize("argv, message", [
    (["--draft-layers", "1", "-md", "x.gguf"], "give one draft: -md/--model-draft FILE or "
                                               "--draft-layers K, not both"),
    (["-md", "no/such/draft.gguf"], "-md/--model-draft: no such file or folder"),
    (["--draft-layers", "0"], "--draft-layers = 0 must be >= 1"),
    (["--draft-max", "-1"], "--draft-max = -1 must be >= 0"),
    (["--spec-draft-n-min", "-1"], "--draft-min = -1 must be >= 0"),
    (["--draft-p-min", "2"], "--draft-p-min = 2.0 must be in [0, 1]"),
])
def test_bad_draft_flags_of_serve_are_refused_before_loading(argv, message):
    from llamaref.common import CLIError
    with pytest.raises(CLIError) as e:
        serve_args(*argv)
    assert str(e.value) == message


def test_serve_with_draft_layers_speculates_in_its_slots():
    """``llamaref serve --draft-layers 2 --draft-max 4``: the slots' draft is the target's
    first 2 layers, with the target's sequences; a greedy answer is the answer without."""
    from llamaref.server.main import load_engine, new_state
    args = serve_args("--draft-layers", "2", "--draft-max", "4", "--draft-p-min", "0.25",
                      "-c", "256", "--backend", "reference", "-np", "2")
    sched = load_engine(args, new_state(args)).scheduler
    assert sched.draft.hparams.n_layer == 2 and sched.draft.n_seq_max == 2
    assert (sched.config.draft_n_max, sched.config.draft_p_min) == (4, 0.25)
    prompt = sched.tokenizer.tokenize("The capital of France is", add_special=True,
                                      parse_special=True)
    out: dict = {}
    params = greedy(6, cache_prompt=False)
    reports = run_scheduler(sched, [Task(1, prompt, params, collect(out, 0))])
    sched.config.draft_n_max = 0
    run_scheduler(sched, [Task(2, prompt, params, collect(out, 1))])
    got = finals(out)
    assert got[0].tokens == got[1].tokens
    assert sum(r.n_draft_verified for r in reports) > 0


# ---- the drafters: n-grams, a draft model, in llama.cpp's order, every slot at once ---------

#: (spec_types, draft) cases: n-gram drafters need no draft model
DRAFTERS = [(("ngram-simple",), None), (("ngram-cache",), None),
            (("ngram-cache", "ngram-simple"), None), (("draft-simple", "ngram-cache"), "layers:1"),
            (("ngram-simple", "draft-simple"), "other")]


def repeating_prompts(n: int) -> list[list[int]]:
    """Prompts that repeat themselves, so that the n-gram drafters find something."""
    return [p + p[1:] + p[1:] for p in prompts(n, words=3)]


@settings(deadline=None, max_examples=10)
@given(arrivals=st.lists(st.integers(0, 4), min_size=1, max_size=3),
       lengths=st.lists(st.integers(1, 16), min_size=3, max_size=3),
       n_slots=st.integers(1, 3), drafters=st.sampled_from(DRAFTERS),
       size_n=st.integers(1, 3), size_m=st.integers(1, 6), unified=st.booleans())
def test_greedy_answers_with_any_drafter_equal_each_prompt_alone(arrivals, lengths, n_slots,
                                                                 drafters, size_n, size_m,
                                                                 unified):
    types, draft = drafters
    ps = repeating_prompts(len(arrivals))
    sched = make_spec_scheduler("reference64", draft=draft, n_slots=n_slots, n_ctx=512,
                                kv_unified=unified, draft_n_max=3, spec_types=types,
                                spec_ngram_size_n=size_n, spec_ngram_size_m=size_m)
    got = run_arrivals(sched, ps, [greedy(n) for n in lengths], arrivals)
    for i, p in enumerate(ps):
        assert got[i].tokens == alone("reference64", p, lengths[i]), (i, types)


def test_ngram_simple_drafts_what_followed_the_last_token_before():
    """The tiny model's plain answer to this prompt repeats ``16882 7540 7010``: with
    ``size_n = 1``, once ``16882`` comes again ngram-simple drafts what followed it, the
    target accepts it, and the answer is the plain one."""
    p = repeating_prompts(3)[2]
    want = alone("reference64", p, 24)
    assert want[13:16] == want[21:24] == [16882, 7540, 7010]
    sched = make_spec_scheduler("reference64", draft=None, n_slots=1,
                                spec_types=("ngram-simple",), spec_ngram_size_n=1,
                                spec_ngram_size_m=4)
    out: dict = {}
    reports = run_scheduler(sched, [Task(1, p, greedy(24), collect(out, 0))])
    assert finals(out)[0].tokens == want
    assert sum(r.n_draft_accepted for r in reports) >= 1
    assert sched.speculator.n_drafts["ngram-simple"] > 0


def test_ngram_cache_drafts_from_a_static_cache_that_knows_the_text():
    """A static cache (``-lcs``) that has seen the plain answer, two by two tokens: every
    slot's drafts are its answer, all accepted; fewer target decodes than tokens."""
    from reference.tools.lookup import ngram
    ps = prompts(3)
    want = [alone("reference64", p, 16) for p in ps]
    static: dict = {}
    for p, w in zip(ps, want, strict=True):
        text = [*p, *w]
        for i in range(2, len(text)):
            static.setdefault(ngram(text[i - 2:i]), {})[text[i]] = 2
    sched = make_spec_scheduler("reference64", draft=None, n_slots=3,
                                spec_types=("ngram-cache",),
                                ngram_caches={"static": static})
    out: dict = {}
    reports = run_scheduler(sched, [Task(i + 1, p, greedy(16), collect(out, i))
                                    for i, p in enumerate(ps)])
    n_draft = sum(r.n_draft for r in reports)
    assert n_draft > 0 and sum(r.n_draft_accepted for r in reports) == n_draft
    assert sum(r.n_decode for r in reports) < 16
    for i in range(3):
        assert finals(out)[i].tokens == want[i]


def test_every_generating_slot_drafts_in_the_same_draft_decodes():
    """Four slots generating together: a step's draft work is one batch per draft
    position (llama.cpp's ``draft()``), not one chain of decodes per slot. The accepted
    tokens the draft has not seen ride in the first of them."""
    ps = prompts(4)
    sched = make_spec_scheduler("reference64", draft="layers:1", n_slots=4, draft_n_max=3)
    calls: list[int] = []
    decode = sched.draft.decode
    sched.draft.decode = lambda b: calls.append(len(b.token)) or decode(b)
    for i, p in enumerate(ps):
        sched.add_task(Task(i + 1, p, greedy(12), lambda r: None))
    per_step = []
    while sched.step().busy:
        if all(s.state.name == "GENERATING" for s in sched.slots):
            per_step.append(list(calls))
        calls.clear()
    steady = [c for c in per_step if c]
    assert steady and all(len(c) <= 1 + 3 for c in steady), steady
    assert any(c[0] >= 4 for c in steady)  # the first batch holds every slot's row


def test_the_ngram_cache_counts_what_counting_from_scratch_counts():
    """A slot's context cache after drafts over a growing conversation equals one count of
    the whole of it; a conversation that does not extend the counted one starts again."""
    from reference.tools.lookup import ngram_cache_update
    from reference.tools.server.speculator import DraftRequest, NgramCacheDrafter

    d = NgramCacheDrafter()
    hist = [5, 6, 7, 5, 6]
    for nxt in [7, 5, 9, 9, 6]:
        d.draft([DraftRequest(0, 4, nxt, list(hist))])
        hist.append(nxt)
    want: dict = {}
    ngram_cache_update(want, 1, 4, hist, len(hist))
    assert d.seqs[0].cache == want
    d.draft([DraftRequest(0, 4, 3, [1, 2])])  # another conversation
    fresh: dict = {}
    ngram_cache_update(fresh, 1, 4, [1, 2, 3], 3)
    assert d.seqs[0].cache == fresh


def test_the_first_drafter_with_a_draft_wins_in_llama_cpps_order():
    """``common_speculative_draft``: ngram-simple, then ngram-cache, then draft-simple,
    whatever the order given; a request without a draft goes to the next; a draft is cut
    to the request's ``n_max``."""
    from reference.tools.server.speculator import DraftRequest, Speculator

    class Fixed:
        def __init__(self, name, drafts):
            self.name, self.drafts, self.n_max, self.asked = name, drafts, 9, []

        def draft(self, requests):
            self.asked.append([r.seq_id for r in requests])
            return {r.seq_id: self.drafts.get(r.seq_id, []) for r in requests}

        def forget(self, seq_id):
            pass

    a, b = Fixed("ngram-simple", {0: [1, 2, 3]}), Fixed("draft-simple", {0: [9], 1: [4, 5]})
    spec = Speculator([a, b])
    got = spec.draft([DraftRequest(0, 2, 7, [1]), DraftRequest(1, 5, 7, [1]),
                      DraftRequest(2, 5, 7, [1])])
    assert got == {0: [1, 2], 1: [4, 5]}
    assert a.asked == [[0, 1, 2]] and b.asked == [[1, 2]]
    assert spec.n_drafts == {"ngram-simple": 1, "draft-simple": 1}


@pytest.mark.parametrize("types, draft, message", [
    (("ngram-map-k",), None, "--spec-type ngram-map-k: not available here"),
    (("ngram-foo",), None, "--spec-type 'ngram-foo': unknown; llama-server's types are"),
    (("draft-simple",), None, "--spec-type draft-simple needs a draft: -md FILE"),
    (("ngram-simple",), "layers:1", "a draft model is given but --spec-type ngram-simple "
                                    "does not use it"),
])
def test_drafter_types_that_cannot_serve_are_refused(types, draft, message):
    with pytest.raises(SchedulerError, match=message):
        make_spec_scheduler("reference", draft=draft, n_slots=1, n_ctx=128, spec_types=types)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_a_recurrent_target_refuses_ngram_drafts_too(kind):
    with pytest.raises(SchedulerError, match="recurrent model .Mamba. cannot"):
        make_spec_scheduler("reference", kind, draft=None, n_slots=1, n_ctx=128,
                            spec_types=("ngram-simple",))


@pytest.mark.parametrize("argv, message", [
    (["--spec-type", "ngram-mod"], "--spec-type ngram-mod: not available here; use "
                                   "ngram-simple, ngram-cache, draft-simple"),
    (["--spec-type", "ngram,none"], "--spec-type 'ngram': unknown; llama-server's types are "
                                    "none, draft-simple, draft-eagle3, draft-mtp, "
                                    "draft-dflash, draft-dspark, ngram-simple, ngram-map-k, "
                                    "ngram-map-k4v, ngram-mod, ngram-cache"),
    (["--spec-type", "draft-simple"], "--spec-type draft-simple needs a draft: -md FILE or "
                                      "--draft-layers K"),
    (["--draft-layers", "1", "--spec-type", "ngram-cache"],
     "a draft model is given but --spec-type ngram-cache does not use it: add draft-simple"),
    (["-lcs", "x.bin"], "-lcs/--lookup-cache-static is read by --spec-type ngram-cache only"),
    (["--spec-type", "ngram-cache", "-lcd", "no/such.bin"],
     "-lcd/--lookup-cache-dynamic: no such file"),
    (["--spec-ngram-simple-size-n", "0"], "--spec-ngram-simple-size-n = 0 must be between 1 "
                                          "and 1024"),
    (["--spec-ngram-simple-size-m", "1025"], "--spec-ngram-simple-size-m = 1025 must be "
                                             "between 1 and 1024"),
    (["--spec-ngram-simple-min-hits", "0"], "--spec-ngram-simple-min-hits = 0 must be >= 1"),
])
def test_bad_spec_type_flags_of_serve_are_refused_before_loading(argv, message):
    from llamaref.common import CLIError
    with pytest.raises(CLIError) as e:
        serve_args(*argv)
    assert str(e.value) == message


def test_serve_with_ngram_drafters_and_a_lookup_cache(tmp_path):
    """``llamaref serve --spec-type ngram-cache,ngram-simple -lcs FILE``: no draft model,
    both n-gram drafters in llama.cpp's order, the static cache read from the file; the
    slots say they speculate; a greedy answer is the answer without."""
    from llamaref.server.main import load_engine, new_state
    from reference.tools.lookup import ngram, ngram_cache_save
    path = tmp_path / "static.bin"
    ngram_cache_save({ngram([1, 2]): {3: 4}}, path)
    args = serve_args("--spec-type", "ngram-cache", "--spec-type", "ngram-simple", "-lcs",
                      str(path), "--spec-ngram-simple-size-n", "2", "-c", "256",
                      "--backend", "reference", "-np", "2")
    sched = load_engine(args, new_state(args)).scheduler
    assert sched.draft is None and sched.speculator.types == ["ngram-simple", "ngram-cache"]
    assert sched.speculator.drafters[1].nc_static == {ngram([1, 2]): {3: 4}}
    prompt = sched.tokenizer.tokenize("one two three one two three one two", add_special=True,
                                      parse_special=True)
    out: dict = {}
    run_scheduler(sched, [Task(1, prompt, greedy(8, cache_prompt=False), collect(out, 0))])
    plain = serve_args("-c", "256", "--backend", "reference", "-np", "2")
    sched2 = load_engine(plain, new_state(plain)).scheduler
    assert sched2.speculator is None
    run_scheduler(sched2, [Task(2, prompt, greedy(8, cache_prompt=False), collect(out, 1))])
    assert finals(out)[0].tokens == finals(out)[1].tokens
