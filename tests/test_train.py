"""Training end to end on a synthesized corpus: learning, determinism, exact resume, MPI.

Every run is a real `echoic train` process (the tiny recipe, CPU, gloo for MPI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import TINY_RECIPE
from tests.test_distributed import MPIRUN_ARGS

ECHOIC = [sys.executable, "-m", "echoic.cli.main"]


def _train_cmd(manifest: Path, out: Path, *overrides: str) -> list[str]:
    return [
        *ECHOIC, "train", "--config", str(TINY_RECIPE), "--no-progress",
        f"data.train_manifest={manifest}", f"out_dir={out}", "threads=1", *overrides,
    ]  # fmt: skip


def _train(
    manifest: Path, out: Path, *overrides: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    run = subprocess.run(
        _train_cmd(manifest, out, *overrides), capture_output=True, text=True, timeout=600,
        env={**os.environ, **env} if env else None,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of everything in a checkpoint: tensors, arrays, numbers, strings."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}.{i}")
    else:
        yield path, value


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (
            torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype
    return type(a) is type(b) and a == b


def _assert_same(a: Path, b: Path, may_differ: tuple[str, ...] = ()) -> None:
    """The two checkpoints are equal in everything: every tensor, the RNG states of every
    rank, sampler, schedule, step, configs; except paths starting with `may_differ`."""
    load = {"map_location": "cpu", "weights_only": False}
    la, lb = (dict(_leaves(torch.load(p, **load))) for p in (a, b))
    assert la.keys() == lb.keys(), f"checkpoints differ in what they hold: {la.keys() ^ lb.keys()}"
    compared = [k for k in la if not k.startswith(may_differ)]
    different = [k for k in compared if not _equal(la[k], lb[k])]
    assert not different, f"checkpoints differ at {different[:5]} ({len(different)} in all)"


def _reference_overrides(manifest: Path) -> tuple[str, ...]:
    """The reference run's: an evaluation before and after on the training corpus, and
    dropout, so that every step draws from torch's RNG (the tiny recipe has none) and an
    RNG state that was not restored shows in the weights."""
    return (f"data.val_manifest={manifest}", "eval_at_start=true", "model.dropout=0.2")


@pytest.fixture(scope="module")
def reference_run(speech_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 steps from scratch (`_reference_overrides`)."""
    out = tmp_path_factory.mktemp("reference")
    _train(speech_corpus, out, *_reference_overrides(speech_corpus))
    return out


