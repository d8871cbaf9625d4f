"""``llamaref bench``: the rows' statistics, the output formats, the plot, the parallel test,
the profile, the errors, and that ``--vs mlx-lm`` runs *the same model* as ours.

Speed itself is not asserted (it depends on the machine); what is asserted is what a row
means: the median and the spread of the runs, the ratio to the peer, the number of tokens a
test decodes, and, on SmolLM2, that mlx-lm built from our weights gives our logits.
"""

from __future__ import annotations

import csv
import io
import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llamaref.bench import (
    BenchRow,
    ContextRunner,
    MLXLMRunner,
    PeerError,
    format_rows,
    mlx_lm_model,
    profile_ops,
    random_tokens,
)
from llamaref.cli import main
from reference.batch import Batch
from tests.support.tiny_models import nmse, random_weights, tiny_hparams, write_tiny_gguf

seconds = st.lists(st.floats(1e-4, 1e3), min_size=1, max_size=9).map(tuple)


@pytest.fixture
def tiny_gguf(tmp_path):
    hp = tiny_hparams(n_layer=1)
    return write_tiny_gguf(tmp_path / "m.gguf", hp, random_weights(hp))


# ---- rows -----------------------------------------------------------------------------------


@given(seconds, st.integers(1, 4096))
def test_median_lies_in_the_spread(runs, n_tokens):
    row = BenchRow("m", "accelerated", "Q4_1", "tg1", runs, n_tokens)
    slowest, fastest = row.spread
    assert slowest <= row.tokens_per_second * (1 + 1e-12)
    assert row.tokens_per_second <= fastest * (1 + 1e-12)
    assert fastest == pytest.approx(n_tokens / min(runs))


@given(seconds, st.floats(1e-3, 1e6))
def test_ratio_is_ours_over_the_peer(runs, baseline):
    row = BenchRow("m", "accelerated", "Q4_1", "pp8", runs, 8, baseline=baseline)
    assert row.ratio == pytest.approx(row.tokens_per_second / baseline)
    assert BenchRow("m", "mlx-lm", "Q4_1", "pp8", runs, 8).ratio is None


def test_median_of_an_even_count_is_the_mean_of_the_middle_times():
    row = BenchRow("m", "reference", "f32", "pp8", (1.0, 4.0, 2.0, 3.0), 10)
    assert row.tokens_per_second == 10 / 2.5


def test_json_and_csv_carry_the_same_rows():
    rows = [BenchRow("m", "accelerated", "Q4_1", "pp8", (0.5, 0.25), 8, 100, 7, 16.0),
            BenchRow("m", "mlx-lm", "Q4_1", "pp8", (0.5,), 8, 100, 7)]
    data = json.loads(format_rows(rows, "json"))
    table = list(csv.DictReader(io.StringIO(format_rows(rows, "csv"))))
    assert [d["backend"] for d in data] == [r["backend"] for r in table] == ["accelerated",
                                                                             "mlx-lm"]
    assert data[0]["seconds"] == [0.5, 0.25]
    assert data[0]["tokens_per_second"] == pytest.approx(8 / 0.375)
    assert data[0]["ratio"] == pytest.approx(8 / 0.375 / 16.0)
    assert float(table[0]["tps_max"]) == pytest.approx(32.0)
    assert data[1]["ratio"] is None and table[1]["ratio"] == ""


# ---- the command on a tiny model ------------------------------------------------------------


def _json_rows(capsys):
    return json.loads(capsys.readouterr().out)


def test_both_backends_and_the_peer_give_a_row_per_test(tiny_gguf, capsys):
    argv = ["bench", "-m", str(tiny_gguf), "-p", "8", "-n", "4", "-r", "2",
            "--backend", "reference,accelerated", "--vs", "mlx-lm", "-o", "json"]
    assert main(argv) == 0
    rows = _json_rows(capsys)
    assert [(r["backend"], r["test"]) for r in rows] == [
        (b, t) for t in ("pp8", "tg4") for b in ("reference", "accelerated", "mlx-lm")]
    assert all(len(r["seconds"]) == 2 and r["tokens_per_second"] > 0 for r in rows)
    for test in ("pp8", "tg4"):
        peer = next(r for r in rows if r["test"] == test and r["backend"] == "mlx-lm")
        for r in rows:
            if r["test"] == test and r["backend"] != "mlx-lm":
                assert r["ratio"] == pytest.approx(r["tokens_per_second"]
                                                   / peer["tokens_per_second"])
    assert {r["dtype"] for r in rows if r["backend"] != "reference"} == {"F32"}


