"""Train a Deep Speech 2 model with CTC, on one process or many.

Single process (CPU or one GPU):

    echoic train --config recipes/default.toml data.train_manifest=corpus/train.jsonl

Many ranks on one or more machines, started by MPI (Open MPI or MPICH); rank and
world size come from the MPI environment, gradients are averaged with NCCL on
GPUs and gloo on CPUs:

    mpirun -np 8 echoic train --config recipes/default.toml out_dir=runs/ds2

The same with torchrun:

    torchrun --nproc-per-node 8 -m echoic.cli.main train --config recipes/default.toml

Training is synchronous data-parallel SGD: SortaGrad for the first epoch, then
length-bucketed, shuffled batches. It writes `out_dir/last.pt` atomically every
`checkpoint_every` steps and resumes from it exactly (model, optimizer, schedule,
data position, RNG states) when started again with the same recipe. The same
recipe, seed and world size give a bitwise-identical checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from echoic.model.core.configs import apply_overrides, config_hash, from_dict, to_dict
from echoic.model.core.text import Vocabulary
from echoic.model.nn.checkpoint import FORMAT, CheckpointError, load_checkpoint
from echoic.model.nn.network import DeepSpeech2, ModelConfig, count_parameters, ctc_loss
from echoic.training import checkpoint, distributed
from echoic.training.data import DataConfig, SpeechDataset, make_loader, read_manifest
from echoic.training.evaluate import evaluate


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


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    out_dir: str = "runs/ds2"  # checkpoints and logs go here
    seed: int = 1234  # seeds weights, data order and dropout
    epochs: int = 20  # passes over the training manifest
    max_steps: int = 0  # stop after this many optimizer steps; 0 = all epochs
    log_every: int = 10  # steps between metric log lines
    eval_every: int = 500  # steps between evaluations on data.val_manifest; 0 = per epoch
    eval_at_start: bool = False  # evaluate the untrained model too (a baseline)
    eval_max_utterances: int = 400  # evaluation subset size, utterances; 0 = all
    checkpoint_every: int = 100  # steps between checkpoints
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto = cuda when available
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto = bf16 autocast on GPU
    rnn_impl: Literal["auto", "cudnn", "persistent"] = "cudnn"  # GRU / plain RNN kernels on
    # GPU: persistent (echoic.model.nn.persistent, cuDNN where they do not fit), auto (persistent
    # where they fit and are expected faster), cudnn. Same parameters and checkpoints.
    threads: int = 0  # intra-op CPU threads per rank; 0 = cores / local ranks
    stats_utterances: int = 300  # utterances sampled for feature mean/std
    init_from: str = ""  # fine-tuning: a checkpoint whose weights and feature statistics
    # start this run (the network must have the same parameter shapes; chunking may differ);
    # the optimizer, schedule and data order start afresh. A run that resumes ignores it.


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """A recipe TOML plus `key=value` overrides; unknown keys are errors."""
    import tomllib

    data: dict[str, Any] = {}
    if path:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    cfg = from_dict(TrainConfig, data)
    return apply_overrides(cfg, list(overrides))


# ---- set-up ----------------------------------------------------------------------


def _device(cfg: TrainConfig, env: distributed.DistEnv) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but no CUDA GPU is visible")
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def make_deterministic(device: torch.device) -> None:
    """Every op deterministic that PyTorch can make so (see README, Determinism)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def feature_stats(utts: list, cfg: ModelConfig, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-bin mean and std of the raw features over an evenly spaced sample of utterances."""
    step = max(1, len(utts) // max(count, 1))
    sample = SpeechDataset(utts[::step][:count], cfg.features)
    total, total_sq, frames = 0.0, 0.0, 0
    for i in range(len(sample)):
        f64 = sample[i].features.astype(np.float64)
        total = total + f64.sum(0)
        total_sq = total_sq + (f64**2).sum(0)
        frames += len(f64)
    if frames == 0:
        raise ValueError("no feature frames to compute normalisation statistics from")
    mean = total / frames
    std = np.sqrt(np.maximum(total_sq / frames - mean**2, 1e-8))
    return mean.astype(np.float32), std.astype(np.float32)


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


def lr_lambda(cfg: OptimConfig, total_steps: int):
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


class MetricLog:
    """JSON lines in out_dir/metrics.jsonl, written by rank 0 only."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, **record: Any) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


# ---- the loop --------------------------------------------------------------------


def train(cfg: TrainConfig, *, progress: bool = True) -> Path:
    """Train (or resume) according to `cfg`; returns the path of the final checkpoint."""
    env = distributed.detect_env()
    device = _device(cfg, env)
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(env.local_world_size, 1))
    torch.set_num_threads(threads)
    make_deterministic(device)
    distributed.init_distributed(env, device.type)
    try:
        return _train(cfg, env, device, progress)
    finally:
        distributed.cleanup()


def _init_from(model: DeepSpeech2, path: str) -> None:
    """Load a checkpoint's weights and feature statistics into `model` (fine-tuning)."""
    ckpt = load_checkpoint(path)
    ours = model.state_dict()
    theirs = ckpt["model"]
    misfit = sorted(set(ours) ^ set(theirs)) or [
        k for k in ours if ours[k].shape != theirs[k].shape
    ]
    if misfit:
        raise CheckpointError(
            f"init_from={path}: its network does not fit this recipe's [model] (first"
            f" difference: {misfit[0]}); fine-tune with the [model] it was trained with"
        )
    model.load_state_dict(theirs)


