"""The suite under CI: a missing system tool or voices extra fails the run instead of
skipping tests."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from importlib.metadata import version
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


@pytest.mark.slow
def test_serve_sh_sets_up_no_system_packages_and_serves_on_its_ports(tmp_path: Path) -> None:
    """`bash scripts/serve.sh` from another directory, on a PATH without apt-get, the
    synthesizers, MPI or Chromium: it installs nothing of the test and training stack (the
    serve extras in .venv are all it needs) and serves on ECHOIC_PORT, ECHOIC_HTTP_PORT
    and ECHOIC_METRICS_PORT."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("the suite runs outside the repository's .venv, which serve.sh sets up")
    markers = [ROOT / ".venv" / name for name in (".echoic-installed", ".echoic-serve")]
    built = max((m.stat().st_mtime for m in markers if m.exists()), default=0.0)
    if (ROOT / "pyproject.toml").stat().st_mtime > built:
        pytest.skip("pyproject.toml is newer than .venv's set-up: serve.sh would reinstall")
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "dirname"):  # what serve.sh and bootstrap.sh run themselves
        (tools / tool).symlink_to(shutil.which(tool))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    env = {**os.environ, "PATH": str(tools), "PYTHONUNBUFFERED": "1", "ECHOIC_PORT": "0",
           "ECHOIC_HTTP_PORT": str(http_port), "ECHOIC_METRICS_PORT": "0"}  # fmt: skip
    process = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "serve.sh"), "--threads", "1"], cwd=tmp_path, env=env,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    timer = threading.Timer(120, process.kill)  # a server that never says so fails, not hangs
    timer.start()
    log: list[str] = []
    try:
        for line in process.stderr:
            log.append(line)
            if "listening on" in line:
                break
        listening = "".join(log)
        assert f"echoic {version('echoic')} listening on" in listening, listening
        assert re.search(rf"HTTP on :{http_port}, metrics on :\d+", listening), listening
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=30) as r:
            assert r.status == 200
        assert "bootstrap: installing" not in listening
        # The bundled model's default decoder loaded its LM: none of KenLM's chatter.
        assert "Loading the LM" not in listening and "*****" not in listening
    finally:
        timer.cancel()
        process.kill()
        process.wait(timeout=30)
        process.stderr.close()
