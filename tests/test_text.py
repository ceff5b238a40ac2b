"""Transcript normalisation and the CTC vocabulary."""

from __future__ import annotations

import json
import string

import pytest

from echoic.model.core.text import (
    BLANK,
    DEFAULT_SYMBOLS,
    TextError,
    Vocabulary,
    normalize_text,
    number_words,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("Hello, World!", "hello world", id="case-and-punctuation"),
        pytest.param("  many \t spaces\n\nhere ", "many spaces here", id="whitespace"),
        pytest.param("Café naïve Ångström", "cafe naive angstrom", id="accents"),
        pytest.param("Ærø Straße", "aero strasse", id="ligatures"),
        pytest.param("It\u2019s Bob\u2018s", "it's bob's", id="curly-apostrophes"),
        pytest.param("\u201cquoted\u201d text", "quoted text", id="curly-quotes"),
        pytest.param("'tis the students' 'books'", "tis the students books", id="edge-apostrophes"),
        pytest.param("rock 'n' roll", "rock n roll", id="quoted-letter"),
        pytest.param("I have 42 cats", "i have forty two cats", id="number"),
        pytest.param("0 and 7", "zero and seven", id="small-numbers"),
        pytest.param(
            "999999", "nine hundred ninety nine thousand nine hundred ninety nine", id="max"
        ),
        pytest.param(
            "1,000,000 and 2024", "one million and two thousand twenty four", id="thousands"
        ),
        pytest.param("3.14", "three point one four", id="decimal"),
        pytest.param("the 21st and 3rd", "the twenty first and third", id="ordinals"),
        pytest.param("agent 007", "agent zero zero seven", id="leading-zeros"),
        pytest.param("50% off", "fifty percent off", id="percent"),
        pytest.param("Tom & Jerry", "tom and jerry", id="ampersand"),
        pytest.param("well-known (sort of) #1", "well known sort of one", id="symbols"),
        pytest.param("ＦＵＬＬ width", "full width", id="nfkc"),
        pytest.param("日本 ok", "日本 ok", id="unknown-letters-kept"),
        pytest.param("?!...", "", id="only-punctuation"),
        pytest.param("", "", id="empty"),
    ],
)
def test_normalize_text(text: str, expected: str) -> None:
    assert normalize_text(text) == expected


@pytest.mark.parametrize(
    ("n", "words"),
    [
        pytest.param(0, "zero", id="0"),
        pytest.param(13, "thirteen", id="13"),
        pytest.param(40, "forty", id="40"),
        pytest.param(105, "one hundred five", id="105"),
        pytest.param(1005, "one thousand five", id="1005"),
        pytest.param(20000, "twenty thousand", id="20000"),
        pytest.param(3_000_001, "three million one", id="3000001"),
    ],
)
def test_number_words(n: int, words: str) -> None:
    assert number_words(n) == words


def test_default_vocabulary_layout() -> None:
    vocab = Vocabulary()
    assert vocab.size == 29 == len(DEFAULT_SYMBOLS)
    assert vocab.blank_id == 0 and vocab.symbols[0] == BLANK
    assert vocab.symbols[1:3] == (" ", "'")
    assert vocab.encode("a z") == [3, 1, 28]


def test_encode_decode_round_trip() -> None:
    vocab = Vocabulary()
    text = "Don't panic: it's 42!"
    ids = vocab.encode(text)
    assert vocab.decode(ids) == normalize_text(text) == "don't panic it's forty two"


def test_decode_skips_blanks_and_rejects_bad_ids() -> None:
    vocab = Vocabulary()
    assert vocab.decode([0, 3, 0, 4]) == "ab"
    with pytest.raises(TextError, match="id 29 is outside the vocabulary"):
        vocab.decode([3, 29])


def test_out_of_vocabulary_error_names_the_characters() -> None:
    with pytest.raises(TextError, match=r"'λ' \(U\+03BB\), 'ω' \(U\+03C9\)"):
        Vocabulary().encode("ωλ alpha")


@pytest.mark.parametrize(
    ("symbols", "text", "normalized"),
    [
        pytest.param((BLANK, " ", "a", "b", "c"), "Abc, CAB", "abc cab", id="small"),
        pytest.param(
            (BLANK, " ", *string.digits, *string.ascii_lowercase),
            "Route 66",
            "route 66",
            id="digits-kept",
        ),
        pytest.param(
            (BLANK, " ", "é", *string.ascii_lowercase), "Café CAFÉ", "café café", id="accent-kept"
        ),
        pytest.param(
            (BLANK, " ", *string.ascii_lowercase), "Don't 'stop'", "dont stop", id="no-apostrophe"
        ),
        pytest.param(
            (BLANK, " ", "-", *string.ascii_lowercase), "well-known", "well-known", id="hyphen"
        ),
    ],
)
def test_custom_vocabulary(symbols: tuple[str, ...], text: str, normalized: str) -> None:
    vocab = Vocabulary(symbols)
    assert normalize_text(text, vocab) == normalized
    assert vocab.decode(vocab.encode(text)) == normalized


def test_vocabulary_list_round_trip() -> None:
    vocab = Vocabulary((BLANK, " ", "x", "y"))
    card = json.loads(json.dumps(vocab.to_list()))
    assert Vocabulary.from_list(card) == vocab


@pytest.mark.parametrize(
    ("symbols", "match"),
    [
        pytest.param((" ", BLANK, "a"), "must start with '<blank>'", id="blank-not-first"),
        pytest.param((BLANK,), "at least one symbol", id="blank-only"),
        pytest.param((BLANK, "a", "b", "a"), "duplicate symbols: 'a'", id="duplicate"),
        pytest.param((BLANK, "a", "th"), "must be one character", id="multi-char"),
        pytest.param((BLANK, "a", "B"), "'B'.*can never occur", id="upper-case"),
        pytest.param((BLANK, " ", "\t"), "can never occur", id="tab"),
        pytest.param([BLANK, "a"], "must be a tuple", id="list"),
    ],
)
def test_bad_vocabulary_is_rejected(symbols: tuple[str, ...], match: str) -> None:
    with pytest.raises(TextError, match=match):
        Vocabulary(symbols)
