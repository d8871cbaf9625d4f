r"""Unicode for tokenizers: llama.cpp's codepoint table, byte-to-unicode, and the regex splits.

This module mirrors ``src/unicode.cpp`` of llama.cpp at the pinned commit. A byte-level BPE
tokenizer first cuts the text into *words* with a list of regular expressions (the
*pre-tokenizer*), and only then merges inside each word. Three things decide the words, and
llama.cpp has its own version of each:

1. **Character classes.** ``\p{L}`` (letters), ``\p{N}`` (numbers), ``\p{P}``, ``\p{S}``,
   ``\p{M}`` and ``\s`` are looked up in llama.cpp's own table (``unicode-data.cpp``, made by
   ``scripts/gen-unicode-data.py`` from Unicode 15.1's ``UnicodeData.txt``), not in Python's
   ``unicodedata`` (Unicode 14 on Python 3.11) nor in the ``regex`` package (a newer Unicode).
   The table is `_FLAG_RANGES` below. Whitespace is a fixed set of 25 codepoints
   (Unicode's ``White_Space``), so ``\s`` does *not* match ``\x1c``-``\x1f`` as Python's ``\s``
   does.
2. **Hand-written splitters.** For the GPT-2, Llama 3 and Qwen2 expressions llama.cpp does not
   run a regex engine: ``unicode_regex_split_custom_gpt2`` / ``_llama3`` / ``_qwen2`` scan the
   codepoints by hand. We write each one as the Python regular expression it is equivalent to
   (`CUSTOM_SPLITS`); ``tests/laws/test_tokenizer.py`` runs a line-by-line port of the C++
   scanners against these expressions on random text.
3. **The std::regex fallback.** Any other expression runs through ``std::regex`` on a
   *collapsed* text where every codepoint above 127 is replaced by one byte naming its class
   (``0xD1`` number, ``0xD2`` letter, ``0xD3`` punctuation, ``0xD4`` mark, ``0xD5`` symbol,
   ``0x0B`` whitespace, ``0xD0`` anything else), and ``\p{X}`` by ``[\xD? + ASCII members]``.
   That is the same as running the expression on the original text with ``\p{X}`` and ``\s``
   replaced by explicit classes from the table, which is what [`translate_regex`][] does.

The expressions are applied one after the other: each one splits every piece that the
previous ones produced, and both the matches and the text between matches become pieces.

Byte-level BPE then spells each word's UTF-8 bytes with GPT-2's printable alphabet
(`BYTE_TO_UNICODE`): the 188 printable Latin-1 bytes stand for themselves, the other 68
are moved to U+0100 onwards, so a space is ``Ġ`` (U+0120) and a newline ``Ċ`` (U+010A).
"""

from __future__ import annotations

import bisect
import re
from functools import cache

# ---------------------------------------------------------------------------------------------
# The codepoint table
# ---------------------------------------------------------------------------------------------