def test_parallel_rows_count_every_sequences_tokens(tiny_gguf, capsys):
    argv = ["bench", "-m", str(tiny_gguf), "-p", "0", "-n", "0", "-r", "1", "--vs", "mlx-lm",
            "--parallel", "1,2,4", "--pl-prompt", "3", "--pl-gen", "5", "-o", "json"]
    assert main(argv) == 0
    rows = _json_rows(capsys)
    assert [(r["test"], r["backend"], r["n_tokens"]) for r in rows] == [
        (f"pl{n}", b, 5 * n) for n in (1, 2, 4) for b in ("accelerated", "mlx-lm")]


def test_plot_writes_a_png_and_the_markdown_table(tiny_gguf, tmp_path, capsys):
    png = tmp_path / "bench.png"
    argv = ["bench", "-m", str(tiny_gguf), "-p", "8", "-n", "4", "-r", "1", "--vs", "mlx-lm",
            "--parallel", "1,2", "--pl-gen", "2", "--plot", str(png)]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = png.with_suffix(".md").read_text().splitlines()
    assert table[0].startswith("| model | backend | dtype | test |")
    assert [line.split("|")[4].strip() for line in table[2:]] == [
        "pp8", "pp8", "tg4", "tg4", "pl1", "pl1", "pl2", "pl2"]
    assert capsys.readouterr().out.splitlines()[2:] == table[2:]


def test_profile_times_the_ops_and_puts_them_back(tiny_gguf, capsys):
    import accelerated.models.llama as acc_llama
    import accelerated.ops as ops

    assert main(["bench", "-m", str(tiny_gguf), "-p", "8", "-n", "3", "-r", "1",
                 "--profile"]) == 0
    out = capsys.readouterr().out
    assert "| pp8: op | calls | ms | share |" in out and "| tg3: op |" in out
    matmul = next(line for line in out.splitlines() if line.startswith("| linear (matmul) |"))
    assert int(matmul.split("|")[2]) == 7 + 1  # pp8, one layer: q k v o gate up down, lm_head
    assert acc_llama.mul_mat is ops.mul_mat  # restored
    assert acc_llama.linear.__module__ == "accelerated.models.llama"


def test_profile_counts_an_op_called_inside_another_once():
    import accelerated.ops as ops
    import accelerated.ops.attention as attention

    stats = {}
    q = mx.ones((2, 3, 4))  # (n_tokens, n_head, d)
    kv = mx.ones((5, 3, 4))  # (n_kv, n_head_kv, d)
    with profile_ops(stats):
        attention.build_attn_mha(q, kv, kv, mx.zeros((2, 5)), 0.5)
    assert stats["build_attn_mha"][0] == 1
    assert "soft_max_ext" not in stats
    assert attention.build_attn_mha is ops.build_attn_mha


