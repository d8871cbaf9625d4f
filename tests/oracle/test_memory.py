"""The memory and decode semantics against llama.cpp's own context (low-level API).

Two groups of tests:

1. **llama.cpp's self-consistency** (always run): the scripted scenarios of
   :mod:`tests.support.scenarios` run on :class:`llamaref.llamacpp.LlamaCppContext` and must show
   the laws the reference is held to, on llama.cpp itself: interleaved multi-sequence batches
   and small ``n_ubatch`` give each sequence's logits decoded alone, ``seq_cp`` branches equal
   independent decodes, ``seq_add`` / context shift equal a fresh decode at the shifted
   positions, a batch that does not fit (rc 1) and invalid batches (rc -1) change nothing.
   They also pin what llama.cpp does that the reference does not copy: ``n_ctx`` padding, the
   per-stream ``seq_keep``, and ``seq_div``'s K rotated the wrong way (proven by rebuilding
   llama.cpp's wrong cache with the reference forward).
2. **The reference Context against llama.cpp** (:class:`reference.context.Context`): every scenario
   gives the same return codes, ``seq_rm`` results, positions and logits (NMSE <= 1e-6), and
   after ``seq_div`` our logits equal llama.cpp's *fresh* decode.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.scenarios import (
    SCENARIOS,
    Clear,
    Decode,
    compare_observations,
    decode_logits,
    run,
    tiny_model,
)
from tests.support.tiny_models import nmse, write_tiny_gguf

pytest.importorskip("llama_cpp")

from llamaref.llamacpp import LlamaCppContext  # noqa: E402

MAX_NMSE = 1e-6


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """The tiny models of :data:`tests.support.scenarios.MODELS`, written as GGUF."""
    folder = tmp_path_factory.mktemp("oracle_memory")
    return {
        name: write_tiny_gguf(folder / f"{name}.gguf", *tiny_model(name))
        for name in ("two_layer", "one_layer")
    }


@pytest.fixture(scope="module")
def llamacpp(ggufs):
    """``llamacpp(name)``: the observations of scenario ``name`` on llama.cpp (memoized)."""
    done = {}

    def get(name):
        if name not in done:
            sc = SCENARIOS[name]
            with LlamaCppContext(ggufs[sc.model], **sc.context_kwargs()) as ctx:
                done[name] = run(sc, ctx)
        return done[name]

    return get


@pytest.fixture(scope="module")
def alone(ggufs):
    """``alone(tokens, model)``: llama.cpp's logits of every token, one sequence, one batch."""
    ctx = {m: LlamaCppContext(p, n_ctx=256, n_batch=256, n_ubatch=256) for m, p in ggufs.items()}

    def get(tokens, model="two_layer"):
        c = ctx[model]
        c.clear()
        n = len(tokens)
        assert c.decode(Decode(tuple(tokens), logits=(True,) * n)) == 0
        return c.get_logits()  # (n_tokens, n_vocab)

    yield get
    for c in ctx.values():
        c.close()


def per_seq(name, observations):
    """Tokens and logits of each sequence over the decodes after the scenario's last Clear."""
    steps = SCENARIOS[name].steps
    start = max((k + 1 for k, s in enumerate(steps) if isinstance(s, Clear)), default=0)
    tokens, rows = {}, {}
    for step, obs in zip(steps[start:], observations[start:], strict=True):
        if not isinstance(step, Decode):
            continue
        assert obs.rc == 0 and step.logits is not None and all(step.logits)
        seq_ids = step.seq_id or ((0,),) * len(step.token)
        for i, (t, s) in enumerate(zip(step.token, seq_ids, strict=True)):
            tokens.setdefault(s[0], []).append(t)
            rows.setdefault(s[0], []).append(obs.logits[i])
    return {s: (tokens[s], np.stack(rows[s])) for s in tokens}


# ---------------------------------------------------------------------------------------------
# 1. llama.cpp's self-consistency: the harness is proven and llama.cpp's behaviour pinned


@pytest.mark.oracle
@pytest.mark.parametrize(
    "kwargs, n_ctx, n_ctx_seq, n_batch",
    [
        (dict(n_ctx=64), 256, 256, 64),  # padded to 256; n_batch = min(n_batch, n_ctx asked)
        (dict(n_ctx=300), 512, 512, 300),
        (dict(n_ctx=256, n_seq_max=4, kv_unified=False), 1024, 256, 256),  # 4 streams of 256
        (dict(n_ctx=100, n_seq_max=3, kv_unified=False), 768, 256, 100),
        (dict(n_ctx=1024, n_seq_max=4, kv_unified=False), 1024, 256, 512),
        (dict(n_ctx=1024, n_seq_max=4, kv_unified=True), 1024, 1024, 512),
    ],
)
def test_llamacpp_pads_n_ctx_to_256_per_stream(ggufs, kwargs, n_ctx, n_ctx_seq, n_batch):
    with LlamaCppContext(ggufs["two_layer"], n_batch=512, n_ubatch=512, **kwargs) as ctx:
        assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_batch) == (n_ctx, n_ctx_seq, n_batch)
        assert ctx.n_ubatch == n_batch


