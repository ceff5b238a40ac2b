"""Sentence sources for `echoic synth`: plain text files and the Debian fortunes.

`read_sentences` turns any text file (one sentence a line) into transcripts the
default vocabulary can encode, counting the lines it had to skip.

`fortune_sentences` extracts clean English sentences from the fortune cookie
files (package `fortunes`): records are split on sentence ends, attributions
("-- Name") are cut off, anything with URLs, digits, acronyms or odd characters is
dropped, and duplicates (by normalised text) are removed. `split_corpus` shuffles
them with a seed and holds some out, so no held-out sentence is ever heard in
training. Everything is deterministic: same files and seed, same output.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from echoic.model.core.text import TextError, Vocabulary, normalize_text

DEFAULT_FORTUNES_DIR = Path("/usr/share/games/fortunes")


@dataclass(frozen=True)
class Sentence:
    line: int  # 1-based line number in the source file
    text: str  # normalised transcript, encodable by the vocabulary


@dataclass(frozen=True)
class TextSkips:
    empty: int  # lines that normalise to nothing, count
    unencodable: int  # lines with characters outside the vocabulary, count
    first_unencodable: int | None  # 1-based line number of the first such line

    @property
    def total(self) -> int:
        return self.empty + self.unencodable


def clean_transcript(raw: str, vocabulary: Vocabulary) -> str | None:
    """The normalised transcript of `raw`, or None if it is empty or not encodable."""
    text = normalize_text(raw)
    if not text:
        return None
    try:
        vocabulary.encode(text)
    except TextError:
        return None
    return text


def read_sentences(
    path: str | Path, limit: int | None = None, vocabulary: Vocabulary | None = None
) -> tuple[list[Sentence], TextSkips]:
    """The first `limit` usable sentences of a text file, one a line, and what was skipped."""
    vocabulary = vocabulary or Vocabulary()
    sentences: list[Sentence] = []
    empty = unencodable = 0
    first_bad: int | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, raw in enumerate(f, start=1):
            if limit is not None and len(sentences) >= limit:
                break
            text = normalize_text(raw)
            if not text:
                empty += 1
                continue
            try:
                vocabulary.encode(text)
            except TextError:
                unencodable += 1
                first_bad = first_bad or number
                continue
            sentences.append(Sentence(line=number, text=text))
    return sentences, TextSkips(empty=empty, unencodable=unencodable, first_unencodable=first_bad)


# --- fortunes -----------------------------------------------------------------

# A sentence ends at . ! or ? (plus closing quotes) before whitespace and a capital.
_BOUNDARY = re.compile(r"([.!?][\"')]*)\s+(?=[\"'(]*[A-Z])")
# Words whose trailing period does not end a sentence.
_ABBREVIATIONS = frozenset(
    "Mr Mrs Ms Dr St Jr Sr Prof Rev Gen Col Capt Lt Sgt Mt Ft vs etc Inc Ltd Co".split()
)
_ALLOWED = re.compile(r"[A-Za-z ,.;!?'\"-]+")
_URL = re.compile(r"https?|www|\.com|\.org|\.net|\.edu", re.IGNORECASE)
_ACRONYM = re.compile(r"\b[A-Z]{2,}\b")


def split_into_sentences(paragraph: str) -> list[str]:
    """Split running text on sentence ends, not on abbreviations or initials."""
    pieces: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(paragraph):
        head = paragraph[start : match.end(1)]
        last_word = head.split()[-1].strip("\"'()").rstrip(".!?")
        if match.group(1).startswith(".") and (
            last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word != "I")
        ):
            continue
        pieces.append(head.strip())
        start = match.end()
    tail = paragraph[start:].strip()
    if tail:
        pieces.append(tail)
    return pieces


def _is_verse(lines: Sequence[str]) -> bool:
    """Most line breaks fall mid-sentence before a capital: a poem or song, not prose."""
    breaks = list(zip(lines, lines[1:], strict=False))
    capitalised = sum(1 for a, b in breaks if a[-1:] not in '.!?:"' and b[:1].isupper())
    return bool(breaks) and capitalised * 2 >= len(breaks)


def fortune_records(path: Path) -> Iterable[str]:
    """The prose records of one fortune file, attributions cut off, whitespace collapsed."""
    text = path.read_text(encoding="utf-8", errors="replace")
    for record in re.split(r"^%\s*$", text, flags=re.MULTILINE):
        kept: list[str] = []
        for line in record.splitlines():
            if line.strip().startswith("--"):
                break  # the attribution and anything after it
            if line.strip():
                kept.append(line.strip())
        if _is_verse(kept):
            continue
        paragraph = " ".join(kept).replace(" -- ", ", ")
        paragraph = re.sub(r"\s+", " ", paragraph).strip()
        if paragraph:
            yield paragraph


def is_clean_sentence(sentence: str, min_words: int, max_words: int) -> bool:
    """Plain English prose of a speakable length: no URLs, digits, acronyms or symbols."""
    if not _ALLOWED.fullmatch(sentence) or _URL.search(sentence) or _ACRONYM.search(sentence):
        return False
    if sentence[-1] not in ".!?" or sentence.count('"') % 2 or "--" in sentence:
        return False
    if ".." in sentence or re.search(r"\.\w", sentence):  # ellipses, "sci.space", "C.S."
        return False
    return min_words <= len(sentence.split()) <= max_words


def fortune_files(directory: str | Path = DEFAULT_FORTUNES_DIR) -> list[Path]:
    """The fortune text files in a directory, sorted; index (.dat) files and links skipped."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"no fortunes directory at {directory} (apt-get install fortunes fortunes-min)"
        )
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8")
    )