def _train(cfg: TrainConfig, env: distributed.DistEnv, device: torch.device, progress: bool):
    out = Path(cfg.out_dir)
    main = env.rank == 0
    if main:
        out.mkdir(parents=True, exist_ok=True)
    vocab = Vocabulary(cfg.model.vocabulary)
    train_utts, report = read_manifest(cfg.data.train_manifest, vocab, cfg.data)
    val_utts = []
    if cfg.data.val_manifest:
        val_utts, _ = read_manifest(cfg.data.val_manifest, vocab, cfg.data)
    log = MetricLog(out / "metrics.jsonl", main)
    if main:
        print(f"train manifest: {report.summary()}", file=sys.stderr)

    ckpt_path = out / checkpoint.LAST
    resume = load_checkpoint(ckpt_path) if ckpt_path.exists() else None
    if resume is not None and resume["model_config"] != to_dict(cfg.model):
        raise CheckpointError(
            f"{ckpt_path} holds a different model (its [model] config differs from this"
            " recipe's); use a new out_dir or the recipe that wrote it"
        )
    if resume is not None and resume["config_hash"] != config_hash(cfg) and main:
        print(f"note: resuming {ckpt_path} with a changed training config", file=sys.stderr)
    if resume is not None and resume["world_size"] != env.world_size:
        raise CheckpointError(
            f"{ckpt_path} was written with world size {resume['world_size']}, not"
            f" {env.world_size}: exact resume needs the same number of ranks"
        )

    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    model = DeepSpeech2(cfg.model)
    if resume is None and cfg.init_from:
        _init_from(model, cfg.init_from)
        if main:
            print(f"fine-tuning from {cfg.init_from}", file=sys.stderr)
    elif resume is None:
        mean, std = feature_stats(train_utts, cfg.model, cfg.stats_utterances)
        model.feature_mean.copy_(torch.from_numpy(mean))
        model.feature_std.copy_(torch.from_numpy(std))
    model.to(device)
    model.set_rnn_impl(cfg.rnn_impl)
    loader, sampler = make_loader(
        train_utts,
        cfg.model.features,
        cfg.data,
        seed=cfg.seed,
        rank=env.rank,
        world_size=env.world_size,
    )
    steps_per_epoch = len(sampler)
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, total))
    step, epoch = 0, 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        sampler.load_state_dict(resume["sampler"])
        step, epoch = resume["step"], resume["epoch"]
        checkpoint.set_rng_state(resume["rng"][env.rank])
    wrapped: nn.Module = model
    if env.world_size > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    use_bf16 = device.type == "cuda" and cfg.precision in ("auto", "bf16")
    if main:
        print(
            f"model {cfg.model.name}: {count_parameters(model) / 1e6:.2f}M parameters;"
            f" {env.world_size} rank(s) on {device.type}; {steps_per_epoch} steps/epoch;"
            f" {total} steps" + (f"; resuming at step {step}" if step else ""),
            file=sys.stderr,
        )

    def save() -> None:
        rngs = distributed.all_gather_object(checkpoint.rng_state())
        if main:
            checkpoint.save_atomic(
                {
                    "format": FORMAT,
                    "model": model.state_dict(),
                    "model_config": to_dict(cfg.model),
                    "train_config": to_dict(cfg),
                    "config_hash": config_hash(cfg),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "sampler": sampler.state_dict(),
                    "rng": rngs,
                    "step": step,
                    "epoch": epoch,
                    "world_size": env.world_size,
                },
                ckpt_path,
            )
        distributed.barrier()

    evaluated_at = [-1]

    def run_eval() -> None:
        evaluated_at[0] = step
        if main and val_utts:
            metrics = evaluate(model, val_utts, cfg, device, limit=cfg.eval_max_utterances)
            log.write(kind="eval", step=step, epoch=epoch, **metrics)
            print(
                f"step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
                file=sys.stderr,
            )
            model.train()
        distributed.barrier()

    bar = None
    if progress and main:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, unit="step", dynamic_ncols=True, file=sys.stderr)
    t0, audio_seconds, window_loss, window_n = time.perf_counter(), 0.0, 0.0, 0
    model.train()
    done = step >= total
    if resume is None:
        sampler.set_epoch(0)
        if cfg.eval_at_start:
            run_eval()
    while not done and epoch < cfg.epochs:
        for feats, feat_len, targets, target_len in loader:
            feats, feat_len = feats.to(device), feat_len.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                log_probs, out_len = wrapped(feats, feat_len)
            # CTC backward is not deterministic on CUDA; on the CPU it is, and the
            # log-probs are small, so the loss is computed there.
            loss = ctc_loss(log_probs.float().cpu(), out_len.cpu(), targets, target_len)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = (
                nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                if cfg.optim.grad_clip
                else torch.zeros(())
            )
            optimizer.step()
            scheduler.step()
            step += 1
            window_loss += loss.item()
            window_n += 1
            hop = cfg.model.features.hop_ms / 1000.0
            audio_seconds += float(feat_len.sum()) * hop * env.world_size
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.2f}", epoch=epoch)
            if step % cfg.log_every == 0 or step == total:
                elapsed = time.perf_counter() - t0
                log.write(
                    kind="train",
                    step=step,
                    epoch=epoch,
                    loss=window_loss / window_n,
                    lr=scheduler.get_last_lr()[0],
                    grad_norm=float(grad_norm),
                    audio_seconds=audio_seconds,
                    elapsed=elapsed,
                    audio_seconds_per_second=audio_seconds / max(elapsed, 1e-9),
                )
                window_loss, window_n = 0.0, 0
            if step == total:
                done = True
            if (cfg.eval_every and step % cfg.eval_every == 0) or done:
                run_eval()
            if step % cfg.checkpoint_every == 0 or done:
                save()
            if done:
                break
        else:
            epoch += 1
            sampler.set_epoch(epoch)
            if not cfg.eval_every and evaluated_at[0] != step:
                run_eval()
            save()
    if bar is not None:
        bar.close()
    return ckpt_path


def config_summary(cfg: TrainConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True)