@pytest.mark.oracle
@pytest.mark.parametrize(
    "name",
    [
        "multi_seq_3_unified_ub256",
        "multi_seq_4_streams_ub256",
        "multi_seq_3_unified_ub3",
        "small_ubatch_1",
        "small_ubatch_3",
        "auto_positions",
    ],
)
def test_llamacpp_each_sequence_equals_it_decoded_alone(llamacpp, alone, name):
    seqs = per_seq(name, llamacpp(name))
    assert len(seqs) >= 2
    for s, (tokens, rows) in seqs.items():
        assert nmse(alone(tokens), rows) <= MAX_NMSE, f"seq {s}"


@pytest.mark.oracle
@pytest.mark.parametrize("mode", ["unified", "streams"])
def test_llamacpp_seq_cp_branches_equal_independent_decodes(llamacpp, alone, mode):
    from tests.support.scenarios import B2, C2, D2, A

    obs = llamacpp(f"seq_cp_diverge_{mode}")
    assert [o.rc for o in obs] == [0, None, 0, None, 0]
    assert obs[1].pos == ((0, 8), (0, 8))  # seq 1 shares the prefix's cells (or a copy)
    both = obs[2].logits  # interleaved: B2[0], C2[0], B2[1], C2[1], C2[2], C2[3]
    assert nmse(alone(A + B2)[-2:], both[[0, 2]]) <= MAX_NMSE
    assert nmse(alone(A + C2)[-4:], both[[1, 3, 4, 5]]) <= MAX_NMSE
    assert nmse(alone(A + C2 + D2)[-3:], obs[4].logits) <= MAX_NMSE
    # seq_keep(1) drops seq 0 from seq 1's stream only: with one stream per sequence, seq 0
    # lives in another stream and survives (llama_kv_cache::seq_keep looks at one stream).
    assert obs[3].pos == (((-1, -1), (0, 12)) if mode == "unified" else ((0, 10), (0, 12)))


@pytest.mark.oracle
def test_llamacpp_partial_seq_rm_then_redecode_equals_fresh(llamacpp, alone):
    from tests.support.scenarios import A, B

    obs = llamacpp("seq_rm_partial")
    assert obs[1].value is True and obs[1].pos == ((0, 4),)
    assert nmse(alone(A[:5] + B)[5:], obs[2].logits) <= MAX_NMSE
    assert obs[3].value is True and obs[3].pos == ((0, 11),)  # a hole at 2, 3: pos_max stays


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["context_shift", "seq_add"])
def test_llamacpp_shift_equals_fresh_decode_at_shifted_positions(llamacpp, name):
    shifted, fresh = llamacpp(name), llamacpp(f"{name}_fresh")
    assert shifted[-1].pos == fresh[-1].pos
    assert nmse(decode_logits(fresh)[-1], decode_logits(shifted)[-1]) <= MAX_NMSE


class _ExplicitKV:
    """A one-sequence cache for the reference forward with K roped at chosen positions and
    cells at other positions: enough to rebuild the cache llama.cpp holds after ``seq_div``."""

    def __init__(self, hp):
        self.hp = hp
        width = hp.n_head_kv * hp.n_embd_head_k
        self.k = [np.zeros((0, width), np.float32) for _ in range(hp.n_layer)]
        self.v = [np.zeros((0, width), np.float32) for _ in range(hp.n_layer)]
        self.cell_pos = np.zeros(0, np.int64)

    def ubatch(self, cell_pos):
        kv, cell_pos = self, np.asarray(cell_pos)
        all_pos = np.concatenate([self.cell_pos, cell_pos])
        mask = np.where(all_pos[None, :] <= cell_pos[:, None], 0.0, -np.inf).astype(np.float32)
        self.cell_pos = all_pos

        class Inp:
            def cpy_k(self, il, k_cur):
                kv.k[il] = np.concatenate([kv.k[il], k_cur.reshape(len(k_cur), -1)])

            def cpy_v(self, il, v_cur):
                kv.v[il] = np.concatenate([kv.v[il], v_cur.reshape(len(v_cur), -1)])

            def get_k(self, il):
                return kv.k[il].reshape(len(kv.k[il]), kv.hp.n_head_kv, -1)

            def get_v(self, il):
                return kv.v[il].reshape(len(kv.v[il]), kv.hp.n_head_kv, -1)

            def get_kq_mask(self, il):
                return mask

            n_stream = 1

        return Inp()


