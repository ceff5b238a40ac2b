"""Real corpora into echoic manifests: LibriSpeech, Mozilla Common Voice, Kaldi data dirs.

`import_corpus(corpus, src, manifest)` reads a corpus in its own layout and writes
a NeMo-style manifest (`{"audio_filepath", "duration", "text", "id", "speaker"}`
per line, absolute paths, in the corpus's order) that `training/data.py` reads:

- "librispeech": every `SPEAKER/CHAPTER/SPEAKER-CHAPTER.trans.txt` under `src` (a
  subset such as `train-clean-100/`, or the `LibriSpeech/` folder holding several),
  one `UTTERANCE-ID TRANSCRIPT` a line, the audio beside it as `UTTERANCE-ID.flac`.
- "commonvoice": a language folder, `validated.tsv` (or `train.tsv`, `dev.tsv`,
  `test.tsv`: `ImportConfig.tsv`) with `path` and `sentence` columns, the MP3s in
  `clips/`. The MP3s are read in place (libsndfile decodes MP3).
- "kaldi": a data directory: `text` (`UTT TRANSCRIPT`), `wav.scp` (`RECORDING PATH`,
  or `RECORDING COMMAND |`, a shell pipeline that writes audio to stdout), optional
  `segments` (`UTT RECORDING START END`, seconds; END -1 = to the end) and
  `utt2spk`. Without `segments` each utterance is a whole recording of the same id.
  As in Kaldi, relative paths and commands are taken from the directory echoic runs
  in; commands run through /bin/sh only with `allow_commands`, since they are code.

Audio referenced as it is (whole files) is checked from its header. What has no
file of its own (a Kaldi segment, a command's output) is written once, as 16-bit
WAV at `sample_rate`, into `audio_dir`, named by the utterance id and a hash of
its source (recording or command, start, end), so that a changed segment gets a
new file rather than an earlier run's. Files are written to a temporary name and
renamed, so an interrupted import is finished by running it again, which finds
them and writes nothing. The manifest is replaced in one rename, so a rerun of a
finished import changes nothing.

Transcripts go through `training/transcripts.py:check_transcript`. An utterance
that cannot be used (malformed line, transcript empty or outside the vocabulary,
audio missing, undecodable or empty, a segment outside its recording, a command
that fails, longer than `max_duration`) is skipped, counted by reason, and
reported as `FILE:LINE: UTTERANCE: what is wrong`; nothing is silently kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf
from tqdm import tqdm

from echoic.model.core.audio import AudioError, audio_duration, decode_audio, write_wav
from echoic.model.core.text import Vocabulary
from echoic.training.transcripts import check_transcript

CORPORA = ("librispeech", "commonvoice", "kaldi")
KEPT_MESSAGES = 100  # problem messages a summary keeps (the counts are complete)
SEGMENT_SLACK = 0.1  # s, how far a segment may end past its recording (cut at the end)
COMMAND_TIMEOUT = 600  # s, longest a wav.scp command may run


class CorpusError(ValueError):
    """A corpus that cannot be imported at all; the message names the file and the fix."""


@dataclass(frozen=True)
class ImportConfig:
    limit: int = 0  # utterances to keep, count; 0 = all
    max_duration: float = 0.0  # s, longer utterances are skipped (counted); 0 = no limit
    sample_rate: int = 16000  # Hz, of the audio an import writes (segments, commands)
    tsv: str = "validated.tsv"  # Common Voice: the list of clips to import
    allow_commands: bool = False  # Kaldi: run wav.scp's "... |" commands through /bin/sh
    audio_dir: str = ""  # folder for written audio; "" = beside the manifest, NAME.audio

    def __post_init__(self) -> None:
        if self.limit < 0 or self.max_duration < 0:
            raise CorpusError("limit and max_duration must not be negative")


@dataclass(frozen=True)
class Source:
    """One utterance as the corpus lists it."""

    id: str  # utterance id
    text: str  # transcript as the corpus writes it
    where: str  # "FILE:LINE" of the transcript
    audio: str  # audio file, or (Kaldi) a shell command ending in "|"
    speaker: str = ""  # speaker id; "" when the corpus does not say
    start: float = 0.0  # s, where the utterance starts in `audio`
    end: float = -1.0  # s, where it ends; -1 = the end of the recording

    @property
    def is_command(self) -> bool:
        return self.audio.endswith("|")

    @property
    def needs_writing(self) -> bool:
        """No file holds exactly this utterance: a segment, or a command's output."""
        return self.is_command or self.start > 0 or self.end >= 0


