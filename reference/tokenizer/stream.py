"""Back to text: the cleaning of spaces, and text from tokens one at a time.

[`clean_spaces`][] is the last step of ``llama_detokenize`` for the vocabularies that ask for
it (``clean_spaces``: GPT-2, Llama 3, not SmolLM2 or Qwen2). A piece may be part of a UTF-8
character (byte tokens, or byte-level BPE tokens that split a character), so streaming output
goes through [`StreamDecoder`][], which never cuts one.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reference.tokenizer.vocab import Tokenizer


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
        >>> from reference.tokenizer.vocab import Tokenizer
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
