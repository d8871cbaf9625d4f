"""The accelerated Gemma twin (MLX forward + the MLX iSWA memory) against the reference.

On tiny random ``gemma`` (one cache, no window), ``gemma2`` (1:1 SWA pattern, attention and
final soft-caps, hard ones in the ``-cap`` variant so that the tanh bends the scores) and
``gemma3`` (5:1 pattern, Q/K norms, another RoPE base on its SWA layers, untied output),
with windows of 4 to 6 and prompts longer than the window:

- the Gemma pieces, function by function (GeGLU, the attention with and without a soft-cap in
  both attention forms, the layer weights);
- the MLX Context against the reference Context (NMSE <= ``MAX_NMSE_TWIN``, float32 end to
  end): prefill, token by token, chunked into small ubatches, several sequences in both KV
  modes, ``seq_cp`` branches, a SWA cache smaller than the base one (``swa_full=False``)
  that reuses its cells, Gemma 3's unscaled input embeddings, and the GPU code paths;
- the laws on the MLX Context itself: batched == unbatched, reuse on == off bit for bit, a
  failed decode (-1, 1, 2) changes no bit of either cache;
- state across the twins: a whole blob and a ``PARTIAL_ONLY`` sequence blob
  (``state_seq_get_data_ext(seq, 1)``: the SWA cache only) written by one Context restore into
  the other, which then decodes as the writer does.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import accelerated.models.gemma as A
import reference.models.gemma as R
from accelerated.context import Context as MLXContext
from accelerated.context import kv_caches
from accelerated.device import GPU_PATHS_ENV
from accelerated.memory import KVCacheISWA
from accelerated.models.llama import prepare_weights
from reference.batch import Batch
from reference.common import MAX_NMSE_SELF_F32, MAX_NMSE_TWIN
from reference.context import Context as RefContext
from reference.memory import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
from reference.testing import nmse, random_gemma_weights, tiny_gemma_hparams
from tests.support.helpers import interleave, rows_of

PARTIAL = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
MODELS = {
    "gemma": tiny_gemma_hparams("gemma", n_layer=2, n_ctx_train=4096),
    "gemma2": tiny_gemma_hparams("gemma2", n_layer=4, n_swa=4, n_ctx_train=4096),
    "gemma2-cap": tiny_gemma_hparams("gemma2", n_layer=2, n_swa=5, attn_softcap=0.5,
                                     final_softcap=1.5, n_ctx_train=4096),
    "gemma3": tiny_gemma_hparams("gemma3", n_layer=6, n_swa=6, freq_base=1e6, tied=False,
                                 n_ctx_train=4096),
}
SWA_MODELS = [name for name, hp in MODELS.items() if hp.is_swa_any()]
PROMPT = np.random.default_rng(0).integers(0, 32, 20).tolist()


def model(name):
    hp = MODELS[name]
    return hp, random_gemma_weights(hp, seed=sorted(MODELS).index(name) + 1)


def pair(name, **kwargs):
    """The reference and the MLX Context of model ``name`` (256 cells unless told)."""
    hp, w = model(name)
    kwargs = dict(dict(n_ctx=256, n_batch=256, n_ubatch=256), **kwargs)
    return RefContext(hp, w, **kwargs), MLXContext(hp, w, **kwargs)


def decode(ctx, tokens, seq: int = 0) -> np.ndarray:
    """Decode ``tokens`` of sequence ``seq`` in one batch, every token an output."""
    n = len(tokens)
    assert ctx.decode(Batch(token=list(tokens), seq_id=[[seq]] * n,
                            logits=[True] * n)) == 0, ctx.last_error
    return ctx.get_logits().copy()  # (n, n_vocab)


def assert_twin(want, got) -> None:
    want, got = np.asarray(want), np.asarray(got)
    assert want.shape == got.shape and np.isfinite(got).all()
    assert nmse(want, got) <= MAX_NMSE_TWIN, f"NMSE {nmse(want, got):.3g}"


def snapshot(ctx):
    """Every cell and tensor of every cache of the MLX Context, and its outputs, as NumPy."""
    cells, tensors = [], []
    for cache in kv_caches(ctx.memory):
        cells.append([(c.pos.tolist(), [sorted(c.seq_get_all(i)) for i in range(c.size())],
                       c.shift.tolist()) for c in cache.v_cells])
        tensors += [np.array(t) for t in (*cache.k_l, *cache.v_l)]
    return cells, tensors, ctx.get_logits().copy(), ctx._output_ids.copy()


def assert_same(a, b) -> None:
    assert a[0] == b[0]
    for x, y in zip([*a[1], a[2], a[3]], [*b[1], b[2], b[3]], strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


# ---- the Gemma pieces, function by function -------------------------------------------------


class PastInput:
    """One layer's K/V as plain arrays after ``n_past`` cells, and a mask: the attention input
    of both twins (``cat`` is ``np.concatenate`` or ``mx.concatenate``)."""

    n_stream = 1

    def __init__(self, k, v, mask, cat):
        self.k, self.v, self.mask, self.cat = k, v, mask, cat

    def cpy_k(self, il, k_cur):
        self.k = self.cat([self.k, k_cur])

    def cpy_v(self, il, v_cur):
        self.v = self.cat([self.v, v_cur])

    def get_k(self, il):
        return self.k

    def get_v(self, il):
        return self.v

    def get_kq_mask(self, il):
        return self.mask


def test_geglu_ffn_equals_the_reference():
    rng = np.random.default_rng(1)
    layer = {f: rng.normal(0, 0.3, s).astype(np.float32) for f, s in
             [("ffn_up", (40, 16)), ("ffn_gate", (40, 16)), ("ffn_down", (16, 40))]}
    cur = rng.normal(size=(7, 16)).astype(np.float32)
    for matmul in ("dense", "quantized"):
        prepared = prepare_weights({f"blk.0.{f}.weight": w for f, w in layer.items()}, matmul)
        twin_layer = {f: prepared[f"blk.0.{f}.weight"] for f in layer}
        got = A.build_ffn_geglu(mx.array(cur), twin_layer)
        assert_twin(R.build_ffn_geglu(cur, layer), np.array(got))


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-form", "gpu-form"])
@pytest.mark.parametrize("softcap", [0.0, 50.0, 0.5])
def test_build_attn_gemma_equals_the_reference(softcap, gpu, monkeypatch):
    """Both attention forms, with and without a (binding) soft-cap, over 3 past cells and a
    windowed mask; GQA 4/2."""
    monkeypatch.setenv(GPU_PATHS_ENV, "1" if gpu else "0")
    rng = np.random.default_rng(2)
    n_past, n_tokens, d = 3, 5, 8
    q = rng.normal(0, 2, (n_tokens, 4, d)).astype(np.float32)  # scores beyond the cap of 0.5
    k, v = (rng.normal(size=(n_tokens, 2, d)).astype(np.float32) for _ in range(2))
    k_past, v_past = (rng.normal(size=(n_past, 2, d)).astype(np.float32) for _ in range(2))
    t = np.arange(n_tokens)[:, None] + n_past
    j = np.arange(n_past + n_tokens)[None, :]
    mask = np.where((j <= t) & (t - j < 4), 0.0, -np.inf).astype(np.float32)
    wo = rng.normal(0, 0.3, (16, 4 * d)).astype(np.float32)
    want = R.build_attn_gemma(PastInput(k_past, v_past, mask, np.concatenate), wo, q, k, v,
                              softcap, 0)
    inp = PastInput(mx.array(k_past), mx.array(v_past), mx.array(mask), mx.concatenate)
    got = A.build_attn_gemma(inp, mx.array(wo), mx.array(q), mx.array(k), mx.array(v),
                             softcap, 0)
    assert_twin(want, np.array(got))
    if softcap == 0.5:  # the cap binds: without it the result is another one
        free = R.build_attn_gemma(PastInput(k_past, v_past, mask, np.concatenate), wo, q, k, v,
                                  0.0, 0)
        assert nmse(free, want) > 1e-3


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layer_weights_have_the_reference_fields(name):
    hp, w = model(name)
    ref = R.gemma_layer_weights(w, 1, np.float32, hp.arch)
    twin = A.gemma_layer_weights(prepare_weights(w), 1, np.float32, hp.arch)
    assert sorted(twin) == sorted(ref)
    np.testing.assert_array_equal(np.array(twin["attn_norm"]), ref["attn_norm"])


# ---- the MLX Context against the reference Context ------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefill_logits_equal_the_reference(name):
    ref, acc = pair(name)
    assert_twin(decode(ref, PROMPT), decode(acc, PROMPT))
    hp = MODELS[name]
    assert isinstance(acc.memory, KVCacheISWA) == hp.is_swa_any()
    if hp.f_final_logit_softcapping:
        assert np.abs(acc.get_logits()).max() <= hp.f_final_logit_softcapping


@pytest.mark.parametrize("name", sorted(MODELS))
def test_token_by_token_and_chunked_equal_the_reference_prefill(name):
    ref, acc = pair(name)
    want = decode(ref, PROMPT)
    assert_twin(want, np.concatenate([decode(acc, [t]) for t in PROMPT]))
    _, chunked = pair(name, n_ubatch=3)
    assert_twin(want, decode(chunked, PROMPT))


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("name", SWA_MODELS)
def test_multi_sequence_small_ubatches_equal_the_reference(name, kv_unified):
    ref, acc = pair(name, n_seq_max=3, n_ubatch=4, kv_unified=kv_unified)
    rng = np.random.default_rng(5)
    token, seq_id = interleave([rng.integers(0, 32, n).tolist() for n in (9, 12, 7)])
    batch = Batch(token=token, seq_id=seq_id, logits=[True] * len(token))
    assert ref.decode(batch) == 0 and acc.decode(batch) == 0
    assert_twin(ref.get_logits(), acc.get_logits())
    more = Batch(token=[3, 4, 5], seq_id=[[0], [1], [2]], logits=[True] * 3)
    assert ref.decode(more) == 0 and acc.decode(more) == 0
    assert_twin(ref.get_logits(), acc.get_logits())


@pytest.mark.parametrize("name", SWA_MODELS)
def test_seq_cp_branches_equal_the_reference_and_independent_decodes(name):
    ref, acc = pair(name, n_seq_max=3)
    prefix, tails = PROMPT[:11], [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    for ctx in (ref, acc):
        decode(ctx, prefix)
        for s in (1, 2):
            ctx.memory.seq_cp(0, s, -1, -1)
    for s, tail in enumerate(tails):
        got = decode(acc, tail, seq=s)
        assert_twin(decode(ref, tail, seq=s), got)
        _, alone = pair(name)
        assert nmse(decode(alone, prefix + tail)[len(prefix):], got) <= MAX_NMSE_SELF_F32


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_small_swa_cache_reuses_its_cells_as_the_reference(name):
    """300 positions, windows of 4 and 6, a 256-cell SWA cache under a 512-cell base one: the
    SWA cache forgets masked cells, each cache has its own view, the logits stay the
    reference's."""
    ref, acc = pair(name, n_ctx=512, n_batch=64, n_ubatch=16, swa_full=False)
    tokens = np.random.default_rng(3).integers(0, 32, 300).tolist()
    for i in range(0, 300, 60):
        assert_twin(decode(ref, tokens[i:i + 60]), decode(acc, tokens[i:i + 60]))
    mem = acc.memory
    assert mem.kv_swa.get_size() == 256 < mem.kv_base.get_size()
    assert mem.kv_base.v_cells[0].get_used() == 300 > mem.kv_swa.v_cells[0].get_used()
    assert acc._prev_key.n_kv > acc._prev_key.n_kv_swa  # the two views differ
    for t in (1, 2, 3):
        assert_twin(decode(ref, [t]), decode(acc, [t]))


