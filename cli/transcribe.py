"""`echoic transcribe`: many files, in this process or through a server."""

from __future__ import annotations

import argparse
import sys
import time

from echoic.cli.batch_io import (
    FORMATS,
    InInputOrder,
    OutputWriter,
    batches,
    collect_inputs,
    transcript_record,
)
from echoic.cli.stream import add_tls_options

EXAMPLES = """\
examples:
  echoic transcribe talk.wav                                  # bundled default model
  echoic transcribe recordings/ --format jsonl --output out.jsonl   # resumable
  echoic transcribe data/test.jsonl --decoder beam --format jsonl --output test.jsonl
  echoic transcribe interview.flac --format srt --output-dir subs/
  echoic transcribe recordings/ --server localhost:50051 --concurrency 8 --output out.jsonl

A file that cannot be read is reported and skipped; the others go on. Rerunning
with the same --output transcribes only what is not in it yet. Exit status 1
when any file failed.
"""


def add_decoder_options(p: argparse.ArgumentParser) -> None:
    """Decoder options shared by transcribe and eval (defaults: DecoderConfig's)."""
    from echoic.model.core.decoding import DecoderConfig

    d = DecoderConfig()
    p.add_argument("--decoder", choices=("greedy", "beam"), default=d.kind, help="CTC decoding")
    p.add_argument("--beam-size", type=int, default=d.beam_size,
                   help=f"beam width (beam; default {d.beam_size})")  # fmt: skip
    p.add_argument("--lm", metavar="ARPA", default=d.lm_path, help="word n-gram LM (beam;"
                   " default: the model directory's lm.arpa)")  # fmt: skip
    p.add_argument("--no-lm", action="store_true", help="beam search without an LM")
    p.add_argument("--lm-weight", type=float, default=d.lm_weight,
                   help=f"LM weight (beam; default {d.lm_weight:g})")  # fmt: skip
    p.add_argument("--word-bonus", type=float, default=d.word_bonus,
                   help=f"score per word, nats (beam; default {d.word_bonus:g})")  # fmt: skip


def decoder_config(args: argparse.Namespace):
    from echoic.model.core.decoding import DecoderConfig

    return DecoderConfig(
        kind=args.decoder, beam_size=args.beam_size, lm_path=args.lm, use_lm=not args.no_lm,
        lm_weight=args.lm_weight, word_bonus=args.word_bonus,
    )  # fmt: skip


def load_recognizer(args: argparse.Namespace):
    try:
        from echoic.model.runtime.recognizer import Recognizer
    except ModuleNotFoundError as e:
        from echoic.cli.errors import missing_extra

        raise missing_extra("serve", e.name or "onnxruntime") from e
    return Recognizer(args.model, decoder_config(args), intra_op_threads=args.threads)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "transcribe",
        help="transcribe files, folders or manifests",
        description="Transcribe audio files (WAV, FLAC, ... any rate, any channels).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="audio files, folders, manifests")
    p.add_argument("--model", metavar="DIR", help="exported model directory (default: bundled)")
    add_decoder_options(p)
    p.add_argument("--format", choices=FORMATS, default="text", help="output format")
    p.add_argument("--output", metavar="FILE", help="append results here (resumable)")
    p.add_argument("--output-dir", metavar="DIR", help="where --format srt writes FILE.srt")
    p.add_argument("--batch-size", type=int, default=16, help="files per model call")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0 = all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--server", metavar="HOST:PORT", help="transcribe through an echoic server")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (--server)")
    add_tls_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    items = collect_inputs(args.paths)
    writer = OutputWriter(args.format, args.output, args.output_dir)
    todo = [i for i in items if not writer.is_done(i)]
    skipped = len(items) - len(todo)
    try:
        if args.server:
            from echoic.cli.transcribe_server import transcribe_with_server

            failed, seconds, elapsed = transcribe_with_server(args, todo, writer)
        else:
            failed, seconds, elapsed = _transcribe_here(args, todo, writer)
    finally:
        writer.close()
    rtf = elapsed / seconds if seconds else 0.0
    print(
        f"transcribed {len(todo) - failed} of {len(items)} files ({seconds / 3600:.2f} h of audio)"
        f" in {elapsed:.1f} s, real-time factor {rtf:.4f}; {failed} failed;"
        f" {skipped} already done",
        file=sys.stderr,
    )
    return 1 if failed else 0


def _transcribe_here(args, todo, writer) -> tuple[int, float, float]:
    from echoic.model.core.audio import AudioError, audio_duration, load_audio

    recognizer = load_recognizer(args)
    writer = InInputOrder(writer, todo)  # batched by length, written in input order
    durations, readable = {}, []
    for item in todo:
        try:
            durations[item.path] = audio_duration(item.path)
            readable.append(item)
        except AudioError as e:
            writer.write_error(item.path, str(e))
    failed = len(todo) - len(readable)
    bar = None
    if not args.no_progress and todo:
        from tqdm import tqdm

        total = sum(durations.values())
        bar = tqdm(total=round(total, 1), unit="audio s", file=sys.stderr, dynamic_ncols=True)
    seconds, started = 0.0, time.perf_counter()
    model = f"{recognizer.card.name}/{recognizer.card.version}"
    for batch in batches(readable, durations, max(1, args.batch_size)):
        audios, ok = [], []
        for item in batch:
            try:
                audios.append(load_audio(item.path, recognizer.sample_rate))
                ok.append(item)
            except AudioError as e:
                writer.write_error(item.path, str(e))
                failed += 1
        for item, audio, transcript in zip(ok, audios, recognizer.transcribe(audios), strict=True):
            duration = len(audio) / recognizer.sample_rate
            writer.write(transcript_record(item.path, transcript, duration, model))
            seconds += duration
        if bar is not None:
            bar.update(round(sum(durations[i.path] for i in batch), 1))
    if bar is not None:
        bar.close()
    return failed, seconds, time.perf_counter() - started
