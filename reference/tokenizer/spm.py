"""SentencePiece-style tokenization (SPM): merge the adjacent pair of highest score.

The vocabulary type ``tokenizer.ggml.model == "llama"`` (Llama 1/2, Mistral, stories260K):
``llm_tokenizer_spm_session::tokenize`` of ``src/llama-vocab.cpp``. Spaces are written ``▁``
(U+2581; [`SPM_SPACE`][]), a space is put in front of the text (``add_space_prefix``), and the
text is cut into characters that are then merged pairwise, always the adjacent pair whose
merged string is the vocabulary entry with the **highest score** (ties: the leftmost). A
character that is not in the vocabulary becomes its UTF-8 bytes as ``<0xXX>`` tokens (*byte
fallback*).
"""

from __future__ import annotations

import heapq

from reference.tokenizer.errors import TokenizerError

SPM_SPACE = "\u2581"  # ▁, how SentencePiece writes a space
"""U+2581 (``▁``): how SentencePiece writes a space in its pieces."""


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
