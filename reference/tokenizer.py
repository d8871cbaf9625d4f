r"""Tokenizers: text to token ids and back, as llama.cpp's ``llama_vocab`` does it.

This module mirrors ``src/llama-vocab.cpp`` at the pinned commit for the two vocabulary types
that nearly every GGUF model uses:

- **SPM** (``tokenizer.ggml.model == "llama"``, SentencePiece-style; Llama 1/2, Mistral,
  stories260K). Spaces are written ``▁`` (U+2581), a space is put in front of the text
  (``add_space_prefix``), and the text is cut into characters that are then merged pairwise,
  always the adjacent pair whose merged string is the vocabulary entry with the **highest
  score** (ties: the leftmost). A character that is not in the vocabulary becomes its UTF-8
  bytes as ``<0xXX>`` tokens (*byte fallback*).
- **Byte-level BPE** (``"gpt2"``; GPT-2, Llama 3, Qwen2, SmolLM2). A *pre-tokenizer* first
  cuts the text into words with regular expressions ([`reference.unicode`][reference.unicode]); each
  word's UTF-8 bytes are spelled with GPT-2's 256-character alphabet (a space is ``Ġ``), and inside
  each word the adjacent pair with the **lowest merge rank** is merged until none is left.

Before either runs, [`Tokenizer.tokenize`][] cuts the text at special tokens
(``tokenizer_st_partition``): with ``parse_special=True`` the text ``<|im_start|>`` becomes
that one control token; user-defined tokens are always cut out. ``add_special`` then puts BOS
in front (and EOS at the end) when the model asks for it (``tokenizer.ggml.add_bos_token``).

Back from ids to text, [`Tokenizer.token_to_piece`][] gives each token's bytes (control
tokens only when ``special=True``), and [`Tokenizer.detokenize`][] concatenates them, drops
the prefix space SPM added, and for some BPE vocabularies "cleans" spaces before punctuation
(``clean_spaces``). A piece may be part of a UTF-8 character (byte tokens, or byte-level BPE
tokens that split a character), so streaming output goes through [`StreamDecoder`][].

Where llama.cpp's result depends on ``std::unordered_map`` iteration order (which of several
end-of-turn texts becomes ``eot_id``), we take the lowest id; ``std::sort`` of the special
tokens by length is not stable in llama.cpp, ours is (ties by id).
"""

from __future__ import annotations

import codecs
import heapq
import json
import operator
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from reference.chat_template import ChatTemplateError, render_chat_template
from reference.common import LlamarefError
from reference.gguf import GGUFError, read_gguf
from reference.unicode import (
    GPT2_REGEX,
    LLAMA3_REGEX,
    QWEN2_REGEX,
    byte_decode,
    byte_encode,
    regex_split,
)


class TokenizerError(LlamarefError, ValueError):
    """A vocabulary, a request or a chat template that the tokenizer cannot handle.

    The message says what was wrong: an unknown tokenizer model or pre-tokenizer, a token id
    out of range, a missing file or key, a template that does not render.
    """


# llama_token_attr (include/llama.h)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_NORMALIZED = 1 << 6
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
ATTR_SINGLE_WORD = 1 << 9

# tokenizer.ggml.token_type (llama_token_type) -> attribute
TOKEN_TYPE_ATTR = {
    0: ATTR_UNDEFINED,
    1: ATTR_NORMAL,
    2: ATTR_UNKNOWN,
    3: ATTR_CONTROL,
    4: ATTR_USER_DEFINED,
    5: ATTR_UNUSED,
    6: ATTR_BYTE,
}

SPM_SPACE = "\u2581"  # ▁, how SentencePiece writes a space

# --8<-- [start:PRE_TOKENIZERS]
_SMOLLM = (r"\p{N}", GPT2_REGEX)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, "[0-9][0-9][0-9]")

#: ``tokenizer.ggml.pre`` -> (expressions, clean_spaces, ignore_merges, add_bos default), from
#: ``llm_tokenizer_bpe``'s constructor and ``llama_vocab::impl::load``.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool, bool]] = {
    "default": (_DEFAULT, True, False, False),
    **{
        name: ((LLAMA3_REGEX,), True, True, True)
        for name in (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        )
    },
    **{name: ((LLAMA3_REGEX,), True, False, False) for name in ("dbrx", "smaug-bpe")},
    "falcon": (_FALCON, True, False, False),
    **{
        name: ((GPT2_REGEX,), True, False, False)
        for name in (
            "gpt-2",
            "phi-2",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
        )
    },
    **{name: ((GPT2_REGEX,), False, False, False) for name in ("trillion", "granite-docling")},
    **{
        name: (_SMOLLM, True, False, False)
        for name in ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2")
    },
    **{name: (_SMOLLM, False, False, False) for name in ("smollm", "command-r")},
    **{
        name: ((QWEN2_REGEX,), False, False, False)
        for name in (
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "hunyuan",
            "grok-2",
            "solar-open",
        )
    },
    **{name: ((QWEN2_REGEX,), True, False, False) for name in ("stablelm2", "megrez")},
}
# --8<-- [end:PRE_TOKENIZERS]

