"""The tokenizer against llama.cpp's own test vocabularies, and its laws.

- ``../shared/fixtures/llama.cpp-vocab``: llama.cpp's ``test-tokenizer-0`` cases (SPM and
  GPT-2 BPE), ids equal with ``add_special=False, parse_special=False``; SPM round-trips.
- The Python expressions of :data:`reference.tokenizer.unicode.CUSTOM_SPLITS` equal a
  line-by-line port of llama.cpp's hand-written scanners (``unicode_regex_split_custom_gpt2``
  / ``_llama3`` / ``_qwen2``) on random text.
- :class:`StreamDecoder` yields exactly ``detokenize`` and never half a character.
- Errors are :class:`TokenizerError` with a message.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from reference.model_loader import default_model_path
from reference.tokenizer import (
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    bpe_merge,
    clean_spaces,
    load_tokenizer,
)
from reference.tokenizer.unicode import (
    GPT2_REGEX,
    LLAMA3_REGEX,
    QWEN2_REGEX,
    WHITESPACE,
    byte_decode,
    byte_encode,
    cpt_category,
    regex_split,
)

SEP = "\n__ggml_vocab_test__\n"


def read_cases(folder, name):
    """``test-tokenizer-0``'s cases: (text, expected ids)."""
    raw = (folder / f"{name}.inp").read_bytes().decode("utf-8")
    texts = raw.split(SEP)
    lines = (folder / f"{name}.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts)
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=False)]


@pytest.fixture(scope="module")
def smollm():
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def gpt2(shared_fixtures):
    return Tokenizer.from_gguf(shared_fixtures / "llama.cpp-vocab" / "ggml-vocab-gpt-2.gguf")


@pytest.mark.parametrize("name", ["ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"])
def test_llamacpp_vocab_fixtures(shared_fixtures, name):
    folder = shared_fixtures / "llama.cpp-vocab"
    tok = Tokenizer.from_gguf(folder / name)
    cases = read_cases(folder, name)
    assert len(cases) > 40
    for text, expected in cases:
        assert tok.tokenize(text, add_special=False) == expected, text


def test_spm_fixture_round_trips(shared_fixtures):
    """SPM adds a prefix space and detokenize drops it: text -> ids -> text is the identity."""
    folder = shared_fixtures / "llama.cpp-vocab"
    tok = Tokenizer.from_gguf(folder / "ggml-vocab-llama-spm.gguf")
    assert (tok.add_bos, tok.add_space_prefix, tok.bos_id, tok.eos_id) == (True, True, 1, 2)
    for text, expected in read_cases(folder, "ggml-vocab-llama-spm.gguf"):
        assert tok.detokenize(expected) == text
        with_bos = tok.tokenize(text)
        assert with_bos == [1, *expected]
        assert tok.detokenize(with_bos, remove_special=True) == " " * bool(expected) + text
        assert tok.detokenize(with_bos, unparse_special=True) == "<s>" + " " * bool(text) + text


def test_gpt2_fixture_clean_spaces(gpt2):
    """gpt-2's vocabulary cleans spaces: " ," loses its space when decoded."""
    tok = gpt2
    assert tok.clean_spaces and tok.pre == "gpt-2"
    ids = tok.tokenize("Hello , world ! I 'm here")
    assert tok.detokenize(ids) == "Hello, world! I'm here"


# ---------------------------------------------------------------------------------------------
# llama.cpp's hand-written scanners, ported line by line, against our expressions
# ---------------------------------------------------------------------------------------------


def _flags(cpts, pos, ini, end):
    """(is_letter, is_number, is_whitespace, defined) of cpts[pos], zeros outside [ini, end)."""
    if not ini <= pos < end:
        return (False, False, False, False)
    c = cpts[pos]
    cat = cpt_category(c)
    return (cat == "L", cat == "N", c in WHITESPACE, True)


def port_gpt2(text: str) -> list[str]:
    """``unicode_regex_split_custom_gpt2`` (one offset: the whole text)."""
    cpts = [ord(c) for c in text]
    end, out, prev = len(cpts), [], 0

    def add(e):
        nonlocal prev
        if e > prev:
            out.append(text[prev:e])
        n, prev = e - prev, e
        return n

    def cpt(p):
        return cpts[p] if 0 <= p < end else -1

    pos = 0
    while pos < end:
        c = cpt(pos)
        if c == ord("'") and pos + 1 < end:
            n1 = chr(cpt(pos + 1))
            if n1 in "stmd":
                pos += add(pos + 2)
                continue
            if pos + 2 < end and n1 + chr(cpt(pos + 2)) in ("re", "ve", "ll"):
                pos += add(pos + 3)
                continue
        f2 = _flags(cpts, pos + 1, 0, end) if c == 32 else _flags(cpts, pos, 0, end)
        if f2[0] or f2[1]:
            k = 0 if f2[0] else 1
            pos += c == 32
            while f2[k]:
                pos += 1
                f2 = _flags(cpts, pos, 0, end)
            add(pos)
            continue
        if not (f2[0] or f2[1] or f2[2]) and f2[3]:
            pos += c == 32
            while not (f2[0] or f2[1] or f2[2]) and f2[3]:
                pos += 1
                f2 = _flags(cpts, pos, 0, end)
            add(pos)
            continue
        nws = 0
        while _flags(cpts, pos + nws, 0, end)[2]:
            nws += 1
        if nws > 1 and cpt(pos + nws) != -1:
            pos += nws - 1
            add(pos)
            continue
        if nws > 0:
            pos += nws
            add(pos)
            continue
        pos += 1
        add(pos)
    return out


