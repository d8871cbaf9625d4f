"""Prompt-lookup decoding (``reference.tools.lookup``) and the three commands' CLI.

- the n-gram cache: counts, the lax / strict / static thresholds, the file format;
- lookup gives plain greedy generation token for token on every flavour, drafts on a
  repetitive prompt, and rolls back a recurrent memory from a saved state;
- ``llamaref speculative``, ``speculative-simple``, ``lookup``: help, a run, one-line errors.
"""

from __future__ import annotations

import struct

import pytest

from llamaref.cli import main
from reference.testing import random_weights, tiny_hparams, write_tiny_gguf
from reference.tools.lookup import (
    Lookup,
    NgramCacheError,
    ngram,
    ngram_cache_draft,
    ngram_cache_load,
    ngram_cache_merge,
    ngram_cache_save,
    ngram_cache_update,
    try_draft,
    try_draft_static,
)
from tests.support.helpers import FLAVOURS, MLX, REF_F32, mamba_model
from tests.tools.test_speculative import GREEDY, plain_greedy, target

REPEAT = [1, 5, 9, 3, 7, 2, 1, 5, 9, 3, 7, 2, 1, 5]
LAX = ((2, 2, 1, 1), (66, 50, 50, 50))
STRICT = ((4, 3, 2, 2), (75, 66, 66, 66))


# ---- the n-gram cache --------------------------------------------------------------------------


def test_update_counts_every_size_and_only_the_new_tokens():
    cache = {}
    ngram_cache_update(cache, 1, 4, [1, 2, 3], nnew=3)
    assert cache == {ngram([1]): {2: 1}, ngram([2]): {3: 1}, ngram([1, 2]): {3: 1}}
    ngram_cache_update(cache, 1, 4, [1, 2, 3, 1, 2], nnew=2)  # the last 2 tokens only
    assert cache[ngram([1])] == {2: 2} and cache[ngram([3])] == {1: 1}
    assert cache[ngram([1, 2, 3, 1])] == {2: 1} and cache[ngram([2, 3, 1])] == {2: 1}


def test_the_longest_ngram_that_passes_its_thresholds_wins():
    cache = {ngram([4]): {5: 4}, ngram([3, 4]): {6: 1, 7: 1}}  # 2-gram: 50% passes lax (50)
    assert try_draft(cache, [ngram([4]), ngram([3, 4])], {}, *LAX) == 6  # first of the tie
    assert try_draft(cache, [ngram([4]), ngram([3, 4])], {}, *STRICT) == 5  # 2-gram fails 66%
    cache[ngram([3, 4])] = {6: 1}  # sample size 1 < 2 (lax, n = 2)
    assert try_draft(cache, [ngram([4]), ngram([3, 4])], {}, *LAX) == 5


def test_the_static_counts_reweight_the_candidates():
    cache = {ngram([4]): {5: 2, 6: 1}}
    assert try_draft(cache, [ngram([4])], {}, *LAX) == 5
    # 6 is known to the static cache after the last 2 tokens: 1 * 100 * 1 > 2 * 1, but the
    # percentage test is on the primary counts (1 of 3 < 50%): nothing is drafted
    assert try_draft(cache, [ngram([4])], {6: 1}, *LAX) == -1
    assert try_draft_static({ngram([1, 2]): {3: 1, 4: 1}}, ngram([1, 2])) == 3  # 50%, 2 seen
    assert try_draft_static({ngram([1, 2]): {3: 1}}, ngram([1, 2])) == -1  # seen once


def test_draft_follows_context_then_dynamic_then_static():
    inp = [1, 2, 3, 9]
    ctx = {}
    ngram_cache_update(ctx, 1, 4, inp, len(inp))
    draft = [9]
    ngram_cache_draft(inp, draft, 3, 1, 4, ctx, {}, {})
    assert draft == [9]  # nothing follows 9 yet
    dynamic = {ngram([9]): {4: 2}}  # 2 < strict sample size 4 for a 1-gram
    ngram_cache_draft(inp, draft, 3, 1, 4, ctx, dynamic, {})
    assert draft == [9]
    dynamic = {ngram([9]): {4: 4}, ngram([9, 4]): {5: 3}}
    static = {ngram([4, 5]): {6: 2}}
    ngram_cache_draft(inp, draft, 3, 1, 4, ctx, dynamic, static)
    assert draft == [9, 4, 5, 6]  # dynamic, dynamic, static


