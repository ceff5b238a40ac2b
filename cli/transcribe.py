"""`echoic transcribe`: many files, in this process or through a server.

A job: inputs collected (cli/batch_io.py), the model loaded or the server reached,
the job record opened and locked (cli/batch_job.py), what is not done yet
transcribed, a summary. Exit status: 0 every input done, 1 some failed (listed in
the summary), 2 the job could not run (bad arguments, no inputs, no model, the
server unreachable, another job on the output), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from echoic.cli.batch_io import (
    FORMATS,
    InInputOrder,
    Item,
    OutputWriter,
    choose_format,
    collect_inputs,
    parse_shard,
    per_file_targets,
    read_file_list,
    shard,
)
from echoic.cli.errors import JobError, UserError, known_errors
from echoic.cli.stream import add_tls_options
from echoic.cli.transcribe_local import (
    LocalBackend,
    Stats,
    add_decoder_options,
    progress_bar,
)

EXAMPLES = """\
examples:
  echoic transcribe talk.wav                                  # bundled default model
  echoic transcribe recordings/ --output out.jsonl            # resumable; format from the name
  echoic transcribe data/test.jsonl --decoder beam --output test.jsonl   # adds pred_text
  echoic transcribe recordings/ --format srt --output-dir subs/   # subs/<same tree>/NAME.srt
  echoic transcribe 'calls/**/*.flac' --shard 2/4 --output part2.tsv
  find calls -name '*.wav' | echoic transcribe --files-from - --output out.jsonl
  echoic transcribe recordings/ --server localhost:50051 --concurrency 16 --output out.jsonl

Formats: jsonl and tsv write one file (--output FILE, or stdout); json, txt, srt and
vtt one file per input (--output-dir DIR, mirroring the inputs' folders). A file
that cannot be read is reported and the others go on. A rerun with the same output
transcribes only what is not done (its job record, OUT.job, says what is); files
that failed are tried again only with --retry-failed, their new rows taking the
place of the old (one row per input, in input order); other settings are refused
unless --overwrite. Exit status: 0 all done, 1 some inputs failed, 2 the job could
not run, 130 interrupted.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "transcribe",
        help="transcribe files, folders or manifests",
        description="Transcribe audio files (WAV, FLAC, OGG, MP3, ... any rate, any channels).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="audio files, folders, globs, manifests")  # fmt: skip
    p.add_argument("--files-from", metavar="FILE", help="paths one a line from FILE (- = stdin)")
    p.add_argument("--model", metavar="DIR", help="exported model directory (default: bundled)")
    add_decoder_options(p)
    p.add_argument("--format", choices=FORMATS, help="output format (default: from --output's"
                   " extension; tsv on stdout)")  # fmt: skip
    p.add_argument("--formatting", action=argparse.BooleanOptionalAction, default=False,
                   help="readable transcripts: punctuation, capitals, written-form numbers"
                        " ($25, 3:30 p.m.); srt/vtt cues end at sentence ends"
                        " (docs/formatting.md; default: lower-case words as spoken)")  # fmt: skip
    p.add_argument("--output", metavar="FILE", help="one file for the job (resumable)")
    p.add_argument("--output-dir", metavar="DIR", help="one file per input, in the inputs' tree")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start the output afresh (other settings, or to redo everything)",
    )
    p.add_argument("--retry-failed", action="store_true",
                   help="try again the inputs that failed in earlier runs")  # fmt: skip
    p.add_argument("--shard", metavar="I/N", help="only every N-th input from the I-th (1-based)")
    p.add_argument("--batch-size", type=int, default=16, help="files per model call")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0 = all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="the summary as one JSON object on stdout")
    p.add_argument("--server", metavar="HOST:PORT", help="transcribe through an echoic server")
    p.add_argument("--ray", action="store_true",
                   help="spread the job over Ray workers (the ray extra): a local Ray, or"
                        " --ray-address's cluster")  # fmt: skip
    p.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster (with --ray)")
    p.add_argument("--ray-workers", type=int, default=0, metavar="N",
                   help="recognizer actors, one CPU each (default: the CPUs Ray has)")  # fmt: skip
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests in flight at most (--server; fewer while the server is full)",
    )
    add_tls_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    stats = Stats()
    try:
        job = _plan(args, stats)
    except known_errors() as e:
        raise JobError(str(e)) from e
    stopped = None
    try:
        job.start()
    except KeyboardInterrupt:
        stats.interrupted = True
    except known_errors() as e:  # server-wide trouble mid-job: what is written stays
        stopped = e
    finally:
        job.close()
        stats.wall_seconds = time.perf_counter() - job.started
    print(stats.line(), file=sys.stderr)
    if stopped is not None:
        raise JobError(str(stopped)) from stopped
    if args.json:
        print(stats.as_json(), flush=True)
    if stats.interrupted:
        return 130
    return 1 if stats.failed or stats.failed_before or stats.unsupported else 0


