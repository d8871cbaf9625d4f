"""``llamaref perplexity`` (``llamaref.perplexity``): the base file by path (written whole or
not at all, read with every check), llama-perplexity's console lines, and the command with
its bad inputs (one line, exit code 1, nothing written). The numbers and the bytes:
``tests/tools/test_perplexity.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from llamaref.perplexity import (
    KLD_TABLE_HEADER,
    final_line,
    read_logits_file,
    run_kl_divergence,
    run_perplexity,
)
from reference.testing import random_weights, tiny_hparams
from reference.tools.perplexity import LogitsFileError, PerplexityError, PerplexitySums
from tests.tools.test_perplexity import (  # noqa: F401 (model, text: fixtures)
    BOS,
    DAMAGES,
    N_VOCAB,
    Failing,
    assert_base_file_layout,
    make_ctx,
    model,
    text,
)


@pytest.fixture(scope="module")
def base_file(model, text, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("kld") / "base.bin"
    run_perplexity(make_ctx(model, 16, 32), text, 16, 32, bos=BOS, base_path=path)
    return path


# ---- the console lines ---------------------------------------------------------------------

def test_the_running_estimates_and_the_final_line_are_printed(model, text):  # noqa: F811
    out, info = [], []
    res = run_perplexity(make_ctx(model, 16, 32), text, 16, 32, 3, bos=BOS, out=out.append,
                         info=info.append)
    assert "".join(out) == "".join(f"[{i + 1}]{p:.4f}," for i, p in
                                   enumerate(res.estimates)) + "\n"
    assert info[-1] == f"Final estimate: PPL = {res.ppl:.4f} +/- {res.uncertainty:.5f}"
    assert "n_ctx=16, batch_size=32, n_seq=2" in info[0]
    assert info[1].startswith("perplexity: ") and " seconds per pass - ETA " in info[1]


def test_the_final_line_complains_of_a_negative_variance():
    sums = PerplexitySums()
    sums.add(np.array([2.0, 2.0]))
    assert final_line(sums) == "Unexpected negative standard deviation of log(prob)"


def test_the_kld_table_and_report_are_printed(model, base_file):  # noqa: F811
    out, info = [], []
    stats = run_kl_divergence(make_ctx(model, 16, 32), base_file, 32, BOS, out=out.append,
                              info=info.append)
    printed = "".join(out)
    table = printed.split("\n\n")[0].strip("\n").splitlines()
    assert table[0] == KLD_TABLE_HEADER
    assert [row.split()[0] for row in table[1:]] == [str(i + 1) for i in range(len(table) - 1)]
    assert len(table) - 1 == stats.count // 7
    for section in ("Perplexity statistics", "KL divergence statistics",
                    "Token probability statistics"):
        assert f"====== {section} ======" in printed
    assert "Same top p: 100.000 ± 0.000 %" in printed
    assert info[0].startswith("kl_divergence: computing over 18 chunks, n_ctx=16")


def test_the_report_waits_for_100_tokens(model, text, tmp_path):  # noqa: F811
    path = tmp_path / "small.bin"
    run_perplexity(make_ctx(model, 16, 32), text, 16, 32, 4, bos=BOS, base_path=path)
    out = []
    stats = run_kl_divergence(make_ctx(model, 16, 32), path, 32, BOS, out=out.append)
    assert stats.count == 28
    assert "KL Divergence" in "".join(out) and "======" not in "".join(out)


# ---- the base file by path -----------------------------------------------------------------

def test_base_file_layout(text, base_file):  # noqa: F811
    assert_base_file_layout(base_file.read_bytes(), text)
    assert not list(base_file.parent.glob(".*.tmp"))  # renamed, nothing left behind


def test_a_short_text_is_refused_and_nothing_is_written(model, text, tmp_path):  # noqa: F811
    path = tmp_path / "base.bin"
    with pytest.raises(PerplexityError, match="needs at least 64"):
        run_perplexity(make_ctx(model, 32, 32), text[:63], 32, 32, base_path=path)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_decode_leaves_no_file(model, text, tmp_path):  # noqa: F811
    Failing.calls = 0
    path = tmp_path / "base.bin"
    with pytest.raises(PerplexityError, match="failed to decode"):
        run_perplexity(make_ctx(model, 16, 16, cls=Failing), text, 16, 16, base_path=path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage, message", DAMAGES)
def test_a_damaged_base_file_is_refused(model, base_file, tmp_path, damage, message):  # noqa: F811
    bad = tmp_path / "bad.bin"
    bad.write_bytes(damage(base_file.read_bytes()))
    with pytest.raises(LogitsFileError, match=message):
        read_logits_file(bad, N_VOCAB)
    out = []
    with pytest.raises(LogitsFileError, match=message):
        run_kl_divergence(make_ctx(model, 16, 32), bad, 32, BOS, out=out.append)
    assert out == []  # refused before anything runs


def test_the_messages_name_the_file(base_file):
    with pytest.raises(LogitsFileError, match=f"^{base_file} holds log-probabilities over"):
        read_logits_file(base_file, 32)


def test_a_file_that_cannot_be_read_is_a_typed_error(model, tmp_path):  # noqa: F811
    with pytest.raises(LogitsFileError, match="cannot read the base logits file"):
        read_logits_file(tmp_path, N_VOCAB)  # a directory
    with pytest.raises(LogitsFileError, match="No such file or directory"):
        run_kl_divergence(make_ctx(model, 16, 32), tmp_path / "missing.bin")


# ---- the command ---------------------------------------------------------------------------

CLI_VOCAB = 300  # every byte token: any text tokenizes


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from reference.testing import write_tiny_gguf

    hp = tiny_hparams(n_vocab=CLI_VOCAB, n_embd=16, n_ctx_train=256)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hp,
                           random_weights(hp, seed=6))


def run_cli(args, capsys):
    from llamaref.cli import main

    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_perplexity_and_kl_divergence(tiny_gguf, tmp_path, capsys):
    text = tmp_path / "text.txt"  # noqa: F811 (a file, not the fixture)
    text.write_text("".join(chr(c) for c in np.random.default_rng(2).integers(97, 123, 300)))
    base = tmp_path / "base.bin"
    common = ["-m", str(tiny_gguf), "--backend", "reference"]
    rc, out, err = run_cli(["perplexity", *common, "-f", str(text), "-c", "16", "-b", "64",
                            "--kl-divergence-base", str(base)], capsys)
    assert rc == 0, err
    assert out.startswith("[1]") and out.endswith(",\n")
    assert "Final estimate: PPL = " in err
    assert read_logits_file(base, CLI_VOCAB).n_ctx == 16
    rc, out, err = run_cli(["perplexity", *common, "--kl-divergence-base", str(base),
                            "--kl-divergence"], capsys)
    assert rc == 0, err
    assert "KL Divergence" in out and "Mean    KLD:" in out and "Same top p: 100.000" in out


@pytest.mark.parametrize("args, message", [
    (["-c", "16", "--kl-divergence-base", "{base}"], "no text: give it with -f FILE"),
    (["-f", "{text}", "-c", "0", "--kl-divergence-base", "{base}"], "requires a context > 0"),
    (["-f", "{text}", "-c", "128", "--kl-divergence-base", "{base}"], "needs at least 256"),
    (["--kl-divergence"], "--kl-divergence needs the base file"),
    (["--kl-divergence", "--kl-divergence-base", "{text}"], "no _logits_ header"),
    (["-f", "{text}", "--ppl-stride", "4", "--kl-divergence-base", "{base}"], "drop --ppl-stride"),
    (["-f", "{text}", "-c", "16", "--ppl-stride", "16"], "--ppl-stride = 16 must be in"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tiny_gguf, tmp_path, capsys, args,
                                                      message):
    text = tmp_path / "text.txt"  # noqa: F811 (a file, not the fixture)
    text.write_text("abcdefghij" * 20)  # 201 tokens with BOS
    base = tmp_path / "base.bin"
    args = [a.format(text=text, base=base) for a in args]
    rc, out, err = run_cli(["perplexity", "-m", str(tiny_gguf), "--backend", "reference",
                            *args], capsys)
    assert rc == 1
    assert err.count("\n") == 1 and message in err, err
    assert sorted(os.listdir(tmp_path)) == ["text.txt"]


def test_cli_refuses_a_context_below_the_files(tiny_gguf, tmp_path, capsys):
    text = tmp_path / "text.txt"  # noqa: F811 (a file, not the fixture)
    text.write_text("abcdefghij" * 20)
    base = tmp_path / "base.bin"
    common = ["-m", str(tiny_gguf), "--backend", "reference"]
    assert run_cli(["perplexity", *common, "-f", str(text), "-c", "16",
                    "--kl-divergence-base", str(base)], capsys)[0] == 0
    rc, _, err = run_cli(["perplexity", *common, "-c", "8", "--kl-divergence-base", str(base),
                          "--kl-divergence"], capsys)
    assert rc == 1
    assert err == (f"llamaref: error: {base} was computed with n_ctx = 16, the context is 8: "
                   "increase it with -c\n")
