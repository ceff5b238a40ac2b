"""Mutation checks: break echoic on purpose and require the test that claims to catch
that bug to fail.

Each case names a mutation (defined in `pythonpath/sitecustomize.py`), the tests
that must catch it and a piece of their failure message. The harness runs those
tests in a child pytest with `tests/mutations/pythonpath` first on PYTHONPATH and
ECHOIC_MUTATION set: Python loads that `sitecustomize` in every process of the
run, the child pytest and the processes it starts (`echoic train`, mpirun's ranks),
and it swaps the function for the mutant as its module is imported; nothing in the
repository is edited. A case passes when every target test fails with the expected
message and the mutant demonstrably ran (its log names the processes, which must
include ones the child pytest started). A target that passed means the mutation
survived: the case fails. Targets that skip (no CUDA GPU, no mpirun) make the case
skip as "not checkable here: REASON". The unmutated targets run in the same suite,
where they must pass.

    .venv/bin/python -m pytest tests/mutations -v      # about a minute on two cores
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

INJECT = Path(__file__).resolve().parent / "pythonpath"


@dataclass(frozen=True)
class Mutation:
    name: str  # a key of MUTATIONS in pythonpath/sitecustomize.py
    targets: tuple[str, ...]  # pytest node ids that must fail, relative to the repo root
    caught_by: str  # in every target's failure message: it failed for this bug
    processes: int  # the mutant must run in at least this many processes below the child
    corpus: bool = False  # the targets use the speech_corpus fixture


MUTATIONS = [
    pytest.param(
        Mutation(
            "noop-rng-restore",
            ("tests/test_train.py::test_sigkill_then_resume_ends_with_the_same_checkpoint",),
            caught_by="checkpoints differ",
            processes=1,  # the resumed `echoic train`
            corpus=True,
        ),
        id="noop-rng-restore",
    ),
    pytest.param(
        Mutation(
            "rendezvous-returns-none",
            ("tests/test_distributed.py::test_mpirun_two_ranks_all_reduce_over_gloo",),
            caught_by="not through mpi4py",
            processes=2,  # both ranks
        ),
        id="rendezvous-returns-none",
    ),
    pytest.param(
        Mutation(
            "persistent-launch-fails",
            (
                "tests/test_persistent_rnn.py::test_gpu_training_step_matches_cudnn",
                "tests/test_train.py::test_gpu_same_seed_gives_identical_checkpoints[persistent]",
                "tests/test_train.py::test_gpu_persistent_kernels_train_like_cudnn",
            ),
            caught_by="",  # any failure; the log shows that the fallback ran
            processes=1,
            corpus=True,
        ),
        id="persistent-launch-fails",
    ),
]


def _outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """node id -> (passed | failed | error | skipped, message) from a junit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        node = f"{path}::{case.get('name')}"
        kind, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind, message = child.tag.replace("failure", "failed"), child.get("message", "")
                break
        out[node] = (kind, message)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_mutation_is_caught(
    mutation: Mutation, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    log, junit = tmp_path / "mutant.log", tmp_path / "junit.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(INJECT), os.environ.get("PYTHONPATH", "")]),
        "ECHOIC_MUTATION": mutation.name,
        "ECHOIC_MUTATION_LOG": str(log),
    }
    if mutation.corpus:  # the child reuses this session's corpus rather than synthesizing one
        env["ECHOIC_TEST_CORPUS"] = str(request.getfixturevalue("speech_corpus"))
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
         f"--junitxml={junit}", *mutation.targets],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = child.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # with what it started: `echoic train`, mpirun
        child.wait()
        raise
    tail = output[-3000:]
    assert junit.exists(), f"the child pytest wrote no report:\n{tail}"
    outcomes = _outcomes(junit)
    assert sorted(outcomes) == sorted(mutation.targets), f"not the targets:\n{tail}"

    survived = [node for node, (kind, _) in outcomes.items() if kind == "passed"]
    assert not survived, f"{mutation.name} survived: {survived} passed\n{tail}"
    skipped = {message for kind, message in outcomes.values() if kind == "skipped"}
    if skipped:
        pytest.skip("not checkable here: " + "; ".join(sorted(skipped)))
    errors = [node for node, (kind, _) in outcomes.items() if kind == "error"]
    assert not errors, f"errors, not failures, in {errors}:\n{tail}"
    for node, (_, message) in outcomes.items():
        assert mutation.caught_by in message, f"{node} failed for another reason:\n{tail}"

    ran = log.read_text().splitlines() if log.exists() else []
    pids = {line.rsplit(" ", 1)[1] for line in ran} - {str(child.pid)}
    assert len(pids) >= mutation.processes, f"the mutant ran in {ran}, not in the children"
