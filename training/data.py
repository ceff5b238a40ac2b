"""Training data: manifests checked before training, length-bucketed batches, padded tensors.

A manifest is JSON lines, `{"audio_filepath": ..., "duration": s, "text": ...}` (the
NeMo convention); relative audio paths are relative to the manifest's directory.
`read_manifest` checks every line before the first step, so a bad file fails the
run in seconds rather than hours in: each problem names the manifest, the line and
the audio file. `bad_input="stop"` refuses such a manifest; `"skip"` drops and counts
the bad lines. Duration filtering (`min_duration`, `max_duration`) is policy, not an
error: those lines are skipped and counted in either mode.

Batches (`BucketBatchSampler`): utterances sorted by duration are cut into batches
whose padded size (longest duration x count) stays within `batch_seconds`. Epoch 0
walks the steps shortest first (SortaGrad); later epochs shuffle the step order with
a generator seeded from (seed, epoch) alone. How a step's batch meets the ranks is
`batch_per`:

- "rank" (weak scaling): the limits bound each rank's batch; groups of `world_size`
  neighbouring batches form one optimizer step, rank r taking the r-th batch of
  each, so ranks in a step pad to similar lengths. When the batch count is not a
  multiple of world_size, the shortest batches are repeated to fill the last step:
  every rank gets the same number of batches (no rank waits forever at an
  all-reduce), every utterance is seen once per epoch and at most world_size-1
  batches twice.
- "step" (strong scaling): the limits bound the step's whole batch, cut as for one
  rank, and rank r takes its utterances r, r + world_size, ... (sorted by duration,
  so the shares pad alike). Training pads every share to the longest and shares the
  batch norms' statistics (`train_step`), so any number of ranks computes the step
  one rank would, up to the order of its sums. A batch of fewer utterances than
  ranks (the longest ones, when batch_seconds holds few) joins its neighbour.

A file that stops decoding after the check (changed on disk) does not end an
epoch: the dataset logs it, counts it and substitutes the nearest utterance by
duration that does decode; `BatchLoader.substituted` counts those rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from echoic.model.core.audio import AudioError, audio_duration, load_audio
from echoic.model.core.features import FeatureConfig, compute_features
from echoic.model.core.text import TextError, Vocabulary
from echoic.training.augment import AugmentConfig, Augmenter

log = logging.getLogger(__name__)

# Why a line was skipped; "bad input" reasons obey DataConfig.bad_input.
BAD_INPUT_REASONS = (
    "malformed_json",
    "missing_key",
    "bad_value",
    "missing_file",
    "empty_file",
    "undecodable",
    "out_of_vocabulary",
)
FILTER_REASONS = ("too_long", "too_short")
SHOWN_PROBLEMS = 5  # problems quoted in a ManifestError
KEPT_MESSAGES = 100  # problem messages a ManifestReport keeps (the counts are complete)


@dataclass(frozen=True)
class DataConfig:
    train_manifest: str = ""  # JSON-lines manifest path
    val_manifest: str = ""  # JSON-lines manifest path; "" = no validation set
    max_duration: float = 20.0  # s, longer utterances are skipped (counted)
    min_duration: float = 0.1  # s, shorter utterances are skipped (counted)
    duration_tolerance: float = 0.1  # fraction; beyond it the audio header's duration wins
    batch_seconds: float = 160.0  # s, padded audio per batch (longest x count), see batch_per
    max_batch: int = 32  # utterances per batch, see batch_per
    batch_per: Literal["rank", "step"] = "rank"  # what batch_seconds and max_batch bound:
    # "rank": each rank's own batch (more ranks, a bigger step); "step": the whole step's
    # batch, dealt to the ranks (more ranks, the same step: one rank's weights, dropout 0)
    sortagrad: bool = True  # first epoch in order of increasing length
    bad_input: Literal["skip", "stop"] = "stop"  # what to do with an unusable manifest line
    num_workers: int = 0  # data loader worker processes; 0 = load in the training process
    augment: AugmentConfig = field(default_factory=AugmentConfig)  # training only (augment.py)

    def __post_init__(self) -> None:
        if not 0 <= self.min_duration < self.max_duration:
            raise ValueError(
                f"need 0 <= min_duration < max_duration, got {self.min_duration}"
                f" and {self.max_duration}"
            )
        if self.batch_seconds <= 0 or self.max_batch < 1:
            raise ValueError("batch_seconds must be positive and max_batch at least 1")
        if self.batch_per not in ("rank", "step"):
            raise ValueError(f"batch_per must be 'rank' or 'step', got {self.batch_per!r}")
        if self.duration_tolerance < 0 or self.num_workers < 0:
            raise ValueError("duration_tolerance and num_workers must not be negative")


class ManifestError(ValueError):
    """A manifest that cannot be trained on; the message names the file and lines."""


@dataclass(frozen=True)
class Utterance:
    path: str  # audio file, resolved against the manifest's directory
    duration: float  # s, used for bucketing (the header's when the manifest is off)
    text: str  # transcript as written in the manifest
    tokens: tuple[int, ...]  # vocabulary ids of the normalised transcript
    line: int  # line number in the manifest, from 1


@dataclass
class ManifestReport:
    """What `read_manifest` kept, skipped (by reason) and corrected."""

    manifest: str  # manifest path
    lines: int = 0  # non-blank lines read
    kept: int = 0  # utterances kept
    seconds: float = 0.0  # s, audio kept
    skipped: Counter[str] = field(default_factory=Counter)  # lines skipped, by reason
    problems: list[str] = field(default_factory=list)  # first KEPT_MESSAGES skip messages
    duration_fixes: int = 0  # kept lines whose duration came from the audio header
    notes: list[str] = field(default_factory=list)  # first KEPT_MESSAGES fix messages

    def summary(self) -> str:
        """One line, e.g. `train.jsonl: kept 980 of 1000 (2.7 h); skipped 20: 20 too_long`."""
        text = f"{self.manifest}: kept {self.kept} of {self.lines} ({self.seconds / 3600:.2f} h)"
        if self.skipped:
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items()))
            text += f"; skipped {sum(self.skipped.values())}: {reasons}"
        if self.duration_fixes:
            text += f"; {self.duration_fixes} durations taken from the audio header"
        return text


class _BadLine(Exception):
    def __init__(self, reason: str, detail: str, audio: str = "") -> None:
        super().__init__(detail)
        self.reason, self.detail, self.audio = reason, detail, audio


def _field(record: dict[str, Any], key: str, kind: type | tuple[type, ...], audio: str) -> Any:
    if key not in record:
        raise _BadLine("missing_key", f"missing key {key!r}", audio)
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _BadLine("bad_value", f"{key} has the wrong type: {value!r}", audio)
    return value


def _parse_line(
    line: str, number: int, base: Path, vocab: Vocabulary, cfg: DataConfig, check_audio: bool
) -> tuple[Utterance, str]:
    """The utterance on one manifest line and a note when its duration was corrected."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadLine("malformed_json", f"malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise _BadLine("malformed_json", "malformed JSON (a line must be one JSON object)")
    raw_path = record.get("audio_filepath")
    shown = raw_path if isinstance(raw_path, str) else ""
    audio = _field(record, "audio_filepath", str, shown)
    if not audio:
        raise _BadLine("bad_value", "audio_filepath is empty")
    path = os.path.normpath(base / audio)
    duration = float(_field(record, "duration", (int, float), path))
    text = _field(record, "text", str, path)
    if not (math.isfinite(duration) and duration >= 0):
        raise _BadLine("bad_value", f"duration must be a non-negative number, got {duration}", path)
    note = ""
    if check_audio:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise _BadLine("missing_file", "no such audio file", path) from None
        except OSError as e:
            raise _BadLine("missing_file", f"cannot read ({e.strerror})", path) from None
        if size == 0:
            raise _BadLine("empty_file", "the audio file is empty (0 bytes)", path)
        try:
            header = audio_duration(path)
        except AudioError as e:
            reason = str(e).removeprefix(f"{path}: ")
            raise _BadLine("undecodable", f"undecodable audio: {reason}", path) from None
        if header <= 0:
            raise _BadLine("empty_file", "the audio has no samples", path)
        if abs(duration - header) > cfg.duration_tolerance * header:
            note = f"manifest says {duration:.3f} s, the header {header:.3f} s: using the header"
            duration = header
    try:
        tokens = tuple(vocab.encode(text))
    except TextError as e:
        raise _BadLine("out_of_vocabulary", str(e), path) from None
    if duration > cfg.max_duration:
        raise _BadLine("too_long", f"{duration:.2f} s > max_duration {cfg.max_duration} s", path)
    if duration < cfg.min_duration:
        raise _BadLine("too_short", f"{duration:.2f} s < min_duration {cfg.min_duration} s", path)
    return Utterance(path, duration, text, tokens, number), note


