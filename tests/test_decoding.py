"""CTC decoding: greedy, beam search (with and without an n-gram LM), streams."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest

from echoic.model.core.decoding import (
    BeamSearchDecoder,
    GreedyDecoder,
    Transcript,
    greedy_decode_batch,
    greedy_ids,
)
from echoic.model.core.lm import build_arpa
from echoic.model.core.text import Vocabulary

VOCAB = Vocabulary()


def greedy_decode(log_probs: np.ndarray, vocab: Vocabulary) -> str:
    """The raw greedy text of one utterance (T, V), as training's evaluation reads it."""
    return greedy_decode_batch(log_probs[None], np.array([len(log_probs)]), vocab)[0]


def greedy_transcript(log_probs: np.ndarray, vocab: Vocabulary, frame: float) -> Transcript:
    return GreedyDecoder(vocab, frame_seconds=frame).decode(log_probs)


def _path(ids: list[int], vocab_size: int = VOCAB.size) -> np.ndarray:
    """Log-probabilities whose best path is `ids`, (T, V)."""
    probs = np.full((len(ids), vocab_size), 0.1 / (vocab_size - 1), dtype=np.float32)
    probs[np.arange(len(ids)), ids] = 0.9
    return np.log(probs)


def _ids(text: str) -> list[int]:
    """'-' is the blank, other characters are vocabulary symbols."""
    return [0 if c == "-" else VOCAB.index[c] for c in text]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param("", "", id="no-frames"),
        pytest.param("---", "", id="all-blank"),
        pytest.param("aaa", "a", id="repeats-merge"),
        pytest.param("aa-a", "aa", id="blank-separates-repeats"),
        pytest.param("-a-b-", "ab", id="blanks-dropped"),
        pytest.param("hhe-l-lloo", "hello", id="double-letter"),
        pytest.param("hi  -there", "hi there", id="space-is-a-symbol"),
        pytest.param("don''t", "don't", id="apostrophe"),
    ],
)
def test_greedy_decode(path: str, expected: str) -> None:
    assert greedy_decode(_path(_ids(path)), VOCAB) == expected


def test_greedy_ids_with_another_blank() -> None:
    assert greedy_ids(_path([2, 2, 1, 1, 2, 0], vocab_size=3), blank_id=2) == [1, 0]


