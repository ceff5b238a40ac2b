"""`echoic transcribe --ray`: the job on a local Ray of two workers writes what the local
job writes, loses nothing when a worker dies mid-batch, and resumes like a local job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.data", reason="the ray extra is not installed")

ECHOIC = [sys.executable, "-m", "echoic.cli.main"]


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [*ECHOIC, "transcribe", *args, "--no-progress"], capture_output=True, text=True,
        timeout=600, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.slow
def test_a_ray_job_writes_what_a_local_one_does_and_survives_a_dead_worker(
    tiny_model_dir: Path, speech_corpus: Path, tmp_path: Path
) -> None:
    model = ("--model", str(tiny_model_dir))
    local = _run(str(speech_corpus), *model, "--output", str(tmp_path / "local.jsonl"))
    assert local.returncode == 0, local.stderr[-2000:]
    want = (tmp_path / "local.jsonl").read_text()

    crashed = tmp_path / "a-worker-died"
    ray_out = tmp_path / "ray.jsonl"
    job = _run(str(speech_corpus), *model, "--ray", "--ray-workers", "2", "--batch-size", "4",
               "--output", str(ray_out), env={"ECHOIC_RAY_CRASH_ONCE": str(crashed)})  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    assert crashed.exists(), "no worker died: the test did not test the restart"
    assert "transcribed 30 of 30 files" in job.stderr and "0 failed" in job.stderr
    assert ray_out.read_text() == want  # every file once, in input order, the same records

    again = _run(str(speech_corpus), *model, "--ray", "--ray-workers", "2",
                 "--output", str(ray_out))  # fmt: skip
    assert again.returncode == 0 and "30 already done" in again.stderr, again.stderr[-2000:]
    assert ray_out.read_text() == want


def test_ray_flags_are_checked(tiny_model_dir: Path, speech_corpus: Path) -> None:
    both = _run(str(speech_corpus), "--ray", "--server", "127.0.0.1:1")
    assert both.returncode == 2 and "exclude each other" in both.stderr
    address = _run(str(speech_corpus), "--ray-address", "auto")
    assert address.returncode == 2 and "--ray-address needs --ray" in address.stderr