def test_gemma3_input_embeddings_equal_the_reference():
    """Gemma 3 does not scale input embeddings; Gemma 2 does: both as the reference."""
    embd = np.random.default_rng(4).normal(size=(9, 16)).astype(np.float32)
    for name in ("gemma2", "gemma3"):
        ref, acc = pair(name)
        batch = Batch(embd=embd, logits=[True] * 9)
        assert ref.decode(batch) == 0 and acc.decode(batch) == 0
        assert_twin(ref.get_logits(), acc.get_logits())
        assert_twin(decode(ref, [1, 2]), decode(acc, [1, 2]))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_gpu_code_paths_equal_the_reference(name, monkeypatch):
    """The fused attention (or the soft-capped op sequence) and quantized-form matmuls."""
    monkeypatch.setenv(GPU_PATHS_ENV, "1")
    ref, acc = pair(name, n_ubatch=7)
    assert_twin(decode(ref, PROMPT), decode(acc, PROMPT))
    assert_twin(decode(ref, [3]), decode(acc, [3]))


# ---- laws on the MLX Context ----------------------------------------------------------------


@pytest.mark.parametrize("n_ubatch", [1, 5])
@pytest.mark.parametrize("name", SWA_MODELS)
def test_batched_equals_unbatched(name, n_ubatch):
    seqs = [PROMPT[:9], PROMPT[5:17], PROMPT[3:10]]
    token, seq_id = interleave(seqs)
    _, acc = pair(name, n_seq_max=3, n_ubatch=n_ubatch)
    assert acc.decode(Batch(token=token, seq_id=seq_id, logits=[True] * len(token))) == 0
    got = acc.get_logits()
    for s, tokens in enumerate(seqs):
        _, alone = pair(name)
        want = decode(alone, tokens)
        assert nmse(want, rows_of(got, seq_id, s)) <= MAX_NMSE_SELF_F32


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_reuse_on_and_off_are_bit_identical(name, kv_unified):
    hp, w = model(name)
    kw = dict(n_ctx=256, n_seq_max=3, n_ubatch=4, kv_unified=kv_unified)
    on, off = MLXContext(hp, w, graph_reuse=True, **kw), MLXContext(hp, w, graph_reuse=False, **kw)
    rng = np.random.default_rng(6)
    token, seq_id = interleave([rng.integers(0, 32, n).tolist() for n in (8, 11, 6)])
    batches = [Batch(token=token, seq_id=seq_id, logits=[True] * len(token))]
    batches += [Batch(token=rng.integers(0, 32, 3).tolist(), seq_id=[[0], [1], [2]],
                      logits=[True] * 3) for _ in range(6)]
    for batch in batches:
        assert on.decode(batch) == 0 and off.decode(batch) == 0
        assert_same(snapshot(on), snapshot(off))
    assert on.perf().n_reused > 0 and off.perf().n_reused == 0