@dataclass(frozen=True)
class Problem:
    """A corpus line that gives no usable utterance."""

    reason: str  # e.g. "malformed_line"
    message: str  # "FILE:LINE: UTTERANCE: what is wrong"


@dataclass
class ImportSummary:
    corpus: str  # "librispeech", "commonvoice" or "kaldi"
    manifest: str  # path of the manifest written
    kept: int = 0  # utterances in the manifest, count
    seconds: float = 0.0  # s, audio in the manifest
    written: int = 0  # audio files this run wrote (segments, command output), count
    reused: int = 0  # audio files found from an earlier run, count
    skipped: Counter[str] = field(default_factory=Counter)  # utterances skipped, by reason
    problems: list[str] = field(default_factory=list)  # the first KEPT_MESSAGES skips

    def skip(self, reason: str, message: str) -> None:
        self.skipped[reason] += 1
        if len(self.problems) < KEPT_MESSAGES:
            self.problems.append(message)

    def line(self) -> str:
        """e.g. `kept 980 utterances (1.20 h) -> m.jsonl; skipped 20: 20 too_long`."""
        text = f"kept {self.kept} utterances ({self.seconds / 3600:.2f} h) -> {self.manifest}"
        if self.skipped:
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items()))
            text += f"; skipped {sum(self.skipped.values())}: {reasons}"
        if self.written or self.reused:
            text += f"; wrote {self.written} audio files ({self.reused} already there)"
        return text


