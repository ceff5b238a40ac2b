"""Durable writes: what export and checkpoints need so a crash leaves the old file or
the new one, never half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_directory(path: str | Path) -> None:
    """Make a rename or a new entry in directory `path` survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` and flush it to the disk before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def staged_directory(out_dir: Path) -> Iterator[Path]:
    """A hidden directory beside `out_dir` to fill; on leaving the block it becomes
    `out_dir` in one rename (an empty `out_dir` is replaced), so a reader sees the whole
    directory or none of it. On an error it is removed and `out_dir` left as it was."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a server may run as another user
        yield tmp
        if out_dir.exists():
            out_dir.rmdir()  # fails unless empty: never replaces what a caller wrote
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_directory(out_dir.parent)