@pytest.mark.parametrize("name", SWA_MODELS)
def test_failed_decodes_change_nothing(name):
    _, acc = pair(name, n_ctx=256, n_batch=256, n_ubatch=16, n_seq_max=2, swa_full=False)
    decode(acc, PROMPT)
    before = snapshot(acc)
    assert acc.decode(Batch(token=[99])) == -1  # a token out of the vocabulary
    assert acc.decode(Batch(token=[1], pos=[40])) == -1  # a hole in the positions
    assert_same(before, snapshot(acc))
    acc.memory.seq_cp(0, 1, -1, -1)  # shared cells are never reused: no room for 240 more
    before = snapshot(acc)
    assert acc.decode(Batch(token=[5] * 240)) == 1
    assert_same(before, snapshot(acc))
    acc.abort_callback = lambda: True  # aborted in its first ubatch: nothing of it is kept
    assert acc.decode(Batch(token=[5, 6])) == 2
    after = snapshot(acc)
    assert after[0] == before[0]
    for x, y in zip(before[1], after[1], strict=True):
        assert x.tobytes() == y.tobytes()


# ---- state across the twins -----------------------------------------------------------------


@pytest.mark.parametrize("writer", ["ref", "mlx"])
@pytest.mark.parametrize("name", SWA_MODELS)
def test_a_whole_state_restores_across_the_twins(name, writer):
    ref, acc = pair(name, n_seq_max=2)
    src, dst = (ref, acc) if writer == "ref" else (acc, ref)
    decode(src, PROMPT[:13])
    decode(src, PROMPT[:5], seq=1)
    blob = src.state_get_data()
    assert dst.state_set_data(blob) == len(blob)
    if writer == "ref":  # the MLX tensors hold the blob's float32 values exactly
        assert acc.state_get_data() == blob
    for seq, tail in ((0, PROMPT[13:]), (1, [7, 8, 9])):
        assert_twin(decode(src, tail, seq), decode(dst, tail, seq))