def port_llama3(text: str, max_digits: int) -> list[str]:
    """``unicode_regex_split_custom_llama3`` (``max_digits=3``) and ``_qwen2`` (1)."""
    cpts = [ord(c) for c in text]
    end, out, prev = len(cpts), [], 0

    def add(e):
        nonlocal prev
        if e > prev:
            out.append(text[prev:e])
        n, prev = e - prev, e
        return n

    def cpt(p):
        return cpts[p] if 0 <= p < end else -1

    def fl(p):
        return _flags(cpts, p, 0, end)

    pos = 0
    while pos < end:
        c, f = cpt(pos), fl(pos)
        if c == ord("'") and pos + 1 < end:
            n1 = chr(cpt(pos + 1)).lower() if cpt(pos + 1) < 128 else ""
            if n1 and n1 in "stmd":
                pos += add(pos + 2)
                continue
            if pos + 2 < end and cpt(pos + 2) < 128:
                if n1 + chr(cpt(pos + 2)).lower() in ("re", "ve", "ll"):
                    pos += add(pos + 3)
                    continue
        if not (c in (13, 10) or f[1]) and (f[0] or fl(pos + 1)[0]):
            pos += 1
            while fl(pos)[0]:
                pos += 1
            add(pos)
            continue
        if f[1]:
            ini = pos
            while fl(pos)[1]:
                pos += 1
                if pos - ini >= max_digits:
                    add(pos)
                    ini = pos
            add(pos)
            continue
        f2 = fl(pos + 1) if c == 32 else f
        if not (f2[0] or f2[1] or f2[2]) and f[3]:
            pos += c == 32
            while not (f2[0] or f2[1] or f2[2]) and f2[3]:
                pos += 1
                f2 = fl(pos)
            while cpt(pos) in (13, 10):
                pos += 1
            add(pos)
            continue
        nws, last_rn = 0, 0
        while fl(pos + nws)[2]:
            if cpt(pos + nws) in (13, 10):
                last_rn = pos + nws + 1
            nws += 1
        if last_rn > 0:
            pos = last_rn
            add(pos)
            continue
        if nws > 1 and cpt(pos + nws) != -1:
            pos += nws - 1
            add(pos)
            continue
        if nws > 0:
            pos += nws
            add(pos)
            continue
        pos += 1
        add(pos)
    return out


TRICKY = st.sampled_from(
    list(" \t\n\r\x0b\x0c\x1c\x85\xa0\u2009\u3000'sStTmMdDrReEvVlL") + ["'re", "'LL", "'ve", "  "]
)
TEXT = st.lists(st.one_of(st.text(max_size=4), TRICKY, st.sampled_from("09٣½Ⅻ")), max_size=30)


@given(TEXT)
def test_custom_splits_equal_llamacpp_scanners(parts):
    text = "".join(parts)
    assert regex_split(text, [GPT2_REGEX]) == port_gpt2(text)
    assert regex_split(text, [LLAMA3_REGEX]) == port_llama3(text, 3)
    assert regex_split(text, [QWEN2_REGEX]) == port_llama3(text, 1)


@given(st.text())
def test_byte_encoding_round_trips(text):
    assert byte_decode(byte_encode(text)) == text.encode("utf-8", "surrogatepass")


def test_category_table_agrees_with_unicodedata_where_assigned():
    """llama.cpp's table (Unicode 15.1) and Python's unicodedata agree wherever both assign."""
    import unicodedata

    letter = {"C": "C", "L": "L", "M": "M", "N": "N", "P": "P", "S": "S", "Z": "Z"}
    for cpt in range(0, 0x110000, 7):
        cat = unicodedata.category(chr(cpt))
        if cat != "Cn":
            assert cpt_category(cpt) == letter[cat[0]], hex(cpt)


# ---------------------------------------------------------------------------------------------
# Algorithms and laws
# ---------------------------------------------------------------------------------------------


