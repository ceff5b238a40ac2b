"""Readable transcripts: written-form numbers, then punctuation and capitals, with spans.

    Formatter(punctuation=True, inverse=True).format(["it", "costs", "twenty", "five",
    "dollars"]) -> [Token("It", 0, 1), Token("costs", 1, 2), Token("$25.", 2, 5)]

Inverse text normalization (`model/core/inverse_text.py`) comes first, so the tagger
reads the tokens people write ("$25", "3:30") as it did in training; the tagger
(`punct.onnx`, trained by `training/punctuation.py`) then gives each token its mark and
case (`model/core/punctuation.py`), the last one always a sentence end. Every token
keeps the span of spoken words it came from, so word times and confidences carry over
(`written_words`).

The tagger runs on ONNX Runtime with one thread: a final result is a few dozen words,
and the server's other work needs the other cores.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from echoic.model.core.inverse_text import Token, inverse_normalize
from echoic.model.core.punctuation import (
    ABBREVIATIONS,
    PieceList,
    WordList,
    apply_tags,
    encode,
    end_sentence,
    spoken_case,
)

PUNCT_FILE = Path(__file__).resolve().parent.parent / "punct" / "punct.onnx"
PUNCT_KEY = "echoic.punct"  # the ONNX metadata entry model/nn/punctuation.py writes
# (format, config kind) of the taggers this runtime reads: words, and word pieces
KINDS = ((1, None), (2, "pieces"))


class FormattingUnavailable(RuntimeError):
    """Punctuation was asked for and this install has no tagger to run it."""


class Punctuator:
    """The tagger under ONNX Runtime: lower-case tokens -> (marks, cases)."""

    def __init__(self, path: Path = PUNCT_FILE) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise FormattingUnavailable(
                "punctuation needs onnxruntime: pip install 'echoic[serve]'"
            ) from None
        if not path.is_file():
            raise FormattingUnavailable(
                f"punctuation is unavailable: no tagger at {path} (reinstall echoic, or "
                "train one: python -m echoic.training.punctuation)"
            )
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        entry = self.session.get_modelmeta().custom_metadata_map.get(PUNCT_KEY)
        if entry is None:
            raise FormattingUnavailable(
                f"punctuation is unavailable: {path} is not a tagger (an ONNX file without "
                f"{PUNCT_KEY} metadata; python -m echoic.training.punctuation writes one)"
            )
        meta = json.loads(entry)
        config = meta.get("config", {})
        kind = (meta.get("format"), config.get("kind"))
        if kind not in KINDS:
            newer = isinstance(kind[0], int) and kind[0] > max(f for f, _ in KINDS)
            raise FormattingUnavailable(
                f"punctuation is unavailable: the tagger at {path} is of format {kind[0]!r}, "
                f"kind {kind[1]!r}, which this echoic does not read"
                + (
                    " (a newer echoic wrote it: upgrade, or give --punctuation-model another "
                    "tagger)"
                    if newer
                    else ""
                )  # fmt: skip
            )
        self.words = WordList(tuple(meta["words"]))
        self.scores = meta.get("scores", {})
        # A pretrained tagger reads word pieces (`PieceList`) at most `positions` at a time.
        self.pieces = PieceList(tuple(meta["words"])) if kind[1] == "pieces" else None
        self.positions = int(config.get("positions", 0))

    def logits(self, tokens: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Mark and case logits, (T, len(MARKS)) and (T, len(CASES))."""
        tokens = [t.lower() for t in tokens]
        if self.pieces is not None:
            return self._piece_logits(tokens)
        word_ids, char_ids = encode(tokens, self.words)
        feeds = {"word_ids": word_ids[None], "char_ids": char_ids[None]}
        marks, cases = self.session.run(None, feeds)
        return marks[0], cases[0]

    def _piece_logits(self, tokens: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """A pretrained tagger's logits: the tokens in runs of at most `positions` pieces
        (a final result of a few hundred words is more than one), each tagged alone."""
        assert self.pieces is not None
        runs = self.pieces.runs(tokens, self.positions)
        marks, cases = [], []
        for run in runs:
            ids, first, last = self.pieces.encode(run)
            feeds = {"piece_ids": ids[None], "first": first[None], "last": last[None]}
            m, c = self.session.run(None, feeds)
            marks.append(m[0])
            cases.append(c[0])
        return np.concatenate(marks), np.concatenate(cases)

    def tag(self, tokens: Sequence[str]) -> tuple[list[int], list[int]]:
        marks, cases = self.logits(tokens)
        return end_sentence(marks), cases.argmax(-1).tolist()


_tagger_file = PUNCT_FILE  # the tagger punctuator() loads: `use_tagger`


def use_tagger(path: Path | None) -> None:
    """The tagger this process formats with from now on (None: the bundled one);
    `echoic serve --punctuation-model`."""
    global _tagger_file
    _tagger_file = PUNCT_FILE if path is None else Path(path)


def punctuator() -> Punctuator:
    """The tagger, loaded once per process and file (FormattingUnavailable when it cannot
    be: asked again, it tries again)."""
    return _load(_tagger_file)


@lru_cache(maxsize=4)
def _load(path: Path) -> Punctuator:
    return Punctuator(path)


@dataclass(frozen=True)
class Formatter:
    punctuation: bool = True  # marks and capitals from the tagger
    inverse: bool = True  # written-form numbers, dates, money, ... (inverse_text)

    def format(self, words: Sequence[str]) -> list[Token]:
        """Written tokens, each with the span of `words` it stands for."""
        tokens = inverse_normalize(words) if self.inverse else [
            Token(w, i, i + 1) for i, w in enumerate(words)
        ]  # fmt: skip
        if not self.punctuation or not tokens:
            return tokens
        marks, cases = punctuator().tag([t.text for t in tokens])
        # A written form keeps its own case ("p.m.", "kg", "Mr."): only words as spoken
        # take the tagger's capitals.
        cases = [spoken_case(c, t.text) if t.last - t.first == 1 and t.text == words[t.first]
                 else 0 for c, t in zip(cases, tokens, strict=True)]  # fmt: skip
        texts = apply_tags([t.text for t in tokens], marks, cases)
        return [Token(text, t.first, t.last) for text, t in zip(texts, tokens, strict=True)]


@dataclass(frozen=True)
class WrittenWord:
    text: str
    start: float  # s: the start of its first spoken word
    end: float  # s: the end of its last spoken word
    confidence: float  # the lowest of its spoken words' confidences


def written_words(
    tokens: Sequence[Token], starts: Sequence[float], ends: Sequence[float],
    confidences: Sequence[float],
) -> list[WrittenWord]:  # fmt: skip
    """Each written token timed by the spoken words it came from."""
    return [
        WrittenWord(t.text, starts[t.first], ends[t.last - 1],
                    float(np.min(confidences[t.first : t.last])))
        for t in tokens
    ]  # fmt: skip


def ends_sentence(text: str) -> bool:
    """Whether a written token ends a sentence: "?", "!", or a period that is not an
    abbreviation's ("Mr.", "p.m." mid-sentence)."""
    if text[-1:] in "?!":
        return True
    return text.endswith(".") and text.lower() not in ABBREVIATIONS
