"""``llamaref finetune`` end to end, the saved GGUF, and SmolLM2 fine-tuned on both twins.

- The command on a tiny random model (a byte-level SPM vocabulary, so any text tokenizes), on
  both backends: llama.cpp's settings line, ``epoch E lr=`` lines, the progress line's exact
  format for every datapoint, the report (steps/s, peak memory, optimizer state: SGD keeps no
  moments, AdamW two per trainable tensor), the loss plot beside the output; the saved model
  is what the driver trains (token embeddings untouched) and both backends save the same one.
- Every refusal is one line, before anything is written: a text too short (with the number of
  tokens needed), ``-c`` not a multiple of ``-b``, ``-b`` not a multiple of ``-ub``,
  ``-ub < -c``, a bad learning rate, LoRA flags without a rank, missing files.
- LoRA through the command: the adapter file (llama.cpp's format) and the merged model.
- The save keeps the source's metadata key for key and type for type (the tokenizer
  included), with ``general.file_type`` = all F32.
- SmolLM2-135M (dequantized to float32), two AdamW steps on a short text: the validation
  loss goes down step after step on both twins, and the twins agree.
- ``oracle``: llama.cpp (llama-cpp-python) loads the saved GGUFs (tiny and SmolLM2) and gives
  our in-memory model's logits, NMSE <= 1e-6.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from accelerated.training.finetune import TRAINER as MLX_TRAINER
from llamaref.backends import prepare_weights
from llamaref.cli import main
from reference.gguf import read_gguf
from reference.model_loader import ModelLoadError, default_model_path, load_model
from reference.testing import nmse, random_weights, reference_logits, tiny_hparams
from reference.tokenizer import load_tokenizer
from reference.training.dataset import dataset_ndata, idata_split, opt_dataset_init
from reference.training.epoch import _eval_datapoint
from reference.training.finetune import TRAINER, FinetuneParams, finetune
from reference.training.lora import load_lora_gguf, merge_lora
from reference.training.save import model_save_to_file, source_metadata
from reference.training.schedule import lr_opt_init
from tests.support.tiny_models import llamacpp_logits, write_tiny_gguf

TEXT = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He wiped the salt "
    "from the glass, trimmed the wick, and lit the great lamp, so that the fishing boats could "
    "find their way home through the fog. In the morning he wrote in his log how many ships had "
    "passed, what the wind had done, and whether the gulls had come early or late. "
)

PROGRESS = re.compile(
    r"^(train: |val:   )\[[\u2588-\u258f ]{8}\] data=\d{7}/\d{7} "
    r"loss=\d+\.\d{5}±(\d+\.\d{5}|-?nan) acc=\d+\.\d{2}±(\d+\.\d{2}|-?nan)% "
    r"t=\d\d:\d\d:\d\d ETA=\d\d:\d\d:\d\d $"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama with a byte-level vocabulary (300 tokens), and a text file."""
    d = tmp_path_factory.mktemp("ft")
    hp = tiny_hparams(n_layer=2, n_vocab=300, n_ctx_train=256)
    path = write_tiny_gguf(d / "tiny.gguf", hp, random_weights(hp, seed=0))
    text = d / "text.txt"
    text.write_text(TEXT * 2 + "\n")
    return path, text


