"""Word n-gram language models in ARPA format: build one from text, read one, score with it.

`build_arpa` estimates an interpolated modified Kneser-Ney model (Chen & Goodman
1998, the estimate KenLM's lmplz makes), so the beam search decoder can load it
through KenLM without any external tool:

- Counts. The highest order uses raw counts; a lower order uses continuation
  counts (how many distinct words precede the n-gram), except n-grams that
  begin with <s>, which nothing can precede, and which keep raw counts.
- Discounts. Per order, from the counts-of-counts t1..t4 of those counts:
  Y = t1 / (t1 + 2 t2), D1 = 1 - 2Y t2/t1, D2 = 2 - 3Y t3/t2, D3+ = 3 - 4Y t4/t3.
  Small corpora can leave some t_k at zero or a D outside (0, k]; that order
  then falls back to one discount for every count, D = Y (0.5 when t1 or t2 is
  zero): interpolated Kneser-Ney with a single discount.
- Interpolation. p(w | h) = (c(hw) - D(c(hw))) / c(h.) + gamma(h) p(w | h'), with
  gamma(h) = (D1 N1(h.) + D2 N2(h.) + D3+ N3+(h.)) / c(h.) and h' = h without its
  first word; unigrams interpolate with the uniform distribution over the
  vocabulary (every word, </s> and <unk>; not <s>, which is never predicted).
  The ARPA file stores the interpolated p for each seen n-gram and gamma(h) as
  the back-off weight of h, so back-off reproduces the interpolated model exactly.
- Pruning (optional). N-grams of order 2 and up that occur once are dropped and
  the back-off weights renormalised so every distribution still sums to 1.

Text goes through `normalize_text`, so the model spells words as the acoustic
model's transcripts do.

A model directory ships its LM as `lm.bin` (KenLM's binary format, converted from the
ARPA file by scripts/build_lm_binary.sh: it loads faster) or `lm.arpa`; `model_lm` finds
it, the binary first, and `lm_words` reads the vocabulary of either.
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from echoic.model.core.text import normalize_text

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
_NEVER = -99.0  # log10 probability ARPA files give <s>, which is only ever a context

Ngram = tuple[str, ...]


class ArpaError(ValueError):
    """An ARPA file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class ArpaStats:
    """What `build_arpa` wrote."""

    sentences: int  # non-empty sentences after normalisation
    words: int  # running words, </s> excluded
    ngrams: tuple[int, ...]  # entries per order, unigrams first
    discounts: tuple[tuple[float, float, float], ...]  # (D1, D2, D3+) per order
    pruned: int  # n-grams dropped by min_count


def build_arpa(
    sentences: Iterable[str],
    out_path: str | os.PathLike[str],
    *,
    order: int = 3,
    prune_singletons: bool = False,
    min_count: int = 1,
) -> ArpaStats:
    """Estimate an interpolated modified Kneser-Ney model of `order` and write it as ARPA.
    N-grams of order 2 and up seen fewer than `min_count` times are pruned (and the
    back-offs renormalised); `prune_singletons` is `min_count=2`."""
    if order < 1:
        raise ValueError(f"order must be at least 1, got {order}")
    if min_count < 1:
        raise ValueError(f"min_count must be at least 1, got {min_count}")
    min_count = max(min_count, 2 if prune_singletons else 1)
    raw, n_sentences, n_words = _count(sentences, order)
    if not n_sentences:
        raise ValueError("no words to build a language model from (all sentences are empty)")
    adjusted = _adjusted_counts(raw)
    discounts = tuple(_discounts(counts.values()) for counts in adjusted)

    log10p: list[dict[Ngram, float]] = []
    gammas: list[dict[Ngram, float]] = []  # contexts of order n -> interpolation weight
    prob = _unigram_probs(adjusted[0], discounts[0])
    log10p.append({g: math.log10(p) for g, p in prob.items()})
    log10p[0][(BOS,)] = _NEVER
    for n in range(2, order + 1):
        prob, gamma = _interpolate(adjusted[n - 1], discounts[n - 1], prob)
        log10p.append({g: math.log10(p) for g, p in prob.items()})
        gammas.append(gamma)

    pruned = 0
    if min_count > 1:
        for n in range(2, order + 1):
            keep = {g: lp for g, lp in log10p[n - 1].items() if raw[n - 1][g] >= min_count}
            pruned += len(log10p[n - 1]) - len(keep)
            log10p[n - 1] = keep
        backoff = _renormalised_backoffs(log10p)
    else:
        backoff = {h: math.log10(g) for gamma in gammas for h, g in gamma.items() if g > 0}

    _write_arpa(out_path, log10p, backoff)
    return ArpaStats(
        sentences=n_sentences,
        words=n_words,
        ngrams=tuple(len(p) for p in log10p),
        discounts=discounts,
        pruned=pruned,
    )