def test_thirty_steps_lower_the_loss(reference_run: Path) -> None:
    evals = [
        json.loads(line)
        for line in (reference_run / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    assert [e["step"] for e in evals][0] == 0 and evals[-1]["step"] == 30
    assert evals[-1]["val_loss"] < 0.8 * evals[0]["val_loss"], evals


def test_same_seed_gives_identical_checkpoints(
    speech_corpus: Path, reference_run: Path, tmp_path: Path
) -> None:
    """Into another out_dir: equal in every value, and then byte for byte (nothing in the
    file says where it was written)."""
    _train(speech_corpus, tmp_path, *_reference_overrides(speech_corpus))
    _assert_same(reference_run / "last.pt", tmp_path / "last.pt")


AUGMENTED = (
    "data.augment.speed_prob=0.5", "data.augment.noise_prob=0.5", "data.augment.reverb_prob=0.3",
    "data.augment.telephone_prob=0.3", "data.augment.freq_masks=2", "data.augment.time_masks=1",
    "max_steps=6",
)  # fmt: skip


@pytest.mark.slow
def test_augmented_training_is_deterministic(speech_corpus: Path, tmp_path: Path) -> None:
    """Augmentation draws from (seed, epoch, utterance) alone: two runs write the same
    bytes, and differ from the run without it."""
    runs = [tmp_path / "a", tmp_path / "b", tmp_path / "clean"]
    for run in runs[:2]:
        _train(speech_corpus, run, *AUGMENTED)
    _train(speech_corpus, runs[2], "max_steps=6")
    assert (runs[0] / "last.pt").read_bytes() == (runs[1] / "last.pt").read_bytes()
    load = {"map_location": "cpu", "weights_only": False}
    augmented, clean = (torch.load(r / "last.pt", **load)["model"] for r in (runs[0], runs[2]))
    assert not all(torch.equal(augmented[k], clean[k]) for k in clean)


def test_same_weights_export_the_same_onnx_bytes(
    speech_corpus: Path, reference_run: Path, tmp_path: Path
) -> None:
    """The reference training again, into another out_dir and reporting otherwise (every
    step logged, no baseline evaluation, other checkpoint and evaluation cadences): the
    same weights and config_hash, so byte-identical exported files."""
    reporting = (
        "log_every=1",
        "eval_at_start=false",
        "eval_max_utterances=3",
        "checkpoint_every=7",
    )
    _train(speech_corpus, tmp_path / "run", *_reference_overrides(speech_corpus), *reporting)
    load = {"map_location": "cpu", "weights_only": False}
    ours, theirs = (torch.load(r / "last.pt", **load) for r in (tmp_path / "run", reference_run))
    assert ours["config_hash"] == theirs["config_hash"]
    exported = []
    for name, run in (("ours", tmp_path / "run"), ("theirs", reference_run)):
        exported.append(tmp_path / name / "echoic-tiny" / "1")
        subprocess.run(
            [*ECHOIC, "export", str(run / "last.pt"), str(exported[-1])],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
    for file in ("model.onnx", "stream.onnx", "export.json"):
        assert (exported[0] / file).read_bytes() == (exported[1] / file).read_bytes(), file


def test_other_seed_gives_other_weights(speech_corpus: Path, tmp_path: Path) -> None:
    _train(speech_corpus, tmp_path / "a", "max_steps=2")
    _train(speech_corpus, tmp_path / "b", "max_steps=2", "seed=99")
    with pytest.raises(AssertionError, match=r"checkpoints differ at \['model\."):
        _assert_same(
            tmp_path / "a" / "last.pt", tmp_path / "b" / "last.pt",
            may_differ=("train_config.seed", "sampler.seed", "config_hash"),
        )  # fmt: skip


def test_sigkill_then_resume_ends_with_the_same_checkpoint(
    speech_corpus: Path, reference_run: Path, tmp_path: Path
) -> None:
    """Killed after a checkpoint at step 8 or later, resumed: the same checkpoint as the
    run never interrupted. The steps after the resume draw dropout masks, so they match
    only if the resume restored the RNG states (tests/mutations checks that)."""
    overrides = (*_reference_overrides(speech_corpus), "checkpoint_every=4")
    proc = subprocess.Popen(
        _train_cmd(speech_corpus, tmp_path, *overrides),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    last, deadline = tmp_path / "last.pt", time.monotonic() + 300
    killed_at = None
    while time.monotonic() < deadline and proc.poll() is None:
        if last.exists():
            step = torch.load(last, map_location="cpu", weights_only=False)["step"]
            if step >= 8:
                os.killpg(proc.pid, signal.SIGKILL)
                killed_at = step
                break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert killed_at is not None and killed_at < 30, "the run ended before it could be killed"
    resumed = subprocess.run(
        _train_cmd(speech_corpus, tmp_path, *overrides), capture_output=True, text=True,
        timeout=600, check=True,
    )  # fmt: skip
    at = re.search(r"resuming at step (\d+)", resumed.stderr)
    assert at and 8 <= int(at[1]) < 30, resumed.stderr[-2000:]  # random steps left to run
    # The same as the uninterrupted run, although that one checkpointed every 10 steps.
    _assert_same(
        reference_run / "last.pt",
        tmp_path / "last.pt",
        may_differ=("train_config.checkpoint_every",),
    )


def test_max_minutes_stops_at_a_checkpoint_and_resumes_to_the_same_weights(
    speech_corpus: Path, reference_run: Path, tmp_path: Path
) -> None:
    """A spent wall-clock budget stops the run at its first checkpoint (step 10), after an
    evaluation; run again, it resumes and ends with the uninterrupted run's checkpoint, equal
    in every value (the budget is no part of it)."""
    overrides = _reference_overrides(speech_corpus)
    stopped = _train(speech_corpus, tmp_path, *overrides, "max_minutes=1e-9")
    assert "max_minutes=1e-09 reached: stopped at step 10 of 30" in stopped.stderr
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in evals if "val_loss" in e]
    assert steps[0] == 0 and steps[-1] == 10  # the recipe evaluates per epoch: 4 steps
    _train(speech_corpus, tmp_path, *overrides)
    _assert_same(reference_run / "last.pt", tmp_path / "last.pt")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        pytest.param("model.rnn_hidden=32", "holds a different model", id="other-model"),
        pytest.param(
            "threads={other}", "and the weights depend on it: pass threads={used} to resume",
            id="other-thread-count",
        ),
    ],
)  # fmt: skip
def test_resume_refuses_what_it_cannot_continue_exactly(
    speech_corpus: Path, tmp_path: Path, override: str, message: str
) -> None:
    """The first run picks its thread count (threads=0: cores / ranks) and records the
    count it used; a resume with another count would silently change the weights."""
    _train(speech_corpus, tmp_path, "max_steps=1", "threads=0")
    ckpt = torch.load(tmp_path / "last.pt", map_location="cpu", weights_only=False)
    used = ckpt["train_config"]["threads"]
    assert used == max(1, os.cpu_count() or 1)
    other = subprocess.run(
        _train_cmd(speech_corpus, tmp_path, "max_steps=2", override.format(other=used + 1)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert other.returncode == 1, other.stderr[-2000:]
    assert message.format(used=used) in other.stderr.strip().splitlines()[-1]
    assert "Traceback" not in other.stderr


def test_overrides_may_follow_flags(speech_corpus: Path, tmp_path: Path) -> None:
    """`key=value` overrides before, between and after the flags, as people type them;
    stdout is the final checkpoint's path alone."""
    cmd = [
        *ECHOIC, "train", f"data.train_manifest={speech_corpus}", "--config", str(TINY_RECIPE),
        f"out_dir={tmp_path}", "--no-progress", "max_steps=1", "threads=1",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == f"{tmp_path / 'last.pt'}\n"
    assert torch.load(tmp_path / "last.pt", map_location="cpu", weights_only=False)["step"] == 1


def test_train_records_say_how_many_steps_their_loss_covers(
    speech_corpus: Path, tmp_path: Path
) -> None:
    """log_every=5: a run to step 3, resumed to 7. The record at step 5 covers steps 4-5
    only (the resume began mid-window), and says so."""
    _train(speech_corpus, tmp_path, "max_steps=3")
    _train(speech_corpus, tmp_path, "max_steps=7")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["steps"]) for r in rows if r["kind"] == "train"]
    assert train == [(3, 3), (5, 2), (7, 2)]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        pytest.param("optim.lrr=1", "unknown config key optim.lrr", id="unknown-key"),
        pytest.param("model.rnn_hidden=big", "expected an integer", id="bad-type"),
        pytest.param("nonsense", "key=value", id="not-an-override"),
    ],
)
def test_bad_overrides_are_one_line_errors(
    speech_corpus: Path, tmp_path: Path, override: str, message: str
) -> None:
    run = subprocess.run(
        _train_cmd(speech_corpus, tmp_path, override), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1
    assert message in run.stderr and "Traceback" not in run.stderr


def test_init_from_starts_from_the_weights_with_a_fresh_schedule(
    speech_corpus: Path, reference_run: Path, tmp_path: Path
) -> None:
    """Fine-tuning: step 0 of the new run evaluates exactly as the end of the old one
    (same weights and feature statistics); the step count and schedule restart."""
    _train(
        speech_corpus, tmp_path, f"data.val_manifest={speech_corpus}", "eval_at_start=true",
        f"init_from={reference_run / 'last.pt'}", "max_steps=5", "optim.lr=1e-4",
    )  # fmt: skip

    def evals(run: Path) -> list[dict]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if r.get("kind") == "eval"]

    assert evals(tmp_path)[0]["step"] == 0
    assert evals(tmp_path)[0]["val_loss"] == evals(reference_run)[-1]["val_loss"]
    ckpt = torch.load(tmp_path / "last.pt", map_location="cpu", weights_only=False)
    assert ckpt["step"] == 5