# Texts llama.cpp recognises when the GGUF does not name the token (llama_vocab::impl::load).
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)
_SPECIAL_ID_KEYS = (
    "bos",
    "eos",
    "eot",
    "eom",
    "unk",
    "sep",
    "pad",
    "mask",
    "fim_pre",
    "fim_suf",
    "fim_mid",
    "fim_pad",
    "fim_rep",
    "fim_sep",
)
_SPECIAL_ID_GGUF = {name: f"tokenizer.ggml.{name}_token_id" for name in _SPECIAL_ID_KEYS}
_SPECIAL_ID_GGUF.update(
    unk="tokenizer.ggml.unknown_token_id",
    sep="tokenizer.ggml.seperator_token_id",
    pad="tokenizer.ggml.padding_token_id",
)
_SPECIAL_ID_DEPRECATED = {
    "fim_pre": "tokenizer.ggml.prefix_token_id",
    "fim_suf": "tokenizer.ggml.suffix_token_id",
    "fim_mid": "tokenizer.ggml.middle_token_id",
}


# ---------------------------------------------------------------------------------------------
# The two algorithms
# ---------------------------------------------------------------------------------------------


# --8<-- [start:spm_tokenize]
def spm_tokenize(
    text: str, token_to_id: dict[str, int], scores: list[float], byte_token: list[int | None]
) -> list[int]:
    """SentencePiece-style merges by score (``llm_tokenizer_spm_session::tokenize``).

    The text (spaces already written ``▁``) starts as one symbol per character. A heap holds
    every adjacent pair whose concatenation is a token, keyed by that token's score (highest
    first, then leftmost). Popping a pair merges it if both symbols are still what they were
    when it was pushed; the new symbol's two new pairs are pushed. Finally every symbol is its
    token, or (a character with no token) its UTF-8 bytes as ``<0xXX>`` tokens.

    Args:
        text: the text to encode, spaces as ``▁``.
        token_to_id: vocabulary text -> id.
        scores: score of each id.
        byte_token: id of ``<0xXX>`` for each byte value (None when missing).

    Returns:
        The token ids.

    Raises:
        TokenizerError: a character needs byte fallback and the vocabulary lacks the byte token.

    Examples:
        >>> vocab = {"▁": 0, "a": 1, "b": 2, "▁a": 3, "ab": 4, "▁ab": 5}
        >>> spm_tokenize("▁ab", vocab, [0, 0, 0, -1.0, -2.0, -3.0], [None] * 256)
        [5]
    """
    n = len(text)
    start = list(range(n))
    size = [1] * n
    prev = list(range(-1, n - 1))
    nxt = [*range(1, n), -1]
    heap: list[tuple[float, int, int, int]] = []

    def try_add_bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        piece = text[start[left] : start[left] + size[left] + size[right]]
        token = token_to_id.get(piece)
        if token is not None:
            heapq.heappush(heap, (-scores[token], left, right, len(piece)))

    for i in range(1, n):
        try_add_bigram(i - 1, i)
    while heap:
        _, left, right, length = heapq.heappop(heap)
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
            continue  # one of the two was merged since this pair was pushed
        size[left] += size[right]  # merge right into left
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add_bigram(prev[left], left)
        try_add_bigram(left, nxt[left])

    out: list[int] = []
    i = 0 if n else -1
    while i != -1:
        piece = text[start[i] : start[i] + size[i]]
        token = token_to_id.get(piece)
        if token is not None:
            out.append(token)
        else:  # byte fallback: every merged symbol is a token, so this is one character
            for b in piece.encode("utf-8", "surrogatepass"):
                if byte_token[b] is None:
                    raise TokenizerError(f"no byte token <0x{b:02X}> for {piece!r}")
                out.append(byte_token[b])
        i = nxt[i]
    return out


# --8<-- [end:spm_tokenize]