@pytest.mark.parametrize("writer", ["ref", "mlx"])
@pytest.mark.parametrize("name", SWA_MODELS)
def test_a_partial_sequence_state_restores_across_the_twins(name, writer):
    """``PARTIAL_ONLY`` holds the SWA cache only: restored over a sequence whose base part is
    in place (both twins decoded the same prefix), the reader goes on as the writer."""
    ref, acc = pair(name)
    src, dst = (ref, acc) if writer == "ref" else (acc, ref)
    for ctx in (ref, acc):
        decode(ctx, PROMPT[:12])
    partial = src.state_seq_get_data_ext(0, PARTIAL)
    assert len(partial) < len(src.state_seq_get_data_ext(0))
    # the reader goes astray, drops its own tail, and loses its SWA part: the blob brings it back
    decode(dst, [9, 9, 9])
    dst.memory.seq_rm(0, 12, -1)
    dst.memory.kv_swa.seq_rm(0, -1, -1)
    assert dst.state_seq_set_data_ext(partial, 0, PARTIAL) == len(partial)
    n_swa = MODELS[name].n_swa  # the blob holds the cells the window shows from position 11
    assert (dst.memory.seq_pos_min(0), dst.memory.seq_pos_max(0)) == (11 - n_swa + 1, 11)
    if writer == "ref":
        assert acc.state_seq_get_data_ext(0, PARTIAL) == partial
    assert_twin(decode(src, PROMPT[12:]), decode(dst, PROMPT[12:]))


