"""`echoic transcribe` and `echoic eval` in process, on a real exported model."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
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
    # Resumable: a second run has nothing to do; the bad files were recorded once and are
    # tried again only when asked (and fail again: their error rows replaced, not added).
    again = _run(*args, "--output", str(out), "--no-progress")
    assert again.returncode == 1, again.stderr  # not every input is done
    assert "4 already done" in again.stderr and "3 failed before" in again.stderr
    assert "--retry-failed" in again.stderr
    first = out.read_text()
    assert len(first.splitlines()) == 7
    retried = _run(*args, "--output", str(out), "--no-progress", "--retry-failed")
    assert retried.returncode == 1 and "3 failed;" in retried.stderr
    assert out.read_text() == first


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
    assert run.returncode == 2 and "--output-dir" in run.stderr and "Traceback" not in run.stderr


def test_missing_model_directory_is_one_line(tmp_path: Path, mixed_folder: Path) -> None:
    run = _run("transcribe", str(mixed_folder / "good0.wav"), "--model", str(tmp_path / "nope"))
    assert run.returncode == 2 and "nope" in run.stderr and "Traceback" not in run.stderr


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
    from echoic.model.core.decoding import FILE_ENDPOINTING, DecoderConfig
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
        # Files as `echoic transcribe` cuts them; the manifest's utterances whole, as eval.
        cut = rec.transcribe([audio[p] for p in files], endpointing=FILE_ENDPOINTING)
        whole = rec.transcribe([audio[p] for p in utterances])
        texts = [t.text for t in (*cut, *whole)]
        return rec.lm_path, dict(zip(files + utterances, texts, strict=True))

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
@pytest.mark.parametrize("fmt", ["tsv", "jsonl"])
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
    else:  # tsv has no line for a file that failed
        assert [Path(line.split("\t")[0]).name for line in lines] == [
            n for n in names if n != "corrupt.wav"
        ]


# ---------------------------------------------------------------- jobs (issue 22)


def _job(*args: str, cwd: Path | None = None, stdin: str | None = None):
    return subprocess.run(
        [*ECHOIC, "transcribe", *args], capture_output=True, text=True, timeout=300, cwd=cwd,
        input=stdin,
    )  # fmt: skip


@pytest.fixture(scope="module")
def two_folders(corpus_audio, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """data/a/utt_001.wav and data/b/utt_001.wav (other audio, the same name), and
    data/a/utt_002.wav."""
    root = tmp_path_factory.mktemp("two-folders") / "data"
    for folder, n, utterance in (("a", 1, 0), ("b", 1, 1), ("a", 2, 2)):
        (root / folder).mkdir(parents=True, exist_ok=True)
        sf.write(root / folder / f"utt_00{n}.wav", corpus_audio[utterance][1], 16000)
    return root


def _texts(tiny_model_dir: Path, root: Path) -> dict[str, str]:
    """In-process transcripts of every WAV under root, by path relative to it."""
    return {
        str(p.relative_to(root)): _in_process(tiny_model_dir, p).text
        for p in sorted(root.rglob("*.wav"))
    }


@pytest.mark.parametrize("fmt", ["json", "txt", "srt", "vtt"])
def test_per_file_outputs_mirror_the_tree(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path, fmt: str
) -> None:
    """a/utt_001.wav and b/utt_001.wav each get their own output (they used to collide on
    the bare name: one lost), and a rerun finds both done."""
    want = _texts(tiny_model_dir, two_folders)
    assert want["a/utt_001.wav"] != want["b/utt_001.wav"], "the test needs different audio"
    subs = tmp_path / "subs"
    args = [str(two_folders), "--model", str(tiny_model_dir), "--format", fmt,
            "--output-dir", str(subs), "--no-progress"]  # fmt: skip
    run = _job(*args)
    assert run.returncode == 0, run.stderr
    written = sorted(str(p.relative_to(subs)) for p in subs.rglob(f"*.{fmt}"))
    assert written == [f"a/utt_001.{fmt}", f"a/utt_002.{fmt}", f"b/utt_001.{fmt}"]
    for rel, text in want.items():
        content = (subs / rel).with_suffix(f".{fmt}").read_text()
        if fmt == "json":
            assert json.loads(content)["text"] == text
        elif fmt == "txt":
            assert content == text + "\n"
        else:
            cue_lines = [ln for ln in content.splitlines() if ln and "-->" not in ln]
            cue_lines = [ln for ln in cue_lines if not ln.isdigit() and ln != "WEBVTT"]
            assert " ".join(cue_lines) == text
            assert content.startswith("WEBVTT\n") == (fmt == "vtt")
            assert (" --> " in content) == bool(text)
    again = _job(*args)
    assert again.returncode == 0 and "3 already done" in again.stderr, again.stderr


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        pytest.param(["--output", "OUT.jsonl"], "jsonl", id="jsonl-from-the-name"),
        pytest.param(["--output", "OUT.tsv"], "tsv", id="tsv-from-the-name"),
        pytest.param(["--output", "OUT", "--format", "jsonl"], "jsonl", id="no-extension"),
        pytest.param(
            ["--output", "OUT.jsonl", "--format", "tsv"],
            "contradicts",
            id="format-against-the-name",
        ),  # fmt: skip
        pytest.param(["--output", "OUT.txt"], "--output-dir", id="per-file-format-one-file"),
        pytest.param(["--output", "OUT.out"], "cannot tell the format", id="unknown-extension"),
        pytest.param(
            ["--output-dir", "OUT", "--format", "jsonl"],
            "--output FILE",
            id="one-file-format-in-a-dir",
        ),  # fmt: skip
    ],
)
def test_the_format_follows_the_output_name(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path, flags: list[str], want: str
) -> None:
    """`--output out.jsonl` writes JSON lines (it used to write path<TAB>text lines);
    a format that contradicts the name, or one that cannot go there, is refused."""
    flags = [f.replace("OUT", str(tmp_path / "out")) for f in flags]
    run = _job(str(two_folders / "a" / "utt_001.wav"), "--model", str(tiny_model_dir),
               "--no-progress", *flags)  # fmt: skip
    out = Path(flags[1])
    if want in ("jsonl", "tsv"):
        assert run.returncode == 0, run.stderr
        line = out.read_text()
        assert line.endswith("\n") and line.count("\n") == 1
        if want == "jsonl":
            text = _in_process(tiny_model_dir, out_audio(two_folders)).text
            assert json.loads(line)["text"] == text
        else:
            assert line.split("\t")[0] == str(out_audio(two_folders))
    else:
        assert run.returncode == 2 and want in run.stderr and "Traceback" not in run.stderr
        assert not out.exists() or out.is_dir()


def out_audio(two_folders: Path) -> Path:
    return two_folders / "a" / "utt_001.wav"


def test_resume_goes_by_the_resolved_file(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path
) -> None:
    """The same folder given relative, then absolute, then through a symlink is one job
    (it used to be transcribed again, duplicated); a file that changed is done again."""
    out = tmp_path / "out.jsonl"
    base = ["--model", str(tiny_model_dir), "--output", str(out), "--no-progress"]
    first = _job("data", *base, cwd=two_folders.parent)
    assert first.returncode == 0, first.stderr
    again = _job(str(two_folders), *base)
    assert again.returncode == 0 and "3 already done" in again.stderr, again.stderr
    (tmp_path / "link").symlink_to(two_folders)
    linked = _job(str(tmp_path / "link"), *base)
    assert "3 already done" in linked.stderr, linked.stderr
    assert len(out.read_text().splitlines()) == 3
    copy = tmp_path / "copy"
    shutil.copytree(two_folders, copy)
    changed = _job(str(copy / "a" / "utt_002.wav"), *base)
    assert "transcribed 1 of 1" in changed.stderr
    assert re.search(r"\(\d+\.\d s of audio\)", changed.stderr), changed.stderr  # not 0.00 h
    sf.write(copy / "a" / "utt_002.wav", np.zeros(8000, np.float32), 16000)  # edited
    edited = _job(str(copy / "a" / "utt_002.wav"), *base)
    assert "transcribed 1 of 1" in edited.stderr, edited.stderr


def test_other_settings_are_refused_unless_overwrite(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path
) -> None:
    """A rerun with --decoder beam used to keep the greedy results without a word."""
    pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")
    out = tmp_path / "out.jsonl"
    base = [str(two_folders), "--model", str(tiny_model_dir), "--output", str(out),
            "--no-progress"]  # fmt: skip
    assert _job(*base).returncode == 0
    before = out.read_text()
    beam = _job(*base, "--decoder", "beam", "--no-lm")
    assert beam.returncode == 2, beam.stderr
    assert "--overwrite" in beam.stderr and "'greedy' -> 'beam'" in beam.stderr
    assert out.read_text() == before
    redo = _job(*base, "--decoder", "beam", "--no-lm", "--overwrite")
    assert redo.returncode == 0 and "transcribed 3 of 3" in redo.stderr, redo.stderr
    assert len(out.read_text().splitlines()) == 3  # replaced, not appended
    # An output no job record speaks for is not appended to either.
    stray = tmp_path / "stray.jsonl"
    stray.write_text('{"audio_filepath": "x.wav", "text": "mine"}\n')
    refused = _job(*base[:-3], "--output", str(stray), "--no-progress")
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    assert stray.read_text() == '{"audio_filepath": "x.wav", "text": "mine"}\n'


def test_two_jobs_cannot_write_one_output(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path
) -> None:
    """The job record is locked while a job runs (here held by this test process, as a
    running job holds it); a second job on the same output stops before writing."""
    import fcntl

    out = tmp_path / "out.jsonl"
    base = [str(two_folders), "--model", str(tiny_model_dir), "--output", str(out),
            "--no-progress"]  # fmt: skip
    assert _job(*base).returncode == 0
    before = out.read_text()
    with open(tmp_path / "out.jsonl.job") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        second = _job(*base, "--overwrite")
    assert second.returncode == 2 and "another echoic transcribe" in second.stderr
    assert out.read_text() == before
    assert _job(*base).returncode == 0  # the lock went with its holder


def test_a_torn_last_line_is_set_aside(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path
) -> None:
    """Killed mid-write (power loss, a full disk): the output ends in half a line and the
    record never heard of that file. The rerun moves the fragment to OUT.torn and writes
    the file's line whole (it used to append after the fragment, for good)."""
    out = tmp_path / "out.jsonl"
    files = [str(p) for p in sorted(two_folders.rglob("*.wav"))]
    base = ["--model", str(tiny_model_dir), "--output", str(out), "--no-progress"]
    assert _job(*files[:2], *base).returncode == 0
    fragment = '{"audio_filepath": "' + files[2][:10]
    with open(out, "a") as f:
        f.write(fragment)
    run = _job(*files, *base)
    assert run.returncode == 0, run.stderr
    assert "out.jsonl.torn" in run.stderr and "2 already done" in run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["audio_filepath"] for r in rows] == files
    assert (tmp_path / "out.jsonl.torn").read_text() == fragment + "\n"


