"""``llamaref bench --profile MODE``: each mode's table on the tiny models, and its hooks.

Times are not asserted (they depend on the machine); what is asserted is the table's shape
(its header, a row per phase, function, wait, primitive or Context), that its numbers are
sane (counts are integers > 0, times > 0, shares add up to 100 %), that an added busy wait
shows in the time per token, and that every wrapped name is put back afterwards.
"""

from __future__ import annotations

import types
from collections import defaultdict

import mlx.core as mx
import pytest

import accelerated.context as accelerated_context
import reference.batch as batch_module
from accelerated.context import Context as AccContext
from llamaref.bench import ContextRunner, add_bench_command
from llamaref.bench.profile import (
    MODES,
    ProfileError,
    mlx_calls,
    timed_calls,
    token_entry,
    wrapped,
)
from llamaref.cli import main
from reference.context import Context as RefContext
from tests.support.tiny_models import random_weights, tiny_hparams


def _tables(out: str) -> list[list[list[str]]]:
    """Every Markdown table of ``out``: its lines (the rule line dropped) as lists of cells."""
    tables, rows = [], []
    for line in out.splitlines() + [""]:
        if line.startswith("|"):
            if not line.startswith("|---"):
                rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def _run(capsys, *argv: str) -> list[list[list[str]]]:
    assert main(["bench", *argv]) == 0
    return _tables(capsys.readouterr().out)


def _is_count(text: str) -> bool:
    return text.isdigit() and int(text) > 0


# ---- the flag --------------------------------------------------------------------------------


