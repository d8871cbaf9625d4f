"""Perplexity and KL divergence against llama.cpp itself.

- **Perplexity on SmolLM2 in float32.** SmolLM2 dequantized to a float32 GGUF; llama.cpp
  (llama-cpp-python, f32 KV cache, no flash attention) decodes the same chunks one by one and
  the test scores its logits with a plain float64 log-softmax: our perplexity (the reference
  Context) equals it to 1e-4 relative. The same procedure run *over llama.cpp's context*
  (three chunks per decode, one KV stream each) gives the same number too.
- **BOS.** A tiny model whose vocabulary adds BOS: the vocabulary flag we read is llama.cpp's,
  and both contexts give the same perplexity with the first token of every chunk replaced.
- **The base file, byte for byte.** llama.cpp's own quantization and KL-divergence functions
  (``tools/perplexity/perplexity.cpp``, copied verbatim below, MIT licence) compiled with the
  system's C++ compiler: our records, nll and per-token KLD are bit-identical, Δp to an ulp.
- **Strided perplexity (divergence 20).** llama.cpp's ``perplexity_v2`` transcribed line by
  line over llama.cpp's context: what it computes is our strided perplexity with a window of
  ``llama_n_ctx`` (256, padded) and no BOS, not the ``-c`` asked for.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from reference.arch import hparams_from_file
from reference.context import Context
from reference.gguf import read_gguf, write_gguf
from reference.model_loader import ModelLoadError, default_model_path
from reference.quants import QuantizedTensor
from reference.testing import random_weights, tiny_hparams, write_tiny_gguf
from reference.tokenizer import load_tokenizer
from reference.tools.perplexity import (
    KLDStats,
    context_params,
    kld_tokens,
    perplexity,
    quantize_log_probs,
)

llama_cpp = pytest.importorskip("llama_cpp")
from llamaref.llamacpp import LlamaCppContext  # noqa: E402

N_CTX, N_CHUNKS = 128, 3


def stdlib_text() -> str:
    """A text shipped with Python: the docstrings of a few standard modules."""
    import argparse
    import inspect
    import json

    return "\n\n".join(inspect.getdoc(m) for m in (argparse, json))


def log_softmax64(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def smol_f32(tmp_path_factory):
    try:
        path = default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    gguf = read_gguf(path)
    weights = {k: v.dequantize() if isinstance(v, QuantizedTensor) else np.asarray(v)
               for k, v in gguf.tensors.items()}
    f32 = tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf"
    write_gguf(f32, {**gguf.metadata, "general.file_type": 0}, weights)
    tokens = load_tokenizer(path).tokenize(stdlib_text(), add_special=True)
    assert len(tokens) >= N_CHUNKS * N_CTX
    yield f32, hparams_from_file(gguf), weights, np.array(tokens, np.int32)
    f32.unlink()


def llamacpp_chunk_by_chunk(path, tokens, n_ctx, n_chunk, bos=None) -> np.ndarray:
    """llama.cpp's logits, each chunk decoded alone; scored here in float64."""
    nll = []
    with LlamaCppContext(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=2) as lc:
        for c in range(n_chunk):
            window = tokens[c * n_ctx:(c + 1) * n_ctx].copy()
            if bos is not None:
                window[0] = bos
            lc.clear()
            assert lc.decode({"token": window, "logits": [True] * n_ctx}) == 0
            logp = log_softmax64(lc.get_logits())  # (n_ctx, n_vocab)
            for k in range(n_ctx // 2, n_ctx - 1):
                nll.append(-logp[k, tokens[c * n_ctx + k + 1]])
    return np.array(nll)


@pytest.mark.oracle
def test_smollm2_f32_perplexity_matches_llamacpp(smol_f32):
    path, hp, weights, tokens = smol_f32
    n_batch = N_CHUNKS * N_CTX  # the three chunks in one decode
    ours = perplexity(Context(hp, weights, **context_params(N_CTX, n_batch)), tokens, N_CTX,
                      n_batch, N_CHUNKS)
    theirs = np.exp(llamacpp_chunk_by_chunk(path, tokens, N_CTX, N_CHUNKS).mean())
    print(f"SmolLM2 f32, {N_CHUNKS} chunks of {N_CTX}: PPL ours {ours.ppl:.6f}, "
          f"llama.cpp {theirs:.6f}")
    assert ours.ppl == pytest.approx(theirs, rel=1e-4)
    with LlamaCppContext(path, n_ctx=n_batch, n_batch=n_batch, n_ubatch=n_batch,
                         n_seq_max=N_CHUNKS, kv_unified=False, n_threads=2) as lc:
        batched = perplexity(lc, tokens, N_CTX, n_batch, N_CHUNKS)
    assert batched.ppl == pytest.approx(theirs, rel=1e-5)


@pytest.fixture(scope="module")
def tiny_bos(tmp_path_factory):
    hp = tiny_hparams(n_vocab=300, n_embd=32, n_ctx_train=512)
    weights = random_weights(hp, seed=9)
    path = write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", hp, weights)
    tokens = np.random.default_rng(3).integers(3, 300, 600).astype(np.int32)
    return path, hp, weights, tokens


@pytest.mark.oracle
def test_bos_substitution_matches_llamacpp(tiny_bos):
    path, hp, weights, tokens = tiny_bos
    tok = load_tokenizer(path)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(),
                                                 llama_cpp.llama_model_default_params())
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        assert tok.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(vocab)) is True
        assert tok.bos_id == llama_cpp.llama_vocab_bos(vocab) == 1
    finally:
        llama_cpp.llama_model_free(model)
    ours = perplexity(Context(hp, weights, **context_params(32, 64)), tokens, 32, 64, 6,
                      bos=tok.bos_id)
    theirs = np.exp(llamacpp_chunk_by_chunk(path, tokens, 32, 6, bos=tok.bos_id).mean())
    assert ours.ppl == pytest.approx(theirs, rel=1e-5)


