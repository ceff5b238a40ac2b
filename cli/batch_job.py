"""The job record of a batch transcription: what a rerun may skip, and who is writing.

Beside the output (`OUT.job` for `--output OUT`, `DIR/.echoic-job` for
`--output-dir DIR`) a JSON-lines file: first the settings that change results
(format, model name/version, decoder, beam size, LM), then one line per input
finished, keyed on its resolved path with its size and mtime:

    {"echoic_job": 1, "settings": {"format": "jsonl", "model": "echoic-tiny/1", ...}}
    {"key": "/data/a/utt_001.wav", "size": 153644, "mtime_ns": 17000, "error": null, "end": 912}

A rerun skips what the record says is done (the same file, unchanged) and what
failed (unless --retry-failed); it refuses other settings unless --overwrite. The
record is locked (flock) while a job runs, so two jobs cannot write one output; a
lock dies with its process, so a killed job leaves none behind. Each line says where
its result ends in the output; whatever follows the last one on resume (a line cut
short by power loss or a full disk, or a line written just before a kill that the
record never heard of) is moved to `OUT.torn` and cut off, so the next line starts
clean and no input is written twice. A call the server refused for being busy is
noted `"transient": true`: its row is in the output, but the input is neither done
nor failed, so a rerun tries it.

One row per input: an input done again (retried with --retry-failed, refused by a busy
server, or changed since) has a new row appended, and at the end of the run
`compact` rewrites the output so each input keeps one row, its latest result (a
transient refusal only where nothing else was ever said), in the place of its first
row, so the output stays in input order. The rewrite goes through files beside the
two (`OUT.compacted`, then `OUT.job.compacted`, whose arrival commits it); a run
that opens the record finishes a committed rewrite a kill interrupted, or drops one
that was not committed, so the output and the record always describe each other.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any, TextIO

from echoic.cli.batch_io import Item
from echoic.cli.errors import UserError

VERSION = 1


def stat_key(item: Item) -> tuple[int, int] | None:
    """(size, mtime ns) of an input, None when it cannot be read."""
    try:
        st = os.stat(item.key)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def set_aside_unrecorded(path: Path, end: int) -> str | None:
    """Move what `path` holds past byte `end` (the end of the last result the record
    noted) to `path`.torn and cut it off; returns what was moved (None when nothing).
    That is a line cut short by a kill or a full disk, or whole lines written just
    before a kill that the record never heard of: their inputs are done again, once."""
    if not path.exists() or path.stat().st_size <= end:
        return None
    with open(path, "rb+") as f:
        f.seek(end)
        tail = f.read()
        with open(path.with_name(path.name + ".torn"), "ab") as aside:
            aside.write(tail if tail.endswith(b"\n") else tail + b"\n")
        f.truncate(end)
    return tail.decode(errors="replace")


def _kept_rows(
    rows: list[dict[str, Any]], size: int
) -> list[tuple[dict[str, Any], int, int]] | None:
    """Each input's row to keep, (record line, start, end in the output): its latest
    result (a transient refusal only where there is no other), in the order of the
    inputs' first rows. None when the record does not describe an output of `size`."""
    spans, start = [], 0
    for row in rows:
        if not start <= row["end"] <= size:
            return None
        spans.append((row, start, row["end"]))
        start = row["end"]
    if start != size:
        return None  # lines no record line speaks for: the next run sets them aside
    kept: dict[str, int] = {}  # key -> the span kept; in the order of first rows
    for n, (row, _, _) in enumerate(spans):
        before = kept.get(row["key"])
        if before is None or not row.get("transient") or spans[before][0].get("transient"):
            kept[row["key"]] = n
    return [spans[n] for n in kept.values()]