def test_the_cache_file_is_llama_cpps_records(tmp_path):
    cache = {ngram([1, 2]): {3: 4, 5: 1}, ngram([7]): {8: 2}}
    path = tmp_path / "c.bin"
    ngram_cache_save(cache, path)
    data = path.read_bytes()
    assert data[:24] == struct.pack("<6i", 1, 2, -1, -1, 2, 3) and len(data) == 2 * 20 + 3 * 8
    assert ngram_cache_load(path) == cache
    ngram_cache_merge(cache, {ngram([7]): {8: 1, 9: 1}})
    assert cache[ngram([7])] == {8: 3, 9: 1}
    path.write_bytes(data[:-4])
    with pytest.raises(NgramCacheError, match="bad follower count"):
        ngram_cache_load(path)
    path.write_bytes(data[:10])
    with pytest.raises(NgramCacheError, match="truncated"):
        ngram_cache_load(path)


# ---- lookup: exactly plain generation ----------------------------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS, ids=str)
def test_lookup_is_plain_generation(flavour):
    hp, w = target(flavour)
    want = plain_greedy(flavour, hp, w, REPEAT, 40)
    look = Lookup(flavour.make(hp, w, n_ctx=256), GREEDY, n_draft=4)
    assert list(look.generate(REPEAT, 40)) == want
    assert look.stats.n_drafted > look.stats.n_accept > 0


def test_a_dynamic_cache_from_an_earlier_run_drafts_more(tmp_path):
    hp, w = target(REF_F32)
    from reference.context import Context

    first = Lookup(Context(hp, w, n_ctx=256), GREEDY, n_draft=4)
    want = list(first.generate([4, 8], 30))
    ngram_cache_merge(first.nc_dynamic, first.nc_context)
    ngram_cache_save(first.nc_dynamic, tmp_path / "dyn.bin")
    again = Lookup(Context(hp, w, n_ctx=256), GREEDY, n_draft=4,
                   nc_dynamic=ngram_cache_load(tmp_path / "dyn.bin"))
    assert list(again.generate([4, 8], 30)) == want
    assert again.stats.n_accept > first.stats.n_accept


@pytest.mark.parametrize("flavour", [REF_F32, MLX], ids=str)
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_lookup_on_mamba_restores_a_saved_state(flavour, arch):
    hp, w = mamba_model(arch, flavour.dtype)
    want = plain_greedy(flavour, hp, w, REPEAT, 30)
    look = Lookup(flavour.make(hp, w, n_ctx=256), GREEDY, n_draft=4)
    assert list(look.generate(REPEAT, 30)) == want
    assert look.n_restored > 0


# ---- the commands ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    hp = tiny_hparams(n_vocab=300, n_layer=2, n_ctx_train=4096)  # the byte tokens fit
    path = tmp_path_factory.mktemp("spec") / "t.gguf"
    return write_tiny_gguf(path, hp, random_weights(hp, seed=7))


@pytest.mark.parametrize("command", ["speculative", "speculative-simple", "lookup"])
def test_every_command_has_help_with_an_example(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and f"usage: llamaref {command}" in out
    assert f"llamaref {command} " in out.split("example")[-1]


@pytest.mark.parametrize("command", ["speculative", "speculative-simple", "lookup"])
def test_the_commands_print_llamacpps_statistics(tiny_gguf, capsys, command, tmp_path):
    draft = [] if command == "lookup" else ["--draft-layers", "1"]
    extra = ["-lcd", str(tmp_path / "d.bin")] if command == "lookup" else []
    assert main([command, "-m", str(tiny_gguf), "-p", "a b a b a b", "-n", "16", "--temp", "0",
                 "--backend", "reference", *draft, *extra]) == 0
    err = capsys.readouterr().err.splitlines()
    n_predict = [line for line in err if line.startswith("n_predict")]
    assert len(n_predict) == 1 and 1 <= int(n_predict[0].split("=")[1]) <= 16
    assert any(line.startswith("n_drafted") for line in err)
    assert any(line.startswith("accept") and line.endswith("%") for line in err)
    if command == "lookup":
        assert (tmp_path / "d.bin").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["speculative", "-p", "x"], "needs one draft: -md/--model-draft FILE or --draft-layers K"),
    (["speculative-simple", "-p", "x", "-md", "nope.gguf"], "draft model not found: nope.gguf"),
    (["speculative", "-p", "x", "--draft-layers", "1", "-np", "0"], "-np/--parallel = 0"),
    (["lookup", "-p", "x", "-lcs", "nope.bin"], "failed to open static lookup cache"),
    (["speculative", "-p", "x", "--draft-layers", "1", "--draft-max", "0"], "--draft-max = 0"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, message):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_an_incompatible_draft_model_is_refused_before_any_work(tiny_gguf, tmp_path, capsys):
    hp = tiny_hparams(n_vocab=40, n_layer=1, n_ctx_train=4096)
    other = write_tiny_gguf(tmp_path / "o.gguf", hp, random_weights(hp))
    assert main(["speculative", "-m", str(tiny_gguf), "-md", str(other), "-p", "a",
                 "--backend", "reference"]) == 1
    err = capsys.readouterr().err
    assert "difference 260 > 128" in err and "--draft-layers" in err
