r"""Byte-level BPE: pre-tokenize into words, then merge the pair of lowest rank in each word.

The vocabulary type ``tokenizer.ggml.model == "gpt2"`` (GPT-2, Llama 3, Qwen2, SmolLM2):
``llm_tokenizer_bpe`` and ``llm_tokenizer_bpe_session::tokenize`` of ``src/llama-vocab.cpp``. A
*pre-tokenizer*, named by ``tokenizer.ggml.pre`` ([`PRE_TOKENIZERS`][]), first cuts the text
into words with regular expressions
([`reference.tokenizer.unicode`][reference.tokenizer.unicode]); each word's UTF-8 bytes are
spelled with GPT-2's 256-character alphabet (a space is ``Ġ``), and inside each word the
adjacent pair with the **lowest merge rank** is merged until none is left ([`bpe_merge`][]).
"""

from __future__ import annotations

import heapq

from reference.tokenizer.unicode import GPT2_REGEX, LLAMA3_REGEX, QWEN2_REGEX

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
"""``tokenizer.ggml.pre`` -> the pre-tokenizer: its split regexes and flags."""


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
