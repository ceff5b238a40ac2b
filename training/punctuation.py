"""Train the punctuation and capitals tagger on English prose that Debian ships, and export it.

    python -m echoic.training.punctuation --out model/punct/punct.onnx

Data recipe (deterministic: same files, same seed, same split):

- the fortune files (package `fortunes`, /usr/share/games/fortunes): each record's prose,
  attributions cut off and verse skipped (`training/corpus.py:fortune_records`);
- the GNU manuals (/usr/share/info/*.info*.gz): paragraphs of running text (lines
  indented as body text, ending in a sentence end), examples and tables skipped;
- WordNet's example sentences when `wordnet-base` is installed (/usr/share/wordnet).

Each paragraph becomes its words with tags (`model/core/punctuation.py:tags_of_prose`).
Paragraphs are split into train and held-out by a hash of their text, so the held-out
scores are on text never seen in training. Training examples are windows of up to
`window` words, half of them starting at a sentence start (as a final result does) and
half anywhere; the held-out set is each held-out paragraph from its start, cut into
windows, scored as the server uses the tagger (`end_sentence`: the last word's mark is
always a sentence end). No recording or transcript of a person is used.

Torch gets one thread: the machine it was trained on is shared.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from echoic.model.core.punctuation import (
    CASES,
    MARKS,
    Tagged,
    WordList,
    encode,
    end_sentence,
    tags_of_prose,
)
from echoic.model.nn.punctuation import Tagger, TaggerConfig, export_tagger
from echoic.training.corpus import DEFAULT_FORTUNES_DIR, fortune_files, fortune_records

INFO_DIR = Path("/usr/share/info")
WORDNET_DIR = Path("/usr/share/wordnet")
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
    for path in sorted(directory.glob("data.*")):
        for line in path.read_text(encoding="latin-1").splitlines():
            if "|" in line and not line.startswith("  "):
                for example in re.findall(r'"([^"]+)"', line.split("|", 1)[1]):
                    if example[:1].isupper() and example[-1] in ".?!":
                        yield example


def corpus(held_out_percent: int = 5) -> tuple[list[list[Tagged]], list[list[Tagged]], dict]:
    """(train paragraphs, held-out paragraphs, counts per source), as tagged words."""
    sources = {"fortunes": fortune_paragraphs(), "info": info_paragraphs()}
    if WORDNET_DIR.is_dir():
        sources["wordnet"] = wordnet_paragraphs()
    train: list[list[Tagged]] = []
    held: list[list[Tagged]] = []
    counts: dict[str, int] = {}
    seen: set[int] = set()
    for name, paragraphs in sources.items():
        n = 0
        for paragraph in paragraphs:
            key = zlib.crc32(paragraph.lower().encode())
            tagged = tags_of_prose(paragraph)
            if key in seen or len(tagged) < 3:
                continue
            seen.add(key)
            n += 1
            (held if key % 100 < held_out_percent else train).append(tagged)
        counts[name] = n
    return train, held, counts


def word_list(paragraphs: Sequence[list[Tagged]], size: int) -> WordList:
    counts = Counter(t.token for p in paragraphs for t in p)
    return WordList(tuple(w for w, _ in counts.most_common(size)))


def windows(
    paragraph: list[Tagged], window: int, rng: np.random.Generator
) -> Iterator[list[Tagged]]:
    """Training windows over one paragraph: from sentence starts and from anywhere."""
    starts = [0] + [i + 1 for i, t in enumerate(paragraph[:-1]) if t.mark >= 2]
    for start in starts:
        if rng.random() < 0.5:
            start = int(rng.integers(0, len(paragraph)))
        piece = paragraph[start : start + int(rng.integers(4, window + 1))]
        if len(piece) >= 2:
            yield piece


def batches(paragraphs, words: WordList, window: int, batch: int, rng: np.random.Generator):
    pieces = [w for p in paragraphs for w in windows(p, window, rng)]
    order = rng.permutation(len(pieces))
    for i in range(0, len(order), batch):
        group = [pieces[j] for j in order[i : i + batch]]
        t = max(len(g) for g in group)
        w = np.zeros((len(group), t), np.int64)
        c = np.zeros((len(group), t, 12), np.int64)
        marks = np.full((len(group), t), -100, np.int64)
        cases = np.full((len(group), t), -100, np.int64)
        for k, g in enumerate(group):
            wi, ci = encode([x.token for x in g], words)
            w[k, : len(g)], c[k, : len(g)] = wi, ci
            marks[k, : len(g)] = [x.mark for x in g]
            cases[k, : len(g)] = [x.case if x.case >= 0 else -100 for x in g]
        yield (torch.from_numpy(a) for a in (w, c, marks, cases))


def held_out_windows(paragraphs: Sequence[list[Tagged]], window: int) -> list[list[Tagged]]:
    return [p[i : i + window] for p in paragraphs for i in range(0, len(p), window)]


def score(model: Tagger, pieces: Sequence[list[Tagged]], words: WordList) -> dict:
    """F1 per mark and the share of words cased right, as the server tags a final result."""
    model.eval()
    tp, fp, fn = Counter(), Counter(), Counter()
    right = total = 0
    with torch.no_grad():
        for piece in pieces:
            w, c = encode([x.token for x in piece], words)
            ml, cl = model(torch.from_numpy(w)[None], torch.from_numpy(c)[None])
            marks = end_sentence(ml[0].numpy())
            cases = cl[0].argmax(-1).tolist()
            for x, m, k in zip(piece, marks, cases, strict=True):
                if x.case >= 0:
                    right += x.case == k
                    total += 1
                for mark in (1, 2, 3):
                    tp[mark] += x.mark == mark and m == mark
                    fp[mark] += x.mark != mark and m == mark
                    fn[mark] += x.mark == mark and m != mark
    out: dict = {}
    for mark in (1, 2, 3):
        p = tp[mark] / max(tp[mark] + fp[mark], 1)
        r = tp[mark] / max(tp[mark] + fn[mark], 1)
        out[MARKS[mark]] = {"precision": round(p, 3), "recall": round(r, 3),
                            "f1": round(2 * p * r / max(p + r, 1e-9), 3),
                            "support": tp[mark] + fn[mark]}  # fmt: skip
    out["case_accuracy"] = round(right / max(total, 1), 4)
    out["words"] = sum(len(p) for p in pieces)
    out["cased_words"] = total
    model.train()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("model/punct/punct.onnx"))
    ap.add_argument("--minutes", type=float, default=20.0, help="training time budget")
    ap.add_argument("--window", type=int, default=48, help="most words per training window")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train, held, counts = corpus()
    cfg = TaggerConfig()
    words = word_list(train, cfg.words)
    n_train = sum(len(p) for p in train)
    n_held = sum(len(p) for p in held)
    print(f"paragraphs per source {counts}; words: train {n_train}, held out {n_held}")
    model = Tagger(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)
    # Rare marks matter as much as the common "no mark": weigh them up a little.
    mark_loss = nn.CrossEntropyLoss(ignore_index=-100, weight=torch.tensor([1.0, 2.0, 2.0, 3.0]))
    pieces = held_out_windows(held, 60)
    deadline = time.monotonic() + 60 * args.minutes
    best, best_state, epoch = -1.0, None, 0
    while time.monotonic() < deadline:
        epoch += 1
        total = n = 0
        for w, c, marks, cases in batches(train, words, args.window, args.batch, rng):
            ml, cl = model(w, c)
            loss = mark_loss(ml.reshape(-1, len(MARKS)), marks.reshape(-1)) + loss_fn(
                cl.reshape(-1, len(CASES)), cases.reshape(-1)
            )
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total, n = total + loss.item(), n + 1
            if time.monotonic() > deadline:
                break
        scores = score(model, pieces, words)
        mean_f1 = sum(scores[m]["f1"] for m in ",.?") / 3 + scores["case_accuracy"]
        print(f"epoch {epoch} loss {total / max(n, 1):.4f} {json.dumps(scores)}", flush=True)
        if mean_f1 > best:
            best, best_state = mean_f1, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    scores = score(model, pieces, words)
    scores["data"] = {"paragraphs": counts, "train_words": n_train, "held_out_words": n_held}
    print("held-out scores", json.dumps(scores))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    export_tagger(model, words, scores, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