def _parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_bench_command(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_the_bare_flag_is_ops_and_every_mode_is_a_choice():
    assert _parse("--profile").profile == "ops"
    assert _parse("--profile", "-m", "tiny").profile == "ops"
    assert _parse().profile is None
    assert [_parse("--profile", mode).profile for mode in MODES] == list(MODES)
    assert list(MODES) == ["ops", "phases", "steps", "overlap", "nodes", "depth"]


# ---- the modes on the tiny models -------------------------------------------------------------


def test_ops_shares_add_up_to_a_hundred_percent(capsys):
    tables = _run(capsys, "-m", "tiny", "-p", "8", "-n", "3", "-r", "1", "--profile", "ops")
    profiles = [t for t in tables if t[0][0].endswith(": op")]
    assert [t[0] for t in profiles] == [["pp8: op", "calls", "ms", "share"],
                                        ["tg3: op", "calls", "ms", "share"]]
    for table in profiles:
        rows = table[1:]
        assert rows[-1][0] == "total" and rows[-1][3] == "100.0 %"
        shares = [float(row[3].rstrip(" %")) for row in rows[:-1]]
        assert sum(shares) == pytest.approx(100.0, abs=0.5)
        assert all(_is_count(row[1]) for row in rows[:-1] if not row[0].startswith("("))


def test_phases_split_a_token_of_ours_and_of_mlx_lm(capsys):
    n = 8
    ours, theirs = _run(capsys, "-m", "tiny", "--profile", "phases", "-n", str(n),
                        "--vs", "mlx-lm")
    assert ours[0] == ["accelerated: phase", "µs / token", "calls / token"]
    assert [row[0] for row in ours[1:]] == [
        "decode", "in decode: mx.array", "in decode: graph call", "in decode: mx.async_eval",
        "argmax, read back"]
    assert [row[0] for row in theirs[1:]] == ["model call", "async_eval", "argmax, read back"]
    for row in ours[1:] + theirs[1:]:
        assert float(row[1]) > 0 and float(row[2]).is_integer() and float(row[2]) >= 1
    decode, inside = float(ours[1][1]), sum(float(row[1]) for row in ours[2:5])
    assert inside < decode  # the three phases are inside the decode
    assert accelerated_context.mx is mx  # the module's view of mlx.core is put back


@pytest.mark.parametrize("model, backend", [("tiny", "accelerated"), ("tiny-mamba", "accelerated"),
                                            ("tiny", "reference")])
def test_steps_count_one_call_per_token(capsys, model, backend):
    n, runs = 6, 2
    assert main(["bench", "-m", model, "--backend", backend, "--profile", "steps",
                 "-n", str(n), "-r", str(runs)]) == 0
    out = capsys.readouterr().out
    (table,) = _tables(out)
    assert table[0] == [f"{backend}: function", "calls", "median µs"]
    rows = {row[0]: row for row in table[1:]}
    sampler = "sampler.sample_async" if backend == "accelerated" else "sampler.sample"
    for label in ("BatchAllocr", "memory.init_batch", "decode", "process_ubatch", "output_set",
                  sampler):
        assert int(rows[label][1]) == n, label  # n forwards, as the bench's tg counts them
    assert all(_is_count(row[1]) and float(row[2]) > 0 for row in table[1:])
    medians = [float(row[2]) for row in table[1:]]
    assert medians == sorted(medians, reverse=True)
    assert ("memory.backup" in rows) == (model == "tiny-mamba" and backend == "accelerated")
    per_run = out.split("ms / token of each run (the timers included):")[1].split()
    assert len(per_run) == runs and all(float(ms) > 0 for ms in per_run)
    assert batch_module.BatchAllocr.__init__.__qualname__ == "BatchAllocr.__init__"


def test_overlap_adds_the_wait_to_each_token(capsys):
    n, wait_us = 4, 2000
    (table,) = _run(capsys, "-m", "tiny", "--profile", "overlap", "-n", str(n), "-r", "1",
                    "-d", "8", "--spins", f"0,{wait_us}", "--vs", "mlx-lm")
    assert table[0] == ["added host work (µs) @ d8", "accelerated (ms / token)",
                        "mlx-lm (ms / token)"]
    assert [row[0] for row in table[1:]] == ["0", str(wait_us)]
    waited = table[2]
    # every token's host work starts with the wait: a token cannot take less
    assert all(float(ms) >= wait_us / 1e3 for ms in waited[1:])


@pytest.mark.parametrize("model", ["tiny", "tiny-mamba2"])
def test_nodes_count_the_primitives_of_a_token(capsys, model):
    (table,) = _run(capsys, "-m", model, "--profile", "nodes", "--matmul", "dense")
    assert table[0] == ["accelerated: primitive", "nodes"]
    rows, total = table[1:-1], table[-1]
    assert total[0] == "total" and int(total[1]) == sum(int(row[1]) for row in rows) > 0
    assert all(_is_count(row[1]) for row in rows)
    assert "Matmul" in {row[0] for row in rows}


def test_nodes_at_a_depth_are_titled_with_it(capsys):
    tables = _run(capsys, "-m", "tiny", "--profile", "nodes", "-d", "0,20")
    assert [t[0][0] for t in tables] == ["accelerated: primitive",
                                         "accelerated @ d20: primitive"]
    assert tables[0][-1] == tables[1][-1]  # a token's graph does not grow with the depth


def test_depth_probes_both_contexts_at_each_depth(capsys):
    (table,) = _run(capsys, "-m", "tiny", "--profile", "depth", "--backend",
                    "reference,accelerated", "-p", "0", "-n", "2", "-c", "256", "-d", "0,64",
                    "-r", "1")
    assert table[0] == ["Context", "n_ctx", "ms", "d0", "d64", "d_last/d0",
                        "failed decode (ms)"]
    assert [row[:3] for row in table[1:]] == [
        [b, "256", what] for b in ("reference", "accelerated")
        for what in ("per token", "bookkeeping")]
    for row in table[1:]:
        assert all(float(ms) > 0 for ms in row[3:6])
        assert (float(row[6]) > 0) if row[2] == "per token" else row[6] == ""


# ---- what each mode refuses -------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--profile", "phases", "--backend", "reference"],
     "--profile profiles the accelerated backend (phases)"),
    (["--profile", "nodes", "--backend", "reference"],
     "--profile profiles the accelerated backend (nodes)"),
    (["--profile", "steps", "--vs", "mlx-lm"], "--profile steps measures ours only"),
    (["--profile", "overlap", "--vs", "llama.cpp"], "compares with mlx-lm only"),
    (["--profile", "steps", "-o", "json"], "--profile steps runs instead of the tests"),
    (["--profile", "depth", "--failed-decode"], "--profile depth runs instead of the tests"),
    (["--profile", "steps", "-p", "4", "-n", "0"], "--profile steps times -n generated tokens"),
    (["--profile", "overlap", "--spins", "0,-5"], "--spins 0,-5: waits must be >= 0 µs"),
    (["--profile", "overlap", "--spins", "0,x"], "--spins '0,x'"),
    (["-m", "tiny-mamba", "--profile", "depth", "-n", "2"], "has no KV cells to fill"),
    (["--profile", "ops", "--backend", "reference"],
     "--profile profiles the accelerated backend"),
])
def test_bad_arguments_are_one_line_and_exit_1(capsys, argv, message):
    if "llama.cpp" in argv:
        pytest.importorskip("llama_cpp")
    argv = argv if "-m" in argv else ["-m", "tiny", *argv]
    assert main(["bench", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# ---- the hooks ---------------------------------------------------------------------------------


class _Owner:
    @staticmethod
    def twice(x):
        return 2 * x

    def add(self, x):
        return x + 1


def test_wrapped_puts_everything_back_even_after_an_error():
    obj = _Owner()
    originals = dict(vars(_Owner))
    times = defaultdict(list)
    with pytest.raises(RuntimeError, match="inside"):
        with timed_calls([(_Owner, "twice", "twice"), (obj, "add", "add"),
                          (_Owner, "__init__", "init")], times):
            assert _Owner.twice(2) == 4 and obj.add(1) == 2 and _Owner().add(1) == 2
            raise RuntimeError("inside")
    assert dict(vars(_Owner)) == originals  # the staticmethod is one again, no __init__ left
    assert vars(obj) == {}  # the instance's wrapper is gone, not replaced by the bound method
    assert {k: len(v) for k, v in times.items()} == {"twice": 1, "add": 1, "init": 1}


def test_wrapped_refuses_private_or_missing_names_before_replacing_anything():
    m = types.SimpleNamespace(f=abs)
    for name in ("_private", "missing"):
        with pytest.raises(ProfileError, match=name):
            with wrapped([(m, "f", "f"), (m, name, name)], lambda label, f: None):
                pass
        assert m.f is abs


def test_mlx_calls_see_only_the_contexts_ubatches():
    hp = tiny_hparams(n_layer=1)
    runner = ContextRunner(AccContext, hp, random_weights(hp), n_ctx=32, n_batch=8)
    seen = []

    def noted(label, f):
        return lambda *args, **kwargs: seen.append(label) or f(*args, **kwargs)

    real_mx = accelerated_context.mx
    with mlx_calls(runner.ctx, ("async_eval",), noted):
        assert accelerated_context.mx is real_mx  # outside process_ubatch
        runner.tg(1, 3)
    assert seen == ["mx.async_eval"] * 3
    assert accelerated_context.mx is real_mx and "process_ubatch" not in vars(runner.ctx)


def test_a_token_starts_at_the_contexts_decode_or_the_models_call():
    hp = tiny_hparams(n_layer=1)
    runner = ContextRunner(RefContext, hp, random_weights(hp), n_ctx=32, n_batch=8)
    assert token_entry(runner) == (runner.ctx, "decode")
    model = types.SimpleNamespace(model=_Owner())
    assert token_entry(model) == (_Owner, "__call__")
    with pytest.raises(ProfileError, match="no Context and no mlx-lm model"):
        token_entry(object())
