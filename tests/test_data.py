"""Manifests checked up front, the bucketing sampler, the dataset and its padded batches."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from echoic.model.core.configs import ConfigError, from_dict
from echoic.model.core.features import FeatureConfig, num_frames
from echoic.model.core.text import Vocabulary
from echoic.training.data import (
    BatchLoader,
    BucketBatchSampler,
    DataConfig,
    ManifestError,
    SpeechDataset,
    Utterance,
    collate,
    make_loader,
    read_manifest,
)

RATE = 16000  # Hz
VOCAB = Vocabulary()
FEATURES = FeatureConfig(sample_rate=RATE)
GOOD = {"audio_filepath": "audio/good.wav", "duration": 0.5, "text": "hello world"}


def _wav(path: Path, seconds: float, rate: int = RATE, seed: int = 0) -> Path:
    """A tone plus a little noise: real, decodable audio."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(round(seconds * rate)) / rate
    noise = np.random.default_rng(seed).normal(0, 0.01, t.shape)
    sf.write(path, (0.3 * np.sin(2 * np.pi * 440 * t) + noise).astype(np.float32), rate)
    return path


def _manifest(path: Path, lines: list[dict | str]) -> Path:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """tmp/data/ with audio/good.wav (0.5 s), long.wav (1.5 s), short.wav (0.05 s),
    empty.wav (0 bytes), headeronly.wav (0 frames) and garbage.wav (random bytes)."""
    audio = tmp_path / "data" / "audio"
    _wav(audio / "good.wav", 0.5)
    _wav(audio / "long.wav", 1.5)
    _wav(audio / "short.wav", 0.05)
    (audio / "empty.wav").write_bytes(b"")
    sf.write(audio / "headeronly.wav", np.zeros(0, dtype=np.float32), RATE)
    (audio / "garbage.wav").write_bytes(np.random.default_rng(1).bytes(3000))
    return tmp_path / "data"


def _cfg(**changes: object) -> DataConfig:
    return from_dict(DataConfig, {"max_duration": 1.0, "min_duration": 0.1, **changes})


