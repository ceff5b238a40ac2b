"""Punctuation and capitals as tags on words: the one encoding that training and serving share.

A tagger reads lower-case written tokens ("the", "meeting", "3:30", "$25") and gives
each two tags: the mark that follows it (`MARKS`: none, comma, period, question) and
its case (`CASES`: lower, Capitalised, UPPER). `tags_of_prose` reads the tags off
punctuated English prose (what the tagger is trained on); `apply_tags` writes them
back onto tokens (what the server does with the tagger's output). `encode` turns
tokens into the tagger's inputs: a word id from the model's word list (0: not in it)
and the word's first and last `CHARS_PER_WORD // 2` characters as ids, so that a word
outside the list still shows its shape (digits, "-ly", "'s").

Colons and semicolons count as commas, exclamation marks as periods: the tagger only
learns the marks a transcript needs, and those are the ones it can be scored on.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

MARKS = ("", ",", ".", "?")  # tag id -> the mark written after the word
CASES = ("lower", "capitalised", "upper")  # tag id -> how the word is written
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789'$%:/.-"  # char id = index + 2 (1: other, 0: pad)
CHARS_PER_WORD = 12  # characters the tagger sees of a word: its first 6 and last 6
_MARK_OF = {",": 1, ";": 1, ":": 1, ".": 2, "!": 2, "?": 3}
# Abbreviations keep their own period: "mr." is one token, not "mr" + a sentence end.
ABBREVIATIONS = frozenset(
    "mr. mrs. ms. dr. st. jr. sr. vs. etc. e.g. i.e. a.m. p.m. no. prof. mt. inc. co. ltd.".split()
)
_OPENING = "\"'([{`“‘"
_CLOSING = "\"')]}`”’"


@dataclass(frozen=True)
class Tagged:
    """One word of prose: what the tagger reads, and the tags it should give."""

    token: str  # lower case, outer quotes and brackets and the mark after it removed
    mark: int  # index into MARKS
    case: int  # index into CASES; -1: the writer's choice (see tags_of_prose)


def case_of(word: str) -> int:
    letters = [c for c in word if c.isalpha()]
    if not letters or not letters[0].isupper():
        return 0
    if len(letters) > 1 and all(c.isupper() for c in letters):
        return 2
    return 1


def tags_of_prose(text: str) -> list[Tagged]:
    """Punctuated prose -> its words with tags: "Hello, world." -> hello/,/Cap world/./lower.
    A word whose capital is the writer's choice rather than the language's (after a colon
    or semicolon, or inside quotes: `Note: The file`, `"Go," he said`) gets case -1:
    nothing to learn or score there."""
    out: list[Tagged] = []
    free_case = False  # the next word's capital is a choice
    for raw in text.split():
        word = raw.lstrip(_OPENING)
        quoted = len(word) < len(raw)
        mark = 0
        ends_free = False
        while True:
            if word.lower() in ABBREVIATIONS:
                break
            if word and word[-1] in _CLOSING:
                word, ends_free = word[:-1], True
            elif word and word[-1] in _MARK_OF:
                ends_free = ends_free or word[-1] in ":;"
                mark = max(mark, _MARK_OF[word[-1]])  # "?!" is a question, ".," a period
                word = word[:-1]
            else:
                break
        if not word or not any(c.isalnum() for c in word):
            if out and mark:  # a mark standing alone ("wait - what ?") belongs to the word before
                out[-1] = Tagged(out[-1].token, max(out[-1].mark, mark), out[-1].case)
            free_case = free_case or ends_free
            continue
        case = -1 if (free_case or quoted) and case_of(word) else case_of(word)
        out.append(Tagged(word.lower(), mark, case))
        free_case = ends_free
    return out


def apply_case(token: str, case: int) -> str:
    if case == 2:
        return token.upper()
    if case == 1:
        for i, c in enumerate(token):  # "$25" has no letter to raise; "'tis" raises the t
            if c.isalpha():
                return token[:i] + c.upper() + token[i + 1 :]
    return token


MAX_ACRONYM = 3  # letters of the longest word the tagger may write in capitals ("FBI", "USA")


def spoken_case(case: int, token: str) -> int:
    """The tagger's case for a spoken word, all capitals only for a short one: it wrote
    "LAID" for "laid", and a shouted common word reads worse than a name ("Nasa")."""
    if case == 2 and len(token) > MAX_ACRONYM:
        return 1
    return case


def written_cases(tokens: Sequence[str], marks: Sequence[int], cases: Sequence[int]) -> list[int]:
    """The case each token is written in: its tag, but a sentence starts with a capital
    whatever its tag says (the first token, and each after a period or question mark),
    unless it starts with no letter ("5th", "$25")."""
    out = []
    starts_sentence = True
    for token, mark, case in zip(tokens, marks, cases, strict=True):
        out.append(max(case, 1) if starts_sentence and token[:1].isalpha() else case)
        starts_sentence = MARKS[mark] in (".", "?")
    return out


def apply_tags(tokens: Sequence[str], marks: Sequence[int], cases: Sequence[int]) -> list[str]:
    """Tokens written with their tags: ["hello", "world"], [1, 2], [1, 0] -> ["Hello,", "world."]
    (cased by `written_cases`). A token that already ends in a period (an abbreviation)
    takes no second one."""
    out = []
    for token, mark, case in zip(tokens, marks, written_cases(tokens, marks, cases), strict=True):
        word = apply_case(token, case)
        text = MARKS[mark]
        if word.endswith(".") and text == ".":
            text = ""
        out.append(word + text)
    return out


_WORD_SHAPE = re.compile(r"\d")


@dataclass(frozen=True)
class WordList:
    """The tagger's known words: id = position + 2 (0: padding, 1: any other word)."""

    words: tuple[str, ...]  # most frequent words of the training text, most frequent first

    @cached_property
    def index(self) -> dict[str, int]:
        return {w: i + 2 for i, w in enumerate(self.words)}

    def id(self, token: str) -> int:
        return self.index.get(token, 1)


