r"""Tokenizers: text to token ids and back, as llama.cpp's ``llama_vocab`` does it.

This package mirrors ``src/llama-vocab.cpp`` and ``src/unicode.cpp`` at the pinned commit for
the two vocabulary types that nearly every GGUF model uses:

- **SPM** (``tokenizer.ggml.model == "llama"``, SentencePiece-style; Llama 1/2, Mistral,
  stories260K): [`reference.tokenizer.spm`][reference.tokenizer.spm]. Spaces are written ``▁``
  (U+2581), a space is put in front of the text (``add_space_prefix``), and the text is cut
  into characters that are then merged pairwise, always the adjacent pair whose merged string
  is the vocabulary entry with the **highest score** (ties: the leftmost). A character that is
  not in the vocabulary becomes its UTF-8 bytes as ``<0xXX>`` tokens (*byte fallback*).
- **Byte-level BPE** (``"gpt2"``; GPT-2, Llama 3, Qwen2, SmolLM2):
  [`reference.tokenizer.bpe`][reference.tokenizer.bpe]. A *pre-tokenizer* first cuts the text
  into words with regular expressions
  ([`reference.tokenizer.unicode`][reference.tokenizer.unicode]); each word's UTF-8 bytes are
  spelled with GPT-2's 256-character alphabet (a space is ``Ġ``), and inside each word the
  adjacent pair with the **lowest merge rank** is merged until none is left.

Before either runs, [`Tokenizer.tokenize`][reference.tokenizer.vocab.Tokenizer.tokenize] cuts
the text at special tokens (``tokenizer_st_partition``): with ``parse_special=True`` the text
``<|im_start|>`` becomes that one control token; user-defined tokens are always cut out.
``add_special`` then puts BOS in front (and EOS at the end) when the model asks for it
(``tokenizer.ggml.add_bos_token``).

Back from ids to text,
[`Tokenizer.token_to_piece`][reference.tokenizer.vocab.Tokenizer.token_to_piece] gives each
token's bytes (control tokens only when ``special=True``), and
[`Tokenizer.detokenize`][reference.tokenizer.vocab.Tokenizer.detokenize] concatenates them,
drops the prefix space SPM added, and for some BPE vocabularies "cleans" spaces before
punctuation ([`clean_spaces`][reference.tokenizer.stream.clean_spaces]). A piece may be part of
a UTF-8 character (byte tokens, or byte-level BPE tokens that split a character), so streaming
output goes through [`StreamDecoder`][reference.tokenizer.stream.StreamDecoder].

The modules, in the order a reader meets them:

- [`reference.tokenizer.vocab`][reference.tokenizer.vocab]: the
  [`Tokenizer`][reference.tokenizer.vocab.Tokenizer] (``llama_vocab``) and
  [`load_tokenizer`][reference.tokenizer.vocab.load_tokenizer];
- [`reference.tokenizer.spm`][reference.tokenizer.spm] and
  [`reference.tokenizer.bpe`][reference.tokenizer.bpe]: the two algorithms, and the table of
  pre-tokenizers;
- [`reference.tokenizer.unicode`][reference.tokenizer.unicode]: llama.cpp's codepoint table,
  the byte-to-unicode alphabet and the regex splits;
- [`reference.tokenizer.load`][reference.tokenizer.load]: the vocabulary from a GGUF's
  ``tokenizer.ggml.*`` keys or a HF ``tokenizer.json``;
- [`reference.tokenizer.stream`][reference.tokenizer.stream]: detokenization's cleaning of
  spaces, and text from tokens one at a time;
- [`reference.tokenizer.attrs`][reference.tokenizer.attrs] and
  [`reference.tokenizer.errors`][reference.tokenizer.errors]: the token attributes and the
  package's error.

Chat templates are not part of it: [`reference.chat_template`][reference.chat_template] renders
them and knows nothing of the tokenizer.

Where llama.cpp's result depends on ``std::unordered_map`` iteration order (which of several
end-of-turn texts becomes ``eot_id``), we take the lowest id; ``std::sort`` of the special
tokens by length is not stable in llama.cpp, ours is (ties by id).
"""

from reference.tokenizer.attrs import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_NORMAL,
    ATTR_NORMALIZED,
    ATTR_RSTRIP,
    ATTR_SINGLE_WORD,
    ATTR_UNDEFINED,
    ATTR_UNKNOWN,
    ATTR_UNUSED,
    ATTR_USER_DEFINED,
    TOKEN_TYPE_ATTR,
)
from reference.tokenizer.bpe import PRE_TOKENIZERS, bpe_merge
from reference.tokenizer.errors import TokenizerError
from reference.tokenizer.spm import SPM_SPACE, spm_tokenize
from reference.tokenizer.stream import StreamDecoder, clean_spaces
from reference.tokenizer.vocab import Tokenizer, load_tokenizer

__all__ = [
    "ATTR_BYTE",
    "ATTR_CONTROL",
    "ATTR_LSTRIP",
    "ATTR_NORMAL",
    "ATTR_NORMALIZED",
    "ATTR_RSTRIP",
    "ATTR_SINGLE_WORD",
    "ATTR_UNDEFINED",
    "ATTR_UNKNOWN",
    "ATTR_UNUSED",
    "ATTR_USER_DEFINED",
    "PRE_TOKENIZERS",
    "SPM_SPACE",
    "TOKEN_TYPE_ATTR",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "bpe_merge",
    "clean_spaces",
    "load_tokenizer",
    "spm_tokenize",
]