def test_read_manifest_resolves_paths_against_the_manifest_directory(
    corpus: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _wav(corpus / "other" / "b.wav", 0.3)
    manifest = _manifest(
        corpus / "train.jsonl",
        [GOOD, "", {"audio_filepath": "other/b.wav", "duration": 0.3, "text": "It's 2 AM"}],
    )
    monkeypatch.chdir(tmp_path)  # not the manifest's directory
    utts, report = read_manifest(manifest, VOCAB, _cfg())
    assert [(Path(u.path), u.line) for u in utts] == [
        (corpus / "audio" / "good.wav", 1),
        (corpus / "other" / "b.wav", 3),
    ]
    assert utts[1].tokens == tuple(VOCAB.encode("It's 2 AM"))
    assert utts[1].text == "It's 2 AM"
    assert (report.lines, report.kept, dict(report.skipped)) == (2, 2, {})
    assert report.summary().startswith(f"{manifest}: kept 2 of 2")


BAD_LINES = [
    pytest.param(
        {"audio_filepath": "audio/nope.wav", "duration": 0.5, "text": "a"},
        "missing_file",
        "audio/nope.wav",
        id="missing-file",
    ),
    pytest.param(
        {"audio_filepath": "audio/empty.wav", "duration": 0.5, "text": "a"},
        "empty_file",
        "audio/empty.wav",
        id="empty-file",
    ),
    pytest.param(
        {"audio_filepath": "audio/headeronly.wav", "duration": 0.5, "text": "a"},
        "empty_file",
        "audio/headeronly.wav",
        id="no-frames",
    ),
    pytest.param(
        {"audio_filepath": "audio/garbage.wav", "duration": 0.5, "text": "a"},
        "undecodable",
        "audio/garbage.wav",
        id="garbage-bytes",
    ),
    pytest.param(
        {"audio_filepath": "audio/good.wav", "duration": 0.5, "text": "καλημέρα"},
        "out_of_vocabulary",
        "audio/good.wav",
        id="out-of-vocabulary",
    ),
    pytest.param('{"audio_filepath": "audio/good.wav", ', "malformed_json", "", id="malformed"),
    pytest.param('["audio/good.wav", 0.5, "a"]', "malformed_json", "", id="not-an-object"),
    pytest.param(
        {"audio_filepath": "audio/good.wav", "duration": 0.5},
        "missing_key",
        "audio/good.wav",
        id="missing-key",
    ),
    pytest.param(
        {"audio_filepath": "audio/good.wav", "duration": "0.5", "text": "a"},
        "bad_value",
        "audio/good.wav",
        id="duration-not-a-number",
    ),
]

FILTERED_LINES = [
    pytest.param(
        {"audio_filepath": "audio/long.wav", "duration": 1.5, "text": "a"},
        "too_long",
        "audio/long.wav",
        id="too-long",
    ),
    pytest.param(
        {"audio_filepath": "audio/short.wav", "duration": 0.05, "text": "a"},
        "too_short",
        "audio/short.wav",
        id="too-short",
    ),
]


@pytest.mark.parametrize(("line", "reason", "audio"), BAD_LINES + FILTERED_LINES)
def test_skip_mode_counts_bad_lines_by_reason(
    corpus: Path, line: dict | str, reason: str, audio: str
) -> None:
    manifest = _manifest(corpus / "train.jsonl", [GOOD, line])
    utts, report = read_manifest(manifest, VOCAB, _cfg(bad_input="skip"))
    assert [u.line for u in utts] == [1]
    assert dict(report.skipped) == {reason: 1}
    assert report.problems[0].startswith(f"{manifest}:2: ")
    if audio:
        assert str(corpus / audio) in report.problems[0]
    assert f"skipped 1: 1 {reason}" in report.summary()


@pytest.mark.parametrize(("line", "reason", "audio"), BAD_LINES)
def test_stop_mode_names_file_and_line(
    corpus: Path, line: dict | str, reason: str, audio: str
) -> None:
    manifest = _manifest(corpus / "train.jsonl", [GOOD, line])
    with pytest.raises(ManifestError, match="1 unusable line") as err:
        read_manifest(manifest, VOCAB, _cfg(bad_input="stop"))
    assert f"{manifest}:2: " in str(err.value)
    if audio:
        assert str(corpus / audio) in str(err.value)


@pytest.mark.parametrize(("line", "reason", "audio"), FILTERED_LINES)
def test_stop_mode_still_filters_by_duration(
    corpus: Path, line: dict | str, reason: str, audio: str
) -> None:
    manifest = _manifest(corpus / "train.jsonl", [GOOD, line])
    utts, report = read_manifest(manifest, VOCAB, _cfg(bad_input="stop"))
    assert len(utts) == 1
    assert dict(report.skipped) == {reason: 1}


def test_stop_mode_counts_all_problems_and_shows_the_first(corpus: Path) -> None:
    missing = {"audio_filepath": "audio/nope.wav", "duration": 0.5, "text": "a"}
    manifest = _manifest(corpus / "train.jsonl", [GOOD] + [missing] * 7)
    with pytest.raises(ManifestError, match="7 unusable line") as err:
        read_manifest(manifest, VOCAB, _cfg())
    assert f"{manifest}:6: " in str(err.value)
    assert f"{manifest}:7: " not in str(err.value)
    assert "and 2 more" in str(err.value)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(None, id="nothing-usable"),
        pytest.param("absent.jsonl", id="no-manifest"),
    ],
)
def test_no_usable_manifest_is_an_error(corpus: Path, path: str | None) -> None:
    missing = {"audio_filepath": "audio/nope.wav", "duration": 0.5, "text": "a"}
    manifest = _manifest(corpus / "train.jsonl", [missing, missing])
    with pytest.raises(ManifestError, match="no usable|no such manifest"):
        read_manifest(corpus / path if path else manifest, VOCAB, _cfg(bad_input="skip"))


@pytest.mark.parametrize(
    ("claimed", "used", "fixes"),
    [
        pytest.param(0.52, 0.52, 0, id="within-tolerance-keeps-manifest"),
        pytest.param(0.9, 0.5, 1, id="header-wins"),
        pytest.param(5.0, 0.5, 1, id="header-wins-before-duration-filter"),
    ],
)
def test_audio_header_is_the_truth_when_far_off(
    corpus: Path, claimed: float, used: float, fixes: int
) -> None:
    line = {**GOOD, "duration": claimed}
    utts, report = read_manifest(_manifest(corpus / "m.jsonl", [line]), VOCAB, _cfg())
    assert utts[0].duration == pytest.approx(used)
    assert report.duration_fixes == fixes
    assert len(report.notes) == fixes