def test_a_line_the_record_never_heard_of_is_not_written_twice(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path
) -> None:
    """Killed after a file's line was written and before the record noted it: the
    rerun sets that line aside and writes the file once (not a second row)."""
    out = tmp_path / "out.jsonl"
    files = [str(p) for p in sorted(two_folders.rglob("*.wav"))]
    base = ["--model", str(tiny_model_dir), "--output", str(out), "--no-progress"]
    assert _job(*files, *base).returncode == 0
    lines = out.read_text().splitlines(keepends=True)
    record = (tmp_path / "out.jsonl.job").read_text().splitlines(keepends=True)
    (tmp_path / "out.jsonl.job").write_text("".join(record[:-1]))  # the last note, lost
    run = _job(*files, *base)
    assert run.returncode == 0 and "2 already done" in run.stderr, run.stderr
    assert out.read_text() == "".join(lines)  # the same three rows, none twice
    assert (tmp_path / "out.jsonl.torn").read_text() == lines[-1]


@pytest.mark.parametrize("fmt", ["jsonl", "tsv", "txt"])
def test_a_retried_file_keeps_one_row_in_input_order(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path, fmt: str
) -> None:
    """A file that failed (unreadable), then made readable and retried with
    --retry-failed: its transcript takes the place of its error row (which used to stay
    beside it, so the output still showed the failure), one row per input, in input
    order; the job record reads as one result per input, and a rerun has nothing to do."""
    data = tmp_path / "data"
    shutil.copytree(two_folders, data)
    files = [str(p) for p in sorted(data.rglob("*.wav"))]
    middle = Path(files[1])
    audio = middle.read_bytes()
    middle.write_bytes(b"not audio yet")
    out = tmp_path / ("out" if fmt == "txt" else f"out.{fmt}")
    where = ["--output-dir", str(out)] if fmt == "txt" else ["--output", str(out)]
    base = [*files, "--model", str(tiny_model_dir), "--format", fmt, *where, "--no-progress"]
    assert _job(*base).returncode == 1
    middle.write_bytes(audio)
    assert _job(*base).returncode == 1  # still failed before: not tried without the flag
    retried = _job(*base, "--retry-failed", "--json")
    assert retried.returncode == 0, retried.stderr
    summary = json.loads(retried.stdout)
    assert (summary["transcribed"], summary["failed"], summary["already_done"]) == (1, 0, 2)
    want = _texts(tiny_model_dir, data)
    if fmt == "jsonl":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["audio_filepath"] for r in rows] == files
        assert [r.get("text") for r in rows] == [want[str(Path(f).relative_to(data))]
                                                 for f in files]  # fmt: skip
    elif fmt == "tsv":
        rows = [line.split("\t") for line in out.read_text().splitlines()]
        assert rows == [[f, want[str(Path(f).relative_to(data))]] for f in files]
    else:
        written = sorted(str(p.relative_to(out)) for p in out.rglob("*.txt"))
        assert written == ["a/utt_001.txt", "a/utt_002.txt", "b/utt_001.txt"]
        assert (out / "a" / "utt_002.txt").read_text() == want["a/utt_002.wav"] + "\n"
    record = out / ".echoic-job" if fmt == "txt" else Path(f"{out}.job")
    noted = [json.loads(line) for line in record.read_text().splitlines()[1:]]
    if fmt != "txt":
        assert [n["key"] for n in noted] == files and all(n["error"] is None for n in noted)
        assert not list(tmp_path.glob("*.compacted*"))
    again = _job(*base, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["already_done"] == 3


def _record_of(tmp_path: Path, results: list[tuple[str, str]]):
    """A job record and its output (JSON lines) of `results`, (input, "text" | "error" |
    "busy") in the order they were written; "busy" is a transient refusal."""
    from echoic.cli.batch_io import Item
    from echoic.cli.batch_job import JobRecord

    out = tmp_path / "out.jsonl"
    record = JobRecord(tmp_path / "out.jsonl.job", out, {"format": "jsonl"}, overwrite=True)
    with open(out, "a") as f:
        for n, (name, kind) in enumerate(results):
            audio = tmp_path / f"{name}.wav"
            audio.touch()
            row = {"audio_filepath": name, kind: f"{kind} {n}"}
            f.write(json.dumps(row) + "\n")
            f.flush()
            error = None if kind == "text" else row[kind]
            record.note(Item(str(audio), str(audio)), error, f.tell(), transient=kind == "busy")
    return out, record


def _record_with_a_retry(tmp_path: Path):
    """A job record and its output, a.wav's error row superseded by a later text row."""
    return _record_of(tmp_path, [("a", "error"), ("b", "text"), ("a", "text")])


@pytest.mark.parametrize(
    ("results", "kept", "state"),
    [
        pytest.param([("a", "error"), ("b", "text"), ("a", "text")], ["text 2", "text 1"],
                     {"a": "done", "b": "done"}, id="retried-and-done"),
        pytest.param([("a", "error"), ("b", "text"), ("a", "error")], ["error 2", "text 1"],
                     {"a": "failed", "b": "done"}, id="retried-and-failed-again"),
        pytest.param([("a", "busy"), ("b", "text"), ("a", "text")], ["text 2", "text 1"],
                     {"a": "done", "b": "done"}, id="refused-busy-then-done"),
        pytest.param([("a", "error"), ("a", "busy"), ("b", "busy")], ["error 0", "busy 2"],
                     {"a": "failed", "b": "neither"}, id="a-failure-outlives-a-refusal"),
        pytest.param([("a", "busy"), ("a", "busy")], ["busy 1"], {"a": "neither"},
                     id="refused-twice"),
        pytest.param([("a", "text"), ("b", "text"), ("a", "text")], ["text 2", "text 1"],
                     {"a": "done", "b": "done"}, id="changed-and-done-again"),
    ],
)  # fmt: skip
def test_each_input_keeps_its_latest_result_in_the_place_of_its_first(
    tmp_path: Path, results: list[tuple[str, str]], kept: list[str], state: dict[str, str]
) -> None:
    """The rewrite keeps an input's latest result, a busy server's refusal only where
    nothing else was said; the rewritten record gives every input the state it had."""
    from echoic.cli.batch_io import Item
    from echoic.cli.batch_job import JobRecord

    out, record = _record_of(tmp_path, results)
    assert record.compact() == len(results) - len(kept)
    record.close()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [next(v for k, v in r.items() if k != "audio_filepath") for r in rows] == kept
    reopened = JobRecord(tmp_path / "out.jsonl.job", out, {"format": "jsonl"}, overwrite=False)
    for name, want in state.items():
        item = Item(str(tmp_path / f"{name}.wav"), str(tmp_path / f"{name}.wav"))
        got = ("done" if reopened.is_done(item) else
               "failed" if reopened.failed_before(item) else "neither")  # fmt: skip
        assert got == want, name
    assert reopened.end == out.stat().st_size
    reopened.close()


@pytest.mark.parametrize(
    "edit",
    [pytest.param(lambda t: t.replace("text 1", "text one"), id="a-row-edited"),
     pytest.param(lambda t: t[: len(t) // 2], id="cut-short")],
)  # fmt: skip
def test_an_output_edited_by_hand_is_not_rewritten(tmp_path: Path, edit) -> None:
    """Rows no longer where the record says they end: the rewrite would move the wrong
    bytes, so the output is left as it is."""
    out, record = _record_with_a_retry(tmp_path)
    out.write_text(edit(out.read_text()))
    edited = out.read_text()
    assert record.compact() == 0
    record.close()
    assert out.read_text() == edited


@pytest.mark.parametrize(
    "killed", [pytest.param(k, id=k) for k in ("after-the-commit", "before-the-commit")]
)
def test_a_killed_rewrite_is_finished_or_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, killed: str
) -> None:
    """The rewrite to one row per input is killed half way (here: the step after the
    point named raises, a fake kill at a seam this test is not about). The next job
    that opens the record finds the output and the record describing each other: the
    rewrite done, or not begun and done at that job's end; never a row lost or twice."""
    from echoic.cli import batch_job
    from echoic.cli.batch_job import JobRecord

    out, record = _record_with_a_retry(tmp_path)
    before = out.read_text()

    class Killed(BaseException):
        pass

    def kill(*_args) -> None:
        raise Killed

    if killed == "after-the-commit":
        monkeypatch.setattr(JobRecord, "_finish_compaction", kill)
    else:
        monkeypatch.setattr(batch_job.os, "replace", kill)
    with pytest.raises(Killed):
        record.compact()
    record.close()
    monkeypatch.undo()
    assert out.read_text() == before  # the output itself is not touched before the commit
    reopened = JobRecord(tmp_path / "out.jsonl.job", out, {"format": "jsonl"}, overwrite=False)
    if killed == "before-the-commit":
        assert out.read_text() == before
        assert reopened.compact() == 1
    reopened.close()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{"audio_filepath": "a", "text": "text 2"},
                    {"audio_filepath": "b", "text": "text 1"}]  # fmt: skip
    again = JobRecord(tmp_path / "out.jsonl.job", out, {"format": "jsonl"}, overwrite=False)
    assert [(Path(r["key"]).name, r["error"]) for r in again.rows] == [("a.wav", None),
                                                                     ("b.wav", None)]  # fmt: skip
    assert again.end == out.stat().st_size and again.compact() == 0
    again.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav", "b.wav", "out.jsonl",
                                                          "out.jsonl.job"]  # fmt: skip


def test_exit_codes_and_json_summary(
    tiny_model_dir: Path, two_folders: Path, mixed_folder: Path, tmp_path: Path
) -> None:
    """0 all done, 1 some inputs failed (listed), 2 the job could not run."""
    model = ["--model", str(tiny_model_dir), "--no-progress", "--json"]
    ok = _job(str(two_folders), *model, "--output", str(tmp_path / "ok.jsonl"))
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout)
    assert (summary["inputs"], summary["transcribed"], summary["failed"]) == (3, 3, 0)
    assert summary["outputs"] == [str(tmp_path / "ok.jsonl")]
    assert summary["audio_seconds"] > 1 and summary["wall_seconds"] > 0

    some = _job(str(mixed_folder), *model, "--output-dir", str(tmp_path / "subs"),
                "--format", "txt")  # fmt: skip
    assert some.returncode == 1, some.stderr
    summary = json.loads(some.stdout)
    assert summary["failed"] == 3 and summary["transcribed"] == 4
    assert sorted(Path(f["path"]).name for f in summary["failed_files"]) == [
        "corrupt.wav", "empty.wav", "noise.flac",
    ]  # fmt: skip
    assert "failed: " in some.stderr and "corrupt.wav" in some.stderr.splitlines()[-3]

    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = _job(str(empty), "--model", str(tiny_model_dir))
    assert nothing.returncode == 2 and "no audio files in" in nothing.stderr
    bad_args = _job(str(two_folders), "--shard", "3/2")
    assert bad_args.returncode == 2 and "--shard" in bad_args.stderr