#: llama.cpp's ``unicode_ranges_flags``: consecutive ranges, each written as the distance (hex)
#: from the previous range's first codepoint, then the category of the range: ``L`` letter,
#: ``N`` number, ``P`` punctuation, ``S`` symbol, ``M`` mark, ``Z`` separator, ``C`` control
#: (Cc, Cf, Co, Cs), ``u`` unassigned. Made from ``src/unicode-data.cpp`` at the pinned commit.
_FLAG_RANGES = (
    "0C20Z1P3S1P6S1P4NaP2S3P2L1aP3S1P1S1L1aP1S1P1S1C21Z1P1S5P1S2L1P1S1C1S4N2S1L1P2S1N1L1P1N3P"
    "1L17S1L1fS1L1caS4LcSeL5S7L1S1L1S11M70L5S1L2u2L4P1L1u4S2L1P1L3u1L1u1L14u1L53S1L8bS1M7La6u"
    "1L26u2L1P6L29P2u2S3u1M2dP1M1P1M2P1M2P1M1u8L1bu4L4P2ubC6S3P2S1P2S2MbP1C1P3L2bM15NaP4L2M1L"
    "63P1L1M7C1S1M6L2M2S1M4L2NaL3S2L1Peu1C1L1M1L1eM1bu2L59MbL1ueNaL21M9L2S1P3L1u2M1S2L16M4L1M"
    "9L1M3L1M5u2Pfu1L19M3u2P1u1Lbu5L18S1L6u1C2u6M8L2aM18C1M21L36M3L1M12L1M7LaM2P2NaP1L10M3u1L"
    "8u2L2u2L16u1L7u1L1u3L4u2M1L1M7u2M2u2M3L1u8M1u4L2u1L3M2u2NaL2S2N6S2L1P1M1u2M3u1L6u4L2u2L1"
    "6u1L7u1L2u1L2u1L2u2M1u1M5u4M2u2M3u3M1u7L4u1L1u7NaM2L3M1P1uaM3u1L9u1L3u1L16u1L7u1L2u1L5u2"
    "M1L1M8u1M3u1M3u2L1ufL2M2u2NaP1S1u7L1M6u1M3u1L8u2L2u2L16u1L7u1L2u1L5u2M1L1M7u2M2u2M3u7M3u"
    "4L2u1L3M2u2NaS1L1N6uaM1L1u1L6u3L3u1L4u3L2u1L1u1L2u3L2u3L3u3Lcu4M5u3M3u1M4u2L1u6M1ueNdS8u"
    "5M5L8u1L3u1L17u1L10u2M1L1M7u1M3u1M4u7M2u1L3u2L1u2L2M2u2Nau7P1N7S1L1M3P1L8u1L3u1L17u1Lau1"
    "L5u2M1L1M7u1M3u1M4u7M2u6L2u1L2M2u2Nau1L2M1ucM4L9u1L3u1L29M2L1M7u1M3u1M4L1S1u4L3M1N7L3M2u"
    "2N13S1L6u1M3u1L12u3L18u1L9u1L1u2L7u3M1u4M6u1M1u1M8u6Nau2M2P1ucL30M1L2M7u4S1L7M8P1NaP2u25"
    "L2u1L1u1L5u1L18u1L1u1LaM1L2M9L1u2L5u1L1u1M7u1Nau2L4u20L1S3PfS1P1S3M2S6N14S1M1S1M1S1M1P4M"
    "2L8u1L24u4M14P1M2L5Mbu1M24u1S8M1S6u1S2P5S4P2u25L2bM14L1NaP6L6M4L4M3L1M3L2M7L3M4LdMcL1M1N"
    "aM4S2L26u1L1u5L1u2L2bP1L14du1L4u2L7u1L1u1L4u2L29u1L4u2L21u1L4u2L7u1L1u1L4u2Lfu1L39u1L4u2"
    "L43u2M3P9N14u3L10Sau6L56u2L6u2P1L26cS1P1L11Z1L1aP2u3L4bP3N3L8u7L12M4u9L13M3P2u9L12M2ucLd"
    "u1L3u1M2ucL34M20P3L1P3S1L1M1u2Nau6Nau6PbM3C1M1Nau6L59u7L5M2L22M1L1u5L46uaL1fu1Mcu4Mcu4S1"
    "u3P2NaL1eu2L5ubL2cu4L1au6Nbu3S22L17M5u2P2L35Mau1M1du2M1Nau6Nau6P7L1P6u2M1fu31M5L2fM11L8u"
    "3NaP7SaM9S9P2u1M3L1eMdL2NaL2cMeu8P4L24M14u3P5Nau3L3NaL24P2L9u7L2bu2L3P8u8M3P1M15L4M1L6M1"
    "L2M3L1u5Lc0M40L116u2L6u2L26u2L6u2L8u1L1u1L1u1L1u1L1fu2L35u1L7S1L1S3L3u1L7S3L4u2L6u1S3LdS"
    "3u2L3u1L7S2u1ZbC5P18Z2C5Z1P14S1PdS1PcZ1C5u1CaN1L1u2N6S3P2L1NaS3P2u1Ldu3S21ufM21ufS2L1S4L"
    "1S2LaS1L1S3L5S6L1S1L1S1L1S1L4S1LbS2L4S5L5S4L1S1N33L2N5S2u4S178P4S1dP2Sfcu19Sbu15N3cS4eN1"
    "6S268PeN1eS31P2S1fPaS193P16S3fP4S20P2S176u2S20u1S69Le5S6L4M3L2u5P4N1P2L26u1L1u5L1u2L38u7"
    "L1P1ueM1L17u9L7u1L7u1L7u1L7u1L7u1L7u1L7u1L7u1M20P2fL1P20S2Pcu22S1au1S59ucSd6u1aS10Z1P3S1"
    "L2N1PaS2PcS1N9M6P1L5S2N3L2P1S2u1L56u2M2S2L3P1L5aP1L4u5L2bu1L5eu1S2N4SaL20S24ubS1L10S1fu1"
    "NaS1eN8S1NfS20NaS27NfS140L19c0S40L568du3S37u9L2eP2L10dP3L10NaL2u14L2fM4P1MaP1L1fM2L46NaM"
    "2P6u8S17L9S2L67S2L40u5L2u1L1u1L5u18L10M1L3M1L4M1L17M5S4M1u3N6S4u6L34P4u8M2L32M12u8P2Nau6"
    "M12L6P3L1P1L2M1NaL1cM8P2L17MdubP1L1du3M4L2fMePdu1L1Nau4P2L5M1LaNaL5u1L29Meu9L3M1L8M2u2Na"
    "u2P4L17S3L1M3L32M1L1M3L2M2L5M2L1M1L1u18L3P2LbM5P2L3M2uaL6u2L6u2L6u9L7u1L7u1L2bS1LeS2u4L7"
    "3M8P1M2u2Nau6L2ba4ucL17u4L31u4C2100L16eu2L6au26L7ucL5u5L1M1LaS1Ldu1L5u1L1u1L2u1L2u1L6cS1"
    "1u10L16bP2S10L40u2L36u7S1u20LcS4M10Pau6M10P23u1PeS1P1S3u1P1S1P2u4L5u1L87u2C1u1P3S1P6S1P4"
    "NaP2S3P2L1aP3S1P1S1L1aP1S1P1S1P7L59u3L6u2L6u2L6u2L3u3S7u1S7uaC3S2u2Lcu1L1au1L13u1L2u1Lfu"
    "2Leu22L7bu5P3u4N2du3S9N39S11N2S3u1Sdu3S1u2fS2dM1u82L1du3L31ufM1N1bu4L20N4u9L14N1L8N1u5L2"
    "6M5u5L1eu1P1L24u4L8P1N5u2aL9eu2Nau6L24u4L24u4L28u8L34ubP1Lbu1Lfu1L7u1L2u1Lbu1Lfu1L7u1L2u"
    "43L137u9L16uaL8u18L6u1L2au1L9u45L6u2L1u1L2cu1L2u3L1u2L17u1P1N8L17S2N7L1fu8N9u30L13u1L2u5"
    "N5L16N6u3P1L1au5P1u40L38u4N2L2N10u2N2eL1M3u1M2u5M4L4u1L3u1L1du2M3u4M1N9u7P9u7L1dN2P1L1dN"
    "3u20L8S1L1cM2u4N5P7u9L36u3P7L16u2N8L13u5N8L12u7P4ucN7u50L49u37L33udL33u7N6L24M4u8Nau126N"
    "1fu1L2au1M2P1u2L2u4bM3L1dNaL1u8L16MbN4P5u16L12M4P4u26L15N7u14L17u9M3L35MfP7u4N1eM1L2M2L1"
    "u9M4L2dMbP2C1P4M1uaC1u2L19u7Nau6M3L24Meu1NaP4L1M2L1u8L23M1P2L1u9M3L30MeL4P4M4P1M2NaL1P1L"
    "1P3u1N14ubL12u1L19McP6M1L2M1u3eL7u1L1u1L4u1Lfu1LaP1u6L2fMcu5Nau6M4u1L8u2L2u2L16u1L7u1L2u"
    "1L5u1M2L1M7u2M2u2M3u2L1u6M1u5L5M2u2M7u3M5u8bL35M12L4P5NaP2u1P1M1L3u1eL30M14L2P1L1u8Naua6"
    "L2fM7u2M9P17L4M2u22L30M11P3L1ubNau6Pdu13L2bMdL1P1u6Nau36L1bu2Mfu4NcP3S1L7ub9L2cMfP1u64L4"
    "0N13ucL8u2L1u2L8u1L2u1L18M6u1M2u2M4L1M1L1M2P3u9Nau46L8u2L27M7u2M7L1P1L1M1u1bL1MaL28M7L1M"
    "4P8M1u8L1MbL2eM10P3L1P5udL49u7Pauf6L9u1L25M8u1M8L1P5uaN1du3P2L1eu2M16u1Meu49L7u1L2u1L26M"
    "6u3M1u1M2u1M7L1M1u8Nau6L6u1L2u1L20M5u1M2u1M5L1u7Nau136L13M4P2u7M2L1M1Ldu1L22M7u3M5PdNau5"
    "6L1ufN15S1dudP1L39au66N6fu1P5ubLc4ua4cL61P2udL430C10M1L6MfufaaL247u21b9L239u7L1fu1Nau4P2"
    "L4fu1Nau6L1eu2M5P1uaL30M7P5S4L4P1S1uaNau1N7u1L15u5L13u2b0L40N17P4u65L4bu4M1L1M37u7M4Ldu4"
    "0L2P1L1M1ubM2ueL17f8u8L4d6u2aL9u22e7L4u1L7u1L2u1L123ufL1u1dL3u2L1ueL4u8L18cu904L6bu5Ldu3"
    "L9u7Lau2S1M2P1C4u125cM2eu2M17u9S74u3cSf6uaS27u2S3cM5S3M6C8M8S2M7S1eM4S3du15S42M3S1u7aN14"
    "ucN14ucS57u9N19u87L55u1L47u1L2u2L1u2L2u2L4u1Lcu1L1u1L7u1L41u1L4u2L8u1L7u1L1cu1L4u1L5u1L1"
    "u3L7u1L154u2L19S1L19S1L1fS1L19S1L1fS1L19S1L1fS1L19S1L1fS1L19S1L8u2N32S200M37S4M32S8M1SeM"
    "1S2P5ufM5u1Mfu450L1fu6L6ud5M7u1M11u2M7u1M2u1M5u5L3eu21M1u70L2du3M7L7u2Nau4L1S1u140L1eM1u"
    "11L2cM4Nau5S1u1d0L1cM4Nau2e6L7u1L4u1L2u1Lfu1Lc5u2N9M7u29L44M7L1u4Nau4P2u311N3bS1N3S1N4u4"
    "cN2dS1Nfuc2L4u1L1bu1L2u1L1u2L1u1Lau1L4u1L1u1L1u6L1u4L1u1L1u1L1u1L3u1L2u1L1u2L1u1L1u1L1u1"
    "L1u1L1u1L2u1L1u2L4u1L7u1L4u1L4u1L1u1Lau1L11u5L3u1L5u1L11u34S2u10eS2cu4S64ucSfu2Sfu1Sfu1S"
    "25uaNdSa1u38S1dudS2cu4S9u7S2ueS6u9aS3d8u4S11u3Sdu3S77u4S5fu6Scu4S1ufScu4S38u8Sau6S28u8S1"
    "eu2S2u4eS154ucSeu2Sdu3S9u7S2eu1S7u8Seu4S9u7S9u7S93u1S37u25Nau406La6e0u20L103au6Ldeu2L168"
    "2ueL1d31ufL26eu9a2L21eu5e2L134bu5L1060uadc51C1u1eC60u80Mf0ufe10Cfffeu2Cfffeu"
)

