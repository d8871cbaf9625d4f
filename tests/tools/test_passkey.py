"""Passkey retrieval (``reference.tools.passkey``, ``llamaref passkey``).

- the key, its place and the prompt are ``passkey.cpp``'s (glibc's unseeded ``rand()``);
- on both twins, the chunked fill with grouping leaves every chunk but the last at
  ``t // G`` and the last one after them, and the cache equals a fresh decode there;
- a prompt longer than the context is shifted in; the answer is 16 greedy tokens;
- SmolLM2 finds the key with grouping on (the loop exercised: 4 chunks of 64, G = 2);
- ``llamaref passkey`` prints llama.cpp's lines and refuses bad flags in one line.
"""

from __future__ import annotations

import numpy as np
import pytest

from llamaref.cli import main
from reference.context import Context
from reference.tokenizer import load_tokenizer
from reference.tools.passkey import (
    JUNK,
    PROMPT_PREFIX,
    PROMPT_SUFFIX,
    GlibcRand,
    PasskeyError,
    choose_passkey,
    passkey_fill,
    passkey_n_ctx,
    passkey_prompt,
    run_passkey,
)
from tests.oracle.test_smollm2 import smollm2_path
from tests.support.helpers import (
    REF_F32,
    assert_twins_agree,
    decode_seq,
    every_flavour,
    fresh_cache,
    make,
    make_mamba,
)
from tests.support.tiny_models import random_weights, tiny_hparams
from tests.tools.test_generate import cached_tokenizers  # noqa: F401  (an autouse fixture)


def test_rand_key_and_place_are_passkey_cpp():
    r = GlibcRand()
    assert [r() for _ in range(3)] == [1804289383, 846930886, 1681692777]
    assert choose_passkey(250) == (133, 30887)  # the defaults, no --pos
    assert choose_passkey(250, 90) == (90, 39384)  # --pos 90: the key is the first draw


def test_prompt_text():
    want = (PROMPT_PREFIX + JUNK + " The pass key is 7. Remember it. 7 is the pass key." + JUNK
            + PROMPT_SUFFIX)
    assert passkey_prompt(2, 1, 7) == want
    assert "pass key is 7." not in passkey_prompt(2, 2, 7)  # i_pos >= n_junk: no key
    assert passkey_n_ctx(8192, 2, 32) == 16640


