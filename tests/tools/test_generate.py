"""Generation (``reference.tools.generate`` and ``llamaref generate`` / ``chat``).

- greedy ``llamaref generate`` prints exactly what a plain argmax loop over the reference
  Context decodes, and that is llama.cpp's own greedy continuation (llama-cpp-python);
- seeded sampling is reproducible, and the same seed gives the same text on both backends;
- the context shift keeps generating past ``n_ctx``, and the shifted cache is the cache of
  the kept tokens decoded afresh; without it, generation stops at a full context;
- a chat turn decodes only what the cache lacks.

Fast tests run a tiny random model that carries SmolLM2's tokenizer (:func:`tiny_smol_gguf`);
the oracle tests run SmolLM2 itself on the reference backend.
"""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from llamaref.backends import pick_backend, prepare_weights
from llamaref.cli import main
from reference.batch import Batch
from reference.context import Context
from reference.tools.generate import ChatSession, Generator, Perf
from tests.oracle.test_smollm2 import smollm2_path
from tests.support.tiny_models import random_weights, tiny_hparams

GREEDY_PROMPT = "Once upon a time, there was a little"


class Greedy:
    """The smallest sampler: argmax, and a record of what was accepted."""

    def __init__(self):
        self.accepted = []

    def sample(self, logits):
        return int(np.argmax(logits))

    def accept(self, token):
        self.accepted.append(int(token))


def tiny_smol_gguf(path, n_layer=1):
    """A tiny random llama (n_embd 32) with SmolLM2's vocabulary, tokenizer and template."""
    from reference.arch import llama_metadata
    from reference.gguf import read_gguf, write_gguf

    smol = read_gguf(smollm2_path())
    vocab = {k: v for k, v in smol.metadata.items() if k.startswith("tokenizer.")}
    hp = tiny_hparams(n_vocab=49152, n_embd=32, n_layer=n_layer, n_head=4, n_head_kv=2, n_ff=48,
                      n_ctx_train=8192)
    weights = {k: np.asarray(v, np.float32) for k, v in random_weights(hp, seed=3).items()}
    write_gguf(str(path), llama_metadata(hp, vocab=vocab), weights)
    return path


_TOKENIZERS: dict = {}


@pytest.fixture(autouse=True)
def cached_tokenizers(monkeypatch):
    """Each CLI run loads the tokenizer (seconds for 49152 tokens): load each file once."""
    import reference.tokenizer

    load = reference.tokenizer.load_tokenizer

    def cached(path):
        key = str(path)
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = load(path)
        return _TOKENIZERS[key]
    monkeypatch.setattr(reference.tokenizer, "load_tokenizer", cached)


@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory):
    return tiny_smol_gguf(tmp_path_factory.mktemp("tiny") / "tiny-smol.gguf")


@pytest.fixture(scope="module")
def smol():
    from reference.model_loader import load_model
    from reference.tokenizer import load_tokenizer

    path = smollm2_path()
    hparams, weights = load_model(path)
    return path, hparams, prepare_weights(weights, "reference"), load_tokenizer(path)


def run_cli(capsys, *argv) -> tuple[str, str]:
    assert main(list(argv)) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    return captured.out, captured.err


# ---- greedy: our loop, the CLI, llama.cpp ---------------------------------------------------

def own_greedy(hparams, weights, prompt_tokens, n):
    """An argmax loop written out on the reference Context: the specification of greedy."""
    ctx = Context(hparams, weights, n_ctx=256)
    assert ctx.decode(Batch(token=list(prompt_tokens))) == 0
    out, margins = [], []
    for _ in range(n):
        logits = ctx.get_logits_ith(-1)
        top2 = np.sort(logits)[-2:]
        out.append(int(np.argmax(logits)))
        margins.append(float(top2[1] - top2[0]))
        assert ctx.decode(Batch(token=[out[-1]])) == 0
    return out, margins


def llamacpp_greedy(path, prompt_tokens, n):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False)
    try:
        out = []
        for token in llm.generate(list(prompt_tokens), temp=0.0, top_k=1):
            out.append(int(token))
            if len(out) == n:
                return out
    finally:
        llm.close()