def _count(sentences: Iterable[str], order: int) -> tuple[list[Counter[Ngram]], int, int]:
    raw: list[Counter[Ngram]] = [Counter() for _ in range(order)]
    n_sentences = n_words = 0
    for sentence in sentences:
        words = normalize_text(sentence).split()
        if not words:
            continue
        n_sentences += 1
        n_words += len(words)
        tokens = (BOS, *words, EOS)
        for n in range(1, order + 1):
            counts = raw[n - 1]
            for i in range(len(tokens) - n + 1):
                counts[tokens[i : i + n]] += 1
    return raw, n_sentences, n_words


def _adjusted_counts(raw: list[Counter[Ngram]]) -> list[dict[Ngram, int]]:
    """Raw counts at the top order; continuation counts below it (raw for n-grams at <s>)."""
    adjusted: list[dict[Ngram, int]] = [dict(raw[-1])]
    for n in range(len(raw) - 1, 0, -1):
        preceded = Counter(g[1:] for g in raw[n])  # distinct words before each n-gram
        adjusted.insert(0, {g: c if g[0] == BOS else preceded[g] for g, c in raw[n - 1].items()})
    adjusted[0].pop((BOS,), None)  # <s> is a context, never predicted
    return adjusted


def _discounts(counts: Iterable[int]) -> tuple[float, float, float]:
    t = Counter(min(c, 4) for c in counts)
    t1, t2, t3, t4 = (t[k] for k in (1, 2, 3, 4))
    y = t1 / (t1 + 2 * t2) if t1 and t2 else 0.5
    if t1 and t2 and t3 and t4:
        d = (1 - 2 * y * t2 / t1, 2 - 3 * y * t3 / t2, 3 - 4 * y * t4 / t3)
        if all(0 < dk <= k for k, dk in enumerate(d, start=1)):
            return d
    return (y, y, y)


def _discount(count: int, discounts: tuple[float, float, float]) -> float:
    return discounts[min(count, 3) - 1]


def _unigram_probs(
    counts: dict[Ngram, int], discounts: tuple[float, float, float]
) -> dict[Ngram, float]:
    vocabulary = {**counts, (UNK,): counts.get((UNK,), 0)}
    total = sum(counts.values())
    left_over = sum(_discount(c, discounts) for c in counts.values()) / total
    uniform = left_over / len(vocabulary)
    return {
        g: (c - _discount(c, discounts) if c else 0.0) / total + uniform
        for g, c in sorted(vocabulary.items())
    }


def _interpolate(
    counts: dict[Ngram, int],
    discounts: tuple[float, float, float],
    lower: dict[Ngram, float],
) -> tuple[dict[Ngram, float], dict[Ngram, float]]:
    """One order's interpolated probabilities of its seen n-grams, and gamma per context."""
    by_context: dict[Ngram, list[tuple[Ngram, int]]] = defaultdict(list)
    for g, c in counts.items():
        by_context[g[:-1]].append((g, c))
    prob: dict[Ngram, float] = {}
    gamma: dict[Ngram, float] = {}
    for h, followers in sorted(by_context.items()):
        total = sum(c for _, c in followers)
        gamma[h] = sum(_discount(c, discounts) for _, c in followers) / total
        for g, c in sorted(followers):
            prob[g] = (c - _discount(c, discounts)) / total + gamma[h] * lower[g[1:]]
    return prob, gamma