def test_greedy_decode_batch_ignores_padding() -> None:
    rows = ["caa-t", "do-g-", "aa"]
    length = max(map(len, rows)) + 3
    z = VOCAB.index["z"]
    batch = np.stack([_path(_ids(r) + [z] * (length - len(r))) for r in rows])  # pad with "z"
    lengths = np.array([len(r) for r in rows])
    assert greedy_decode_batch(batch, lengths, VOCAB) == ["cat", "dog", "a"]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(
            lambda: greedy_decode(np.zeros((4, 10)), VOCAB), "vocabulary has 29", id="wrong-vocab"
        ),
        pytest.param(lambda: greedy_ids(np.zeros(4)), r"shape \(T, V\)", id="1d"),
        pytest.param(
            lambda: greedy_decode_batch(np.zeros((2, 4, 29)), np.array([5, 1]), VOCAB),
            r"lengths must lie in \[0, 4\]",
            id="length-too-long",
        ),
        pytest.param(
            lambda: greedy_decode_batch(np.zeros((2, 4, 29)), np.array([1]), VOCAB),
            r"lengths must have shape \(2,\)",
            id="lengths-shape",
        ),
    ],
)
def test_bad_shapes_are_rejected(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- transcripts

FRAME = 0.02  # s: 10 ms hop, time stride 2


def _peaky(path: str, *, peaks: dict[int, float] | None = None, seed: int | None = None):
    """(T, V) log-probs spelling `path` ('-' is the blank): 0.9 on the path, or `peaks[t]`.

    With `seed`, every probability is jittered a little, so no two hypotheses of a
    beam search tie exactly (flashlight breaks exact ties by memory address).
    """
    ids = _ids(path)
    probs = np.full((len(ids), VOCAB.size), 0.1 / (VOCAB.size - 1))
    probs[np.arange(len(ids)), ids] = 0.9
    for t, p in (peaks or {}).items():
        probs[t] = (1 - p) / (VOCAB.size - 1)
        probs[t, ids[t]] = p
    if seed is not None:
        probs *= np.random.default_rng(seed).uniform(0.9, 1.1, probs.shape)
        probs /= probs.sum(axis=1, keepdims=True)
    return np.log(probs).astype(np.float32)


HI_THERE = "-hh-i--  -tthere-"  # frames: h 1-2, i 4, spaces 7-8, t 10-11, ... e 15


def test_greedy_transcript_word_times_and_confidence() -> None:
    # "i" peaks at 0.6 (frame 4); "h" is 0.9 on frame 1 but 0.95 on frame 2: its peak counts.
    log_probs = _peaky(HI_THERE, peaks={2: 0.95, 4: 0.6})
    result = greedy_transcript(log_probs, VOCAB, FRAME)
    assert result.text == "hi there"
    (hi, there) = result.words
    assert (hi.text, hi.start, hi.end) == ("hi", pytest.approx(0.02), pytest.approx(0.10))
    assert (there.start, there.end) == (pytest.approx(0.20), pytest.approx(0.32))
    assert hi.confidence == pytest.approx(0.6)  # its least sure character
    assert there.confidence == pytest.approx(0.9)
    assert result.confidence == pytest.approx(0.75)  # mean over words
    assert result.stable_words == 2


@pytest.mark.parametrize(
    ("path", "text", "times"),
    [
        pytest.param("", "", [], id="no-frames"),
        pytest.param("----", "", [], id="silence"),
        pytest.param("  a  ", "a", [(2, 3)], id="spaces-around"),
        pytest.param("a- -  b", "a b", [(0, 1), (6, 7)], id="space-runs-split"),
        pytest.param("aa-a", "aa", [(0, 4)], id="double-letter"),
        pytest.param("don''t", "don't", [(0, 6)], id="apostrophe-in-word"),
    ],
)
def test_greedy_transcript_words(path: str, text: str, times: list[tuple[int, int]]) -> None:
    log_probs = _peaky(path).reshape(len(path), VOCAB.size)
    result = greedy_transcript(log_probs, VOCAB, FRAME)
    assert result.text == text == " ".join(greedy_decode(log_probs, VOCAB).split())
    assert [(w.start, w.end) for w in result.words] == [
        (pytest.approx(a * FRAME), pytest.approx(b * FRAME)) for a, b in times
    ]


def test_empty_transcript_confidence() -> None:
    assert greedy_transcript(np.zeros((0, VOCAB.size)), VOCAB, FRAME) == Transcript("")
    silence = greedy_transcript(_peaky("---", peaks={1: 0.7}), VOCAB, FRAME)
    assert (silence.text, silence.confidence) == ("", pytest.approx(0.7))


def _chunks(log_probs: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    bounds = np.cumsum([0, *sizes])
    assert bounds[-1] >= len(log_probs)
    return [log_probs[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([1] * 17, id="frame-by-frame"),
        pytest.param([2, 0, 3, 5, 7], id="uneven-with-empty"),
        pytest.param([11, 6], id="boundary-in-a-run"),  # frames 10-11 are one "t"
    ],
)
def test_greedy_stream_equals_whole(sizes: list[int]) -> None:
    log_probs = _peaky(HI_THERE, peaks={2: 0.95, 4: 0.6}, seed=1)
    stream = GreedyDecoder(VOCAB, frame_seconds=FRAME).stream()
    for chunk in _chunks(log_probs, sizes):
        stream.accept(chunk)
    assert stream.finalize() == greedy_transcript(log_probs, VOCAB, FRAME)


@pytest.mark.parametrize(
    ("path", "split", "text"),
    [
        pytest.param("aa", 1, "a", id="repeat-across-boundary-merges"),
        pytest.param("a-a", 2, "aa", id="blank-across-boundary-separates"),
        pytest.param("a-a", 1, "aa", id="blank-first-in-chunk"),
    ],
)
def test_greedy_stream_carries_the_last_symbol(path: str, split: int, text: str) -> None:
    stream = GreedyDecoder(VOCAB, frame_seconds=FRAME).stream()
    log_probs = _peaky(path)
    stream.accept(log_probs[:split])
    assert stream.accept(log_probs[split:]).text == text
    assert stream.finalize().text == text


def test_greedy_stream_partials_and_stability() -> None:
    stream = GreedyDecoder(VOCAB, frame_seconds=FRAME).stream()
    log_probs = _peaky(HI_THERE)
    first = stream.accept(log_probs[:12])
    assert (first.text, first.stable_words) == ("hi t", 1)  # "t" may still grow
    assert stream.partial() == first
    stream.accept(log_probs[12:])
    final = stream.finalize()
    assert (final.text, final.stable_words) == ("hi there", 2)
    assert stream.finalize() is final
    with pytest.raises(RuntimeError, match="finalized"):
        stream.accept(log_probs[:1])


@pytest.mark.parametrize(
    ("log_probs", "match"),
    [
        pytest.param(np.zeros((4, 10)), "vocabulary has 29", id="wrong-vocab"),
        pytest.param(np.zeros((4,)), r"shape \(T, V\)", id="1d"),
        pytest.param(np.full((2, 29), np.nan), "NaN", id="nan"),
        pytest.param(np.full((2, 29), np.inf), r"\+inf", id="plus-inf"),
    ],
)
def test_greedy_transcript_rejects_bad_input(log_probs: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        greedy_transcript(log_probs, VOCAB, FRAME)


def test_bad_frame_seconds() -> None:
    with pytest.raises(ValueError, match="frame_seconds"):
        GreedyDecoder(VOCAB, frame_seconds=0.0)


# ---------------------------------------------------------------- beam search


@pytest.fixture(scope="module")
def flashlight() -> None:
    pytest.importorskip("flashlight.lib.text.decoder", reason="flashlight-text not installed")


@pytest.fixture(scope="module")
def cat_lm(tmp_path_factory: pytest.TempPathFactory, flashlight: None) -> str:
    path = tmp_path_factory.mktemp("lm") / "cats.arpa"
    build_arpa(
        ["the cat sat on the mat", "the cat sat", "a cat sat on a mat", "the dog ran"],
        path,
        order=3,
    )
    return str(path)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(HI_THERE, id="hi-there"),
        pytest.param("-hhe-l-lloo  -wwo-r-l-dd--", id="double-letters"),
        pytest.param("  don''t -- st-op", id="apostrophe"),
        pytest.param("---", id="silence"),
    ],
)
def test_beam_without_lm_equals_greedy_on_peaky_input(flashlight: None, path: str) -> None:
    log_probs = _peaky(path, seed=2)
    beam = BeamSearchDecoder(VOCAB, frame_seconds=FRAME).decode(log_probs)
    assert beam == greedy_transcript(log_probs, VOCAB, FRAME)


def test_beam_sums_over_alignments(flashlight: None) -> None:
    # Each frame: blank 0.4, "a" 0.35. Best path "--" -> "" (0.16), but "a" has three
    # alignments (aa, a-, -a): 0.35^2 + 2 * 0.35 * 0.4 = 0.4025.
    probs = np.full((2, VOCAB.size), 0.25 / (VOCAB.size - 2))
    probs[:, 0], probs[:, VOCAB.index["a"]] = 0.4, 0.35
    log_probs = np.log(probs)
    assert greedy_transcript(log_probs, VOCAB, FRAME).text == ""
    result = BeamSearchDecoder(VOCAB, frame_seconds=FRAME).decode(log_probs)
    assert result.text == "a"
    assert result.words[0].confidence == pytest.approx(0.35)


def _blur(log_probs: np.ndarray, frames: list[int], probs: dict[str, float]) -> np.ndarray:
    """Give `frames` the distribution `probs` ('-' is the blank), the rest spread evenly."""
    row = np.full(VOCAB.size, (1 - sum(probs.values())) / (VOCAB.size - len(probs)))
    for symbol, p in probs.items():
        row[_ids(symbol)[0]] = p
    log_probs = log_probs.copy()
    log_probs[frames] = np.log(row)
    return log_probs


def _ambiguous_cat() -> np.ndarray:
    """ "the ?at sat" where the acoustics prefer "b" (0.5) to "c" (0.4)."""
    return _blur(_peaky("-tt-he-  -c-a-t-  -s-a-tt-", seed=3), [10], {"b": 0.5, "c": 0.4})


def test_lm_flips_an_ambiguous_word(cat_lm: str) -> None:
    log_probs = _ambiguous_cat()
    assert greedy_transcript(log_probs, VOCAB, FRAME).text == "the bat sat"
    assert BeamSearchDecoder(VOCAB, frame_seconds=FRAME).decode(log_probs).text == "the bat sat"
    with_lm = BeamSearchDecoder(VOCAB, frame_seconds=FRAME, lm_path=cat_lm).decode(log_probs)
    assert with_lm.text == "the cat sat"
    assert with_lm.words[1].confidence == pytest.approx(0.4, rel=0.1)  # acoustics still doubt it


def test_lm_restores_spaces_the_acoustics_barely_hint_at(cat_lm: str) -> None:
    path = "-tt-he- -c-a-t- -s-a-tt- -o-n- -t-h-e- -m-a-t-"
    spaces = [t for t, c in enumerate(path) if c == " "]
    log_probs = _blur(_peaky(path, seed=6), spaces, {" ": 0.3, "-": 0.6})
    assert greedy_transcript(log_probs, VOCAB, FRAME).text == "thecatsatonthemat"
    decoder = BeamSearchDecoder(VOCAB, frame_seconds=FRAME, lm_path=cat_lm)
    assert decoder.decode(log_probs).text == "the cat sat on the mat"


def test_lm_keeps_words_it_has_never_seen(cat_lm: str) -> None:
    log_probs = _peaky("-z-e-b-r-a-  -s-a-tt-", seed=4)
    decoder = BeamSearchDecoder(VOCAB, frame_seconds=FRAME, lm_path=cat_lm)
    assert decoder.decode(log_probs).text == "zebra sat"


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([1] * 26, id="frame-by-frame"),
        pytest.param([3, 0, 7, 5, 11], id="uneven-with-empty"),
    ],
)
@pytest.mark.parametrize("with_lm", [pytest.param(False, id="no-lm"), pytest.param(True, id="lm")])
def test_beam_stream_equals_whole(cat_lm: str, sizes: list[int], with_lm: bool) -> None:
    decoder = BeamSearchDecoder(VOCAB, frame_seconds=FRAME, lm_path=cat_lm if with_lm else None)
    log_probs = _ambiguous_cat()
    stream = decoder.stream()
    partials = [stream.accept(chunk) for chunk in _chunks(log_probs, sizes)]
    final = stream.finalize()
    assert final == decoder.decode(log_probs)
    assert final.stable_words == len(final.words) == 3
    assert all(p.stable_words <= max(len(p.words) - 1, 0) for p in partials)
    assert partials[-1].text.startswith("the")


