"""ssm_conv and ssm_scan: against explicit loops, chunking, state selection, ggml's CPU backend."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.ops import ssm_conv, ssm_scan
from reference.ops.errors import OpIndexError, OpShapeError, OpTypeError
from reference.ops.ssm import compute_softplus
from tests.support.tiny_models import nmse

# ---------------------------------------------------------------------------------------------
# Inputs


@st.composite
def scan_cases(draw, min_tokens: int = 1):
    """Random ssm_scan inputs in float64: either A form, any head/group layout, spare rows."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mamba1 = draw(st.booleans())  # A (n_head, d_state) or (n_head, 1)
    n_group = draw(st.integers(1, 3))
    n_head = n_group * draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 3))
    d_state = draw(st.integers(1, 5))
    n_seqs = draw(st.integers(1, 3))
    n_seq_tokens = draw(st.integers(min_tokens, 6))
    n_rs = n_seqs + draw(st.integers(0, 2))
    s = rng.standard_normal((n_rs, n_head, head_dim, d_state))
    x = rng.standard_normal((n_seqs, n_seq_tokens, n_head, head_dim))
    dt = rng.uniform(-6.0, 6.0, (n_seqs, n_seq_tokens, n_head))
    A = -np.exp(rng.standard_normal((n_head, d_state if mamba1 else 1)))
    B = rng.standard_normal((n_seqs, n_seq_tokens, n_group, d_state))
    C = rng.standard_normal((n_seqs, n_seq_tokens, n_group, d_state))
    ids = rng.integers(0, n_rs, n_seqs)  # repeats allowed: two sequences, one starting state
    return s, x, dt, A, B, C, ids


@st.composite
def conv_cases(draw):
    """Random ssm_conv inputs in float64: conv state (n_seqs, conv_dim, d_conv - 1), inputs."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_seqs, conv_dim = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    d_conv, n_seq_tokens = draw(st.integers(1, 5)), draw(st.integers(0, 8))
    state = rng.standard_normal((n_seqs, conv_dim, d_conv - 1))
    u = rng.standard_normal((n_seqs, conv_dim, n_seq_tokens))  # new inputs, token axis last
    c = rng.standard_normal((conv_dim, d_conv))
    return state, u, c


# ---------------------------------------------------------------------------------------------
# The spec of the spec: the same math, as plain Python loops over scalars


def scan_loop(s, x, dt, A, B, C, ids):
    """The selective scan, one scalar at a time, as written in the Mamba paper."""
    n_seqs, n_seq_tokens, n_head, head_dim = x.shape
    d_state, n_group = s.shape[3], B.shape[2]
    y = np.zeros(x.shape)
    final = np.zeros((n_seqs, n_head, head_dim, d_state))
    for i in range(n_seqs):
        h = s[ids[i]].tolist()  # h[head][p][n], plain floats
        for t in range(n_seq_tokens):
            for hd in range(n_head):
                d = float(dt[i, t, hd])
                delta = d if d > 20 else math.log1p(math.exp(d))  # official softplus
                g = hd // (n_head // n_group)  # consecutive heads share a group
                for p in range(head_dim):
                    acc = 0.0
                    for n in range(d_state):
                        a = A[hd, n] if A.shape[1] == d_state else A[hd, 0]
                        h[hd][p][n] = (math.exp(delta * a) * h[hd][p][n]
                                       + delta * x[i, t, hd, p] * B[i, t, g, n])
                        acc += h[hd][p][n] * C[i, t, g, n]
                    y[i, t, hd, p] = acc
        final[i] = h
    return y, final


def conv_loop(sx, c):
    """The causal depthwise convolution, one output at a time."""
    n_seqs, conv_dim, n_cols = sx.shape
    d_conv = c.shape[1]
    n_seq_tokens = n_cols - d_conv + 1
    y = np.zeros((n_seqs, n_seq_tokens, conv_dim))
    for i in range(n_seqs):
        for t in range(n_seq_tokens):
            for d in range(conv_dim):
                y[i, t, d] = sum(sx[i, d, t + k] * c[d, k] for k in range(d_conv))
    return y


# ---------------------------------------------------------------------------------------------
# (1) ssm_scan == the explicit recurrence


@given(scan_cases())
def test_scan_equals_the_explicit_recurrence(case):
    y, states = ssm_scan(*case)
    y_ref, states_ref = scan_loop(*case)
    assert y.dtype == np.float64 and states.shape == states_ref.shape
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(states, states_ref, rtol=1e-12, atol=1e-12)


def test_scan_mamba1_mamba2_and_groups_are_all_exercised():
    """The three layouts the property draws, pinned once: Mamba-1, Mamba-2, 3 groups."""
    rng = np.random.default_rng(3)
    for n_head, head_dim, n_group, a_cols in [(6, 1, 1, 4), (4, 3, 1, 1), (6, 2, 3, 1)]:
        d_state, n_seqs, n_t = 4, 2, 5
        case = (
            rng.standard_normal((n_seqs, n_head, head_dim, d_state)),
            rng.standard_normal((n_seqs, n_t, n_head, head_dim)),
            rng.uniform(-3, 3, (n_seqs, n_t, n_head)),
            -np.exp(rng.standard_normal((n_head, a_cols))),
            rng.standard_normal((n_seqs, n_t, n_group, d_state)),
            rng.standard_normal((n_seqs, n_t, n_group, d_state)),
            np.array([1, 0]),
        )
        for got, ref in zip(ssm_scan(*case), scan_loop(*case), strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_groups_are_blocks_of_consecutive_heads():
    """Head h reads group h // (n_head // n_group), not h % n_group (repeat_interleave)."""
    n_head, n_group = 4, 2
    s = np.zeros((1, n_head, 1, 1))
    x = np.ones((1, 1, n_head, 1))
    dt = np.full((1, 1, n_head), 30.0)  # softplus(30) == 30
    A = np.zeros((n_head, 1))
    B = np.ones((1, 1, n_group, 1))
    C = np.array([1.0, 2.0]).reshape(1, 1, n_group, 1)  # group 0 -> 1, group 1 -> 2
    y, _ = ssm_scan(s, x, dt, A, B, C, np.array([0]))
    np.testing.assert_array_equal(y.ravel(), [30.0, 30.0, 60.0, 60.0])


