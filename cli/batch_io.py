"""Inputs and outputs of batch transcription, shared by in-process and server modes.

Inputs: audio files, folders (searched recursively) and manifests (JSON lines
with "audio_filepath"). Outputs: plain text (`path<TAB>transcript`), JSON lines
(one object per file, with word times), or SRT subtitles (one .srt per file).
Runs resume: whatever is already in the output is not transcribed again.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from echoic.cli.errors import UserError

AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au"}
FORMATS = ("text", "jsonl", "srt")


@dataclass(frozen=True)
class Item:
    path: str  # audio file, as given or resolved from a manifest
    reference: str | None = None  # transcript from a manifest, when there is one


def collect_inputs(paths: Iterable[str]) -> list[Item]:
    """Files, folders and manifests -> audio items, in a stable order, without repeats."""
    items: list[Item] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.suffix.lower() in AUDIO_SUFFIXES)
            items += [Item(str(f)) for f in files]
        elif p.suffix in (".jsonl", ".json") and p.is_file():
            for n, line in enumerate(p.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    audio = Path(row["audio_filepath"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise UserError(f"{p}:{n}: not a manifest line ({e})") from None
                audio = audio if audio.is_absolute() else p.parent / audio
                items.append(Item(str(audio), row.get("text")))
        else:
            items.append(Item(str(p)))  # a missing file is reported when it is read
    seen: set[str] = set()
    return [i for i in items if not (i.path in seen or seen.add(i.path))]


def _timestamp(seconds: float) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d},{ms:03d}"


def srt(words: list[dict[str, Any]], max_words: int = 7, max_seconds: float = 3.5) -> str:
    """Subtitle cues of up to `max_words` words or `max_seconds` each."""
    cues: list[list[dict[str, Any]]] = []
    for w in words:
        if cues and len(cues[-1]) < max_words and w["end"] - cues[-1][0]["start"] <= max_seconds:
            cues[-1].append(w)
        else:
            cues.append([w])
    blocks = [
        f"{i}\n{_timestamp(c[0]['start'])} --> {_timestamp(c[-1]['end'])}\n"
        + " ".join(w["word"] for w in c)
        + "\n"
        for i, c in enumerate(cues, 1)
    ]
    return "\n".join(blocks)


def transcript_record(path: str, transcript: Any, duration: float, model: str) -> dict[str, Any]:
    """The JSON-lines record of one transcribed file (a decoding.Transcript, or a server's
    Recognition); `model` is the "name/version" that transcribed it."""
    return {
        "audio_filepath": path,
        "duration": round(duration, 3),
        "model": model,
        "text": transcript.text,
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


class OutputWriter:
    """Writes results as they come and knows what earlier runs already wrote."""

    def __init__(self, fmt: str, output: str | None, output_dir: str | None) -> None:
        if fmt not in FORMATS:
            raise UserError(f"unknown output format {fmt!r}: choose one of {', '.join(FORMATS)}")
        if fmt == "srt" and not output_dir:
            raise UserError("--format srt writes one file per input: give --output-dir DIR")
        self.fmt, self.output_dir = fmt, Path(output_dir) if output_dir else None
        self.done: set[str] = set()
        self._out: TextIO = sys.stdout
        if output:
            path = Path(output)
            if path.exists():
                self.done = self._already_done(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._out = open(path, "a")  # noqa: SIM115 - closed in close()
        if self.output_dir:
            self.output_dir.mkdir(parents=True, exist_ok=True)

    def _already_done(self, path: Path) -> set[str]:
        done = set()
        for line in path.read_text().splitlines():
            if self.fmt == "jsonl":
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill; the file is transcribed again
                if "error" not in row:
                    done.add(row["audio_filepath"])
            elif "\t" in line:
                done.add(line.split("\t", 1)[0])
        return done

    def srt_path(self, audio: str) -> Path:
        assert self.output_dir is not None
        return self.output_dir / (Path(audio).stem + ".srt")

    def is_done(self, item: Item) -> bool:
        if self.fmt == "srt":
            return self.srt_path(item.path).exists()
        return item.path in self.done

    def write(self, record: dict[str, Any]) -> None:
        if self.fmt == "jsonl":
            self._out.write(json.dumps(record) + "\n")
        elif self.fmt == "text":
            self._out.write(f"{record['audio_filepath']}\t{record['text']}\n")
        else:
            target = self.srt_path(record["audio_filepath"])
            tmp = target.with_suffix(".srt.tmp")
            tmp.write_text(srt(record["words"]))
            tmp.replace(target)
        self._out.flush()

    def write_error(self, path: str, error: str) -> None:
        print(f"echoic: {error}", file=sys.stderr)
        if self.fmt == "jsonl":
            self._out.write(json.dumps({"audio_filepath": path, "error": error}) + "\n")
            self._out.flush()

    def close(self) -> None:
        if self._out is not sys.stdout:
            self._out.close()


class InInputOrder:
    """An OutputWriter's front that hands it results in input order, while they arrive in
    another (batched by length): each waits until those before it have been written."""

    def __init__(self, writer: OutputWriter, items: list[Item]) -> None:
        self.writer = writer
        self._position = {item.path: n for n, item in enumerate(items)}
        self._ready: dict[int, Callable[[], None]] = {}
        self._next = 0

    def write(self, record: dict[str, Any]) -> None:
        self._put(record["audio_filepath"], lambda: self.writer.write(record))

    def write_error(self, path: str, error: str) -> None:
        self._put(path, lambda: self.writer.write_error(path, error))

    def _put(self, path: str, emit: Callable[[], None]) -> None:
        self._ready[self._position[path]] = emit
        while self._next in self._ready:
            self._ready.pop(self._next)()
            self._next += 1


def batches(items: list[Item], durations: dict[str, float], size: int) -> Iterator[list[Item]]:
    """Items in batches of similar length (sorted by duration), `size` at most each."""
    ordered = sorted(items, key=lambda i: durations.get(i.path, 0.0))
    for start in range(0, len(ordered), size):
        yield ordered[start : start + size]
