"""``llamaref quantize`` (``llamaref.quantize``): the file it writes is ``quantize_model``'s
(which is llama.cpp's, byte for byte: tests/oracle/test_model_quant.py), the type by name,
alias or number, llama-quantize's flags, and every bad input refused in one line, exit code 1,
before anything is written (an existing output stays as it was)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from llamaref.cli import main
from reference.arch import llama_metadata
from reference.gguf import read_gguf, write_gguf
from reference.model_quant import QuantizeParams, quantize_model, typed_metadata
from reference.quants import QUANTIZE, QuantizedTensor
from reference.testing import random_weights, tiny_hparams, write_tiny_gguf

T = GGMLQuantizationType
PLAIN = QuantizeParams()  # llama_model_quantize_default_params()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hp = tiny_hparams("llama", n_vocab=32, n_layer=1, n_embd=256, n_head=4, n_head_kv=2,
                      n_ff=256)
    return write_tiny_gguf(tmp_path_factory.mktemp("q") / "m-f32.gguf", hp, random_weights(hp))


def expected_bytes(src, ftype: str, params: QuantizeParams = PLAIN, tmp=None):
    f = read_gguf(src)
    tensors, md = quantize_model(f.tensors, typed_metadata(f), ftype, params)
    write_gguf(tmp, md, tensors)
    return tmp.read_bytes()


@pytest.mark.parametrize("type_arg", ["Q4_K_M", "q4_k_m", "Q4_K", "15"])
def test_the_file_is_quantize_models(model, tmp_path, capsys, type_arg):
    out = tmp_path / "m-q4km.gguf"
    assert main(["quantize", str(model), str(out), type_arg]) == 0
    assert out.read_bytes() == expected_bytes(model, "Q4_K_M", tmp=tmp_path / "x.gguf")
    err = capsys.readouterr().err
    assert err.startswith(f"llamaref: quantized '{model}' to '{out}' as Q4_K_M: ")


def test_the_flags_are_llama_quantizes(model, tmp_path):
    out = tmp_path / "pure.gguf"
    assert main(["quantize", "--pure", "--output-tensor-type", "q8_0",
                 "--token-embedding-type", "Q4_0", "--leave-output-tensor",
                 str(model), str(out), "Q6_K"]) == 0
    params = QuantizeParams(pure=True, output_tensor_type=T.Q8_0,
                            token_embedding_type=T.Q4_0, quantize_output_tensor=False)
    assert out.read_bytes() == expected_bytes(model, "Q6_K", params, tmp_path / "x.gguf")
    f = read_gguf(out)
    assert f.tensors["output.weight"].dtype == np.float32  # left as it was
    assert f.tensors["token_embd.weight"].qtype == T.Q4_0


def test_help_lists_the_types_as_llama_quantize(capsys):
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    out = capsys.readouterr().out
    assert "  15  or  Q4_K_M  :  4.58G, +0.1754 ppl @ Llama-3-8B" in out
    assert "  12  or  Q3_K    : alias for Q3_K_M" in out
    assert "not supported here (llama-quantize writes them): Q1_0, " in out


def _bad(tmp_path, capsys, argv) -> str:
    out = tmp_path / "out.gguf"
    out.write_bytes(b"old")
    assert main(["quantize", *[a.replace("OUT", str(out)) for a in argv]]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llamaref: error: ") and err.count("\n") == 1, err
    assert out.read_bytes() == b"old"  # nothing written
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out.gguf")] == \
        ["out.gguf"]  # no temporary file left
    return err.removeprefix("llamaref: error: ").rstrip("\n")


def test_an_unknown_type_is_refused(model, tmp_path, capsys):
    err = _bad(tmp_path, capsys, [str(model), "OUT", "Q4_K_X"])
    assert err.startswith("unknown file type 'Q4_K_X'; supported: Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, ")


def test_a_type_llama_quantize_writes_but_we_cannot_is_named(model, tmp_path, capsys):
    err = _bad(tmp_path, capsys, [str(model), "OUT", "iq2_xxs"])
    assert err.startswith("file type IQ2_XXS is not supported: llama-quantize writes it, but "
                          "its tensor types cannot be written here; supported: Q4_0, ")
    err = _bad(tmp_path, capsys, [str(model), "OUT", "19"])  # IQ2_XXS's number
    assert err.startswith("file type 19 is not supported; supported: 0 (F32), 1 (F16), 2 (Q4_0)")


def test_a_bad_tensor_type_flag_is_refused(model, tmp_path, capsys):
    err = _bad(tmp_path, capsys, ["--output-tensor-type", "q9_9", str(model), "OUT", "Q4_0"])
    assert err.startswith("unknown or unsupported tensor type 'q9_9'; supported: F32, F16, ")


def test_a_flag_type_whose_blocks_do_not_fit_is_refused(tmp_path, capsys):
    hp = tiny_hparams("llama", n_vocab=32, n_layer=1, n_embd=96, n_head=2, n_head_kv=1,
                      n_ff=96)
    src = write_tiny_gguf(tmp_path / "m96.gguf", hp, random_weights(hp))
    err = _bad(tmp_path, capsys, ["--token-embedding-type", "q4_k", str(src), "OUT", "Q8_0"])
    assert err == (f"{src}: token_embd.weight: a row of 96 weights is not a whole number of "
                   "Q4_K blocks (256 weights each)")


def test_a_missing_or_malformed_input_is_refused(tmp_path, capsys):
    err = _bad(tmp_path, capsys, [str(tmp_path / "none.gguf"), "OUT", "Q4_0"])
    assert err == f"input file not found: {tmp_path / 'none.gguf'}"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x07\x00\x00\x00")
    err = _bad(tmp_path, capsys, [str(bad), "OUT", "Q4_0"])
    assert "GGUF" in err and "version" in err


def test_a_plan_that_cannot_be_written_is_refused_before_writing(tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.delitem(QUANTIZE, T.Q5_0)  # as if reference.quants could not write Q5_0
    hp = tiny_hparams("llama", n_vocab=32, n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
                      n_ff=288)  # blk.0's ffn_down: Q4_K (blk.1's: Q6_K, falling back to Q8_0)
    src = write_tiny_gguf(tmp_path / "odd.gguf", hp, random_weights(hp))
    err = _bad(tmp_path, capsys, [str(src), "OUT", "Q4_K_M"])
    assert err.startswith(f"{src}: blk.0.ffn_down.weight needs type Q5_0 (llama.cpp's "
                          "choice, a fallback for its row of 288 weights), which this project "
                          "cannot write yet; supported: F32, F16, ")


def test_requantizing_needs_the_flag(model, tmp_path, capsys):
    q8 = tmp_path / "q8.gguf"
    assert main(["quantize", str(model), str(q8), "Q8_0"]) == 0
    capsys.readouterr()
    err = _bad(tmp_path, capsys, [str(q8), "OUT", "Q4_0"])
    assert err == (f"{q8}: requantizing from type Q8_0 is disabled (output.weight); "
                   "allow it with allow_requantize (--allow-requantize)")
    out = tmp_path / "q4.gguf"
    assert main(["quantize", "--allow-requantize", str(q8), str(out), "Q4_0"]) == 0
    assert isinstance(read_gguf(out).tensors["blk.0.attn_q.weight"], QuantizedTensor)


def test_metadata_types_are_kept(tmp_path):
    from reference.gguf import GGUFValue, GGUFValueType

    hp = tiny_hparams("llama", n_vocab=32, n_layer=1, n_embd=256, n_head=4, n_head_kv=2,
                      n_ff=256)
    md = llama_metadata(hp) | {"x.small": GGUFValue(3, GGUFValueType.UINT8),
                               "general.file_type": GGUFValue(0, GGUFValueType.UINT32),
                               "split.count": GGUFValue(1, GGUFValueType.UINT16)}
    src, out = tmp_path / "m.gguf", tmp_path / "o.gguf"
    write_gguf(src, md, {k: v for k, v in random_weights(hp).items()})
    assert main(["quantize", str(src), str(out), "Q8_0"]) == 0
    f = read_gguf(out)
    assert f.value_types["x.small"] == GGUFValueType.UINT8
    assert "split.count" not in f.metadata
    assert list(f.metadata)[-2:] == ["general.quantization_version", "general.file_type"]
    assert (f.metadata["general.file_type"], f.value_types["general.file_type"]) == \
        (7, GGUFValueType.UINT32)