SCAN_ARG_NAMES = ("s", "x", "dt", "A", "B", "C")


@pytest.mark.parametrize("wide", [None, *SCAN_ARG_NAMES])
def test_scan_computes_in_the_common_dtype_of_its_float_inputs(wide):
    """One float64 input among float32 ones makes the whole scan float64: the result is the
    all-float64 scan of the same values, bit for bit; all float32 stays float32."""
    rng = np.random.default_rng(11)
    case = dict(zip(SCAN_ARG_NAMES, (
        rng.standard_normal((2, 4, 2, 3)), rng.standard_normal((2, 3, 4, 2)),
        rng.uniform(-3, 3, (2, 3, 4)), -np.exp(rng.standard_normal((4, 3))),
        rng.standard_normal((2, 3, 2, 3)), rng.standard_normal((2, 3, 2, 3)),
    ), strict=True))
    narrow = {k: v.astype(np.float32) for k, v in case.items()}
    mixed = {k: case[k] if k == wide else narrow[k] for k in SCAN_ARG_NAMES}
    ids = np.array([1, 0])
    y, states = ssm_scan(**mixed, ids=ids)
    want_dtype = np.float32 if wide is None else np.float64
    assert y.dtype == want_dtype and states.dtype == want_dtype
    y_want, states_want = ssm_scan(**{k: v.astype(want_dtype) for k, v in mixed.items()},
                                   ids=ids)
    np.testing.assert_array_equal(y, y_want)
    np.testing.assert_array_equal(states, states_want)