def test_interrupted_job_exits_130_and_resumes(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path
) -> None:
    """SIGINT while the job waits for its inputs (a file list on a pipe that stays open):
    exit 130 and no traceback; the rerun does the whole job."""
    import signal

    from tests.conftest import sigint_deliverable

    out = tmp_path / "out.jsonl"
    with sigint_deliverable():
        job = subprocess.Popen(
            [*ECHOIC, "transcribe", "--files-from", "-", "--model", str(tiny_model_dir),
             "--output", str(out), "--no-progress"],
            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    job.stdin.write(str(out_audio(two_folders)) + "\n")
    job.stdin.flush()
    time.sleep(1.0)  # the signal may come before or after the interpreter is up: both 130
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 130 and "Traceback" not in err, err
    rerun = _job("--files-from", "-", "--model", str(tiny_model_dir), "--output", str(out),
                 "--no-progress", stdin=str(out_audio(two_folders)) + "\n")  # fmt: skip
    assert rerun.returncode == 0 and "transcribed 1 of 1" in rerun.stderr, rerun.stderr


def test_manifest_keeps_every_field_and_adds_pred_text(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path
) -> None:
    """NeMo's convention: the manifest's line as it was, plus pred_text (the reference
    `text` used to be overwritten and audio_filepath rewritten); in manifest order."""
    files = sorted(two_folders.rglob("*.wav"), reverse=True)
    rows = [{"audio_filepath": str(p.relative_to(two_folders)), "text": f"reference {n}",
             "duration": 9.5, "speaker": n} for n, p in enumerate(files)]  # fmt: skip
    (two_folders / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    run = _job(str(two_folders / "manifest.jsonl"), "--model", str(tiny_model_dir),
               "--output", str(out), "--no-progress", "--batch-size", "2")  # fmt: skip
    (two_folders / "manifest.jsonl").unlink()
    assert run.returncode == 0, run.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: g[k] for k in r} for g, r in zip(got, rows, strict=True)] == rows
    assert [g["pred_text"] for g in got] == [_in_process(tiny_model_dir, p).text for p in files]
    assert all(g["model"] == "echoic-tiny/1" and "words" in g for g in got)


