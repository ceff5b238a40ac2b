"""`echoic transcribe` in this process: the recognizer from the decoder options (shared
with `echoic eval`), the local backend (batches by length; long files streamed a block
at a time), which `--ray` extends (cli/transcribe_ray.py), and what every backend shares:
the run's summary (`Stats`) and its progress bar. cli/transcribe.py drives a job over
one of the backends.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from echoic.cli.batch_io import InInputOrder, Item, batches, transcript_record

# Files longer than this (s) go one at a time through the streaming graph, a block at a
# time, so memory does not grow with their length (issue 22: 20 min took 1.24 GB whole).
LONG_FILE_SECONDS = 120.0


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
    p.add_argument("--lm", metavar="FILE", default=d.lm_path, help="word n-gram LM, ARPA or"
                   " KenLM binary (beam; default: the model directory's lm.bin, else"
                   " lm.arpa)")  # fmt: skip
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
    from echoic.model.core.lm import model_lm
    from echoic.model.runtime.recognizer import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    has_lm = bool(args.lm) or model_lm(model_dir) is not None
    args.decoder = "beam" if has_lm and not args.no_lm else "greedy"


def load_recognizer(args: argparse.Namespace):
    resolve_decoder(args)
    try:
        from echoic.model.runtime.recognizer import Recognizer
    except ModuleNotFoundError as e:
        from echoic.cli.errors import missing_extra

        raise missing_extra("serve", e.name or "onnxruntime") from e
    return Recognizer(args.model, decoder_config(args), intra_op_threads=args.threads)


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
        bar = progress_bar(self.args, sum(durations.values()), "audio s", writer)
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


def progress_bar(args: argparse.Namespace, total: float, unit: str, writer: InInputOrder):
    if args.no_progress or not total:
        return None
    from tqdm import tqdm

    bar = tqdm(total=round(total), unit=unit, file=sys.stderr, dynamic_ncols=True)
    writer.writer.bar = bar
    return bar
