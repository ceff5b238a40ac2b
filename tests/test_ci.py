"""The suite under CI: a missing system tool or voices extra fails the run instead of
skipping tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SYSTEM_TOOLS

# A test that needs mpirun, and skips without it when CI is not set.
NEEDS_MPIRUN = "tests/test_distributed.py::test_mpirun_two_ranks_all_reduce_over_gloo"


@pytest.mark.parametrize(
    ("ci", "returncode", "output"),
    [
        pytest.param(
            "1",
            4,
            "CI is set and not installed: espeak-ng, flite, text2wave, mpirun, sox",
            id="ci",
        ),
        pytest.param("true", 4, "Install: bash scripts/bootstrap.sh", id="ci-true"),
        pytest.param("", 0, "mpirun is not installed", id="not-ci-skips"),
    ],
)
def test_missing_system_tools(ci: str, returncode: int, output: str, tmp_path: Path) -> None:
    nothing = tmp_path / "empty-bin"
    nothing.mkdir()  # PATH with no programs: espeak-ng, flite, mpirun and sox are all missing
    env = {**os.environ, "PATH": str(nothing), "CI": ci}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
         f"--basetemp={tmp_path / 'child'}", NEEDS_MPIRUN],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == returncode, run.stdout[-2000:] + run.stderr[-2000:]
    assert output in run.stdout + run.stderr


NEEDS_PIPER = "tests/test_neural_voices.py::test_engine_renders_speech_and_records_it[piper]"


@pytest.mark.parametrize(
    ("ci", "returncode", "output"),
    [
        pytest.param("1", 4, "CI is set and not installed: the neural voices of piper", id="ci"),
        pytest.param("", 0, "piper-tts is not installed", id="not-ci-skips"),
    ],
)
def test_missing_voices_extra(ci: str, returncode: int, output: str, tmp_path: Path) -> None:
    """Without piper-tts (a module on PYTHONPATH that raises ImportError stands in for its
    absence), the test that renders through it skips, and under CI the run fails."""
    missing = [tool for tool in SYSTEM_TOOLS if not shutil.which(tool)]
    if ci and missing:
        pytest.skip(f"not installed: {', '.join(missing)} (CI would stop on them first)")
    blockers = tmp_path / "blockers"
    blockers.mkdir()
    (blockers / "piper.py").write_text("raise ImportError('piper-tts is absent in this test')\n")
    env = {**os.environ, "PYTHONPATH": f"{blockers}{os.pathsep}{ROOT}", "CI": ci}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
         f"--basetemp={tmp_path / 'child'}", NEEDS_PIPER],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == returncode, run.stdout[-2000:] + run.stderr[-2000:]
    assert output in run.stdout + run.stderr
