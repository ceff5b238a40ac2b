"""Transcripts of real corpora onto the model's vocabulary, as people would say them.

`model/core/text.py:normalize_text` already lower-cases, folds accents, spells
integers, ordinals, decimals and percentages and drops punctuation. Corpus text
(Common Voice's sentences, Kaldi's `text`) has more written forms that are read
aloud differently from their digits; `normalize_transcript` rewrites those first:

- years: 1100-1999 and 2010-2099 standing alone are read in pairs ("1999" ->
  "nineteen ninety nine", "1905" -> "nineteen oh five", "1900" -> "nineteen
  hundred", "2024" -> "twenty twenty four"); 2000-2009 stay "two thousand five".
  A number with a thousands comma ("1,999"), a decimal part, an ordinal suffix, a
  currency sign before it or a percent sign after it is a quantity, not a year.
- decades: "1990s" / "the '90s" -> "nineteen nineties" / "the nineties".
- money: "$5" -> "five dollars", "$1" -> "one dollar", "$5.50" -> "five dollars
  fifty cents", "$2 million" -> "two million dollars"; likewise "£" (pounds,
  pence) and "€" (euros, cents).
- a few symbols and abbreviations: "+" plus, "=" equals, "@" at, "Mr." mister,
  "Mrs." missus, "Dr." doctor, "vs." versus, "etc." et cetera.

Everything else is `normalize_text`'s: other punctuation becomes a word break,
unicode quotes and apostrophes become "'" (kept only inside words: "don't"),
accented Latin letters lose their accents, ligatures are spelled out ("æ" ->
"ae"). Letters that stay outside the vocabulary after that (Greek, Cyrillic, CJK)
make `check_transcript` give a reason instead of a transcript: an importer
counts and reports such an utterance and never keeps it.
"""

from __future__ import annotations

import re
import unicodedata

from echoic.model.core.text import TextError, Vocabulary, normalize_text, number_words

_YEAR = re.compile(
    r"(?<![\d,.$£€])(?P<year>1[1-9]\d\d|20[1-9]\d)(?![\d%]|[.,]\d|st|nd|rd|th|s\b)",
    re.ASCII,
)
_DECADE = re.compile(r"(?<![\d,.$£€])(?:(?P<century>1[1-9]|20)|['’‘])?(?P<decade>\d0)s\b")
_CURRENCIES = {"$": ("dollar", "cent"), "£": ("pound", "penny"), "€": ("euro", "cent")}
_SCALE_WORDS = "thousand|million|billion|trillion"
_MONEY = re.compile(
    r"(?P<sign>[$£€])\s?(?P<whole>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<frac>\d+))?"
    rf"(?:\s+(?P<scale>{_SCALE_WORDS})\b)?"
)
_ABBREVIATIONS = {
    "mr": "mister",
    "mrs": "missus",
    "dr": "doctor",
    "vs": "versus",
    "etc": "et cetera",
}
_ABBREVIATION = re.compile(r"\b(?P<word>" + "|".join(_ABBREVIATIONS) + r")\.", re.IGNORECASE)
_SYMBOLS = str.maketrans({"+": " plus ", "=": " equals ", "@": " at "})


def year_words(year: int) -> str:
    """A year as read aloud: 1999 -> "nineteen ninety nine", 1905 -> "nineteen oh five"."""
    if not 1100 <= year <= 2099 or 2000 <= year <= 2009:
        return number_words(year)
    century, rest = divmod(year, 100)
    if rest == 0:
        return f"{number_words(century)} hundred"
    if rest < 10:
        return f"{number_words(century)} oh {number_words(rest)}"
    return f"{number_words(century)} {number_words(rest)}"


def _plural(words: str) -> str:
    """ "nineteen ninety" -> "nineteen nineties", "nineteen hundred" -> "nineteen hundreds"."""
    head, _, last = words.rpartition(" ")
    last = last[:-1] + "ies" if last.endswith("y") else last + "s"
    return f"{head} {last}".strip()


def _decade(m: re.Match[str]) -> str:
    decade = int(m["decade"])
    if m["century"]:
        return " " + _plural(year_words(int(m["century"]) * 100 + decade)) + " "
    return " " + _plural(number_words(decade) if decade else "hundred") + " "


def _money(m: re.Match[str]) -> str:
    unit, minor = _CURRENCIES[m["sign"]]
    whole = m["whole"]
    if m["scale"]:  # "$1.5 million" -> "1.5 million dollars"
        amount = whole + (f".{m['frac']}" if m["frac"] else "")
        return f" {amount} {m['scale']} {unit}s "
    words = f" {whole} {unit}" + ("" if whole == "1" else "s")
    if m["frac"] and len(m["frac"]) == 2 and int(m["frac"]):
        cents = int(m["frac"])
        plural = "pence" if minor == "penny" else f"{minor}s"
        words += f" {cents} {minor if cents == 1 else plural}"
    elif m["frac"] and int(m["frac"]):  # "$0.125": read the amount, not coins
        words = f" {whole}.{m['frac']} {unit}s"
    return words + " "


def normalize_transcript(text: str, vocab: Vocabulary | None = None) -> str:
    """Corpus text as the model's targets: the rules above, then `normalize_text`.

    "In 1999 Mr. Smith paid $5.50 (21st time)" -> "in nineteen ninety nine mister smith
    paid five dollars fifty cents twenty first time".
    """
    text = unicodedata.normalize("NFKC", text)
    text = _ABBREVIATION.sub(lambda m: " " + _ABBREVIATIONS[m["word"].lower()] + " ", text)
    text = _MONEY.sub(_money, text)
    text = _DECADE.sub(_decade, text)
    text = _YEAR.sub(lambda m: " " + year_words(int(m["year"])) + " ", text)
    return normalize_text(text.translate(_SYMBOLS), vocab)


def check_transcript(text: str, vocab: Vocabulary) -> tuple[str, str, str]:
    """(normalised transcript, "", "") or ("", reason, detail) when it cannot be used:
    reason "empty_text" (nothing left to say) or "out_of_vocabulary" (characters the
    vocabulary lacks, named in `detail`)."""
    normalized = normalize_transcript(text, vocab)
    if not normalized:
        return "", "empty_text", f"the transcript is empty after normalisation ({text!r})"
    try:
        vocab.encode(normalized)
    except TextError as e:
        return "", "out_of_vocabulary", str(e).replace(repr(normalized), repr(text))
    return normalized, "", ""
