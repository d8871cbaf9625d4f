"""Perplexity and KL divergence (``reference.tools.perplexity``) on tiny models: the procedure
against a brute-force statement of it, the base file's bytes and their round trip, the MLX
twin, and every bad input (a typed error, nothing written). The base file by path, the console
lines and the command: ``tests/app/test_perplexity.py``.

The brute force decodes every chunk alone with ``reference.testing.reference_logits`` (the
simple cache, no Context, no batching) and scores it with a float64 log-softmax: what the
procedure must equal however the chunks are batched.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from reference.common import MAX_NMSE_TWIN, LlamarefError
from reference.context import Context
from reference.testing import nmse, random_weights, reference_logits, tiny_hparams
from reference.tools.perplexity import (
    LOGITS_HEADER_SIZE,
    LOGITS_MAGIC,
    LogitsFile,
    LogitsFileError,
    PerplexityError,
    context_params,
    encode_logits_header,
    eval_chunks,
    kl_divergence,
    perplexity,
    plan_chunks,
    quantize_log_probs,
    read_logits,
    record_len,
)

BOS = 1
N_VOCAB = 33  # odd: every record carries one uint16 of padding


@pytest.fixture(scope="module")
def model():
    hp = tiny_hparams(n_vocab=N_VOCAB, n_embd=16, n_ctx_train=256)
    return hp, random_weights(hp, seed=4)


@pytest.fixture(scope="module")
def text():
    return np.random.default_rng(11).integers(3, N_VOCAB, 300).astype(np.int32)


def make_ctx(model, n_ctx, n_batch, cls=Context, **kwargs):
    hp, w = model
    return cls(hp, w, **context_params(n_ctx, n_batch), **kwargs)


def log_softmax64(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def brute_force_nll(model, text, n_ctx, n_chunk, stride=None, bos=BOS):
    """Each window decoded alone, its first token replaced by BOS, the tail scored."""
    hp, w = model
    stride = stride or n_ctx
    first = n_ctx // 2 if stride == n_ctx else n_ctx - stride - 1
    nll = []
    for c in range(n_chunk):
        window = text[c * stride:c * stride + n_ctx].copy()
        if bos is not None:
            window[0] = bos
        logp = log_softmax64(reference_logits(w, hp, window))  # (n_ctx, n_vocab)
        for k in range(first, n_ctx - 1):
            nll.append(-logp[k, text[c * stride + k + 1]])
    return np.array(nll)


@pytest.mark.parametrize("n_batch", [4, 16, 32, 48], ids=["2-decodes-per-chunk", "1-chunk",
                                                        "2-chunks", "3-chunks"])
def test_perplexity_equals_the_brute_force_however_chunks_are_batched(model, text, n_batch):
    n_ctx, n_chunks = 16, 5  # 3 chunks per decode leaves a group of 2: a partial last group
    res = perplexity(make_ctx(model, n_ctx, n_batch), text, n_ctx, n_batch, n_chunks, bos=BOS)
    want = brute_force_nll(model, text, n_ctx, n_chunks)
    assert res.sums.count == len(want) == n_chunks * (n_ctx - 1 - n_ctx // 2)
    assert res.ppl == pytest.approx(np.exp(want.mean()), rel=1e-5)
    running = [np.exp(want[:k * 7].mean()) for k in range(1, n_chunks + 1)]
    np.testing.assert_allclose(res.estimates, running, rtol=1e-5)
    sigma = np.sqrt((np.mean(want ** 2) - want.mean() ** 2) / (len(want) - 1))
    assert res.uncertainty == pytest.approx(np.exp(want.mean()) * sigma, rel=1e-4)


def test_bos_replaces_the_first_token_of_each_chunk(model, text):
    """Without BOS the first token stays: a different number, equal to its own brute force."""
    n_ctx = 16
    with_bos = perplexity(make_ctx(model, n_ctx, 32), text, n_ctx, 32, 4, bos=BOS).ppl
    without = perplexity(make_ctx(model, n_ctx, 32), text, n_ctx, 32, 4, bos=None).ppl
    assert without == pytest.approx(np.exp(brute_force_nll(model, text, n_ctx, 4,
                                                           bos=None).mean()), rel=1e-5)
    assert abs(with_bos - without) > 1e-3 * without


@pytest.mark.parametrize("stride", [1, 4, 7])
def test_strided_perplexity_scores_the_last_stride_tokens_of_each_window(model, text, stride):
    n_ctx, n_chunks = 16, 6
    res = perplexity(make_ctx(model, n_ctx, 32), text, n_ctx, 32, n_chunks, ppl_stride=stride,
                     bos=BOS)
    want = brute_force_nll(model, text, n_ctx, n_chunks, stride=stride)
    assert res.sums.count == n_chunks * stride
    assert res.ppl == pytest.approx(np.exp(want.mean()), rel=1e-5)


def test_on_chunk_sees_every_chunk_and_the_running_sums(model, text):
    seen = []
    res = perplexity(make_ctx(model, 16, 32), text, 16, 32, 3, bos=BOS,
                     on_chunk=lambda i, sums: seen.append((i, sums.count, sums.ppl)))
    assert [i for i, _, _ in seen] == [0, 1, 2]
    assert [n for _, n, _ in seen] == [7, 14, 21]
    assert [p for _, _, p in seen] == res.estimates


# ---- the base file -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_bytes(model, text):
    """The base file of the text's chunks of 16, as bytes (written into a stream)."""
    stream = io.BytesIO()
    perplexity(make_ctx(model, 16, 32), text, 16, 32, bos=BOS, base=stream)
    return stream.getvalue()