MAX_CODEPOINTS = 0x110000

#: llama.cpp's ``unicode_set_whitespace`` (Unicode's ``White_Space`` property): what ``\s``
#: matches, and nothing else.
WHITESPACE = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B)]
    + [0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)


def _parse_ranges(table: str) -> tuple[list[int], list[str]]:
    """The first codepoint and the category of every range of `_FLAG_RANGES`."""
    starts: list[int] = []
    categories: list[str] = []
    cpt = 0
    for delta, category in re.findall(r"([0-9a-f]+)([uNLZMPSC])", table):
        cpt += int(delta, 16)
        starts.append(cpt)
        categories.append(category)
    return starts, categories


_STARTS, _CATEGORIES = _parse_ranges("".join(_FLAG_RANGES))


# --8<-- [start:cpt_category]
def cpt_category(cpt: int) -> str:
    """The category llama.cpp gives a codepoint (``unicode_cpt_flags_from_cpt``).

    Args:
        cpt: a codepoint.

    Returns:
        One letter: ``L`` letter, ``N`` number, ``P`` punctuation, ``S`` symbol, ``M`` mark,
        ``Z`` separator, ``C`` control/format/private/surrogate, ``u`` unassigned; ``""`` for
        a value outside ``[0, 0x110000)`` (llama.cpp's all-zero flags).

    Examples:
        >>> [cpt_category(ord(c)) for c in "a1!+ \u0301\u4e00"]
        ['L', 'N', 'P', 'S', 'Z', 'M', 'L']
        >>> cpt_category(0x2FFC)  # assigned in Unicode 15.1, after Python 3.11's Unicode 14
        'S'
    """
    if not 0 <= cpt < MAX_CODEPOINTS:
        return ""
    return _CATEGORIES[bisect.bisect_right(_STARTS, cpt) - 1]