def test_beam_stream_stability(cat_lm: str) -> None:
    decoder = BeamSearchDecoder(VOCAB, frame_seconds=FRAME, lm_path=cat_lm)
    log_probs = _ambiguous_cat()
    stream = decoder.stream(stable_after=3)
    partials = [stream.accept(frame[None]) for frame in log_probs]
    # "the" becomes stable once "ca" follows it, never before 3 partials agree.
    first_stable = next(i for i, p in enumerate(partials) if p.stable_words)
    assert partials[first_stable].text.startswith("the c")
    assert [p.words[:1] for p in partials[first_stable - 2 : first_stable + 1]] == [
        partials[first_stable].words[:1]
    ] * 3
    assert (partials[-1].text, partials[-1].stable_words) == ("the cat sat", 2)


def test_beam_n_best_alternatives(flashlight: None) -> None:
    """With "the ?at sat" (b 0.5, c 0.4) the best is "the bat sat", the next "the cat sat";
    every alternative has its own text, words and confidence; n_best 1 gives none."""
    log_probs = _ambiguous_cat()
    decoder = BeamSearchDecoder(VOCAB, frame_seconds=FRAME)
    best = decoder.decode(log_probs, n_best=4)
    assert best.text == "the bat sat" and best.alternatives[0].text == "the cat sat"
    texts = [best.text, *(t.text for t in best.alternatives)]
    assert 2 <= len(texts) <= 4 and len(set(texts)) == len(texts)
    assert best.alternatives[0].words[1].confidence == pytest.approx(0.4, rel=0.1)
    assert all(t.stable_words == len(t.words) for t in best.alternatives)
    assert decoder.decode(log_probs).alternatives == ()
    assert replace(best, alternatives=()) == decoder.decode(log_probs)
    greedy = GreedyDecoder(VOCAB, frame_seconds=FRAME).decode(log_probs, n_best=4)
    assert greedy.alternatives == ()


