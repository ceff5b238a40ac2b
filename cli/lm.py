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

Each line is a sentence; text is normalised the way transcripts are (lower case,
numbers in words, no punctuation). The estimate is interpolated modified
Kneser-Ney; the file loads in KenLM and in echoic's beam search decoder.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "lm",
        help="build an n-gram language model (ARPA) from a text file",
        description="Estimate a word n-gram language model (interpolated modified\n"
        "Kneser-Ney) from a text file, one sentence a line, and write it as ARPA.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("text", metavar="TEXT_FILE", help="sentences, one a line (UTF-8)")
    p.add_argument("out", metavar="OUT.arpa", help="the ARPA file to write")
    p.add_argument("--order", type=int, default=3, metavar="N", help="n-gram order (default 3)")
    p.add_argument(
        "--prune-singletons",
        action="store_true",
        help="drop n-grams of order 2 and up seen only once (smaller model)",
    )
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.model.core.lm import build_arpa

    if args.order < 1:
        raise UserError(f"--order must be at least 1, got {args.order}")
    with open(args.text, encoding="utf-8") as f:
        try:
            stats = build_arpa(
                f, args.out, order=args.order, prune_singletons=args.prune_singletons
            )
        except ValueError as e:  # no usable sentences, undecodable bytes
            raise UserError(f"{args.text}: {e}") from e
    if args.json:
        print(json.dumps({"out": args.out, **dataclasses.asdict(stats)}))
        return 0
    counts = ", ".join(f"{n}-grams {c:,}" for n, c in enumerate(stats.ngrams, start=1))
    pruned = f" ({stats.pruned:,} singletons pruned)" if args.prune_singletons else ""
    print(f"{stats.sentences:,} sentences, {stats.words:,} words -> {args.out}: {counts}{pruned}")
    return 0
