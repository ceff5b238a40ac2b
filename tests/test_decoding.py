"""Greedy CTC decoding."""

from __future__ import annotations

import numpy as np
import pytest

from echoic.model.decoding import greedy_decode, greedy_decode_batch, greedy_ids
from echoic.model.text import Vocabulary

VOCAB = Vocabulary()


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