def fortune_sentences(
    files: Sequence[str | Path],
    min_words: int = 3,
    max_words: int = 20,
    vocabulary: Vocabulary | None = None,
) -> list[str]:
    """Clean, distinct (by normalised text) sentences from fortune files, in file order."""

    def candidates() -> Iterator[str]:
        for path in files:
            for record in fortune_records(Path(path)):
                for sentence in split_into_sentences(record):
                    yield sentence.strip("'\"")  # outer quotes of a quoted remark

    pairs = _clean_distinct(candidates(), min_words, max_words, vocabulary)
    return [sentence for sentence, _ in pairs]


def _clean_distinct(
    sentences: Iterable[str], min_words: int, max_words: int, vocabulary: Vocabulary | None
) -> Iterator[tuple[str, str]]:
    """(sentence, its normalised transcript) for each clean sentence (`is_clean_sentence`)
    the vocabulary can encode whose transcript has not come before."""
    vocabulary = vocabulary or Vocabulary()
    seen: set[str] = set()
    for sentence in sentences:
        if not sentence or not is_clean_sentence(sentence, min_words, max_words):
            continue
        key = clean_transcript(sentence, vocabulary)
        if key is not None and key not in seen:
            seen.add(key)
            yield sentence, key


DEFAULT_WORDNET_DIR = Path("/usr/share/wordnet")


def wordnet_sentences(
    directory: str | Path = DEFAULT_WORDNET_DIR,
    min_words: int = 3,
    max_words: int = 30,
    vocabulary: Vocabulary | None = None,
) -> list[str]:
    """WordNet's example sentences and glosses (package `wordnet-base`), clean and distinct
    by normalised text: plain modern English beyond the fortunes, for a language model.
    A gloss ("breathe with great difficulty, as when ...") holds its examples in quotes;
    each example and each `;`-separated definition is one sentence."""
    directory = Path(directory)
    files = sorted(directory.glob("data.*"))
    if not files:
        hint = "apt-get install wordnet-base"
        raise FileNotFoundError(f"no WordNet data.* files in {directory} ({hint})")

    def candidates() -> Iterator[str]:
        for path in files:
            for line in path.read_text(encoding="latin-1").splitlines():
                if line.startswith("  ") or "|" not in line:  # the licence header
                    continue
                gloss = line.split("|", 1)[1]
                examples = re.findall(r'"([^"]+)"', gloss)
                definitions = re.sub(r'"[^"]*"', "", gloss).split(";")
                for sentence in (*examples, *definitions):
                    sentence = sentence.strip()
                    if sentence and sentence[-1] not in ".!?":
                        sentence += "."  # a definition has no full stop of its own
                    yield sentence

    return [key for _, key in _clean_distinct(candidates(), min_words, max_words, vocabulary)]


def split_corpus(sentences: Sequence[str], held_out: int, seed: int) -> tuple[list[str], list[str]]:
    """Shuffle with `seed` and hold out `held_out` sentences: (train, held_out), disjoint."""
    if not 0 <= held_out <= len(sentences):
        raise ValueError(f"cannot hold out {held_out} of {len(sentences)} sentences")
    if len(set(sentences)) != len(sentences):
        raise ValueError("sentences must be distinct to split them")
    order = list(sentences)
    random.Random(seed).shuffle(order)
    return order[held_out:], order[:held_out]


def write_lines(path: str | Path, lines: Iterable[str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)


def make_fortune_text(
    out_dir: str | Path,
    fortunes_dir: str | Path = DEFAULT_FORTUNES_DIR,
    held_out: int = 200,
    seed: int = 0,
    min_words: int = 3,
    max_words: int = 20,
) -> dict[str, int | str]:
    """Write `train.txt` and `heldout.txt` from the fortunes; returns counts and paths."""
    sentences = fortune_sentences(fortune_files(fortunes_dir), min_words, max_words)
    if held_out >= len(sentences):
        raise ValueError(f"only {len(sentences)} clean sentences found; cannot hold out {held_out}")
    train, heldout = split_corpus(sentences, held_out, seed)
    out_dir = Path(out_dir)
    write_lines(out_dir / "train.txt", train)
    write_lines(out_dir / "heldout.txt", heldout)
    return {
        "train": len(train),
        "heldout": len(heldout),
        "train_path": str((out_dir / "train.txt").resolve()),
        "heldout_path": str((out_dir / "heldout.txt").resolve()),
    }