def _renormalised_backoffs(log10p: list[dict[Ngram, float]]) -> dict[Ngram, float]:
    """Back-off weights that make each context's distribution sum to 1 over what is kept."""
    model = ArpaModel(log10p, {})
    for n in range(2, len(log10p) + 1):
        followers: dict[Ngram, list[str]] = defaultdict(list)
        for g in log10p[n - 1]:
            followers[g[:-1]].append(g[-1])
        for h, words in followers.items():
            seen = math.fsum(10 ** log10p[n - 1][(*h, w)] for w in words)
            lower = math.fsum(10 ** model.log10_prob(w, h[1:]) for w in words)
            if lower < 1 - 1e-12 and seen < 1:
                model.backoff[h] = math.log10((1 - seen) / (1 - lower))
    return model.backoff


def _write_arpa(
    path: str | os.PathLike[str], log10p: list[dict[Ngram, float]], backoff: dict[Ngram, float]
) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\\data\\\n")
        for n, entries in enumerate(log10p, start=1):
            f.write(f"ngram {n}={len(entries)}\n")
        for n, entries in enumerate(log10p, start=1):
            f.write(f"\n\\{n}-grams:\n")
            for g in sorted(entries):
                line = f"{entries[g]:.7f}\t{' '.join(g)}"
                if g in backoff:
                    line += f"\t{backoff[g]:.7f}"
                f.write(line + "\n")
        f.write("\n\\end\\\n")
    os.replace(tmp, path)  # a reader never sees half a model


# ---------------------------------------------------------------- reading and scoring


class ArpaModel:
    """A back-off n-gram model read from ARPA text: log10 p(word | context)."""

    def __init__(self, log10p: list[dict[Ngram, float]], backoff: dict[Ngram, float]) -> None:
        self.log10p = log10p  # per order: n-gram -> log10 probability
        self.backoff = backoff  # context -> log10 back-off weight (absent: 0)

    @property
    def order(self) -> int:
        return len(self.log10p)

    @property
    def vocabulary(self) -> list[str]:
        """Every unigram, <s> and </s> and <unk> included."""
        return [g[0] for g in self.log10p[0]]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ArpaModel:
        log10p: list[dict[Ngram, float]] = []
        backoff: dict[Ngram, float] = {}
        for n, fields, lineno in _arpa_entries(path):
            if n > len(log10p):
                log10p.append({})
            width = len(fields) - n
            if width not in (1, 2):
                raise ArpaError(f"{path}:{lineno}: expected {n} words after the probability")
            g = tuple(fields[1 : n + 1])
            log10p[n - 1][g] = float(fields[0])
            if width == 2:
                backoff[g] = float(fields[-1])
        if not log10p:
            raise ArpaError(f"{path}: no n-grams (is it an ARPA file?)")
        return cls(log10p, backoff)

    def log10_prob(self, word: str, context: Sequence[str] = ()) -> float:
        """log10 p(word | context), backing off as far as needed; unknown words are <unk>."""
        unigrams = self.log10p[0]
        word = word if (word,) in unigrams else UNK
        context = tuple(w if (w,) in unigrams else UNK for w in context)
        context = context[len(context) - (self.order - 1) :] if self.order > 1 else ()
        penalty = 0.0
        for k in range(len(context), -1, -1):
            h = context[len(context) - k :]
            p = self.log10p[k].get((*h, word))
            if p is not None:
                return penalty + p
            penalty += self.backoff.get(h, 0.0)
        raise ArpaError(f"{UNK} is missing from the model's unigrams")

    def log10_sentence(self, text: str) -> float:
        """log10 p of a whole normalised sentence, from <s> to </s>."""
        history = [BOS]
        total = 0.0
        for word in (*normalize_text(text).split(), EOS):
            total += self.log10_prob(word, history)
            history.append(word)
        return total


# The word LM a model directory may ship beside its graphs, in the order a loader prefers
# them: KenLM's binary format (scripts/build_lm_binary.sh makes it from the ARPA file; it
# loads in a fraction of the ARPA's time, docs/models-and-import.md), then the ARPA file.
LM_BINARY, LM_ARPA = "lm.bin", "lm.arpa"
LM_FILES = (LM_BINARY, LM_ARPA)