@pytest.mark.parametrize("argv, message", [
    (["--backend", "cuda"], "unknown backend cuda"),
    (["--vs", "vllm"], "--vs vllm: the peers are mlx-lm, llama.cpp"),
    (["-d", "0,x"], "-d '0,x': give depths like"),
    (["-d", "-5"], "depths must be distinct and >= 0"),
    (["-d", "4,4"], "depths must be distinct and >= 0"),
    (["-d", "200", "-c", "100"], "-c 100 holds no depth of 200 tokens"),
    (["--threads", "2"], "--threads sets llama.cpp's threads"),
    (["--parallel", "1,x"], "--parallel '1,x'"),
    (["--parallel", "0"], "--parallel counts"),
    (["-p", "0", "-n", "0"], "nothing to run"),
    (["--backend", "reference", "--profile"], "--profile profiles the accelerated backend"),
])
def test_bad_arguments_are_one_line_and_exit_1(tiny_gguf, capsys, argv, message):
    assert main(["bench", "-m", str(tiny_gguf), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_model_the_peer_cannot_run_is_refused(tmp_path, capsys):
    hp = tiny_hparams("qwen2", n_layer=1)
    path = write_tiny_gguf(tmp_path / "q.gguf", hp, random_weights(hp))
    assert main(["bench", "-m", str(path), "-p", "8", "-n", "2", "--vs", "mlx-lm"]) == 1
    assert "runs arch llama, mamba or mamba2" in capsys.readouterr().err
    hp = tiny_hparams(n_layer=1, n_swa=4)
    with pytest.raises(PeerError, match="sliding window"):
        mlx_lm_model(hp, random_weights(hp))


# ---- depth, the tiny models, the failed decode, llama.cpp -----------------------------------


def test_depth_rows_continue_after_the_depth_and_make_a_depth_table(tiny_gguf, capsys):
    argv = ["bench", "-m", str(tiny_gguf), "-p", "4", "-n", "3", "-d", "0,20", "-r", "1",
            "--backend", "reference,accelerated", "--vs", "mlx-lm", "--failed-decode"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    tests = [line.split("|")[4].strip() for line in out.splitlines()
             if line.startswith("| m.gguf |")]
    assert tests == [t for t in ("pp4", "tg3", "pp4 @ d20", "tg3 @ d20") for _ in range(3)]
    table = out[out.index("| ms / token |"):].splitlines()
    assert table[0] == "| ms / token | d0 | d20 | d20 / d0 | failed decode (ms) |"
    assert [line.split("|")[1].strip() for line in table[2:5]] == [
        "reference", "accelerated", "mlx-lm"]
    assert "×)" in table[3] and "×)" not in table[4]  # ours against the peer, in time


def test_a_runner_puts_the_cache_back_to_its_depth_before_each_run():
    from accelerated.context import Context as AccContext

    hp = tiny_hparams(n_layer=1)
    runner = ContextRunner(AccContext, hp, random_weights(hp), n_ctx=64, n_batch=8)
    runner.set_depth(random_tokens(20, hp.n_vocab))
    for _ in range(2):
        runner.tg(1, 5)  # the first decoded at 20, then 4 more: 5 forwards
        assert runner.ctx.memory.seq_pos_max(0) == 24 and len(runner.last_tokens) == 5
    runner.pp(random_tokens(6, hp.n_vocab))
    assert runner.ctx.memory.seq_pos_max(0) == 25
    assert runner.failed_decode() > 0  # fills the cache, fails, comes back to the depth
    assert runner.ctx.memory.seq_pos_max(0) == 19


@pytest.mark.parametrize("model", ["tiny", "tiny-mamba", "tiny-mamba2"])
def test_the_tiny_models_against_mlx_lm(model, capsys):
    argv = ["bench", "-m", model, "-p", "4", "-n", "3", "-d", "0,8", "-r", "1", "--vs",
            "mlx-lm", "-o", "json"]
    assert main(argv) == 0
    rows = _json_rows(capsys)
    assert [(r["backend"], r["test"]) for r in rows] == [
        (b, t) for t in ("pp4", "tg3", "pp4 @ d8", "tg3 @ d8") for b in ("accelerated", "mlx-lm")]
    assert all(r["model"] == model and r["dtype"] == "F32" for r in rows)


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_the_peer_on_a_tiny_mamba_is_our_model(arch):
    """mlx-lm's Mamba / Mamba-2 on our weights gives our logits (A_log = log(-A) rounds once)."""
    from accelerated.context import Context
    from llamaref.bench.tiny import tiny_model

    hp, w = tiny_model(f"tiny-{arch}" if arch == "mamba2" else "tiny-mamba")
    tokens = [1, 5, 7, 2, 30, 11, 200, 3]
    ctx = Context(hp, w, n_ctx=16)
    assert ctx.decode(Batch(token=tokens, logits=[True] * len(tokens))) == 0
    ours = ctx.get_logits()
    theirs = _mlx_lm_logits(mlx_lm_model(hp, w), tokens)
    assert nmse(ours, theirs) < 1e-8
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.oracle
def test_llama_cpp_as_a_peer(tiny_gguf, capsys):
    pytest.importorskip("llama_cpp")
    argv = ["bench", "-m", str(tiny_gguf), "-p", "8", "-n", "3", "-d", "0,16", "-r", "1",
            "--backend", "reference", "--vs", "llama.cpp", "--threads", "1", "--parallel", "2",
            "--pl-prompt", "2", "--pl-gen", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| m.gguf |")]
    assert [(r[2].strip(), r[4].strip()) for r in rows] == [
        (b, t) for t in ("pp8", "tg3", "pp8 @ d16", "tg3 @ d16", "pl2")
        for b in ("reference", "llama.cpp")]
    assert "llama.cpp: n_threads 1, n_ctx 24" in out


# ---- the peer runs the same model -----------------------------------------------------------


def _mlx_lm_logits(model, tokens) -> np.ndarray:
    return np.array(model(mx.array([tokens]))[0])  # (n_tokens, n_vocab)


@pytest.mark.parametrize("tied", [True, False])
def test_the_peer_on_a_tiny_model_is_our_model(tied):
    from accelerated.context import Context

    hp = tiny_hparams(n_layer=2, tied=tied)
    w = random_weights(hp, seed=3)
    tokens = [1, 5, 7, 2, 30, 11]
    ctx = Context(hp, w, n_ctx=16)
    assert ctx.decode(Batch(token=tokens, logits=[True] * 6)) == 0
    assert nmse(ctx.get_logits(), _mlx_lm_logits(mlx_lm_model(hp, w), tokens)) < 1e-10


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's weights, and the reference's logits of a short prompt (dequantized once)."""
    from llamaref.bench import dense_weights
    from reference.context import Context as RefContext
    from reference.model_loader import load_model
    from tests.oracle.test_smollm2 import smollm2_path

    hp, w = load_model(smollm2_path())
    ref = RefContext(hp, dense_weights(w), n_ctx=16)
    assert ref.decode(Batch(token=SMOL_PROMPT, logits=[True] * len(SMOL_PROMPT))) == 0
    return hp, w, ref.get_logits().copy()


SMOL_PROMPT = [1, 504, 3458, 314, 4264, 30]


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("matmul", ["quantized", "dense"])
def test_the_peer_on_smollm2_is_our_model_same_weights_same_precision(smollm2, matmul):
    """mlx-lm built from SmolLM2's weights (the Q4_1/Q8_0 groups as they are, or exactly
    dequantized) gives the logits of our accelerated forward holding them the same way, and
    of the reference (float32 on the dequantized weights): NMSE far below the 5e-4 of an
    attention op, same argmax; and both runners' ``tg`` generate the same greedy tokens."""
    from accelerated.context import Context as AccContext
    from llamaref.bench import twin_kwargs

    hp, w, ref_logits = smollm2
    model = mlx_lm_model(hp, w, matmul)
    theirs = _mlx_lm_logits(model, SMOL_PROMPT)  # (6, n_vocab)
    acc = AccContext(hp, w, n_ctx=16, **twin_kwargs(matmul))
    assert acc.decode(Batch(token=SMOL_PROMPT, logits=[True] * len(SMOL_PROMPT))) == 0
    assert nmse(acc.get_logits(), theirs) < 1e-10
    assert nmse(ref_logits, theirs) < 1e-10
    assert (theirs.argmax(-1) == acc.get_logits().argmax(-1)).all()
    assert (theirs.argmax(-1) == ref_logits.argmax(-1)).all()
    if matmul == "dense":
        return  # the greedy tokens once are enough (the dense forms are slow on a CPU BLAS)
    ours = ContextRunner(AccContext, hp, w, n_ctx=8, n_batch=8, **twin_kwargs(matmul))
    peer = MLXLMRunner(model)
    first = int(random_tokens(1, hp.n_vocab)[0])
    ours.tg(first, 4)
    peer.tg(first, 4)
    assert ours.last_tokens[:3] == peer.last_tokens  # the peer yields n - 1, runs n forwards