# --8<-- [end:cpt_category]


def _class_body(cpts: list[tuple[int, int]]) -> str:
    """The inside of a ``[...]`` regex class for inclusive codepoint ranges."""
    return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in cpts)


@cache
def category_class(categories: str) -> str:
    r"""The inside of a regex class matching every codepoint of these llama.cpp categories.

    Args:
        categories: category letters (see [`cpt_category`][]), or ``"s"`` for the
            whitespace set `WHITESPACE`.

    Returns:
        A string to put between ``[`` and ``]`` (``\UXXXXXXXX`` escapes and ranges).

    Examples:
        >>> import re
        >>> bool(re.fullmatch(f"[{category_class('L')}]+", "héllo"))
        True
        >>> bool(re.fullmatch(f"[{category_class('s')}]", "\x1c"))  # Python's \s says yes
        False
    """
    if categories == "s":
        return _class_body([(c, c) for c in sorted(WHITESPACE)])
    ends = [*_STARTS[1:], MAX_CODEPOINTS]
    ranges = [
        (a, b - 1)
        for a, b, cat in zip(_STARTS, ends, _CATEGORIES, strict=True)
        if cat in categories
    ]
    return _class_body(ranges)


# ---------------------------------------------------------------------------------------------
# GPT-2's byte-to-unicode alphabet
# ---------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> list[str]:
    """``unicode_byte_to_utf8_map``: printable Latin-1 stays, the rest moves to U+0100+."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


#: Byte ``b`` is spelled ``BYTE_TO_UNICODE[b]`` inside byte-level BPE tokens.
BYTE_TO_UNICODE: list[str] = _bytes_to_unicode()
#: The inverse of `BYTE_TO_UNICODE`.
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
_LATIN1_TO_GPT2 = {b: c for b, c in enumerate(BYTE_TO_UNICODE)}
_GPT2_TO_LATIN1 = {ord(c): b for b, c in enumerate(BYTE_TO_UNICODE)}
_ALPHABET = frozenset(BYTE_TO_UNICODE)


# --8<-- [start:byte_encode]
def byte_encode(word: str) -> str:
    r"""Spell a word's UTF-8 bytes with `BYTE_TO_UNICODE` (``unicode_byte_encoding_process``).

    Args:
        word: a pre-tokenized word (lone surrogates are encoded as llama.cpp's UTF-8
            encoder does, in three bytes).

    Returns:
        One character per byte.

    Examples:
        >>> byte_encode(" hé\n")
        'ĠhÃ©Ċ'
    """
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_LATIN1_TO_GPT2)


# --8<-- [end:byte_encode]


# --8<-- [start:byte_decode]
def byte_decode(text: str) -> bytes:
    r"""The bytes a byte-level BPE token stands for (``llama_decode_text``).

    A character outside the alphabet gives ``[UNK_BYTE_0x<its UTF-8 in hex><text>]``, as in
    llama.cpp (which appends the *whole* token text there).

    Args:
        text: the token's text from the vocabulary.

    Returns:
        The bytes.

    Examples:
        >>> byte_decode("ĠhÃ©Ċ")
        b' h\xc3\xa9\n'
        >>> byte_decode("a€")
        b'a[UNK_BYTE_0xe282aca\xe2\x82\xac]'
    """
    if _ALPHABET.issuperset(text):  # the usual case, at C speed
        return text.translate(_GPT2_TO_LATIN1).encode("latin-1")
    out = bytearray()
    for ch in text:
        b = UNICODE_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            utf8 = ch.encode("utf-8", "surrogatepass")
            out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8", "surrogatepass")
            out += b"]"
    return bytes(out)


# --8<-- [end:byte_decode]


# ---------------------------------------------------------------------------------------------
# The regex splits
# ---------------------------------------------------------------------------------------------

_L = category_class("L")
_N = category_class("N")
_W = category_class("s")

#: ``unicode_regex_split_custom_gpt2``'s expression, as llama.cpp spells it.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
#: ``unicode_regex_split_custom_llama3``'s expression (case-insensitive contractions spelled out).
LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: ``unicode_regex_split_custom_qwen2``: Llama 3's with single digits.
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

# --8<-- [start:CUSTOM_SPLITS]
#: What llama.cpp's hand-written scanners compute, as Python expressions over the table's
#: classes. Two differences from the expressions they are named after: the GPT-2 scanner ends
#: with ``\s+`` (GPT-2's own regex has it; llama.cpp's string lost it, its scanner did not),
#: and ``\s`` is the 25-codepoint set, so ``\x1c`` is "other", not whitespace.
CUSTOM_SPLITS: dict[str, str] = {
    GPT2_REGEX: (
        rf"'(?:[stmd]|re|ve|ll)| ?[{_L}]+| ?[{_N}]+| ?[^{_W}{_L}{_N}]+"
        rf"|[{_W}]+(?![^{_W}])|[{_W}]+"
    ),
    LLAMA3_REGEX: (
        rf"'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL])|[^\r\n{_L}{_N}]?[{_L}]+|[{_N}]{{1,3}}"
        rf"| ?[^{_W}{_L}{_N}]+[\r\n]*|[{_W}]*[\r\n]+|[{_W}]+(?![^{_W}])|[{_W}]+"
    ),
    QWEN2_REGEX: (
        rf"'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL])|[^\r\n{_L}{_N}]?[{_L}]+|[{_N}]"
        rf"| ?[^{_W}{_L}{_N}]+[\r\n]*|[{_W}]*[\r\n]+|[{_W}]+(?![^{_W}])|[{_W}]+"
    ),
}
# --8<-- [end:CUSTOM_SPLITS]

# \p{...} names that llama.cpp's collapsed std::regex path knows (k_ucat_enum): the letter
# subcategories all collapse to "letter".
_UCAT = {
    r"\p{N}": "N",
    r"\p{L}": "L",
    r"\p{P}": "P",
    r"\p{M}": "M",
    r"\p{S}": "S",
    r"\p{Lu}": "L",
    r"\p{Ll}": "L",
    r"\p{Lt}": "L",
    r"\p{Lm}": "L",
    r"\p{Lo}": "L",
}


# --8<-- [start:translate_regex]
def translate_regex(expr: str) -> str:
    r"""The Python expression that matches what llama.cpp's ``std::regex`` fallback matches.

    ``\p{X}`` becomes the class of category ``X`` (inside a ``[...]`` only its body),
    ``\s`` / ``\S`` the whitespace set and its complement, and ``$`` the end of the piece
    (ECMAScript's ``$``; Python's would also match before a final newline). Compile the
    result with ``re.ASCII`` (ECMAScript's ``\d`` and ``\w`` are ASCII).

    Args:
        expr: a pre-tokenizer expression as llama.cpp writes it.

    Returns:
        The Python expression.

    Raises:
        ValueError: ``\S`` inside a class (no llama.cpp pre-tokenizer does that).

    Examples:
        >>> import re
        >>> pat = re.compile(translate_regex(r"\p{N}+"), re.ASCII)
        >>> pat.findall("a12 ٣٤x")
        ['12', '٣٤']
    """
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "\\" and i + 1 < len(expr):
            name = expr[i : expr.find("}", i) + 1] if expr.startswith("\\p{", i) else ""
            if name in _UCAT:
                body = category_class(_UCAT[name])
                out.append(body if inside else f"[{body}]")
                i += len(name)
                continue
            nxt = expr[i + 1]
            if nxt == "s":
                out.append(_W if inside else f"[{_W}]")
            elif nxt == "S":
                if inside:
                    raise ValueError(f"\\S inside a character class is not supported: {expr!r}")
                out.append(f"[^{_W}]")
            else:
                out.append(expr[i : i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            c = r"\Z"
        out.append(c)
        i += 1
    return "".join(out)


# --8<-- [end:translate_regex]


@cache
def compile_split(expr: str) -> re.Pattern:
    """The compiled Python pattern for one llama.cpp pre-tokenizer expression."""
    if expr in CUSTOM_SPLITS:
        return re.compile(CUSTOM_SPLITS[expr])
    return re.compile(translate_regex(expr), re.ASCII)


# --8<-- [start:regex_split]
def regex_split(text: str, exprs: list[str] | tuple[str, ...]) -> list[str]:
    r"""Cut text into words with a pre-tokenizer's expressions (``unicode_regex_split``).

    Each expression splits every piece the previous ones made; matches and the text between
    them both become pieces (empty pieces are dropped: they would give no tokens).

    Args:
        text: the text (one fragment between special tokens).
        exprs: the expressions, as llama.cpp writes them (keys of `CUSTOM_SPLITS` use
            the hand-written scanners).

    Returns:
        The words, in order; ``"".join(words) == text``.

    Examples:
        >>> regex_split("I've 12345 cats!!\n\n", [r"\p{N}", GPT2_REGEX])
        ['I', "'ve", ' ', '1', '2', '3', '4', '5', ' cats', '!!', '\n\n']
        >>> regex_split("I've 12345 cats!!\n\n", [LLAMA3_REGEX])
        ['I', "'ve", ' ', '123', '45', ' cats', '!!\n\n']
    """
    pieces = [text] if text else []
    for expr in exprs:
        pattern = compile_split(expr)
        split: list[str] = []
        for piece in pieces:
            at = 0
            for m in pattern.finditer(piece):
                start, end = m.span()
                if start > at:
                    split.append(piece[at:start])
                if end > start:
                    split.append(piece[start:end])
                at = end
            if at < len(piece):
                split.append(piece[at:])
        pieces = split
    return pieces


# --8<-- [end:regex_split]
