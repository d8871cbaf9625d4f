r"""The text a slot streams: UTF-8 held back until complete, stop strings cut from it.

llama.cpp's slot appends each generated token's piece to ``generated_text`` and decides,
token by token, how much of it may be sent (``process_token``,
``tools/server/server-context.cpp:1814-1860``):

1. **Incomplete UTF-8.** When the text ends inside a multi-byte character
   (``validate_utf8``, ``server-common.cpp:903-928``), nothing is checked and nothing is
   sent; the token's bytes wait for the rest of the character.
2. **Full stop string.** Otherwise, for every stop word, the *unsent* text is searched from
   ``max(0, len(unsent) - len(word) - len(last piece))``: a word that was not there before
   this token must end inside the new text (``find_stopping_strings``,
   ``server-context.cpp:537-566``). The earliest match over all words wins; the text is cut
   there (the word and whatever followed it are never sent) and the generation ends with
   ``stop_type`` ``"word"`` and ``stopping_word`` the word. Words are matched as soon as
   they complete: with stop words ``["abcd", "c"]``, the text ``"abc"`` stops on ``"c"``.
3. **Partial stop string.** Otherwise, when the unsent text ends with a prefix of some stop
   word (``string_find_partial_stop``, ``common/common.h:862-875``), *nothing* is sent for
   this token: the whole unsent text waits until the next tokens show whether the word
   completes (then it is cut) or not (then it goes out with them).
4. Otherwise all the unsent text is sent.

This module works on ``str`` after an incremental UTF-8 decode, so offsets are characters,
not bytes; for valid UTF-8 a byte match and a character match are the same thing (a stop
word's prefix that ends a complete text starts and ends on character boundaries). Two
deliberate differences from the byte-level C++:

- "the last piece" is all the text decoded since the last check, not the last token's bytes:
  when a stop word is followed by a character split across tokens, llama.cpp's window
  (``len(word) + len(last token)``) no longer reaches back to the word and misses it; here
  it is found.
- invalid bytes become U+FFFD as Python's ``"replace"`` decoding does (``validate_utf8``
  only looks at a truncated tail, and the JSON writer replaces the rest).

Empty stop words are dropped, as the request parser does (``server-schema.cpp:494``).

[`common_prefix`][] is ``server_tokens::get_common_prefix`` (``server-common.cpp:697-710``),
the measure behind slot selection, ``cache_prompt`` and the RAM prompt cache.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from reference.tools.server.errors import ServerError


# --8<-- [start:common_prefix]
def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists
    (``server_tokens::get_common_prefix``, ``server-common.cpp:697-710``, text tokens only).

    Args:
        a: token ids.
        b: token ids.

    Returns:
        The largest ``n`` with ``a[:n] == b[:n]``.

    Examples:
        >>> common_prefix([1, 2, 3, 4], [1, 2, 5]), common_prefix([], [1]), common_prefix([7], [7])
        (2, 0, 1)
    """
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
# --8<-- [end:common_prefix]


# --8<-- [start:find_stop]
def find_full_stop(unsent: str, stop: Sequence[str], n_new: int) -> tuple[int, str | None]:
    """The earliest full stop word in the tail of the unsent text
    (``find_stopping_strings(..., is_full_stop=true)``, ``server-context.cpp:545-549``).

    Each word is searched from ``max(0, len(unsent) - len(word) - n_new)``: earlier
    occurrences would have been found by an earlier check.

    Args:
        unsent: the text not sent yet.
        stop: the stop words (non-empty).
        n_new: characters of ``unsent`` added since the last check.

    Returns:
        ``(position, word)`` of the earliest match (the first word listed on a tie), or
        ``(-1, None)``.

    Examples:
        >>> find_full_stop("say STOP or END", ["END", "STOP"], n_new=15)
        (4, 'STOP')
        >>> find_full_stop("say STOP or END", ["END", "STOP"], n_new=3)  # STOP is too far back
        (12, 'END')
    """
    best, found = -1, None
    for word in stop:
        pos = unsent.find(word, max(0, len(unsent) - len(word) - n_new))
        if pos != -1 and (best == -1 or pos < best):
            best, found = pos, word
    return best, found