# KenLM's binary files begin with this (lm/binary_format.cc, kMagicBytes: format version 5).
_KENLM_MAGIC = b"mmap lm http://kheafield.com/code format version 5\n\0\0"
_KENLM_OLD_MAGIC = b"mmap lm http://kheafield.com/code"
_KENLM_SANITY = (len(_KENLM_MAGIC) + 7) // 8 * 8 + 12 + 12 + 8  # magic, 3 floats, 3 ids, 1


def model_lm(model_dir: str | os.PathLike[str]) -> Path | None:
    """The word LM a model directory ships (the first of `LM_FILES` there), or None."""
    for name in LM_FILES:
        if (path := Path(model_dir) / name).is_file():
            return path
    return None


def is_kenlm_binary(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a KenLM binary file (of any format version) rather than text."""
    with open(path, "rb") as f:
        return f.read(len(_KENLM_OLD_MAGIC)) == _KENLM_OLD_MAGIC


def lm_words(path: str | os.PathLike[str]) -> list[str]:
    """The unigrams of a word LM: an ARPA file's, or a KenLM binary file's."""
    return binary_words(path) if is_kenlm_binary(path) else arpa_words(path)


def binary_words(path: str | os.PathLike[str]) -> list[str]:
    """The vocabulary of a KenLM binary file: build_binary writes the words at its end,
    each followed by a NUL, <unk> first (lm/vocab.cc); the header gives how many."""
    import struct

    with open(path, "rb") as f:
        head = f.read(_KENLM_SANITY + 20)
        if not head.startswith(_KENLM_MAGIC) or len(head) < _KENLM_SANITY + 20:
            raise ArpaError(
                f"{path}: a KenLM binary file of another format version than 5:"
                " rebuild it from its ARPA file (scripts/build_lm_binary.sh)"
            )
        _, _, _, has_words, _ = struct.unpack_from("<Bxxxfi?xxxI", head, _KENLM_SANITY)
        if not has_words:
            raise ArpaError(
                f"{path}: built without its vocabulary (build_binary -v):"
                " rebuild it from its ARPA file (scripts/build_lm_binary.sh)"
            )
        f.seek(_KENLM_SANITY + 20)
        (unigrams,) = struct.unpack("<Q", f.read(8))
        size = f.seek(0, os.SEEK_END)
        tail, end = b"", size
        while end > 0:  # back from the end, a MiB at a time, to the last "<unk>\0" there
            start = max(0, end - (1 << 20))
            f.seek(start)
            tail, end = f.read(end - start) + tail, start
            at = tail.rfind(b"<unk>\0")
            while at >= 0 and tail.count(b"\0", at) != unigrams:
                at = tail.rfind(b"<unk>\0", 0, at)  # a word that ends in "<unk>"
            if at >= 0:
                return tail[at:-1].decode("utf-8").split("\0")
    raise ArpaError(f"{path}: no vocabulary of {unigrams} words at its end (truncated?)")


def arpa_words(path: str | os.PathLike[str]) -> list[str]:
    """The unigrams of an ARPA file, read without loading the higher orders."""
    words = []
    for n, fields, _ in _arpa_entries(path):
        if n > 1:
            break
        words.append(fields[1])
    if not words:
        raise ArpaError(f"{path}: no unigrams (is it an ARPA file?)")
    return words


def _arpa_entries(path: str | os.PathLike[str]) -> Iterator[tuple[int, list[str], int]]:
    """(order, whitespace-split fields, line number) for each n-gram line."""
    order = 0
    seen_data = False
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            if line == "\\data\\":
                seen_data = True
            elif line == "\\end\\":
                return
            elif line.startswith("\\") and line.endswith("-grams:"):
                order = int(line[1 : -len("-grams:")])
            elif order:
                yield order, line.split(), lineno
            elif not seen_data:
                raise ArpaError(f"{path}:{lineno}: not an ARPA file (no \\data\\ header)")