class Job:
    """One run over the inputs: the backend (here or a server), the output, the record."""

    def __init__(self, args: argparse.Namespace, items: list[Item], fmt: str, backend,
                 stats: Stats) -> None:  # fmt: skip
        from echoic.cli.batch_job import JobRecord, set_aside_unrecorded

        self.args, self.items, self.fmt, self.backend, self.stats = (
            args, items, fmt, backend, stats,
        )  # fmt: skip
        self.started = time.perf_counter()
        self.record: JobRecord | None = None
        self._out = None
        targets = None
        settings = {"format": fmt, "model": backend.model, **backend.decoder_settings()}
        formatter = None
        if args.formatting:  # only then a setting, so older job records still match
            from echoic.model.runtime.formatting import Formatter, punctuator

            punctuator()  # FormattingUnavailable (one line) before any work
            formatter = Formatter()
            settings["formatting"] = True
        if args.output:
            out = Path(args.output)
            record = out.with_name(out.name + ".job")
            written = out.exists() and out.stat().st_size > 0
            if written and not record.exists() and not args.overwrite:
                raise UserError(
                    f"{out} exists and no job record says what wrote it: pass --overwrite to"
                    " replace it, or write to a new --output"
                )
            self.record = JobRecord(record, out, settings, overwrite=args.overwrite or not written)
            if args.overwrite and out.exists():
                out.write_text("")
            elif moved := set_aside_unrecorded(out, self.record.end):
                stats.warnings.append(f"{out}: {len(moved)} bytes set aside in {out}.torn")
                print(
                    f"echoic: {out} ended in {moved.count(chr(10)) or 'a cut'} line(s) no job"
                    f" record speaks for ({moved[:60]!r}...): moved to {out.name}.torn;"
                    " their inputs are transcribed again",
                    file=sys.stderr,
                )
            self._out = open(out, "a")  # noqa: SIM115 - closed in close()
            stats.outputs.append(str(out))
        elif args.output_dir:
            out_dir = Path(args.output_dir)
            self.record = JobRecord(out_dir / ".echoic-job", out_dir, settings,
                                    overwrite=args.overwrite)  # fmt: skip
            targets = per_file_targets(items, out_dir, fmt)
            stats.outputs.append(str(out_dir))
        self.targets = targets or {}
        self.writer = OutputWriter(fmt, self._out, targets, self._written, formatter)

    def _is_done(self, item: Item) -> bool:
        if self.record is None or not self.record.is_done(item):
            return False
        return item.key not in self.targets or self.targets[item.key].exists()

    def start(self) -> None:
        todo = []
        for item in self.items:
            if self._is_done(item):
                self.stats.done_before += 1
            elif self.record and self.record.failed_before(item) and not self.args.retry_failed:
                self.stats.failed_before += 1
            else:
                todo.append(item)
        self.backend.transcribe(todo, InInputOrder(self.writer, todo), self.stats)

    def _written(self, item: Item, error: str | None, transient: bool = False) -> None:
        if error is None:
            self.stats.transcribed += 1
        else:
            self.stats.failed.append({"path": item.path, "error": error})
        if self.record is not None:
            end = self._out.tell() if self._out is not None else None
            self.record.note(item, error, end, transient=transient)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            try:
                self.record.compact()  # rows a retry superseded: one row per input
            except OSError as e:
                print(f"echoic: could not rewrite {self.record.output} to one row per input"
                      f" ({e.strerror or e}); every row is there, and a rerun tidies it",
                      file=sys.stderr)  # fmt: skip
        if self.record is not None:
            self.record.close()
        self.backend.close()


def _plan(args: argparse.Namespace, stats: Stats) -> Job:
    """Everything that can stop a job before it starts: arguments, inputs, the model or
    the server, the output and its record."""
    fmt = choose_format(args.format, args.output, args.output_dir)
    if args.json and not (args.output or args.output_dir):
        raise UserError("--json prints the summary on stdout: give --output or --output-dir")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    paths = list(args.paths)
    if args.files_from:
        paths += read_file_list(args.files_from)
    if not paths:
        raise UserError("no inputs: give files, folders or manifests, or --files-from FILE")
    inputs = collect_inputs(paths)
    items = inputs.items
    if args.shard:
        items = shard(items, *parse_shard(args.shard))
    stats.inputs, stats.unsupported = len(items), inputs.unsupported
    if not items:
        found = f" (only unsupported files: {', '.join(inputs.unsupported[:3])})" if (
            inputs.unsupported) else ""  # fmt: skip
        raise UserError(f"no audio files in {' '.join(paths)}{found}")
    if args.ray and args.server:
        raise UserError("--ray and --server exclude each other: Ray workers run the model")
    if args.ray_address and not args.ray:
        raise UserError("--ray-address needs --ray")
    if args.ray:
        from echoic.cli.transcribe_ray import RayBackend

        backend = RayBackend(args)
    else:
        backend = ServerBackend(args) if args.server else LocalBackend(args)
    try:
        return Job(args, items, fmt, backend, stats)
    except BaseException:
        backend.close()
        raise


class ServerBackend:
    """Transcription through a server (cli/transcribe_server.py)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from echoic.cli.transcribe_server import ServerTranscriber

        self._server = ServerTranscriber(args)
        self.model = self._server.model

    def decoder_settings(self) -> dict[str, object]:
        return self._server.decoder_settings()

    def transcribe(self, todo: list[Item], writer: InInputOrder, stats: Stats) -> None:
        bar = progress_bar(self.args_for_bar(), len(todo), "file", writer)
        try:
            self._server.transcribe(todo, writer, stats, bar)
        finally:
            if bar is not None:
                bar.close()
                writer.writer.bar = None

    def args_for_bar(self) -> argparse.Namespace:
        return self._server.args

    def close(self) -> None:
        self._server.close()
