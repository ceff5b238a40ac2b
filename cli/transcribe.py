"""`echoic transcribe`: many files, in this process or through a server.

A job: inputs collected (cli/batch_io.py), the model loaded or the server reached,
the job record opened and locked (cli/batch_job.py), what is not done yet
transcribed, a summary. Exit status: 0 every input done, 1 some failed (listed in
the summary), 2 the job could not run (bad arguments, no inputs, no model, the
server unreachable, another job on the output), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from echoic.cli.batch_io import (
    FORMATS,
    InInputOrder,
    Item,
    OutputWriter,
    batches,
    choose_format,
    collect_inputs,
    parse_shard,
    per_file_targets,
    read_file_list,
    shard,
    transcript_record,
)
from echoic.cli.errors import JobError, UserError
from echoic.cli.stream import add_tls_options

# Files longer than this (s) go one at a time through the streaming graph, a block at a
# time, so memory does not grow with their length (issue 22: 20 min took 1.24 GB whole).
LONG_FILE_SECONDS = 120.0

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


def audio_length(seconds: float) -> str:
    """A length of audio in the unit that shows it: 12.3 s, 4.5 min, 2.02 h."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def add_decoder_options(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """Decoder options shared by transcribe and eval (defaults: DecoderConfig's, and
    `default` for --decoder)."""
    from echoic.model.core.decoding import DecoderConfig

    d = DecoderConfig()
    p.add_argument(
        "--decoder", choices=("auto", "greedy", "beam"), default=default,
        help="CTC decoding: greedy, beam (search with a word LM), or auto = beam where the "
             "model ships an LM (or --lm names one), greedy otherwise; with --server, auto is "
             "the server's default, greedy with --no-lm, beam with a --beam-size "
             "(default %(default)s)",
    )  # fmt: skip
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


def resolve_decoder(args: argparse.Namespace) -> None:
    """--decoder auto becomes what it means for --model, as `echoic serve --decoder auto`
    decides it: beam where a word LM is at hand (a third fewer of the bundled model's
    errors: README, "Talk to the server"), greedy where none is (beam alone gains little)."""
    if args.decoder != "auto":
        return
    from echoic.model.runtime.recognizer import LM_FILE, default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    has_lm = bool(args.lm) or (model_dir / LM_FILE).is_file()
    args.decoder = "beam" if has_lm and not args.no_lm else "greedy"


def load_recognizer(args: argparse.Namespace):
    resolve_decoder(args)
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


@dataclass
class Stats:
    """What one run did; the summary."""

    inputs: int = 0
    done_before: int = 0  # skipped: finished by an earlier run
    failed_before: int = 0  # skipped: failed in an earlier run (see --retry-failed)
    transcribed: int = 0
    failed: list[dict[str, str]] = field(default_factory=list)  # {"path", "error"}
    unsupported: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    retries: int = 0  # server calls tried again (busy or unavailable)
    audio_seconds: float = 0.0
    wall_seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)
    interrupted: bool = False

    def line(self) -> str:
        rtf = self.wall_seconds / self.audio_seconds if self.audio_seconds else 0.0
        text = (
            f"transcribed {self.transcribed} of {self.inputs} files"
            f" ({audio_length(self.audio_seconds)} of audio) in {self.wall_seconds:.1f} s,"
            f" real-time factor {rtf:.4f}; {len(self.failed)} failed; {self.done_before}"
            f" already done"
        )
        if self.failed_before:
            text += f"; {self.failed_before} failed before (--retry-failed to try them again)"
        if self.retries:
            text += f"; {self.retries} retries"
        if self.unsupported:
            text += f"; {len(self.unsupported)} unsupported"
        if self.interrupted:
            text += "; interrupted (rerun to go on)"
        lines = [text]
        lines += [f"  failed: {f['error']}" for f in self.failed[:20]]  # it names the file
        if len(self.failed) > 20:
            lines.append(f"  ... and {len(self.failed) - 20} more failed")
        lines += [f"  unsupported (not read): {p}" for p in self.unsupported[:20]]
        if len(self.unsupported) > 20:
            lines.append(f"  ... and {len(self.unsupported) - 20} more unsupported")
        return "\n".join(lines)

    def as_json(self) -> str:
        return json.dumps({
            "inputs": self.inputs, "transcribed": self.transcribed, "failed": len(self.failed),
            "already_done": self.done_before, "failed_before": self.failed_before,
            "unsupported": len(self.unsupported), "retries": self.retries,
            "audio_seconds": round(self.audio_seconds, 3),
            "wall_seconds": round(self.wall_seconds, 3), "interrupted": self.interrupted,
            "outputs": self.outputs, "failed_files": self.failed,
            "unsupported_files": self.unsupported, "warnings": self.warnings,
        })  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from echoic.cli.main import known_errors

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


class LocalBackend:
    """Transcription in this process, batched by length."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.recognizer = load_recognizer(args)
        self.model = f"{self.recognizer.card.name}/{self.recognizer.card.version}"

    def decoder_settings(self) -> dict[str, object]:
        a = self.args
        if a.decoder != "beam":
            return {"decoder": a.decoder}
        return {"decoder": a.decoder, "beam_size": a.beam_size, "lm": self.recognizer.lm_path,
                "lm_weight": a.lm_weight, "word_bonus": a.word_bonus}  # fmt: skip

    def transcribe(self, todo: list[Item], writer: InInputOrder, stats: Stats) -> None:
        from echoic.model.core.audio import AudioError, audio_duration, truncation

        # The LM loads only now, once the job's record has accepted its settings.
        self.recognizer.load_decoder()

        durations, readable = {}, []
        for item in todo:
            try:
                durations[item.key] = audio_duration(item.path)
                readable.append(item)
            except AudioError as e:
                writer.write_error(item, str(e))
                continue
            if warning := truncation(item.path):
                stats.warnings.append(warning)
                writer.say(f"echoic: warning: {warning}")
        # Long files one at a time through the streaming graph (memory bounded by a block,
        # not the file); the rest batched by length through model.onnx.
        streamable = self.recognizer.engine.streamable
        is_long = {i.key: streamable and durations[i.key] > LONG_FILE_SECONDS for i in readable}
        short = [i for i in readable if not is_long[i.key]]
        groups = [
            *((batch, False) for batch in batches(short, durations, self.args.batch_size)),
            *(([i], True) for i in readable if is_long[i.key]),
        ]
        bar = _progress_bar(self.args, sum(durations.values()), "audio s", writer)
        done = 0.0
        try:
            for group, chunked in groups:
                self._transcribe_group(group, chunked, writer, stats)
                done += sum(durations[i.key] for i in group)
                if bar is not None:
                    bar.update(round(done) - bar.n)  # whole seconds: no float noise
        finally:
            if bar is not None:
                bar.close()
                writer.writer.bar = None

    def _transcribe_group(self, group: list[Item], chunked: bool, writer: InInputOrder,
                          stats: Stats) -> None:  # fmt: skip
        from echoic.model.core.audio import AudioError, audio_blocks, load_audio
        from echoic.model.core.decoding import FILE_ENDPOINTING

        rec = self.recognizer
        if chunked:
            (item,) = group
            samples = 0

            def counted(blocks):
                nonlocal samples
                for block in blocks:
                    samples += len(block)
                    yield block

            try:
                transcript = rec.transcribe_blocks(
                    counted(audio_blocks(item.path, rec.sample_rate)), endpointing=FILE_ENDPOINTING
                )
            except AudioError as e:
                writer.write_error(item, str(e))
                return
            results = [(item, samples / rec.sample_rate, transcript)]
        else:
            audios, ok = [], []
            for item in group:
                try:
                    audios.append(load_audio(item.path, rec.sample_rate))
                    ok.append(item)
                except AudioError as e:
                    writer.write_error(item, str(e))
            transcripts = rec.transcribe(audios, endpointing=FILE_ENDPOINTING)
            results = [(i, len(a) / rec.sample_rate, t)
                       for i, a, t in zip(ok, audios, transcripts, strict=True)]  # fmt: skip
        for item, duration, transcript in results:
            writer.write(item, transcript_record(item, transcript, duration, self.model))
            stats.audio_seconds += duration

    def close(self) -> None:
        pass


def _progress_bar(args: argparse.Namespace, total: float, unit: str, writer: InInputOrder):
    if args.no_progress or not total:
        return None
    from tqdm import tqdm

    bar = tqdm(total=round(total), unit=unit, file=sys.stderr, dynamic_ncols=True)
    writer.writer.bar = bar
    return bar


class ServerBackend:
    """Transcription through a server (cli/transcribe_server.py)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from echoic.cli.transcribe_server import ServerTranscriber

        self._server = ServerTranscriber(args)
        self.model = self._server.model

    def decoder_settings(self) -> dict[str, object]:
        return self._server.decoder_settings()

    def transcribe(self, todo: list[Item], writer: InInputOrder, stats: Stats) -> None:
        bar = _progress_bar(self.args_for_bar(), len(todo), "file", writer)
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
