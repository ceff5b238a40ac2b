"""`echoic transcribe` and `echoic eval` in process, on a real exported model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

ECHOIC = [sys.executable, "-m", "echoic.cli.main"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ECHOIC, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def mixed_folder(corpus_audio, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Good 16 kHz files, a 44.1 kHz stereo FLAC of good audio, and three bad files."""
    root = tmp_path_factory.mktemp("mixed")
    for i, (_, audio) in enumerate(corpus_audio[:3]):
        sf.write(root / f"good{i}.wav", audio, 16000, subtype="PCM_16")
    hi = soxr.resample(corpus_audio[3][1], 16000, 44100)
    sf.write(root / "stereo44k.flac", np.stack([hi, 0.5 * hi], axis=1), 44100)
    (root / "corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage" + bytes(range(50)))
    (root / "empty.wav").write_bytes(b"")
    (root / "noise.flac").write_bytes(np.random.default_rng(0).bytes(4000))
    return root


def test_bad_files_are_reported_and_the_rest_transcribed(
    tiny_model_dir: Path, mixed_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    args = ["transcribe", str(mixed_folder), "--model", str(tiny_model_dir), "--format", "jsonl"]
    run = _run(*args, "--output", str(out), "--no-progress")
    assert run.returncode == 1, run.stderr
    rows = {
        Path(r["audio_filepath"]).name: r for r in map(json.loads, out.read_text().splitlines())
    }
    assert sorted(n for n, r in rows.items() if "error" in r) == [
        "corrupt.wav", "empty.wav", "noise.flac",
    ]  # fmt: skip
    for name in ("good0.wav", "good1.wav", "good2.wav", "stereo44k.flac"):
        assert "text" in rows[name] and rows[name]["duration"] > 0.5
        assert rows[name]["model"] == "echoic-tiny/1"  # which model and version wrote it
    for name in ("corrupt.wav", "empty.wav", "noise.flac"):
        assert name in run.stderr
    assert "4 of 7 files" in run.stderr and "3 failed" in run.stderr
    # Resumable: a second run transcribes only the files that failed (and fail again).
    again = _run(*args, "--output", str(out), "--no-progress")
    assert "4 already done" in again.stderr
    assert len(out.read_text().splitlines()) == 10


def test_stereo_44k_equals_the_16k_original(mixed_folder: Path, corpus_audio) -> None:
    from echoic.model.core.audio import load_audio

    converted = load_audio(mixed_folder / "stereo44k.flac", 16000)
    mono = 0.75 * corpus_audio[3][1]  # the mean of the two channels (1 and 0.5)
    assert len(converted) == len(mono)
    assert np.abs(converted - mono).max() < 0.01


def _in_process(model_dir: Path, path: Path):
    from echoic.model.core.audio import load_audio
    from echoic.model.runtime.recognizer import Recognizer

    return Recognizer(model_dir, intra_op_threads=1).transcribe([load_audio(path, 16000)])[0]


def test_text_output(tiny_model_dir: Path, mixed_folder: Path) -> None:
    good = mixed_folder / "good0.wav"
    run = _run("transcribe", str(good), "--model", str(tiny_model_dir), "--no-progress")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{good}\t{_in_process(tiny_model_dir, good).text}\n"


def _srt_seconds(stamp: str) -> float:
    hours, minutes, rest = stamp.split(":")
    seconds, ms = rest.split(",")
    return int(hours) * 3600 + int(minutes) * 60 + int(seconds) + int(ms) / 1000


def test_srt_cues_carry_the_words_and_their_times(
    tiny_model_dir: Path, corpus_audio, tmp_path: Path
) -> None:
    talk = tmp_path / "talk.wav"  # two utterances: more words than one cue holds
    sf.write(talk, np.concatenate([corpus_audio[0][1], corpus_audio[2][1]]), 16000)
    words = _in_process(tiny_model_dir, talk).words
    assert len(words) > 7, "too few words for several cues"
    args = ["transcribe", str(talk), "--model", str(tiny_model_dir), "--format", "srt"]
    run = _run(*args, "--output-dir", str(tmp_path / "subs"), "--no-progress")
    assert run.returncode == 0, run.stderr
    subtitles = (tmp_path / "subs" / "talk.srt").read_text()
    assert subtitles.strip(), "an empty SRT file"
    cues = []
    for n, block in enumerate(subtitles.split("\n\n"), 1):
        number, times, text = block.rstrip("\n").split("\n")
        assert number == str(n)
        start, end = map(_srt_seconds, times.split(" --> "))
        cues.append((start, end, text.split()))
    assert len(cues) >= 2
    assert [w for *_, cue_words in cues for w in cue_words] == [w.text for w in words]
    first = 0  # each cue runs from its first word's start to its last word's end
    for start, end, cue_words in cues:
        last = first + len(cue_words) - 1
        assert start == pytest.approx(words[first].start, abs=0.0015)
        assert end == pytest.approx(words[last].end, abs=0.0015)
        assert start < end and len(cue_words) <= 7 and end - start <= 3.5 + 0.001
        first = last + 1
    assert all(a[1] <= b[0] for a, b in zip(cues, cues[1:], strict=False))


def test_srt_needs_an_output_dir(tiny_model_dir: Path, mixed_folder: Path) -> None:
    run = _run("transcribe", str(mixed_folder / "good0.wav"), "--format", "srt")
    assert run.returncode == 1 and "--output-dir" in run.stderr and "Traceback" not in run.stderr


def test_missing_model_directory_is_one_line(tmp_path: Path, mixed_folder: Path) -> None:
    run = _run("transcribe", str(mixed_folder / "good0.wav"), "--model", str(tmp_path / "nope"))
    assert run.returncode == 1 and "nope" in run.stderr and "Traceback" not in run.stderr


def test_eval_reports_error_rates(tiny_model_dir: Path, speech_corpus: Path) -> None:
    run = _run("eval", "--model", str(tiny_model_dir), "--manifest", str(speech_corpus), "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["utterances"] == 30 and 0 < result["cer"] <= 1.5
    assert result["real_time_factor"] > 0 and len(result["worst"]) == 5


# ---------------------------------------------------------------- beam search flags


@pytest.fixture(scope="module")
def other_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bigram LM of every other corpus sentence: not the model directory's lm.arpa."""
    from echoic.model.core.lm import build_arpa
    from tests.conftest import SENTENCES

    path = tmp_path_factory.mktemp("other-lm") / "other.arpa"
    build_arpa(SENTENCES.splitlines()[::2], path, order=2)
    return path


BEAM_FLAGS = {
    "model-directory-lm": ([], {}),
    "lm-file-over-the-directorys": (["--lm", "OTHER"], {"lm_path": "OTHER"}),
    "no-lm": (["--no-lm"], {"use_lm": False}),
}


@pytest.mark.parametrize("case", [pytest.param(name, id=name) for name in BEAM_FLAGS])
def test_beam_flags_equal_in_process_beam_search(
    tiny_lm_model_dir: Path, mixed_folder: Path, speech_corpus: Path, other_lm: Path, case: str
) -> None:
    """`--decoder beam` with the model directory's lm.arpa, `--lm FILE` or `--no-lm`, in
    `echoic transcribe` and `echoic eval`, reads what `Recognizer` reads with that config."""
    pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")
    import jiwer

    from echoic.model.core.audio import load_audio
    from echoic.model.core.decoding import DecoderConfig
    from echoic.model.core.text import normalize_text
    from echoic.model.runtime.recognizer import Recognizer

    files = [str(mixed_folder / f"good{i}.wav") for i in range(3)]
    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()][:4]
    utterances = [str(speech_corpus.parent / r["audio_filepath"]) for r in rows]
    audio = {p: load_audio(p, 16000) for p in files + utterances}

    def read(decoder: dict) -> tuple[str | None, dict[str, str]]:
        decoder = {k: str(other_lm) if v == "OTHER" else v for k, v in decoder.items()}
        config = DecoderConfig(kind="beam", **decoder)
        rec = Recognizer(tiny_lm_model_dir, config, intra_op_threads=1)
        transcripts = rec.transcribe(list(audio.values()))
        return rec.lm_path, {p: t.text for p, t in zip(audio, transcripts, strict=True)}

    readings = {name: read(decoder) for name, (_, decoder) in BEAM_FLAGS.items()}
    lm, want = readings[case]
    alike = [name for name, (_, r) in readings.items() if r == want]
    assert alike == [case], f"{alike} read alike: the test cannot tell them apart"
    assert lm == {"model-directory-lm": str(tiny_lm_model_dir / "lm.arpa"),
                  "lm-file-over-the-directorys": str(other_lm), "no-lm": None}[case]  # fmt: skip
    flags = [str(other_lm) if f == "OTHER" else f for f in BEAM_FLAGS[case][0]]
    beam = ["--model", str(tiny_lm_model_dir), "--decoder", "beam", *flags]

    run = _run("transcribe", *files, *beam, "--format", "jsonl", "--no-progress")
    assert run.returncode == 0, run.stderr
    got = {r["audio_filepath"]: r["text"] for r in map(json.loads, run.stdout.splitlines())}
    assert got == {p: want[p] for p in files}

    run = _run("eval", *beam, "--manifest", str(speech_corpus), "--limit", "4", "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert (result["decoder"], result["lm"], result["utterances"]) == ("beam", lm, 4)
    assert {w["audio"]: w["hyp"] for w in result["worst"]} == {p: want[p] for p in utterances}
    refs = [normalize_text(r["text"]) for r in rows]
    assert result["wer"] == round(jiwer.wer(refs, [want[p] for p in utterances]), 4)


@pytest.fixture(scope="module")
def lengths_folder(corpus_audio, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """WAVs of 3, 1 and 2 utterances' length, and an unreadable file."""
    root = tmp_path_factory.mktemp("lengths")
    for name, count in (("long", 3), ("short", 1), ("middle", 2)):
        audio = np.concatenate([a for _, a in corpus_audio[:count]])
        sf.write(root / f"{name}.wav", audio, 16000, subtype="PCM_16")
    (root / "corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")
    return root


@pytest.mark.parametrize("batch_size", [pytest.param("1", id="a-file-a-batch"),
                                        pytest.param("16", id="one-batch")])  # fmt: skip
@pytest.mark.parametrize("fmt", ["text", "jsonl"])
def test_output_follows_input_order(
    tiny_model_dir: Path, lengths_folder: Path, tmp_path: Path, fmt: str, batch_size: str
) -> None:
    """Batched by length (short, middle, long), written in the order given; in JSON
    lines the unreadable file's error row keeps its place too."""
    names = ["long.wav", "corrupt.wav", "short.wav", "middle.wav"]
    out = tmp_path / "out"
    run = _run(
        "transcribe", *(str(lengths_folder / n) for n in names), "--model", str(tiny_model_dir),
        "--format", fmt, "--output", str(out), "--batch-size", batch_size, "--no-progress",
    )  # fmt: skip
    assert run.returncode == 1, run.stderr  # the corrupt file
    lines = out.read_text().splitlines()
    if fmt == "jsonl":
        written = [Path(json.loads(line)["audio_filepath"]).name for line in lines]
        assert written == names
    else:  # text has no line for a file that failed
        assert [Path(line.split("\t")[0]).name for line in lines] == [
            n for n in names if n != "corrupt.wav"
        ]
