"""`echoic import`: a real corpus (LibriSpeech, Common Voice, a Kaldi data directory)
into a training manifest."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

EXAMPLES = """\
examples:
  # LibriSpeech: every SPEAKER/CHAPTER/*.trans.txt below the folder, FLACs read in place
  echoic import librispeech LibriSpeech/train-clean-100 data/ls.jsonl
  echoic import librispeech LibriSpeech/dev-clean data/ls-dev.jsonl --max-duration 20

  # Common Voice: a language folder (validated.tsv and clips/*.mp3); --tsv picks another list
  echoic import commonvoice cv-corpus-17.0/en data/cv-train.jsonl --tsv train.tsv

  # Kaldi: wav.scp + text (+ segments, utt2spk); segments are cut into data/ami.audio/
  echoic import kaldi egs/ami/s5/data/train data/ami.jsonl --allow-commands

  # the first 100 usable utterances, summary as JSON
  echoic import librispeech LibriSpeech/dev-clean /tmp/smoke.jsonl --limit 100 --json

then train on it:
  echoic train --config training/recipes/librispeech.toml data.train_manifest=data/ls.jsonl

Transcripts are normalised to the model's alphabet (docs/training.md, "Real corpora"): lower
case, numbers, years and money spelled out, punctuation dropped, accents folded.
Utterances that cannot be used (text outside the alphabet, missing or broken audio,
malformed lines, too long) are skipped, counted and listed with FILE:LINE. A rerun
finds the audio it wrote (segments, command output) and writes the same manifest.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "import",
        help="turn LibriSpeech, Common Voice or a Kaldi data directory into a manifest",
        description="Read a speech corpus in its own layout and write a NeMo-style\n"
        "manifest (JSON lines: audio_filepath, duration, text, id, speaker) for\n"
        "`echoic train`. Audio files are used in place; Kaldi segments and wav.scp\n"
        "commands are written once as 16 kHz WAVs beside the manifest.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "corpus", choices=("librispeech", "commonvoice", "kaldi"), help="the corpus's layout"
    )
    p.add_argument("src", metavar="SRC", help="the corpus folder (or Kaldi data directory)")
    p.add_argument("manifest", metavar="OUT_MANIFEST", help="the manifest to write (JSON lines)")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="keep the first N usable")
    p.add_argument(
        "--max-duration",
        type=float,
        default=0.0,
        metavar="S",
        help="skip (and count) utterances longer than S seconds (default: keep all)",
    )
    p.add_argument(
        "--tsv",
        default="validated.tsv",
        metavar="NAME",
        help="Common Voice: the clip list in SRC (default validated.tsv; train.tsv, dev.tsv...)",
    )
    p.add_argument(
        "--allow-commands",
        action="store_true",
        help="Kaldi: run wav.scp's piped commands ('sox ... |') through /bin/sh",
    )
    p.add_argument(
        "--audio-dir",
        default="",
        metavar="DIR",
        help="where written audio goes (default: OUT_MANIFEST without .jsonl, plus .audio)",
    )
    p.add_argument(
        "--sample-rate",
        type=int,
        default=16000,
        metavar="HZ",
        help="rate of the audio an import writes (default 16000, the models' rate)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=run)


SHOWN_PROBLEMS = 10  # skipped utterances listed on stderr


def run(args: argparse.Namespace) -> int:
    from echoic.training.importers import ImportConfig, import_corpus

    config = ImportConfig(
        limit=args.limit,
        max_duration=args.max_duration,
        sample_rate=args.sample_rate,
        tsv=args.tsv,
        allow_commands=args.allow_commands,
        audio_dir=args.audio_dir,
    )
    progress = not (args.json or args.no_progress) and sys.stderr.isatty()
    summary = import_corpus(args.corpus, args.src, args.manifest, config, progress=progress)
    if args.json:
        # asdict would rebuild the Counter from (key, value) pairs, counting the pairs
        record = {f.name: getattr(summary, f.name) for f in dataclasses.fields(summary)}
        record |= {"seconds": round(summary.seconds, 3), "skipped": dict(summary.skipped)}
        print(json.dumps(record))
        return 0
    for message in summary.problems[:SHOWN_PROBLEMS]:
        print(f"skipped {message}", file=sys.stderr)
    more = sum(summary.skipped.values()) - min(len(summary.problems), SHOWN_PROBLEMS)
    if more > 0:
        print(f"... and {more} more skipped (--json lists the first 100)", file=sys.stderr)
    print(summary.line())
    return 0
