"""The text a slot streams (reference/tools/server/text.py): UTF-8 and stop strings.

Laws, for any text and any split of its UTF-8 bytes into pieces (splits inside multi-byte
characters included):

- with no stop word in the text, everything pushed + flush == the text;
- with a stop word in it, what was sent is the text cut at an occurrence of the word
  reported, and never contains a stop word; the cut is at the earliest occurrence when no
  stop word is inside another (otherwise, as in llama.cpp, a short word that completes first
  can win over a longer one that started earlier: the cut lies between the earliest
  occurrence and the first completed one, and pushing one character at a time cuts at the
  first completed one);
- at every step, what was sent so far is a prefix of the final content (a partial stop
  word is held until it is known not to be one);
- ``common_prefix`` is the longest common prefix.

Plus llama.cpp's chunking on concrete cases (a partial match holds the whole unsent text,
an incomplete character holds everything).
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.tools.server.errors import ServerError
from reference.tools.server.text import StopText, common_prefix, find_partial_stop

# small alphabets so stop words occur and partial matches are frequent
ALPHABET = "ab é€🦙\n"
texts = st.text(alphabet=ALPHABET, max_size=40)
words = st.text(alphabet=ALPHABET, min_size=1, max_size=4)


@st.composite
def split_bytes(draw, data: bytes) -> list[bytes]:
    """``data`` cut at random byte offsets (inside characters too), empty pieces allowed."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    bounds = [0, *cuts, len(data)]
    return [data[i:j] for i, j in pairwise(bounds)]


def run(stop: list[str], pieces: list[bytes]) -> tuple[StopText, list[str], str | None]:
    """Push every piece until a stop word; return the StopText, what each step sent, the word."""
    s, sent = StopText(stop), []
    for piece in pieces:
        out, word = s.push(piece)
        sent.append(out)
        if word is not None:
            return s, sent, word
    sent.append(s.flush())
    return s, sent, None


@settings(deadline=None)
@given(st.data(), texts, st.lists(words, max_size=3))
def test_no_stop_word_everything_is_sent(data, text, stop):
    stop = [w for w in stop if w not in text]
    pieces = data.draw(split_bytes(text.encode()))
    s, sent, word = run(stop, pieces)
    assert word is None and "".join(sent) == text == s.text and s.stopping_word == ""


def occurrences(text: str, stop: list[str]) -> list[tuple[int, int, str]]:
    """Every occurrence of every stop word: ``(start, end, word)``."""
    return [(i, i + len(w), w) for w in stop for i in range(len(text)) if text.startswith(w, i)]


def cut(text: str, stop: list[str], pieces: list[bytes]) -> tuple[str, str | None]:
    """Run ``StopText``; check the content is what was sent, cut at the word it reports."""
    s, sent, word = run(stop, pieces)
    content = "".join(sent)
    assert content == s.text and s.stopping_word == (word or "")
    assert word is not None and text[len(content):].startswith(word)
    assert not any(w in content for w in stop)
    return content, word


@settings(deadline=None)
@given(st.data(), texts, texts, st.lists(words, min_size=1, max_size=3))
def test_stop_word_cuts_at_the_first_completed_occurrence(data, before, after, stop):
    text = before + data.draw(st.sampled_from(stop)) + after
    hits = occurrences(text, stop)
    end = min(e for _, e, _ in hits)  # where a stop word first completes
    first_done = min(s for s, e, _ in hits if e == end)
    # any split: the cut is at an occurrence no later than the first completed one, and no
    # earlier than the earliest occurrence (a longer word that had not completed yet)
    content, _ = cut(text, stop, data.draw(split_bytes(text.encode())))
    assert min(s for s, _, _ in hits) <= len(content) <= first_done
    # one character a piece: exactly the first completed occurrence (earliest on a tie)
    content, _ = cut(text, stop, [c.encode() for c in text])
    assert len(content) == first_done


@settings(deadline=None)
@given(st.data(), texts, texts, st.lists(words, min_size=1, max_size=3))
def test_stop_word_cut_does_not_depend_on_the_split(data, before, after, stop):
    # no stop word inside another: every split cuts before the earliest occurrence
    stop = [w for w in stop if not any(w != v and v in w for v in stop)]
    text = before + data.draw(st.sampled_from(stop)) + after
    earliest = min(s for s, _, _ in occurrences(text, stop))
    content, _ = cut(text, stop, data.draw(split_bytes(text.encode())))
    assert content == text[:earliest]


@settings(deadline=None)
@given(st.data(), texts, st.lists(words, max_size=3))
def test_sent_text_is_always_a_prefix_of_the_content(data, text, stop):
    pieces = data.draw(split_bytes(text.encode()))
    s, sent, _ = run(stop, pieces)
    content = s.text
    for k in range(len(sent) + 1):
        assert content.startswith("".join(sent[:k]))


@settings(deadline=None)
@given(st.data(), st.binary(max_size=24))
def test_invalid_bytes_are_replaced_as_a_whole_decode(data, raw):
    pieces = data.draw(split_bytes(raw))
    _, sent, _ = run([], pieces)
    assert "".join(sent) == raw.decode("utf-8", "replace")


@settings(deadline=None)
@given(st.lists(st.integers(0, 3), max_size=8), st.lists(st.integers(0, 3), max_size=8))
def test_common_prefix_laws(a, b):
    n = common_prefix(a, b)
    assert n == common_prefix(b, a) and 0 <= n <= min(len(a), len(b))
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]
    assert common_prefix(a, a) == len(a) and common_prefix(a, a + b) == len(a)


def test_partial_match_holds_the_whole_unsent_text():
    # llama.cpp sends nothing for a token whose text ends with a stop word's prefix
    s = StopText(["world!"])
    assert s.push(b"Hello") == ("Hello", None)
    assert s.push(b" wor") == ("", None)
    assert s.push(b"ld") == ("", None)
    assert s.push(b"?") == (" world?", None)
    assert s.flush() == "" and s.text == "Hello world?"


def test_held_prefix_is_sent_by_flush():
    s = StopText(["###"])
    assert [s.push(p) for p in [b"x", b"#", b"#"]] == [("x", None), ("", None), ("", None)]
    assert s.flush() == "##"


def test_incomplete_character_holds_everything():
    s = StopText([])
    assert s.push(b"a\xe2\x82") == ("", None)  # 'a' waits with the cut euro sign
    assert s.push(b"\xac") == ("a€", None)


def test_stop_word_before_a_split_character_is_found():
    # llama.cpp's byte window (len(word) + len(last token)) would miss STOP here
    s = StopText(["STOP"])
    assert s.push(b"xSTOP\xe2") == ("", None)
    assert s.push(b"\x82\xac") == ("x", "STOP")


def test_earliest_match_wins_over_list_order():
    s = StopText(["cd", "bcd"])
    assert s.push(b"abcde") == ("a", "bcd")


def test_empty_stop_words_are_ignored():
    s = StopText(["", "z"])
    assert s.push(b"ab") == ("ab", None) and s.stop == ["z"]


def test_push_after_stop_is_an_error():
    s = StopText(["b"])
    assert s.push(b"ab") == ("a", "b")
    with pytest.raises(ServerError, match="push after the stop word 'b'"):
        s.push(b"c")
    assert s.flush() == "" and s.text == "a"


def test_find_partial_stop_takes_the_longest_prefix():
    assert find_partial_stop("xaba", ["abab"]) == 1
    assert find_partial_stop("xab", ["b", "abc"]) == 1
