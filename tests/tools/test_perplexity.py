"""Perplexity and KL divergence (``reference.tools.perplexity``) on tiny models: the procedure
against a brute-force statement of it, the base file's layout and round trip, the MLX twin,
the CLI, and every bad input (a typed error, nothing written).

The brute force decodes every chunk alone with ``reference.testing.reference_logits`` (the
simple cache, no Context, no batching) and scores it with a float64 log-softmax: what the
procedure must equal however the chunks are batched.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from reference.common import MAX_NMSE_TWIN, LlamarefError
from reference.context import Context
from reference.tools.perplexity import (
    LOGITS_MAGIC,
    LogitsFileError,
    PerplexityError,
    context_params,
    eval_chunks,
    kl_divergence,
    perplexity,
    plan_chunks,
    quantize_log_probs,
    read_logits_file,
    record_len,
)
from reference.testing import nmse, random_weights, reference_logits, tiny_hparams

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


def test_the_running_estimates_and_the_final_line_are_printed(model, text):
    out, info = [], []
    res = perplexity(make_ctx(model, 16, 32), text, 16, 32, 3, bos=BOS, out=out.append,
                     info=info.append)
    assert "".join(out) == "".join(f"[{i + 1}]{p:.4f}," for i, p in
                                   enumerate(res.estimates)) + "\n"
    assert info[-1] == f"Final estimate: PPL = {res.ppl:.4f} +/- {res.uncertainty:.5f}"
    assert "n_ctx=16, batch_size=32, n_seq=2" in info[0]


# ---- the base file -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_file(model, text, tmp_path_factory):
    path = tmp_path_factory.mktemp("kld") / "base.bin"
    perplexity(make_ctx(model, 16, 32), text, 16, 32, bos=BOS, base_path=path)
    return path


def test_base_file_layout(model, text, base_file):
    n_ctx, n_chunk, n_scored = 16, len(text) // 16, 16 - 1 - 8
    data = base_file.read_bytes()
    assert data[:8] == LOGITS_MAGIC
    assert np.frombuffer(data[8:20], "<i4").tolist() == [n_ctx, N_VOCAB, n_chunk]
    tokens = np.frombuffer(data[20:20 + 4 * n_chunk * n_ctx], "<i4")
    np.testing.assert_array_equal(tokens, text[:n_chunk * n_ctx])  # BOS not substituted
    assert len(data) == 20 + 4 * n_chunk * n_ctx + 2 * n_chunk * n_scored * record_len(N_VOCAB)
    assert not list(base_file.parent.glob(".*.tmp"))  # renamed, nothing left behind


def test_base_file_reads_back_bit_exactly(model, text, base_file):
    base = read_logits_file(base_file, N_VOCAB)
    plan = plan_chunks(len(text), 16, 32)
    ctx = make_ctx(model, 16, 32)
    for i in range(0, base.n_chunk, plan.n_seq):
        logits = eval_chunks(ctx, text, plan, i, min(plan.n_seq, base.n_chunk - i), BOS)
        for s in range(len(logits)):
            first = plan.start(i + s) + plan.first
            want, _ = quantize_log_probs(logits[s, :plan.n_scored],
                                         text[first + 1:first + 1 + plan.n_scored])
            np.testing.assert_array_equal(base.records(i + s), want)
            assert (base.records(i + s)[:, -1] == 0).all()  # the padding of an odd vocabulary


def test_the_same_model_against_its_own_base_file(model, base_file):
    """KLD is 0 up to the 16-bit quantization: at most half a step, s/2 <= 8/65535 nats."""
    base = read_logits_file(base_file, N_VOCAB)
    out = []
    stats = kl_divergence(make_ctx(model, 16, 32), base, 32, BOS, out=out.append)
    kld = np.concatenate(stats.kld_values)
    assert stats.count == base.n_chunk * 7 >= 100
    assert np.abs(kld).max() <= 8 / 65535 * 1.001
    assert stats.n_same_top == stats.count
    assert abs(stats.log_ppl_ratio()[0]) <= 8 / 65535
    text = "".join(out)
    for section in ("Perplexity statistics", "KL divergence statistics",
                    "Token probability statistics"):
        assert f"====== {section} ======" in text
    assert "Same top p: 100.000 ± 0.000 %" in text


def test_another_model_has_a_positive_kld(model, base_file):
    hp, _ = model
    other = (hp, random_weights(hp, seed=5))
    stats = kl_divergence(make_ctx(other, 16, 32), read_logits_file(base_file, N_VOCAB), 32, BOS)
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

def test_a_short_text_is_refused_and_nothing_is_written(model, text, tmp_path):
    path = tmp_path / "base.bin"
    with pytest.raises(PerplexityError, match="needs at least 64"):
        perplexity(make_ctx(model, 32, 32), text[:63], 32, 32, base_path=path)
    assert list(tmp_path.iterdir()) == []


def test_a_context_too_small_is_refused(model, text):
    with pytest.raises(PerplexityError, match="n_seq_max = 1 < 2"):
        perplexity(make_ctx(model, 16, 16), text, 16, 32)


def test_a_failed_decode_leaves_no_file(model, text, tmp_path):
    class Failing(Context):
        calls = 0

        def decode(self, batch):
            Failing.calls += 1
            return 1 if Failing.calls == 3 else super().decode(batch)

    path = tmp_path / "base.bin"
    with pytest.raises(PerplexityError, match="failed to decode"):
        perplexity(make_ctx(model, 16, 16, cls=Failing), text, 16, 16, base_path=path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:-1], "truncated"),
    (lambda d: d + b"\0\0", "truncated"),
    (lambda d: d[:20], "truncated"),
    (lambda d: b"_logitz_" + d[8:], "no _logits_ header"),
    (lambda d: d[:5], "no _logits_ header"),
    (lambda d: d[:8] + np.array([16, N_VOCAB, 0], "<i4").tobytes() + d[20:], "bad header"),
])
def test_a_damaged_base_file_is_refused(base_file, tmp_path, damage, message):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(damage(base_file.read_bytes()))
    with pytest.raises(LogitsFileError, match=message):
        read_logits_file(bad, N_VOCAB)


def test_a_base_file_of_another_vocabulary_is_refused(base_file):
    with pytest.raises(LogitsFileError, match=f"over {N_VOCAB} tokens, the model has 32"):
        read_logits_file(base_file, 32)


def test_errors_are_typed():
    assert issubclass(LogitsFileError, PerplexityError)
    assert issubclass(PerplexityError, LlamarefError) and issubclass(PerplexityError, ValueError)


# ---- the command ---------------------------------------------------------------------------

CLI_VOCAB = 300  # every byte token: any text tokenizes


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from reference.testing import write_tiny_gguf

    hp = tiny_hparams(n_vocab=CLI_VOCAB, n_embd=16, n_ctx_train=256)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hp,
                           random_weights(hp, seed=6))


def run_cli(args, capsys):
    from llamaref.cli import main

    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_perplexity_and_kl_divergence(tiny_gguf, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("".join(chr(c) for c in np.random.default_rng(2).integers(97, 123, 300)))
    base = tmp_path / "base.bin"
    common = ["-m", str(tiny_gguf), "--backend", "reference"]
    rc, out, err = run_cli(["perplexity", *common, "-f", str(text), "-c", "16", "-b", "64",
                            "--kl-divergence-base", str(base)], capsys)
    assert rc == 0, err
    assert out.startswith("[1]") and out.endswith(",\n")
    assert "Final estimate: PPL = " in err
    assert read_logits_file(base, CLI_VOCAB).n_ctx == 16
    rc, out, err = run_cli(["perplexity", *common, "--kl-divergence-base", str(base),
                            "--kl-divergence"], capsys)
    assert rc == 0, err
    assert "KL Divergence" in out and "Mean    KLD:" in out and "Same top p: 100.000" in out


@pytest.mark.parametrize("args, message", [
    (["-c", "16", "--kl-divergence-base", "{base}"], "no text: give it with -f FILE"),
    (["-f", "{text}", "-c", "0", "--kl-divergence-base", "{base}"], "requires a context > 0"),
    (["-f", "{text}", "-c", "128", "--kl-divergence-base", "{base}"], "needs at least 256"),
    (["--kl-divergence"], "--kl-divergence needs the base file"),
    (["--kl-divergence", "--kl-divergence-base", "{text}"], "no _logits_ header"),
    (["-f", "{text}", "--ppl-stride", "4", "--kl-divergence-base", "{base}"], "drop --ppl-stride"),
    (["-f", "{text}", "-c", "16", "--ppl-stride", "16"], "--ppl-stride = 16 must be in"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tiny_gguf, tmp_path, capsys, args,
                                                      message):
    text = tmp_path / "text.txt"
    text.write_text("abcdefghij" * 20)  # 201 tokens with BOS
    base = tmp_path / "base.bin"
    args = [a.format(text=text, base=base) for a in args]
    rc, out, err = run_cli(["perplexity", "-m", str(tiny_gguf), "--backend", "reference",
                            *args], capsys)
    assert rc == 1
    assert err.count("\n") == 1 and message in err, err
    assert sorted(os.listdir(tmp_path)) == ["text.txt"]
