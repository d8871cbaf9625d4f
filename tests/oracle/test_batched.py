"""llama.cpp's ``examples/batched`` replayed through llama-cpp-python against ours.

``batched.cpp`` is transcribed line by line over llama.cpp's own context and samplers
(``llama_sampler_chain`` of ``top_k``, ``top_p``, ``temp``, ``dist``; ``llama_sampler_sample``
on the logits index of each stream; the prompt decoded once with every seq id in one KV
stream): `llamacpp_batched`. On SmolLM2 dequantized to float32 (f32 KV cache, no flash
attention) its texts are ours (``reference.tools.batched.batched`` on the reference Context),
token for token: greedy, and seeded sampling at llama.cpp's default temperature.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference.arch import hparams_from_file
from reference.context import Context
from reference.gguf import read_gguf, write_gguf
from reference.model_loader import ModelLoadError, default_model_path
from reference.quants import QuantizedTensor
from reference.sampling import SamplerChain
from reference.tokenizer import load_tokenizer
from reference.tools.batched import batched, sampler_params

llama_cpp = pytest.importorskip("llama_cpp")
from llamaref.llamacpp import LlamaCppContext  # noqa: E402

PROMPT = "Hello my name is"
N_PREDICT, N_PARALLEL = 20, 3


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
    yield f32, hparams_from_file(gguf), weights, load_tokenizer(path)
    f32.unlink()


def llamacpp_batched(path, n_predict: int, n_parallel: int, seed: int, temp: float):
    """batched.cpp:59-231 over llama.cpp's context and samplers; the streams' tokens."""
    ll = llama_cpp
    with LlamaCppContext(path, n_ctx=256, n_batch=max(n_predict, n_parallel), n_ubatch=512,
                         n_seq_max=n_parallel, kv_unified=True, n_threads=2) as lc:
        tokens = lc.tokenize(PROMPT)  # common_tokenize(vocab, text, add_special=true)
        chains = []
        for _ in range(n_parallel):  # :76-85
            smpl = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
            ll.llama_sampler_chain_add(smpl, ll.llama_sampler_init_top_k(40))
            ll.llama_sampler_chain_add(smpl, ll.llama_sampler_init_top_p(0.95, 0))
            ll.llama_sampler_chain_add(smpl, ll.llama_sampler_init_temp(temp))
            ll.llama_sampler_chain_add(smpl, ll.llama_sampler_init_dist(seed))
            chains.append(smpl)
        n = len(tokens)  # :122-154: the prompt once, every seq id on every token
        assert lc.decode({"token": tokens, "pos": list(range(n)),
                          "seq_id": [list(range(n_parallel))] * n,
                          "logits": [i == n - 1 for i in range(n)]}) == 0
        streams = [[] for _ in range(n_parallel)]
        i_batch = [n - 1] * n_parallel
        n_cur = n
        while n_cur <= n_predict:  # :180-231
            batch = {"token": [], "pos": [], "seq_id": [], "logits": []}
            for i in range(n_parallel):
                if i_batch[i] < 0:
                    continue
                tok = lc.sampler_sample(chains[i], i_batch[i])
                if lc.is_eog(tok) or n_cur == n_predict:
                    i_batch[i] = -1
                    continue
                streams[i].append(tok)
                i_batch[i] = len(batch["token"])
                for key, value in (("token", tok), ("pos", n_cur), ("seq_id", [i]),
                                   ("logits", True)):
                    batch[key].append(value)
            if not batch["token"]:
                break
            n_cur += 1
            assert lc.decode(batch) == 0
        for smpl in chains:
            ll.llama_sampler_free(smpl)
    return tokens, streams


def ours(hp, weights, tokenizer, n_predict: int, n_parallel: int, seed: int, temp: float):
    ctx = Context(hp, weights, n_ctx=256, n_batch=max(n_predict, n_parallel),
                  n_seq_max=n_parallel, kv_unified=True)
    prompt = tokenizer.tokenize(PROMPT, add_special=True)
    chains = [SamplerChain.from_params(sampler_params(temp=temp, seed=seed), hp.n_vocab)
              for _ in range(n_parallel)]
    return prompt, batched(ctx, chains, prompt, n_predict, tokenizer.is_eog).tokens


@pytest.mark.oracle
@pytest.mark.parametrize(("seed", "temp"), [(1, 0.0), (42, 0.8)], ids=["greedy", "seed42"])
def test_batched_texts_are_llamacpps(smol_f32, seed, temp):
    path, hp, weights, tokenizer = smol_f32
    theirs_prompt, theirs = llamacpp_batched(path, N_PREDICT, N_PARALLEL, seed, temp)
    our_prompt, mine = ours(hp, weights, tokenizer, N_PREDICT, N_PARALLEL, seed, temp)
    assert our_prompt == theirs_prompt
    assert mine == theirs
    text = tokenizer.detokenize(mine[0]) if hasattr(tokenizer, "detokenize") else ""
    print(f"{PROMPT!r} + {text!r} x {N_PARALLEL} ({temp=}, {seed=})")
    assert all(len(s) == N_PREDICT - len(our_prompt) for s in mine)