def test_check_audio_false_trusts_the_manifest(corpus: Path) -> None:
    line = {"audio_filepath": "audio/nope.wav", "duration": 0.5, "text": "a"}
    utts, _ = read_manifest(_manifest(corpus / "m.jsonl", [line]), VOCAB, _cfg(), False)
    assert utts[0].path == str(corpus / "audio" / "nope.wav")


@pytest.mark.parametrize(
    "data",
    [
        pytest.param({"batch_size": 3}, id="unknown-key"),
        pytest.param({"bad_input": "ignore"}, id="bad-choice"),
        pytest.param({"min_duration": 5.0, "max_duration": 1.0}, id="empty-range"),
    ],
)
def test_data_config_rejects_bad_values(data: dict) -> None:
    with pytest.raises(ConfigError):
        from_dict(DataConfig, data)


# ---- dataset and collate -------------------------------------------------------


def _utterances(corpus: Path, seconds: list[float]) -> list[Utterance]:
    lines = []
    for i, s in enumerate(seconds):
        _wav(corpus / "u" / f"{i}.wav", s, seed=i)
        lines.append({"audio_filepath": f"u/{i}.wav", "duration": s, "text": "ab " * (i + 1)})
    utts, _ = read_manifest(_manifest(corpus / "u.jsonl", lines), VOCAB, _cfg())
    return utts


def test_collate_pads_features_and_concatenates_targets(corpus: Path) -> None:
    utts = _utterances(corpus, [0.3, 0.5, 0.2])
    dataset = SpeechDataset(utts, FEATURES)
    batch = collate([dataset[i] for i in range(3)])
    frames = [num_frames(round(s * RATE), FEATURES) for s in (0.3, 0.5, 0.2)]
    assert batch.features.shape == (3, max(frames), FEATURES.num_features)
    assert batch.features.dtype == torch.float32
    assert batch.feature_lengths.tolist() == frames
    assert batch.feature_lengths.dtype == batch.target_lengths.dtype == torch.int64
    assert batch.target_lengths.tolist() == [len(u.tokens) for u in utts]
    assert batch.targets.tolist() == [t for u in utts for t in u.tokens]
    assert batch.targets.dtype == torch.int64
    assert torch.all(batch.features[2, frames[2] :] == 0)
    assert torch.equal(batch.features[1], torch.from_numpy(dataset[1].features))


def test_file_broken_after_the_check_is_replaced_by_its_duration_neighbour(
    corpus: Path,
) -> None:
    utts = _utterances(corpus, [0.3, 0.5, 0.2, 0.4])
    Path(utts[0].path).write_bytes(b"not audio any more")
    dataset = SpeechDataset(utts, FEATURES)
    first, again = dataset[0], dataset[0]
    # Duration order is 0.2 (2), 0.3 (0), 0.4 (3), 0.5 (1): next longer is utterance 3.
    assert (first.index, first.substituted) == (3, True)
    assert np.array_equal(first.features, again.features)
    assert dataset.failures == Counter({utts[0].path: 2})
    assert dataset[1].substituted is False


# ---- the sampler ------------------------------------------------------------------

DURATIONS = [round(0.5 + (i * 7919 % 97) / 10, 1) for i in range(53)]  # 0.5 .. 10.1 s
SAMPLER_CFG = DataConfig(batch_seconds=30.0, max_batch=5)