def fill_positions(n: int, n_batch: int, n_grp: int) -> list[int]:
    """Every chunk but the last at t // G, the last one right after them."""
    n_grouped = (-(-n // n_batch) - 1) * n_batch
    return [t // n_grp if t < n_grouped else n_grouped // n_grp + t - n_grouped
            for t in range(n)]


@every_flavour
@pytest.mark.parametrize("n, n_batch, n_grp", [(50, 8, 2), (64, 16, 4), (37, 6, 3), (9, 12, 2),
                                               (40, 10, 1)])
def test_fill_groups_every_chunk_but_the_last(flavour, n, n_batch, n_grp):
    tokens = [int(t) for t in np.random.default_rng(n).integers(0, 32, n)]

    def scenario(fl):
        ctx = make(fl, n_layer=1, n_batch=n_batch)
        lines: list[str] = []
        n_past = passkey_fill(ctx, tokens, ctx.n_ctx - 4, n_batch, n_grp, 4, lines.append)
        want = fill_positions(n, n_batch, n_grp)
        assert ctx.memory.v_cells[0].pos[:n].tolist() == want
        assert n_past == want[-1] + 1
        assert lines[0] == f"main: processed: [     0, {min(n_batch, n):6d})"
        assert len(lines) == -(-n // n_batch)
        fresh = fresh_cache(fl, list(zip(tokens, want, strict=True)))
        fl.assert_close(decode_seq(fresh, [5]), got := decode_seq(ctx, [5]))
        return got

    assert_twins_agree(flavour, scenario(flavour), scenario)


def test_long_prompt_is_shifted_in_as_passkey_cpp_does():
    """``passkey.cpp``'s shift, quirks included: the fill's last chunk runs past ``n_ctx``
    (tokens 248..255 are decoded again by the shift loop), and ``seq_add`` stops at ``n_ctx``,
    not at ``n_past``, so what lies beyond it is never moved back: 256 + 32 + 20 = 308."""
    ctx = make(REF_F32, n_layer=1, n_batch=32)  # 256 cells, n_ctx = 256 - n_keep = 248
    lines: list[str] = []
    n_past = passkey_fill(ctx, [1] * 300, ctx.n_ctx - 8, 32, 1, 8, lines.append)
    assert lines[8:] == ["main: shifting KV cache with 32", "main: processed: [   248,    280)",
                         "main: shifting KV cache with 32", "main: processed: [   280,    300)",
                         "main: shifting KV cache with 76 to free space for the answer"]
    assert n_past == ctx.memory.seq_pos_max(0) + 1 == 308
    assert ctx.memory.v_cells[0].get_used() == 256 - 32 + 32 - 32 + 20 - 76


def tiny_smol_gguf(path, n_ctx_train: int):
    """A tiny random llama with SmolLM2's vocabulary and a short trained context."""
    from reference.arch import llama_metadata
    from reference.gguf import read_gguf, write_gguf

    smol = read_gguf(smollm2_path())
    vocab = {k: v for k, v in smol.metadata.items() if k.startswith("tokenizer.")}
    hp = tiny_hparams(n_vocab=49152, n_embd=32, n_layer=1, n_head=4, n_head_kv=2, n_ff=48,
                      n_ctx_train=n_ctx_train)
    weights = {k: np.asarray(v, np.float32) for k, v in random_weights(hp, seed=5).items()}
    write_gguf(str(path), llama_metadata(hp, vocab=vocab), weights)
    return path


@pytest.fixture(scope="module")
def tiny_passkey_model(tmp_path_factory):
    return tiny_smol_gguf(tmp_path_factory.mktemp("pk") / "tiny-pk.gguf", n_ctx_train=128)


def test_run_passkey_on_a_tiny_model(tiny_passkey_model):
    from reference.model_loader import load_model

    hp, w = load_model(tiny_passkey_model)
    tok = load_tokenizer(tiny_passkey_model)
    made, out, info = [], [], []

    def new_context(**kw):
        made.append(kw)
        return Context(hp, w, **kw)

    res = run_passkey(new_context, tok, hp.n_ctx_train, n_junk=4, i_pos=2, n_grp=2, n_batch=32,
                      out=out.append, info=info.append)
    assert made == [dict(n_ctx=passkey_n_ctx(128, 2, 32), n_batch=32)]
    assert (res.passkey, res.i_pos, res.n_junk) == (39384, 2, 4)
    assert res.n_tokens_all == len(tok.tokenize(passkey_prompt(4, 2, 39384)))
    assert 1 <= res.n_decode == len(res.answer) <= 16 and "".join(out[:-1]) == res.text
    assert info[0].startswith("\nmain: n_len = ") and "n_grp = 2, n_batch = 32" in info[0]
    assert sum(line.startswith("main: processed: [") for line in info) == -(
        -res.n_tokens_all // 32)
    assert f"\nmain: passkey = 39384, inserted at position 2 / 4 (token pos: ~" \
           f"{2 * res.n_tokens_all // 4})\n" in info
    assert PROMPT_SUFFIX in info


def test_recurrent_model_and_bad_parameters_are_refused():
    mp = make_mamba(REF_F32, "mamba")
    with pytest.raises(PasskeyError, match="recurrent"):
        run_passkey(lambda **kw: mp, _FakeTok(), 128, n_junk=2, i_pos=0)
    for kw in [dict(n_junk=0), dict(n_keep=-1), dict(i_pos=-2), dict(n_grp=0),
               dict(n_grp=3, n_batch=64)]:
        with pytest.raises(PasskeyError):
            run_passkey(_no_context, _FakeTok(), 128, **kw)


class _FakeTok:
    def tokenize(self, text, add_special=True, parse_special=False):
        return [1] * (len(text) // 20 + 1)


def _no_context(**kw):
    raise AssertionError("a context was made before the parameters were checked")


# ---- the command ---------------------------------------------------------------------------

def test_cli_passkey(capsys, tiny_passkey_model):
    assert main(["passkey", "-m", str(tiny_passkey_model), "--junk", "4", "--pos", "2",
                 "-gan", "2", "-b", "32", "--backend", "reference"]) == 0
    cap = capsys.readouterr()
    assert "main: passkey = 39384, inserted at position 2 / 4" in cap.err
    assert "main: processed: [     0,     32)" in cap.err
    assert "llamaref: passkey 39384 " in cap.err and "main: decoded " in cap.err
    assert cap.out.endswith("\n") and "main:" not in cap.out


@pytest.mark.parametrize("flags, message", [
    (["--junk", "0"], "--junk 0"),
    (["--pos", "-2"], "--pos -2"),
    (["-gan", "0"], "--grp-attn-n 0"),
    (["-gan", "4", "-b", "30"], "divisible"),
    (["--keep", "-1"], "--keep"),
])
def test_cli_passkey_bad_flags(capsys, flags, message):
    assert main(["passkey", "-m", "/nonexistent.gguf", *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_smollm2_finds_the_key_with_grouping(capsys):
    """SmolLM2 (reference backend): 4 chunks of 64, three of them grouped by 2."""
    assert main(["passkey", "--junk", "8", "--pos", "3", "-gan", "2", "-b", "64", "-c", "512",
                 "--backend", "reference"]) == 0
    cap = capsys.readouterr()
    assert cap.err.count("main: processed:") == 4
    assert "39384" in cap.out and "passkey 39384 found" in cap.err