def _copy_rows(output: Path, kept: list[tuple[dict[str, Any], int, int]],
               target: Path) -> list[dict[str, Any]] | None:  # fmt: skip
    """Write the kept rows of `output` to `target` (synced), a row at a time so memory
    does not grow with the output; the record's lines for it, or None when a row does
    not end where the record says (the output was edited)."""
    lines, size = [], 0
    with open(output, "rb") as source, open(target, "wb") as f:
        for row, start, end in kept:
            source.seek(start)
            text = source.read(end - start)
            if text and not text.endswith(b"\n"):
                return None
            f.write(text)
            size += len(text)
            lines.append({**row, "end": size})
        f.flush()
        os.fsync(f.fileno())
    return lines


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` survive power loss."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JobRecord:
    """The record beside one output, opened and locked for the length of a job."""

    def __init__(self, path: Path, output: Path, settings: dict[str, Any], *,
                 overwrite: bool) -> None:  # fmt: skip
        self.path, self.output, self.settings = path, output, settings
        self.done: dict[str, tuple[int, int]] = {}  # key -> (size, mtime ns)
        self.failed: dict[str, str] = {}  # key -> error
        self.end = 0  # bytes of the output that the noted results fill
        self.rows: list[dict[str, Any]] = []  # the record's lines in order, this run's too
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(path, "a+")  # noqa: SIM115 - closed in close()
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise UserError(
                f"another echoic transcribe is writing {output} (its job record {path} is"
                " locked): wait for it, or write to a new --output"
            ) from None
        self._finish_compaction()  # one a kill interrupted, or none
        self._file.seek(0)
        lines = self._file.read().splitlines()
        header = self._header(lines[0]) if lines else None
        if overwrite or header is None:
            self._start_fresh(lines and header is None and not overwrite)
        elif header != settings:
            self.close()
            changed = ", ".join(
                f"{k} {header.get(k)!r} -> {settings.get(k)!r}"
                for k in sorted(set(header) | set(settings))
                if header.get(k) != settings.get(k)
            )
            raise UserError(
                f"{output} was written with other settings ({changed}): pass --overwrite to"
                " replace it, or write to a new output"
            )
        else:
            for line in lines[1:]:
                try:
                    row = json.loads(line)
                    key, size, mtime = row["key"], row["size"], row["mtime_ns"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut by a kill: that input is done again
                self.end = max(self.end, row.get("end") or 0)
                self.rows.append(row)
                if row.get("transient"):
                    continue  # neither done nor failed: a rerun tries it
                if row.get("error") is None:
                    self.done[key] = (size, mtime)
                    self.failed.pop(key, None)
                else:
                    self.failed[key] = row["error"]
            if lines and not self._ends_clean():
                self._file.write("\n")

    @staticmethod
    def _header(line: str) -> dict[str, Any] | None:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            return None
        return row.get("settings") if row.get("echoic_job") == VERSION else None

    def _ends_clean(self) -> bool:
        self._file.seek(0, os.SEEK_END)
        if self._file.tell() == 0:
            return True
        self._file.seek(self._file.tell() - 1)
        return self._file.read(1) == "\n"

    def _start_fresh(self, unreadable: bool) -> None:
        if unreadable:
            self.close()
            raise UserError(
                f"{self.path} is not an echoic job record: pass --overwrite to replace it"
            )
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps({"echoic_job": VERSION, "settings": self.settings}) + "\n")
        self._file.flush()

    def is_done(self, item: Item) -> bool:
        return item.key in self.done and self.done[item.key] == stat_key(item)

    def failed_before(self, item: Item) -> str | None:
        return self.failed.get(item.key)

    def note(self, item: Item, error: str | None, end: int | None = None, *,
             transient: bool = False) -> None:  # fmt: skip
        """`item` is finished (its result is written): done, or failed with `error`
        (`transient`: refused by a busy server, neither done nor failed); `end`: the
        output's length once its line was written (one file for the job)."""
        size, mtime = stat_key(item) or (None, None)
        row = {"key": item.key, "size": size, "mtime_ns": mtime, "error": error, "end": end}
        if transient:
            row["transient"] = True
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self.rows.append(row)

    def compact(self) -> int:
        """Rewrite the output (one file for the job, closed) and the record so each
        input has one row; returns the rows taken out (0: nothing was superseded, or
        the output is not what the record describes, and both are left as they are)."""
        if len({row["key"] for row in self.rows}) == len(self.rows):
            return 0
        if any(not isinstance(row.get("end"), int) for row in self.rows):
            return 0  # per-file outputs, or lines from before records said where rows end
        kept = _kept_rows(self.rows, self.output.stat().st_size)
        if kept is None:
            return 0
        staged, committed = self._compaction_files()
        part = committed.with_name(committed.name + ".part")
        try:
            rows = _copy_rows(self.output, kept, staged)
            if rows is None:
                staged.unlink()
                return 0
            header = json.dumps({"echoic_job": VERSION, "settings": self.settings}) + "\n"
            _write_synced(part, (header + "".join(json.dumps(r) + "\n" for r in rows)).encode())
            os.replace(part, committed)
            _sync_folder(committed.parent)
        except OSError:  # a full disk: not committed, so the output stays as it was
            staged.unlink(missing_ok=True)
            part.unlink(missing_ok=True)
            raise
        self._finish_compaction()
        taken_out = len(self.rows) - len(rows)
        self.rows = rows
        return taken_out

    def _compaction_files(self) -> tuple[Path, Path]:
        """(the rewritten output, the rewritten record: its arrival commits the rewrite)."""
        return (self.output.with_name(self.output.name + ".compacted"),
                self.path.with_name(self.path.name + ".compacted"))  # fmt: skip

    def _finish_compaction(self) -> None:
        """Put a committed rewrite in place (idempotent, so a kill half way through is
        finished by the next run); drop one that was not committed."""
        staged, committed = self._compaction_files()
        if not committed.exists():
            for uncommitted in (staged, committed.with_name(committed.name + ".part")):
                if uncommitted.is_file():
                    uncommitted.unlink()
            return
        if staged.exists():
            os.replace(staged, self.output)
            _sync_folder(self.output.parent)  # in place before the record says so
        # The record is rewritten in place, not replaced: the lock is on this file.
        self._file.seek(0)
        self._file.truncate()
        self._file.write(committed.read_text())
        self._file.flush()
        os.fsync(self._file.fileno())
        committed.unlink()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()  # and the lock with it