def assert_base_file_layout(data: bytes, text: np.ndarray) -> None:
    """``data`` is the base file of ``text``'s chunks of 16 over ``N_VOCAB`` tokens."""
    n_ctx, n_chunk, n_scored = 16, len(text) // 16, 16 - 1 - 8
    assert data[:8] == LOGITS_MAGIC
    assert np.frombuffer(data[8:20], "<i4").tolist() == [n_ctx, N_VOCAB, n_chunk]
    tokens = np.frombuffer(data[20:20 + 4 * n_chunk * n_ctx], "<i4")
    np.testing.assert_array_equal(tokens, text[:n_chunk * n_ctx])  # BOS not substituted
    assert len(data) == 20 + 4 * n_chunk * n_ctx + 2 * n_chunk * n_scored * record_len(N_VOCAB)


def test_base_file_layout(text, base_bytes):
    assert_base_file_layout(base_bytes, text)


def test_the_header_encodes_and_reads_back(text):
    head = encode_logits_header(16, N_VOCAB, 3, text)
    assert len(head) == LOGITS_HEADER_SIZE + 4 * 3 * 16
    records = bytes(2 * 3 * 7 * record_len(N_VOCAB))
    base = read_logits(io.BytesIO(head + records), N_VOCAB)
    assert (base.n_ctx, base.n_vocab, base.n_chunk, base.n_scored) == (16, N_VOCAB, 3, 7)
    np.testing.assert_array_equal(base.tokens, text[:48])
    assert base.expected_size() == len(head) + len(records)


def test_records_past_the_end_of_the_stream_are_refused(text):
    base = LogitsFile(16, N_VOCAB, 3, text[:48])
    stream = io.BytesIO(encode_logits_header(16, N_VOCAB, 3, text))  # no records
    with pytest.raises(LogitsFileError, match="ends inside the records of chunk 1"):
        base.records(stream, 0)


def test_base_file_reads_back_bit_exactly(model, text, base_bytes):
    stream = io.BytesIO(base_bytes)
    base = read_logits(stream, N_VOCAB)
    plan = plan_chunks(len(text), 16, 32)
    ctx = make_ctx(model, 16, 32)
    for i in range(0, base.n_chunk, plan.n_seq):
        logits = eval_chunks(ctx, text, plan, i, min(plan.n_seq, base.n_chunk - i), BOS)
        for s in range(len(logits)):
            first = plan.start(i + s) + plan.first
            want, _ = quantize_log_probs(logits[s, :plan.n_scored],
                                         text[first + 1:first + 1 + plan.n_scored])
            np.testing.assert_array_equal(base.records(stream, i + s), want)
            # the padding of an odd vocabulary
            assert (base.records(stream, i + s)[:, -1] == 0).all()