def _epoch(sampler: BucketBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_sortagrad_epoch_is_in_increasing_length_within_the_budget() -> None:
    sampler = BucketBatchSampler(DURATIONS, SAMPLER_CFG, seed=1)
    batches = _epoch(sampler, 0)
    flat = [DURATIONS[i] for b in batches for i in b]
    assert flat == sorted(DURATIONS)
    for batch in batches:
        assert len(batch) <= SAMPLER_CFG.max_batch
        assert len(batch) == 1 or len(batch) * max(DURATIONS[i] for i in batch) <= 30.0
    assert sorted(i for b in batches for i in b) == list(range(len(DURATIONS)))


def test_later_epochs_shuffle_reproducibly() -> None:
    one, two = (BucketBatchSampler(DURATIONS, SAMPLER_CFG, seed=1) for _ in range(2))
    assert _epoch(one, 1) == _epoch(two, 1)
    assert _epoch(one, 1) != _epoch(one, 2)
    assert _epoch(one, 1) != _epoch(BucketBatchSampler(DURATIONS, SAMPLER_CFG, seed=2), 1)
    assert sorted(map(sorted, _epoch(one, 1))) == sorted(map(sorted, _epoch(one, 0)))
    unsorted = BucketBatchSampler(
        DURATIONS, DataConfig(batch_seconds=30.0, max_batch=5, sortagrad=False), 1
    )
    assert _epoch(unsorted, 0) != _epoch(BucketBatchSampler(DURATIONS, SAMPLER_CFG, 1), 0)


@pytest.mark.parametrize("world_size", [pytest.param(w, id=f"world-{w}") for w in (2, 3, 4)])
@pytest.mark.parametrize("epoch", [pytest.param(0, id="sortagrad"), pytest.param(3, id="shuffled")])
def test_ranks_get_equal_counts_and_disjoint_batches(world_size: int, epoch: int) -> None:
    samplers = [
        BucketBatchSampler(DURATIONS, SAMPLER_CFG, seed=7, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    per_rank = [_epoch(s, epoch) for s in samplers]
    assert len({len(batches) for batches in per_rank}) == 1
    assert all(len(batches) == len(s) for batches, s in zip(per_rank, samplers, strict=True))
    # Every utterance once, plus the documented padding: the shortest batches again.
    global_batches = len(_epoch(BucketBatchSampler(DURATIONS, SAMPLER_CFG, seed=7), 0))
    padding = len(samplers[0].batches) - global_batches
    assert 0 <= padding < world_size
    seen = Counter(i for batches in per_rank for b in batches for i in b)
    repeated = Counter(i for b in samplers[0].batches[:padding] for i in b)
    assert seen == Counter(range(len(DURATIONS))) + repeated


@pytest.mark.parametrize("world_size", [pytest.param(w, id=f"world-{w}") for w in (2, 3, 4)])
@pytest.mark.parametrize("epoch", [pytest.param(0, id="sortagrad"), pytest.param(3, id="shuffled")])
def test_batch_per_step_deals_one_ranks_batches_to_the_ranks(world_size: int, epoch: int) -> None:
    """batch_per = "step": the steps are one rank's batches (where each holds a share for
    every rank), in one rank's order, each dealt to the ranks in turn (so the shares pad
    alike); every utterance once, none twice."""
    cfg = DataConfig(batch_seconds=30.0, max_batch=5, batch_per="step")
    samplers = [
        BucketBatchSampler(DURATIONS, cfg, seed=7, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    ranks = [_epoch(s, epoch) for s in samplers]
    order = samplers[0].step_order(epoch)
    batches = samplers[0].batches
    assert [b for s in samplers[1:] for b in s.batches] == batches * (world_size - 1)
    for step, shares in enumerate(zip(*ranks, strict=True)):
        assert list(shares) == [batches[order[step]][r::world_size] for r in range(world_size)]
    one = BucketBatchSampler(DURATIONS, SAMPLER_CFG, seed=7)
    if min(map(len, one.batches)) >= world_size:  # 2 and 3; 4 merges the longest
        assert batches == one.batches and order == one.step_order(epoch)
    assert min(map(len, batches)) >= world_size
    seen = Counter(i for shares in ranks for b in shares for i in b)
    assert seen == Counter(range(len(DURATIONS)))


def test_batch_per_step_gives_every_rank_a_share_of_every_batch() -> None:
    """A batch the limits end with fewer utterances than ranks takes more, and a short last
    one joins the one before: no rank is ever handed an empty share."""
    durations = [1.0] * 6 + [20.0, 25.0, 30.0]  # the last three fill 30 s alone
    cfg = DataConfig(batch_seconds=30.0, max_batch=4, batch_per="step")
    shares = [
        _epoch(BucketBatchSampler(durations, cfg, 0, rank=r, world_size=2), 0) for r in (0, 1)
    ]
    # [6] would end alone (20 + 25 > 30 s) and takes 7; [8] is left over and joins them.
    assert shares == [[[0, 2], [4], [6, 8]], [[1, 3], [5], [7]]]
    one_rank = _epoch(BucketBatchSampler(durations, cfg, 0), 0)
    assert one_rank == [[0, 1, 2, 3], [4, 5], [6], [7], [8]]  # one rank: as the limits cut
    with pytest.raises(ValueError, match="cannot be dealt to 4 ranks"):
        BucketBatchSampler(durations[:3], cfg, 0, rank=0, world_size=4)


def test_batch_per_must_be_rank_or_step() -> None:
    with pytest.raises(ValueError, match="batch_per must be 'rank' or 'step'"):
        DataConfig(batch_per="node")  # type: ignore[arg-type]


def test_resume_mid_epoch_yields_exactly_the_remaining_batches() -> None:
    sampler = BucketBatchSampler(DURATIONS, SAMPLER_CFG, seed=3, rank=1, world_size=2)
    sampler.set_epoch(2)
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(3)]
    state = sampler.state_dict()
    rest = list(iterator)
    resumed = BucketBatchSampler(DURATIONS, SAMPLER_CFG, seed=3, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert (state["epoch"], state["consumed"]) == (2, 3)
    assert list(resumed) == rest
    assert taken + rest == _epoch(resumed, 2)


@pytest.mark.parametrize(
    ("seed", "world_size", "durations"),
    [
        pytest.param(4, 2, DURATIONS, id="other-seed"),
        pytest.param(3, 1, DURATIONS, id="other-world-size"),
        pytest.param(3, 2, DURATIONS[:-1], id="other-data"),
    ],
)
def test_resume_refuses_a_different_setting(
    seed: int, world_size: int, durations: list[float]
) -> None:
    state = BucketBatchSampler(DURATIONS, SAMPLER_CFG, seed=3, world_size=2).state_dict()
    with pytest.raises(ValueError, match="cannot resume"):
        BucketBatchSampler(durations, SAMPLER_CFG, seed, world_size=world_size).load_state_dict(
            state
        )


# ---- the loader -------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_workers", [pytest.param(0, id="in-process"), pytest.param(1, id="one-worker")]
)
def test_loader_position_counts_delivered_batches_and_resumes(
    corpus: Path, num_workers: int
) -> None:
    utts = _utterances(corpus, [0.2, 0.3, 0.4, 0.5, 0.6])
    cfg = _cfg(batch_seconds=0.7, max_batch=2, num_workers=num_workers)
    loader, sampler = make_loader(utts, FEATURES, cfg, seed=5)
    sampler.set_epoch(1)
    everything = [batch.targets.tolist() for batch in loader]
    sampler.set_epoch(1)
    iterator = iter(loader)
    next(iterator)
    second = next(iterator)
    assert sampler.state_dict()["consumed"] == 2  # not what the worker prefetched
    assert second.targets.tolist() == everything[1]
    state = sampler.state_dict()
    del iterator

    resumed, resumed_sampler = make_loader(utts, FEATURES, cfg, seed=5)
    resumed_sampler.load_state_dict(state)
    assert [b.targets.tolist() for b in resumed] == everything[2:]
    assert len(resumed) == len(everything)


_HELD_IN_THE_TRAINER = threading.Lock()


class _LockTakingDataset(SpeechDataset):
    """Takes and gives back a lock for each utterance, as library code does inside."""

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        if not _HELD_IN_THE_TRAINER.acquire(timeout=5):
            raise RuntimeError("the worker inherited a lock held in the training process")
        _HELD_IN_THE_TRAINER.release()
        return super().__getitem__(index)


def test_loader_workers_inherit_no_lock_held_in_the_training_process(corpus: Path) -> None:
    """A worker forked from the trainer gets a copy of every lock held there at that
    moment, held by a thread it does not have (a gRPC call's, a collective's): it waits
    forever or crashes. Workers start from a clean process and only get the dataset."""
    utts = _utterances(corpus, [0.2, 0.3, 0.4])
    cfg = _cfg(batch_seconds=0.7, max_batch=2)
    sampler = BucketBatchSampler([u.duration for u in utts], cfg, seed=0)
    in_process = [
        b.targets.tolist() for b in BatchLoader(_LockTakingDataset(utts, FEATURES), sampler)
    ]
    sampler.set_epoch(0)
    with _HELD_IN_THE_TRAINER:
        loader = BatchLoader(_LockTakingDataset(utts, FEATURES), sampler, num_workers=2)
        assert [b.targets.tolist() for b in loader] == in_process


def test_loader_counts_substituted_rows(corpus: Path) -> None:
    utts = _utterances(corpus, [0.2, 0.3])
    Path(utts[1].path).write_bytes(b"")
    loader, _ = make_loader(utts, FEATURES, _cfg(), seed=0)
    (batch,) = list(loader)
    assert loader.substituted == 1
    assert sorted(loader.last_indices) == [0, 0]
    assert batch.feature_lengths.tolist()[0] == batch.feature_lengths.tolist()[1]
