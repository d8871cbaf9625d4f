"""The tokenizer against the oracles: llama.cpp (llama-cpp-python), ``tokenizers``, transformers.

- SmolLM2 (byte-level BPE, ``smollm`` pre-tokenizer): our ids equal llama.cpp's
  ``llama_tokenize`` on ~300 KB of code, generated Unicode, whitespace runs, digit runs,
  punctuation and special-token strings, with ``add_special`` / ``parse_special`` both ways;
  ``token_to_piece`` equals for every id (special both ways); ``detokenize`` equals
  ``llama_detokenize``; plus a hypothesis property on arbitrary text.
- The same for llama.cpp's SPM and GPT-2 test vocabularies (``../shared``) on the corpus.
- :meth:`Tokenizer.from_hf` on a ``tokenizer.json`` written by ``tokenizers`` equals
  ``tokenizers`` itself.
- Chat templates render exactly as transformers' ``render_jinja_template``.
"""

from __future__ import annotations

import copy
import ctypes
import os
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.model_loader import default_model_path
from reference.tokenizer import ATTR_RSTRIP, Tokenizer

pytestmark = pytest.mark.oracle


class LlamaCppVocab:
    """llama.cpp's vocabulary through llama-cpp-python (``vocab_only``)."""

    def __init__(self, path):
        import llama_cpp

        from llamaref.llamacpp import silence_llama_log

        silence_llama_log()
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        # lone surrogates (a Python str can hold them) as the 3 bytes llama.cpp's lax UTF-8
        # decoder reads back as that codepoint
        data = text.encode("utf-8", "surrogatepass")
        return self.llm.tokenize(data, add_bos=add_special, special=parse_special)

    def token_to_piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, 256, 0, special)
        assert n >= 0
        return buf.raw[:n]

    def detokenize(self, tokens, remove_special=False, unparse_special=False) -> bytes:
        arr = (self.lib.llama_token * len(tokens))(*tokens)
        size = 8 * len(tokens) + 64
        buf = ctypes.create_string_buffer(size)
        n = self.lib.llama_detokenize(
            self.vocab, arr, len(tokens), buf, size, remove_special, unparse_special
        )
        assert n >= 0
        return buf.raw[:n]


def corpus() -> list[str]:
    """~300 KB of varied text, the same on every run."""
    rng = random.Random(1234)
    stdlib = sorted(Path(os.__file__).parent.glob("*.py"))[::6]
    texts, size = [], 0
    for f in stdlib:
        texts.append(f.read_text(encoding="utf-8", errors="replace"))
        size += len(texts[-1])
        if size > 200_000:
            break
    scripts = [
        (0x20, 0x7E),
        (0xA0, 0x24F),
        (0x300, 0x36F),
        (0x370, 0x3FF),
        (0x400, 0x4FF),
        (0x530, 0x58F),
        (0x590, 0x5FF),
        (0x600, 0x6FF),
        (0x900, 0x97F),
        (0x980, 0x9FF),
        (0xE00, 0xE7F),
        (0x10A0, 0x10FF),
        (0x1100, 0x11FF),
        (0x2000, 0x206F),
        (0x2190, 0x22FF),
        (0x2E80, 0x2FFF),
        (0x3000, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0xE000, 0xE0FF),
        (0xFE00, 0xFE0F),
        (0xFF00, 0xFFEF),
        (0x10000, 0x1007F),
        (0x1D400, 0x1D7FF),
        (0x1F300, 0x1FAFF),
        (0x20000, 0x2A6DF),
    ]
    words = []
    for _ in range(6000):
        a, b = rng.choice(scripts)
        words.append("".join(chr(rng.randint(a, b)) for _ in range(rng.randint(1, 6))))
        words.append(rng.choice([" ", "  ", "\n", "\t", "", "'s ", "\u200d", " \n ", "'LL"]))
    texts.append("".join(words))
    spaces = " \t\n\r\x0b\x0c\xa0\u3000\u2009\x1c"
    texts.append(
        "".join(
            rng.choice(spaces) * rng.randint(1, 9) + rng.choice(["a", "1", "!", ""])
            for _ in range(4000)
        )
        + "  \n\t "
    )
    texts.append(
        " ".join(
            "".join(rng.choice("0123456789") for _ in range(n))
            + rng.choice(["", ".5", ",000", "٣٤", "½"])
            for n in range(1, 60)
        )
        * 20
    )
    punct = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~…—«»¿¡"
    texts.append(
        "".join(
            rng.choice(punct) * rng.randint(1, 4) + rng.choice([" ", "", "x"]) for _ in range(5000)
        )
    )
    specials = [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<repo_name>",
        "<|im_start",
        "im_end|>",
        "<<|im_end|>>",
    ]
    texts.append(
        "".join(
            rng.choice(specials) + rng.choice(["user\n", " hi ", "", "\n\n"]) for _ in range(2000)
        )
    )
    return texts