def test_bpe_merge_follows_ranks_not_order():
    ranks = {("a", "b"): 1, ("b", "c"): 0, ("a", "bc"): 2}
    assert bpe_merge("abc", ranks) == ["abc"]
    assert bpe_merge("abab", {("a", "b"): 0, ("ab", "ab"): 1}) == ["abab"]
    assert bpe_merge("", ranks) == []


def test_clean_spaces_literal_passes():
    assert clean_spaces(b"a ' b") == b"a'b"
    assert clean_spaces(b"a ' ' b") == b"a'' b"
    assert clean_spaces(b"I 'm, you 're, we 'll, it 'd") == b"I'm, you're, we 'll, it 'd"
    assert clean_spaces(b"") == b""


@given(st.text(max_size=60))
def test_smollm_round_trip(smollm, text):
    """SmolLM2 neither adds a prefix space nor cleans spaces: detokenize inverts tokenize.

    (Where every byte has its token: SmolLM2 lacks a few control bytes, which llama.cpp drops.)
    """
    assume(all(c in smollm.token_to_id for c in byte_encode(text)))
    assert smollm.detokenize(smollm.tokenize(text)) == text.encode("utf-8", "surrogatepass").decode(
        "utf-8", "replace"
    )


@given(
    st.lists(
        st.sampled_from(["é", "🙂", "ab", " ", "\n", "日本", "<|im_end|>", "\x80"]), max_size=12
    ),
    st.booleans(),
)
def test_stream_decoder_equals_detokenize(smollm, parts, special):
    ids = smollm.tokenize("".join(parts), parse_special=True)
    # byte tokens of a multibyte character, one byte per token
    ids += [smollm.token_to_id[c] for c in byte_encode("€")]
    dec = StreamDecoder(smollm, special=special)
    chunks = [dec.push(t) for t in ids]
    assert all("\ufffd" not in c for c in chunks)  # never half a character
    assert "".join(chunks) + dec.flush() == smollm.detokenize(ids, unparse_special=special)


@given(
    st.lists(st.sampled_from(["Hello", " ,", " !", " 's", " '", " ' ", ".", "é", " "]), max_size=12)
)
def test_stream_decoder_clean_spaces(gpt2, parts):
    tok = gpt2
    ids = tok.tokenize("".join(parts))
    dec = StreamDecoder(tok)
    assert "".join(dec.push(t) for t in ids) + dec.flush() == tok.detokenize(ids)


def test_stream_decoder_spm_drops_prefix_space(shared_fixtures):
    tok = Tokenizer.from_gguf(shared_fixtures / "llama.cpp-vocab" / "ggml-vocab-llama-spm.gguf")
    ids = tok.tokenize("Hello 🦙 world", add_special=False)
    dec = StreamDecoder(tok)
    out = [dec.push(t) for t in ids]
    assert "".join(out) + dec.flush() == "Hello 🦙 world"
    assert "" in out  # the llama's four byte tokens wait for the last one


def test_special_tokens(smollm):
    assert (smollm.bos_id, smollm.eos_id, smollm.eot_id) == (1, 2, 0)
    assert smollm.tokenize("<|im_end|>", parse_special=True) == [2]
    assert len(smollm.tokenize("<|im_end|>", parse_special=False)) > 1
    assert smollm.is_eog(2) and smollm.is_eog(0) and not smollm.is_eog(1)


def test_chat_template_smollm(smollm):
    text = smollm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm.tokenize(text, parse_special=True)
    assert ids[0] == 1 and smollm.detokenize(ids, unparse_special=True) == text


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_errors(smollm, tmp_path):
    with pytest.raises(TokenizerError, match="out of range"):
        smollm.token_to_piece(smollm.n_vocab)
    with pytest.raises(TokenizerError, match="out of range"):
        smollm.detokenize([-1])
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf(tmp_path)
    base = {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(TokenizerError, match="unknown tokenizer model 'wpm'"):
        Tokenizer.from_metadata({**base, "tokenizer.ggml.model": "wpm"})
    with pytest.raises(TokenizerError, match="unsupported pre-tokenizer 'nope'"):
        Tokenizer.from_metadata(
            {**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "nope"}
        )
    with pytest.raises(TokenizerError, match="does not compile"):
        Tokenizer.from_metadata(
            {**base, "tokenizer.ggml.model": "gpt2", "tokenizer.chat_template": "{% for %}"}
        ).apply_chat_template([])
    refuse = "{{ raise_exception('no system role') }}"
    with pytest.raises(TokenizerError, match="no system role"):
        Tokenizer.from_metadata(
            {**base, "tokenizer.ggml.model": "gpt2", "tokenizer.chat_template": refuse}
        ).apply_chat_template([])