def read_manifest(
    path: str | os.PathLike[str], vocab: Vocabulary, cfg: DataConfig, check_audio: bool = True
) -> tuple[list[Utterance], ManifestReport]:
    """Parse and check a JSON-lines manifest; see the module docstring for the policy.

    check_audio=False trusts the manifest (no file is opened): for manifests already
    checked, on storage where a stat per file is slow.
    """
    manifest = Path(path)
    try:
        content = manifest.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ManifestError(f"{manifest}: no such manifest file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"{manifest}: cannot read the manifest ({e})") from None
    report = ManifestReport(str(manifest))
    utterances: list[Utterance] = []
    bad: list[str] = []  # the first SHOWN_PROBLEMS unusable lines
    bad_count = 0
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        report.lines += 1
        try:
            utt, note = _parse_line(line, number, manifest.parent, vocab, cfg, check_audio)
        except _BadLine as e:
            message = f"{manifest}:{number}: {e.audio or '-'}: {e.detail}"
            report.skipped[e.reason] += 1
            if len(report.problems) < KEPT_MESSAGES:
                report.problems.append(message)
            if e.reason in BAD_INPUT_REASONS:
                bad_count += 1
                if len(bad) < SHOWN_PROBLEMS:
                    bad.append(message)
            continue
        if note:
            report.duration_fixes += 1
            if len(report.notes) < KEPT_MESSAGES:
                report.notes.append(f"{manifest}:{number}: {utt.path}: {note}")
        utterances.append(utt)
        report.kept += 1
        report.seconds += utt.duration
    if bad_count and cfg.bad_input == "stop":
        more = f"\n  ... and {bad_count - len(bad)} more" if bad_count > len(bad) else ""
        raise ManifestError(
            f"{manifest}: {bad_count} unusable line(s); fix them or set data.bad_input=skip:"
            + "".join(f"\n  {m}" for m in bad)
            + more
        )
    if not utterances:
        raise ManifestError(f"no usable utterances: {report.summary()}")
    return utterances, report


class Example(NamedTuple):
    features: np.ndarray  # (T, F) float32
    tokens: np.ndarray  # (L,) int64 vocabulary ids
    index: int  # utterance actually loaded
    substituted: bool  # True when the requested utterance failed to load


class SpeechDataset(Dataset):
    """Utterances -> (features, token ids), decoding at the feature config's sample rate.

    An utterance whose audio no longer decodes is replaced by the nearest one in
    duration order that does (next longer, next shorter, then further out, up to
    `max_substitutes` tries), so an epoch keeps its length and batches their shape.
    `failures` counts paths in this process only; with worker processes, read
    `BatchLoader.substituted` instead.
    """

    def __init__(
        self,
        utterances: Sequence[Utterance],
        features: FeatureConfig,
        max_substitutes: int = 8,
        augment: AugmentConfig | None = None,
        seed: int = 0,
    ) -> None:
        self.utterances = list(utterances)
        self.features = features
        self.max_substitutes = max_substitutes
        self.epoch = 0  # set by BatchLoader before each epoch: augmentation draws from it
        self.augmenter = (
            Augmenter(augment, seed, features.sample_rate, self._babble_talker)
            if augment is not None and augment.active
            else None
        )
        durations = np.array([u.duration for u in self.utterances], dtype=np.float64)
        self._by_duration = np.argsort(durations, kind="stable")
        self._position = np.empty_like(self._by_duration)
        self._position[self._by_duration] = np.arange(len(durations))
        self.failures: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.utterances)

    def _candidates(self, index: int) -> Iterator[int]:
        yield index
        pos, n = int(self._position[index]), len(self.utterances)
        for step in range(1, self.max_substitutes + 1):
            for neighbour in (pos + step, pos - step):
                if 0 <= neighbour < n:
                    yield int(self._by_duration[neighbour])

    def __getitem__(self, index: int) -> Example:
        for candidate in self._candidates(index):
            utt = self.utterances[candidate]
            try:
                samples = load_audio(utt.path, self.features.sample_rate)
            except AudioError as e:
                self.failures[utt.path] += 1
                if self.failures[utt.path] == 1:
                    log.warning("line %d: %s; substituting a neighbour by duration", utt.line, e)
                continue
            if self.augmenter is not None:
                samples = self.augmenter.waveform(samples, self.epoch, candidate)
            features = compute_features(samples, self.features)  # (T, F)
            if self.augmenter is not None:
                features = self.augmenter.features(features, self.epoch, candidate)
            tokens = np.asarray(utt.tokens, dtype=np.int64)
            return Example(features, tokens, candidate, candidate != index)
        raise ManifestError(
            f"{self.utterances[index].path} and its {self.max_substitutes * 2} nearest"
            " neighbours by duration all fail to load; is the data still there?"
        )

    def _babble_talker(self, rng: np.random.Generator) -> np.ndarray:
        """Another utterance's samples, for babble noise; empty when it does not load."""
        other = self.utterances[int(rng.integers(len(self.utterances)))]
        try:
            return load_audio(other.path, self.features.sample_rate)
        except AudioError:
            return np.zeros(0, np.float32)


