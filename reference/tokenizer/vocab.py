"""The tokenizer: a vocabulary and ``llama_tokenize`` & co. (``llama_vocab``).

[`Tokenizer`][] mirrors ``llama_vocab`` of ``src/llama-vocab.cpp``: it holds the tokens, their
scores, attributes and merges, and the special ids, and gives them the semantics of the C API.
[`Tokenizer.tokenize`][] first cuts the text at special tokens ([`Tokenizer.partition`][],
``tokenizer_st_partition``), then encodes each text fragment with the vocabulary's algorithm
([`reference.tokenizer.spm`][reference.tokenizer.spm] or
[`reference.tokenizer.bpe`][reference.tokenizer.bpe]); [`Tokenizer.token_to_piece`][] and
[`Tokenizer.detokenize`][] go back to bytes and text.

The fields are filled by [`reference.tokenizer.load`][reference.tokenizer.load], through the
constructors [`Tokenizer.from_gguf`][], [`Tokenizer.from_metadata`][] and
[`Tokenizer.from_hf`][], or [`load_tokenizer`][] for either kind of path. Special tokens of
equal length are tried in id order: llama.cpp's ``std::sort`` of them by length is not stable,
ours is (ties by id).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reference.chat_template import ChatTemplateError, render_chat_template
from reference.tokenizer.attrs import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_NORMAL,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
)
from reference.tokenizer.bpe import bpe_merge
from reference.tokenizer.errors import TokenizerError
from reference.tokenizer.load import load_gguf_vocab, load_hf_vocab, read_tokenizer_metadata
from reference.tokenizer.spm import SPM_SPACE, spm_tokenize
from reference.tokenizer.stream import clean_spaces
from reference.tokenizer.unicode import byte_decode, byte_encode, regex_split


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
        return cls.from_metadata(read_tokenizer_metadata(path))

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (a dict as
        [`reference.gguf.read_gguf`][reference.gguf.read_gguf] gives).

        The fields are read by
        [`load_gguf_vocab`][reference.tokenizer.load.load_gguf_vocab]; then the caches of
        special tokens, byte tokens and pieces are built.

        Raises:
            TokenizerError: as [`from_gguf`][].
        """
        tok = cls()
        load_gguf_vocab(tok, md)
        tok._finish(md.get("general.name", ""))
        return tok

    @classmethod
    def from_hf(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load a HF tokenizer folder: ``tokenizer.json`` (+ ``tokenizer_config.json``).

        Text is encoded by the ``tokenizers`` package itself (``parse_special=False`` sets its
        ``encode_special_tokens``); BOS/EOS, their ``add_*`` flags and the chat template come
        from ``tokenizer_config.json``. Pieces are byte-level (a ``ByteLevel`` decoder) or
        SentencePiece-style (``▁`` and ``<0xXX>``). The fields are read by
        [`load_hf_vocab`][reference.tokenizer.load.load_hf_vocab].

        Args:
            directory: the folder.

        Returns:
            The tokenizer.

        Raises:
            TokenizerError: ``tokenizer.json`` missing or unreadable.
        """
        tok = cls()
        tok._hf = load_hf_vocab(tok, directory)
        tok._finish()
        return tok

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