@pytest.mark.oracle
def test_greedy_generate_is_our_argmax_loop_and_llamacpps_continuation(smol, capsys):
    """16 greedy tokens of SmolLM2 Q4_1: the CLI == an argmax loop == llama.cpp.

    llama.cpp quantizes activations to Q8_1 inside its Q4_1 matmuls and keeps an f16 KV
    cache, so a near-tie can flip: on "The capital of France is" the two part at step 5,
    where our top-2 margin is 0.22 logits (" answer" vs " United"). This prompt agrees on all
    16 tokens; the assertion reports the step and our margin if that ever changes.
    """
    path, hparams, weights, tokenizer = smol
    prompt = tokenizer.tokenize(GREEDY_PROMPT, add_special=True, parse_special=True)
    ours, margins = own_greedy(hparams, weights, prompt, 16)
    out, _ = run_cli(capsys, "generate", GREEDY_PROMPT, "-m", str(path), "-n", "16", "-c", "256",
                     "--temp", "0", "--backend", "reference", "--no-display-prompt")
    assert out == tokenizer.detokenize(ours) + "\n"
    theirs = llamacpp_greedy(path, prompt, 16)
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    assert step is None, (f"llama.cpp parts at step {step}: ours {ours[step]}, theirs "
                          f"{theirs[step]}, our top-2 margin there {margins[step]:.3f}")


def test_generate_echoes_the_prompt_and_reports_perf(tiny_smol, capsys):
    out, err = run_cli(capsys, "generate", "Hello world", "-m", str(tiny_smol), "-n", "3",
                       "--temp", "0", "--backend", "reference")
    assert out.startswith("Hello world")
    assert "llamaref: backend reference" in err
    assert "/     2 tokens (" in err  # the prompt, one decode of 2 tokens
    assert "/     2 runs" in err  # 3 tokens sampled, the last one is not decoded


# ---- seeds -----------------------------------------------------------------------------------

def test_a_seed_gives_the_same_text_again_and_on_both_backends(tiny_smol, capsys):
    argv = ("generate", "The sea", "-m", str(tiny_smol), "-n", "8", "-s", "7", "--temp", "1.0",
            "--ignore-eos", "--no-display-prompt")
    first, _ = run_cli(capsys, *argv, "--backend", "reference")
    again, _ = run_cli(capsys, *argv, "--backend", "reference")
    acc, err = run_cli(capsys, *argv, "--backend", "accelerated")
    assert "backend accelerated" in err
    assert first == again == acc and len(first) > 8


def test_auto_is_reference_on_a_cpu_only_mlx():
    import mlx.core as mx

    expected = "accelerated" if mx.default_device().type == mx.DeviceType.gpu else "reference"
    assert pick_backend("auto", tiny_hparams()) == expected


# ---- the prompt joins the sampler's history --------------------------------------------------

def test_prompt_tokens_are_accepted_before_sampling():
    hp = tiny_hparams()
    sampler = Greedy()
    gen = Generator(Context(hp, random_weights(hp), n_ctx=256), sampler)
    gen.eval_prompt([3, 1, 4, 1, 5])
    tokens = list(gen.generate(4, is_eog=lambda t: False))
    assert sampler.accepted == [3, 1, 4, 1, 5] + tokens


# ---- context shift ---------------------------------------------------------------------------

def test_context_shift_keeps_generating_past_n_ctx():
    """400 tokens through 256 cells (two shifts): llama-completion's rule, step by step.

    Before a decode that would fill the context, ``n_discard = (n_past - n_keep) // 2``
    tokens after the first ``n_keep`` go, and the rest moves back; the cache then holds
    exactly the kept tokens at positions ``0..n_past-1``.
    """
    hp = tiny_hparams(n_ctx_train=4096)
    gen = Generator(Context(hp, random_weights(hp), n_ctx=256), Greedy(), n_keep=3)
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6]
    gen.eval_prompt(prompt)
    out = list(gen.generate(400, is_eog=lambda t: False))
    assert len(out) == 400 and gen.stopped is None
    expected, n_shifts = list(prompt), 0
    for token in out[:-1]:  # the last token is sampled, not decoded
        if len(expected) + 1 >= 256:
            n_discard = (len(expected) - 3) // 2
            del expected[3 : 3 + n_discard]
            n_shifts += 1
        expected.append(token)
    assert n_shifts >= 2 and gen.tokens == expected
    memory = gen.ctx.memory
    assert memory.seq_pos_min(0) == 0 and memory.seq_pos_max(0) == len(expected) - 1
    assert memory.v_cells[0].get_used() == len(expected)