def llamacpp_perplexity_v2(lc, tokens, ppl_stride, n_batch, n_chunks) -> float:
    """``perplexity_v2`` (perplexity.cpp:296-440), line by line, over llama.cpp's context."""
    n_ctx = lc.n_ctx  # llama_n_ctx(ctx): padded, with the n_parallel factor and +stride/2
    calc_chunk = n_ctx
    n_chunk = min(n_chunks, (len(tokens) - calc_chunk + ppl_stride - 1) // ppl_stride)
    nll, count = 0.0, 0
    for i in range(n_chunk):
        start = i * ppl_stride
        end = start + calc_chunk
        logits = []
        lc.clear()
        for j in range((calc_chunk + n_batch - 1) // n_batch):
            batch_start = start + j * n_batch
            batch_size = min(end - batch_start, n_batch)
            batch = {"token": tokens[batch_start:batch_start + batch_size],
                     "pos": [j * n_batch + k for k in range(batch_size)],
                     "seq_id": [[0]] * batch_size, "logits": [True] * batch_size}
            assert lc.decode(batch) == 0
            # (the BOS substitution happens here, after the decode: no effect)
            logits.append(lc.get_logits())
        logits = np.concatenate(logits)
        for j in range(n_ctx - ppl_stride - 1, n_ctx - 1):
            z = logits[j].astype(np.float32)
            e = np.exp((z - z.max()).astype(np.float64))
            nll += -np.log(np.float32(e[tokens[start + j + 1]] / e.sum()))
            count += 1
    return float(np.exp(nll / count))


@pytest.mark.oracle
def test_strided_perplexity_divergence(tiny_bos):
    path, hp, weights, tokens = tiny_bos
    c, stride, n_batch, n_chunks = 16, 4, 16, 3
    # llama-perplexity's main: n_parallel = 1, n_ctx = 16 + stride / 2, padded to 256
    with LlamaCppContext(path, n_ctx=c + stride // 2, n_batch=n_batch, n_ubatch=n_batch,
                         n_threads=2) as lc:
        assert lc.n_ctx == 256
        theirs = llamacpp_perplexity_v2(lc, tokens, stride, n_batch, n_chunks)
    as_theirs = perplexity(Context(hp, weights, **context_params(256, n_batch)), tokens, 256,
                           n_batch, n_chunks, ppl_stride=stride, bos=None)
    ours = perplexity(Context(hp, weights, **context_params(c, n_batch)), tokens, c, n_batch,
                      n_chunks, ppl_stride=stride, bos=1)
    assert theirs == pytest.approx(as_theirs.ppl, rel=1e-5)  # a 256-token window, no BOS
    assert abs(ours.ppl - theirs) > 1e-2 * theirs  # not the -c window asked for


# llama.cpp's tools/perplexity/perplexity.cpp at the pinned commit (llama-cpp-python 0.3.36's
# vendor/llama.cpp), lines 72-107 and 191-252, verbatim. Copyright (c) 2023-2024 The ggml
# authors, MIT licence.
LLAMACPP_FUNCTIONS = r"""
static inline int nearest_int(float fval) {
    //assert(fval <= 4194303.f);
    float val = fval + 12582912.f;
    int i; memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

static double log_softmax(int n_vocab, const float * logits, uint16_t * log_prob, int tok) {
    float max_logit = logits[0];
    float min_logit = logits[0];
    for (int i = 1; i < n_vocab; ++i) {
        max_logit = std::max(max_logit, logits[i]);
        min_logit = std::min(min_logit, logits[i]);
    }
    min_logit = std::max(min_logit, max_logit - 16);
    double sum_exp = 0.0;
    for (int i = 0; i < n_vocab; ++i) {
        sum_exp += expf(logits[i] - max_logit);
    }
    const float log_sum_exp = log(sum_exp);
    const float min_log_prob = min_logit - max_logit - log_sum_exp;
    const float scale = (max_logit - min_logit)/65535.f;
    float * d = (float *)log_prob;
    d[0] = scale;
    d[1] = min_log_prob;
    log_prob += 4;
    if (scale) {
        const float inv_scale = 1/scale;
        for (int i = 0; i < n_vocab; ++i) {
            log_prob[i] = logits[i] > min_logit ? nearest_int(inv_scale*(logits[i] - min_logit)) : 0;
        }
    } else {
        std::memset(log_prob, 0, n_vocab*sizeof(uint16_t));
    }
    return max_logit + log_sum_exp - logits[tok];
}

static std::pair<double, float> log_softmax(int n_vocab, const float * logits, const uint16_t * base_log_prob, int tok, kl_divergence_result & kld) {
    float max_logit = logits[0];
    int imax = 0;
    for (int i = 1; i < n_vocab; ++i) {
        if (logits[i] > max_logit) {
            max_logit = logits[i];
            imax = i;
        }
    }
    double sum_exp = 0.0;
    for (int i = 0; i < n_vocab; ++i) {
        sum_exp += expf(logits[i] - max_logit);
    }
    const float log_sum_exp = log(sum_exp);
    const float * d = (const float *)base_log_prob;
    const float scale = d[0];
    const float min_log_prob = d[1];
    base_log_prob += 4;

    const float nll = max_logit + log_sum_exp - logits[tok];
    kld.sum_nll  += nll;
    kld.sum_nll2 += nll*nll;

    const float nll_base = -(scale*base_log_prob[tok] + min_log_prob);
    kld.sum_nll_base  += nll_base;
    kld.sum_nll_base2 += nll_base*nll_base;

    kld.sum_nll_nll_base += nll*nll_base;

    max_logit += log_sum_exp;
    double sum = 0;
    int imax_base = -1;
    float p_log_base_max = 0;
    for (int i = 0; i < n_vocab; ++i) {
        const float p_log_base = scale*base_log_prob[i] + min_log_prob;
        if (i == 0 || p_log_base > p_log_base_max) {
            p_log_base_max = p_log_base;
            imax_base = i;
        }
        if (p_log_base > -16.f) {
            const float p_base = expf(p_log_base);
            sum += p_base * (p_log_base - logits[i] + max_logit);
        }
    }
    kld.sum_kld  += sum;
    kld.sum_kld2 += sum*sum;
    ++kld.count;
    if (imax == imax_base) {
        ++kld.n_same_top;
    }

    const float p_base = expf(-nll_base);
    const float p = expf(-nll);
    const float p_diff = p - p_base;
    kld.sum_p_diff  += p_diff;
    const double p_diff2 = p_diff*p_diff;
    kld.sum_p_diff2 += p_diff2;
    kld.sum_p_diff4 += p_diff2*p_diff2;
    kld.max_p_diff = std::max(kld.max_p_diff, std::fabs(p_diff));

    return std::make_pair(sum, p_diff);
}
"""  # noqa: E501

HARNESS = r"""
#include <cstdio>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <vector>
#include <utility>
struct kl_divergence_result {
    double sum_nll = 0, sum_nll2 = 0, sum_nll_base = 0, sum_nll_base2 = 0;
    double sum_nll_nll_base = 0, sum_kld = 0, sum_kld2 = 0;
    double sum_p_diff = 0, sum_p_diff2 = 0, sum_p_diff4 = 0;
    float max_p_diff = 0; size_t n_same_top = 0, count = 0;
};
FUNCTIONS
// in: n, n_vocab, logits[n][n_vocab] (base), logits[n][n_vocab] (test), tok[n]
// out: records, nll (base), kld (float), p_diff (float), the sums
int main(int argc, char ** argv) {
    int n, V; FILE * f = fopen(argv[1], "rb");
    if (fread(&n, 4, 1, f) != 1 || fread(&V, 4, 1, f) != 1) return 1;
    std::vector<float> base((size_t) n * V), test((size_t) n * V); std::vector<int> tok(n);
    if (fread(base.data(), 4, base.size(), f) != base.size()) return 1;
    if (fread(test.data(), 4, test.size(), f) != test.size()) return 1;
    if (fread(tok.data(), 4, n, f) != (size_t) n) return 1;
    fclose(f);
    const int nv = 2*((V + 1)/2) + 4;
    std::vector<uint16_t> rec((size_t) n * nv, 0); std::vector<double> nll(n);
    std::vector<float> kld(n), p_diff(n); kl_divergence_result k;
    for (int i = 0; i < n; i++) {
        nll[i] = log_softmax(V, base.data() + (size_t) i*V, rec.data() + (size_t) i*nv, tok[i]);
        auto r = log_softmax(V, test.data() + (size_t) i*V, rec.data() + (size_t) i*nv, tok[i], k);
        kld[i] = (float) r.first; p_diff[i] = r.second;
    }
    FILE * g = fopen(argv[2], "wb");
    fwrite(rec.data(), 2, rec.size(), g); fwrite(nll.data(), 8, n, g);
    fwrite(kld.data(), 4, n, g); fwrite(p_diff.data(), 4, n, g);
    fwrite(&k, sizeof(k), 1, g); fclose(g);
    return 0;
}
"""


@pytest.fixture(scope="module")
def llamacpp_functions(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build llama.cpp's perplexity functions")
    d = tmp_path_factory.mktemp("ppl_cpp")
    (d / "ppl.cpp").write_text(HARNESS.replace("FUNCTIONS", LLAMACPP_FUNCTIONS))
    subprocess.run([cxx, "-O2", "-ffp-contract=off", "-o", str(d / "ppl"), str(d / "ppl.cpp")],
                   check=True)
    return d / "ppl"


@pytest.mark.oracle
@pytest.mark.parametrize("n_vocab", [32, 777, 4096, 49152])
def test_base_records_and_kld_are_llamacpps_bit_for_bit(llamacpp_functions, tmp_path, n_vocab):
    rng = np.random.default_rng(n_vocab)
    n = 24
    base = (rng.normal(size=(n, n_vocab)) * rng.uniform(0.5, 8, (n, 1))).astype(np.float32)
    base[3] = 1.0  # a flat row: scale 0, every value stored as 0
    base[4, :7] = base[4].max()  # ties for the top
    test = (base + rng.normal(0, 0.3, base.shape)).astype(np.float32)
    tok = rng.integers(0, n_vocab, n).astype(np.int32)
    (tmp_path / "in.bin").write_bytes(np.array([n, n_vocab], "<i4").tobytes() + base.tobytes()
                                      + test.tobytes() + tok.tobytes())
    subprocess.run([str(llamacpp_functions), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                   check=True)
    data = (tmp_path / "out.bin").read_bytes()
    nv = 2 * ((n_vocab + 1) // 2) + 4
    sizes = {"rec": 2 * n * nv, "nll": 8 * n, "kld": 4 * n, "p_diff": 4 * n}
    parts, o = {}, 0
    for name, size in sizes.items():
        parts[name], o = data[o:o + size], o + size
    records, nll = quantize_log_probs(base, tok)
    assert records.tobytes() == parts["rec"]
    np.testing.assert_array_equal(nll, np.frombuffer(parts["nll"], "<f8"))
    t = kld_tokens(test, records, tok)
    np.testing.assert_array_equal(t.kld, np.frombuffer(parts["kld"], "<f4"))
    # Δp = expf(-nll) - expf(-nll_base): glibc's expf is not correctly rounded in rare cases,
    # ours is (float64, rounded once), so one value in a few dozen may differ by an ulp
    np.testing.assert_allclose(t.p_diff, np.frombuffer(parts["p_diff"], "<f4"), rtol=2.0**-22)
    sums = np.frombuffer(data[o:o + 80], "<f8")  # sum_nll .. sum_p_diff4
    stats = KLDStats()
    stats.add(t)
    assert stats.sum_nll == pytest.approx(sums[0], rel=1e-12)
    assert stats.sum_kld == pytest.approx(sums[5], rel=1e-6)
    n_same_top = int(np.frombuffer(data[o + 88:o + 96], "<u8")[0])
    assert stats.n_same_top == n_same_top
