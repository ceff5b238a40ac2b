"""The optimizer and its learning-rate schedule: AdamW or Nesterov SGD, linear warm-up,
then cosine, exponential or no decay."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"  # AdamW, or SGD with Nesterov momentum (DS2)
    lr: float = 1e-3  # peak learning rate
    momentum: float = 0.9  # SGD momentum (Nesterov)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW betas
    weight_decay: float = 1e-5  # decoupled weight decay (AdamW) or L2 (SGD)
    warmup_steps: int = 200  # linear warm-up, optimizer steps
    decay: Literal["cosine", "exponential", "constant"] = "cosine"  # after warm-up
    decay_steps: int = 0  # steps of the decay; 0 = until max_steps or the last epoch
    final_lr_ratio: float = 0.05  # lr at the end of the decay, fraction of lr
    grad_clip: float = 200.0  # max global gradient norm; 0 = no clipping


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """The schedule as LambdaLR wants it: step -> factor of the peak lr."""
    decay_steps = cfg.decay_steps or max(total_steps - cfg.warmup_steps, 1)

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
        if cfg.decay == "cosine":
            return cfg.final_lr_ratio + (1 - cfg.final_lr_ratio) * 0.5 * (
                1 + math.cos(math.pi * progress)
            )
        if cfg.decay == "exponential":
            return cfg.final_lr_ratio**progress
        return 1.0

    return factor
