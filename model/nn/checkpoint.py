"""Reading a training checkpoint: its network, ready to use, without the recipe.

`echoic.training.checkpoint` writes checkpoints (atomically, with optimizer and
RNG state for an exact resume); this module is the reading side that export and
fine-tuning need, so nothing in `echoic.model` imports `echoic.training`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from echoic.model.core.configs import from_dict
from echoic.model.nn.network import DeepSpeech2, ModelConfig

FORMAT = "echoic-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or from another recipe."""


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint's dict; FileNotFoundError or CheckpointError saying what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"{path} is not a readable echoic checkpoint: {e}") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an echoic checkpoint (format {FORMAT} expected)")
    return ckpt


def load_model(path: str | Path) -> tuple[DeepSpeech2, dict[str, Any]]:
    """The network of a checkpoint, in eval mode, with its config; no recipe needed."""
    ckpt = load_checkpoint(path)
    model = DeepSpeech2(from_dict(ModelConfig, ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.eval(), ckpt
