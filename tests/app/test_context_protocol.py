"""Every context the programs run on declares the same surface: ``ContextLike``.

The programs of ``reference/tools/`` and the bench read a context's attributes plainly
(``ctx.recurrent``, ``ctx.kv_unified``, ``ctx.last_error``, ``ctx.on_device``), so every
context must have all of them, of the declared kind: the reference Context and its MLX twin
on each architecture (llama, gemma2's iSWA cache, mamba, mamba2), and llama.cpp's own
context (:class:`llamaref.llamacpp.LlamaCppContext`). The checker itself must fail on a
context that falls short.
"""

from __future__ import annotations

import numpy as np
import pytest

from accelerated.context import Context as MLXContext
from llamaref.llamacpp import LlamaCppContext
from reference.batch import Batch
from reference.context import Context, PerfContextData, is_recurrent
from reference.context_protocol import ContextLike, MemoryLike, protocol_mismatches
from reference.model_loader import ModelLoadError, default_model_path
from reference.testing import (
    random_gemma_weights,
    random_mamba_weights,
    random_weights,
    tiny_gemma_hparams,
    tiny_hparams,
    tiny_mamba_hparams,
    write_tiny_gguf,
    write_tiny_mamba_gguf,
)
from reference.tokenizer import load_tokenizer

MODELS = {
    "llama": lambda: (hp := tiny_hparams(n_layer=1), random_weights(hp)),
    "gemma2": lambda: (hp := tiny_gemma_hparams(n_swa=4), random_gemma_weights(hp)),
    "mamba": lambda: (hp := tiny_mamba_hparams("mamba"), random_mamba_weights(hp)),
    "mamba2": lambda: (hp := tiny_mamba_hparams("mamba2"), random_mamba_weights(hp)),
}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("context", [Context, MLXContext], ids=["reference", "mlx"])
def test_our_contexts_are_context_like(context, model):
    hp, weights = MODELS[model]()
    ctx = context(hp, weights, n_ctx=64, n_seq_max=2)
    assert protocol_mismatches(ctx, ContextLike) == []
    assert ctx.recurrent == is_recurrent(hp)
    assert ctx.on_device == hasattr(ctx, "get_logits_ith_device")  # the flag is the truth
    assert ctx.decode(Batch(token=[1, 2, 3])) == 0 and ctx.last_error is None


@pytest.fixture(scope="module")
def llama_cpp():
    """llama-cpp-python (an oracle: CI fails on the skip)."""
    return pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def ggufs(llama_cpp, tmp_path_factory):
    """A tiny float32 llama and mamba as GGUF files, with the hyperparameters written."""
    folder = tmp_path_factory.mktemp("protocol")
    hp, mp = tiny_hparams(n_layer=1), tiny_mamba_hparams("mamba")
    return {
        "llama": (write_tiny_gguf(folder / "l.gguf", hp, random_weights(hp)), hp),
        "mamba": (write_tiny_mamba_gguf(folder / "m.gguf", mp, random_mamba_weights(mp)), mp),
    }


@pytest.mark.oracle
@pytest.mark.parametrize("model", ["llama", "mamba"])
@pytest.mark.parametrize("f32", [True, False], ids=["f32", "llamacpp-defaults"])
def test_llamacpp_context_is_context_like(ggufs, model, f32):
    path, hp = ggufs[model]
    with LlamaCppContext(path, 64, 8, 8, n_seq_max=2, f32=f32) as ctx:
        assert protocol_mismatches(ctx, ContextLike) == []
        assert protocol_mismatches(ctx.memory, MemoryLike) == []
        assert (ctx.recurrent, ctx.on_device) == (is_recurrent(hp), False)
        fields = ("arch", "n_vocab", "n_embd", "n_layer", "n_ctx_train")
        assert [getattr(ctx.hparams, f) for f in fields] == [getattr(hp, f) for f in fields]
        assert ctx.decode(Batch(token=[1, 2, 3])) == 0 and ctx.last_error is None
        ctx.synchronize()
        assert isinstance(ctx.perf(), PerfContextData) and ctx.perf().n_p_eval == 3
        assert ctx.decode(Batch(token=[1], pos=[3], seq_id=[[5]])) == -1  # seq id >= n_seq_max
        assert ctx.last_error.startswith("invalid batch")


@pytest.mark.oracle
def test_llamacpp_context_state_ext_and_samplers(ggufs, llama_cpp):
    """The pieces the oracle tests reach for: a sequence's state with flags, a llama.cpp
    sampler on a row of the last decode."""
    path, _ = ggufs["llama"]
    with LlamaCppContext(path, 64, 8, 8, n_seq_max=2) as ctx:
        assert ctx.decode(Batch(token=[1, 2, 3], logits=[True] * 3)) == 0
        blob = ctx.state_seq_get_data_ext(0, 0)
        assert blob == ctx.state_seq_get_data(0)
        assert ctx.state_seq_set_data_ext(blob, 1, 0) == len(blob)
        assert ctx.memory.seq_pos_max(1) == 2
        greedy = llama_cpp.llama_sampler_init_greedy()
        try:
            assert ctx.sampler_sample(greedy, 1) == int(np.argmax(ctx.get_logits_ith(1)))
        finally:
            llama_cpp.llama_sampler_free(greedy)


@pytest.mark.oracle
def test_llamacpp_context_tokenizes_as_ours_on_smollm2(llama_cpp):
    try:
        path = default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    ours = load_tokenizer(path)
    with LlamaCppContext(path, 64, 8, 8) as ctx:
        for text in ("Hello my name is", "<|im_start|>user\n héllo"):
            for special in (False, True):
                assert ctx.tokenize(text, add_special=special, parse_special=special) == \
                    ours.tokenize(text, add_special=special, parse_special=special)
        eog = [t for t in range(ctx.n_vocab) if ctx.is_eog(t)]
        assert eog and all(ours.is_eog(t) for t in eog)


class ShortContext:
    """A context that falls short in every way the checker looks at."""

    n_ctx = "256"  # declared int
    kv_unified = True

    def recurrent(self) -> bool:  # declared a value
        return False

    def decode(self, batch, extra) -> int:  # declared (batch)
        return 0

    class memory:  # a namespace standing in for the memory: only clear()
        @staticmethod
        def clear(data: bool = True) -> None:
            pass


def test_the_checker_names_what_falls_short():
    found = protocol_mismatches(ShortContext(), ContextLike)
    assert "hparams: missing" in found
    assert "n_ctx: str, declared <class 'int'>" in found
    assert any(line.startswith("recurrent: a method") for line in found)
    assert "decode: parameters (batch, extra), declared (batch)" in found
    assert "memory.seq_rm: missing" in found and "memory.clear: missing" not in found
    assert not any(line.startswith("kv_unified") for line in found)