CASES = [(False, False), (True, False), (False, True), (True, True)]


@pytest.fixture(scope="module")
def smollm_pair():
    path = default_model_path()
    return Tokenizer.from_gguf(path), LlamaCppVocab(path)


@pytest.fixture(scope="module")
def texts():
    return corpus()


def test_corpus_size(texts):
    assert sum(len(t) for t in texts) > 280_000


def test_smollm_tokenize_equals_llamacpp(smollm_pair, texts):
    ours, theirs = smollm_pair
    for text in texts:
        cases = CASES if len(text) < 30_000 else [(False, False), (True, True)]
        for add_special, parse_special in cases:
            assert ours.tokenize(text, add_special, parse_special) == theirs.tokenize(
                text, add_special, parse_special
            )


def test_smollm_vocab_facts_equal_llamacpp(smollm_pair):
    ours, theirs = smollm_pair
    lib, v = theirs.lib, theirs.vocab
    assert ours.n_vocab == lib.llama_vocab_n_tokens(v)
    assert (ours.bos_id, ours.eos_id, ours.eot_id) == (
        lib.llama_vocab_bos(v),
        lib.llama_vocab_eos(v),
        lib.llama_vocab_eot(v),
    )
    assert (ours.add_bos, ours.add_eos) == (
        lib.llama_vocab_get_add_bos(v),
        lib.llama_vocab_get_add_eos(v),
    )
    for t in range(ours.n_vocab):
        assert ours.is_eog(t) == lib.llama_vocab_is_eog(v, t)
        assert ours.attrs[t] == lib.llama_vocab_get_attr(v, t)


def test_smollm_token_to_piece_every_id(smollm_pair):
    ours, theirs = smollm_pair
    for t in range(ours.n_vocab):
        for special in (False, True):
            assert ours.token_to_piece(t, special) == theirs.token_to_piece(t, special), t


def test_smollm_detokenize_equals_llamacpp(smollm_pair, texts):
    ours, theirs = smollm_pair
    for text in texts:
        ids = ours.tokenize(text, True, True)
        for remove, unparse in CASES:
            assert ours.detokenize_bytes(ids, remove, unparse) == theirs.detokenize(
                ids, remove, unparse
            )


ANY_TEXT = st.lists(
    st.one_of(
        st.text(st.characters(codec=None, categories=None)),  # surrogates included
        st.sampled_from(["<|im_start|>", "<|im_end|>", "'s", "  \n", "2024", "\u00a0", "\x1c"]),
    ),
    max_size=8,
).map("".join)


@given(ANY_TEXT, st.booleans(), st.booleans())
def test_smollm_property(smollm_pair, text, add_special, parse_special):
    ours, theirs = smollm_pair
    ids = ours.tokenize(text, add_special, parse_special)
    assert ids == theirs.tokenize(text, add_special, parse_special)
    assert ours.detokenize_bytes(ids) == theirs.detokenize(ids)