def test_float32_scan_rounds_every_step_in_float32():
    """float32 in: every product and sum is a float32 one (ggml's float kernel), checked
    bit for bit against a loop over np.float32 scalars. dt > 20 and A = 0 keep the softplus
    and the decay exact (Δ = dt, e^0 = 1); d_state = 2 makes the sum order irrelevant."""
    f = np.float32
    rng = np.random.default_rng(4)
    n_seqs, n_t, n_head, head_dim, d_state = 2, 4, 2, 3, 2
    s = rng.standard_normal((n_seqs, n_head, head_dim, d_state)).astype(f)
    x = rng.standard_normal((n_seqs, n_t, n_head, head_dim)).astype(f)
    dt = rng.uniform(21, 30, (n_seqs, n_t, n_head)).astype(f)
    A = np.zeros((n_head, 1), f)
    B = rng.standard_normal((n_seqs, n_t, 1, d_state)).astype(f)
    C = rng.standard_normal((n_seqs, n_t, 1, d_state)).astype(f)
    y, states = ssm_scan(s, x, dt, A, B, C, np.arange(n_seqs))
    h = s.copy()
    for i, t, hd, p in np.ndindex(n_seqs, n_t, n_head, head_dim):
        x_dt = x[i, t, hd, p] * dt[i, t, hd]  # np.float32 * np.float32: a float32 rounding
        for n in range(d_state):
            h[i, hd, p, n] = h[i, hd, p, n] + B[i, t, 0, n] * x_dt
        want = h[i, hd, p, 0] * C[i, t, 0, 0] + h[i, hd, p, 1] * C[i, t, 0, 1]
        assert y[i, t, hd, p] == want, (i, t, hd, p)
    np.testing.assert_array_equal(states, h)


# ---------------------------------------------------------------------------------------------
# (2) chunking: the returned state is all the scan needs to go on


@given(scan_cases(min_tokens=2), st.data())
def test_scan_in_two_chunks_equals_scan_at_once(case, data):
    s, x, dt, A, B, C, ids = case
    t = data.draw(st.integers(1, x.shape[1] - 1))
    y, states = ssm_scan(s, x, dt, A, B, C, ids)
    y1, states1 = ssm_scan(s, x[:, :t], dt[:, :t], A, B[:, :t], C[:, :t], ids)
    rows = np.arange(x.shape[0])  # the returned states are in sequence order
    y2, states2 = ssm_scan(states1, x[:, t:], dt[:, t:], A, B[:, t:], C[:, t:], rows)
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(states2, states, rtol=1e-12, atol=1e-12)


@given(scan_cases())
def test_scan_token_by_token_equals_scan_at_once(case):
    s, x, dt, A, B, C, ids = case
    y, states = ssm_scan(s, x, dt, A, B, C, ids)
    rows = np.arange(x.shape[0])
    state, outs = s[ids], []
    for t in range(x.shape[1]):
        y_t, state = ssm_scan(state, x[:, t:t + 1], dt[:, t:t + 1], A, B[:, t:t + 1],
                              C[:, t:t + 1], rows)
        outs.append(y_t)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state, states, rtol=1e-12, atol=1e-12)


def test_scan_of_zero_tokens_returns_the_selected_states():
    s = np.arange(12.0).reshape(3, 2, 1, 2)
    x, dt = np.zeros((2, 0, 2, 1)), np.zeros((2, 0, 2))
    B = C = np.zeros((2, 0, 1, 2))
    y, states = ssm_scan(s, x, dt, np.zeros((2, 1)), B, C, np.array([2, 0]))
    assert y.shape == (2, 0, 2, 1)
    np.testing.assert_array_equal(states, s[[2, 0]])


# ---------------------------------------------------------------------------------------------
# (3) ssm_conv == the explicit convolution; chunks carrying the last d_conv - 1 columns


@given(conv_cases())
def test_conv_equals_the_explicit_loop(case):
    state, u, c = case
    sx = np.concatenate([state, u], axis=-1)  # (n_seqs, conv_dim, d_conv - 1 + n_seq_tokens)
    y = ssm_conv(sx, c)
    assert y.shape == (u.shape[0], u.shape[2], u.shape[1])
    np.testing.assert_allclose(y, conv_loop(sx, c), rtol=1e-13, atol=1e-13)


