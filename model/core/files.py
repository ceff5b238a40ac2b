"""Durable writes: what export and checkpoints need so a crash leaves the old file or
the new one, never half of one."""

from __future__ import annotations

import os
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
