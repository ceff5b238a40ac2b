"""Inputs and outputs of batch transcription, shared by in-process and server modes.

Inputs: audio files, folders (searched recursively), quoted globs, manifests (JSON
lines with "audio_filepath") and file lists (`--files-from FILE`, `-` for stdin).
Every input is keyed by its resolved path, so the same file given two ways is one.

Outputs, in two kinds:

- one file for the job (`--output FILE`, or stdout): `jsonl` (one object per input,
  with word times) or `tsv` (`path<TAB>transcript`);
- one file per input (`--output-dir DIR`): `json`, `txt`, `srt` or `vtt`, at the
  input's path relative to the inputs' common root, so `a/utt_001.wav` and
  `b/utt_001.wav` become `DIR/a/utt_001.srt` and `DIR/b/utt_001.srt`.

The format comes from `--format` or, without it, from the output's extension; a
format that contradicts the extension is an error. A manifest's line keeps every
field and gains `pred_text` (NeMo's convention). What a job has finished is in its
job record (cli/batch_job.py), not guessed from the output.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from echoic.cli.errors import UserError

AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au"}
# Audio a folder may hold that cannot be decoded here: listed in the summary, not read.
UNSUPPORTED_SUFFIXES = {".m4a", ".mp4", ".aac", ".wma", ".amr", ".webm", ".mka", ".3gp", ".ac3"}
COMBINED = ("jsonl", "tsv")  # one file for the job
PER_FILE = ("json", "txt", "srt", "vtt")  # one file per input
FORMATS = COMBINED + PER_FILE
EXTENSIONS = {f".{fmt}": fmt for fmt in FORMATS}


@dataclass(frozen=True)
class Item:
    path: str  # audio file, as given or as a manifest names it (relative to the manifest)
    key: str  # the resolved path: what the job record and the output layout go by
    row: dict[str, Any] | None = field(default=None, compare=False, hash=False)  # manifest line

    @property
    def reference(self) -> str | None:
        """The manifest's transcript, when there is one."""
        return None if self.row is None else self.row.get("text")


@dataclass
class Inputs:
    items: list[Item]  # in the order given, without repeats
    unsupported: list[str]  # audio files found in folders that cannot be decoded here


def _item(path: Path | str, row: dict[str, Any] | None = None) -> Item:
    return Item(str(path), os.path.realpath(path), row)


