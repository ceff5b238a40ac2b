"""`echoic import`: LibriSpeech, Common Voice and Kaldi data directories into manifests.

Each corpus is built by the test in its real layout from speech that espeak-ng
renders here (FLAC for LibriSpeech, 48 kHz MP3 for Common Voice, WAV recordings
cut by `segments` and a `sox ... |` command for Kaldi), with the kinds of bad lines
real corpora have.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from echoic.cli.main import main
from echoic.model.core.audio import load_audio
from echoic.model.core.text import Vocabulary
from echoic.training.data import DataConfig, read_manifest
from echoic.training.importers import CORPORA, CorpusError, ImportConfig, import_corpus
from echoic.training.transcripts import check_transcript, normalize_transcript, year_words
from tests.conftest import TINY_RECIPE

RATE = 16000
LINES = (
    "the cat sat on the mat",
    "open the window please",
    "do not panic",
    "good things come to those who wait",
    "time flies like an arrow",
)


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    """LINES spoken by espeak-ng, float32 at 16 kHz."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/bootstrap.sh installs it)")
    out = tmp_path_factory.mktemp("espeak")
    rendered = []
    for i, line in enumerate(LINES):
        wav = out / f"{i}.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(wav), line], check=True)
        audio, rate = sf.read(wav, dtype="float32")
        rendered.append(soxr.resample(audio, rate, RATE).astype(np.float32))
    return rendered