class Batch(NamedTuple):
    features: torch.Tensor  # (B, T, F) float32, zero-padded after each utterance's end
    feature_lengths: torch.Tensor  # (B,) int64, frames
    targets: torch.Tensor  # (sum of target_lengths,) int64, all targets concatenated
    target_lengths: torch.Tensor  # (B,) int64, tokens


def collate(examples: Sequence[Example]) -> Batch:
    """Pad features to the longest in the batch; concatenate targets (torch CTC layout)."""
    lengths = [e.features.shape[0] for e in examples]
    num_features = examples[0].features.shape[1]
    features = torch.zeros(len(examples), max(lengths), num_features, dtype=torch.float32)
    for row, example in enumerate(examples):
        features[row, : lengths[row]] = torch.from_numpy(example.features)
    return Batch(
        features=features,
        feature_lengths=torch.tensor(lengths, dtype=torch.int64),
        targets=torch.from_numpy(np.concatenate([e.tokens for e in examples])),
        target_lengths=torch.tensor([len(e.tokens) for e in examples], dtype=torch.int64),
    )


def _collate_with_sources(examples: Sequence[Example]) -> tuple[Batch, list[int], list[bool]]:
    """The batch plus which utterances were loaded and which stood in for a bad file."""
    return collate(examples), [e.index for e in examples], [e.substituted for e in examples]