@given(conv_cases(), st.data())
def test_conv_in_chunks_carrying_the_state_equals_conv_at_once(case, data):
    state, u, c = case
    n_seq_tokens = u.shape[2]
    t = data.draw(st.integers(0, n_seq_tokens))
    whole = ssm_conv(np.concatenate([state, u], axis=-1), c)
    sx1 = np.concatenate([state, u[..., :t]], axis=-1)
    state1 = sx1[..., t:]  # the model's copy: the last d_conv - 1 columns (offset n_seq_tokens)
    assert state1.shape == state.shape
    sx2 = np.concatenate([state1, u[..., t:]], axis=-1)
    chunks = np.concatenate([ssm_conv(sx1, c), ssm_conv(sx2, c)], axis=1)
    np.testing.assert_array_equal(chunks, whole)  # the same products, summed in the same order


def test_conv_reads_non_contiguous_inputs():
    """The self-overlapping view is built from sx's own strides, whatever they are."""
    rng = np.random.default_rng(5)
    big = rng.standard_normal((2, 7, 12))
    sx = big[:, ::2, 1::2]  # (2, 4, 6), strided in both axes
    c = rng.standard_normal((4, 3))
    np.testing.assert_allclose(ssm_conv(sx, c), conv_loop(np.ascontiguousarray(sx), c),
                               rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# (4) ids: each sequence starts from the state row it names


@given(scan_cases(), st.data())
def test_ids_select_the_state_rows(case, data):
    s, x, dt, A, B, C, ids = case
    y, states = ssm_scan(s, x, dt, A, B, C, ids)
    y0, states0 = ssm_scan(s[ids], x, dt, A, B, C, np.arange(len(ids)))
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(states, states0)
    perm = np.asarray(data.draw(st.permutations(range(len(ids)))), dtype=int)
    y_p, states_p = ssm_scan(s, x[perm], dt[perm], A, B[perm], C[perm], ids[perm])
    np.testing.assert_array_equal(y_p, y[perm])
    np.testing.assert_array_equal(states_p, states[perm])


def test_the_state_rows_are_not_modified():
    rng = np.random.default_rng(2)
    s = rng.standard_normal((3, 2, 1, 4))
    before = s.copy()
    ssm_scan(s, rng.standard_normal((2, 3, 2, 1)), rng.standard_normal((2, 3, 2)),
             -np.ones((2, 4)), rng.standard_normal((2, 3, 1, 4)),
             rng.standard_normal((2, 3, 1, 4)), np.array([2, 2]))
    np.testing.assert_array_equal(s, before)


# ---------------------------------------------------------------------------------------------
# (5) softplus: the threshold at 20, ggml's log(1 + exp(x))


@given(st.floats(-30.0, 60.0, allow_nan=False))
def test_softplus_threshold_at_20(v):
    got = float(compute_softplus(np.float64(v)))
    if v > 20.0:
        assert got == v
    else:
        # the formula with NumPy's exp: libm's exp may differ from it in the last bit, and
        # 1 + e^v then rounds to a neighbour, which the log turns into several ulps of a small
        # result (v = -2.015625: 7 ulps). NumPy's log and libm's differ by at most one ulp.
        want = math.log(1.0 + float(np.exp(np.float64(v))))
        assert abs(got - want) <= math.ulp(want)


def test_softplus_jump_at_the_threshold_is_below_float32_resolution():
    just_below = float(compute_softplus(np.float64(20.0)))
    assert just_below != 20.0 and 0 < just_below - 20.0 < 3e-9
    assert float(compute_softplus(np.float32(20.0))) == 20.0  # log(1 + e^20) rounds to 20
    assert compute_softplus(np.float32(20.0)).dtype == np.float32


def test_softplus_of_very_negative_dt_is_zero_in_float32_like_ggml():
    """ggml writes logf(1 + expf(x)); the official kernel log1p(exp(x)): 0 vs ~exp(x)."""
    dt = np.float32(-20.0)
    assert float(compute_softplus(dt)) == 0.0
    assert math.log1p(math.exp(-20.0)) > 2e-9


# ---------------------------------------------------------------------------------------------
# Errors: raised before anything is computed


def test_errors():
    s, x, dt = np.zeros((2, 4, 1, 3)), np.zeros((1, 2, 4, 1)), np.zeros((1, 2, 4))
    A, B = np.zeros((4, 3)), np.zeros((1, 2, 2, 3))
    ok = np.array([1])
    ssm_scan(s, x, dt, A, B, B, ok)
    with pytest.raises(OpShapeError, match="A"):
        ssm_scan(s, x, dt, np.zeros((4, 2)), B, B, ok)
    with pytest.raises(OpShapeError, match="multiple of n_group"):
        ssm_scan(s, x, dt, A, np.zeros((1, 2, 3, 3)), np.zeros((1, 2, 3, 3)), ok)
    with pytest.raises(OpShapeError, match="dt"):
        ssm_scan(s, x, np.zeros((1, 3, 4)), A, B, B, ok)
    with pytest.raises(OpShapeError, match="ids"):
        ssm_scan(s, x, dt, A, B, B, np.array([0, 1]))
    with pytest.raises(OpIndexError, match="outside"):
        ssm_scan(s, x, dt, A, B, B, np.array([2]))
    with pytest.raises(OpTypeError, match="integers"):
        ssm_scan(s, x, dt, A, B, B, np.array([0.0]))
    with pytest.raises(OpShapeError, match="d_conv - 1"):
        ssm_conv(np.zeros((1, 3, 2)), np.zeros((3, 4)))
    with pytest.raises(OpShapeError, match="conv_dim"):
        ssm_conv(np.zeros((1, 3)), np.zeros((3, 4)))


def _raises_exactly(error, message):
    """pytest.raises that wants the whole message, not a substring of it."""
    return pytest.raises(error, match="^" + re.escape(message) + "$")


def test_conv_error_counts_the_columns_sx_needs():
    with _raises_exactly(OpShapeError, (
        "ssm_conv: sx (1, 3, 2) does not fit c (3, 4): need sx.shape[1] == c.shape[0] and "
        "at least d_conv - 1 = 3 columns in sx"
    )):
        ssm_conv(np.zeros((1, 3, 2)), np.zeros((3, 4)))


def _scan_args(n_rs=2, n_head=4, head_dim=1, d_state=3, n_group=2, n_seqs=1, n_t=2):
    """Zeros of the shapes ssm_scan accepts; callers break one of them."""
    return dict(
        s=np.zeros((n_rs, n_head, head_dim, d_state)),
        x=np.zeros((n_seqs, n_t, n_head, head_dim)),
        dt=np.zeros((n_seqs, n_t, n_head)),
        A=np.zeros((n_head, d_state)),
        B=np.zeros((n_seqs, n_t, n_group, d_state)),
        C=np.zeros((n_seqs, n_t, n_group, d_state)),
        ids=np.zeros(n_seqs, dtype=np.int32),
    )


@pytest.mark.parametrize("name", ["s", "x", "dt", "A", "B"])
def test_scan_rejects_a_wrong_rank_naming_every_expected_layout(name):
    """Any one array of the wrong rank: the message lists all the layouts and all the shapes."""
    args = _scan_args()
    args[name] = args[name][..., None]  # one axis too many
    got = {k: args[k].shape for k in ("s", "x", "dt", "A", "B")}
    with _raises_exactly(OpShapeError, (
        "ssm_scan: need s (n_rs, n_head, head_dim, d_state), x (n_seqs, n_seq_tokens, "
        "n_head, head_dim), dt (n_seqs, n_seq_tokens, n_head), A (n_head, d_state or 1), "
        f"B and C (n_seqs, n_seq_tokens, n_group, d_state); got s {got['s']}, x {got['x']}, "
        f"dt {got['dt']}, A {got['A']}, B {got['B']}"
    )):
        ssm_scan(**args)


def test_scan_shape_errors_name_every_problem_in_one_message():
    """s, dt, A and B (with C equal to it) all wrong: one OpShapeError, the four problems."""
    args = _scan_args()
    args["s"] = np.zeros((2, 5, 1, 3))
    args["dt"] = np.zeros((1, 2, 5))
    args["A"] = np.zeros((4, 2))
    args["B"] = args["C"] = np.zeros((1, 3, 2, 3))
    with _raises_exactly(OpShapeError, (
        "ssm_scan: s (2, 5, 1, 3) must be (n_rs, 4, 1, d_state); "
        "dt (1, 2, 5) must be (1, 2, 4); "
        "A (4, 2) must be (4, 3) or (4, 1); "
        "B (1, 3, 2, 3) and C (1, 3, 2, 3) must both be (1, 2, 'n_group', 3)"
    )):
        ssm_scan(**args)


@pytest.mark.parametrize("n_group", [0, 3])
def test_scan_wants_heads_in_whole_groups(n_group):
    args = _scan_args(n_group=n_group)
    with _raises_exactly(OpShapeError,
                         f"ssm_scan: n_head = 4 must be a multiple of n_group = {n_group}"):
        ssm_scan(**args)


def test_scan_error_on_ids_of_the_wrong_length():
    with _raises_exactly(OpShapeError, "ssm_scan: ids (2,) must be (1,)"):
        ssm_scan(**{**_scan_args(), "ids": np.array([0, 1])})


@pytest.mark.parametrize("ids", [[-1], [3], [0, 3], [-1, 0]])
def test_scan_rejects_ids_outside_the_state_rows(ids):
    """Negative ids too (NumPy would wrap them); the message counts the rows of s (n_rs = 3)."""
    args = _scan_args(n_rs=3, n_seqs=len(ids))
    with _raises_exactly(OpIndexError, f"ssm_scan: ids {ids} outside the 3 rows of s"):
        ssm_scan(**{**args, "ids": np.array(ids)})


def test_scan_error_on_float_ids():
    with _raises_exactly(OpTypeError,
                         "ssm_scan: ids must be integers (ggml: I32), got float64"):
        ssm_scan(**{**_scan_args(), "ids": np.array([0.0])})


def test_scan_of_zero_sequences_returns_empty_outputs():
    """An empty ubatch (no ids at all) is not an index error."""
    y, states = ssm_scan(**_scan_args(n_seqs=0))
    assert y.shape == (0, 2, 4, 1) and states.shape == (0, 4, 1, 3)


# ---------------------------------------------------------------------------------------------
# Oracle: ggml's own CPU backend (the pinned commit, through llama-cpp-python's libggml)


def _ggml_scan(ggml, s, x, dt, A, B, C, ids):
    """ggml_ssm_scan(..., K=1): one flat float32 tensor, y then the final states."""
    out = ggml("ssm_scan", s, x, dt, A, B, C, ids.astype(np.int32), params=(1,)).reshape(-1)
    n_seqs, _, n_head, head_dim = x.shape
    return out[:x.size].reshape(x.shape), out[x.size:].reshape(n_seqs, n_head, head_dim, -1)


SCAN_CONFIGS = [  # (n_head, head_dim, n_group, d_state, mamba1, n_seqs, n_seq_tokens, n_rs)
    (24, 1, 1, 16, True, 3, 5, 4),  # Mamba-1: one head per channel, A (d_inner, d_state)
    (4, 8, 2, 64, False, 2, 7, 3),  # Mamba-2: SIMD path of the state loop (d_state >= 32)
    (6, 16, 3, 128, False, 3, 4, 5),  # Mamba-2: 3 groups, Mamba-2's usual d_state
    (4, 4, 1, 16, False, 1, 1, 2),  # token generation: one token, scalar path
]


@pytest.mark.oracle
@pytest.mark.parametrize("config", SCAN_CONFIGS, ids=str)
def test_scan_matches_ggml_cpu(config):
    from tests.support.ggml_cpu import ggml_cpu

    n_head, head_dim, n_group, d_state, mamba1, n_seqs, n_t, n_rs = config
    rng = np.random.default_rng(sum(config))
    f = np.float32
    s = rng.standard_normal((n_rs, n_head, head_dim, d_state)).astype(f)
    x = rng.standard_normal((n_seqs, n_t, n_head, head_dim)).astype(f)
    dt = rng.uniform(-5, 5, (n_seqs, n_t, n_head)).astype(f)
    A = (-np.exp(rng.standard_normal((n_head, d_state if mamba1 else 1)))).astype(f)
    B = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(f)
    C = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(f)
    ids = rng.permutation(n_rs)[:n_seqs]
    ids[-1] = ids[0]  # two sequences may start from one row (after seq_cp)
    y_ggml, states_ggml = _ggml_scan(ggml_cpu(), s, x, dt, A, B, C, ids)
    y, states = ssm_scan(s, x, dt, A, B, C, ids)
    assert y.dtype == np.float32 and states.dtype == np.float32
    assert nmse(y_ggml, y) <= 1e-7  # measured 1e-14: float32 rounding, SIMD sum order
    assert nmse(states_ggml, states) <= 1e-7  # measured 7e-15


@pytest.mark.oracle
def test_scan_softplus_matches_ggml_cpu_at_the_threshold_and_below():
    """A = 0, B = C = 1, x = 1: y is softplus(dt) itself; at dt = -20 ggml's is exactly 0."""
    from tests.support.ggml_cpu import ggml_cpu

    f = np.float32
    dts = np.array([-20, -16, -10, 0, 19.5, 20, 20.001, 21, 30], dtype=f)
    n = len(dts)
    case = (np.zeros((1, n, 1, 1), f), np.ones((1, 1, n, 1), f), dts.reshape(1, 1, n),
            np.zeros((n, 1), f), np.ones((1, 1, 1, 1), f), np.ones((1, 1, 1, 1), f),
            np.array([0]))
    y_ggml, _ = _ggml_scan(ggml_cpu(), *case)
    y, _ = ssm_scan(*case)
    np.testing.assert_allclose(y.ravel(), y_ggml.ravel(), rtol=1e-6, atol=0)
    assert y_ggml.ravel()[0] == 0.0 == y.ravel()[0]  # log1p(exp(-20)) would be 2.06e-9
    assert y_ggml.ravel()[5] == 20.0 and y_ggml.ravel()[-1] == 30.0


CONV_CONFIGS = [  # (n_seqs, conv_dim, d_conv, n_seq_tokens)
    (3, 40, 4, 5),  # Mamba-1 style, d_conv 4
    (2, 96, 4, 1),  # token generation
    (1, 7, 2, 9),  # odd sizes
]


@pytest.mark.oracle
@pytest.mark.parametrize("config", CONV_CONFIGS, ids=str)
def test_conv_matches_ggml_cpu(config):
    """NMSE <= 1e-7; measured: bit-exact for d_conv = 4, NMSE ~1e-15 otherwise.

    Both sum the d_conv products in order in float32; for d_conv != 4 the compiler turned
    ggml's ``sumf += s * c`` into fused multiply-adds (one rounding per tap instead of two),
    which is a property of the build, not of the op.
    """
    from tests.support.ggml_cpu import ggml_cpu

    n_seqs, conv_dim, d_conv, n_t = config
    rng = np.random.default_rng(sum(config))
    sx = rng.standard_normal((n_seqs, conv_dim, d_conv - 1 + n_t)).astype(np.float32)
    c = rng.standard_normal((conv_dim, d_conv)).astype(np.float32)
    y_ggml = ggml_cpu()("ssm_conv", sx, c)
    y = ssm_conv(sx, c)
    assert y.shape == y_ggml.shape == (n_seqs, n_t, conv_dim) and y.dtype == np.float32
    assert nmse(y_ggml, y) <= 1e-7
