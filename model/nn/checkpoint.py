"""Reading a training checkpoint: its network, ready to use, without the recipe.

`echoic.training.checkpoint` writes checkpoints (atomically, with optimizer and
RNG state for an exact resume); this module is the reading side that export and
fine-tuning need, so nothing in `echoic.model` imports `echoic.training`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from echoic.model.core.configs import from_dict
from echoic.model.nn.network import DeepSpeech2, ModelConfig

FORMAT = "echoic-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or from another recipe."""


@dataclass
class Checkpoint:
    """A training checkpoint: the one definition of what `out_dir/last.pt` holds.

    On disk it is `to_dict()` (a plain dict with `format`, written by torch.save), so
    files stay readable without this class; `load_checkpoint` reads them back.
    """

    model: dict[str, Tensor]  # the network's state_dict
    model_config: dict[str, Any]  # ModelConfig, as configs.to_dict gives it
    train_config: dict[str, Any] = field(default_factory=dict)  # TrainConfig without
    # out_dir, with the thread count used
    config_hash: str = ""  # the training config's hash: what changes the weights
    optimizer: dict[str, Any] = field(default_factory=dict)  # the optimizer's state_dict
    scheduler: dict[str, Any] = field(default_factory=dict)  # the LR schedule's state_dict
    sampler: dict[str, Any] = field(default_factory=dict)  # the batch sampler's position
    rng: list[Any] = field(default_factory=list)  # every rank's RNG states, by rank
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # passes over the training data begun
    world_size: int = 1  # ranks that trained it

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_dict(cls, saved: dict[str, Any], path: str | Path = "") -> Checkpoint:
        """The checkpoint in a dict that torch.load gave; CheckpointError naming what is
        missing. Keys this version does not know are left out."""
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not an echoic checkpoint (format {FORMAT} expected)")
        missing = [k for k in ("model", "model_config") if k not in saved]
        if missing:
            raise CheckpointError(f"{path} is an echoic checkpoint without {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})


def load_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`; FileNotFoundError or CheckpointError saying what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"{path} is not a readable echoic checkpoint: {e}") from e
    return Checkpoint.from_dict(saved, path)


def load_model(path: str | Path) -> tuple[DeepSpeech2, Checkpoint]:
    """The network of a checkpoint, in eval mode, with the checkpoint; no recipe needed."""
    ckpt = load_checkpoint(path)
    model = DeepSpeech2(from_dict(ModelConfig, ckpt.model_config))
    model.load_state_dict(ckpt.model)
    return model.eval(), ckpt