def _bucket(
    durations: np.ndarray, batch_seconds: float, max_batch: int, least: int = 1
) -> list[list[int]]:
    """Cut the duration-sorted utterances into batches with longest x count <= batch_seconds,
    each of at least `least` utterances where there are that many (a batch the limits
    would end sooner takes more; a short last one joins the one before)."""
    batches: list[list[int]] = []
    current: list[int] = []
    for index in np.argsort(durations, kind="stable").tolist():
        padded = (len(current) + 1) * durations[index]  # sorted: this one is the longest
        full = padded > batch_seconds or len(current) >= max_batch
        if len(current) >= least and full:
            batches.append(current)
            current = []
        current.append(index)
    if len(current) < least and batches:
        batches[-1] += current
    else:
        batches.append(current)
    return batches


class BucketBatchSampler(Sampler[list[int]]):
    """Length-bucketed batches for one rank; see the module docstring for the scheme.

    The same durations, config, seed and world size give the same batches in the
    same order on any machine. shuffle=False keeps every epoch in increasing length
    (for validation). state_dict() holds the epoch and the batches of it handed out
    so far (BatchLoader keeps that exact when workers prefetch); iteration after
    load_state_dict() resumes at the next one.
    """

    def __init__(
        self,
        durations: Sequence[float],
        cfg: DataConfig,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if not durations:
            raise ValueError("no utterances to batch")
        if seed < 0 or not 0 <= rank < world_size:
            raise ValueError(f"need seed >= 0 and 0 <= rank < world_size, got {seed}, {rank}")
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.sortagrad, self.shuffle = cfg.sortagrad, shuffle
        self.split = cfg.batch_per == "step"  # a batch a step, dealt to the ranks
        if self.split and len(durations) < world_size:
            raise ValueError(
                f"{len(durations)} utterance(s) cannot be dealt to {world_size} ranks"
                ' (batch_per = "step" gives every rank a share of each batch)'
            )
        durations = np.asarray(durations, dtype=np.float64)
        if self.split:
            self.batches = _bucket(durations, cfg.batch_seconds, cfg.max_batch, world_size)
            self.num_steps = len(self.batches)
        else:
            batches = _bucket(durations, cfg.batch_seconds, cfg.max_batch)
            self.num_steps = -(-len(batches) // world_size)
            padding = self.num_steps * world_size - len(batches)
            self.batches = batches + [batches[i % len(batches)] for i in range(padding)]
        flat = np.array([i for batch in self.batches for i in batch + [-1]], dtype=np.int64)
        self.digest = hashlib.sha256(flat.tobytes()).hexdigest()[:16]
        self.epoch = 0
        self.consumed = 0  # batches of this epoch handed out by the iterator

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch."""
        self.epoch, self.consumed = epoch, 0

    def step_order(self, epoch: int) -> list[int]:
        """The order of the optimizer steps in `epoch` (shared by all ranks)."""
        if not self.shuffle or (epoch == 0 and self.sortagrad):
            return list(range(self.num_steps))
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(self.num_steps).tolist()

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of `epoch`, in order."""
        if self.split:
            return [self.batches[s][self.rank :: self.world_size] for s in self.step_order(epoch)]
        return [self.batches[s * self.world_size + self.rank] for s in self.step_order(epoch)]

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches(self.epoch)
        # A local cursor: BatchLoader may set self.consumed back to what it delivered.
        for position in range(self.consumed, len(batches)):
            self.consumed = position + 1
            yield list(batches[position])

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "world_size": self.world_size,
            "digest": self.digest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "world_size", "digest"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"cannot resume the data position exactly: {key} was {state[key]!r} when"
                    f" saved and is {mine[key]!r} now (same manifest, config, seed and world"
                    " size needed)"
                )
        if not 0 <= state["consumed"] <= self.num_steps:
            raise ValueError(f"saved position {state['consumed']} is outside the epoch")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def _worker_context() -> multiprocessing.context.BaseContext:
    """Loader workers start from a fork server, never by forking the training process.

    A process forked while other threads run inherits their locks and native state
    mid-use: gRPC's (a child forked while a gRPC call was in flight died of a segfault),
    a collective's, CUDA's. The fork server is a fresh interpreter with this module
    imported, started once; each worker is forked from it and gets the pickled dataset
    (sent again each epoch: seconds a worker for a corpus of 280k utterances), sys.path
    and the main script, none of the trainer's threads or locks. The batches are the same
    bits either way: workers are seeded from the loader's generator, not from the fork.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


class BatchLoader:
    """A DataLoader over a SpeechDataset and a BucketBatchSampler; yields `Batch`.

    Worker processes prefetch, so the sampler's own count runs ahead of training;
    after each batch handed out, this loader sets the sampler's position to the
    batches actually delivered, so `sampler.state_dict()` is always the one to
    checkpoint. Worker RNGs are seeded from (seed, epoch, position).
    """

    def __init__(
        self,
        dataset: SpeechDataset,
        sampler: BucketBatchSampler,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.substituted = 0  # rows so far that stood in for a file that failed to load
        self.last_indices: list[int] = []  # utterances loaded for the last batch

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Batch]:
        sampler = self.sampler
        delivered = sampler.consumed
        self.dataset.epoch = sampler.epoch  # workers copy the dataset when the loader starts
        seed = np.random.SeedSequence([sampler.seed, sampler.epoch, delivered])
        loader = DataLoader(
            self.dataset,
            batch_sampler=sampler,
            collate_fn=_collate_with_sources,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(int(seed.generate_state(1)[0])),
            multiprocessing_context=_worker_context() if self.num_workers else None,
        )
        for batch, indices, substituted in loader:
            delivered += 1
            sampler.consumed = delivered
            self.last_indices = indices
            self.substituted += sum(substituted)
            yield batch


def make_loader(
    utterances: Sequence[Utterance],
    features: FeatureConfig,
    cfg: DataConfig,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    pin_memory: bool = False,
) -> tuple[BatchLoader, BucketBatchSampler]:
    """Dataset + sampler + collate for one rank, with `cfg.num_workers` loader processes.

    Drive epochs and checkpoints through the sampler (`set_epoch`, `state_dict`). A
    shuffled (training) loader applies `cfg.augment`; an unshuffled one never does.
    """
    augment = cfg.augment if shuffle else None
    dataset = SpeechDataset(utterances, features, augment=augment, seed=seed)
    durations = [u.duration for u in utterances]
    sampler = BucketBatchSampler(durations, cfg, seed, rank, world_size, shuffle)
    return BatchLoader(dataset, sampler, cfg.num_workers, pin_memory), sampler
