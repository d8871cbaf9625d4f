"""stories260K (llama2.c, MIT): greedy decoding reproduces the text of its model card.

The model card (``stories260K.md``) records the output of llama2.c's ``run.c`` at
temperature 0 from an empty prompt: BOS, then up to 256 steps, stopping at BOS. Our greedy
decoding of the float32 GGUF of the same weights, token by token through the simple KV
cache, must print the same text. Tokens are turned into text as ``run.c`` does: SentencePiece
pieces with ``▁`` as a space, ``<0xXX>`` byte tokens as that byte, and the leading space of
the first piece after BOS dropped. (The real tokenizer is a later chapter.)
"""

from __future__ import annotations

import re

import pytest

from reference.arch import hparams_from_file
from reference.gguf import read_gguf
from reference.models.llama import greedy

BOS = 1
STEPS = 256  # run.c's default number of steps


def recorded_greedy_text(card: str) -> str:
    """The code block that follows the ``-t 0.0`` command line in the model card."""
    m = re.search(r"-t 0\.0\n(.*?)\n```", card, re.S)
    assert m, "greedy output not found in the model card"
    return m.group(1)


def decode_run_c(pieces: list[str], tokens: list[int], prev: int = BOS) -> str:
    """Concatenate pieces as llama2.c's ``decode`` + ``safe_printf`` do."""
    out = bytearray()
    for t in tokens:
        piece = pieces[t].replace("\u2581", " ")
        if prev == BOS and piece.startswith(" "):
            piece = piece[1:]
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        out += bytes([int(byte.group(1), 16)]) if byte else piece.encode("utf-8")
        prev = t
    return out.decode("utf-8")


@pytest.fixture(scope="module")
def stories(shared_fixtures):
    folder = shared_fixtures / "stories260K"
    gguf = read_gguf(folder / "stories260K-f32.gguf")
    return gguf, (folder / "stories260K.md").read_text()


def test_hparams(stories):
    gguf, _ = stories
    hp = hparams_from_file(gguf)
    assert (hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_vocab) == (64, 5, 8, 4, 512)


def test_greedy_reproduces_the_model_card(stories):
    gguf, card = stories
    tokens = greedy(gguf.tensors, hparams_from_file(gguf), [BOS], n_predict=STEPS, stop=(BOS,))
    text = decode_run_c(gguf.metadata["tokenizer.ggml.tokens"], tokens)
    assert text.rstrip() == recorded_greedy_text(card).rstrip()