def test_without_context_shift_generation_stops_at_a_full_context():
    hp = tiny_hparams(n_ctx_train=4096)
    gen = Generator(Context(hp, random_weights(hp), n_ctx=256), Greedy(), shift=False)
    gen.eval_prompt([1, 2, 3, 4, 5])
    out = list(gen.generate(-1, is_eog=lambda t: False))
    assert len(out) == 256 - 5  # positions 0..254 decoded, the last token sampled
    assert "context full" in gen.stopped


def test_cli_context_shift_and_no_context_shift(tiny_smol, capsys):
    """A 200-token prompt in 256 cells: 80 more tokens need a shift, or stop at 56."""
    from reference.tokenizer import load_tokenizer

    prompt = "one two three four five six seven eight nine ten " * 20
    n_prompt = len(load_tokenizer(tiny_smol).tokenize(prompt))
    assert 180 <= n_prompt <= 250
    argv = ("generate", prompt, "-m", str(tiny_smol), "-c", "256", "-n", "80", "--temp", "0",
            "--ignore-eos", "--backend", "reference", "--no-display-prompt")
    _, err = run_cli(capsys, *argv)
    assert f"/ {n_prompt:5d} tokens (" in err and "/    79 runs" in err
    _, err = run_cli(capsys, *argv, "--no-context-shift")
    assert "context full (n_ctx = 256) and context shift is disabled => stopping" in err
    assert f"/ {256 - n_prompt - 1:5d} runs" in err  # positions up to 254 are decoded


def test_a_prompt_longer_than_the_context_is_one_line_error(tiny_smol, capsys):
    assert main(["generate", "word " * 300, "-m", str(tiny_smol), "-c", "256",
                 "--backend", "reference"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "llamaref: backend reference"  # then one line, no traceback
    assert lines[1].startswith("llamaref: error: the prompt needs") and len(lines) == 2


# ---- chat ------------------------------------------------------------------------------------

def test_a_chat_turn_decodes_only_the_new_suffix(tiny_smol):
    from llamaref.backends import make_sampler
    from reference.model_loader import load_model
    from reference.sampling import SamplerParams
    from reference.tokenizer import load_tokenizer

    hparams, weights = load_model(tiny_smol)
    tokenizer = load_tokenizer(tiny_smol)
    sampler, _ = make_sampler("reference", SamplerParams(temp=0.0), hparams.n_vocab)
    gen = Generator(Context(hparams, weights, n_ctx=512), sampler, shift=False)
    chat = ChatSession(gen, tokenizer, system="You are brief.")
    chat.turn("Hello there", n_predict=5, emit=lambda s: None)
    chat.turn("And now?", n_predict=5, emit=lambda s: None)
    first, second = chat.prompt_per_turn
    assert chat.decoded_per_turn[0] == first  # an empty cache: everything
    # the first turn's prompt is cached: at most the reply and the new message are decoded
    assert 0 < chat.decoded_per_turn[1] <= second - first
    assert gen.perf.n_p_eval == sum(chat.decoded_per_turn)


def test_cli_chat_reads_stdin_until_exit(tiny_smol, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n\nHow are you?\n/exit\nignored\n"))
    out, err = run_cli(capsys, "chat", "-m", str(tiny_smol), "-n", "3", "--temp", "0",
                       "--backend", "reference", "-sys", "Be brief.")
    assert out.count("\n") == 2  # two replies, one per message
    assert "llama_perf_context_print: prompt eval time" in err


def test_perf_lines_follow_llama_perf_context_print():
    perf = Perf(t_load_ms=1.0, t_p_eval_ms=20.0, n_p_eval=4, t_eval_ms=10.0, n_eval=2,
                n_reused=1)
    lines = perf.lines()
    assert lines[2] == ("llama_perf_context_print:        eval time =      10.00 ms /     2 runs"
                        "   (    5.00 ms per token,   200.00 tokens per second)")
    assert lines[-1] == "llama_perf_context_print:    graphs reused =          1"
