"""``llamaref batched``, ``llamaref parallel`` and ``llamaref batched-bench`` end to end on a
tiny GGUF (dummy byte vocabulary), and their errors as one line with exit code 1."""

from __future__ import annotations

import json

import pytest

from llamaref.cli import main
from reference.testing import random_weights, tiny_hparams, write_tiny_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """256 byte tokens, so that any text tokenizes; n_ctx_train 4096."""
    hp = tiny_hparams(n_vocab=300, n_ctx_train=4096, n_layer=1)
    return str(write_tiny_gguf(tmp_path_factory.mktemp("par") / "t.gguf", hp,
                               random_weights(hp, seed=1)))


@pytest.mark.parametrize("backend", ["reference", "accelerated"])
@pytest.mark.parametrize("kvu", [["-kvu"], []], ids=["unified", "per-seq"])
def test_batched_streams_are_greedy_generate(gguf, capsys, backend, kvu):
    """-np 3 greedy streams of "Hello my name is" (26 byte tokens with BOS), -n 40 in all:
    each is the 14 tokens ``llamaref generate -n 14 --temp 0`` writes."""
    assert main(["generate", "Hello my name is", "-m", gguf, "-n", "14", "--temp", "0",
                 "--backend", backend]) == 0
    want = capsys.readouterr().out.rstrip("\n")
    assert main(["batched", "-m", gguf, "-np", "3", "-n", "40", "--temp", "0",
                 "--backend", backend, *kvu]) == 0
    out, err = capsys.readouterr()
    for i in range(3):
        assert f"sequence {i}:\n\n{want}\n\n" in out
    assert "main: decoded 42 tokens in" in err
    assert "llama_perf_context_print: prompt eval time" in err


def test_parallel_serves_every_request(gguf, capsys, tmp_path):
    questions = tmp_path / "q.txt"
    questions.write_text("Why?\nHow?\n")
    assert main(["parallel", "-m", gguf, "-np", "2", "-ns", "3", "-n", "4", "-pps",
                 "-c", "8192", "-f", str(questions), "--temp", "0",
                 "--backend", "reference"]) == 0
    err = capsys.readouterr().err
    assert "  1 prompt: Why?" in err and "  2 prompt: How?" in err
    assert err.count("started decoding ...") == 3
    assert "Total gen tokens:        12," in err  # 3 requests, 4 decoded tokens each
    assert "Cache misses:             0" in err
    assert f"External prompt file: {questions}" in err


@pytest.mark.parametrize("fmt", ["md", "jsonl"])
def test_batched_bench_prints_the_table(gguf, capsys, fmt):
    assert main(["batched-bench", "-m", gguf, "-c", "512", "-npp", "8", "-ntg", "4",
                 "-npl", "1,2", "-npl", "64", "-kvu", "--output-format", fmt,
                 "--backend", "reference"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(("|", "{"))]
    if fmt == "md":
        assert lines[0].startswith("|    PP |     TG |    B |   N_KV |")
        rows = [x.split("|")[1:5] for x in lines[2:]]
        assert [[int(v) for v in r] for r in rows] == [[8, 4, 1, 12], [8, 4, 2, 24]]
    else:  # B = 64 needs 768 cells of the one 512-cell stream: skipped
        assert [(r["pl"], r["n_kv"]) for r in map(json.loads, lines)] == [(1, 12), (2, 24)]


@pytest.mark.oracle
def test_batched_bench_vs_llamacpp_runs_the_same_rows_on_llamacpp(gguf, capsys):
    """``--vs llama.cpp``: the same rows by the same code on llama.cpp's own context (its N_KV
    column equal to ours: the same tokens, positions and sequences), then the S_TG ratios."""
    pytest.importorskip("llama_cpp")
    assert main(["batched-bench", "-m", gguf, "-c", "512", "-npp", "8", "-ntg", "4",
                 "-npl", "1,2", "--backend", "reference", "--vs", "llama.cpp",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    ours, theirs = out.split("## llama.cpp (1 threads")
    n_kv = [[line.split("|")[1:5] for line in part.splitlines() if line.startswith("|  ")]
            for part in (ours, theirs.split("| PP | TG | B |")[0])]
    assert n_kv[0] == n_kv[1] and len(n_kv[0]) == 3  # the header, B = 1, B = 2
    ratios = [line.split("|") for line in out.splitlines() if line.startswith("| 8 | 4 |")]
    assert [int(r[3]) for r in ratios] == [1, 2]
    assert all(float(r[6]) > 0 for r in ratios)


@pytest.mark.oracle
def test_parallel_vs_llamacpp_serves_the_same_requests_on_llamacpp(gguf, capsys):
    """``--vs llama.cpp``: the same requests, the same schedule (chunks, halving, finishes)
    over llama.cpp's own context; greedy, so its totals count the same tokens as ours."""
    pytest.importorskip("llama_cpp")
    assert main(["parallel", "-m", gguf, "-np", "2", "-ns", "3", "-n", "4", "-pps",
                 "-c", "8192", "--temp", "0", "--backend", "reference", "--vs", "llama.cpp",
                 "--threads", "1"]) == 0
    err = capsys.readouterr().err
    ours, theirs = err.split("the same schedule on llama.cpp (1 threads")
    for key in ("Total prompt tokens:", "Total gen tokens:", "Cache misses:"):
        line = [x for x in ours.splitlines() if x.startswith(key)][0]
        assert line.split(",")[0] in theirs, (key, line)
    assert float(err.rsplit("Total speed ours / llama.cpp: ", 1)[1].split()[0]) > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["batched-bench", "-npp", "8", "-ntg", "4", "-npl", "1", "--threads", "2"],
     "--threads sets llama.cpp's threads"),
    (["parallel", "--threads", "2"], "--threads sets llama.cpp's threads"),
    (["batched", "-np", "300"], "-np 300: a context holds 1 to 256 sequences"),
    (["batched", "-n", "5"], "the prompt has 26 tokens and -n 5 is the total length"),
    (["parallel", "-np", "256"], "need -np + 1 sequences, at most 256"),
    (["parallel", "-np", "2", "-c", "1024"], "increase -c or reduce -n"),
    (["parallel", "-f", "/nonexistent.txt"], "-f /nonexistent.txt: no such file"),
    (["batched-bench", "-npl", "1,0", "-npp", "8", "-ntg", "4"], "every value must be >= 1"),
    (["batched-bench", "-npl", "4", "-npp", "512", "-ntg", "4", "-c", "256", "-kvu"],
     "no row fits: the smallest needs 2064 cells"),
    (["batched-bench", "-npp", "1,x"], "is not a comma-separated list of integers"),
])
def test_errors_are_one_line(gguf, capsys, argv, message):
    assert main([*argv, "-m", gguf, "--backend", "reference"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("llamaref: error:") and message in err[-1], err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("command", ["batched", "parallel", "batched-bench"])
def test_help_has_an_example(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: llamaref {command}" in out and f"llamaref {command} -" in out
