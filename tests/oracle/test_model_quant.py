"""Oracle: ``reference.model_quant`` against llama.cpp's own quantizer, file for file.

llama.cpp's ``llama_model_quantize`` (through llama-cpp-python, ``nthread = 1``, no importance
matrix) and ``quantize_model`` + ``write_gguf`` quantize the same random float32 GGUF; the two
files must be equal byte for byte: every tensor's type and blocks, the tensor order, the
metadata (``general.file_type``, ``general.quantization_version``) and the padding.

- ``test_the_file_is_llama_cpps``: a 2-layer llama (rows of 256), seven file types;
- ``test_tied_embeddings_and_biases``: a tied qwen2 with biases (token_embd takes the
  output's type; 1-D biases stay F32);
- ``test_rows_that_do_not_fit_fall_back``: rows of 288 (K-quants -> Q4_0 / Q5_0 / Q5_1 /
  Q8_0) and of 272
  (not even 32-blocks: F16), and an n_embd of 96 (output.weight -> Q8_0);
- ``test_the_plan_is_llama_cpps``: only the types, for every supported file type, on models
  whose matrices have two rows (so llama.cpp's work is small): 32 and 80 layers (the 70B
  rule), GQA 1 / 2 / 4 / 8, tied or not, a Gemma 2, an 8-expert model, and rows that need
  Q5_0/Q5_1; a fallback type that cannot be written is refused, naming the tensor;
- the options ``--pure``, ``--output-tensor-type``, ``--token-embedding-type``,
  ``--leave-output-tensor`` and ``--allow-requantize`` (an F16 and a Q8_0 source).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from reference.arch import llama_metadata
from reference.gguf import read_gguf, write_gguf
from reference.model_quant import (
    FTYPE_ALIASES,
    FTYPES,
    ModelQuantError,
    QuantizeParams,
    parse_ftype,
    quantize_model,
    tensor_types,
    typed_metadata,
)
from reference.quants import QUANTIZE, QuantizedTensor
from reference.testing import random_weights, tiny_hparams, write_tiny_gguf

T = GGMLQuantizationType
PLAIN = QuantizeParams()  # llama_model_quantize_default_params()
pytestmark = pytest.mark.oracle

FILE_TYPES = [name for name in FTYPES if name not in FTYPE_ALIASES]


# ---------------------------------------------------------------------------------------------
# The two quantizers
# ---------------------------------------------------------------------------------------------


def llama_cpp_quantize(src, dst, ftype: str, params: QuantizeParams = PLAIN) -> None:
    """llama.cpp's ``llama_model_quantize`` with the default parameters, one thread."""
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = int(parse_ftype(ftype))
    p.nthread = 1
    p.pure = params.pure
    p.quantize_output_tensor = params.quantize_output_tensor
    p.allow_requantize = params.allow_requantize
    if params.output_tensor_type is not None:
        p.output_tensor_type = int(params.output_tensor_type)
    if params.token_embedding_type is not None:
        p.token_embedding_type = int(params.token_embedding_type)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    assert rc == 0, f"llama_model_quantize failed ({rc})"


def our_quantize(src, dst, ftype: str, params: QuantizeParams = PLAIN) -> None:
    f = read_gguf(src)
    tensors, metadata = quantize_model(f.tensors, typed_metadata(f), ftype, params)
    write_gguf(dst, metadata, tensors)


def assert_same_file(src, tmp_path, ftype: str, params: QuantizeParams = PLAIN):
    """Both quantizers on ``src``; the files are equal byte for byte (types first, for a
    readable failure). Returns llama.cpp's file, read."""
    theirs, ours = tmp_path / f"llama-{ftype}.gguf", tmp_path / f"ours-{ftype}.gguf"
    llama_cpp_quantize(src, theirs, ftype, params)
    our_quantize(src, ours, ftype, params)
    a, b = read_gguf(theirs), read_gguf(ours)
    assert _types(b) == _types(a)
    assert b.metadata["general.file_type"] == a.metadata["general.file_type"] == \
        int(parse_ftype(ftype))
    for name, t in a.tensors.items():
        x, y = (t.data if isinstance(t, QuantizedTensor) else t), b.tensors[name]
        assert np.array_equal(getattr(y, "data", y), x), name
    assert theirs.read_bytes() == ours.read_bytes()
    return a


def _types(f) -> list[tuple[str, str]]:
    return [(k, getattr(v, "qtype", T.F32).name) for k, v in f.tensors.items()]


# ---------------------------------------------------------------------------------------------
# Whole files
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    hp = tiny_hparams("llama", n_vocab=32, n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
                      n_ff=256)
    return write_tiny_gguf(tmp_path_factory.mktemp("mq") / "llama.gguf", hp, random_weights(hp))


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "Q4_0",
                                   "Q8_0"])