def _run(capsys, *argv):
    rc = main(["finetune", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


FLAGS = ("-c", 32, "-lr", 1e-2, "-val-split", 0.25)


def test_the_command_trains_saves_plots_and_reports_on_both_backends(tiny, tmp_path, capsys):
    model, text = tiny
    saved = {}
    for backend in ("reference", "accelerated"):
        out = tmp_path / f"{backend}.gguf"
        rc, _, err = _run(capsys, "-m", model, "-f", text, "-o", out, *FLAGS,
                          "--backend", backend)
        assert rc == 0, err
        lines = [x for x in re.split(r"[\r\n]", err) if x]
        assert lines[1] == ("-optimizer adamw -lr0 0.01 -wd 0 -lr-min -1 -min-epochs -1 "
                            "-epochs 2 -period 1 -val 0.25")
        assert sum(x == "epoch 0 lr=0.01" for x in lines) == 1  # each rate once
        assert sum(x == "epoch 1 lr=0.01" for x in lines) == 1
        progress = [x for x in re.split(r"[\r\n]", err) if x.startswith(("train: ", "val:   "))]
        assert all(PROGRESS.match(x) for x in progress), progress[:2]
        n_tokens = int(re.search(r"(\d+) tokens", err).group(1))
        ndata = dataset_ndata(n_tokens, 32, 16)
        n_train = idata_split(ndata, 0.25)
        loops = ["train: "] * n_train + ["val:   "] * (ndata - n_train)
        assert [x[:7] for x in progress] == loops * 2  # one line per datapoint, two epochs
        last = progress[n_train - 1]  # the end of a loop: 7/8 in the last cell, no ETA
        assert last.startswith("train: [███████▉] data=") and "ETA=00:00:00" in last
        assert any(re.search(r"\d+ steps in .* steps/s \(" + backend, x) for x in lines)
        assert any(x.startswith("peak memory:") and "MiB" in x for x in lines)
        assert any("moments" in x for x in lines)
        assert (tmp_path / f"{backend}.loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        saved[backend] = load_model(out)[1]
    src = load_model(model)[1]
    ref, twin = saved["reference"], saved["accelerated"]
    assert np.array_equal(ref["token_embd.weight"], src["token_embd.weight"])  # never trained
    assert not np.array_equal(ref["blk.0.attn_k.weight"], src["blk.0.attn_k.weight"])
    assert max(nmse(ref[n], twin[n]) for n in ref) <= 1e-10


def test_the_saved_model_is_what_the_driver_trains(tiny, tmp_path, capsys):
    model, text = tiny
    out = tmp_path / "o.gguf"
    rc, _, err = _run(capsys, "-m", model, "-f", text, "-o", out, *FLAGS, "-opt", "sgd",
                      "-epochs", 1, "--backend", "reference")
    assert rc == 0, err
    hp, w = load_model(model)
    tokens = load_tokenizer(model).tokenize(TEXT * 2, add_special=True, parse_special=False)
    params = FinetuneParams(32, optimizer="sgd", lr=lr_opt_init(1e-2, epochs=1), val_split=0.25)
    expected = finetune({k: np.asarray(v) for k, v in w.items()}, hp, tokens, params).weights
    got = load_model(out)[1]
    assert all(np.array_equal(got[n], expected[n]) for n in expected)
    assert "optimizer sgd" in err and "moments 0.00 MiB" in err


def test_adamw_reports_two_moments_per_trainable_tensor(tiny, tmp_path, capsys):
    model, text = tiny
    rc, _, err = _run(capsys, "-m", model, "-f", text, "-o", tmp_path / "a.gguf", *FLAGS,
                      "-epochs", 1, "--backend", "reference")
    assert rc == 0
    trainable, grads, moments = (float(x) for x in re.search(
        r"trainable ([\d.]+) MiB, gradients ([\d.]+) MiB, moments ([\d.]+) MiB", err).groups())
    # printed to 0.01 MiB: 2 * (trainable +- 0.005) +- 0.005
    assert trainable == grads > 0 and moments == pytest.approx(2 * trainable, abs=0.0151)


def test_without_validation_data(tiny, tmp_path, capsys):
    model, text = tiny
    rc, _, err = _run(capsys, "-m", model, "-f", text, "-o", tmp_path / "v.gguf", "-c", 32,
                      "-val-split", 0, "-epochs", 1, "--backend", "reference")
    assert rc == 0 and "val:   [" not in err and "no validation data" in err


@pytest.mark.parametrize("extra, message", [
    (("-c", 1024, "-ub", 1024), "at least 1537 tokens are needed"),
    (("-c", 32, "-b", 24), "n_ctx = 32 must be a multiple of n_batch = 24"),
    (("-c", 32, "-b", 32, "-ub", 12), "n_batch = 32 must be a multiple of n_ubatch = 12"),
    (("-c", 64, "-b", 64, "-ub", 32), "n_ubatch = 32 < n_ctx = 64"),
    (("-c", 32, "-lr", 0), "adamw.alpha must be > 0"),
    (("-c", 32, "-opt", "sgd", "-wd", 2), "sgd.wd must be in [0, 1]"),
    (("-c", 32, "-val-split", 2), "val_split=2.0 puts the split"),
    (("-c", 32, "-epochs", -1), "-epochs = -1 must be >= 0"),
    (("-c", 32, "--lora-out", "x.gguf"), "need --lora-rank"),
    (("-c", 32, "--lora-rank", 2), "give its file with --lora-out"),
    (("-c", 32, "--lora-rank", 0, "--lora-out", "x.gguf"), "--lora-rank = 0 must be >= 1"),
    (("-c", 32, "-opt", "adam"), "invalid choice: 'adam'"),
])
def test_refusals_are_one_line_and_write_nothing(tiny, tmp_path, capsys, extra, message):
    model, text = tiny
    out = tmp_path / "never.gguf"
    rc, _, err = _run(capsys, "-m", model, "-f", text, "-o", out, *extra)
    assert rc == 1 and err.count("\n") == 1 and err.startswith("llamaref: error: "), err
    assert message in err
    assert not out.exists() and not (tmp_path / "never.loss.png").exists()


def test_missing_text_and_output_are_refused(tiny, tmp_path, capsys):
    model, text = tiny
    assert _run(capsys, "-m", model, "-o", tmp_path / "o.gguf")[2].endswith(
        "no text: give it with -f FILE\n")
    assert "no output file" in _run(capsys, "-m", model, "-f", text)[2]
    assert "no such file" in _run(capsys, "-m", model, "-f", tmp_path / "none", "-o", "x")[2]
    assert "-m must be a GGUF file" in _run(capsys, "-m", tmp_path, "-f", text, "-o", "x")[2]


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    help_text = capsys.readouterr().out
    assert "llamaref finetune -f text.txt -o tuned.gguf" in help_text
    for flag in ("-opt", "-lr-min", "-decay-epochs", "-wd", "-epochs", "-val-split", "-ub",
                 "--lora-rank", "--lora-alpha", "--lora-out"):
        assert flag in help_text


@pytest.mark.parametrize("backend", ["reference", "accelerated"])
def test_lora_writes_the_adapter_and_the_merged_model(tiny, tmp_path, capsys, backend):
    model, text = tiny
    adapter, merged = tmp_path / "ad.gguf", tmp_path / "merged.gguf"
    rc, _, err = _run(capsys, "-m", model, "-f", text, "--lora-rank", 2, "--lora-alpha", 4,
                      "--lora-out", adapter, "-o", merged, *FLAGS, "-epochs", 1,
                      "--backend", backend)
    assert rc == 0, err
    hp, base = load_model(model)
    ad = load_lora_gguf(adapter, base, hp)
    assert ad.alpha == 4.0 and ad.rank("blk.0.attn_q.weight") == 2
    assert ad.b("blk.1.ffn_down.weight").any()  # B starts at 0: it was trained

    expected = merge_lora({k: np.asarray(v) for k, v in base.items()}, ad)
    got = load_model(merged)[1]
    assert max(nmse(expected[n], got[n]) for n in expected) <= 1e-12
    assert np.array_equal(got["output.weight"], base["output.weight"])  # frozen under LoRA


def test_save_keeps_the_source_metadata_and_its_types(tiny, tmp_path):
    model, _ = tiny
    hp, w = load_model(model)
    out = tmp_path / "copy.gguf"
    model_save_to_file(out, w, hp, source_metadata(model))
    src, dst = read_gguf(model), read_gguf(out)
    assert dst.metadata["general.file_type"] == 0
    assert set(dst.metadata) == set(src.metadata) | {"general.file_type"}
    for key, value in src.metadata.items():
        assert dst.value_types[key] == src.value_types[key], key
        assert np.array_equal(np.asarray(dst.metadata[key]), np.asarray(value)), key
    assert list(dst.tensors) == list(src.tensors)


def test_save_of_a_tied_model_writes_no_lm_head(tmp_path):
    hp = tiny_hparams(n_layer=1, tied=True)
    out = tmp_path / "t.gguf"
    model_save_to_file(out, random_weights(hp), hp)
    hp2, w2 = load_model(out)
    assert "output.weight" not in w2 and hp2.tied_output


# ---------------------------------------------------------------------------------------------
# SmolLM2


def _smollm2_path():
    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 dequantized to float32, and its tokens of the text."""
    path = _smollm2_path()
    hp, w = load_model(path)
    tokens = load_tokenizer(path).tokenize(TEXT, add_special=True, parse_special=False)
    return path, hp, prepare_weights(w, "reference"), np.asarray(tokens)


SMOL_N_CTX = 32


def _smol_finetune(smol, trainer, epochs):
    """``epochs`` epochs of one AdamW step each (2 datapoints of 32 tokens, the second
    validates)."""
    _, hp, w, tokens = smol
    params = FinetuneParams(SMOL_N_CTX, optimizer="adamw",
                            lr=lr_opt_init(lr0=1e-4, epochs=epochs), val_split=0.5)
    return finetune(w, hp, tokens[: 2 * SMOL_N_CTX + 2], params, trainer)


@pytest.fixture(scope="module")
def smol_reference_run(smol):
    return _smol_finetune(smol, TRAINER, epochs=2)


def _val_loss_before(smol) -> float:
    _, hp, w, tokens = smol
    data, labels = opt_dataset_init(tokens[: 2 * SMOL_N_CTX + 2], SMOL_N_CTX)
    return _eval_datapoint(w, hp, data[1], labels[1], 1)[0]


def test_smollm2_finetune_lowers_the_validation_loss_reference(smol, smol_reference_run):
    losses = [_val_loss_before(smol)] + [e.val_loss[0] for e in smol_reference_run.epochs]
    assert losses[0] > losses[1] > losses[2], losses
    assert smol_reference_run.n_steps == 2


def test_smollm2_finetune_lowers_the_validation_loss_accelerated(smol, smol_reference_run):
    """The same two steps on the MLX twin: the loss goes down, to the reference's values
    (float32 forwards of 30 layers in two summation orders: ~3e-5 apart)."""
    run = _smol_finetune(smol, MLX_TRAINER, epochs=2)
    losses = [_val_loss_before(smol)] + [e.val_loss[0] for e in run.epochs]
    assert losses[0] > losses[1] > losses[2], losses
    for r, t in zip(smol_reference_run.epochs, run.epochs, strict=True):
        assert t.val_loss[0] == pytest.approx(r.val_loss[0], rel=1e-4)


# ---------------------------------------------------------------------------------------------
# llama.cpp loads what we save


@pytest.mark.oracle
def test_llamacpp_loads_the_finetuned_tiny_model(tiny, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    model, text = tiny
    out = tmp_path / "t.gguf"
    rc, _, err = _run(capsys, "-m", model, "-f", text, "-o", out, *FLAGS, "-epochs", 1)
    assert rc == 0, err
    hp, w = load_model(out)
    tokens = [1, 87, 104, 101, 35, 111, 105, 200, 7, 45]
    ours = reference_logits(w, hp, tokens)
    theirs = llamacpp_logits(out, tokens)
    assert nmse(ours, theirs) <= 1e-6


@pytest.mark.oracle
def test_llamacpp_loads_the_finetuned_smollm2(smol, smol_reference_run, tmp_path):
    pytest.importorskip("llama_cpp")
    path, hp, _, tokens = smol
    out = tmp_path / "smol.gguf"
    model_save_to_file(out, smol_reference_run.weights, hp, source_metadata(path))
    prompt = tokens[:12].tolist()
    ours = reference_logits(smol_reference_run.weights, hp, prompt)  # the in-memory model
    assert nmse(ours, llamacpp_logits(out, prompt)) <= 1e-6