def _manifest(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _librispeech(root: Path, speech: list[np.ndarray]) -> Path:
    """LibriSpeech/dev-clean with two chapters of two speakers; chapter 2 has a line
    whose FLAC is missing and one with no transcript."""
    subset = root / "LibriSpeech" / "dev-clean"
    chapters = {
        ("84", "121123"): [(0, LINES[0].upper()), (1, "OPEN THE WINDOW PLEASE")],
        ("174", "50561"): [(2, "DON'T PANIC"), (None, "THIS FILE IS MISSING"), (3, "")],
    }
    for (speaker, chapter), utts in chapters.items():
        folder = subset / speaker / chapter
        folder.mkdir(parents=True)
        lines = []
        for n, (which, text) in enumerate(utts):
            utt = f"{speaker}-{chapter}-{n:04d}"
            lines.append(f"{utt} {text}".rstrip())
            if which is not None:
                sf.write(folder / f"{utt}.flac", speech[which], RATE, format="FLAC")
        (folder / f"{speaker}-{chapter}.trans.txt").write_text("\n".join(lines) + "\n")
    return root / "LibriSpeech"


def test_librispeech(tmp_path: Path, speech: list[np.ndarray]) -> None:
    src = _librispeech(tmp_path, speech)
    summary = import_corpus("librispeech", src, tmp_path / "ls.jsonl")
    rows = _manifest(tmp_path / "ls.jsonl")
    # sorted by transcript file: speaker 174 before 84
    assert [r["text"] for r in rows] == ["don't panic", LINES[0], LINES[1]]
    assert [r["id"] for r in rows] == ["174-50561-0000", "84-121123-0000", "84-121123-0001"]
    assert [r["speaker"] for r in rows] == ["174", "84", "84"]
    for row, which in zip(rows, (2, 0, 1), strict=True):
        assert row["audio_filepath"].endswith(f"{row['id']}.flac")
        assert Path(row["audio_filepath"]).is_absolute()
        assert row["duration"] == pytest.approx(len(speech[which]) / RATE, abs=1e-6)
    assert summary.kept == 3 and dict(summary.skipped) == {"missing_file": 1, "empty_text": 1}
    trans = src / "dev-clean" / "174" / "50561" / "174-50561.trans.txt"
    assert f"{trans}:2: 174-50561-0001: no such audio file" in summary.problems[0]
    assert summary.problems[1].startswith(f"{trans}:3: 174-50561-0002: the transcript is empty")
    utts, report = read_manifest(tmp_path / "ls.jsonl", Vocabulary(), DataConfig())
    assert len(utts) == 3 and not report.skipped and not report.duration_fixes


@pytest.mark.parametrize(
    ("config", "kept", "skipped"),
    [
        pytest.param(
            ImportConfig(limit=2), 2, {"missing_file": 1, "empty_text": 1}, id="limit"
        ),  # the two skipped lines come before the second usable one
        pytest.param(ImportConfig(max_duration=1.2), 1, None, id="max-duration"),
    ],
)
def test_librispeech_limit_and_max_duration(
    tmp_path: Path, speech: list[np.ndarray], config: ImportConfig, kept: int, skipped
) -> None:
    src = _librispeech(tmp_path, speech)
    summary = import_corpus("librispeech", src, tmp_path / "ls.jsonl", config)
    assert summary.kept == kept == len(_manifest(tmp_path / "ls.jsonl"))
    if skipped is not None:
        assert dict(summary.skipped) == skipped
    else:
        long = sum(len(speech[i]) / RATE > 1.2 for i in (0, 1, 2))
        assert summary.skipped["too_long"] == long == 3 - kept
        assert all(r["duration"] <= 1.2 for r in _manifest(tmp_path / "ls.jsonl"))


CV_HEADER = "client_id\tpath\tsentence\tup_votes\tdown_votes\tage\tgender\taccents\tlocale\tsegment"


def _commonvoice(root: Path, speech: list[np.ndarray]) -> Path:
    """A Common Voice language folder: 48 kHz MP3 clips, validated.tsv and train.tsv."""
    lang = root / "cv-corpus" / "en"
    (lang / "clips").mkdir(parents=True)
    rows = [
        ("a1", 0, "The cat sat on the mat."),
        ("a2", 1, "“Open the window,” please — it’s 1999!"),
        ("b7", 3, "Привет мир"),  # Cyrillic: outside the vocabulary
        ("b7", 4, "Café au lait costs $5.50 on the 21st."),
        ("c3", None, "A clip that is not MP3 at all."),
    ]
    lines = [CV_HEADER]
    for n, (client, which, sentence) in enumerate(rows):
        clip = f"common_voice_en_{1000 + n}.mp3"
        if which is None:
            (lang / "clips" / clip).write_bytes(b"ID3 this is not audio" * 20)
        else:
            audio = soxr.resample(speech[which], RATE, 48000).astype(np.float32)
            sf.write(lang / "clips" / clip, audio, 48000, format="MP3")
        lines.append(f"{client}\t{clip}\t{sentence}\t2\t0\t\t\t\ten\t")
    lines.insert(3, "d9\tcommon_voice_en_9.mp3\ttoo few fields")
    (lang / "validated.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (lang / "train.tsv").write_text("\n".join(lines[:2]) + "\n", encoding="utf-8")
    return lang


def test_commonvoice(tmp_path: Path, speech: list[np.ndarray]) -> None:
    src = _commonvoice(tmp_path, speech)
    summary = import_corpus("commonvoice", src, tmp_path / "cv.jsonl")
    rows = _manifest(tmp_path / "cv.jsonl")
    assert [r["text"] for r in rows] == [
        LINES[0],
        "open the window please it's nineteen ninety nine",
        "cafe au lait costs five dollars fifty cents on the twenty first",
    ]
    assert [r["speaker"] for r in rows] == ["a1", "a2", "b7"]
    assert [r["id"] for r in rows] == [f"common_voice_en_{n}" for n in (1000, 1001, 1003)]
    for row, which in zip(rows, (0, 1, 4), strict=True):
        assert row["duration"] == pytest.approx(len(speech[which]) / RATE, abs=0.01)
    assert dict(summary.skipped) == {
        "malformed_line": 1,
        "out_of_vocabulary": 1,
        "undecodable": 1,
    }
    tsv = src / "validated.tsv"
    assert summary.problems[0] == (f"{tsv}:4: -: 3 tab-separated fields where the header has 10")
    assert summary.problems[1].startswith(f"{tsv}:5: common_voice_en_1002: characters outside")
    assert summary.problems[2].startswith(f"{tsv}:7: common_voice_en_1004: ")
    # the MP3s train as they are: the loader decodes them
    utts, _ = read_manifest(tmp_path / "cv.jsonl", Vocabulary(), DataConfig())
    assert len(load_audio(utts[0].path, RATE)) == pytest.approx(len(speech[0]), abs=0.01 * RATE)

    only_train = import_corpus(
        "commonvoice", src, tmp_path / "train.jsonl", ImportConfig(tsv="train.tsv")
    )
    assert only_train.kept == 1 and not only_train.skipped


def _kaldi(root: Path, speech: list[np.ndarray], command: str = "sox {} -t wav - |") -> Path:
    """A Kaldi data directory: recording A (WAV, three utterances 0.5 s apart, cut by
    segments, one segment past its end) and B (read through a command)."""
    data = root / "data" / "train"
    data.mkdir(parents=True)
    gap = np.zeros(RATE // 2, np.float32)
    recording = np.concatenate([gap, speech[0], gap, speech[1], gap, speech[2], gap])
    sf.write(root / "A.wav", recording, RATE, subtype="PCM_16")
    sf.write(root / "B.flac", speech[3], RATE, format="FLAC")
    starts = np.cumsum([0.5, len(speech[0]) / RATE + 0.5, len(speech[1]) / RATE + 0.5])
    segments = [
        f"A-{i} A {start:.6f} {start + len(speech[i]) / RATE:.6f}" for i, start in enumerate(starts)
    ]
    length = len(recording) / RATE
    segments += [f"A-9 A {length - 0.5:.3f} {length + 3:.3f}", "B-0 B 0 -1", "A-7 A 1.0 nan"]
    texts = [f"A-{i} {LINES[i].upper()}" for i in range(3)]
    texts += ["A-9 PAST THE END", "B-0 GOOD THINGS COME TO THOSE WHO WAIT", "A-7 BAD TIMES"]
    texts += ["C-0 NO SEGMENT FOR THIS ONE", "A-1 A DUPLICATE"]
    (data / "wav.scp").write_text(f"A {root / 'A.wav'}\nB {command.format(root / 'B.flac')}\n")
    (data / "segments").write_text("\n".join(segments) + "\n")
    (data / "text").write_text("\n".join(texts) + "\n")
    (data / "utt2spk").write_text("A-0 alice\nA-1 bob\nA-2 alice\nB-0 carol\n")
    return data


@pytest.mark.skipif(shutil.which("sox") is None, reason="sox is not installed")
def test_kaldi_segments_and_commands(tmp_path: Path, speech: list[np.ndarray]) -> None:
    data = _kaldi(tmp_path, speech)
    manifest = tmp_path / "out" / "kaldi.jsonl"
    summary = import_corpus("kaldi", data, manifest, ImportConfig(allow_commands=True))
    rows = _manifest(manifest)
    assert [r["id"] for r in rows] == ["A-0", "A-1", "A-2", "B-0"]
    assert [r["text"] for r in rows] == list(LINES[:4])
    assert [r["speaker"] for r in rows] == ["alice", "bob", "alice", "carol"]
    assert summary.written == 4 and summary.reused == 0
    # each segment's WAV holds exactly that stretch of its recording
    for row, which in zip(rows, range(4), strict=True):
        assert Path(row["audio_filepath"]).parent == tmp_path / "out" / "kaldi.audio"
        cut = load_audio(row["audio_filepath"], RATE)
        assert abs(len(cut) - len(speech[which])) <= 2
        n = min(len(cut), len(speech[which]))
        assert np.abs(cut[:n] - speech[which][:n]).max() < 2e-3
        assert row["duration"] == pytest.approx(len(cut) / RATE, abs=1e-6)
    text = data / "text"
    assert dict(summary.skipped) == {
        "bad_segment": 1,
        "malformed_line": 1,
        "no_audio": 1,
        "duplicate_id": 1,
    }
    assert f"{text}:4: A-9: segment " in summary.problems[0]
    assert "outside its recording" in summary.problems[0]
    assert summary.problems[1].startswith(f"{data / 'segments'}:6: A-7: expected")
    assert summary.problems[2] == f"{text}:7: C-0: no line for it in {data / 'segments'}"
    assert summary.problems[3] == f"{text}:8: A-1: also at {text}:2"

    # a rerun writes nothing and the same manifest; one lost WAV is written again
    before = manifest.read_bytes()
    again = import_corpus("kaldi", data, manifest, ImportConfig(allow_commands=True))
    assert (again.written, again.reused) == (0, 4) and manifest.read_bytes() == before
    Path(rows[1]["audio_filepath"]).unlink()
    manifest.unlink()
    third = import_corpus("kaldi", data, manifest, ImportConfig(allow_commands=True))
    assert (third.written, third.reused) == (1, 3) and manifest.read_bytes() == before
    # a changed segment is cut again, not taken from the earlier run's file
    segments = data / "segments"
    segments.write_text(segments.read_text().replace("A-0 A 0.500000", "A-0 A 0.600000"))
    fourth = import_corpus("kaldi", data, manifest, ImportConfig(allow_commands=True))
    assert (fourth.written, fourth.reused) == (1, 3)
    assert _manifest(manifest)[0]["duration"] == pytest.approx(rows[0]["duration"] - 0.1, abs=1e-4)


def test_kaldi_whole_recordings_without_segments(tmp_path: Path, speech: list[np.ndarray]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    sf.write(tmp_path / "u1.wav", speech[0], RATE)
    (data / "wav.scp").write_text(
        f"u1 {tmp_path / 'u1.wav'}\nu2 {tmp_path / 'gone.wav'}\nu3 raw/feats.ark:1234\nu5\n"
    )
    (data / "text").write_text(
        "u1 THE CAT SAT ON THE MAT\nu2 GONE\nu3 AN ARCHIVE\nu4 NO WAV\nu5 NO PATH\n"
    )
    summary = import_corpus("kaldi", data, tmp_path / "k.jsonl")
    rows = _manifest(tmp_path / "k.jsonl")
    assert [(r["id"], r["audio_filepath"]) for r in rows] == [("u1", str(tmp_path / "u1.wav"))]
    assert dict(summary.skipped) == {
        "missing_file": 1,
        "unsupported_audio": 1,
        "no_audio": 1,
        "malformed_line": 1,
    }
    assert "wav.scp:3 gives u3 as an archive offset" in summary.problems[1]
    wav_scp = data / "wav.scp"
    assert summary.problems[2] == f"{data / 'text'}:4: u4: recording u4 is not in {wav_scp}"
    assert (
        summary.problems[3] == f"{data / 'text'}:5: u5: {wav_scp}:4 gives no file or command for u5"
    )
    assert not (tmp_path / "k.audio").exists()  # nothing needed writing


@pytest.mark.parametrize(
    ("command", "reason", "detail"),
    [
        pytest.param("false {} |", "command_failed", "exited with 1", id="fails"),
        pytest.param("true {} |", "command_failed", "wrote no audio", id="no-output"),
        pytest.param("echo not audio {} |", "undecodable", "cannot decode audio", id="not-audio"),
    ],
)
def test_kaldi_commands_that_do_not_give_audio(
    tmp_path: Path, speech: list[np.ndarray], command: str, reason: str, detail: str
) -> None:
    data = _kaldi(tmp_path, speech, command)
    summary = import_corpus("kaldi", data, tmp_path / "k.jsonl", ImportConfig(allow_commands=True))
    assert summary.skipped[reason] == 1 and summary.kept == 3
    message = next(m for m in summary.problems if ": B-0: " in m)
    assert message.startswith(f"{data / 'text'}:5: B-0: ") and detail in message


def test_kaldi_commands_run_only_when_allowed(tmp_path: Path, speech: list[np.ndarray]) -> None:
    data = _kaldi(tmp_path, speech, "touch {}.ran |")
    with pytest.raises(CorpusError, match=r"wav\.scp:2: B is a command .*--allow-commands"):
        import_corpus("kaldi", data, tmp_path / "k.jsonl")
    assert not (tmp_path / "B.flac.ran").exists()


@pytest.mark.parametrize(
    ("corpus", "make", "match"),
    [
        pytest.param("librispeech", lambda d: d, r"no \*\.trans\.txt files", id="ls-empty"),
        pytest.param("commonvoice", lambda d: d, r"validated\.tsv: no such file", id="cv-no-tsv"),
        pytest.param(
            "commonvoice",
            lambda d: (d / "validated.tsv").write_text("client_id\tfile\ttext\n"),
            r"validated\.tsv:1: the header has no path or sentence column",
            id="cv-header",
        ),
        pytest.param("kaldi", lambda d: d, r"text: no such file", id="kaldi-no-text"),
        pytest.param(
            "kaldi",
            lambda d: [(d / n).write_text(f"u1 {n}\nu1 again\n") for n in ("text", "wav.scp")],
            r"wav\.scp:2: u1 is listed twice \(first at line 1\)",
            id="kaldi-duplicate-recording",
        ),
        pytest.param(
            "librispeech",
            lambda d: (d / "1-2.trans.txt").write_bytes(b"1-2-0000 caf\xe9\n"),
            r"1-2\.trans\.txt: not UTF-8 text",
            id="ls-not-utf8",
        ),
    ],
)
def test_sources_that_cannot_be_imported(tmp_path: Path, corpus: str, make, match: str) -> None:
    make(tmp_path)
    with pytest.raises(CorpusError, match=match):
        import_corpus(corpus, tmp_path, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_nothing_usable_is_an_error_that_shows_why(tmp_path: Path) -> None:
    (tmp_path / "1-2.trans.txt").write_text("1-2-0000 HELLO\n")
    with pytest.raises(CorpusError, match=r"nothing to import; kept 0 .*1 missing_file\n.*:1: 1-2"):
        import_corpus("librispeech", tmp_path, tmp_path / "out.jsonl")


def test_cli_json_summary_and_one_line_errors(
    tmp_path: Path, speech: list[np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    src = _librispeech(tmp_path, speech)
    out = tmp_path / "ls.jsonl"
    assert main(["import", "librispeech", str(src), str(out), "--limit", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kept"] == 2 and summary["skipped"] == {"missing_file": 1, "empty_text": 1}
    assert summary["manifest"] == str(out) and len(_manifest(out)) == 2

    assert main(["import", "librispeech", str(src), str(out)]) == 0
    captured = capsys.readouterr()
    assert re.fullmatch(
        rf"kept 3 utterances \(0\.00 h\) -> {re.escape(str(out))}; skipped 2: 1 empty_text,"
        r" 1 missing_file\n",
        captured.out,
    )
    assert captured.err.count("skipped ") == 2 and ".trans.txt:2: 174-50561-0001" in captured.err

    # the command offers every layout (its choices are spelled out: `echoic --help` must
    # not import the importers)
    with pytest.raises(SystemExit):
        main(["import", "timit", str(src), str(out)])
    offered = capsys.readouterr().err.split("choose from", 1)[1]
    assert re.findall(r"\w+", offered) == list(CORPORA)

    assert main(["import", "kaldi", str(tmp_path / "nowhere"), str(out)]) == 1
    err = capsys.readouterr().err
    assert err == f"echoic import: error: {tmp_path / 'nowhere'}: no such directory\n"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("HELLO WORLD", "hello world", id="case"),
        pytest.param("It’s “quoted” — isn’t it?", "it's quoted isn't it", id="unicode-quotes"),
        pytest.param("'Tis the rock 'n' roll", "tis the rock n roll", id="outer-apostrophes"),
        pytest.param("Crème brûlée, naïve façade", "creme brulee naive facade", id="accents"),
        pytest.param("Æsop and Œdipus", "aesop and oedipus", id="ligatures"),
        pytest.param("42 and 1,000,001", "forty two and one million one", id="integers"),
        pytest.param("the 21st and 3rd", "the twenty first and third", id="ordinals"),
        pytest.param("3.14 and 0.5", "three point one four and zero point five", id="decimals"),
        pytest.param("50% off", "fifty percent off", id="percent"),
        pytest.param("in 1999, 1905", "in nineteen ninety nine nineteen oh five", id="years"),
        pytest.param("by 1900, in 2024", "by nineteen hundred in twenty twenty four", id="years-2"),
        pytest.param("in 2005", "in two thousand five", id="year-2000s"),
        pytest.param("1,999 men", "one thousand nine hundred ninety nine men", id="not-a-year"),
        pytest.param("the 1990s and ’80s", "the nineteen nineties and eighties", id="decades"),
        pytest.param("$1 or $5.50", "one dollar or five dollars fifty cents", id="dollars"),
        pytest.param("£2.01, €3 million", "two pounds one penny three million euros", id="money"),
        pytest.param("2 + 2 = 4", "two plus two equals four", id="symbols"),
        pytest.param("Mr. and Mrs. Dr. Who", "mister and missus doctor who", id="abbreviations"),
        pytest.param("Tom & Jerry; (etc.)", "tom and jerry et cetera", id="punctuation"),
    ],
)
def test_normalisation(raw: str, expected: str) -> None:
    assert normalize_transcript(raw) == expected
    assert check_transcript(raw, Vocabulary()) == (expected, "", "")


@pytest.mark.parametrize(
    ("raw", "reason", "detail"),
    [
        pytest.param("...!?", "empty_text", "empty after normalisation ('...!?')", id="empty"),
        pytest.param("", "empty_text", "empty after normalisation ('')", id="blank"),
        pytest.param("Ελλάδα", "out_of_vocabulary", "'α' (U+03B1)", id="greek"),
        pytest.param("東京 Tokyo", "out_of_vocabulary", "(in '東京 Tokyo')", id="cjk"),
    ],
)
def test_transcripts_that_cannot_be_used(raw: str, reason: str, detail: str) -> None:
    text, why, message = check_transcript(raw, Vocabulary())
    assert (text, why) == ("", reason) and detail in message


@pytest.mark.parametrize(
    ("year", "words"),
    [
        pytest.param(1066, "one thousand sixty six", id="before-1100"),
        pytest.param(1100, "eleven hundred", id="1100"),
        pytest.param(1909, "nineteen oh nine", id="oh"),
        pytest.param(2000, "two thousand", id="2000"),
        pytest.param(2010, "twenty ten", id="2010"),
        pytest.param(2099, "twenty ninety nine", id="2099"),
    ],
)
def test_year_words(year: int, words: str) -> None:
    assert year_words(year) == words


@pytest.mark.slow
def test_tiny_recipe_trains_on_an_imported_corpus(tmp_path: Path, speech_corpus: Path) -> None:
    """The session's synthesized corpus laid out as LibriSpeech (FLAC, upper-case
    transcripts), imported, and trained on for a few steps by a real `echoic train`."""
    chapter = tmp_path / "LibriSpeech" / "train-clean-5" / "19" / "198"
    chapter.mkdir(parents=True)
    lines = []
    for n, row in enumerate(_manifest(speech_corpus)):
        utt = f"19-198-{n:04d}"
        audio = load_audio(speech_corpus.parent / row["audio_filepath"], RATE)
        sf.write(chapter / f"{utt}.flac", audio, RATE, format="FLAC")
        lines.append(f"{utt} {row['text'].upper()}")
    (chapter / "19-198.trans.txt").write_text("\n".join(lines) + "\n")
    manifest = tmp_path / "train.jsonl"
    summary = import_corpus("librispeech", tmp_path / "LibriSpeech", manifest)
    assert summary.kept == len(lines) and not summary.skipped
    run = subprocess.run(
        [sys.executable, "-m", "echoic.cli.main", "train", "--config", str(TINY_RECIPE),
         "--no-progress", "threads=1", "max_steps=4", "checkpoint_every=4",
         f"data.train_manifest={manifest}", f"out_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses and all(np.isfinite(losses))
    assert (tmp_path / "run" / "last.pt").is_file()
