"""scripts/gpu_train.sh, the one-call GPU training, proved on the CPU: pack here, run as
the GPU machine would (its own PACK, WORK and OUT), join the weights that come back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from echoic.model.nn.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from echoic.training.gpu_pack import join_parts, pack_corpus, write_parts
from tests.conftest import ROOT, TINY_RECIPE

LIMIT = 16_000_000  # bytes: the largest file a device call brings back
MAX_FILES = 8  # files a device call brings back


def _script(*args: str, env: dict[str, str], status: int = 0) -> subprocess.CompletedProcess:
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_train.sh"), *args], cwd=ROOT,
        env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == status, run.stdout[-2000:] + run.stderr[-2000:]
    return run


@pytest.mark.slow
def test_pack_run_join_end_to_end(
    speech_corpus: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """From an exported model (rebuilt at pack time: the GPU image has no onnxruntime),
    on the corpus packed as Opus: four steps, then the weights back under the limits,
    joined, and exported."""
    env = {
        "PYTHON": sys.executable, "PACK": str(tmp_path / "pack"), "WORK": str(tmp_path / "gpu"),
        "OUT": str(tmp_path / "out"), "RECIPE": str(TINY_RECIPE), "INIT": str(tiny_model_dir),
        "NO_WHEELS": "1", "BUDGET_S": "400",
    }  # fmt: skip
    _script("pack", str(speech_corpus), str(speech_corpus), env=env)
    packed = [
        json.loads(line) for line in (tmp_path / "pack" / "pack.json").read_text().splitlines()
    ]
    assert [(p["utterances"], p["left_out"], p["format"]) for p in packed] == [(30, 0, "opus")] * 2
    assert sorted(p.name for p in (tmp_path / "pack").iterdir()) == [
        "corpus.tar", "init.pt", "pack.json", "recipe.toml", "val.tar",
    ]  # fmt: skip

    run = _script("run", "max_steps=4", "checkpoint_every=2", "threads=1", env=env)
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["metrics.jsonl", "train.log", "weights.pt"], run.stdout
    assert len(files) <= MAX_FILES and all((out / f).stat().st_size < LIMIT for f in files)
    log = (out / "train.log").read_text()
    assert f"fine-tuning from {tmp_path / 'pack' / 'init.pt'}" in log
    assert "training ended with status 0" in log
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in e for e in evals)  # the packed validation set was read

    weights = join_parts(out, tmp_path / "back" / "weights.pt")
    back, start = load_checkpoint(weights), load_checkpoint(tmp_path / "pack" / "init.pt")
    assert back.step == 4 and torch.load(weights, weights_only=False)["weights_dtype"] == "float32"
    assert not back.optimizer and not back.rng  # slim: what travels is the weights
    assert not all(torch.equal(back.model[k], start.model[k]) for k in start.model)
    export = tmp_path / "export"
    subprocess.run(
        [sys.executable, "-m", "echoic.cli.main", "export", str(weights), str(export)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert (export / "model.onnx").is_file() and (export / "stream.onnx").is_file()


def test_pack_refuses_more_than_a_call_carries(speech_corpus: Path, tmp_path: Path) -> None:
    """A call carries the checkout's own files too (the bundled model's 40 MiB): a pack of
    well under 1 MiB is refused when the limit is 1 MiB."""
    env = {"PYTHON": sys.executable, "PACK": str(tmp_path / "pack"), "NO_WHEELS": "1",
           "RECIPE": str(TINY_RECIPE), "CARRY_MIB": "1"}  # fmt: skip
    run = _script("pack", str(speech_corpus), env=env, status=1)
    assert (tmp_path / "pack" / "corpus.tar").stat().st_size < 1024 * 1024
    assert "the checkout's files" in run.stdout
    assert "more than the 1 MiB a call carries in: pack again with a smaller MAX_MB" in run.stderr


@pytest.mark.slow
def test_run_sizes_max_steps_to_its_budget(speech_corpus: Path, tmp_path: Path) -> None:
    """MAX_STEPS=auto: a probe measures the rate, and the run's schedule is the steps
    chosen (train.log says the number; the run's own line counts them), status 0. A run
    left in WORK is not sized again: resuming it with another schedule is refused.
    The budget is roomy for a shared machine: a probe slowed to 40 s by other work must
    still leave the 30 s a run needs, and the reserve less 15 s (the timeout's margin past
    the run's minutes) must cover a run slower than its probe measured."""
    env = {
        "PYTHON": sys.executable, "PACK": str(tmp_path / "pack"), "WORK": str(tmp_path / "gpu"),
        "OUT": str(tmp_path / "out"), "RECIPE": str(TINY_RECIPE), "NO_WHEELS": "1",
        "BUDGET_S": "140", "RESERVE_S": "40", "MAX_STEPS": "auto", "PROBE_STEPS": "20",
    }  # fmt: skip
    _script("pack", str(speech_corpus), env=env)
    run = _script("run", "threads=1", "log_every=5", env=env)
    log = (tmp_path / "out" / "train.log").read_text()
    chosen = int(log.split("gpu_train: max_steps=")[1].split()[0])
    assert chosen > 20, run.stderr  # the tiny network trains several steps a second here
    assert "audio seconds a second after" in run.stderr
    assert f"steps/epoch; {chosen} steps" in log  # the run's schedule is the steps chosen
    assert "training ended with status 0" in log
    assert not (tmp_path / "gpu" / ".gpu-train-probe").exists()
    again = _script("run", env=env, status=2)
    assert "MAX_STEPS=auto sizes a fresh run" in again.stderr


def test_opus_level_packs_smaller_and_is_checked(speech_corpus: Path, tmp_path: Path) -> None:
    default = pack_corpus(speech_corpus, tmp_path / "a.tar")
    small = pack_corpus(speech_corpus, tmp_path / "b.tar", opus_level=0.97)
    assert small["utterances"] == default["utterances"] and small["bytes"] < default["bytes"]
    with pytest.raises(ValueError, match="a level from 0 to 1"):
        pack_corpus(speech_corpus, tmp_path / "c.tar", "flac", opus_level=0.5)


def test_max_mb_counts_the_tar_itself(speech_corpus: Path, tmp_path: Path) -> None:
    """max_mb bounds the tar file, its headers and padding included."""
    whole = pack_corpus(speech_corpus, tmp_path / "a.tar")
    limit = whole["bytes"] * 0.6 / 1e6
    part = pack_corpus(speech_corpus, tmp_path / "b.tar", max_mb=limit)
    assert 0 < part["utterances"] < whole["utterances"]
    with tarfile.open(tmp_path / "b.tar") as tar:
        text = tar.getmember("manifest.jsonl").size
    # beyond the files: the manifest (header, padded text) and the tar's closing record
    assert part["bytes"] <= limit * 1e6 + 512 + text + 512 + tarfile.RECORDSIZE


def _checkpoint(path: Path, floats: int) -> Path:
    """A checkpoint file with one weight of `floats` float32 values (the seam under test is
    the file, not the network)."""
    torch.manual_seed(0)
    weights = {"w": torch.randn(floats), "n": torch.tensor(3)}
    torch.save(Checkpoint(model=weights, model_config={}, step=7).to_dict(), path)
    return path


@pytest.mark.parametrize(
    ("part_mb", "max_parts", "parts", "dtype"),
    [
        pytest.param(1.0, 6, ["weights.pt"], torch.float32, id="one-file"),
        pytest.param(
            0.15, 6, [f"weights.pt.part-0{n}" for n in range(3)], torch.float32, id="parts"
        ),
        pytest.param(
            0.15, 2, ["weights.pt.part-00", "weights.pt.part-01"], torch.bfloat16, id="bf16"
        ),
    ],
)
def test_weights_come_back_in_parts_and_join(
    tmp_path: Path, part_mb: float, max_parts: int, parts: list[str], dtype: torch.dtype
) -> None:
    source = _checkpoint(tmp_path / "last.pt", 100_000)  # 400 kB as float32
    written = write_parts(source, tmp_path / "out", part_mb=part_mb, max_parts=max_parts)
    assert [p.name for p in written] == parts
    assert all(p.stat().st_size <= part_mb * 1e6 for p in written)
    joined = load_checkpoint(join_parts(tmp_path / "out", tmp_path / "joined.pt"))
    original = torch.load(source, weights_only=False)["model"]
    assert joined.model["w"].dtype == dtype and joined.step == 7
    assert torch.equal(joined.model["w"], original["w"].to(dtype))
    assert torch.equal(joined.model["n"], original["n"])


@pytest.mark.parametrize(
    ("first", "second", "dtype"),
    [
        pytest.param((0.15, 6), (0.15, 2), torch.bfloat16, id="three-parts-then-two"),
        pytest.param((0.15, 6), (1.0, 6), torch.float32, id="parts-then-one-file"),
    ],
)
def test_writing_again_leaves_no_part_of_the_last_write(
    tmp_path: Path, first: tuple[float, int], second: tuple[float, int], dtype: torch.dtype
) -> None:
    source = _checkpoint(tmp_path / "last.pt", 100_000)
    write_parts(source, tmp_path / "out", part_mb=first[0], max_parts=first[1])
    written = write_parts(source, tmp_path / "out", part_mb=second[0], max_parts=second[1])
    assert sorted((tmp_path / "out").iterdir()) == sorted(written)
    joined = load_checkpoint(join_parts(tmp_path / "out", tmp_path / "joined.pt"))
    assert joined.model["w"].dtype == dtype


def test_a_missing_part_is_caught_at_join(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "last.pt", 100_000)
    written = write_parts(source, tmp_path / "out", part_mb=0.15, max_parts=6)
    written[1].unlink()
    with pytest.raises(CheckpointError, match="is not a readable echoic checkpoint"):
        join_parts(tmp_path / "out", tmp_path / "joined.pt")


def test_weights_too_large_even_as_bf16_are_refused(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "last.pt", 100_000)
    with pytest.raises(ValueError, match=r"even as bfloat16, more than 1 parts of 0\.05 MB"):
        write_parts(source, tmp_path / "out", part_mb=0.05, max_parts=1)


def test_aside_and_back_take_the_bundled_models_out_of_a_call(tmp_path: Path) -> None:
    """`aside` takes model/default and model/punct out of the index and the checkout (what
    a device call carries), `back` restores both exactly; in a clone of its own."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("gpu_train.sh", "gpu_env.sh"):
        shutil.copy2(ROOT / "scripts" / name, repo / "scripts" / name)
    files = {"model/default/model.onnx": b"graph", "model/punct/punct.onnx": b"tagger",
             "model/other.txt": b"stays"}  # fmt: skip
    for name, data in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], check=True,
                              capture_output=True, text=True).stdout  # fmt: skip

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "start")
    script = ["bash", str(repo / "scripts" / "gpu_train.sh")]
    subprocess.run([*script, "aside"], check=True, capture_output=True)
    carried = git("ls-files", "--cached", "--others", "--exclude-standard").split()
    assert "model/other.txt" in carried and not [f for f in carried if "onnx" in f]
    assert not (repo / "model" / "default").exists()
    subprocess.run([*script, "back"], check=True, capture_output=True)
    assert all((repo / name).read_bytes() == data for name, data in files.items())
    assert git("status", "--porcelain") == ""  # index and checkout as they were