def test_the_file_is_llama_cpps(llama_file, tmp_path, ftype):
    a = assert_same_file(llama_file, tmp_path, ftype)
    assert a.metadata["general.quantization_version"] == 2


def test_tied_embeddings_and_biases(tmp_path):
    hp = tiny_hparams("qwen2", n_vocab=32, n_layer=1, n_embd=256, n_head=4, n_head_kv=4,
                      n_ff=256, tied=True)
    src = write_tiny_gguf(tmp_path / "qwen2.gguf", hp, random_weights(hp))
    a = assert_same_file(src, tmp_path, "Q4_K_M")
    assert a.tensors["token_embd.weight"].qtype == T.Q6_K  # the output's type
    assert a.tensors["blk.0.attn_q.bias"].dtype == np.float32


@pytest.mark.parametrize("ftype, n_embd, n_ff, fallback", [
    ("Q6_K", 256, 288, T.Q8_0), ("Q2_K", 256, 288, T.Q4_0),
    ("Q4_0", 256, 272, T.F16), ("Q8_0", 256, 272, T.F16), ("Q6_K", 96, 96, T.Q8_0),
])
def test_rows_that_do_not_fit_fall_back(tmp_path, ftype, n_embd, n_ff, fallback):
    hp = tiny_hparams("llama", n_vocab=32, n_layer=1, n_embd=n_embd, n_head=2, n_head_kv=1,
                      n_ff=n_ff)
    src = write_tiny_gguf(tmp_path / "odd.gguf", hp, random_weights(hp))
    a = assert_same_file(src, tmp_path, ftype)
    assert a.tensors["blk.0.ffn_down.weight"].qtype == fallback


@pytest.mark.parametrize("ftype, fallback", [("Q4_K_M", T.Q5_0), ("Q5_K_M", T.Q5_1)])
def test_k_quant_rows_that_do_not_fit_fall_back_to_q5(tmp_path, ftype, fallback):
    """Layer 1 of 3 gets the file's K-quant for ``ffn_down`` (not Q6_K's "more bits"); rows of
    288 are no whole super-block, so llama.cpp writes Q5_0 (Q4_K) or Q5_1 (Q5_K) instead."""
    hp = tiny_hparams("llama", n_vocab=32, n_layer=3, n_embd=256, n_head=2, n_head_kv=1,
                      n_ff=288)
    src = write_tiny_gguf(tmp_path / "odd.gguf", hp, random_weights(hp))
    a = assert_same_file(src, tmp_path, ftype)
    assert a.tensors["blk.1.ffn_down.weight"].qtype == fallback


# ---------------------------------------------------------------------------------------------
# The plan, on many layers (two rows per matrix: the types depend on names and row lengths)
# ---------------------------------------------------------------------------------------------

LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")


def skeleton(hp, ncols: int = 256, n_ff: int = 512, experts: int = 0) -> dict:
    """Random tensors with a llama model's names, every matrix two rows long."""
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (2, ncols), "output_norm.weight": (ncols,)}
    if not hp.tied_output:
        shapes["output.weight"] = (2, ncols)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        shapes |= {f"{b}{n}.weight": (2, ncols) for n in LAYER_MATRICES}
        shapes |= {f"{b}attn_norm.weight": (ncols,), f"{b}ffn_norm.weight": (ncols,),
                   f"{b}ffn_down.weight": (2, n_ff)}
        if experts:
            del shapes[f"{b}ffn_gate.weight"], shapes[f"{b}ffn_up.weight"]
            del shapes[f"{b}ffn_down.weight"]
            shapes |= {f"{b}ffn_gate_inp.weight": (experts, ncols),
                       f"{b}ffn_gate_exps.weight": (experts, 2, ncols),
                       f"{b}ffn_up_exps.weight": (experts, 2, ncols),
                       f"{b}ffn_down_exps.weight": (experts, 2, n_ff)}
            if il == 0:  # with experts llama.cpp reads the layer from the name, not a count
                del shapes[f"{b}ffn_down_exps.weight"]
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