class _Skip(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise CorpusError(f"{path}: cannot read ({e.strerror or e})") from None


def _id_and_rest(line: str) -> tuple[str, str]:
    """Kaldi and LibriSpeech lines: an id, whitespace, the rest."""
    parts = line.strip().split(maxsplit=1)
    return parts[0], parts[1] if len(parts) > 1 else ""


# ---------------------------------------------------------------- the layouts


def librispeech_sources(src: Path, cfg: ImportConfig) -> Iterator[Source | Problem]:
    transcripts = sorted(src.rglob("*.trans.txt"))
    if not transcripts:
        raise CorpusError(
            f"{src}: no *.trans.txt files below it (LibriSpeech's layout is"
            " SUBSET/SPEAKER/CHAPTER/SPEAKER-CHAPTER.trans.txt with SPEAKER-CHAPTER-N.flac)"
        )
    for trans in transcripts:
        for number, line in enumerate(_lines(trans), start=1):
            if line.strip():
                utt, text = _id_and_rest(line)
                audio = str(trans.parent / f"{utt}.flac")
                yield Source(utt, text, f"{trans}:{number}", audio, speaker=utt.split("-")[0])


def commonvoice_sources(src: Path, cfg: ImportConfig) -> Iterator[Source | Problem]:
    tsv = src / cfg.tsv
    if not tsv.is_file():
        raise CorpusError(
            f"{tsv}: no such file (a Common Voice language folder holds validated.tsv,"
            " train.tsv, dev.tsv, test.tsv and clips/)"
        )
    lines = _lines(tsv)
    header = lines[0].split("\t") if lines else []
    missing = [c for c in ("path", "sentence") if c not in header]
    if missing:
        raise CorpusError(f"{tsv}:1: the header has no {' or '.join(missing)} column")
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            message = f"{len(fields)} tab-separated fields where the header has {len(header)}"
            yield Problem("malformed_line", f"{tsv}:{number}: -: {message}")
            continue
        row = dict(zip(header, fields, strict=True))
        clip = row["path"]
        yield Source(
            Path(clip).stem, row["sentence"], f"{tsv}:{number}", str(src / "clips" / clip),
            speaker=row.get("client_id", ""),
        )  # fmt: skip


def _kaldi_table(path: Path) -> dict[str, tuple[str, int]]:
    """id -> (rest of the line, line number) of a Kaldi table; CorpusError names the
    line of a duplicate id."""
    table: dict[str, tuple[str, int]] = {}
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        key, rest = _id_and_rest(line)
        if key in table:
            first = table[key][1]
            raise CorpusError(f"{path}:{number}: {key} is listed twice (first at line {first})")
        table[key] = (rest, number)
    return table


def kaldi_sources(src: Path, cfg: ImportConfig) -> Iterator[Source | Problem]:
    text_file, wav_scp, segments_file = src / "text", src / "wav.scp", src / "segments"
    for needed in (text_file, wav_scp):
        if not needed.is_file():
            raise CorpusError(
                f"{needed}: no such file (a Kaldi data directory has wav.scp and text;"
                " segments and utt2spk are optional)"
            )
    recordings = _kaldi_table(wav_scp)
    for rec, (audio, number) in recordings.items():
        if audio.endswith("|") and not cfg.allow_commands:
            raise CorpusError(
                f"{wav_scp}:{number}: {rec} is a command ({audio[:60]}); echoic runs wav.scp"
                " commands through /bin/sh, as Kaldi does, only with --allow-commands"
            )
    speakers = {}
    if (src / "utt2spk").is_file():
        speakers = {u: s for u, (s, _) in _kaldi_table(src / "utt2spk").items()}
    segments = _kaldi_table(segments_file) if segments_file.is_file() else None
    for number, line in enumerate(_lines(text_file), start=1):
        if not line.strip():
            continue
        utt, text = _id_and_rest(line)
        where = f"{text_file}:{number}"
        start, end, rec = 0.0, -1.0, utt
        if segments is not None:
            if utt not in segments:
                yield Problem("no_audio", f"{where}: {utt}: no line for it in {segments_file}")
                continue
            fields, seg_line = segments[utt]
            seg_where = f"{segments_file}:{seg_line}"
            try:
                rec, start_s, end_s = fields.split()
                start, end = float(start_s), float(end_s)
                if not (math.isfinite(start) and math.isfinite(end)):
                    raise ValueError("not a time")
            except ValueError:
                expected = "expected 'RECORDING START END' after the id"
                message = f"{seg_where}: {utt}: {expected}, got {fields!r}"
                yield Problem("malformed_line", message)
                continue
            if start < 0 or (end != -1 and end <= start):
                message = f"{seg_where}: {utt}: segment {start}-{end} s is empty or negative"
                yield Problem("bad_segment", message)
                continue
        if rec not in recordings:
            yield Problem("no_audio", f"{where}: {utt}: recording {rec} is not in {wav_scp}")
            continue
        audio, scp_line = recordings[rec]
        if not audio:
            message = f"{wav_scp}:{scp_line} gives no file or command for {rec}"
            yield Problem("malformed_line", f"{where}: {utt}: {message}")
            continue
        if re.search(r"\.ark:\d+$", audio):
            message = (
                f"{wav_scp}:{scp_line} gives {rec} as an archive offset ({audio}), which echoic"
                " cannot read; give a file or a command ending in '|'"
            )
            yield Problem("unsupported_audio", f"{where}: {utt}: {message}")
            continue
        if not audio.endswith("|"):
            audio = str(Path(audio).absolute())
        yield Source(utt, text, where, audio, speakers.get(utt, ""), start, end)


_LAYOUTS = {
    "librispeech": librispeech_sources,
    "commonvoice": commonvoice_sources,
    "kaldi": kaldi_sources,
}


# ---------------------------------------------------------------- audio


def _file_name(s: Source, rate: int) -> str:
    """The written file of an utterance: its id (cleaned to a safe name) and a hash of
    everything that decides the audio, so that a changed segment or command gets a new
    file instead of a stale one from an earlier run."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", s.id).lstrip(".")[:80]
    key = json.dumps([s.id, s.audio, s.start, s.end, rate]).encode()
    return f"{safe}-{hashlib.sha256(key).hexdigest()[:10]}.wav"


class _Audio:
    """Audio for the manifest: a file's own path, or a written file for what has none."""

    def __init__(self, cfg: ImportConfig, audio_dir: Path, summary: ImportSummary) -> None:
        self.cfg, self.audio_dir, self.summary = cfg, audio_dir, summary
        self._recording: tuple[str, np.ndarray | None] = ("", None)  # the last one decoded

    def _too_long(self, duration: float) -> None:
        if self.cfg.max_duration and duration > self.cfg.max_duration:
            raise _Skip("too_long", f"{duration:.2f} s > max_duration {self.cfg.max_duration} s")

    def __call__(self, s: Source) -> tuple[str, float]:
        """(path, duration in s) of the utterance's audio; _Skip when it is unusable."""
        if not s.needs_writing:
            return s.audio, self._header_duration(s.audio)
        if s.end >= 0:
            self._too_long(s.end - s.start)
        path = self.audio_dir / _file_name(s, self.cfg.sample_rate)
        done = self._existing(path)
        if done:
            self._too_long(done)
            self.summary.reused += 1
            return str(path), done
        samples = self._cut(self._decode(s), s)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write_wav(tmp, samples, self.cfg.sample_rate)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.summary.written += 1
        return str(path), len(samples) / self.cfg.sample_rate

    def _header_duration(self, path: str) -> float:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise _Skip("missing_file", f"no such audio file {path}") from None
        except OSError as e:
            raise _Skip("missing_file", f"cannot read {path} ({e.strerror})") from None
        if size == 0:
            raise _Skip("empty_audio", f"{path} is empty (0 bytes)")
        try:
            duration = audio_duration(path)
        except AudioError as e:
            raise _Skip("undecodable", str(e)) from None
        if duration <= 0:
            raise _Skip("empty_audio", f"{path} has no samples")
        self._too_long(duration)
        return duration

    def _existing(self, path: Path) -> float:
        """The duration of a file an earlier run wrote (0 when there is none)."""
        try:
            info = sf.info(str(path))
        except (sf.LibsndfileError, RuntimeError, OSError):
            return 0.0
        ok = info.samplerate == self.cfg.sample_rate and info.channels == 1 and info.frames
        return info.frames / info.samplerate if ok else 0.0

    def _decode(self, s: Source) -> np.ndarray:
        """The whole recording at the output rate; the last one is kept, since a
        recording's segments come one after another."""
        if self._recording[0] == s.audio and self._recording[1] is not None:
            return self._recording[1]
        if s.is_command:
            data = self._run(s.audio[:-1])
            name = f"the output of {s.audio[:60]!r}"
        else:
            if not os.path.isfile(s.audio):
                raise _Skip("missing_file", f"no such audio file {s.audio}")
            data, name = Path(s.audio).read_bytes(), s.audio
        try:
            samples = decode_audio(data, self.cfg.sample_rate, name=name)
        except AudioError as e:
            raise _Skip("undecodable", str(e)) from None
        self._recording = (s.audio, samples)
        return samples

    @staticmethod
    def _run(command: str) -> bytes:
        try:
            done = subprocess.run(
                command, shell=True, capture_output=True, timeout=COMMAND_TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired:
            raise _Skip("command_failed", f"{command!r} ran over {COMMAND_TIMEOUT} s") from None
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace").strip().splitlines()
            last = err[-1] if err else "no message"
            raise _Skip("command_failed", f"{command!r} exited with {done.returncode}: {last}")
        if not done.stdout:
            raise _Skip("command_failed", f"{command!r} wrote no audio to stdout")
        return done.stdout

    def _cut(self, samples: np.ndarray, s: Source) -> np.ndarray:
        rate = self.cfg.sample_rate
        length = len(samples) / rate
        end = length if s.end < 0 else s.end
        if s.start >= length or end > length + SEGMENT_SLACK:
            raise _Skip(
                "bad_segment",
                f"segment {s.start:.2f}-{end:.2f} s lies outside its recording ({length:.2f} s)",
            )
        cut = samples[round(s.start * rate) : round(min(end, length) * rate)]
        if not len(cut):
            raise _Skip("empty_audio", "the segment has no samples")
        self._too_long(len(cut) / rate)
        return cut


# ---------------------------------------------------------------- the import


def default_audio_dir(manifest: str | os.PathLike[str]) -> Path:
    """Where written audio goes by default: `data/train.jsonl` -> `data/train.audio/`."""
    manifest = Path(manifest)
    return manifest.with_name(f"{manifest.stem}.audio")


def import_corpus(
    corpus: str,
    src: str | os.PathLike[str],
    manifest: str | os.PathLike[str],
    cfg: ImportConfig | None = None,
    vocab: Vocabulary | None = None,
    progress: bool = False,
) -> ImportSummary:
    """Read `corpus` ("librispeech", "commonvoice", "kaldi") at `src`, write `manifest`."""
    cfg = cfg or ImportConfig()
    vocab = vocab or Vocabulary()
    if corpus not in _LAYOUTS:
        raise CorpusError(f"unknown corpus {corpus!r} (choose from {', '.join(CORPORA)})")
    src_dir = Path(src)
    if not src_dir.is_dir():
        raise CorpusError(f"{src_dir}: no such directory")
    manifest = Path(manifest).absolute()
    items = list(_LAYOUTS[corpus](src_dir.absolute(), cfg))
    audio_dir = Path(cfg.audio_dir).absolute() if cfg.audio_dir else default_audio_dir(manifest)
    if any(isinstance(i, Source) and i.needs_writing for i in items):
        audio_dir.mkdir(parents=True, exist_ok=True)
    summary = ImportSummary(corpus, str(manifest))
    audio = _Audio(cfg, audio_dir, summary)
    entries: list[str] = []
    seen: dict[str, str] = {}
    with tqdm(items, desc=f"import {corpus}", unit="utt", disable=not progress) as bar:
        for item in bar:
            if cfg.limit and summary.kept >= cfg.limit:
                break
            if isinstance(item, Problem):
                summary.skip(item.reason, item.message)
                continue
            if item.id in seen:
                summary.skip("duplicate_id", f"{item.where}: {item.id}: also at {seen[item.id]}")
                continue
            seen[item.id] = item.where
            text, reason, detail = check_transcript(item.text, vocab)
            try:
                if reason:
                    raise _Skip(reason, detail)
                path, duration = audio(item)
            except _Skip as e:
                summary.skip(e.reason, f"{item.where}: {item.id}: {e}")
                continue
            record = {"audio_filepath": path, "duration": round(duration, 6), "text": text}
            record |= {"id": item.id, "speaker": item.speaker}
            entries.append(json.dumps(record, ensure_ascii=False) + "\n")
            summary.kept += 1
            summary.seconds += duration
    if not entries:
        shown = "".join(f"\n  {m}" for m in summary.problems[:5])
        raise CorpusError(f"{src_dir}: nothing to import; {summary.line()}{shown}")
    manifest.parent.mkdir(parents=True, exist_ok=True)
    tmp = manifest.with_name(f".{manifest.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(entries), encoding="utf-8")
    os.replace(tmp, manifest)
    return summary