@pytest.mark.parametrize("name", ["ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"])
def test_fixture_vocabs_equal_llamacpp(shared_fixtures, texts, name):
    path = shared_fixtures / "llama.cpp-vocab" / name
    ours, theirs = Tokenizer.from_gguf(path), LlamaCppVocab(path)
    sample = [t[:4_000] for t in texts]
    for text in sample:
        for add_special, parse_special in CASES[::3]:
            ids = ours.tokenize(text, add_special, parse_special)
            assert ids == theirs.tokenize(text, add_special, parse_special)
        for remove, unparse in CASES:
            assert ours.detokenize_bytes(ids, remove, unparse) == theirs.detokenize(
                ids, remove, unparse
            )
    for t in range(0, ours.n_vocab, 13):
        assert ours.token_to_piece(t, True) == theirs.token_to_piece(t, True)
        assert ours.token_to_piece(t, False) == theirs.token_to_piece(t, False)


# ---------------------------------------------------------------------------------------------
# The HF path
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, smollm_pair):
    """A byte-level BPE ``tokenizer.json`` built from SmolLM2's vocabulary by ``tokenizers``."""
    import json

    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    ours, _ = smollm_pair
    vocab = {t: i for i, t in enumerate(ours.tokens)}
    merges = sorted(ours.ranks, key=ours.ranks.get)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(ours.tokens[i], special=True) for i in range(17)])
    folder = tmp_path_factory.mktemp("hf")
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": ours.chat_template,
            }
        )
    )
    return folder, hf


def test_from_hf_equals_tokenizers(hf_folder, texts):
    folder, hf = hf_folder
    tok = Tokenizer.from_hf(folder)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    for text in [t[:8_000] for t in texts]:
        for parse_special in (False, True):
            hf.encode_special_tokens = not parse_special
            expected = hf.encode(text, add_special_tokens=False).ids
            assert tok.tokenize(text, add_special=False, parse_special=parse_special) == expected
        assert tok.detokenize(expected, unparse_special=True) == hf.decode(
            expected, skip_special_tokens=False
        )


