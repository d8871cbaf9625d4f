"""Mamba and Mamba-2 in the reference: laws of the forward pass, in float64.

- chunked prefill == token by token == one prefill (the recurrence carries everything);
- several sequences in one ubatch == each alone;
- the whole model equals an explicit per-token loop written from the formulas, without
  ``ssm_conv``/``ssm_scan`` (the spec of the spec);
- the state rows have the layout the memory contract states;
- hparams: GGUF metadata round trip, ``n_embd_r``/``n_embd_s``, refusals.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.arch import (
    hparams_from_file,
    hparams_from_gguf,
    mamba_hparams_from_gguf,
    mamba_metadata,
)
from reference.gguf import GGUFError, read_gguf
from reference.hparams import HParamsError, MambaHParams
from reference.models.llama import LlamaForwardError
from reference.models.mamba import (
    MambaForwardError,
    SimpleRecurrentState,
    mamba_forward,
)
from tests.support.tiny_models import (
    mamba_reference_logits,
    random_mamba_weights,
    tiny_mamba_hparams,
    write_tiny_mamba_gguf,
)

MODELS = {
    "mamba": dict(arch="mamba"),
    "mamba-rms": dict(arch="mamba", dt_b_c_rms=True, dt_rank=3),
    "mamba2-g1": dict(arch="mamba2", n_group=1, head_dim=8),
    "mamba2-g2": dict(arch="mamba2", n_group=2, head_dim=4, d_state=4),
    "mamba2-d2": dict(arch="mamba2", n_group=4, head_dim=4, d_conv=2),
}


def model(name: str, seed: int = 0, dtype=np.float64):
    hp = tiny_mamba_hparams(n_vocab=24, **MODELS[name])
    return hp, random_mamba_weights(hp, seed=seed, dtype=dtype)


def chunkings(n: int):
    """Ways to cut ``n`` tokens into consecutive chunks."""
    return st.lists(st.booleans(), min_size=n - 1, max_size=n - 1).map(
        lambda cuts: _sizes(cuts)
    )


def _sizes(cuts: list[bool]) -> list[int]:
    sizes = [1]
    for cut in cuts:
        if cut:
            sizes.append(1)
        else:
            sizes[-1] += 1
    return sizes


# ---------------------------------------------------------------------------------------------
# The recurrence


@given(name=st.sampled_from(sorted(MODELS)), seed=st.integers(0, 2**16), data=st.data())
def test_chunked_equals_token_by_token_equals_prefill(name, seed, data):
    hp, w = model(name, seed)
    n = data.draw(st.integers(1, 12), label="n_tokens")
    tokens = np.random.default_rng(seed).integers(0, hp.n_vocab, n)
    prefill = mamba_reference_logits(w, hp, tokens)
    steps = mamba_reference_logits(w, hp, tokens, chunks=[1] * n)
    chunks = data.draw(chunkings(n), label="chunks")
    chunked = mamba_reference_logits(w, hp, tokens, chunks=chunks)
    np.testing.assert_allclose(steps, prefill, rtol=0, atol=1e-10)
    np.testing.assert_allclose(chunked, prefill, rtol=0, atol=1e-10)


@given(name=st.sampled_from(sorted(MODELS)), seed=st.integers(0, 2**16),
       n_seqs=st.integers(2, 4), n_seq_tokens=st.integers(1, 5))
def test_sequences_in_one_ubatch_equal_each_alone(name, seed, n_seqs, n_seq_tokens):
    hp, w = model(name, seed)
    rng = np.random.default_rng(seed)
    history = rng.integers(0, hp.n_vocab, (n_seqs, 3))  # a different past per sequence
    tokens = rng.integers(0, hp.n_vocab, (n_seqs, n_seq_tokens))
    state = SimpleRecurrentState(hp, n_seqs, np.float64)
    mamba_forward(w, hp, history, state.init_batch())
    together = mamba_forward(w, hp, tokens, state.init_batch())  # (n_seqs * n_seq_tokens, n_vocab)
    for s in range(n_seqs):
        alone = mamba_reference_logits(w, hp, np.concatenate([history[s], tokens[s]]))
        rows = together[s * n_seq_tokens : (s + 1) * n_seq_tokens]
        np.testing.assert_allclose(rows, alone[3:], rtol=0, atol=1e-10)


def test_out_ids_select_rows_and_keep_the_state():
    hp, w = model("mamba2-g2")
    tokens = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    full_state, some_state = (SimpleRecurrentState(hp, 2, np.float64) for _ in range(2))
    full = mamba_forward(w, hp, tokens, full_state.init_batch())
    some = mamba_forward(w, hp, tokens, some_state.init_batch(), out_ids=np.array([7, 3]))
    np.testing.assert_allclose(some, full[[7, 3]], rtol=0, atol=1e-12)
    for il in range(hp.n_layer):  # the states do not depend on which rows get logits
        np.testing.assert_array_equal(full_state.get_s(il), some_state.get_s(il))
        np.testing.assert_array_equal(full_state.get_r(il), some_state.get_r(il))


# ---------------------------------------------------------------------------------------------
# The spec of the spec: the model as an explicit loop over tokens, from the formulas


def _softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def _silu(x):
    return x / (1 + np.exp(-x))


def _rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def loop_logits(w: dict, hp: MambaHParams, tokens) -> np.ndarray:
    """One sequence, token by token, with explicit conv windows and the SSM recurrence."""
    d_inner, N, K = hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_d_conv
    eps = hp.f_norm_rms_eps
    conv_in = [np.zeros((K - 1, hp.conv_dim())) for _ in range(hp.n_layer)]  # past conv inputs
    h = [np.zeros((hp.n_head(), hp.head_dim(), N)) for _ in range(hp.n_layer)]
    out = []
    for tok in tokens:
        u = w["token_embd.weight"][tok]
        for il in range(hp.n_layer):
            def p(name, il=il):
                return w[f"blk.{il}.{name}"]

            v = _rms(u, eps) * p("attn_norm.weight")
            proj = p("ssm_in.weight") @ v
            if hp.arch == "mamba":  # [x, z]
                xin, z = proj[:d_inner], proj[d_inner:]
            else:  # [z, xBC, dt]
                z, xin = proj[:d_inner], proj[d_inner : d_inner + hp.conv_dim()]
            window = np.vstack([conv_in[il], xin])  # (K, conv_dim): oldest first
            conv_in[il] = window[1:]
            xc = _silu(np.einsum("kc,ck->c", window, p("ssm_conv1d.weight"))
                       + p("ssm_conv1d.bias"))
            if hp.arch == "mamba":
                x = xc
                dbc = p("ssm_x.weight") @ x
                dt_r = dbc[: hp.ssm_dt_rank]
                B = dbc[hp.ssm_dt_rank : hp.ssm_dt_rank + N]
                C = dbc[hp.ssm_dt_rank + N :]
                if hp.ssm_dt_b_c_rms:
                    dt_r, B, C = _rms(dt_r, eps), _rms(B, eps), _rms(C, eps)
                delta = _softplus(p("ssm_dt.weight") @ dt_r + p("ssm_dt.bias"))  # (d_inner,)
                A = p("ssm_a")  # (d_inner, N)
                hs = h[il][:, 0, :]  # (d_inner, N)
                hs = np.exp(delta[:, None] * A) * hs + (delta * x)[:, None] * B[None, :]
                h[il][:, 0, :] = hs
                y = hs @ C + p("ssm_d") * x
                y = y * _silu(z)
            else:
                G, P = hp.ssm_n_group, hp.head_dim()
                x = xc[:d_inner].reshape(hp.n_head(), P)
                B = xc[d_inner : d_inner + G * N].reshape(G, N)
                C = xc[d_inner + G * N :].reshape(G, N)
                delta = _softplus(proj[d_inner + hp.conv_dim() :] + p("ssm_dt.bias"))
                y = np.zeros((hp.n_head(), P))
                for head in range(hp.n_head()):
                    g = head // (hp.n_head() // G)
                    a = p("ssm_a")[head, 0]
                    h[il][head] = (np.exp(delta[head] * a) * h[il][head]
                                   + delta[head] * np.outer(x[head], B[g]))
                    y[head] = h[il][head] @ C[g] + p("ssm_d")[head, 0] * x[head]
                y = (y.reshape(-1) * _silu(z)).reshape(G, -1)
                y = (_rms(y, eps) * p("ssm_norm.weight")).reshape(-1)
            u = u + p("ssm_out.weight") @ y
        lm_head = w.get("output.weight", w["token_embd.weight"])
        out.append(lm_head @ (_rms(u, eps) * w["output_norm.weight"]))
    return np.array(out)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_equals_the_explicit_loop(name):
    hp, w = model(name, seed=11)
    tokens = np.random.default_rng(3).integers(0, hp.n_vocab, 7)
    np.testing.assert_allclose(mamba_reference_logits(w, hp, tokens), loop_logits(w, hp, tokens),
                               rtol=0, atol=1e-10)


def test_tied_output_uses_token_embd():
    hp = tiny_mamba_hparams("mamba2", tied=True)
    w = random_mamba_weights(hp, seed=2, dtype=np.float64)
    assert "output.weight" not in w
    tokens = np.array([3, 1, 4])
    np.testing.assert_allclose(mamba_reference_logits(w, hp, tokens), loop_logits(w, hp, tokens),
                               rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# The state rows: the layout of the memory contract


@pytest.mark.parametrize("name", ["mamba", "mamba2-g2"])
def test_conv_row_holds_the_last_inputs(name):
    """Row layout ``(conv_dim, d_conv - 1)``: column ``j`` is input ``n - (d_conv - 1) + j``."""
    hp, w = model(name)
    tokens = np.array([5, 9, 2, 7, 1])
    state = SimpleRecurrentState(hp, 1, np.float64)
    mamba_forward(w, hp, tokens, state.init_batch())
    u = w["token_embd.weight"][tokens]
    v = _rms(u, hp.f_norm_rms_eps) * w["blk.0.attn_norm.weight"]
    start = 0 if hp.arch == "mamba" else hp.ssm_d_inner  # Mamba-1: [x, z]; Mamba-2: [z, xBC, dt]
    xin = (v @ w["blk.0.ssm_in.weight"].T)[:, start : start + hp.conv_dim()]
    row = state.get_r(0).reshape(hp.conv_dim(), hp.ssm_d_conv - 1)
    np.testing.assert_allclose(row, xin[-(hp.ssm_d_conv - 1) :].T, rtol=0, atol=1e-12)
    assert state.get_s(0).shape == (1, hp.n_embd_s())


def test_a_new_sequence_starts_from_zero():
    hp, w = model("mamba")
    tokens = np.array([[3, 4]])
    fresh = mamba_forward(w, hp, tokens, SimpleRecurrentState(hp, 1, np.float64).init_batch())
    used = SimpleRecurrentState(hp, 1, np.float64)
    mamba_forward(w, hp, np.array([[7, 7]]), used.init_batch())
    assert np.abs(mamba_forward(w, hp, tokens, used.init_batch()) - fresh).max() > 1e-3


def test_float32_is_close_to_float64():
    hp, w64 = model("mamba2-g2")
    w32 = {k: v.astype(np.float32) for k, v in w64.items()}
    tokens = np.arange(10) % hp.n_vocab
    l32 = mamba_reference_logits(w32, hp, tokens)
    assert l32.dtype == np.float32
    np.testing.assert_allclose(l32, mamba_reference_logits(w64, hp, tokens), atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Errors


def test_forward_refuses_bad_inputs():
    hp, w = model("mamba")
    state = SimpleRecurrentState(hp, 1, np.float64)
    with pytest.raises(MambaForwardError, match="token id 99"):
        mamba_forward(w, hp, np.array([1, 99]), state.init_batch())
    with pytest.raises(MambaForwardError, match="equal sequence sets"):
        mamba_forward(w, hp, np.array([1, 2, 3]), state.init_batch(), n_seqs=2)
    with pytest.raises(MambaForwardError, match="non-empty"):
        mamba_forward(w, hp, np.array([], np.int64), state.init_batch())
    with pytest.raises(MambaForwardError, match="out_ids"):
        mamba_forward(w, hp, np.array([1, 2]), state.init_batch(), out_ids=[2])
    with pytest.raises(MambaForwardError, match="n_seqs=3"):
        mamba_forward(w, hp, np.array([[1], [2]]), state.init_batch(), n_seqs=3)
    # nothing was written: the state is still zero
    assert not any(state.get_s(il).any() or state.get_r(il).any() for il in range(hp.n_layer))
    missing = {k: v for k, v in w.items() if k != "blk.1.ssm_x.weight"}
    with pytest.raises(LlamaForwardError, match="blk.1.ssm_x.weight"):
        mamba_forward(missing, hp, np.array([1]), state.init_batch())


# ---------------------------------------------------------------------------------------------
# Hyperparameters


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gguf_metadata_round_trip(name, tmp_path):
    hp, w = model(name, dtype=np.float32)
    path = write_tiny_mamba_gguf(tmp_path / "m.gguf", hp, w)
    f = read_gguf(path)
    assert hparams_from_file(f) == hp
    assert set(f.tensors) == set(w)
    assert hparams_from_gguf(hp.arch, mamba_metadata(hp)) == hp


def test_state_sizes_are_llama_hparams():
    # llama_hparams::n_embd_r / n_embd_s: (d_conv - 1) * (d_inner + 2 * n_group * d_state)
    # and d_state * d_inner
    m1 = tiny_mamba_hparams("mamba", n_embd=16, d_state=8, d_conv=4)
    assert (m1.n_embd_r(), m1.n_embd_s(), m1.n_head(), m1.head_dim()) == (3 * 32, 8 * 32, 32, 1)
    m2 = tiny_mamba_hparams("mamba2", n_embd=16, d_state=8, d_conv=4, n_group=2, head_dim=8)
    assert (m2.n_embd_r(), m2.n_embd_s(), m2.n_head(), m2.head_dim()) == (
        3 * (32 + 2 * 2 * 8), 8 * 32, 4, 8)


MAMBA2_MD = {
    "mamba2.context_length": 64, "mamba2.embedding_length": 16, "mamba2.block_count": 1,
    "mamba2.ssm.conv_kernel": 4, "mamba2.ssm.inner_size": 32, "mamba2.ssm.state_size": 8,
    "mamba2.ssm.time_step_rank": 4, "mamba2.ssm.group_count": 2,
    "mamba2.attention.layer_norm_rms_epsilon": 1e-5, "mamba2.vocab_size": 32,
}


@pytest.mark.parametrize(
    "change, match",
    [
        ({"mamba2.ssm.group_count": None}, "mamba2.ssm.group_count"),
        ({"mamba2.ssm.state_size": None}, "mamba2.ssm.state_size"),
        ({"mamba2.ssm.group_count": 3}, "multiple of ssm_n_group=3"),
        ({"mamba2.ssm.time_step_rank": 5}, "multiple of the head count"),
        ({"mamba2.ssm.conv_kernel": 0}, "ssm_d_conv must be positive"),
        ({"mamba2.ssm.inner_size": "32"}, "must be an integer"),
        ({"mamba2.block_count": 0}, "must be > 0"),
    ],
)
def test_hparams_from_gguf_refuses(change, match):
    md = dict(MAMBA2_MD, **change)
    md = {k: v for k, v in md.items() if v is not None}
    with pytest.raises(GGUFError, match=match):
        mamba_hparams_from_gguf("mamba2", md)


def test_mamba_reads_its_own_keys_only():
    md = {k.replace("mamba2.", "mamba."): v for k, v in MAMBA2_MD.items()}
    hp = mamba_hparams_from_gguf("mamba", md)  # group_count is not a mamba key: ignored
    assert (hp.ssm_n_group, hp.ssm_dt_b_c_rms) == (0, False)
    assert mamba_hparams_from_gguf("mamba", {**md, "mamba.ssm.dt_b_c_rms": True}).ssm_dt_b_c_rms
    with pytest.raises(GGUFError, match="must be a bool"):
        mamba_hparams_from_gguf("mamba", {**md, "mamba.ssm.dt_b_c_rms": 1})


def test_hparams_refuse_inconsistent_sizes():
    hp = tiny_mamba_hparams("mamba2", n_group=2)
    with pytest.raises(HParamsError, match="ssm_n_group must be positive"):
        dataclasses.replace(hp, ssm_n_group=0)
    with pytest.raises(HParamsError, match="mamba: ssm_n_group must be 0"):
        dataclasses.replace(hp, arch="mamba")
    with pytest.raises(HParamsError, match="dt_b_c_rms"):
        dataclasses.replace(hp, ssm_dt_b_c_rms=True)
    with pytest.raises(HParamsError, match="not one of"):
        dataclasses.replace(hp, arch="llama")
