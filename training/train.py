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
recipe, seed, world size and thread count give a byte-identical checkpoint file,
whatever the out_dir (docs/training.md, "Determinism").

The module reads in the order things happen: the configs; `start`, which builds a
`Run` (one process's state) by resuming, fine-tuning or starting fresh; the steps
on it (`train_step`, `log_step`, `evaluate`, `save`); and the loop that drives them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from echoic.model.core.configs import (
    apply_overrides,
    config_hash,
    from_dict,
    to_dict,
)
from echoic.model.core.text import Vocabulary
from echoic.model.nn.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from echoic.model.nn.network import DeepSpeech2, ModelConfig, count_parameters, ctc_loss
from echoic.model.nn.rebuild import bundled_model_dir, is_export, rebuild, recalibrate_norms
from echoic.training import checkpoint, distributed
from echoic.training.data import (
    Batch,
    BatchLoader,
    BucketBatchSampler,
    DataConfig,
    SpeechDataset,
    Utterance,
    collate,
    make_loader,
    read_manifest,
)
from echoic.training.evaluate import evaluate as evaluate_model
from echoic.training.optim import OptimConfig, lr_lambda, make_optimizer
from echoic.training.recipe_files import BUNDLED, find_recipe

if TYPE_CHECKING:
    from tqdm import tqdm


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    out_dir: str = "runs/ds2"  # checkpoints and logs go here
    seed: int = 1234  # seeds weights, data order and dropout
    epochs: int = 20  # passes over the training manifest
    max_steps: int = 0  # stop after this many optimizer steps; 0 = all epochs
    max_minutes: float = 0.0  # wall-clock budget of this call, minutes: at the first
    # checkpoint past it, evaluate, checkpoint and stop (run again to resume); 0 = none.
    # The schedule follows max_steps, so stopping and resuming changes no weight.
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
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"  # collectives between ranks: auto =
    # NCCL on GPUs (a GPU a rank), gloo on CPUs; gloo on GPUs lets ranks share them (local
    # rank r on GPU r % GPUs). Sums in another order: part of what a run computes.
    threads: int = 0  # intra-op CPU threads per rank; 0 = cores / local ranks. The weights
    # depend on it: a checkpoint records the count used and resumes only with that count.
    stats_utterances: int = 300  # utterances sampled for feature mean/std
    init_from: str = ""  # fine-tuning: a checkpoint (or an exported model directory, such as
    # the bundled one: init_from=bundled) whose weights and feature statistics start this run (the
    # network must have the same parameter shapes; chunking may differ); the optimizer,
    # schedule and data order start afresh. A run that resumes ignores it.


# Where a checkpoint lies is no part of it: left out of the saved config, so that the
# same training into two directories writes the same bytes (and a moved file is not stale).
NOT_SAVED = ("out_dir", "max_minutes")
# What only says where a run writes and what it reports, never what it computes: left out
# of `config_hash` (the checkpoint's and the model card's), so that the same weights get
# the same hash and export to the same ONNX bytes, and a resume notes only real changes.
NOT_HASHED = (
    *NOT_SAVED, "log_every", "eval_every", "eval_at_start", "eval_max_utterances",
    "checkpoint_every", "data.val_manifest",
)  # fmt: skip


# Settings that came after checkpoints were written, with the value that computes what
# runs computed before them: left out of the saved config and the hash while they hold
# it, so that a recipe that does not use them writes the bytes and hash it wrote before.
LATER_DEFAULTS = {"data.batch_per": "rank"}


def leaving_out(cfg: TrainConfig, keys: tuple[str, ...]) -> tuple[str, ...]:
    """`keys`, and each of `LATER_DEFAULTS` that `cfg` holds at that value."""
    at_default = (k for k, v in LATER_DEFAULTS.items() if reduce(getattr, k.split("."), cfg) == v)
    return (*keys, *at_default)


def saved_config(cfg: TrainConfig) -> dict[str, Any]:
    """The training config as a checkpoint holds it (without `NOT_SAVED`)."""
    return to_dict(cfg, leaving_out(cfg, NOT_SAVED))


def weights_hash(cfg: TrainConfig) -> str:
    """The hash of everything in `cfg` that changes the weights (the checkpoint's and the
    model card's `config_hash`)."""
    return config_hash(cfg, leaving_out(cfg, NOT_HASHED))


# A recipe's own relative paths: looked for in the working directory, then beside it.
RECIPE_PATHS = (("init_from",), ("data", "train_manifest"), ("data", "val_manifest"))


def _beside_recipe(data: dict[str, Any], folder: Path) -> None:
    """A relative path in the recipe that is not in the working directory but is beside
    the recipe file becomes that file's path."""
    for keys in RECIPE_PATHS:
        holder = data
        for key in keys[:-1]:
            holder = holder.get(key, {}) if isinstance(holder, dict) else {}
        value = holder.get(keys[-1]) if isinstance(holder, dict) else None
        if not isinstance(value, str) or not value or value == BUNDLED:
            continue
        here = Path(value)
        if not here.is_absolute() and not here.exists() and (folder / here).exists():
            holder[keys[-1]] = str(folder / here)


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """A recipe (a TOML file, or a packaged recipe's name: `find_recipe`) plus `key=value`
    overrides; unknown keys are errors. The recipe's relative paths are found in the
    working directory, else beside the recipe (`_beside_recipe`); `init_from=bundled` is
    the bundled model."""
    import tomllib

    data: dict[str, Any] = {}
    if path:
        recipe = find_recipe(path)
        with open(recipe, "rb") as f:
            data = tomllib.load(f)
        _beside_recipe(data, recipe.resolve().parent)
    cfg = from_dict(TrainConfig, data)
    cfg = apply_overrides(cfg, list(overrides))
    if cfg.init_from == BUNDLED:
        cfg = dataclasses.replace(cfg, init_from=str(bundled_model_dir()))
    return cfg


# ---- set-up ----------------------------------------------------------------------


def _device_type(cfg: TrainConfig) -> str:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but no CUDA GPU is visible")
        return "cuda"
    return "cpu"


def make_deterministic(device: torch.device) -> None:
    """Every op deterministic that PyTorch can make so (docs/training.md, "Determinism")."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def feature_stats(utts: list, cfg: ModelConfig, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-bin mean and std of the raw features over an evenly spaced sample of utterances."""
    sample = SpeechDataset(_evenly(utts, count), cfg.features)
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


class MetricLog:
    """JSON lines in out_dir/metrics.jsonl, written by rank 0 only."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, **record: Any) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


# ---- a run's state and its set-up ------------------------------------------------


@dataclass
class Run:
    """What one training process holds and changes as it goes; `start` builds it."""

    cfg: TrainConfig
    env: distributed.DistEnv
    device: torch.device
    model: DeepSpeech2  # the network that is evaluated and checkpointed
    wrapped: nn.Module  # `model`, or its DistributedDataParallel wrapper on many ranks
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: BatchLoader
    sampler: BucketBatchSampler  # this rank's data position, checkpointed
    val_utts: list[Utterance]  # empty = no evaluation, only its barrier
    log: MetricLog
    ckpt_path: Path  # out_dir/last.pt: written by `save`, resumed from by `start`
    total: int  # optimizer steps of the whole run
    resumed: bool  # started from ckpt_path, not afresh
    step: int  # optimizer steps taken, counting those before a resume
    epoch: int  # the sampler's epoch: epochs finished
    bar: tqdm | None  # progress bar on rank 0, when asked for
    started: float  # time.perf_counter() when training started, seconds
    evaluated_at: int = -1  # step of this process's last evaluation; -1 = none yet
    step_frames: int = 0  # feature frames of the last step's shared batch; 0: a batch a rank
    audio_seconds: float = 0.0  # audio trained on by all ranks since `started`, seconds
    window_loss: float = 0.0  # sum of the losses since the last train record
    window_steps: int = 0  # steps since the last train record

    @property
    def main(self) -> bool:
        """Rank 0: the one that logs and writes checkpoints."""
        return self.env.rank == 0


def start(cfg: TrainConfig, env: distributed.DistEnv, device: torch.device, progress: bool) -> Run:
    """Read the data and build the run: resumed from out_dir/last.pt when there is one,
    else fine-tuned from `cfg.init_from` when set, else fresh."""
    out, main = Path(cfg.out_dir), env.rank == 0
    vocab = Vocabulary(cfg.model.vocabulary)
    train_utts, report = read_manifest(cfg.data.train_manifest, vocab, cfg.data)
    val_utts = []
    if cfg.data.val_manifest:
        val_utts, _ = read_manifest(cfg.data.val_manifest, vocab, cfg.data)
    log = MetricLog(out / "metrics.jsonl", main)
    if main:
        print(f"train manifest: {report.summary()}", file=sys.stderr)

    ckpt_path = out / checkpoint.LAST
    resume = _resumable(ckpt_path, cfg, env)
    model = _new_model(cfg, train_utts, fresh=resume is None, main=main)
    if main:  # only now: a run that cannot start leaves no empty out_dir behind
        out.mkdir(parents=True, exist_ok=True)
    model.to(device)
    model.set_rnn_impl(cfg.rnn_impl)
    loader, sampler = make_loader(
        train_utts, cfg.model.features, cfg.data, cfg.seed, env.rank, env.world_size
    )
    total = cfg.max_steps or len(sampler) * cfg.epochs
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, total))
    step, epoch = 0, 0
    if resume is not None:
        model.load_state_dict(resume.model)
        optimizer.load_state_dict(resume.optimizer)
        scheduler.load_state_dict(resume.scheduler)
        sampler.load_state_dict(resume.sampler)
        step, epoch = resume.step, resume.epoch
        checkpoint.set_rng_state(resume.rng[env.rank])
    # After the resume: DDP broadcasts rank 0's weights when it wraps them.
    wrapped: nn.Module = model
    if env.world_size > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        if cfg.data.batch_per == "step":  # ranks share each batch: and its norms' statistics
            model.share_norm_statistics(distributed.new_group())
    if main:
        print(
            f"model {cfg.model.name}: {count_parameters(model) / 1e6:.2f}M parameters;"
            f" {env.world_size} rank(s) on {device.type}; {len(sampler)} steps/epoch;"
            f" {total} steps" + (f"; resuming at step {step}" if step else ""),
            file=sys.stderr,
        )
    bar = None
    if progress and main:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, unit="step", dynamic_ncols=True, file=sys.stderr)
    return Run(
        cfg=cfg,
        env=env,
        device=device,
        model=model,
        wrapped=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        sampler=sampler,
        val_utts=val_utts,
        log=log,
        ckpt_path=ckpt_path,
        total=total,
        resumed=resume is not None,
        step=step,
        epoch=epoch,
        bar=bar,
        started=time.perf_counter(),
    )


def _resumable(
    ckpt_path: Path, cfg: TrainConfig, env: distributed.DistEnv
) -> dict[str, Any] | None:
    """The checkpoint to resume from, None when there is none; refuses one this run cannot
    continue exactly."""
    if not ckpt_path.exists():
        return None
    resume = load_checkpoint(ckpt_path)
    if resume.model_config != to_dict(cfg.model):
        raise CheckpointError(
            f"{ckpt_path} holds a different model (its [model] config differs from this"
            " recipe's); use a new out_dir or the recipe that wrote it"
        )
    saved_threads = resume.train_config.get("threads", 0)  # 0: not recorded (older)
    if saved_threads and saved_threads != cfg.threads:
        raise CheckpointError(
            f"{ckpt_path} was trained with {saved_threads} intra-op thread(s), this run would use"
            f" {cfg.threads}, and the weights depend on it: pass threads={saved_threads} to resume"
        )
    if resume.config_hash != weights_hash(cfg) and env.rank == 0:
        ours, theirs = _flat(to_dict(cfg, leaving_out(cfg, NOT_HASHED))), _flat(resume.train_config)
        changed = sorted(k for k, v in ours.items() if theirs.get(k) != v)
        print(
            f"note: resuming {ckpt_path} with a changed training config"
            f" ({', '.join(changed) or 'from an older checkpoint'}): the run will not match"
            " an uninterrupted one",
            file=sys.stderr,
        )
    if resume.world_size != env.world_size:
        raise CheckpointError(
            f"{ckpt_path} was written with world size {resume.world_size}, not"
            f" {env.world_size}: exact resume needs the same number of ranks"
        )
    return resume


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim.lr": 0.003, ...} of a nested config dict."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _new_model(
    cfg: TrainConfig, train_utts: list[Utterance], fresh: bool, main: bool
) -> DeepSpeech2:
    """The network, seeded; with `init_from`'s weights or this data's feature statistics
    unless it is about to be resumed (`fresh` False)."""
    random.seed(cfg.seed)  # nothing draws from it, but its state is checkpointed
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    model = DeepSpeech2(cfg.model)
    if fresh and cfg.init_from:
        how = _init_from(model, cfg, train_utts)
        if main:
            print(f"fine-tuning from {cfg.init_from}{how}", file=sys.stderr)
    elif fresh:
        mean, std = feature_stats(train_utts, cfg.model, cfg.stats_utterances)
        model.feature_mean.copy_(torch.from_numpy(mean))
        model.feature_std.copy_(torch.from_numpy(std))
    return model


def _init_from(model: DeepSpeech2, cfg: TrainConfig, train_utts: list[Utterance]) -> str:
    """Load `cfg.init_from`'s weights and feature statistics into `model` (fine-tuning);
    returns how, for the log line. An exported model is rebuilt (`echoic.model.nn.rebuild`)
    and its norms recalibrated on this run's data."""
    path = cfg.init_from
    source = info = None
    if not Path(path).exists():
        raise CheckpointError(
            f"init_from={path}: no checkpoint or model directory at {Path(path).resolve()} (a"
            " recipe's relative init_from is looked for in the working directory, then beside"
            " the recipe); init_from=bundled fine-tunes the bundled model"
        )
    if is_export(path):
        source, info = rebuild(path)
        theirs = source.state_dict()
    else:
        theirs = load_checkpoint(path).model
    ours = model.state_dict()
    misfit = sorted(set(ours) ^ set(theirs)) or [
        k for k in ours if ours[k].shape != theirs[k].shape
    ]
    if source is not None and not misfit:  # shapes alone miss strides, chunks, vocabulary order
        theirs_cfg, ours_cfg = to_dict(source.cfg), to_dict(cfg.model)
        free = ("name", "dropout", "chunk_frames", "context_frames")  # may differ
        misfit = [f"model.{k}" for k in ours_cfg if k not in free and ours_cfg[k] != theirs_cfg[k]]
    if misfit:
        raise CheckpointError(
            f"init_from={path}: its network does not fit this recipe's [model] (first"
            f" difference: {misfit[0]}); fine-tune with the [model] it was trained with"
        )
    if source is None:
        model.load_state_dict(theirs)
        return ""
    sample = SpeechDataset(_evenly(train_utts, cfg.stats_utterances), cfg.model.features)
    batches = (
        (b.features, b.feature_lengths)
        for b in (
            collate([sample[j] for j in range(i, min(i + 16, len(sample)))])
            for i in range(0, len(sample), 16)
        )
    )
    frames = recalibrate_norms(source, batches)
    model.load_state_dict(source.state_dict())
    return (
        f" (an export: weights rebuilt, max |diff| {info['parity_max_abs_diff']:.1e} from"
        f" its graphs; norm statistics measured on {frames} frames of this data)"
    )


def _evenly(utts: list, count: int) -> list:
    """An evenly spaced sample of at most `count` utterances."""
    return utts[:: max(1, len(utts) // max(count, 1))][:count]


# ---- the steps -------------------------------------------------------------------


def step_share(
    features: torch.Tensor, frames: int, world_size: int
) -> tuple[torch.Tensor, float, int]:
    """This rank's share of a step's batch (batch_per = "step" over several ranks): its
    features (B, T, F) padded to the batch's longest, so that the convolutions' norms see
    what one rank would; the weight of its loss (a mean over its utterances), so that
    DDP's mean over ranks is the batch's mean over utterances; and the batch's frames
    (`frames` this rank's)."""
    sizes = distributed.all_gather_sizes(*features.shape[:2], frames)  # (ranks, 3)
    longest = int(sizes[:, 1].max())
    features = nn.functional.pad(features, (0, 0, 0, longest - features.shape[1]))
    share = world_size * features.shape[0] / int(sizes[:, 0].sum())
    return features, share, int(sizes[:, 2].sum())


def train_step(run: Run, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch; returns its loss and the gradient norm before
    clipping (zero when clipping is off)."""
    cfg, device = run.cfg, run.device
    use_bf16 = device.type == "cuda" and cfg.precision in ("auto", "bf16")
    features, share, run.step_frames = batch.features, 1.0, 0
    shared = cfg.data.batch_per == "step" and run.env.world_size > 1
    if shared:
        frames = int(batch.feature_lengths.sum())
        features, share, run.step_frames = step_share(features, frames, run.env.world_size)
    features, feature_lengths = features.to(device), batch.feature_lengths.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
        log_probs, out_len = run.wrapped(features, feature_lengths)
    # CTC backward is not deterministic on CUDA; on the CPU it is, and the
    # log-probs are small, so the loss is computed there.
    loss = ctc_loss(log_probs.float().cpu(), out_len.cpu(), batch.targets, batch.target_lengths)
    run.optimizer.zero_grad(set_to_none=True)
    (loss * share).backward()
    if shared:  # the batch's loss, as one rank's (on the device: NCCL moves no CPU tensor)
        loss = distributed.all_reduce_mean((loss * share).to(device)).cpu()
    grad_norm = (
        nn.utils.clip_grad_norm_(run.model.parameters(), cfg.optim.grad_clip)
        if cfg.optim.grad_clip
        else torch.zeros(())
    )
    run.optimizer.step()
    run.scheduler.step()
    run.step += 1
    return loss, grad_norm


def log_step(run: Run, batch: Batch, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    """Advance the progress bar; a train record every `log_every` steps and at the last,
    its loss the mean over its `steps`: those since the record before, or since the
    resume (fewer than `log_every` when the run resumed between two records)."""
    run.window_loss += loss.item()
    run.window_steps += 1
    hop = run.cfg.model.features.hop_ms / 1000.0
    if run.step_frames:  # the ranks shared the batch: its frames are known
        run.audio_seconds += run.step_frames * hop
    else:  # a batch a rank: alike, near enough
        run.audio_seconds += float(batch.feature_lengths.sum()) * hop * run.env.world_size
    if run.bar is not None:
        run.bar.update(1)
        run.bar.set_postfix(loss=f"{loss.item():.2f}", epoch=run.epoch)
    if run.step % run.cfg.log_every == 0 or run.step == run.total:
        elapsed = time.perf_counter() - run.started
        run.log.write(
            kind="train",
            step=run.step,
            epoch=run.epoch,
            loss=run.window_loss / run.window_steps,
            steps=run.window_steps,
            lr=run.scheduler.get_last_lr()[0],
            grad_norm=float(grad_norm),
            audio_seconds=run.audio_seconds,
            elapsed=elapsed,
            audio_seconds_per_second=run.audio_seconds / max(elapsed, 1e-9),
        )
        run.window_loss, run.window_steps = 0.0, 0


def evaluate(run: Run) -> None:
    """Evaluate on the validation set and log it; rank 0 does, the others wait for it."""
    run.evaluated_at = run.step
    if run.main and run.val_utts:
        metrics = evaluate_model(
            run.model, run.val_utts, run.cfg.model, run.device, limit=run.cfg.eval_max_utterances
        )
        run.log.write(kind="eval", step=run.step, epoch=run.epoch, **metrics)
        print(
            f"step {run.step}: " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
            file=sys.stderr,
        )
        run.model.train()
    distributed.barrier()


def save(run: Run) -> None:
    """Checkpoint to out_dir/last.pt: every rank's RNG states, gathered; rank 0 writes."""
    rngs = distributed.all_gather_object(checkpoint.rng_state())
    if run.main:
        cfg = run.cfg
        saved = Checkpoint(
            model=run.model.state_dict(),
            model_config=to_dict(cfg.model),
            train_config=saved_config(cfg),  # threads: the count used
            config_hash=weights_hash(cfg),
            optimizer=run.optimizer.state_dict(),
            scheduler=run.scheduler.state_dict(),
            sampler=run.sampler.state_dict(),
            rng=rngs,
            step=run.step,
            epoch=run.epoch,
            world_size=run.env.world_size,
        )
        checkpoint.save_atomic(saved.to_dict(), run.ckpt_path)
    distributed.barrier()


# ---- the loop --------------------------------------------------------------------


def train(cfg: TrainConfig, *, progress: bool = True) -> Path | None:
    """Train (or resume) according to `cfg`; returns the path of the final checkpoint on
    rank 0 (the one that wrote it), None on the others."""
    env = distributed.detect_env()
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(env.local_world_size, 1))
    cfg = dataclasses.replace(cfg, threads=threads)  # the count used is what is recorded
    torch.set_num_threads(threads)
    device = distributed.init_distributed(env, _device_type(cfg), cfg.dist_backend)
    make_deterministic(device)
    try:
        return _train(cfg, env, device, progress)
    finally:
        distributed.cleanup()


def _train(
    cfg: TrainConfig, env: distributed.DistEnv, device: torch.device, progress: bool
) -> Path | None:
    run = start(cfg, env, device, progress)
    run.model.train()
    done = run.step >= run.total
    if not run.resumed:
        run.sampler.set_epoch(0)  # SortaGrad's epoch, from its first batch
        if cfg.eval_at_start:
            evaluate(run)
    out_of_time = False
    while not done and not out_of_time and run.epoch < cfg.epochs:
        for batch in run.loader:
            loss, grad_norm = train_step(run, batch)
            log_step(run, batch, loss, grad_norm)
            done = run.step == run.total
            out_of_time = not done and run.step % cfg.checkpoint_every == 0 and _out_of_time(run)
            if (cfg.eval_every and run.step % cfg.eval_every == 0) or done or out_of_time:
                evaluate(run)
            if run.step % cfg.checkpoint_every == 0 or done:
                save(run)
            if done or out_of_time:
                break
        else:  # the epoch ran out before the last step
            run.epoch += 1
            run.sampler.set_epoch(run.epoch)
            # eval_every 0: evaluate once an epoch, never twice at one step.
            if not cfg.eval_every and run.evaluated_at != run.step:
                evaluate(run)
            save(run)
    if run.bar is not None:
        run.bar.close()
    if out_of_time and run.main:
        print(
            f"max_minutes={cfg.max_minutes} reached: stopped at step {run.step} of {run.total}"
            f" with a checkpoint in {run.ckpt_path}; run again to resume",
            file=sys.stderr,
        )
    return run.ckpt_path if run.main else None


def _out_of_time(run: Run) -> bool:
    """Whether the wall-clock budget is spent, as rank 0 sees it (every rank stops at
    the same step: one all-reduce, at checkpoints only)."""
    if not run.cfg.max_minutes:
        return False
    spent = time.perf_counter() - run.started >= 60.0 * run.cfg.max_minutes
    flag = torch.tensor([float(spent and run.main)], device=run.device)
    return bool(distributed.all_reduce_mean(flag).item() > 0)


def config_summary(cfg: TrainConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True)
