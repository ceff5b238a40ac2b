"""Text: the output vocabulary and the normalisation that maps transcripts onto it.

Training targets and evaluation references go through `normalize_text`, so a
model is trained and scored on the same spelling: lower case, no accents,
numbers written out, punctuation gone, apostrophes only inside words. Letters
outside the vocabulary are left in on purpose, so `Vocabulary.encode` can name
them instead of a transcript silently losing words.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Literal

BLANK = "<blank>"
WORD_START = "\u2581"  # "▁": SentencePiece's mark on a token that begins a word
DEFAULT_SYMBOLS: tuple[str, ...] = (BLANK, " ", "'", *string.ascii_lowercase)


class TextError(ValueError):
    """A transcript or vocabulary that cannot be used; the message names the culprit."""


@dataclass(frozen=True)
class Vocabulary:
    """CTC output symbols: id 0 is the blank; every other symbol is one character
    ("chars", " " between words), or a subword token ("bpe": a SentencePiece piece, a
    word starting at each token that begins with "▁")."""

    symbols: tuple[str, ...] = DEFAULT_SYMBOLS  # output symbols in id order; blank first
    token_type: Literal["chars", "bpe"] = "chars"  # what a symbol after the blank is

    def __post_init__(self) -> None:
        symbols = self.symbols
        if not isinstance(symbols, tuple) or not all(isinstance(s, str) for s in symbols):
            raise TextError(f"vocabulary symbols must be a tuple of strings, got {symbols!r}")
        if len(symbols) < 2 or symbols[0] != BLANK:
            raise TextError(f"vocabulary must start with {BLANK!r} and have at least one symbol")
        duplicates = sorted(s for s, n in Counter(symbols).items() if n > 1)
        if duplicates:
            raise TextError(f"vocabulary has duplicate symbols: {_show(duplicates)}")
        if self.token_type == "bpe":
            bad = [s for s in symbols[1:] if not s or s != s.strip() or " " in s]
            if bad:
                raise TextError(f"subword tokens must be non-empty and hold no space: {bad!r}")
            return
        if self.token_type != "chars":
            raise TextError(f"token_type must be 'chars' or 'bpe', got {self.token_type!r}")
        bad = [s for s in symbols[1:] if len(s) != 1]
        if bad:
            raise TextError(f"vocabulary symbols after the blank must be one character: {bad!r}")
        # normalize_text lower-cases and turns all whitespace into " ": other forms never occur.
        unreachable = [s for s in symbols[1:] if s != s.lower() or (s.isspace() and s != " ")]
        if unreachable:
            raise TextError(
                f"vocabulary symbols {_show(unreachable)} can never occur after normalisation "
                "(text is lower-cased and whitespace becomes ' ')"
            )

    @property
    def blank_id(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return len(self.symbols)

    @cached_property
    def index(self) -> Mapping[str, int]:
        """Symbol -> id, the blank excluded."""
        return {s: i for i, s in enumerate(self.symbols) if i != self.blank_id}

    @cached_property
    def pieces(self) -> tuple[tuple[bool, str], ...]:
        """Per id, (whether the symbol begins a word, the text it adds to that word): " "
        begins one and adds nothing, "▁the" begins one with "the", "s" or "ing" add to
        the word in progress, the blank adds nothing."""
        out = [(False, "")]
        for s in self.symbols[1:]:
            if self.token_type == "chars":
                out.append((True, "") if s == " " else (False, s))
            else:
                out.append((s.startswith(WORD_START), s.removeprefix(WORD_START)))
        return tuple(out)

    def encode(self, text: str) -> list[int]:
        """Normalise `text` and map it to ids; TextError names characters outside the vocabulary."""
        if self.token_type != "chars":
            raise TextError(
                "a subword vocabulary cannot encode text without its tokenizer (sentencepiece)"
            )
        normalized = normalize_text(text, self)
        unknown = sorted({c for c in normalized if c not in self.index})
        if unknown:
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise TextError(
                f"characters outside the vocabulary: {_show(unknown)} (in {shown!r}); "
                "fix the transcript or train with a vocabulary that has them"
            )
        return [self.index[c] for c in normalized]

    def decode(self, ids: Iterable[int]) -> str:
        """Map ids to text; blanks are skipped (no repeat collapsing: see decoding). Subword
        tokens are joined, a space before each that begins a word but the first."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.size:
                raise TextError(f"id {i} is outside the vocabulary (size {self.size})")
            if i != self.blank_id:
                out.append(self.symbols[i])
        if self.token_type == "chars":
            return "".join(out)
        return " ".join("".join(out).replace(WORD_START, " ").split())

    def to_list(self) -> list[str]:
        """JSON-safe form for model cards and checkpoints."""
        return list(self.symbols)

    @classmethod
    def from_list(cls, symbols: Iterable[str], token_type: str = "chars") -> Vocabulary:
        return cls(tuple(symbols), token_type)  # type: ignore[arg-type]