@pytest.mark.oracle
def test_llamacpp_seq_div_rotates_keys_the_wrong_way(llamacpp, ggufs):
    """llama.cpp's ``pos_div`` records ``shift = p_old - p_new`` (``pos_add`` records
    ``p_new - p_old``), so K ends up roped at ``2 p_old - p_new`` instead of ``p_new``."""
    from reference.model_loader import load_model
    from reference.models.llama import llama_forward
    from tests.support.scenarios import A, B

    divided, fresh = llamacpp("seq_div"), llamacpp("seq_div_fresh")
    assert divided[1].pos == ((0, 2),) and divided[-1].pos == fresh[-1].pos == ((0, 9),)
    got, right = decode_logits(divided)[-1], decode_logits(fresh)[-1]
    assert nmse(right, got) > 1e-2  # measured 0.054: not rounding

    hp, weights = load_model(ggufs["one_layer"])
    p_old = np.arange(8)
    p_new = p_old // 3
    pos = np.arange(3, 3 + len(B))

    def keys_roped_at(k_pos):  # cells at p_new, their K roped at k_pos, then B decoded
        kv = _ExplicitKV(hp)
        llama_forward(weights, hp, np.array(A[:8]), k_pos, kv.ubatch(p_new))
        return llama_forward(weights, hp, np.array(B), pos, kv.ubatch(pos))

    assert nmse(got, keys_roped_at(2 * p_old - p_new)) <= MAX_NMSE  # measured 3e-14
    assert nmse(right, keys_roped_at(p_new)) <= MAX_NMSE  # measured 3e-14


@pytest.mark.oracle
def test_llamacpp_no_slot_returns_1_and_changes_nothing(llamacpp):
    obs, ref = llamacpp("no_slot"), llamacpp("no_slot_reference")
    assert [o.rc for o in obs] == [0, 1, 0]
    assert obs[1].pos == obs[0].pos == ((0, 199),)  # the first ubatch (32 of 56 free) undone
    np.testing.assert_array_equal(obs[2].logits, ref[1].logits)


@pytest.mark.oracle
def test_llamacpp_invalid_batches_return_minus_1_and_change_nothing(llamacpp):
    obs, ref = llamacpp("invalid"), llamacpp("invalid_reference")
    assert [o.rc for o in obs] == [0] + [-1] * 9 + [0]
    assert all(o.pos == ((0, 3), (-1, -1)) for o in obs[:-1])
    np.testing.assert_array_equal(obs[-1].logits, ref[-1].logits)


@pytest.mark.oracle
def test_llamacpp_clear_then_decode_equals_fresh(llamacpp, alone):
    from tests.support.scenarios import B

    obs = llamacpp("clear")
    assert obs[1].pos == ((-1, -1),)
    assert nmse(alone(B), obs[2].logits) <= MAX_NMSE


@pytest.mark.oracle
def test_llamacpp_state_save_clear_restore_continue(ggufs):
    """``llama_state_get_data`` / ``set_data`` and the per-sequence variants round-trip."""
    from tests.support.scenarios import A, B

    with LlamaCppContext(ggufs["two_layer"], 256, 256, 256, n_seq_max=2) as ctx:
        ctx.decode(Decode(A))
        blob, seq_blob = ctx.state_get_data(), ctx.state_seq_get_data(0)
        ctx.decode(Decode(B, logits=(True,) * len(B)))
        straight = ctx.get_logits()
        ctx.clear()
        assert ctx.state_set_data(blob) == len(blob)
        assert ctx.seq_pos_max(0) == len(A) - 1
        assert ctx.decode(Decode(B, logits=(True,) * len(B))) == 0
        np.testing.assert_array_equal(ctx.get_logits(), straight)
        ctx.clear()
        assert ctx.state_seq_set_data(seq_blob, 1) == len(seq_blob)
        assert (ctx.seq_pos_max(0), ctx.seq_pos_max(1)) == (-1, len(A) - 1)
        assert ctx.decode(Decode(B, seq_id=((1,),) * len(B), logits=(True,) * len(B))) == 0
        np.testing.assert_array_equal(ctx.get_logits(), straight)


@pytest.mark.oracle
def test_wrapper_refuses_what_llamacpp_would_abort_on(ggufs):
    with LlamaCppContext(ggufs["two_layer"], 256, 16, 16, n_seq_max=2, kv_unified=False) as ctx:
        with pytest.raises(ValueError, match="n_batch"):
            ctx.decode(Decode(tuple(range(17))))
        with pytest.raises(ValueError, match="seq_id"):
            ctx.seq_rm(-2, 0, -1)
        with pytest.raises(ValueError, match="seq_id"):
            ctx.seq_pos_max(2)  # per-stream: seq ids < n_seq_max
        with pytest.raises(ValueError, match="whole range"):
            ctx.seq_cp(0, 1, 0, 4)
        assert ctx.decode(Decode((1, 2, 3), logits=(True, False, True))) == 0
        assert ctx.get_logits().shape == (2, 64)
        np.testing.assert_array_equal(ctx.get_logits_ith(-1), ctx.get_logits_ith(2))
        with pytest.raises(IndexError):
            ctx.get_logits_ith(1)  # not an output