def test_from_hf_pieces_equal_gguf(hf_folder, smollm_pair):
    folder, _ = hf_folder
    tok, ours = Tokenizer.from_hf(folder), smollm_pair[0]
    for t in range(0, ours.n_vocab, 3):
        assert tok.token_to_piece(t, True) == ours.token_to_piece(t, True)


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set system = messages[0]['content'] -%}
    {%- set messages = messages[1:] -%}
{%- endif -%}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('roles must alternate user/assistant') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + (('<<SYS>>\n' + system + '\n<</SYS>>\n\n') if loop.first and system
                        is defined else '') + message['content'] | trim + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'] | trim + ' ' + eos_token }}
    {% endif %}
{% endfor %}"""
TOOLS = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{{ m | tojson }}\n{% if loop.last %}{% break %}{% endif %}{% endfor %}"
    "count={{ ns.n }}{{ dict(a=1) | tojson }}"
)
MESSAGES = [
    {"role": "system", "content": 'Be brief. <b>&</b> "quoted" é'},
    {"role": "user", "content": "  What is 2+2?  "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3? 🙂"},
]


@pytest.mark.parametrize("name", ["smollm2", "chatml", "llama2", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_equals_transformers(smollm_pair, name, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = smollm_pair[0]
    template = {"smollm2": ours.chat_template, "chatml": CHATML, "llama2": LLAMA2, "tools": TOOLS}[
        name
    ]
    tok = copy.copy(ours)
    tok.chat_template = template
    for messages in (MESSAGES, MESSAGES[1:], MESSAGES[1:2]):
        rendered, _ = render_jinja_template(
            [messages],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            unk_token="<|endoftext|>",
            pad_token="<|im_end|>",
        )
        assert tok.apply_chat_template(messages, add_generation_prompt) == rendered[0]


# ---------------------------------------------------------------------------------------------
# Other pre-tokenizers: SmolLM2's vocabulary under another ``tokenizer.ggml.pre``
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_metadata():
    from reference.gguf import GGUFValue, GGUFValueType, read_gguf

    gguf = read_gguf(default_model_path())
    return {
        k: v if gguf.value_types[k] == GGUFValueType.ARRAY else GGUFValue(v, gguf.value_types[k])
        for k, v in gguf.metadata.items()
    }


@pytest.mark.parametrize("pre", ["default", "gpt-2", "llama-bpe", "qwen2", "falcon"])
def test_pre_tokenizers_equal_llamacpp(tmp_path, smollm_metadata, texts, pre):
    """The same vocabulary split by each pre-tokenizer: ids and detokenized bytes agree."""
    from reference.gguf import write_gguf

    metadata = {**smollm_metadata, "tokenizer.ggml.pre": pre}
    del metadata["tokenizer.ggml.add_bos_token"]  # llama-bpe defaults to add_bos = True
    path = tmp_path / f"vocab-{pre}.gguf"
    write_gguf(path, metadata, {})
    ours = Tokenizer.from_metadata({k: getattr(v, "value", v) for k, v in metadata.items()})
    theirs = LlamaCppVocab(path)
    assert ours.add_bos == theirs.lib.llama_vocab_get_add_bos(theirs.vocab) == (pre == "llama-bpe")
    for text in [t[:5_000] for t in texts]:
        for add_special, parse_special in CASES[::3]:
            ids = ours.tokenize(text, add_special, parse_special)
            assert ids == theirs.tokenize(text, add_special, parse_special)
        assert ours.detokenize_bytes(ids) == theirs.detokenize(ids)


def test_rstrip_tokens_equal_llamacpp(tmp_path, smollm_metadata, texts):
    """llama.cpp gives every special token RSTRIP when ``general.name`` says Phi-3."""
    from reference.gguf import write_gguf

    tokens = list(smollm_metadata["tokenizer.ggml.tokens"])
    tokens[5:8] = ["<unk>", "<s>", "</s>"]  # llama.cpp needs these in a Phi-3 vocabulary
    metadata = {
        **smollm_metadata,
        "general.name": "Phi-3 look-alike",
        "tokenizer.ggml.tokens": tokens,
    }
    path = tmp_path / "vocab-phi3.gguf"
    write_gguf(path, metadata, {})
    ours = Tokenizer.from_metadata({k: getattr(v, "value", v) for k, v in metadata.items()})
    theirs = LlamaCppVocab(path)
    assert ours.attrs == [
        theirs.lib.llama_vocab_get_attr(theirs.vocab, t) for t in range(ours.n_vocab)
    ]
    assert ours.attrs[7] & ATTR_RSTRIP and ours.eog_ids == {0, 2, 4, 7}
    text = texts[-1][:20_000] + " <|im_end|> \n\t x</s>  y<s>\n"
    for parse_special in (False, True):
        assert ours.tokenize(text, False, parse_special) == theirs.tokenize(
            text, False, parse_special
        )


def test_from_hf_sentencepiece_pieces(tmp_path, shared_fixtures):
    """A SentencePiece-style ``tokenizer.json`` (Unigram, byte fallback, ``▁``) built from
    llama.cpp's SPM test vocabulary: ids are the ``tokenizers`` package's, pieces and BOS as
    llama.cpp gives them for the GGUF."""
    import json

    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    gguf = Tokenizer.from_gguf(shared_fixtures / "llama.cpp-vocab" / "ggml-vocab-llama-spm.gguf")
    unigram = models.Unigram(list(zip(gguf.tokens, gguf.scores, strict=True)), 0, True)
    hf = HFTokenizer(unigram)
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    hf.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf(tmp_path)
    assert (tok.model, tok.bos_id, tok.eos_id, tok.add_bos) == ("hf-spm", 1, 2, True)
    for t in range(gguf.n_vocab):
        assert tok.token_to_piece(t, special=True) == gguf.token_to_piece(t, special=True)
    text = "Hello wörld 🦙 </s> 12345"
    ids = tok.tokenize(text, add_special=True, parse_special=True)
    assert ids == [1, *hf.encode(text, add_special_tokens=False).ids]
    assert tok.detokenize(ids) == hf.decode(ids)