def test_beam_empty_input(flashlight: None) -> None:
    decoder = BeamSearchDecoder(VOCAB, frame_seconds=FRAME)
    assert decoder.decode(np.zeros((0, VOCAB.size))) == Transcript("")
    assert decoder.stream().finalize() == Transcript("")


@pytest.mark.parametrize(
    ("log_probs", "match"),
    [
        pytest.param(np.zeros((4, 10)), "vocabulary has 29", id="wrong-vocab"),
        pytest.param(np.full((2, 29), np.nan), "NaN", id="nan"),
        pytest.param(np.zeros((1, 2, 29)), r"shape \(T, V\)", id="3d"),
    ],
)
def test_beam_rejects_bad_input(flashlight: None, log_probs: np.ndarray, match: str) -> None:
    decoder = BeamSearchDecoder(VOCAB, frame_seconds=FRAME)
    with pytest.raises(ValueError, match=match):
        decoder.decode(log_probs)
    with pytest.raises(ValueError, match=match.replace("T, V", "t, V")):
        decoder.stream().accept(log_probs)


def test_missing_lm_file_is_named(flashlight: None, tmp_path) -> None:
    missing = tmp_path / "nowhere.arpa"
    with pytest.raises(FileNotFoundError, match="nowhere.arpa"):
        BeamSearchDecoder(VOCAB, frame_seconds=FRAME, lm_path=missing)


def test_missing_flashlight_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake at the seam under test: the import fails as it does where the extra is missing.
    monkeypatch.setitem(sys.modules, "flashlight.lib.text", None)
    with pytest.raises(ImportError, match=r"pip install 'echoic\[serve\]'"):
        BeamSearchDecoder(VOCAB, frame_seconds=FRAME)


def test_decoders_of_one_lm_file_share_one_copy(cat_lm: str, tmp_path) -> None:
    """Every beam size asked for decodes with the same loaded LM (one copy per file),
    with the same results as a decoder of its own; a changed file is loaded again."""
    log_probs = _ambiguous_cat()
    small, big = (
        BeamSearchDecoder(VOCAB, frame_seconds=FRAME, lm_path=cat_lm, beam_size=n) for n in (8, 16)
    )
    assert small.lm is not None and small.lm is big.lm
    assert big.decode(log_probs) == small.decode(log_probs)
    other = tmp_path / "other.arpa"
    build_arpa(["the bat sat"], other, order=2)
    assert BeamSearchDecoder(VOCAB, frame_seconds=FRAME, lm_path=other).lm is not small.lm