# ---------------------------------------------------------------------------------------------
# 2. The reference Context against llama.cpp


def reference_context(ggufs, name):
    """Our Context for scenario ``name``, on the same GGUF llama.cpp loads."""
    from reference.context import Context
    from reference.model_loader import load_model

    sc = SCENARIOS[name]
    hp, weights = load_model(ggufs[sc.model])
    return Context(hp, weights, dtype=np.float32, **sc.context_kwargs())


SAME_AS_LLAMACPP = sorted(set(SCENARIOS) - {"seq_div"})


@pytest.mark.oracle
@pytest.mark.parametrize("name", SAME_AS_LLAMACPP)
def test_reference_matches_llamacpp(llamacpp, ggufs, name):
    ours = run(SCENARIOS[name], reference_context(ggufs, name))
    assert compare_observations(llamacpp(name), ours, MAX_NMSE) == []


@pytest.mark.oracle
def test_reference_seq_div_equals_llamacpp_fresh_decode(llamacpp, ggufs):
    """Where llama.cpp is wrong (see the test above) ours equals its fresh decode."""
    ours = run(SCENARIOS["seq_div"], reference_context(ggufs, "seq_div"))
    divided, fresh = llamacpp("seq_div"), llamacpp("seq_div_fresh")
    assert [o.pos for o in ours] == [o.pos for o in divided]
    assert [o.rc for o in ours] == [o.rc for o in divided]
    assert nmse(decode_logits(fresh)[-1], decode_logits(ours)[-1]) <= MAX_NMSE
    assert nmse(decode_logits(divided)[-1], decode_logits(ours)[-1]) > 1e-2


@pytest.mark.oracle
@pytest.mark.parametrize("kwargs", [
    dict(n_ctx=64),
    dict(n_ctx=300),
    dict(n_ctx=256, n_seq_max=4, kv_unified=False),
    dict(n_ctx=100, n_seq_max=3, kv_unified=False),
    dict(n_ctx=1024, n_seq_max=4, kv_unified=False),
    dict(n_ctx=1024, n_seq_max=4, kv_unified=True),
    dict(n_ctx=512, n_batch=2048, n_ubatch=0),
])
def test_reference_context_sizes_match_llamacpp(ggufs, kwargs):
    from reference.context import Context
    from reference.model_loader import load_model

    kwargs = dict(dict(n_batch=512, n_ubatch=512), **kwargs)
    hp, weights = load_model(ggufs["two_layer"])
    ours = Context(hp, weights, **kwargs)
    with LlamaCppContext(ggufs["two_layer"], **kwargs) as ctx:
        theirs = (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_batch, ctx.n_ubatch)
    assert (ours.n_ctx, ours.n_ctx_seq, ours.n_batch, ours.n_ubatch) == theirs
    assert ours.memory.get_size() == ours.n_ctx_seq


@pytest.mark.oracle
def test_reference_get_logits_ith_indexing_matches_llamacpp(ggufs):
    """Batch indices for ``i >= 0``, output rows counted from the end for ``i < 0``."""
    from reference.batch import Batch
    from reference.context import Context, ContextError
    from reference.model_loader import load_model

    hp, weights = load_model(ggufs["two_layer"])
    ours = Context(hp, weights, n_ctx=256, n_batch=16, n_ubatch=2)
    flags = (False, True, False, True, True, False)
    tokens = (5, 6, 7, 8, 9, 10)
    assert ours.decode(Batch(token=list(tokens), logits=list(flags))) == 0
    with LlamaCppContext(ggufs["two_layer"], 256, 16, 2) as ctx:
        assert ctx.decode(Decode(tokens, logits=flags)) == 0
        for i in (1, 3, 4, -1, -2, -3):
            assert nmse(ctx.get_logits_ith(i), ours.get_logits_ith(i)) <= MAX_NMSE, i
        assert nmse(ctx.get_logits(), ours.get_logits()) <= MAX_NMSE
        for i in (0, 2, 5):
            with pytest.raises(IndexError):
                ctx.get_logits_ith(i)
            with pytest.raises(ContextError, match=rf"batch.logits\[{i}\] != true"):
                ours.get_logits_ith(i)
    with pytest.raises(ContextError, match="negative index out of range"):
        ours.get_logits_ith(-4)