def _printed_config(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    from echoic.cli.main import main

    assert main(["train", *argv, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def test_recipes_by_name_and_their_paths_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From a directory other than the repository's: `--config tiny` and `--config
    finetune` find the packaged recipes (finetune's init_from=bundled is the bundled
    model); a recipe's relative manifest is found beside it when the working directory
    has none; a recipe that is nowhere is one line naming where it looked and the names."""
    from echoic.cli.main import main
    from echoic.model.runtime.recognizer import default_model_dir

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "mine.toml").write_text(
        'init_from = "bundled"\n[data]\ntrain_manifest = "m.jsonl"\nval_manifest = "v.jsonl"\n'
    )
    (recipes / "m.jsonl").write_text("")
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    (elsewhere / "v.jsonl").write_text("")  # the working directory's comes first
    monkeypatch.chdir(elsewhere)
    tiny = _printed_config(capsys, "--config", "tiny")
    assert tiny == _printed_config(capsys, "--config", str(TINY_RECIPE))
    finetune = _printed_config(capsys, "--config", "finetune")
    assert Path(finetune["init_from"]) == default_model_dir()
    mine = _printed_config(capsys, "--config", "../recipes/mine.toml")
    assert Path(mine["init_from"]) == default_model_dir()
    assert Path(mine["data"]["train_manifest"]) == recipes.resolve() / "m.jsonl"
    assert mine["data"]["val_manifest"] == "v.jsonl"
    assert main(["train", "--config", "nope", "--print-config"]) == 1
    err = capsys.readouterr().err
    assert str(elsewhere / "nope") in err
    listed = err.split("recipes by name: ")[1].split(")")[0].split(", ")
    assert {"default", "finetune", "librispeech", "tiny"} <= set(listed)
    assert listed == sorted(listed)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("init_from={run}/nope.pt", "no checkpoint or model directory at"),
        ("model.rnn_hidden=32", "its network does not fit this recipe's [model]"),
        ("init_from={bundled}", "its network does not fit this recipe's [model]"),
        ("init_from={tmp}/bad/model.onnx", "is not a readable ONNX model"),
        ("init_from={tmp}", "no checkpoint at"),
    ],
    ids=["missing", "other-network", "export-of-another-network", "bad-graph", "a-directory"],
)
def test_init_from_refuses_what_it_cannot_load(
    speech_corpus: Path, reference_run: Path, tmp_path: Path, override: str, message: str
) -> None:
    """A clear one-line error, and no empty out_dir left behind."""
    from echoic.model.runtime.recognizer import default_model_dir

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.onnx").write_bytes(b"not a graph")
    paths = dict(run=reference_run, bundled=default_model_dir(), tmp=tmp_path)
    overrides = [f"init_from={reference_run / 'last.pt'}", override.format(**paths)]
    run = subprocess.run(
        _train_cmd(speech_corpus, tmp_path / "out", *overrides), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr[-2000:]
    assert message in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not shutil.which("mpirun"), reason="mpirun (openmpi-bin) is not installed")
def test_mpirun_two_ranks_trains_and_reproduces_itself(speech_corpus: Path, tmp_path: Path) -> None:
    def run(out: Path) -> subprocess.CompletedProcess:
        cmd = ["mpirun", *MPIRUN_ARGS, "-np", "2"]
        cmd += _train_cmd(speech_corpus, out, "max_steps=8", "checkpoint_every=4")
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    assert first.returncode == 0, first.stderr[-2000:]
    assert second.returncode == 0, second.stderr[-2000:]
    assert "2 rank(s)" in first.stderr
    assert first.stdout == f"{tmp_path / 'a' / 'last.pt'}\n"  # rank 0's line, only
    ckpt = torch.load(tmp_path / "a" / "last.pt", map_location="cpu", weights_only=False)
    assert ckpt["world_size"] == 2 and ckpt["step"] == 8 and len(ckpt["rng"]) == 2
    _assert_same(tmp_path / "a" / "last.pt", tmp_path / "b" / "last.pt")


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(run_dir / "last.pt", map_location="cpu", weights_only=False)
    return {k: v.double() for k, v in saved["model"].items() if v.is_floating_point()}


def _largest_difference(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def _train_records(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


def _sharing_ranks_train_one_ranks_weights(
    corpus: Path, out: Path, *overrides: str, env: dict | None = None
) -> tuple[float, float]:
    """One rank, then two ranks with batch_per = "step" (twice: the same bits) and with
    batch_per = "rank", 4 plain SGD steps each (`overrides` added): the largest weight
    difference from one rank's with each mode. The sharing ranks log one rank's losses
    and audio."""
    sgd = ("optim.name=sgd", "optim.lr=1e-3", "optim.warmup_steps=0", "max_steps=4", "log_every=1")
    environ = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}

    def ranks(to: Path, batch_per: str) -> None:
        cmd = ["mpirun", *MPIRUN_ARGS, "-np", "2"]
        cmd += _train_cmd(corpus, to, *sgd, *overrides, f"data.batch_per={batch_per}")
        run = subprocess.run(
            cmd, capture_output=True, text=True, timeout=600, env={**environ, **(env or {})}
        )
        assert run.returncode == 0, run.stderr[-2000:]

    _train(corpus, out / "one", *sgd, *overrides, env=env)
    ranks(out / "step", "step")
    ranks(out / "again", "step")
    ranks(out / "rank", "rank")
    _assert_same(out / "step" / "last.pt", out / "again" / "last.pt")
    one, step = _train_records(out / "one"), _train_records(out / "step")
    assert [r["step"] for r in one] == [r["step"] for r in step] == list(range(1, 5))
    assert [r["audio_seconds"] for r in one] == pytest.approx([r["audio_seconds"] for r in step])
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in step], rel=1e-3)
    assert [r["loss"] for r in one][1:] != pytest.approx(
        [r["loss"] for r in _train_records(out / "rank")][1:], rel=1e-2
    )
    return (
        _largest_difference(out / "one", out / "step"),
        _largest_difference(out / "one", out / "rank"),
    )


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("mpirun"), reason="mpirun (openmpi-bin) is not installed")
def test_mpirun_two_ranks_sharing_each_batch_train_one_ranks_weights(
    speech_corpus: Path, tmp_path: Path
) -> None:
    """Strong scaling: with data.batch_per = "step", two ranks deal each of one rank's
    batches between them and end 4 steps with one rank's weights (to the order of the
    sums: the ranks reduce in other places than one rank does), log its losses and audio,
    and reproduce their own bits; with batch_per = "rank" each rank takes a batch of its
    own and the weights go elsewhere. Plain SGD, whose step is the gradient's own: Adam's
    first steps are near sign(gradient), so a rounding in a near-zero gradient moves a
    weight by the whole learning rate. Few steps: early training is chaotic, and a
    rounding apart grows some 10x a step (one rank at two threads against one: 3e-5 after
    4 steps, 6e-5 after 8)."""
    shared, own = _sharing_ranks_train_one_ranks_weights(speech_corpus, tmp_path)
    print(f"largest weight difference from one rank: shared batches {shared:.2e}, own {own:.2e}")
    assert shared < 1e-3 and own > 100 * shared, (shared, own)


# ---- on a CUDA GPU (skipped elsewhere; scripts/gpu_check.sh train runs these) -----------

# A run that asked for the persistent kernels and fell back to cuDNN would train exactly
# as cuDNN does and pass: the GPU runs are strict, so that a fallback fails them.
STRICT = {"ECHOIC_PERSISTENT_STRICT": "1"}


def test_strict_persistent_kernels_without_a_gpu_are_a_one_line_error(
    speech_corpus: Path, tmp_path: Path
) -> None:
    """What a strict run does where the kernels cannot run, shown on the CPU: it stops
    with the reason, instead of training on the modules."""
    run = subprocess.run(
        _train_cmd(speech_corpus, tmp_path, "device=cpu", "rnn_impl=persistent", "max_steps=1"),
        capture_output=True, text=True, timeout=600, env={**os.environ, **STRICT},
    )  # fmt: skip
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "echoic train: error: the persistent kernels run on a CUDA GPU, not on cpu"
        " (ECHOIC_PERSISTENT_STRICT=1: no fallback)"
    )
    assert "Traceback" not in run.stderr


def _need_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("kind") == "train"]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "persistent"])
def test_gpu_same_seed_gives_identical_checkpoints(
    impl: str, speech_corpus: Path, tmp_path: Path
) -> None:
    """On the GPU too (bf16 autocast, deterministic algorithms): the same recipe and
    seed give the same bits, with cuDNN and with the persistent kernels (strict: never
    cuDNN's bits under the persistent name)."""
    _need_gpu()
    for name in ("a", "b"):
        _train(speech_corpus, tmp_path / name, "device=cuda", f"rnn_impl={impl}", env=STRICT)
    _assert_same(tmp_path / "a" / "last.pt", tmp_path / "b" / "last.pt")


@pytest.mark.gpu
@pytest.mark.skipif(not shutil.which("mpirun"), reason="mpirun (openmpi-bin) is not installed")
def test_gpu_two_ranks_share_one_gpu_and_reproduce_themselves(
    speech_corpus: Path, tmp_path: Path
) -> None:
    """`mpirun -np 2` on one GPU, the ranks' gradients summed over gloo (NCCL takes a GPU
    a rank): the same recipe and seed give the same bits."""
    _need_gpu()

    def run(out: Path) -> subprocess.CompletedProcess:
        cmd = ["mpirun", *MPIRUN_ARGS, "-np", "2"]
        cmd += _train_cmd(speech_corpus, out, "device=cuda", "dist_backend=gloo", "max_steps=8")
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    assert first.returncode == 0, first.stderr[-2000:]
    assert second.returncode == 0, second.stderr[-2000:]
    assert "2 rank(s) on cuda" in first.stderr
    ckpt = torch.load(tmp_path / "a" / "last.pt", map_location="cpu", weights_only=False)
    assert ckpt["world_size"] == 2 and ckpt["step"] == 8
    _assert_same(tmp_path / "a" / "last.pt", tmp_path / "b" / "last.pt")


@pytest.mark.gpu
def test_gpu_persistent_kernels_train_like_cudnn(speech_corpus: Path, tmp_path: Path) -> None:
    """The same 30 steps through the persistent kernels and through cuDNN: the loss
    curves agree to bf16 tolerance, and both learn; the checkpoints differ, as two
    implementations' rounding does (equal bits would mean that cuDNN ran both)."""
    _need_gpu()
    curves = {}
    for impl in ("cudnn", "persistent"):
        _train(speech_corpus, tmp_path / impl, "device=cuda", f"rnn_impl={impl}", env=STRICT)
        curves[impl] = _losses(tmp_path / impl)
    with pytest.raises(AssertionError, match="checkpoints differ at"):
        _assert_same(tmp_path / "cudnn" / "last.pt", tmp_path / "persistent" / "last.pt")
    assert len(curves["cudnn"]) == len(curves["persistent"]) >= 2
    for ours, theirs in zip(curves["persistent"], curves["cudnn"], strict=True):
        assert abs(ours - theirs) <= 0.05 * abs(theirs), curves
    assert curves["persistent"][-1] < curves["persistent"][0], curves


@pytest.mark.gpu
@pytest.mark.skipif(not shutil.which("mpirun"), reason="mpirun (openmpi-bin) is not installed")
def test_gpu_two_ranks_sharing_each_batch_train_one_ranks_weights(
    speech_corpus: Path, tmp_path: Path
) -> None:
    """Issue 29's row on the GPU: `mpirun -np 2` on one GPU over gloo, each batch dealt
    to both ranks (batch_per = "step"), ends with one rank's weights (float32 here: under
    bf16 autocast each share rounds apart), reproduces its bits, and logs one rank's
    losses."""
    _need_gpu()
    shared, own = _sharing_ranks_train_one_ranks_weights(
        speech_corpus, tmp_path, "device=cuda", "dist_backend=gloo", "precision=fp32", env=STRICT
    )
    print(f"largest weight difference from one rank: shared batches {shared:.2e}, own {own:.2e}")
    assert shared < 1e-3 and own > 100 * shared, (shared, own)


def test_batch_per_rank_is_saved_and_hashed_as_before_it_existed() -> None:
    """A recipe at a later setting's default writes the config and hash it wrote before
    the setting came (the same checkpoint bytes, model card and resume); one that uses
    it records it."""
    from echoic.model.core.configs import config_hash
    from echoic.training.train import NOT_HASHED, load_recipe, saved_config, weights_hash

    rank = load_recipe(str(TINY_RECIPE), [])
    step = load_recipe(str(TINY_RECIPE), ["data.batch_per=step"])
    assert "batch_per" not in saved_config(rank)["data"]
    assert weights_hash(rank) == config_hash(rank, (*NOT_HASHED, "data.batch_per"))
    assert saved_config(step)["data"]["batch_per"] == "step"
    assert weights_hash(step) != weights_hash(rank)