# --8<-- [start:bpe_merge]
def bpe_merge(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-level BPE inside one word (``llm_tokenizer_bpe_session::tokenize``).

    The word (already in GPT-2's byte alphabet) starts as one symbol per character; a heap
    holds every adjacent pair that is a merge, keyed by (rank, left position). A popped pair
    is merged if its two symbols still spell what they spelled when it was pushed.

    Args:
        word: one pre-tokenized word, byte-encoded.
        ranks: (left, right) -> rank (line number in ``tokenizer.ggml.merges``).

    Returns:
        The final symbols' texts, in order.

    Examples:
        >>> bpe_merge("Ġlower", {("Ġ", "l"): 0, ("o", "w"): 1, ("Ġl", "ow"): 2, ("e", "r"): 3})
        ['Ġlow', 'er']
    """
    n = len(word)
    start = list(range(n))
    size = [1] * n
    prev = list(range(-1, n - 1))
    nxt = [*range(1, n), -1]
    heap: list[tuple[int, int, int, str]] = []

    def add_bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        a = word[start[left] : start[left] + size[left]]
        b = word[start[right] : start[right] + size[right]]
        rank = ranks.get((a, b))
        if rank is not None:
            heapq.heappush(heap, (rank, left, right, a + b))

    for i in range(1, n):
        add_bigram(i - 1, i)
    while heap:
        _, left, right, text = heapq.heappop(heap)
        if size[left] == 0 or size[right] == 0:
            continue
        if word[start[left] : start[left] + size[left] + size[right]] != text or (
            nxt[left] != right
        ):
            continue  # outdated: one side changed since the pair was pushed
        size[left] += size[right]
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add_bigram(prev[left], left)
        add_bigram(left, nxt[left])
    return [word[start[i] : start[i] + size[i]] for i in range(n) if size[i] > 0]


# --8<-- [end:bpe_merge]


# --8<-- [start:clean_spaces]
def clean_spaces(text: bytes) -> bytes:
    """``detokenize``'s three in-place passes for ``clean_spaces`` vocabularies, byte for byte.

    1. drop a space before ``?``, ``!``, ``.``, ``,``;
    2. ``" ' "`` loses both spaces;
    3. drop the space before ``'s``, ``'m``, ``'re``, ``'ve``.

    Args:
        text: the concatenated pieces.

    Returns:
        The cleaned bytes.

    Examples:
        >>> clean_spaces(b"Hello , world ! it 's a ' b")
        b"Hello, world! it's a'b"
    """
    t = bytearray(text)
    # first pass: " ?", " !", " .", " ,"
    total1, total = len(t), 1 if t else 0
    for i in range(1, total1):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    # second pass: " ' "
    total2, total = total, 1 if total else 0
    i = 1
    while i < total2:
        x = t[i]
        if x == 0x27 and i + 1 < total2 and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    # third pass: " 's", " 'm", " 're", " 've"
    total3, total = total, 1 if total else 0
    for i in range(1, total3):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < total3:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < total3:
                if (x1, t[i + 2]) in ((0x72, 0x65), (0x76, 0x65)):  # re, ve
                    total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])


# --8<-- [end:clean_spaces]


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


# --8<-- [start:Tokenizer]
class Tokenizer:
    """A vocabulary and the llama.cpp semantics of ``llama_tokenize`` & co.

    Build one with [`from_gguf`][], [`from_hf`][] or [`load_tokenizer`][].

    Attributes:
        n_vocab: number of tokens.
        bos_id, eos_id, eot_id: special ids (None when the vocabulary has none).
        add_bos, add_eos: whether ``tokenize(add_special=True)`` adds them.
        chat_template: the Jinja chat template, if the model ships one.
        model: ``"llama"`` (SPM), ``"gpt2"`` (byte-level BPE), ``"hf-bpe"`` or ``"hf-spm"``
            ([`from_hf`][]: encoded by the ``tokenizers`` package).
        pre: the pre-tokenizer name (``tokenizer.ggml.pre``) for BPE.
        tokens: text of every token; ``attrs``: its ``ATTR_*`` bits.

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> tok = load_tokenizer(default_model_path())  # SmolLM2: byte-level BPE, smollm
        >>> tok.model, tok.pre, tok.n_vocab, tok.tokenize("Hello world")
        ('gpt2', 'smollm', 49152, [19556, 905])
        >>> tok.detokenize([19556, 905])
        'Hello world'
    """

    def __init__(self) -> None:
        self.model = ""
        self.pre = ""
        self.tokens: list[str] = []
        self.scores: list[float] = []
        self.attrs: list[int] = []
        self.token_to_id: dict[str, int] = {}
        self.ranks: dict[tuple[str, str], int] = {}
        self.regexes: tuple[str, ...] = ()
        self.add_space_prefix = False
        self.add_bos = False
        self.add_eos = False
        self.clean_spaces = False
        self.ignore_merges = False
        self.special: dict[str, int | None] = {}
        self.eog_ids: set[int] = set()
        self.special_cache: list[int] = []
        self.chat_template: str | None = None
        self._pieces: list[bytes] = []
        self._byte_token: list[int | None] = [None] * 256
        self._word_cache: dict[str, tuple[int, ...]] = {}
        self._hf: Any = None

    # -- ids ----------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.special.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self.special.get("eos")

    @property
    def eot_id(self) -> int | None:
        return self.special.get("eot")

    def _check_id(self, token: int) -> None:
        try:
            token = operator.index(token)
        except TypeError:
            raise TokenizerError(f"token id must be an integer, got {token!r}") from None
        if not 0 <= token < self.n_vocab:
            raise TokenizerError(f"token id {token} out of range [0, {self.n_vocab})")

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Load the vocabulary of a GGUF file (``llama_vocab::impl::load``).

        Args:
            path: a ``.gguf`` file.

        Returns:
            The tokenizer.

        Raises:
            TokenizerError: missing file or keys, unknown ``tokenizer.ggml.model``, unknown
                ``tokenizer.ggml.pre``, malformed GGUF.

        Examples:
            >>> from reference.model_loader import default_model_path
            >>> tok = Tokenizer.from_gguf(default_model_path())
            >>> tok.model, tok.pre, tok.n_vocab, tok.add_bos
            ('gpt2', 'smollm', 49152, False)
        """
        p = Path(path)
        if not p.is_file():
            raise TokenizerError(f"GGUF file not found: {path}")
        stat = p.stat()
        return cls.from_metadata(
            _tokenizer_metadata(str(p.resolve()), stat.st_mtime_ns, stat.st_size)
        )

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (a dict as
        [`reference.gguf.read_gguf`][reference.gguf.read_gguf] gives).

        Raises:
            TokenizerError: as [`from_gguf`][].
        """
        tok = cls()
        tok._load_type(md)
        tok._load_tokens(md)
        tok._load_special_ids(md)
        tok._detect_special_texts()
        tok._finish(md.get("general.name", ""))
        tok.chat_template = md.get("tokenizer.chat_template")
        return tok

    def _load_type(self, md: dict[str, Any]) -> None:
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("'tokenizer.ggml.model' is missing from the GGUF metadata")
        pre = md.get("tokenizer.ggml.pre", "") or ""
        if model == "llama":
            self.special = dict(bos=1, eos=2, unk=0)
            self.add_space_prefix, self.add_bos = True, True
        elif model == "gpt2":
            if "tokenizer.ggml.merges" not in md:
                raise TokenizerError("byte-level BPE vocabulary without 'tokenizer.ggml.merges'")
            name = pre or "default"
            if name not in PRE_TOKENIZERS:
                raise TokenizerError(
                    f"unsupported pre-tokenizer {pre!r} ('tokenizer.ggml.pre'); supported: "
                    + ", ".join(sorted(PRE_TOKENIZERS))
                )
            self.regexes, self.clean_spaces, self.ignore_merges, self.add_bos = PRE_TOKENIZERS[name]
            self.special = dict(bos=11, eos=11)
            for i, merge in enumerate(md["tokenizer.ggml.merges"]):
                cut = merge.find(" ", 1)
                pair = (merge[:cut], merge[cut + 1 :]) if cut != -1 else ("", "")
                self.ranks.setdefault(pair, i)  # emplace: the first occurrence wins
        else:
            raise TokenizerError(
                f"unknown tokenizer model {model!r} ('tokenizer.ggml.model'); "
                "supported: 'llama' (SPM), 'gpt2' (byte-level BPE)"
            )
        self.model, self.pre = model, pre
        self.add_space_prefix = bool(
            md.get("tokenizer.ggml.add_space_prefix", self.add_space_prefix)
        )

    def _load_tokens(self, md: dict[str, Any]) -> None:
        tokens = md.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise TokenizerError("'tokenizer.ggml.tokens' is missing from the GGUF metadata")
        n = len(tokens)
        scores = md.get("tokenizer.ggml.scores")
        types = md.get("tokenizer.ggml.token_type")
        for key, arr in (("scores", scores), ("token_type", types)):
            if arr is not None and len(arr) < n:
                raise TokenizerError(f"'tokenizer.ggml.{key}' has {len(arr)} < {n} entries")
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.scores = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
        self.attrs = (
            [TOKEN_TYPE_ATTR.get(int(t), ATTR_UNDEFINED) for t in types[:n]]
            if types is not None
            else [ATTR_NORMAL] * n
        )
        self.token_to_id = {t: i for i, t in enumerate(self.tokens)}
        if len(self.token_to_id) != n:
            raise TokenizerError("the vocabulary has duplicate token texts")

    def _load_special_ids(self, md: dict[str, Any]) -> None:
        n = self.n_vocab
        ids = {name: self.special.get(name) for name in _SPECIAL_ID_KEYS}
        for name, value in list(ids.items()):
            if value is not None and value >= n:
                ids[name] = None  # a default out of range is disabled
        keys = [*_SPECIAL_ID_GGUF.items(), *_SPECIAL_ID_DEPRECATED.items()]
        for name, key in keys:
            value = md.get(key)
            if value is not None and 0 <= int(value) < n:
                ids[name] = int(value)
        self.special = ids
        self.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", self.add_bos))
        self.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", self.add_eos))

    def _mark_control(self, token: int) -> None:
        self.attrs[token] |= ATTR_CONTROL

    def _detect_special_texts(self) -> None:
        """EOT/EOM/FIM ids by text, UNUSED marks and the EOG set, as ``load`` does."""
        by_text = self.token_to_id
        for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
            if self.special.get(name) is None:
                found = sorted(by_text[t] for t in texts if t in by_text)
                if found:  # llama.cpp: the first in unordered_map order; we: the lowest id
                    self.special[name] = found[0]
                    self._mark_control(found[0])
        for i, text in enumerate(self.tokens):
            if self.attrs[i] & ATTR_CONTROL and "unused" in text:
                self.attrs[i] |= ATTR_UNUSED
        eog = {self.special.get(k) for k in ("fim_pad", "fim_rep", "fim_sep")} - {None}
        for text in _EOG_TEXTS:
            if text in by_text:
                eog.add(by_text[text])
                self._mark_control(by_text[text])
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            if text in by_text:
                self.attrs[by_text[text]] = ATTR_USER_DEFINED
        eog |= {self.special.get(k) for k in ("eos", "eot", "eom")} - {None}
        texts = {self.tokens[t]: t for t in eog}
        if "<|end|>" in texts and (
            ("<|return|>" in texts and "<|call|>" in texts)
            or ("<|calls|>" in texts and "<|flush|>" in texts)
        ):
            eog.discard(texts["<|end|>"])
            self.attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            self.attrs[texts["</s>"]] = ATTR_NORMAL
        self.eog_ids = eog

    def _finish(self, model_name: str = "") -> None:
        """Special-token cache, byte tokens, piece cache, per-model attributes."""
        special_attrs = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        cache = [i for i, a in enumerate(self.attrs) if a & special_attrs]
        self.special_cache = sorted(cache, key=lambda i: -len(self.tokens[i].encode()))
        for b in range(256):
            self._byte_token[b] = self.token_to_id.get(f"<0x{b:02X}>")
            if self._byte_token[b] is None and self.model == "llama":
                self._byte_token[b] = self.token_to_id.get(chr(b)) if b < 128 else None
        self._pieces = [self._piece_uncached(i) for i in range(self.n_vocab)]
        if "phi-3" in model_name.lower() or "phi3" in model_name.lower():
            self._phi3_attrs()

    def _phi3_attrs(self) -> None:
        """llama.cpp's Phi-3 attributes: special tokens eat the whitespace on their right."""
        for i in self.special_cache:
            self.attrs[i] |= ATTR_RSTRIP
        for text, on in (
            ("</s>", True),
            ("<unk>", False),
            ("<s>", False),
            ("<|endoftext|>", False),
        ):
            if text not in self.token_to_id:  # llama.cpp: token_to_id.at() throws
                raise TokenizerError(f"a Phi-3 vocabulary without the token {text!r}")
            i = self.token_to_id[text]
            self.attrs[i] = self.attrs[i] | ATTR_RSTRIP if on else self.attrs[i] & ~ATTR_RSTRIP

    @classmethod
    def from_hf(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load a HF tokenizer folder: ``tokenizer.json`` (+ ``tokenizer_config.json``).

        Text is encoded by the ``tokenizers`` package itself (``parse_special=False`` sets its
        ``encode_special_tokens``); BOS/EOS, their ``add_*`` flags and the chat template come
        from ``tokenizer_config.json``. Pieces are byte-level (a ``ByteLevel`` decoder) or
        SentencePiece-style (``▁`` and ``<0xXX>``).

        Args:
            directory: the folder.

        Returns:
            The tokenizer.

        Raises:
            TokenizerError: ``tokenizer.json`` missing or unreadable.
        """
        import tokenizers

        folder = Path(directory)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path} not found")
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
            spec = json.loads(path.read_text(encoding="utf-8"))
        except Exception as e:  # noqa: BLE001 - the package raises plain Exceptions
            raise TokenizerError(f"cannot read {path}: {e}") from None
        config_path = folder / "tokenizer_config.json"
        config = (
            json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        )
        tok = cls()
        tok._hf = hf
        tok.model = "hf"
        vocab = hf.get_vocab(with_added_tokens=True)
        tok.tokens = [""] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            tok.tokens[i] = text
        tok.token_to_id = {t: i for i, t in enumerate(tok.tokens)}
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        tok.attrs = [ATTR_NORMAL] * tok.n_vocab
        for i, text in enumerate(tok.tokens):
            if not byte_level and len(text) == 6 and text.startswith("<0x") and text[-1] == ">":
                tok.attrs[i] = ATTR_BYTE
        for added in spec.get("added_tokens", []):
            tok.attrs[added["id"]] = ATTR_CONTROL if added.get("special") else ATTR_USER_DEFINED
        tok.model = "hf-bpe" if byte_level else "hf-spm"
        tok.special = {
            name: _config_token(config, f"{name}_token", tok.token_to_id)
            for name in ("bos", "eos", "unk", "pad")
        }
        tok.add_bos = bool(config.get("add_bos_token", False))
        tok.add_eos = bool(config.get("add_eos_token", False))
        tok._detect_special_texts()
        tok._finish()
        tok.chat_template = config.get("chat_template")
        if isinstance(tok.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in tok.chat_template}
            tok.chat_template = named.get("default")
        jinja = folder / "chat_template.jinja"
        if tok.chat_template is None and jinja.is_file():
            tok.chat_template = jinja.read_text(encoding="utf-8")
        return tok

    # -- text to ids --------------------------------------------------------------------------
    # --8<-- [start:partition]
    def partition(self, text: str, parse_special: bool) -> list[str | int]:
        r"""Cut text at special tokens (``tokenizer_st_partition``).

        Special tokens are tried longest first; each one is cut out of every text fragment,
        left to right. Control and unknown tokens only when ``parse_special``; user-defined
        ones always. ``LSTRIP`` / ``RSTRIP`` tokens also eat the whitespace (C ``isspace``)
        on that side.

        Args:
            text: the text.
            parse_special: whether control tokens written in the text are tokens.

        Returns:
            Text fragments (``str``) and token ids (``int``), in order.

        Examples:
            >>> from reference.model_loader import default_model_path
            >>> tok = Tokenizer.from_gguf(default_model_path())
            >>> tok.partition("<|im_start|>user\nhi<|im_end|>", parse_special=True)
            [1, 'user\nhi', 2]
            >>> tok.partition("<|im_start|>user", parse_special=False)
            ['<|im_start|>user']
        """
        fragments: list[str | int] = [text] if text else []
        for special_id in self.special_cache:
            attr = self.attrs[special_id]
            if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue
            needle = self.tokens[special_id]
            out: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or needle not in fragment:
                    out.append(fragment)
                    continue
                out += _split_on(fragment, needle, special_id, attr)
            fragments = out
        return fragments

    # --8<-- [end:partition]

    # --8<-- [start:tokenize]
    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Text to token ids, as ``llama_tokenize(vocab, text, ..., add_special, parse_special)``.

        Args:
            text: the text.
            add_special: add BOS (and EOS) if the vocabulary asks for them (``add_bos``,
                ``add_eos``).
            parse_special: turn control-token texts (``<|im_start|>``) into those tokens.

        Returns:
            The ids.

        Raises:
            TokenizerError: BOS/EOS needed but undefined; a byte token is missing.

        Examples:
            >>> from reference.model_loader import default_model_path
            >>> tok = Tokenizer.from_gguf(default_model_path())
            >>> tok.tokenize("Hello world!")
            [19556, 905, 17]
            >>> tok.tokenize("<|im_start|>hi", parse_special=True)
            [1, 6004]
        """
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a str, got {type(text).__name__}")
        if add_special and self.add_bos and self.bos_id is None:
            raise TokenizerError("add_bos is set but the vocabulary has no BOS token")
        if add_special and self.add_eos and self.eos_id is None:
            raise TokenizerError("add_eos is set but the vocabulary has no EOS token")
        out: list[int] = [self.bos_id] if add_special and self.add_bos else []
        if self._hf is not None:
            self._hf.encode_special_tokens = not parse_special
            out += self._hf.encode(text, add_special_tokens=False).ids
        else:
            prev_special = True  # SPM: a space in front of the first fragment
            for fragment in self.partition(text, parse_special):
                if isinstance(fragment, int):
                    out.append(fragment)
                    prev_special = True
                elif self.model == "llama":
                    prefix = " " if self.add_space_prefix and prev_special else ""
                    out += spm_tokenize(
                        (prefix + fragment).replace(" ", SPM_SPACE),
                        self.token_to_id,
                        self.scores,
                        self._byte_token,
                    )
                    prev_special = False
                else:
                    out += self._bpe_fragment(fragment)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    # --8<-- [end:tokenize]

    def _bpe_fragment(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._word_cache
        for word in regex_split(text, self.regexes):
            ids = cache.get(word)
            if ids is None:
                ids = cache[word] = tuple(self._bpe_word(byte_encode(word)))
            out += ids
        return out

    def _bpe_word(self, word: str) -> list[int]:
        if self.ignore_merges and word in self.token_to_id:
            return [self.token_to_id[word]]
        out: list[int] = []
        for symbol in bpe_merge(word, self.ranks):
            token = self.token_to_id.get(symbol)
            if token is not None:
                out.append(token)
                continue
            for b in symbol.encode("utf-8"):  # llama.cpp: each raw byte as a one-byte text
                if b < 0x80 and chr(b) in self.token_to_id:
                    out.append(self.token_to_id[chr(b)])
        return out

    # -- ids to text --------------------------------------------------------------------------
    def _piece_uncached(self, token: int) -> bytes:
        """``token_to_piece`` with ``special=True``, before the cache (empty for other types)."""
        text, attr = self.tokens[token], self.attrs[token]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogatepass")
        if attr & ATTR_NORMAL:
            if self.model in ("gpt2", "hf-bpe"):
                return byte_decode(text)
            return text.replace(SPM_SPACE, " ").encode("utf-8", "surrogatepass")
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""

    # --8<-- [start:token_to_piece]
    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (``llama_token_to_piece`` with ``lstrip=0``).

        Args:
            token: the id.
            special: render control and unknown tokens (otherwise they are empty).

        Returns:
            The bytes (possibly part of a UTF-8 character).

        Raises:
            TokenizerError: the id is out of range.

        Examples:
            >>> from reference.model_loader import default_model_path
            >>> tok = Tokenizer.from_gguf(default_model_path())
            >>> tok.token_to_piece(905), tok.token_to_piece(2), tok.token_to_piece(2, special=True)
            (b' world', b'', b'<|im_end|>')
        """
        self._check_id(token)
        if not special and self.attrs[token] & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        return self._pieces[token]

    # --8<-- [end:token_to_piece]

    # --8<-- [start:detokenize]
    def detokenize_bytes(
        self, tokens, remove_special: bool = False, unparse_special: bool = False
    ) -> bytes:
        """The bytes of [`detokenize`][] (``llama_detokenize``), before UTF-8 decoding."""
        tokens = list(tokens)
        for t in tokens:
            self._check_id(t)
        remove_space = self.add_space_prefix  # the space SPM put in front
        if remove_special and self.add_bos and tokens and tokens[0] == self.bos_id:
            remove_space = False
            tokens = tokens[1:]
        if remove_special and self.add_eos and tokens and tokens[-1] == self.eos_id:
            tokens = tokens[:-1]
        out = bytearray()
        for t in tokens:
            piece = self.token_to_piece(t, special=unparse_special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            out += piece
        return clean_spaces(bytes(out)) if self.clean_spaces else bytes(out)

    def detokenize(
        self, tokens: Iterable[int], remove_special: bool = False, unparse_special: bool = False
    ) -> str:
        """Token ids to text (``llama_detokenize``), invalid UTF-8 replaced by U+FFFD.

        Args:
            tokens: the ids.
            remove_special: drop a leading BOS / trailing EOS when the model adds them.
            unparse_special: render control tokens as their text.

        Returns:
            The text.

        Raises:
            TokenizerError: an id is out of range.

        Examples:
            >>> from reference.model_loader import default_model_path
            >>> tok = Tokenizer.from_gguf(default_model_path())
            >>> tok.detokenize(tok.tokenize("Hello world!"))
            'Hello world!'
        """
        return self.detokenize_bytes(tokens, remove_special, unparse_special).decode(
            "utf-8", "replace"
        )

    # --8<-- [end:detokenize]

    def is_eog(self, token: int) -> bool:
        """Whether the token ends generation (``llama_vocab_is_eog``).

        Examples:
            >>> from reference.model_loader import default_model_path
            >>> tok = Tokenizer.from_gguf(default_model_path())
            >>> [t for t in range(10) if tok.is_eog(t)]
            [0, 2, 4]
        """
        return token in self.eog_ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the model's chat template, as HF transformers does.

        See
        [`reference.chat_template.render_chat_template`][reference.chat_template.render_chat_template].

        Raises:
            TokenizerError: no chat template, or it does not render (the
                [`ChatTemplateError`][reference.chat_template.ChatTemplateError], as a tokenizer
                error).
        """
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template ('tokenizer.chat_template')")
        names = {
            f"{k}_token": self.tokens[v]
            for k, v in self.special.items()
            if k in ("bos", "eos", "unk", "pad") and v is not None
        }
        try:
            return render_chat_template(
                self.chat_template, messages, add_generation_prompt, **names
            )
        except ChatTemplateError as e:
            raise TokenizerError(str(e)) from e


# --8<-- [end:Tokenizer]


@lru_cache(maxsize=4)
def _tokenizer_metadata(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """The ``tokenizer.*`` and ``general.*`` metadata of a GGUF file (cached by path, mtime
    and size: reading 100k strings is most of the cost of loading a vocabulary)."""
    try:
        metadata = read_gguf(path).metadata
    except GGUFError as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None
    return {k: v for k, v in metadata.items() if k.startswith(("tokenizer.", "general."))}


def _config_token(config: dict, key: str, token_to_id: dict[str, int]) -> int | None:
    """The id of ``tokenizer_config.json``'s ``bos_token`` etc. (a string or an AddedToken dict)."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return token_to_id.get(value) if isinstance(value, str) else None


def _split_on(fragment: str, needle: str, special_id: int, attr: int) -> list[str | int]:
    """One fragment cut at every occurrence of one special token (with lstrip/rstrip)."""
    out: list[str | int] = []
    parts = fragment.split(needle)
    for k, part in enumerate(parts):
        if k > 0 and attr & ATTR_RSTRIP:
            part = part.lstrip(" \t\n\v\f\r")
        if k < len(parts) - 1 and attr & ATTR_LSTRIP:
            part = part.rstrip(" \t\n\v\f\r")
        if part:
            out.append(part)
        if k < len(parts) - 1:
            out.append(special_id)
    return out


# --8<-- [start:load_tokenizer]
def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a GGUF file or a HF folder (with ``tokenizer.json``).

    Args:
        path: the file or folder.

    Returns:
        The tokenizer.

    Raises:
        TokenizerError: the path does not exist or is neither.

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> load_tokenizer(default_model_path()).n_vocab
        49152
    """
    p = Path(path)
    if p.is_dir():
        return Tokenizer.from_hf(p)
    if p.is_file():
        return Tokenizer.from_gguf(p)
    raise TokenizerError(f"no such file or folder: {path}")


# --8<-- [end:load_tokenizer]


# --8<-- [start:StreamDecoder]
class StreamDecoder:
    """Text from tokens one at a time, never cutting a UTF-8 character.

    The concatenation of everything [`push`][] and [`flush`][] return is exactly
    ``tokenizer.detokenize(tokens, unparse_special=special)``. Pieces are joined as
    ``detokenize`` joins them (the first piece loses SPM's prefix space); the bytes go through
    an incremental UTF-8 decoder, which holds back an incomplete character until its last byte
    arrives (and replaces invalid bytes with U+FFFD exactly as a whole decode would). Where
    the vocabulary cleans spaces, the last 4 bytes are held back too: the cleaning of a space
    depends on the next two bytes, and each of the three passes can shift that.

    Args:
        tokenizer: the tokenizer.
        special: render control tokens (``unparse_special``).

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> tok = Tokenizer.from_gguf(default_model_path())
        >>> ids = tok.tokenize("né 🦙")
        >>> dec = StreamDecoder(tok)
        >>> [dec.push(t) for t in ids] + [dec.flush()]
        ['n', 'é', ' ', '', '🦙', '']
    """

    _HOLD = 4  # bytes held back when clean_spaces is on

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self.tokenizer = tokenizer
        self.special = special
        self._raw = bytearray()  # concatenated pieces
        self._first = True
        self._sent = 0  # bytes of the (cleaned) stream given to the decoder
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def _stream(self) -> bytes:
        raw = bytes(self._raw)
        return clean_spaces(raw) if self.tokenizer.clean_spaces else raw

    def push(self, token: int) -> str:
        """Add one token; return the text that became complete (maybe ``""``)."""
        piece = self.tokenizer.token_to_piece(token, special=self.special)
        if self._first and self.tokenizer.add_space_prefix and piece.startswith(b" "):
            piece = piece[1:]
        self._first = False
        self._raw += piece
        stream = self._stream()
        stable = len(stream) - (self._HOLD if self.tokenizer.clean_spaces else 0)
        if stable <= self._sent:
            return ""
        text = self._decoder.decode(stream[self._sent : stable])
        self._sent = stable
        return text

    def flush(self) -> str:
        """Return the rest, invalid or incomplete bytes replaced by U+FFFD."""
        stream = self._stream()
        text = self._decoder.decode(stream[self._sent :], final=True)
        self._sent = len(stream)
        return text


# --8<-- [end:StreamDecoder]