def _show(chars: Iterable[str]) -> str:
    return ", ".join(f"{c!r} (U+{ord(c):04X})" if len(c) == 1 else repr(c) for c in chars)


# ---------------------------------------------------------------- numbers

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
_ORDINAL_WORDS = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}


def _below_thousand(n: int) -> list[str]:
    words = []
    if n >= 100:
        words += [_ONES[n // 100], "hundred"]
        n %= 100
    if n >= 20:
        words.append(_TENS[n // 10])
        n %= 10
        if n:
            words.append(_ONES[n])
    elif n or not words:
        words.append(_ONES[n])
    return words


def number_words(n: int) -> str:
    """Cardinal in words: 42 -> "forty two", 1005 -> "one thousand five"."""
    if n < 0:
        return "minus " + number_words(-n)
    if n >= 10**15:
        return " ".join(_ONES[int(d)] for d in str(n))
    words: list[str] = []
    for scale, name in _SCALES:
        if n >= scale:
            words += [*_below_thousand(n // scale), name]
            n %= scale
    if n or not words:
        words += _below_thousand(n)
    return " ".join(words)


def _ordinal_words(n: int) -> str:
    words = number_words(n).split()
    last = words[-1]
    if last in _ORDINAL_WORDS:
        words[-1] = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return " ".join(words)


_NUMBER = re.compile(
    r"(?<![0-9])(?P<int>[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.(?P<frac>[0-9]+))?"
    r"(?P<ord>st|nd|rd|th)?(?![0-9])",
    re.ASCII,
)


def _spell_number(m: re.Match[str]) -> str:
    digits = m["int"].replace(",", "")
    if len(digits) > 1 and digits.startswith("0"):  # "007", codes: read digit by digit
        words = " ".join(_ONES[int(d)] for d in digits)
    elif m["ord"] and not m["frac"]:
        words = _ordinal_words(int(digits))
    else:
        words = number_words(int(digits))
    if m["frac"]:
        words += " point " + " ".join(_ONES[int(d)] for d in m["frac"])
        if m["ord"]:
            words += " " + m["ord"]
    return f" {words} "


# ---------------------------------------------------------------- characters

_APOSTROPHES = str.maketrans(dict.fromkeys("\u2018\u2019\u201b\u02bc\u02b9\u2032\u0060\u00b4", "'"))
_WORDS_FOR_SYMBOLS = {"%": " percent ", "&": " and "}
# Letters that Unicode does not decompose into a base letter and a mark.
_LIGATURES = {"æ": "ae", "œ": "oe", "ø": "o", "ł": "l", "đ": "d", "ð": "d", "þ": "th", "ı": "i"}
_LETTER_APOSTROPHE = re.compile(r"(?<=[^\W\d_])'(?=[^\W\d_])")


@lru_cache(maxsize=8192)
def _fold_char(c: str, keep: frozenset[str]) -> str:
    """One lower-cased character to its normalised form (possibly several characters)."""
    if c in keep:
        return c
    if c in _WORDS_FOR_SYMBOLS:
        return _WORDS_FOR_SYMBOLS[c]
    if c.isspace():
        return " "
    folded = _LIGATURES.get(c) or c.casefold()
    base = "".join(
        ch for ch in unicodedata.normalize("NFKD", folded) if not unicodedata.combining(ch)
    )
    out = []
    for ch in base:
        if ch in keep or ch == "'" or unicodedata.category(ch)[0] in "LM":
            out.append(ch)  # letters stay, in or out of the vocabulary (encode reports them)
        else:
            out.append(" ")  # punctuation, symbols, digits of other scripts
    return "".join(out)


def normalize_text(text: str, vocab: Vocabulary | None = None) -> str:
    """Normalise a transcript for training and scoring.

    "It’s 42% Café & co." -> "it's forty two percent cafe and co". Symbols of
    `vocab` (default: the default vocabulary) are kept as they are, so a
    vocabulary with digits or accented letters keeps those.
    """
    keep = frozenset((vocab or _DEFAULT_VOCAB).symbols[1:])
    text = unicodedata.normalize("NFKC", text.translate(_APOSTROPHES)).lower()
    if not set("0123456789") <= keep:
        text = _NUMBER.sub(_spell_number, text)
    text = "".join(_fold_char(c, keep) for c in text)
    # Apostrophes count only between letters ("don't"), not as quotes ('hello').
    inner = "\x00"
    text = _LETTER_APOSTROPHE.sub(inner, text).replace("'", " ")
    text = text.replace(inner, "'" if "'" in keep else "")
    return " ".join(text.split())


_DEFAULT_VOCAB = Vocabulary()
