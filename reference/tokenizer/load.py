"""Loading a vocabulary: a GGUF's ``tokenizer.ggml.*`` keys, or a HF ``tokenizer.json``.

Mirrors ``llama_vocab::impl::load`` (``src/llama-vocab.cpp``): [`load_gguf_vocab`][] reads the
type of the vocabulary and its pre-tokenizer ([`load_type`][]), the tokens with their scores and
types ([`load_tokens`][]), the special ids the file names ([`load_special_ids`][]), then finds
the special tokens the file does not name by their texts ([`detect_special_texts`][]: EOT,
EOM, the FIM tokens, the end-of-generation set). A HF folder is read by [`load_hf_vocab`][];
its text is encoded by the ``tokenizers`` package itself.

Each function fills the fields of a [`Tokenizer`][reference.tokenizer.vocab.Tokenizer] (its
constructors [`from_gguf`][reference.tokenizer.vocab.Tokenizer.from_gguf],
[`from_metadata`][reference.tokenizer.vocab.Tokenizer.from_metadata] and
[`from_hf`][reference.tokenizer.vocab.Tokenizer.from_hf] call them); nothing here encodes text.

Where llama.cpp's result depends on ``std::unordered_map`` iteration order (which of several
end-of-turn texts becomes ``eot_id``), we take the lowest id.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reference.gguf import GGUFError, read_gguf
from reference.tokenizer.attrs import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_NORMAL,
    ATTR_UNDEFINED,
    ATTR_UNUSED,
    ATTR_USER_DEFINED,
    TOKEN_TYPE_ATTR,
)
from reference.tokenizer.bpe import PRE_TOKENIZERS
from reference.tokenizer.errors import TokenizerError

if TYPE_CHECKING:
    from reference.tokenizer.vocab import Tokenizer

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
# GGUF: the tokenizer.ggml.* keys
# ---------------------------------------------------------------------------------------------


def read_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``tokenizer.*`` and ``general.*`` metadata of a GGUF file.

    Cached by path, modification time and size: reading 100k strings is most of the cost of
    loading a vocabulary.

    Args:
        path: a ``.gguf`` file.

    Returns:
        Key to value, as [`reference.gguf.read_gguf`][reference.gguf.read_gguf] reads them.

    Raises:
        TokenizerError: the file does not exist or is not a valid GGUF.

    Examples:
        >>> from reference.model_loader import default_model_path
        >>> read_tokenizer_metadata(default_model_path())["tokenizer.ggml.pre"]
        'smollm'
    """
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"GGUF file not found: {path}")
    stat = p.stat()
    return _tokenizer_metadata(str(p.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _tokenizer_metadata(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """[`read_tokenizer_metadata`][] of a resolved path, cached."""
    try:
        metadata = read_gguf(path).metadata
    except GGUFError as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None
    return {k: v for k, v in metadata.items() if k.startswith(("tokenizer.", "general."))}


# --8<-- [start:load_gguf_vocab]
def load_gguf_vocab(tok: Tokenizer, md: dict[str, Any]) -> None:
    """Fill ``tok`` from GGUF metadata, in ``llama_vocab::impl::load``'s order.

    Args:
        tok: a new, empty tokenizer.
        md: the metadata (a dict as [`reference.gguf.read_gguf`][reference.gguf.read_gguf]
            gives).

    Raises:
        TokenizerError: a missing key, an unknown ``tokenizer.ggml.model`` or
            ``tokenizer.ggml.pre``, arrays shorter than the token list, duplicate tokens.
    """
    load_type(tok, md)
    load_tokens(tok, md)
    load_special_ids(tok, md)
    detect_special_texts(tok)
    tok.chat_template = md.get("tokenizer.chat_template")
# --8<-- [end:load_gguf_vocab]


def load_type(tok: Tokenizer, md: dict[str, Any]) -> None:
    """The algorithm, the pre-tokenizer and their defaults (``tokenizer.ggml.model`` / ``pre``).

    SPM (``"llama"``) defaults to BOS 1, EOS 2, UNK 0, a prefix space and BOS added; byte-level
    BPE (``"gpt2"``) reads its merges (the first occurrence of a pair wins) and takes the
    expressions and flags of its pre-tokenizer from
    [`PRE_TOKENIZERS`][reference.tokenizer.bpe.PRE_TOKENIZERS].

    Raises:
        TokenizerError: no ``tokenizer.ggml.model``, another model, BPE without merges, or an
            unknown pre-tokenizer.
    """
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError("'tokenizer.ggml.model' is missing from the GGUF metadata")
    pre = md.get("tokenizer.ggml.pre", "") or ""
    if model == "llama":
        tok.special = dict(bos=1, eos=2, unk=0)
        tok.add_space_prefix, tok.add_bos = True, True
    elif model == "gpt2":
        if "tokenizer.ggml.merges" not in md:
            raise TokenizerError("byte-level BPE vocabulary without 'tokenizer.ggml.merges'")
        name = pre or "default"
        if name not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"unsupported pre-tokenizer {pre!r} ('tokenizer.ggml.pre'); supported: "
                + ", ".join(sorted(PRE_TOKENIZERS))
            )
        tok.regexes, tok.clean_spaces, tok.ignore_merges, tok.add_bos = PRE_TOKENIZERS[name]
        tok.special = dict(bos=11, eos=11)
        for i, merge in enumerate(md["tokenizer.ggml.merges"]):
            cut = merge.find(" ", 1)
            pair = (merge[:cut], merge[cut + 1 :]) if cut != -1 else ("", "")
            tok.ranks.setdefault(pair, i)  # emplace: the first occurrence wins
    else:
        raise TokenizerError(
            f"unknown tokenizer model {model!r} ('tokenizer.ggml.model'); "
            "supported: 'llama' (SPM), 'gpt2' (byte-level BPE)"
        )
    tok.model, tok.pre = model, pre
    tok.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", tok.add_space_prefix))


def load_tokens(tok: Tokenizer, md: dict[str, Any]) -> None:
    """The tokens, their scores and their attributes (``tokenizer.ggml.tokens`` / ``scores`` /
    ``token_type``); an empty token text becomes ``[EMPTY_{id}]`` as in llama.cpp.

    Raises:
        TokenizerError: no token list, a scores or types array shorter than it, or two tokens
            with the same text.
    """
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise TokenizerError("'tokenizer.ggml.tokens' is missing from the GGUF metadata")
    n = len(tokens)
    scores = md.get("tokenizer.ggml.scores")
    types = md.get("tokenizer.ggml.token_type")
    for key, arr in (("scores", scores), ("token_type", types)):
        if arr is not None and len(arr) < n:
            raise TokenizerError(f"'tokenizer.ggml.{key}' has {len(arr)} < {n} entries")
    tok.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    tok.scores = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
    tok.attrs = (
        [TOKEN_TYPE_ATTR.get(int(t), ATTR_UNDEFINED) for t in types[:n]]
        if types is not None
        else [ATTR_NORMAL] * n
    )
    tok.token_to_id = {t: i for i, t in enumerate(tok.tokens)}
    if len(tok.token_to_id) != n:
        raise TokenizerError("the vocabulary has duplicate token texts")


def load_special_ids(tok: Tokenizer, md: dict[str, Any]) -> None:
    """The special ids the file names (``tokenizer.ggml.{bos,eos,...}_token_id``, and the
    deprecated FIM keys), over the type's defaults; an id out of range is ignored, a default
    out of range disabled. Then ``add_bos_token`` / ``add_eos_token``."""
    n = tok.n_vocab
    ids = {name: tok.special.get(name) for name in _SPECIAL_ID_KEYS}
    for name, value in list(ids.items()):
        if value is not None and value >= n:
            ids[name] = None  # a default out of range is disabled
    keys = [*_SPECIAL_ID_GGUF.items(), *_SPECIAL_ID_DEPRECATED.items()]
    for name, key in keys:
        value = md.get(key)
        if value is not None and 0 <= int(value) < n:
            ids[name] = int(value)
    tok.special = ids
    tok.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", tok.add_bos))
    tok.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", tok.add_eos))


def detect_special_texts(tok: Tokenizer) -> None:
    """EOT/EOM/FIM ids by text, UNUSED marks and the EOG set, as ``load`` does.

    A special id the file does not name is the token whose text llama.cpp knows for it (the
    lowest id when several match), marked CONTROL; every CONTROL token whose text says
    ``unused`` is UNUSED; the end-of-generation set is EOS, EOT, EOM, the FIM pad/repo/sep
    tokens and every token with a known end-of-generation text, less the exceptions llama.cpp
    makes for gpt-oss (``<|end|>``) and PLaMo/Gemma-style vocabularies (``</s>``).
    """
    by_text = tok.token_to_id
    for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
        if tok.special.get(name) is None:
            found = sorted(by_text[t] for t in texts if t in by_text)
            if found:  # llama.cpp: the first in unordered_map order; we: the lowest id
                tok.special[name] = found[0]
                tok.attrs[found[0]] |= ATTR_CONTROL
    for i, text in enumerate(tok.tokens):
        if tok.attrs[i] & ATTR_CONTROL and "unused" in text:
            tok.attrs[i] |= ATTR_UNUSED
    eog = {tok.special.get(k) for k in ("fim_pad", "fim_rep", "fim_sep")} - {None}
    for text in _EOG_TEXTS:
        if text in by_text:
            eog.add(by_text[text])
            tok.attrs[by_text[text]] |= ATTR_CONTROL
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        if text in by_text:
            tok.attrs[by_text[text]] = ATTR_USER_DEFINED
    eog |= {tok.special.get(k) for k in ("eos", "eot", "eom")} - {None}
    texts = {tok.tokens[t]: t for t in eog}
    if "<|end|>" in texts and (
        ("<|return|>" in texts and "<|call|>" in texts)
        or ("<|calls|>" in texts and "<|flush|>" in texts)
    ):
        eog.discard(texts["<|end|>"])
        tok.attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        tok.attrs[texts["</s>"]] = ATTR_NORMAL
    tok.eog_ids = eog


# ---------------------------------------------------------------------------------------------
# HF: tokenizer.json and tokenizer_config.json
# ---------------------------------------------------------------------------------------------


def load_hf_vocab(tok: Tokenizer, directory: str | os.PathLike) -> Any:
    """Fill ``tok`` from a HF tokenizer folder: ``tokenizer.json`` (+ ``tokenizer_config.json``).

    The tokens and their attributes come from the ``tokenizers`` package's vocabulary and the
    ``added_tokens`` (special: CONTROL, else USER_DEFINED); pieces are byte-level (a
    ``ByteLevel`` decoder: ``model = "hf-bpe"``) or SentencePiece-style (``▁`` and ``<0xXX>``:
    ``"hf-spm"``). BOS/EOS, their ``add_*`` flags and the chat template come from
    ``tokenizer_config.json`` (or ``chat_template.jinja``).

    Args:
        tok: a new, empty tokenizer.
        directory: the folder.

    Returns:
        The ``tokenizers.Tokenizer`` that encodes text for ``tok``.

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
    try:
        raw = config_path.read_text(encoding="utf-8") if config_path.is_file() else "{}"
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"cannot read {config_path}: {e}") from None
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
    detect_special_texts(tok)
    tok.chat_template = _hf_chat_template(folder, config)
    return hf


def _config_token(config: dict, key: str, token_to_id: dict[str, int]) -> int | None:
    """The id of ``tokenizer_config.json``'s ``bos_token`` etc. (a string or an AddedToken dict)."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return token_to_id.get(value) if isinstance(value, str) else None


def _hf_chat_template(folder: Path, config: dict) -> str | None:
    """``tokenizer_config.json``'s ``chat_template`` (of named ones, ``"default"``), else
    ``chat_template.jinja``."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template
