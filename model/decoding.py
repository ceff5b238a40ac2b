"""CTC decoding of log-probabilities into text (greedy; numpy only).

CTC's collapse rule: take the best symbol per frame, merge runs of the same
symbol, then drop blanks. A blank between two equal symbols keeps them apart,
which is how the model spells double letters: "a a <b> a" -> "aa".
"""

from __future__ import annotations

import numpy as np

from echoic.model.text import Vocabulary


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


def greedy_decode(log_probs: np.ndarray, vocab: Vocabulary) -> str:
    """Greedy transcript of one utterance's (T, V) log-probabilities."""
    log_probs = np.asarray(log_probs)
    _check_vocab(log_probs, vocab)
    return vocab.decode(greedy_ids(log_probs, vocab.blank_id))


def greedy_decode_batch(log_probs: np.ndarray, lengths: np.ndarray, vocab: Vocabulary) -> list[str]:
    """Greedy transcripts of a padded batch: (B, T, V) and valid frames per row (B,)."""
    log_probs = np.asarray(log_probs)
    lengths = np.asarray(lengths)
    if log_probs.ndim != 3:
        raise ValueError(f"log_probs must have shape (B, T, V), got {log_probs.shape}")
    if lengths.shape != log_probs.shape[:1]:
        raise ValueError(f"lengths must have shape ({log_probs.shape[0]},), got {lengths.shape}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > log_probs.shape[1]):
        raise ValueError(f"lengths must lie in [0, {log_probs.shape[1]}], got {lengths.tolist()}")
    _check_vocab(log_probs, vocab)
    return [
        vocab.decode(greedy_ids(row[: int(n)], vocab.blank_id))
        for row, n in zip(log_probs, lengths, strict=True)
    ]
