"""CTC decoding of log-probabilities into transcripts: greedy, or beam search with an n-gram LM.

CTC's collapse rule: take the best symbol per frame, merge runs of the same
symbol, then drop blanks. A blank between two equal symbols keeps them apart,
which is how the model spells double letters: "a a <b> a" -> "aa".

Transcripts carry word times and confidences read off one alignment (a symbol
per frame: greedy's best path, or the beam search's winning path):

- Times. CTC is peaky: a character fires on one frame or a short run, with
  blanks around it, and where it fires can lag or lead the sound by a frame or
  two. A word spans from the first frame of its first character's run to the
  last frame of its last character's run, inclusive: start = first *
  frame_seconds, end = (last + 1) * frame_seconds. Blanks before and after a word
  are not counted, so words look shorter than the audio they cover.
- Confidence. A character's confidence is its posterior at its peak (the best
  frame of its run); a word's is the lowest of its characters', since one
  doubtful letter makes the word doubtful. An utterance's is the mean of its
  words'; with no words, the lowest posterior along the path (how sure the
  model is that nothing was said), and 0 with no frames at all.

Streams. `decoder.stream()` accepts log-prob chunks as they arrive
(`accept`), gives a partial transcript after each, and a final one at `finalize`.
Streaming gives exactly the whole-utterance result: greedy carries the run in
progress across chunk boundaries; beam search drives flashlight's incremental
decoder. `Transcript.stable_words` counts the leading words later partials are
not expected to change: for greedy, every word a space has closed; for beam
search, the words that stayed the same over the last few partials.

Subword vocabularies (SentencePiece/BPE, `Vocabulary.token_type` "bpe") decode the
same way: a "symbol" above is a token, and a word begins at each token whose piece
starts with "▁" (where a character vocabulary has a space), so "▁the", "▁ca", "t"
are the words "the" and "cat", timed and scored as above.

Beam search is flashlight-text's lexicon-free CTC decoder (the `serve` and
`train` extras; greedy decoding needs numpy alone), so any spelling can come
out. Its LM hook is asked about every character, so a word n-gram model
(KenLM, ARPA) is put behind an adapter that scores each word when a space or
the end closes it; words the LM lacks pay `unk_penalty` as soon as their
spelling leaves every known word's prefix. A subword vocabulary goes through the same
adapter: a token adds its piece to the word, and a "▁" token closes the word before
it. flashlight's lexicon decoder was the alternative: it cannot spell a word outside
the LM's unigrams, which turns "zebra sat" into "a sat" when the LM has never seen
"zebra".
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import numpy as np

from echoic.model.core.text import Vocabulary


def greedy_ids(log_probs: np.ndarray, blank_id: int = 0) -> list[int]:
    """Best path of (T, V) log-probabilities, collapsed: the symbol ids, blanks removed."""
    log_probs = np.asarray(log_probs)
    if log_probs.ndim != 2:
        raise ValueError(f"log_probs must have shape (T, V), got {log_probs.shape}")
    if log_probs.shape[0] == 0:
        return []
    best = log_probs.argmax(axis=1)  # (T,)
    starts = np.ones(best.shape, dtype=bool)
    starts[1:] = best[1:] != best[:-1]  # first frame of each run
    runs = best[starts]
    return [int(i) for i in runs[runs != blank_id]]


def _check_vocab(log_probs: np.ndarray, vocab: Vocabulary) -> None:
    if log_probs.shape[-1] != vocab.size:
        raise ValueError(
            f"log_probs have {log_probs.shape[-1]} symbols per frame "
            f"but the vocabulary has {vocab.size}"
        )


def _check_lengths(log_probs: np.ndarray, lengths: np.ndarray) -> None:
    if lengths.shape != log_probs.shape[:1]:
        raise ValueError(f"lengths must have shape ({log_probs.shape[0]},), got {lengths.shape}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > log_probs.shape[1]):
        raise ValueError(f"lengths must lie in [0, {log_probs.shape[1]}], got {lengths.tolist()}")


def greedy_decode_batch(log_probs: np.ndarray, lengths: np.ndarray, vocab: Vocabulary) -> list[str]:
    """Greedy transcripts of a padded batch: (B, T, V) and valid frames per row (B,)."""
    log_probs = np.asarray(log_probs)
    lengths = np.asarray(lengths)
    if log_probs.ndim != 3:
        raise ValueError(f"log_probs must have shape (B, T, V), got {log_probs.shape}")
    _check_lengths(log_probs, lengths)
    _check_vocab(log_probs, vocab)
    return [
        vocab.decode(greedy_ids(row[: int(n)], vocab.blank_id))
        for row, n in zip(log_probs, lengths, strict=True)
    ]


# ---------------------------------------------------------------- transcripts


@dataclass(frozen=True)
class Word:
    text: str
    start: float  # first frame of the first character, s
    end: float  # end of the last frame of the last character, s
    confidence: float  # in [0, 1]: the least sure character's peak posterior


@dataclass(frozen=True)
class Transcript:
    text: str  # the words joined by single spaces
    words: tuple[Word, ...] = ()
    confidence: float = 0.0  # in [0, 1]: mean word confidence (see the module docstring)
    stable_words: int = 0  # leading words later partials are not expected to change
    # Final transcripts of a beam search asked for n_best > 1: the next best hypotheses
    # with other text, best first (each with its own words and confidence).
    alternatives: tuple[Transcript, ...] = ()


def _check_log_probs(log_probs: np.ndarray, vocab: Vocabulary, shape: str) -> np.ndarray:
    """As C-contiguous float32, after checking shape ("(T, V)" or "(B, T, V)") and values."""
    log_probs = np.asarray(log_probs)
    if log_probs.ndim != shape.count(",") + 1:
        raise ValueError(f"log_probs must have shape {shape}, got {log_probs.shape}")
    _check_vocab(log_probs, vocab)
    if np.isnan(log_probs).any() or np.isposinf(log_probs).any():
        raise ValueError("log_probs contain NaN or +inf: the acoustic model's output is broken")
    return np.ascontiguousarray(log_probs, dtype=np.float32)


class _Alignment:
    """A CTC path as runs of one symbol: symbol, first and last frame, best log-prob in the run."""

    def __init__(self) -> None:
        self.symbols: list[int] = []
        self.first: list[int] = []
        self.last: list[int] = []
        self.peak: list[float] = []
        self.frames = 0
        self.lowest = 0.0  # lowest log-prob along the whole path

    def extend(self, path: np.ndarray, path_log_probs: np.ndarray) -> None:
        """Append frames: the symbol chosen at each (t,) and its log-prob (t,)."""
        if not len(path):
            return
        starts = np.flatnonzero(np.r_[True, path[1:] != path[:-1]])
        lasts = np.r_[starts[1:], len(path)] - 1
        peaks = np.maximum.reduceat(path_log_probs, starts)
        symbols = path[starts].tolist()
        skip = 0
        if self.symbols and self.symbols[-1] == symbols[0]:  # the run goes on across the boundary
            self.last[-1] = self.frames + int(lasts[0])
            self.peak[-1] = max(self.peak[-1], float(peaks[0]))
            skip = 1
        self.symbols += symbols[skip:]
        self.first += (starts[skip:] + self.frames).tolist()
        self.last += (lasts[skip:] + self.frames).tolist()
        self.peak += peaks[skip:].tolist()
        self.frames += len(path)
        self.lowest = min(self.lowest, float(path_log_probs.min()))

    def transcript(self, vocab: Vocabulary, frame_seconds: float) -> tuple[Transcript, int]:
        """The transcript, and how many of its words a word boundary has closed (a space,
        or a subword token that begins the next word)."""
        pieces = vocab.pieces
        words: list[Word] = []
        closed = 0
        chars: list[str] = []
        first = last = 0
        lowest = 0.0
        runs = zip(self.symbols, self.first, self.last, self.peak, strict=True)
        for symbol, run_first, run_last, peak in runs:
            if symbol == vocab.blank_id:
                continue
            starts_word, text = pieces[symbol]
            if starts_word:
                if chars:
                    words.append(_word(chars, first, last, lowest, frame_seconds))
                    chars = []
                closed = len(words)
                if not text:
                    continue
            if not chars:
                first, lowest = run_first, peak
            chars.append(text)
            last, lowest = run_last, min(lowest, peak)
        if chars:
            words.append(_word(chars, first, last, lowest, frame_seconds))
        if words:
            confidence = math.fsum(w.confidence for w in words) / len(words)
        else:
            confidence = math.exp(self.lowest) if self.frames else 0.0
        text = " ".join(w.text for w in words)
        return Transcript(text, tuple(words), min(confidence, 1.0)), closed


def _word(chars: list[str], first: int, last: int, log_conf: float, frame_seconds: float) -> Word:
    return Word(
        "".join(chars),
        first * frame_seconds,
        (last + 1) * frame_seconds,
        min(math.exp(log_conf), 1.0),
    )


# ---------------------------------------------------------------- utterances


MAX_CUT_DELAY = 2.0  # s an utterance may run past max_utterance waiting for a blank frame


@dataclass(frozen=True)
class Endpointing:
    """Where an utterance ends inside longer audio (as in sherpa-onnx and Riva), checked
    after every model step: rule 1 after `trailing_silence` of silence (CTC blanks and
    spaces) after its last word, once it has one; rule 2 once it reaches `max_utterance`,
    at the first step that does not end inside a character's run of frames (at most
    MAX_CUT_DELAY later), so the next utterance does not write that character again.
    The decoder then starts afresh (a beam search's LM context too); the acoustic model
    runs on over the cut. The one rule for live streams (`model/runtime/recognizer.py:
    Stream.settle`, the server's streams and requests) and for files
    (`model/runtime/recognizer.py:Recognizer.transcribe`)."""

    trailing_silence: float = 0.0  # s; 0 = rule 1 off
    max_utterance: float = 0.0  # s; 0 = rule 2 off

    def due(self, words: Sequence[Word], spoken: float, frame_seconds: float) -> bool:
        """Whether an utterance `spoken` s long with these `words` (times from its start)
        ends now."""
        if self.max_utterance and spoken >= self.max_utterance:
            # Not inside a character's run of frames: its next frames would start the
            # same character again in the next utterance. A path that never leaves
            # characters is cut anyway, MAX_CUT_DELAY later.
            in_a_character = bool(words) and spoken - words[-1].end < frame_seconds / 2
            return not in_a_character or spoken >= self.max_utterance + MAX_CUT_DELAY
        if self.trailing_silence:
            return bool(words) and spoken - words[-1].end >= self.trailing_silence
        return False


# A whole file is cut into utterances at pauses of 0.8 s, none longer than 30 s, on every
# path: `echoic transcribe` here and with --server, the HTTP door (its segments). A long
# recording decoded as one utterance glues words across its pauses (CTC writes no space
# over silence) and a beam search's LM then scores nonsense words.
FILE_ENDPOINTING = Endpointing(trailing_silence=0.8, max_utterance=30.0)


def joined(utterances: Sequence[tuple[float, Transcript]]) -> Transcript:
    """One transcript of consecutive utterances, each (its start in the audio s, its
    transcript): words joined, their times from the audio's start; an utterance's
    alternatives only when it is the only one."""
    spoken = [(start, t) for start, t in utterances if t.words]
    if len(spoken) <= 1:
        start, t = spoken[0] if spoken else (0.0, Transcript(""))
        return replace(t, words=tuple(_shifted(w, start) for w in t.words))
    words = tuple(_shifted(w, start) for start, t in spoken for w in t.words)
    confidence = math.fsum(w.confidence for w in words) / len(words)
    text = " ".join(t.text for _, t in spoken)
    return Transcript(text, words, confidence, stable_words=len(words))


def _shifted(word: Word, seconds: float) -> Word:
    return replace(word, start=word.start + seconds, end=word.end + seconds)


# ---------------------------------------------------------------- streams


class StreamingDecoder(ABC):
    """One utterance decoded as its log-probs arrive: accept(), partial(), finalize()."""

    def __init__(self, vocab: Vocabulary, frame_seconds: float) -> None:
        self.vocab = vocab
        self.frame_seconds = frame_seconds
        self.n_best = 1  # transcripts the final one carries, itself included (beam search)
        self._final: Transcript | None = None

    def accept(self, log_probs: np.ndarray) -> Transcript:
        """Take the next (t, V) frames of log-probs; return the partial transcript so far."""
        if self._final is not None:
            raise RuntimeError("the stream is finalized: start a new one with decoder.stream()")
        chunk = _check_log_probs(log_probs, self.vocab, "(t, V)")
        if len(chunk):
            self._accept(chunk)
        return self.partial()

    def partial(self) -> Transcript:
        """The best transcript of what has arrived so far."""
        return self._final if self._final is not None else self._partial()

    def finalize(self) -> Transcript:
        """The stream has ended: the final transcript, every word stable."""
        if self._final is None:
            final = self._finish()
            self._final = replace(final, stable_words=len(final.words))
        return self._final

    @abstractmethod
    def _accept(self, chunk: np.ndarray) -> None: ...

    @abstractmethod
    def _partial(self) -> Transcript: ...

    @abstractmethod
    def _finish(self) -> Transcript: ...


class GreedyStream(StreamingDecoder):
    """Best path, frame by frame. A partial never changes a word a space has closed."""

    def __init__(self, vocab: Vocabulary, frame_seconds: float) -> None:
        super().__init__(vocab, frame_seconds)
        self._alignment = _Alignment()

    def _accept(self, chunk: np.ndarray) -> None:
        best = chunk.argmax(axis=1)  # (t,)
        self._alignment.extend(best, np.take_along_axis(chunk, best[:, None], axis=1)[:, 0])

    def _partial(self) -> Transcript:
        transcript, closed = self._alignment.transcript(self.vocab, self.frame_seconds)
        return replace(transcript, stable_words=closed)

    def _finish(self) -> Transcript:
        return self._partial()


class _Decoder:
    """decode, in terms of the subclass's streams."""

    vocab: Vocabulary
    frame_seconds: float

    def stream(self) -> StreamingDecoder:
        raise NotImplementedError

    def decode(self, log_probs: np.ndarray, n_best: int = 1) -> Transcript:
        """Transcript of one utterance's (T, V) log-probs (with n_best > 1 and beam
        search, carrying up to n_best - 1 `alternatives`)."""
        stream = self.stream()
        stream.n_best = n_best
        chunk = _check_log_probs(log_probs, self.vocab, "(T, V)")
        if len(chunk):
            stream._accept(chunk)  # not accept(): no partial to build
        return stream.finalize()


def _check_frame_seconds(frame_seconds: float) -> float:
    if not (math.isfinite(frame_seconds) and frame_seconds > 0):
        raise ValueError(f"frame_seconds must be a positive number of seconds, got {frame_seconds}")
    return float(frame_seconds)


class GreedyDecoder(_Decoder):
    """Best-path decoding. frame_seconds = hop_ms * time_stride / 1000 of the model."""

    def __init__(self, vocab: Vocabulary, *, frame_seconds: float) -> None:
        self.vocab = vocab
        self.frame_seconds = _check_frame_seconds(frame_seconds)

    def stream(self) -> GreedyStream:
        return GreedyStream(self.vocab, self.frame_seconds)


# ---------------------------------------------------------------- beam search

_LN10 = math.log(10.0)
_FLOOR = -1e4  # log-probs below this (-inf included) reach flashlight as this
_SLICE_FRAMES = 4  # frames per flashlight call (each holds the GIL for all of its frames)


def _flashlight() -> Any:
    """flashlight-text's decoder module, or a one-line ImportError saying how to get it."""
    try:
        from flashlight.lib.text import decoder
    except ImportError:
        raise ImportError(
            "beam search needs flashlight-text, which is not installed: pip install 'echoic[serve]'"
        ) from None
    return decoder


@dataclass(frozen=True)
class DecoderConfig:
    """How to decode: greedy, or beam search with an optional word LM. The one place
    where the decoding defaults are written (the server, the command line and
    `BeamSearchDecoder` take them from here)."""

    kind: str = "greedy"  # "greedy" or "beam"
    beam_size: int = 32  # hypotheses kept per frame (beam)
    lm_path: str = ""  # word LM (ARPA or KenLM binary); "" = the model directory's, if any
    use_lm: bool = True  # with kind="beam": use the LM when one is found
    lm_weight: float = 0.5  # LM weight (beam), natural-log units per LM log-prob
    word_bonus: float = 2.0  # score added per word (beam), nats (docs/models-and-import.md,
    # "The language model": 2 beat 1 by 1.7-1.8 points on the validation split, v2 and v3)
    boost: tuple[tuple[str, float], ...] = ()  # (word, nats) added when the word is spelled
    # (beam): contextual biasing towards names and terms the model or LM would miss

    def __post_init__(self) -> None:
        if self.kind not in ("greedy", "beam"):
            raise ValueError(f"decoder kind must be 'greedy' or 'beam', got {self.kind!r}")
        if self.boost and self.kind != "beam":
            raise ValueError("boosted words need the beam decoder (kind 'beam')")
        for word, nats in self.boost:
            if not word or " " in word or not math.isfinite(nats):
                raise ValueError(f"a boosted word is one word with a finite boost, got {word!r}")


def check_beam_settings(
    vocab: Vocabulary,
    beam_size: int,
    boost: tuple[tuple[str, float], ...] = (),
    token_beam: int | None = 8,
    beam_threshold: float = 25.0,
) -> None:
    """ValueError, saying what is wrong, where `BeamSearchDecoder` cannot decode with
    these settings (checked without flashlight, so that a decoder built elsewhere, in
    another process, refuses the same requests)."""
    if vocab.token_type == "chars" and " " not in vocab.index:
        raise ValueError("beam search needs a space symbol in the vocabulary to separate words")
    if beam_size < 1 or (token_beam is not None and token_beam < 1) or beam_threshold <= 0:
        raise ValueError(
            f"beam_size and token_beam must be at least 1 and beam_threshold positive, got "
            f"{beam_size}, {token_beam}, {beam_threshold}"
        )
    letters = {c for _, text in vocab.pieces for c in text}
    bad = [w for w, _ in boost if any(c not in letters for c in w)]
    if bad:
        raise ValueError(f"boosted word {bad[0]!r} has characters outside the vocabulary")


class BeamSearchDecoder(_Decoder):
    """CTC prefix beam search over characters or subword tokens, optionally with a word
    n-gram LM (an ARPA file, or KenLM's binary format).

    Hypotheses score, in nats,

        ln p_ctc + lm_weight * ln p_lm(words) + word_bonus * #words - unk_penalty * #unknown

    where unknown words are those the LM does not have. The LM terms apply only
    with `lm_path`; without it this is a plain CTC prefix beam search (alignments
    of one prefix summed). beam_size: hypotheses kept per frame; token_beam: symbols tried
    per frame (the most likely ones; None for all); beam_threshold: hypotheses
    further than this (nats) below the best are dropped.

    The decoder is flashlight-text's lexicon-free one, so any spelling can come
    out, words the LM has never seen included (they score as <unk>).
    """

    def __init__(
        self,
        vocab: Vocabulary,
        *,
        frame_seconds: float,
        beam_size: int = DecoderConfig.beam_size,
        lm_path: str | os.PathLike[str] | None = None,
        lm_weight: float = DecoderConfig.lm_weight,
        word_bonus: float = DecoderConfig.word_bonus,
        unk_penalty: float = 10.0,
        beam_threshold: float = 25.0,
        token_beam: int | None = 8,
        boost: tuple[tuple[str, float], ...] = (),
    ) -> None:
        self.vocab = vocab
        self.frame_seconds = _check_frame_seconds(frame_seconds)
        check_beam_settings(vocab, beam_size, boost, token_beam, beam_threshold)
        fl = _flashlight()
        self._options = fl.LexiconFreeDecoderOptions(
            beam_size=beam_size,
            beam_size_token=min(token_beam or vocab.size, vocab.size),
            beam_threshold=beam_threshold,
            lm_weight=1.0,  # the word LM below applies lm_weight itself
            sil_score=0.0,
            log_add=True,  # merge alignments of one prefix by summing: CTC's prefix probability
            criterion_type=fl.CriterionType.CTC,
        )
        self.lm = None if lm_path is None else _KenLM.shared(lm_path)  # shared by all decoders
        self._lm_weights = (lm_weight, word_bonus, unk_penalty)
        self._boost = _Boost(dict(boost)) if boost else None

    def stream(self, stable_after: int = 3) -> BeamStream:
        """A stream; a word is stable once it held its place for `stable_after` chunks."""
        if stable_after < 1:
            raise ValueError(f"stable_after must be at least 1, got {stable_after}")
        fl = _flashlight()
        # flashlight's "silence" token scores nothing here (sil_score 0): the space of a
        # character vocabulary, the blank of a subword one (its words begin at "▁" tokens).
        space = self.vocab.index.get(" ", self.vocab.blank_id)
        if self.lm is None and self._boost is None:
            lm = fl.ZeroLM()
        else:
            lm = _words_lm_class()(self.lm, self.vocab, self._lm_weights, self._boost)
        decoder = fl.LexiconFreeDecoder(self._options, lm, space, self.vocab.blank_id, [])
        return BeamStream(self.vocab, self.frame_seconds, decoder, lm, stable_after)


class BeamStream(StreamingDecoder):
    """flashlight's decode_begin / decode_step / decode_end, one call per chunk."""

    def __init__(
        self,
        vocab: Vocabulary,
        frame_seconds: float,
        decoder: Any,
        lm: Any,
        stable_after: int,
    ) -> None:
        super().__init__(vocab, frame_seconds)
        self._decoder = decoder
        self._lm = lm  # flashlight holds it by reference only: keep it alive
        self._log_probs = np.empty((64, vocab.size), dtype=np.float32)  # grows by doubling
        self._frames = 0
        self._recent: deque[tuple[tuple[str, float], ...]] = deque(maxlen=stable_after)
        self._latest = Transcript("")
        decoder.decode_begin()

    def _accept(self, chunk: np.ndarray) -> None:
        end = self._frames + len(chunk)
        if end > len(self._log_probs):
            grown = np.empty((max(end, 2 * len(self._log_probs)), self.vocab.size), np.float32)
            grown[: self._frames] = self._log_probs[: self._frames]
            self._log_probs = grown
        self._log_probs[self._frames : end] = chunk
        self._frames = end
        emissions = np.ascontiguousarray(np.maximum(chunk, _FLOOR))
        # flashlight holds the GIL while it decodes: a few frames a call, so that other
        # threads (the batch every stream shares, the event loop) get it in between.
        for first in range(0, len(emissions), _SLICE_FRAMES):
            piece = emissions[first : first + _SLICE_FRAMES]
            self._decoder.decode_step(piece.ctypes.data, len(piece), self.vocab.size)
        self._latest = self._with_stability(self._best())

    def _best(self) -> Transcript:
        if not self._frames:
            return Transcript("")
        return self._transcript(self._decoder.get_best_hypothesis().tokens)

    def _transcript(self, tokens: list[int]) -> Transcript:
        """The transcript of a hypothesis: its tokens are a start token, one a frame[, end]."""
        path = np.asarray(tokens[1 : self._frames + 1], dtype=np.int64)
        log_probs = self._log_probs[: self._frames]
        alignment = _Alignment()
        alignment.extend(path, log_probs[np.arange(self._frames), path])
        return alignment.transcript(self.vocab, self.frame_seconds)[0]

    def _partial(self) -> Transcript:
        return self._latest

    def _with_stability(self, transcript: Transcript) -> Transcript:
        """Count the leading words that held their place over the last `stable_after` chunks."""
        words = tuple((w.text, w.start) for w in transcript.words)
        self._recent.append(words)
        stable = 0
        if len(self._recent) == self._recent.maxlen:
            stable = max(len(words) - 1, 0)  # the last word may still grow
            for earlier in self._recent:
                stable = min(stable, _common_prefix(words, earlier))
        return replace(transcript, stable_words=stable)

    def _finish(self) -> Transcript:
        self._decoder.decode_end()
        best = self._best()
        if self.n_best > 1 and self._frames:
            best = replace(best, alternatives=self._others(best))
        return best

    def _others(self, best: Transcript) -> tuple[Transcript, ...]:
        """Up to n_best - 1 final hypotheses whose text differs from best's and each other's."""
        hypotheses = sorted(self._decoder.get_all_final_hypothesis(), key=lambda h: -h.score)
        seen, others = {best.text}, []
        for h in hypotheses:
            if len(others) == self.n_best - 1:
                break
            transcript = self._transcript(h.tokens)
            if transcript.text not in seen:
                seen.add(transcript.text)
                others.append(replace(transcript, stable_words=len(transcript.words)))
        return tuple(others)


def _common_prefix(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _KenLM:
    """A word LM (ARPA or KenLM binary) loaded through flashlight's KenLM wrapper, shared
    by all streams and by every decoder of the same file (`shared`): one copy in memory per
    LM file, whatever the beam sizes asked for, freed once no decoder holds it."""

    _loaded: weakref.WeakValueDictionary[tuple, _KenLM] = weakref.WeakValueDictionary()
    _lock = threading.Lock()

    @classmethod
    def shared(cls, path: str | os.PathLike[str]) -> _KenLM:
        """The loaded LM of `path` (loaded now if no decoder holds it; again if the file
        changed)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"language model {os.fspath(path)!r} does not exist") from None
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        with cls._lock:
            lm = cls._loaded.get(key)
            if lm is None:
                lm = cls._loaded[key] = cls(path)
            return lm

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from echoic.model.core.lm import UNK, lm_words

        if not os.path.isfile(path):
            raise FileNotFoundError(f"language model {os.fspath(path)!r} does not exist")
        words = lm_words(path)  # an ARPA file's unigrams, or a KenLM binary file's
        if UNK not in words:
            words.append(UNK)  # KenLM's own <unk> answers for it
        from flashlight.lib.text.decoder.kenlm import KenLM
        from flashlight.lib.text.dictionary import Dictionary

        from echoic.model.core.native import KENLM_CHATTER, quiet_stderr

        with quiet_stderr(KENLM_CHATTER):  # its loading messages are not the user's business
            self.model = KenLM(os.fspath(path), Dictionary(words))
        self.ids = {w: i for i, w in enumerate(words) if not w.startswith("<")}
        self.unk = words.index(UNK)
        self.prefixes = frozenset(w[:k] for w in self.ids for k in range(1, len(w) + 1))


class _Boost:
    """Boosted words, credited as they are spelled: each character that keeps the word so
    far a prefix of a boosted word earns that word's boost in proportion (so the beam
    keeps the hypothesis alive before the word ends), a spelling that leaves every boosted
    word gives back what it earned, and only a whole boosted word keeps its boost."""

    def __init__(self, boost: dict[str, float]) -> None:
        self.words = boost
        credit: dict[str, float] = {}
        for word, nats in boost.items():
            for k in range(1, len(word) + 1):
                share = nats * k / len(word)
                prefix = word[:k]
                credit[prefix] = max(credit.get(prefix, share), share)
        self.credit = credit  # prefix -> what spelling it has earned, nats

    def step(self, before: str, after: str) -> float:
        """The score change of spelling `after` from `before` (one more character)."""
        return self.credit.get(after, 0.0) - self.credit.get(before, 0.0)

    def close(self, word: str) -> float:
        """The score change when `word` ends: a boosted word keeps its boost exactly,
        anything else gives back what its spelling earned."""
        return (
            self.words[word] - self.credit[word]
            if word in self.words
            else -self.credit.get(word, 0.0)
        )


@cache
def _words_lm_class() -> type:
    """The word-LM adapter; a subclass of flashlight's LM, so defined once flashlight loads."""
    fl = _flashlight()

    class WordsFromCharacters(fl.LM):
        """Scores whole words at each word boundary (a space, or a subword token that
        begins a word) and at the end; the symbols in between score 0.

        flashlight's lexicon-free decoder asks its LM about every symbol it emits,
        so a word model cannot be handed to it directly. Each decoder state maps to
        (KenLM state, the word spelled so far, the score of reaching it, whether
        that word was charged as unknown); states are children of their parent per
        symbol, so one prefix has one state and flashlight merges exactly the
        alignments of one prefix.

        A word the LM does not know scores as <unk>, which is one probability for
        every unknown word however long: without more, gluing several words into
        one (dropping the spaces) would cost less than scoring each. So an unknown
        word also pays `unk_penalty`, charged on the character where its spelling
        stops being the start of any known word, which lets the beam drop it early.
        """

        def __init__(
            self,
            kenlm: _KenLM | None,
            vocab: Vocabulary,
            weights: tuple[float, float, float],
            boost: _Boost | None = None,
        ):
            fl.LM.__init__(self)
            self._kenlm = kenlm  # None: no LM, only boosted words score
            self._boost = boost
            self._pieces = vocab.pieces
            weight, self._bonus, self._unk_penalty = weights
            self._weight = weight * _LN10  # KenLM scores are log10
            self._states: dict[Any, tuple[Any, str, float, bool]] = {}

        def start(self, start_with_nothing: bool) -> Any:
            state = fl.LMState()
            ken = self._kenlm.model.start(False) if self._kenlm is not None else None
            self._states = {state: (ken, "", 0.0, False)}
            return state

        def _known(self, spelled: str) -> bool:
            """Whether `spelled` starts a word the LM knows or a boosted word."""
            boosted = self._boost is not None and self._boost.credit.get(spelled, 0.0) > 0
            return boosted or self._kenlm is None or spelled in self._kenlm.prefixes

        def score(self, state: Any, token: int) -> tuple[Any, float]:
            child = state.child(token)
            known = self._states.get(child)
            if known is None:
                ken, spelled, _, charged = self._states[state]
                starts_word, text = self._pieces[token]
                gain = 0.0
                if starts_word:  # a space, or a subword token that begins a word
                    if spelled:
                        ken, gain = self._word(ken, spelled, charged)
                    spelled, charged = "", False
                if text:
                    before, spelled = spelled, spelled + text
                    gain += self._boost.step(before, spelled) if self._boost else 0.0
                    if not charged and not self._known(spelled):
                        gain, charged = gain - self._unk_penalty, True
                known = (ken, spelled, gain, charged)
                self._states[child] = known
            return child, known[2]

        def finish(self, state: Any) -> tuple[Any, float]:
            ken, spelled, _, charged = self._states[state]
            score = 0.0
            if spelled:
                ken, score = self._word(ken, spelled, charged)
            if self._kenlm is None:
                return state, score
            ken, end = self._kenlm.model.finish(ken)
            return state, score + self._weight * end

        def _word(self, ken: Any, word: str, charged: bool) -> tuple[Any, float]:
            boosted = self._boost.close(word) if self._boost else 0.0
            if self._kenlm is None:  # no LM: only the boost (a plain CTC beam otherwise)
                return ken, boosted
            index = self._kenlm.ids.get(word)
            score = self._bonus + boosted
            if index is None:
                index = self._kenlm.unk
                wanted = self._boost is not None and self._boost.words.get(word, 0.0) > 0
                score -= 0.0 if charged or wanted else self._unk_penalty
            ken, log10p = self._kenlm.model.score(ken, index)
            return ken, score + self._weight * log10p

    return WordsFromCharacters