def test_inputs_globs_shards_and_file_lists(
    tiny_model_dir: Path, two_folders: Path, tmp_path: Path
) -> None:
    """A quoted glob is expanded; --shard I/N splits the inputs into disjoint parts that
    together are all of them; a file list comes from a file or stdin."""
    model = ["--model", str(tiny_model_dir), "--no-progress"]
    every = sorted(str(p) for p in two_folders.rglob("*.wav"))

    def paths(run: subprocess.CompletedProcess) -> list[str]:
        assert run.returncode == 0, run.stderr
        return [line.split("\t")[0] for line in run.stdout.splitlines()]

    assert sorted(paths(_job(f"{two_folders}/**/*.wav", *model))) == every
    shards = [paths(_job(str(two_folders), "--shard", f"{i}/2", *model)) for i in (1, 2)]
    assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == every
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(every[:2]) + "\n\n")
    assert paths(_job("--files-from", str(listing), *model)) == every[:2]
    assert paths(_job("--files-from", "-", *model, stdin="\n".join(every))) == every
    nothing = _job(f"{two_folders}/*.mp3", *model)
    assert nothing.returncode == 2 and "no file matches" in nothing.stderr


def test_unsupported_and_truncated_files_are_reported(
    tiny_model_dir: Path, corpus_audio, tmp_path: Path
) -> None:
    """An .m4a in a folder is listed in the summary (it used to vanish) and the job exits
    1; a WAV whose data stops before its header says is transcribed with a warning."""
    root = tmp_path / "odd"
    root.mkdir()
    sf.write(root / "whole.wav", corpus_audio[0][1], 16000, subtype="PCM_16")
    (root / "phone.m4a").write_bytes(b"\x00\x00\x00\x20ftypM4A " + bytes(64))
    data = (root / "whole.wav").read_bytes()
    (root / "cut.wav").write_bytes(data[: 44 + (len(data) - 44) // 4 // 2 * 2])
    run = _job(str(root), "--model", str(tiny_model_dir), "--no-progress")
    assert run.returncode == 1, run.stderr
    assert "1 unsupported" in run.stderr and "unsupported (not read): " in run.stderr
    assert str(root / "phone.m4a") in run.stderr
    header = len(corpus_audio[0][1]) / 16000
    warning = next(line for line in run.stderr.splitlines() if "ends early" in line)
    assert "cut.wav" in warning and f"{header:.2f} s" in warning
    assert len(run.stdout.splitlines()) == 2  # both WAVs transcribed


def test_progress_bar_counts_whole_seconds_and_errors_get_their_own_line(
    tiny_model_dir: Path, mixed_folder: Path
) -> None:
    """The bar used to show float noise (60.400000000000006/932.6), and errors were
    printed onto the bar's line."""
    run = _job(str(mixed_folder), "--model", str(tiny_model_dir), "--batch-size", "1")
    assert run.returncode == 1
    counts = re.findall(r"\| ([\d.]+)/([\d.]+) \[", run.stderr)
    assert counts, run.stderr
    assert all(a.isdigit() and b.isdigit() for a, b in counts), counts
    for line in run.stderr.split("\n"):
        shown = line.split("\r")[-1]  # what a terminal shows once the line is done
        if "corrupt.wav" in shown and "failed:" not in shown:
            assert shown.startswith("echoic: "), repr(line)


PEAK_RSS = """\
import resource, subprocess, sys
run = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(run.stderr)
sys.stdout.write(run.stdout)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)  # KiB
sys.exit(run.returncode)
"""


@pytest.mark.slow
def test_a_long_file_is_transcribed_in_bounded_memory(
    tiny_model_dir: Path, corpus_audio, tmp_path: Path
) -> None:
    """30 minutes of speech in one file: decoded and recognized a block at a time through
    the streaming graph, in under 300 MB (the whole file at once took 1.1 GB here with
    this tiny model, 1.2 GB for 20 minutes with the bundled one), and the transcript is
    the whole-file one, word for word and time for time."""
    from echoic.model.core.audio import load_audio
    from echoic.model.core.decoding import FILE_ENDPOINTING
    from echoic.model.runtime.recognizer import Recognizer

    gap = np.zeros(4000, np.float32)
    speech = np.concatenate([x for _, a in corpus_audio for x in (a, gap)])
    talk = np.tile(speech, int(np.ceil(30 * 60 * 16000 / len(speech))))[: 30 * 60 * 16000]
    path = tmp_path / "talk.wav"
    sf.write(path, talk, 16000, subtype="PCM_16")
    del talk
    out = tmp_path / "out.jsonl"
    run = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *ECHOIC, "transcribe", str(path), "--model",
         str(tiny_model_dir), "--output", str(out), "--no-progress", "--threads", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    peak_mb = int(run.stderr.split()[-1]) / 1024
    assert peak_mb < 300, f"peak RSS {peak_mb:.0f} MB"
    got = json.loads(out.read_text())
    assert got["duration"] == 1800.0
    whole = Recognizer(tiny_model_dir, intra_op_threads=1).transcribe(
        [load_audio(path, 16000)], endpointing=FILE_ENDPOINTING
    )[0]  # cut at its pauses, as every file is
    assert len(whole.words) > 1000
    assert got["text"] == whole.text
    assert [(w["word"], w["start"], w["end"]) for w in got["words"]] == [
        (w.text, round(w.start, 3), round(w.end, 3)) for w in whole.words
    ]


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        pytest.param(3.0, "3.0 s", id="seconds"),
        pytest.param(270.0, "4.5 min", id="minutes"),
        pytest.param(7272.0, "2.02 h", id="hours"),
    ],
)
def test_audio_lengths_are_shown_in_the_unit_that_shows_them(seconds: float, shown: str) -> None:
    from echoic.cli.transcribe_local import audio_length

    assert audio_length(seconds) == shown


def test_a_beam_job_is_quiet_and_refused_settings_load_no_lm(two_folders, tmp_path) -> None:
    """A beam search prints nothing of KenLM's loading (its hint, path and progress bar,
    written by native code straight to fd 2); a job refused for its settings is refused
    before any LM loads (the --lm named here does not even exist)."""
    wav = str(two_folders / "a" / "utt_001.wav")
    out = tmp_path / "out.jsonl"
    beam = _job(wav, "--decoder", "beam", "--no-progress", "--output", str(out))
    assert beam.returncode == 0, beam.stderr
    assert "Loading the LM" not in beam.stderr and "*****" not in beam.stderr
    assert beam.stderr.count("\n") == 1, beam.stderr  # the summary line alone
    refused = _job(wav, "--decoder", "beam", "--lm", str(tmp_path / "nope.arpa"),
                   "--output", str(out))  # fmt: skip
    assert refused.returncode == 2
    assert "written with other settings" in refused.stderr, refused.stderr
