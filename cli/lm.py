"""`echoic lm`: build a word n-gram language model (ARPA) for beam search decoding."""

from __future__ import annotations

import argparse
import dataclasses
import json

EXAMPLES = """\
examples:
  # a trigram model of the training sentences, for `--lm` at decoding time
  echoic lm data/text/train.txt data/lm/train.3gram.arpa

  # a smaller model: bigrams, n-grams seen once dropped, summary as JSON
  echoic lm data/text/train.txt /tmp/small.arpa --order 2 --prune-singletons --json

  # the bundled model's LM: the fortunes' training sentences and WordNet's examples and
  # definitions (apt-get install wordnet-base), never a held-out sentence
  echoic lm data/default/text/train.txt --wordnet --exclude data/default/text/heldout.txt \
    model/default/lm.arpa --min-count 3

Each line is a sentence; text is normalised the way transcripts are (lower case,
numbers in words, no punctuation). The estimate is interpolated modified
Kneser-Ney; the file loads in KenLM and in echoic's beam search decoder.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "lm",
        help="build an n-gram language model (ARPA) from text files",
        description="Estimate a word n-gram language model (interpolated modified\n"
        "Kneser-Ney) from text files, one sentence a line, and write it as ARPA.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("text", metavar="TEXT_FILE", nargs="*", help="sentences, one a line (UTF-8)")
    p.add_argument("out", metavar="OUT.arpa", help="the ARPA file to write")
    p.add_argument("--order", type=int, default=3, metavar="N", help="n-gram order (default 3)")
    p.add_argument(
        "--prune-singletons",
        action="store_true",
        help="drop n-grams of order 2 and up seen only once (smaller model; --min-count 2)",
    )
    p.add_argument(
        "--min-count",
        type=int,
        default=1,
        metavar="N",
        help="drop n-grams of order 2 and up seen fewer than N times (default 1: none)",
    )
    p.add_argument(
        "--wordnet",
        action="store_true",
        help="also WordNet's example sentences and definitions (package wordnet-base)",
    )
    p.add_argument(
        "--wordnet-dir",
        metavar="DIR",
        default="/usr/share/wordnet",
        help="where WordNet's data.* files are (default /usr/share/wordnet)",
    )
    p.add_argument(
        "--exclude",
        metavar="FILE",
        action="append",
        default=[],
        help="leave out every sentence that normalises to a line of FILE (held-out text)",
    )
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=run)


def _lines(path: str) -> list[str]:
    from echoic.cli.errors import UserError

    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: {e}") from e


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.model.core.lm import build_arpa
    from echoic.model.core.text import normalize_text

    if args.order < 1:
        raise UserError(f"--order must be at least 1, got {args.order}")
    if not args.text and not args.wordnet:
        raise UserError("no text: give TEXT_FILEs, --wordnet, or both")
    sources = [_lines(path) for path in args.text]
    if args.wordnet:
        from echoic.training.corpus import wordnet_sentences

        try:
            sources.append(wordnet_sentences(args.wordnet_dir))
        except FileNotFoundError as e:
            raise UserError(str(e)) from e
    excluded = {normalize_text(line) for path in args.exclude for line in _lines(path)}
    sentences = [s for lines in sources for s in lines]
    if excluded:  # build_arpa normalises every sentence anyway: only then a second time
        sentences = [s for s in sentences if normalize_text(s) not in excluded]
    named = " + ".join([*args.text, *(["WordNet"] if args.wordnet else [])])
    try:
        stats = build_arpa(
            sentences,
            args.out,
            order=args.order,
            prune_singletons=args.prune_singletons,
            min_count=args.min_count,
        )
    except ValueError as e:  # no usable sentences, a bad --min-count
        raise UserError(f"{named}: {e}") from e
    if args.json:
        print(json.dumps({"out": args.out, **dataclasses.asdict(stats)}))
        return 0
    counts = ", ".join(f"{n}-grams {c:,}" for n, c in enumerate(stats.ngrams, start=1))
    pruned = f" ({stats.pruned:,} rare n-grams pruned)" if stats.pruned else ""
    print(f"{stats.sentences:,} sentences, {stats.words:,} words -> {args.out}: {counts}{pruned}")
    return 0
