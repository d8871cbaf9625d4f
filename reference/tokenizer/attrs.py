"""Token attributes: the bits of ``llama_token_attr`` (``include/llama.h``).

Every token carries a set of these bits. [`TOKEN_TYPE_ATTR`][] gives the bits a GGUF's
``tokenizer.ggml.token_type`` value (``llama_token_type``) stands for, as
``llama_vocab::impl::load`` converts them; the loader then adds ``CONTROL`` (texts it
recognises), ``UNUSED``, ``LSTRIP``/``RSTRIP`` (Phi-3), and the tokenizer reads them to decide
what is special ([`partition`][reference.tokenizer.vocab.Tokenizer.partition]) and what a
piece is ([`token_to_piece`][reference.tokenizer.vocab.Tokenizer.token_to_piece]).
"""

from __future__ import annotations

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
"""``tokenizer.ggml.token_type`` (``llama_token_type``) -> the attribute bits a token gets."""