def test_the_same_model_against_its_own_base_file(model, base_bytes):
    """KLD is 0 up to the 16-bit quantization: at most half a step, s/2 <= 8/65535 nats."""
    stream = io.BytesIO(base_bytes)
    base = read_logits(stream, N_VOCAB)
    seen = []
    stats = kl_divergence(make_ctx(model, 16, 32), base, stream, 32, BOS,
                          on_chunk=lambda i, st: seen.append((i, st.count)))
    kld = np.concatenate(stats.kld_values)
    assert stats.count == base.n_chunk * 7 >= 100
    assert np.abs(kld).max() <= 8 / 65535 * 1.001
    assert stats.n_same_top == stats.count
    assert abs(stats.log_ppl_ratio()[0]) <= 8 / 65535
    assert seen == [(i, 7 * (i + 1)) for i in range(base.n_chunk)]
    assert stats.same_top() == (1.0, 0.0)


def test_another_model_has_a_positive_kld(model, base_bytes):
    hp, _ = model
    other = (hp, random_weights(hp, seed=5))
    stream = io.BytesIO(base_bytes)
    stats = kl_divergence(make_ctx(other, 16, 32), read_logits(stream, N_VOCAB), stream, 32, BOS)
    assert stats.mean_kld()[0] > 0.1
    assert stats.n_same_top < stats.count


# ---- the twin ------------------------------------------------------------------------------

def test_twin_perplexity_matches_the_reference(model, text):
    from accelerated.context import Context as AContext

    ref_ctx, acc_ctx = make_ctx(model, 16, 48), make_ctx(model, 16, 48, cls=AContext)
    plan = plan_chunks(len(text), 16, 48, n_chunks=6)
    for i in (0, 3):
        want = eval_chunks(ref_ctx, text, plan, i, 3, BOS)
        got = eval_chunks(acc_ctx, text, plan, i, 3, BOS)
        assert nmse(want, got) <= MAX_NMSE_TWIN
    ref = perplexity(ref_ctx, text, 16, 48, 6, bos=BOS)
    acc = perplexity(acc_ctx, text, 16, 48, 6, bos=BOS)
    assert acc.ppl == pytest.approx(ref.ppl, rel=1e-5)


# ---- bad input -----------------------------------------------------------------------------

def test_a_short_text_is_refused_and_nothing_is_written(model, text):
    stream = io.BytesIO()
    with pytest.raises(PerplexityError, match="needs at least 64"):
        perplexity(make_ctx(model, 32, 32), text[:63], 32, 32, base=stream)
    assert stream.getvalue() == b""


def test_a_base_file_needs_the_standard_mode(model, text):
    stream = io.BytesIO()
    with pytest.raises(PerplexityError, match="needs the standard mode"):
        perplexity(make_ctx(model, 16, 32), text, 16, 32, ppl_stride=4, base=stream)
    assert stream.getvalue() == b""


def test_a_context_too_small_is_refused(model, text):
    with pytest.raises(PerplexityError, match="n_seq_max = 1 < 2"):
        perplexity(make_ctx(model, 16, 16), text, 16, 32)


class Failing(Context):
    """A Context whose third decode finds no slot."""

    calls = 0

    def decode(self, batch):
        Failing.calls += 1
        return 1 if Failing.calls == 3 else super().decode(batch)


def test_a_failed_decode_is_a_typed_error(model, text):
    Failing.calls = 0
    with pytest.raises(PerplexityError, match="failed to decode"):
        perplexity(make_ctx(model, 16, 16, cls=Failing), text, 16, 16, base=io.BytesIO())


#: ways to damage a base file, and what the refusal says
DAMAGES = [
    (lambda d: d[:-1], "truncated"),
    (lambda d: d + b"\0\0", "truncated"),
    (lambda d: d[:20], "truncated"),
    (lambda d: b"_logitz_" + d[8:], "no _logits_ header"),
    (lambda d: d[:5], "no _logits_ header"),
    (lambda d: d[:8] + np.array([16, N_VOCAB, 0], "<i4").tobytes() + d[20:], "bad header"),
]


@pytest.mark.parametrize("damage, message", DAMAGES)
def test_a_damaged_base_file_is_refused(base_bytes, damage, message):
    with pytest.raises(LogitsFileError, match=message):
        read_logits(io.BytesIO(damage(base_bytes)), N_VOCAB)


def test_a_base_file_of_another_vocabulary_is_refused(base_bytes):
    with pytest.raises(LogitsFileError, match=f"over {N_VOCAB} tokens, the model has 32"):
        read_logits(io.BytesIO(base_bytes), 32, "base.bin")


def test_errors_are_typed():
    assert issubclass(LogitsFileError, PerplexityError)
    assert issubclass(PerplexityError, LlamarefError) and issubclass(PerplexityError, ValueError)