PLAN_MODELS = {
    "llama-32-gqa4": (tiny_hparams("llama", n_layer=32, n_embd=256, n_head=8, n_head_kv=2),
                      {}),
    "llama-80-gqa4 (70B)": (tiny_hparams("llama", n_layer=80, n_embd=256, n_head=8,
                                         n_head_kv=2), {}),
    "llama-80-mha (65B)": (tiny_hparams("llama", n_layer=80, n_embd=256, n_head=4,
                                        n_head_kv=4), {}),
    "qwen2-24-tied-gqa8": (tiny_hparams("qwen2", n_layer=24, n_embd=256, n_head=8,
                                        n_head_kv=1, tied=True), {}),
    "llama-8-experts": (tiny_hparams("llama", n_layer=4, n_embd=256, n_head=4, n_head_kv=4,
                                     n_expert=8, n_expert_used=2), dict(experts=8)),
    "llama-rows-288": (tiny_hparams("llama", n_layer=9, n_embd=256, n_head=4, n_head_kv=2),
                       dict(n_ff=288)),
    "llama-rows-96": (tiny_hparams("llama", n_layer=9, n_embd=96, n_head=2, n_head_kv=1),
                      dict(ncols=96, n_ff=96)),
    "llama-rows-80": (tiny_hparams("llama", n_layer=3, n_embd=80, n_head=2, n_head_kv=1),
                      dict(ncols=80, n_ff=80)),
}


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    out = {}
    for key, (hp, kw) in PLAN_MODELS.items():
        path = tmp_path_factory.mktemp("plan") / "m.gguf"
        write_gguf(path, llama_metadata(hp), skeleton(hp, **kw))
        out[key] = path
    return out


@pytest.mark.parametrize("model", list(PLAN_MODELS))
def test_the_plan_is_llama_cpps(plan_files, tmp_path, model):
    f = read_gguf(plan_files[model])
    for ftype in FILE_TYPES:
        llama_cpp_quantize(f.path, tmp_path / "q.gguf", ftype)
        theirs = _types(read_gguf(tmp_path / "q.gguf"))
        ours = [(k, t.name) for k, t in tensor_types(f.tensors, f.metadata, ftype).items()]
        assert ours == theirs, (model, ftype)


def test_the_gemma2_plan_is_llama_cpps(tmp_path):
    from reference.testing import random_gemma_weights, tiny_gemma_hparams

    hp = tiny_gemma_hparams("gemma2", n_layer=8, n_embd=256, n_head=4, n_head_kv=2,
                            n_ff=256)
    src = tmp_path / "gemma2.gguf"
    write_gguf(src, llama_metadata(hp), random_gemma_weights(hp))
    f = read_gguf(src)
    for ftype in ("Q4_K_M", "Q3_K_L", "Q2_K"):
        llama_cpp_quantize(src, tmp_path / "q.gguf", ftype)
        theirs = _types(read_gguf(tmp_path / "q.gguf"))
        assert [(k, t.name) for k, t in tensor_types(f.tensors, f.metadata, ftype).items()] \
            == theirs, ftype


def test_a_fallback_that_cannot_be_written_is_refused_by_name(plan_files, monkeypatch):
    monkeypatch.delitem(QUANTIZE, T.Q5_0)  # as if reference.quants could not write Q5_0
    f = read_gguf(plan_files["llama-rows-288"])
    plan = tensor_types(f.tensors, f.metadata, "Q4_K_M")
    assert plan["blk.1.ffn_down.weight"] == T.Q5_0  # llama.cpp's fallback for Q4_K
    with pytest.raises(ModelQuantError, match=r"blk\.1\.ffn_down\.weight needs type Q5_0 .* "
                                              r"row of 288 weights"):
        quantize_model(f.tensors, f.metadata, "Q4_K_M")


# ---------------------------------------------------------------------------------------------
# The options
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    QuantizeParams(pure=True),
    QuantizeParams(output_tensor_type=T.Q4_0, token_embedding_type=T.Q8_0),
    QuantizeParams(quantize_output_tensor=False),
], ids=["pure", "output-and-embedding-types", "leave-output-tensor"])
def test_the_options_are_llama_cpps(llama_file, tmp_path, params):
    assert_same_file(llama_file, tmp_path, "Q3_K_S", params)


def test_an_f16_source_and_a_requantized_q8_0_source(llama_file, tmp_path):
    f16 = tmp_path / "f16.gguf"
    llama_cpp_quantize(llama_file, f16, "F16")
    assert_same_file(f16, tmp_path, "Q4_K_S")
    q8 = tmp_path / "q8.gguf"
    llama_cpp_quantize(llama_file, q8, "Q8_0")
    f = read_gguf(q8)
    with pytest.raises(ModelQuantError, match="requantizing from type Q8_0 is disabled"):
        quantize_model(f.tensors, typed_metadata(f), "Q4_0")
    assert_same_file(q8, tmp_path, "Q4_0", QuantizeParams(allow_requantize=True))


def test_every_file_type_has_its_llama_cpp_number():
    assert {n: int(FTYPES[n]) for n in FILE_TYPES} == {
        "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12,
        "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7,
        "F16": 1, "BF16": 32, "F32": 0}