def find_partial_stop(unsent: str, stop: Sequence[str]) -> int:
    """Where the longest suffix of ``unsent`` that is a prefix of a stop word starts
    (``string_find_partial_stop``, ``common/common.h:862-875``; the earliest over all words).

    Args:
        unsent: the text not sent yet.
        stop: the stop words (non-empty).

    Returns:
        The start of the partial match, or -1.

    Examples:
        >>> find_partial_stop("Hello wor", ["world!"]), find_partial_stop("Hello", ["world!"])
        (6, -1)
    """
    best = -1
    for word in stop:
        for n in range(min(len(unsent), len(word)), 0, -1):
            if unsent.endswith(word[:n]):
                pos = len(unsent) - n
                best = pos if best == -1 else min(best, pos)
                break
    return best
# --8<-- [end:find_stop]


# --8<-- [start:StopText]
class StopText:
    r"""The generated text of one slot: what may be sent after each token, and the stop word.

    Feed each token's piece (bytes) to [`push`][]; it returns the text that may be sent now
    and the stop word when one matched (then the generation ends and further pushes are an
    error). At the end of a generation that no stop word ended, [`flush`][] returns what was
    held back. The concatenation of everything returned is [`text`][], the content.

    llama.cpp skips the partial check for an end-of-generation token and so sends what was
    held (``server-context.cpp:1842``): call [`flush`][] then. When a limit (``n_predict``,
    the context) ends a streamed generation, llama.cpp's final chunk has no content
    (``server-context.cpp:2083-2090``), so text held at that moment is never streamed; the
    non-streamed content is the whole [`text`][].

    Args:
        stop: the stop words (``"stop"`` of the request); empty words are ignored.

    Examples:
        >>> st = StopText(["</s>"])
        >>> [st.push(p) for p in [b"Hi", b" <", b"/s", b"> bye"]]
        [('Hi', None), ('', None), ('', None), (' ', '</s>')]
        >>> st.text, st.stopping_word
        ('Hi ', '</s>')
        >>> st = StopText([])
        >>> [st.push(p) for p in [b"caf\xc3", b"\xa9!", b"\xf0\x9f"]]
        [('', None), ('café!', None), ('', None)]
        >>> st.flush() == "\ufffd"  # an incomplete character at the end
        True
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = [word for word in stop if word]
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._text = ""  # decoded content, cut at a stop word
        self._n_sent = 0  # characters of _text already returned
        self._n_checked = 0  # characters of _text seen by the last stop check
        self._stopping_word: str | None = None

    @property
    def text(self) -> str:
        """The content so far: sent and held text, cut at a stop word (an incomplete
        character at the end is not in it)."""
        return self._text

    @property
    def stopping_word(self) -> str:
        """The stop word that ended the generation, ``""`` if none (``stopping_word``)."""
        return self._stopping_word or ""

    def push(self, piece: bytes) -> tuple[str, str | None]:
        """Add one token's bytes.

        Args:
            piece: the token's piece (``token_to_piece``), maybe part of a character.

        Returns:
            ``(text, word)``: the text that may be sent now (maybe ``""``) and the stop word
            if one matched (the generation ends; ``text`` stops before the word).

        Raises:
            ServerError: a push after a stop word ended the generation.
        """
        if self._stopping_word is not None:
            raise ServerError(f"push after the stop word {self._stopping_word!r} ended the "
                              "generation; start a new StopText")
        self._text += self._decoder.decode(piece)
        if self._decoder.getstate()[0]:  # incomplete character: no check, nothing sent
            return "", None
        unsent = self._text[self._n_sent:]
        n_new, self._n_checked = len(self._text) - self._n_checked, len(self._text)
        pos, word = find_full_stop(unsent, self.stop, n_new)
        if word is not None:
            self._text = self._text[: self._n_sent + pos]
            self._stopping_word = word
        elif find_partial_stop(unsent, self.stop) != -1:
            return "", None
        return self._send(), word

    def flush(self) -> str:
        """The held text at the end of a generation that no stop word ended, an
        incomplete character replaced by U+FFFD (``""`` after a stop word).

        Returns:
            The text not sent yet.
        """
        if self._stopping_word is None:
            self._text += self._decoder.decode(b"", final=True)
        return self._send()

    def _send(self) -> str:
        out = self._text[self._n_sent:]
        self._n_sent = self._n_checked = len(self._text)
        return out
# --8<-- [end:StopText]


__all__ = ["StopText", "common_prefix", "find_full_stop", "find_partial_stop"]
