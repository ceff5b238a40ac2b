"""Writing checkpoints: atomic, self-describing, with everything an exact resume needs.

A checkpoint holds everything needed to resume exactly (model, optimizer,
scheduler, sampler position, every RNG state) and to use the weights without the
recipe that made them (the model config and the full training config).

Writes go to a temporary file in the same directory, are fsynced, then renamed
over the old file, so a run killed at any moment leaves either the previous
checkpoint or the new one, never half of one. Reading one back is `echoic.model.nn.checkpoint`.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from echoic.model.core.files import fsync_directory

LAST = "last.pt"  # the checkpoint in out_dir that a run resumes from


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_atomic(obj: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path