def manifest_items(p: Path) -> list[Item]:
    """A manifest's lines as items (audio paths resolved against its folder); UserError
    naming the line that is not a manifest line."""
    items = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            audio = Path(row["audio_filepath"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{p}:{n}: not a manifest line ({e})") from None
        items.append(_item(audio if audio.is_absolute() else p.parent / audio, row))
    return items


def read_file_list(source: str) -> list[str]:
    """Paths one a line from a file, or from stdin for `-`; blank lines are skipped."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as e:
        raise UserError(f"cannot read the file list {source} ({e.strerror or e})") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def collect_inputs(paths: Iterable[str]) -> Inputs:
    """Files, folders, globs and manifests -> audio items, in a stable order, without repeats."""
    items: list[Item] = []
    unsupported: list[str] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists() and glob.has_magic(raw):  # a glob the shell did not expand
            matches = sorted(glob.glob(raw, recursive=True))
            if not matches:
                raise UserError(f"{raw}: no file matches this pattern")
            more = collect_inputs(matches)
            items += more.items
            unsupported += more.unsupported
        elif p.is_dir():
            for f in sorted(f for f in p.rglob("*") if f.is_file()):
                if f.suffix.lower() in AUDIO_SUFFIXES:
                    items.append(_item(f))
                elif f.suffix.lower() in UNSUPPORTED_SUFFIXES:
                    unsupported.append(str(f))
        elif p.suffix in (".jsonl", ".json") and p.is_file():
            items += manifest_items(p)
        else:
            items.append(_item(p))  # a missing or unreadable file is reported when read
    seen: set[str] = set()
    return Inputs([i for i in items if not (i.key in seen or seen.add(i.key))], unsupported)


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' (1 <= I <= N) -> (I, N)."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard {text}: write it as I/N, e.g. 2/4") from None
    if not 1 <= index <= count:
        raise UserError(f"--shard {text}: I must be between 1 and N")
    return index, count


def shard(items: list[Item], index: int, count: int) -> list[Item]:
    """Shard `index` of `count` (1-based): every count-th input from the index-th, so the
    shards of one input list are disjoint and together are all of it."""
    return items[index - 1 :: count]


def choose_format(fmt: str | None, output: str | None, output_dir: str | None) -> str:
    """--format, or the one --output's extension names; errors for contradictions."""
    if output and output_dir:
        raise UserError("give --output FILE (one file for the job) or --output-dir DIR, not both")
    implied = EXTENSIONS.get(Path(output).suffix.lower()) if output else None
    if fmt and implied and fmt != implied:
        raise UserError(
            f"--format {fmt} contradicts --output {output} (a .{implied} name):"
            f" drop --format, or name the file .{fmt}"
        )
    fmt = fmt or implied or (None if output_dir else "tsv" if not output else None)
    if fmt is None:
        raise UserError(
            f"cannot tell the format from {output_dir or output}: give --format"
            f" ({', '.join(PER_FILE if output_dir else COMBINED)})"
        )
    if fmt in PER_FILE and not output_dir:
        raise UserError(f"--format {fmt} writes one file per input: give --output-dir DIR")
    if fmt in COMBINED and output_dir:
        raise UserError(f"--format {fmt} writes one file for the job: give --output FILE")
    return fmt


def _timestamp(seconds: float, separator: str = ",") -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"


def _cues(
    words: list[dict[str, Any]], max_words: int = 7, max_seconds: float = 3.5
) -> list[list[dict[str, Any]]]:
    """Words grouped into subtitle cues of up to `max_words` words or `max_seconds` each;
    a formatted transcript's sentence end ends a cue too (`--formatting`)."""
    from echoic.model.runtime.formatting import ends_sentence

    cues: list[list[dict[str, Any]]] = []
    for w in words:
        if (
            cues and len(cues[-1]) < max_words and w["end"] - cues[-1][0]["start"] <= max_seconds
            and not ends_sentence(cues[-1][-1]["word"])
        ):  # fmt: skip
            cues[-1].append(w)
        else:
            cues.append([w])
    return cues


def srt(words: list[dict[str, Any]]) -> str:
    """SubRip subtitles: numbered cues, `00:00:01,250 --> ...` times."""
    blocks = [
        f"{i}\n{_timestamp(c[0]['start'])} --> {_timestamp(c[-1]['end'])}\n"
        + " ".join(w["word"] for w in c)
        + "\n"
        for i, c in enumerate(_cues(words), 1)
    ]
    return "\n".join(blocks)


def vtt(words: list[dict[str, Any]]) -> str:
    """WebVTT subtitles: a WEBVTT header, then cues with `00:00:01.250 --> ...` times."""
    blocks = [
        f"{_timestamp(c[0]['start'], '.')} --> {_timestamp(c[-1]['end'], '.')}\n"
        + " ".join(w["word"] for w in c)
        + "\n"
        for c in _cues(words)
    ]
    return "\n".join(["WEBVTT\n", *blocks])


def transcript_record(item: Item, transcript: Any, duration: float, model: str) -> dict[str, Any]:
    """The JSON record of one transcribed input (a decoding.Transcript, or a server's
    Recognition); `model` is the "name/version" that transcribed it. A manifest's line
    keeps every field and gains `pred_text`; a file's record has `text`."""
    details = {
        "model": model,
        "confidence": round(transcript.confidence, 4),
        "words": [
            {
                "word": w.text,
                "start": round(w.start, 3),
                "end": round(w.end, 3),
                "confidence": round(w.confidence, 4),
            }
            for w in transcript.words
        ],
    }
    if item.row is not None:
        return {**item.row, "pred_text": transcript.text, **details}
    return {"audio_filepath": item.path, "duration": round(duration, 3),
            "text": transcript.text, **details}  # fmt: skip


def format_record(record: dict[str, Any], formatter: Any) -> dict[str, Any]:
    """A record with its transcript and words written as people write them (`--formatting`,
    model/runtime/formatting.py): each written word timed by the spoken words it came from,
    its confidence the lowest of theirs."""
    from echoic.model.runtime.formatting import written_words

    spoken = record["words"]
    words = [w["word"] for w in spoken] or record_text(record).split()
    tokens = formatter.format(words)
    text = " ".join(t.text for t in tokens)
    out = {**record, ("pred_text" if "pred_text" in record else "text"): text}
    if spoken:
        written = written_words(
            tokens, [w["start"] for w in spoken], [w["end"] for w in spoken],
            [w["confidence"] for w in spoken],
        )  # fmt: skip
        out["words"] = [{"word": w.text, "start": w.start, "end": w.end,
                         "confidence": w.confidence} for w in written]  # fmt: skip
    return out


def record_text(record: dict[str, Any]) -> str:
    return record["pred_text"] if "pred_text" in record else record["text"]


def common_root(items: list[Item]) -> Path:
    """The deepest folder that holds every input (resolved)."""
    if not items:
        return Path.cwd()
    return Path(os.path.commonpath([os.path.dirname(i.key) for i in items]))


def per_file_targets(items: list[Item], output_dir: Path, fmt: str) -> dict[str, Path]:
    """Each input's own output file: its path under the common root, mirrored into
    `output_dir` with the format's suffix (`a/utt.wav` -> `DIR/a/utt.srt`). Two inputs
    that differ only in suffix (`x.wav`, `x.flac`) keep theirs (`x.wav.srt`)."""
    root = common_root(items)
    stems = {i.key: Path(i.key).relative_to(root) for i in items}
    counts: dict[Path, int] = {}
    for rel in stems.values():
        counts[rel.with_suffix("")] = counts.get(rel.with_suffix(""), 0) + 1
    targets = {}
    for key, rel in stems.items():
        plain = rel.with_suffix("")
        name = plain if counts[plain] == 1 else rel
        targets[key] = output_dir / name.parent / f"{name.name}.{fmt}"
    return targets


class OutputWriter:
    """Writes each result as it comes: a line of the job's file, or the input's own file.
    `on_written(item, error, transient)` hears of each input once its result is written (the job
    record); `say` prints a message without breaking a progress bar."""

    def __init__(
        self,
        fmt: str,
        output: TextIO | None,
        targets: dict[str, Path] | None = None,
        on_written: Callable[[Item, str | None, bool], None] | None = None,
        formatter: Any = None,
    ) -> None:
        """formatter: a model/runtime/formatting.py Formatter for readable transcripts."""
        self.fmt, self.targets = fmt, targets or {}
        self.formatter = formatter
        self._out = output if output is not None else sys.stdout
        self._on_written = on_written or (lambda item, error, transient: None)
        self.bar: Any = None  # a tqdm bar, while one is shown

    def say(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def write(self, item: Item, record: dict[str, Any]) -> None:
        if self.formatter is not None:
            record = format_record(record, self.formatter)
        if self.fmt == "jsonl":
            self._out.write(json.dumps(record) + "\n")
            self._out.flush()
        elif self.fmt == "tsv":
            self._out.write(f"{item.path}\t{record_text(record)}\n")
            self._out.flush()
        else:
            target = self.targets[item.key]
            text = {"json": lambda: json.dumps(record, indent=1) + "\n",
                    "txt": lambda: record_text(record) + "\n",
                    "srt": lambda: srt(record["words"]),
                    "vtt": lambda: vtt(record["words"])}[self.fmt]()  # fmt: skip
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(target)
        self._on_written(item, None, False)

    def write_error(self, item: Item, error: str, *, transient: bool = False) -> None:
        """`transient`: the server was too busy; not the file's fault, so not recorded."""
        self.say(f"echoic: {error}")
        if self.fmt == "jsonl":
            self._out.write(json.dumps({"audio_filepath": item.path, "error": error}) + "\n")
            self._out.flush()
        self._on_written(item, error, transient)


class InInputOrder:
    """An OutputWriter's front that hands it results in input order, while they arrive in
    another (batched by length): each waits until those before it have been written."""

    def __init__(self, writer: OutputWriter, items: list[Item]) -> None:
        self.writer = writer
        self._position = {item.key: n for n, item in enumerate(items)}
        self._ready: dict[int, Callable[[], None]] = {}
        self._next = 0

    def say(self, message: str) -> None:
        self.writer.say(message)

    def write(self, item: Item, record: dict[str, Any]) -> None:
        self._put(item, lambda: self.writer.write(item, record))

    def write_error(self, item: Item, error: str, *, transient: bool = False) -> None:
        self._put(item, lambda: self.writer.write_error(item, error, transient=transient))

    def _put(self, item: Item, emit: Callable[[], None]) -> None:
        self._ready[self._position[item.key]] = emit
        while self._next in self._ready:
            self._ready.pop(self._next)()
            self._next += 1


def batches(items: list[Item], durations: dict[str, float], size: int) -> Iterator[list[Item]]:
    """Items in batches of similar length (sorted by duration), `size` at most each."""
    ordered = sorted(items, key=lambda i: durations.get(i.key, 0.0))
    for start in range(0, len(ordered), size):
        yield ordered[start : start + size]