def char_ids(token: str) -> list[int]:
    half = CHARS_PER_WORD // 2
    token = _WORD_SHAPE.sub("0", token)  # every digit looks the same: "1999" and "2024" alike
    chars = token[:half].ljust(half, "\0") + token[-half:].rjust(half, "\0")
    return [0 if c == "\0" else CHARS.find(c) + 2 for c in chars]  # find: -1 -> 1, "other"


def encode(tokens: Sequence[str], words: WordList) -> tuple[np.ndarray, np.ndarray]:
    """The tagger's inputs for one sequence: word ids (T,) int64, char ids (T, C) int64."""
    word_ids = np.array([words.id(t) for t in tokens], dtype=np.int64)
    chars = np.array([char_ids(t) for t in tokens], dtype=np.int64).reshape(
        len(tokens), CHARS_PER_WORD
    )
    return word_ids, chars


PIECES_PER_WORD = 8  # word pieces a token keeps: a longer one (a path, a digit run) its ends
PIECE_CHARS = 100  # a longer run of letters or digits is [UNK], as BERT's tokenizer has it
SEEN_TOKENS = 100_000  # tokens whose pieces a PieceList keeps (then it starts afresh)


@dataclass(frozen=True)
class PieceList:
    """A pretrained encoder's word pieces (uncased WordPiece, as BERT's tokenizer splits
    words): id = position; "##" marks a piece that continues a word. The tagger reads
    each token as its pieces and tags it at its first piece (case) and its last (mark)."""

    pieces: tuple[str, ...]  # the encoder's vocabulary, [PAD] [UNK] [CLS] [SEP] among them

    @cached_property
    def index(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.pieces)}

    @cached_property
    def _seen(self) -> dict[str, list[int]]:
        return {}

    def _word(self, word: str) -> list[int]:
        """Greedy longest match first, as WordPiece does; a word with a character no piece
        has, or of more than PIECE_CHARS characters (matching is quadratic in them), is
        [UNK]."""
        if len(word) > PIECE_CHARS:
            return [self.index["[UNK]"]]
        out, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.index:
                    out.append(self.index[piece])
                    start = end
                    break
            else:
                return [self.index["[UNK]"]]
        return out

    def ids(self, token: str) -> list[int]:
        """One token's piece ids, split as BERT's uncased tokenizer splits text
        (`bert_words`: "don't" -> don ' t, "$2 million" -> $ 2 million), each part matched
        to pieces; at most PIECES_PER_WORD (its first and last halves); a token with
        nothing to read (spaces, control characters) is [UNK]."""
        if (seen := self._seen.get(token)) is not None:
            return seen
        ids = [i for part in bert_words(token) for i in self._word(part)]
        ids = ids or [self.index["[UNK]"]]
        if len(ids) > PIECES_PER_WORD:
            half = PIECES_PER_WORD // 2
            ids = ids[:half] + ids[-half:]
        if len(self._seen) >= SEEN_TOKENS:  # a server's transcripts bring new tokens for ever
            self._seen.clear()
        self._seen[token] = ids
        return ids

    def runs(self, tokens: Sequence[str], positions: int) -> list[list[str]]:
        """`tokens` in runs whose pieces, with [CLS] and [SEP], fit an encoder's `positions`
        (a token is never split across two; one of more than PIECES_PER_WORD pieces cannot
        be, as positions hold at least 2 + PIECES_PER_WORD)."""
        runs: list[list[str]] = [[]]
        held = 2  # [CLS] and [SEP]
        for token in tokens:
            n = len(self.ids(token))
            if runs[-1] and held + n > positions:
                runs.append([])
                held = 2
            runs[-1].append(token)
            held += n
        return runs

    def encode(self, tokens: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tagger's inputs for one sequence: piece ids (S,) from [CLS] to [SEP], and each
        token's first and last piece's position (T,), int64."""
        ids, first, last = [self.index["[CLS]"]], [], []
        for token in tokens:
            first.append(len(ids))
            ids += self.ids(token)
            last.append(len(ids) - 1)
        ids.append(self.index["[SEP]"])
        return (np.array(ids, np.int64), np.array(first, np.int64), np.array(last, np.int64))


def _cjk(c: str) -> bool:
    """A CJK ideograph: BERT's tokenizer reads each as a word of its own."""
    cp = ord(c)
    return any(lo <= cp <= hi for lo, hi in (
        (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))  # fmt: skip


def _bert_punctuation(c: str) -> bool:
    """What BERT's tokenizer splits off as a word of its own: every ASCII character that
    is not a letter, digit or space ("$" too), and Unicode punctuation (P*); other symbols
    ("£", "°") stay inside the word."""
    cp = ord(c)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(c).startswith("P")


def bert_words(text: str) -> list[str]:
    """`text` as BERT's uncased BasicTokenizer splits it, for its WordPiece vocabulary:
    control and format characters dropped, every space a break, each CJK ideograph and
    each punctuation character a word of its own, lower case, accents dropped."""
    kept = []
    for c in unicodedata.normalize("NFC", text):
        if c in " \t\n\r" or unicodedata.category(c) == "Zs":
            kept.append(" ")
        elif ord(c) in (0, 0xFFFD) or unicodedata.category(c).startswith("C"):
            continue
        else:
            kept.append(f" {c} " if _cjk(c) else c)
    words: list[str] = []
    for word in "".join(kept).split():
        plain = "".join(ch for ch in unicodedata.normalize("NFD", word.lower())
                        if unicodedata.category(ch) != "Mn")  # fmt: skip
        start = 0
        for i, ch in enumerate(plain):
            if _bert_punctuation(ch):
                words += [w for w in (plain[start:i], ch) if w]
                start = i + 1
        if start < len(plain):
            words.append(plain[start:])
    return words


def end_sentence(mark_logits: np.ndarray) -> list[int]:
    """Marks from the tagger's logits (T, len(MARKS)) for one final result: the best mark
    of each word, and the last word's a sentence end (a period or a question mark), since
    a final result is a whole utterance."""
    marks = mark_logits.argmax(-1).tolist()
    if marks:
        marks[-1] = 3 if mark_logits[-1, 3] > mark_logits[-1, 2] else 2
    return marks