@pytest.mark.parametrize("name", SWA_MODELS)
def test_a_token_left_on_the_device_decodes_as_the_reference(name):
    """``decode_token`` with an ``mx.array`` token (a device sampler's pick, not read back)."""
    ref, acc = pair(name)
    decode(ref, PROMPT)
    decode(acc, PROMPT)
    for _ in range(3):
        token = mx.argmax(acc.get_logits_ith_device(-1))  # stays on the device
        assert acc.decode_token(token) == 0
        assert ref.decode_token(int(np.argmax(ref.get_logits()[-1]))) == 0
        assert_twin(ref.get_logits(), acc.get_logits())


@pytest.mark.parametrize("matmul", ["dense", "quantized"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_q4_0_weights_equal_the_reference_in_both_matmul_formulations(arch, matmul):
    """Q4_0 matrices (the lm_head tied to a quantized ``token_embd`` for Gemma 2): the MLX
    forms are lossless, so the logits are the reference's dequantized ones."""
    from gguf import GGMLQuantizationType

    from accelerated.quants import MLXQuantized
    from reference.quants import QuantizedTensor

    hp = tiny_gemma_hparams(arch, n_embd=32, n_ff=64, n_swa=4, tied=arch == "gemma2",
                            n_ctx_train=4096)
    w = {name: QuantizedTensor.from_float(t, GGMLQuantizationType.Q4_0) if t.ndim == 2 else t
         for name, t in random_gemma_weights(hp, seed=9).items()}
    ref = RefContext(hp, w, n_ctx=256)
    acc = MLXContext(hp, w, n_ctx=256, matmul=matmul)
    assert isinstance(acc.mlx_weights["blk.0.attn_q.weight"], MLXQuantized) == (
        matmul == "quantized")
    assert_twin(decode(ref, PROMPT), decode(acc, PROMPT))
    assert_twin(decode(ref, [4]), decode(acc, [4]))
