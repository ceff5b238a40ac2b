"""`echoic synth`: synthetic corpora from espeak-ng and flite, and the fortunes text source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from echoic.cli.main import main
from echoic.model.core.configs import ConfigError
from echoic.model.core.text import normalize_text
from echoic.training.corpus import (
    DEFAULT_FORTUNES_DIR,
    fortune_files,
    fortune_sentences,
    make_fortune_text,
    read_sentences,
    split_corpus,
    split_into_sentences,
)
from echoic.training.synth import (
    SynthConfig,
    SynthError,
    add_noise,
    find_programs,
    make_noise,
    synthesize_corpus,
)

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None, reason="espeak-ng is not installed"
)
needs_flite = pytest.mark.skipif(shutil.which("flite") is None, reason="flite is not installed")

SENTENCES = [
    "The cat sat on the mat.",
    "",
    "It’s 42 degrees today!",
    "Привет мир",  # Cyrillic letters: outside the default vocabulary
    "Open the window, please.",
    "   ",
    "Don't panic.",
]
USABLE = [s for s in SENTENCES if s.strip() and s != "Привет мир"]


def write_text(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_manifest(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def wav_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "wavs").glob("*.wav"))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    """One small corpus from both engines, two voices per sentence (built once)."""
    if shutil.which("espeak-ng") is None or shutil.which("flite") is None:
        pytest.skip("espeak-ng and flite are both needed")
    root = tmp_path_factory.mktemp("synth")
    text = write_text(root / "sentences.txt", SENTENCES)
    config = SynthConfig(voices_per_sentence=2, seed=3)
    summary = synthesize_corpus(text, root / "out", config, jobs=2)
    return text, root / "out", config, summary


# --- text ---------------------------------------------------------------------


def test_unusable_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    text = write_text(tmp_path / "s.txt", SENTENCES)
    sentences, skips = read_sentences(text)
    assert [s.text for s in sentences] == [normalize_text(s) for s in USABLE]
    assert [s.line for s in sentences] == [1, 3, 5, 7]
    assert (skips.empty, skips.unencodable, skips.first_unencodable) == (2, 1, 4)


@pytest.mark.parametrize(
    ("limit", "lines"),
    [pytest.param(2, [1, 3], id="limit-2"), pytest.param(0, [], id="limit-0")],
)
def test_limit_counts_usable_sentences(tmp_path: Path, limit: int, lines: list[int]) -> None:
    sentences, _ = read_sentences(write_text(tmp_path / "s.txt", SENTENCES), limit=limit)
    assert [s.line for s in sentences] == lines


# --- the corpus ---------------------------------------------------------------


@needs_espeak
@needs_flite
def test_corpus_has_one_wav_per_utterance_with_true_durations(corpus) -> None:
    _, out, _, summary = corpus
    entries = read_manifest(out / "manifest.jsonl")
    assert summary.utterances == len(entries) == 2 * len(USABLE)
    assert summary.written == len(entries) and summary.skipped_existing == 0
    assert (summary.skipped_text, summary.skipped_empty, summary.skipped_unencodable) == (3, 2, 1)
    assert [e["text"] for e in entries] == [normalize_text(s) for s in USABLE for _ in range(2)]
    assert len({e["audio_filepath"] for e in entries}) == len(entries)
    assert len(list((out / "wavs").glob("*.wav"))) == len(entries)
    assert not list((out / "wavs").glob(".*"))  # no temporary files left behind
    for entry in entries:
        path = Path(entry["audio_filepath"])
        assert path.is_absolute()
        info = sf.info(str(path))
        assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
        assert entry["duration"] == pytest.approx(info.frames / 16000, abs=1e-6)
        assert 0.3 < entry["duration"] < 10
    voices = [(e["engine"], e["voice"]) for e in entries]
    assert all(voices[i] != voices[i + 1] for i in range(0, len(voices), 2))  # per sentence
    assert summary.seconds == pytest.approx(sum(e["duration"] for e in entries), abs=1e-3)


@needs_espeak
@needs_flite
def test_rerun_synthesises_nothing(corpus) -> None:
    text, out, config, first = corpus
    manifest_before = (out / "manifest.jsonl").read_bytes()
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "wavs").glob("*.wav")}
    again = synthesize_corpus(text, out, config, jobs=2)
    assert (again.written, again.skipped_existing) == (0, first.utterances)
    assert {p: p.stat().st_mtime_ns for p in (out / "wavs").glob("*.wav")} == mtimes
    assert (out / "manifest.jsonl").read_bytes() == manifest_before


@needs_espeak
@needs_flite
def test_same_seed_same_bytes_whatever_the_jobs(corpus, tmp_path: Path) -> None:
    text, out, config, _ = corpus
    other = synthesize_corpus(text, tmp_path / "one-job", config, jobs=1)
    assert other.written == other.utterances
    assert wav_bytes(tmp_path / "one-job") == wav_bytes(out)
    strip = [
        {**e, "audio_filepath": Path(e["audio_filepath"]).name}
        for e in read_manifest(out / "manifest.jsonl")
    ]
    assert [
        {**e, "audio_filepath": Path(e["audio_filepath"]).name}
        for e in read_manifest(tmp_path / "one-job" / "manifest.jsonl")
    ] == strip


@needs_espeak
def test_variant_seed_draws_new_voices(tmp_path: Path) -> None:
    text = write_text(tmp_path / "s.txt", ["one small step", "a giant leap"])
    plans = []
    for variant in (0, 1):
        config = SynthConfig(engines=("espeak",), variant_seed=variant)
        synthesize_corpus(text, tmp_path / "out", config, jobs=2, relative_paths=True)
        plans.append(read_manifest(tmp_path / "out" / "manifest.jsonl"))
    assert [e["text"] for e in plans[0]] == [e["text"] for e in plans[1]]
    assert [(e["voice"], e["speed"]) for e in plans[0]] != [
        (e["voice"], e["speed"]) for e in plans[1]
    ]
    assert not {e["audio_filepath"] for e in plans[0]} & {e["audio_filepath"] for e in plans[1]}
    assert all((tmp_path / "out" / e["audio_filepath"]).is_file() for e in plans[0] + plans[1])


@needs_espeak
def test_noise_changes_the_audio_and_stays_in_range(tmp_path: Path) -> None:
    text = write_text(tmp_path / "s.txt", ["the quick brown fox", "jumps over the lazy dog"])
    clean = SynthConfig(engines=("espeak",), seed=5)
    noisy = SynthConfig(engines=("espeak",), seed=5, noise_prob=1.0, snr_db=(5.0, 10.0))
    synthesize_corpus(text, tmp_path / "clean", clean, jobs=2, relative_paths=True)
    synthesize_corpus(text, tmp_path / "noisy", noisy, jobs=2, relative_paths=True)
    for a, b in zip(
        read_manifest(tmp_path / "clean" / "manifest.jsonl"),
        read_manifest(tmp_path / "noisy" / "manifest.jsonl"),
        strict=True,
    ):
        assert (a["voice"], a["speed"], a["pitch"], a["noise"]) == (
            b["voice"],
            b["speed"],
            b["pitch"],
            None,
        )
        assert b["noise"] in ("white", "pink", "brown") and 5.0 <= b["snr_db"] <= 10.0
        x, _ = sf.read(tmp_path / "clean" / a["audio_filepath"], dtype="int16")
        y, _ = sf.read(tmp_path / "noisy" / b["audio_filepath"], dtype="int16")
        assert len(x) == len(y) and not np.array_equal(x, y)
        assert np.abs(y.astype(np.int32)).max() <= 0.99 * 32768


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in ("white", "pink", "brown")])
def test_noise_hits_the_snr_without_clipping(kind: str) -> None:
    t = np.arange(16000) / 16000
    speech = (0.9 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    mixed = add_noise(speech, kind, 10.0, seed=7)
    assert mixed.dtype == np.float32 and np.abs(mixed).max() <= 0.99 + 1e-6
    # Scaling to fit keeps the ratio: undo it with the speech component.
    gain = float(np.dot(mixed, speech) / np.dot(speech, speech))
    noise = mixed - gain * speech
    snr = 10 * np.log10(np.mean((gain * speech) ** 2) / np.mean(noise**2))
    assert snr == pytest.approx(10.0, abs=0.5)
    np.testing.assert_array_equal(mixed, add_noise(speech, kind, 10.0, seed=7))


def test_noise_colours_tilt_towards_low_frequencies() -> None:
    rng = np.random.default_rng(0)
    low_share = {}
    for kind in ("white", "pink", "brown"):
        power = np.abs(np.fft.rfft(make_noise(kind, 16000, rng))) ** 2
        low_share[kind] = power[: len(power) // 10].sum() / power.sum()
    assert low_share["white"] < low_share["pink"] < low_share["brown"]


# --- missing programs -----------------------------------------------------------


@pytest.mark.parametrize(
    ("on_path", "engines", "missing"),
    [
        pytest.param((), ("espeak",), "espeak-ng", id="no-espeak"),
        pytest.param((), ("flite",), "flite", id="no-flite"),
        pytest.param(("flite",), ("espeak", "flite"), "espeak-ng", id="flite-only-both-asked"),
        pytest.param(("espeak-ng",), ("flite", "espeak"), "flite", id="espeak-only-both-asked"),
    ],
)
def test_missing_program_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_path, engines, missing: str
) -> None:
    for program in on_path:
        (tmp_path / program).symlink_to("/usr/bin/true")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SynthError, match=rf"^{missing} not found on PATH"):
        find_programs(engines)


@needs_flite
def test_only_the_requested_engine_is_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "flite").symlink_to(shutil.which("flite"))
    monkeypatch.setenv("PATH", str(bin_dir))
    text = write_text(tmp_path / "s.txt", ["hello there"])
    summary = synthesize_corpus(text, tmp_path / "out", SynthConfig(engines=("flite",)), jobs=1)
    assert summary.written == 1
    assert read_manifest(summary.manifest)[0]["engine"] == "flite"


def test_cli_missing_program_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    text = write_text(tmp_path / "s.txt", ["hello"])
    code = main(["synth", "--text", str(text), "--out", str(tmp_path / "o"), "--engines", "espeak"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "espeak-ng not found on PATH" in err


@needs_espeak
def test_cli_json_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = write_text(tmp_path / "s.txt", ["hello world", "", "good morning"])
    argv = ["synth", "--text", str(text), "--out", str(tmp_path / "o"), "--engines", "espeak-ng"]
    assert main([*argv, "--json", "--jobs", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["written"], summary["skipped_existing"], summary["skipped_text"]) == (2, 0, 1)
    assert summary["seconds"] > 0 and summary["elapsed"] > 0
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 0


# --- fortunes -------------------------------------------------------------------

FORTUNES = """\
A clash of doctrine is not a disaster -- it is an opportunity.
%
A fake fortuneteller can be tolerated.  But an authentic soothsayer should
be shot on sight.  Cassandra did not get half the kicking around she deserved.
		-- R. A. Heinlein
%
Visit http://example.com for more wisdom today.
%
Mr. Smith went to Washington in the morning.
%
(1) Avoid fried meats which angry up the blood.
%
The UNIX way is the right way, they said.
%
A fake fortuneteller can be tolerated!
%
Short one.
"""


@pytest.mark.parametrize(
    ("paragraph", "expected"),
    [
        pytest.param("One. Two three!", ["One.", "Two three!"], id="two"),
        pytest.param(
            "Mr. Smith left. Then he came.", ["Mr. Smith left.", "Then he came."], id="mr"
        ),
        pytest.param(
            "Ask R. A. Heinlein. He knows.", ["Ask R. A. Heinlein.", "He knows."], id="initials"
        ),
        pytest.param("So do I. You too.", ["So do I.", "You too."], id="pronoun-i"),
    ],
)
def test_sentence_splitting(paragraph: str, expected: list[str]) -> None:
    assert split_into_sentences(paragraph) == expected


def test_fortune_sentences_are_clean_and_distinct(tmp_path: Path) -> None:
    (tmp_path / "wisdom").write_text(FORTUNES)
    sentences = fortune_sentences([tmp_path / "wisdom"], min_words=3, max_words=20)
    assert sentences == [
        "A clash of doctrine is not a disaster, it is an opportunity.",
        "A fake fortuneteller can be tolerated.",
        "But an authentic soothsayer should be shot on sight.",
        "Cassandra did not get half the kicking around she deserved.",
        "Mr. Smith went to Washington in the morning.",
    ]


def test_split_is_disjoint_and_deterministic() -> None:
    sentences = [f"sentence number {w}" for w in "abcdefghijklmnopqrst"]
    train, held = split_corpus(sentences, held_out=5, seed=1)
    assert len(held) == 5 and len(train) == 15 and not set(train) & set(held)
    assert sorted(train + held) == sorted(sentences)
    assert split_corpus(sentences, 5, seed=1) == (train, held)
    assert split_corpus(sentences, 5, seed=2) != (train, held)


@pytest.mark.skipif(not DEFAULT_FORTUNES_DIR.is_dir(), reason="fortunes are not installed")
def test_make_fortune_text_holds_out_unseen_sentences(tmp_path: Path) -> None:
    files = fortune_files()
    few = tmp_path / "few"
    few.mkdir()
    for path in files[:3]:
        shutil.copy(path, few / path.name)
    result = make_fortune_text(tmp_path / "text", fortunes_dir=few, held_out=20, seed=0)
    train = (tmp_path / "text" / "train.txt").read_text().splitlines()
    held = (tmp_path / "text" / "heldout.txt").read_text().splitlines()
    assert (len(train), len(held)) == (result["train"], result["heldout"]) and len(held) == 20
    assert not {normalize_text(s) for s in train} & {normalize_text(s) for s in held}
    assert all(3 <= len(s.split()) <= 20 for s in train + held)
    make_fortune_text(tmp_path / "again", fortunes_dir=few, held_out=20, seed=0)
    assert (tmp_path / "again" / "heldout.txt").read_text() == "\n".join(held) + "\n"


needs_festival = pytest.mark.skipif(
    shutil.which("text2wave") is None, reason="festival (text2wave) is not installed"
)


@needs_festival
@needs_espeak
@needs_flite
def test_three_engines_and_the_corpus_record(tmp_path: Path) -> None:
    """Festival's voices speak beside espeak-ng's and flite's, each diphone voice at the
    mean F0 drawn for it; corpus.json names every engine's version, the voices each
    offered and how many utterances each voice spoke."""
    import json

    text = write_text(tmp_path / "t.txt", USABLE * 3)
    config = SynthConfig(engines=("espeak", "flite", "festival"), voices_per_sentence=3, seed=4)
    summary = synthesize_corpus(text, tmp_path / "c", config)
    rows = [json.loads(line) for line in Path(summary.manifest).read_text().splitlines()]
    festival = [r for r in rows if r["engine"] == "festival"]
    assert festival and {r["engine"] for r in rows} == {"espeak", "flite", "festival"}
    for row in festival:
        audio, rate = sf.read(row["audio_filepath"])
        assert rate == 16000 and len(audio) / rate == pytest.approx(row["duration"], abs=1e-3)
        assert (row["pitch"] > 0) == (row["voice"] != "cmu_us_slt_arctic_hts")
    record = json.loads((tmp_path / "c" / "corpus.json").read_text())
    assert set(record["engines"]) == {"espeak", "flite", "festival"}
    assert "2.5" in record["engines"]["festival"] and "flite" in record["engines"]["flite"]
    assert {"kal_diphone", "ked_diphone"} <= set(record["voices"]["festival"])
    assert sum(record["utterances_per_voice"].values()) == len(rows)
    assert record["config"]["engines"] == ["espeak", "flite", "festival"]


def _centroid_hz(audio: np.ndarray, rate: int) -> float:
    """Spectral centroid of the voiced part (frames above -30 dB of the loudest)."""
    frames = np.lib.stride_tricks.sliding_window_view(audio, 512)[::256] * np.hanning(512)
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    energy = power.sum(axis=1)
    power = power[energy > energy.max() * 1e-3].sum(axis=0)
    freqs = np.fft.rfftfreq(512, 1 / rate)
    return float((power * freqs).sum() / power.sum())


KLATT = {"adam", "benjamin", "caleb", "david", "edward", "klatt", "klatt2", "klatt3", "klatt4"}
KLATT |= {"klatt6"}


@needs_espeak
def test_espeak_formant_factor_moves_the_spectrum_not_the_timing(tmp_path: Path) -> None:
    """A per-utterance formant factor (a shorter or longer vocal tract) renders each
    espeak-ng voice, its variant's own formants included, with its formants moved: the
    same words at the same speed, with the spectrum shifted the factor's way (Klatt
    variants, which ignore formant settings, keep factor 1). The factor
    is drawn apart from the other settings (voices, speeds and pitches stay as they were)
    and is in the manifest and the file name; factor 1 keeps the names files had."""
    text = write_text(tmp_path / "s.txt", ["the quick brown fox jumps over the lazy dog"] * 6)
    plain = SynthConfig(engines=("espeak",), voices_per_sentence=2, seed=8)
    rows = {}
    for name, formants in (("plain", (1.0, 1.0)), ("low", (0.85, 0.85)), ("high", (1.15, 1.15))):
        config = SynthConfig(**{**plain.__dict__, "espeak_formants": formants})
        summary = synthesize_corpus(text, tmp_path / name, config, jobs=2)
        rows[name] = read_manifest(summary.manifest)
    keep = ("voice", "speed", "pitch", "duration")
    for name in ("low", "high"):
        assert [{k: r[k] for k in keep} for r in rows[name]] == [
            {k: r[k] for k in keep} for r in rows["plain"]
        ]
    klatt = [i for i, r in enumerate(rows["high"]) if "formant" not in r]
    assert all(r["voice"].split("+")[-1] in KLATT for r in (rows["high"][i] for i in klatt))
    assert all("formant" not in r for r in rows["plain"])
    moved = [i for i in range(len(rows["plain"])) if i not in klatt]
    assert {rows["high"][i]["formant"] for i in moved} == {1.15} and len(moved) >= 4
    names = {Path(r["audio_filepath"]).name for v in rows.values() for r in v}
    assert len(names) == 12 + 2 * len(moved)  # factor 1 keeps its files' names
    assert any("+" in rows["plain"][i]["voice"] for i in moved)  # variants' own formants
    for i in moved:
        row = rows["plain"][i]
        centroid = {}
        for name in rows:
            audio, rate = sf.read(rows[name][i]["audio_filepath"])
            centroid[name] = _centroid_hz(audio, rate)
        assert centroid["low"] < centroid["plain"] < centroid["high"], (row["voice"], centroid)


def test_formant_variant_scales_formants_one_to_five() -> None:
    from echoic.training.synth import formant_variant

    base = "name male3\ngender male\nformant 0 100 100 100\nformant 1  96  97 100\n"
    lines = formant_variant(base, 1.1).splitlines()
    assert lines[:4] == [
        "name male3",
        "gender male",
        "formant 0 100 100 100",
        "formant 1 106 97 100",
    ]
    assert lines[4:] == [f"formant {n} 110 100 100" for n in range(2, 6)]
    assert formant_variant(None, 0.9).splitlines()[1] == "formant 1 90 100 100"
    with pytest.raises(ConfigError, match="espeak_formants"):
        SynthConfig(espeak_formants=(0.3, 1.0))


@needs_espeak
def test_every_espeak_accent_takes_its_variants(tmp_path: Path) -> None:
    """Each accent with a variant sounds unlike the accent alone (a voice named by its
    language code, `en-gb+m3`, silently drops the variant)."""
    from echoic.training.synth import Utterance, espeak_voices, render

    program = find_programs(["espeak"])["espeak"]
    voices = espeak_voices(program)
    accents = sorted({v.split("+")[0] for v in voices})
    assert len(accents) >= 5 and len(voices) == len(set(voices))
    for accent in accents:
        audio = {}
        for voice in (accent, f"{accent}+m3", f"{accent}+f2"):
            utt = Utterance(1, 0, "hello there", "espeak", voice, 1.0, 50.0, None, None, 0)
            audio[voice] = render(utt, program, 16000, str(tmp_path)).tobytes()
        assert len(set(audio.values())) == 3, accent


def test_wav_names_say_the_line_copy_and_words_and_change_with_the_audio() -> None:
    from dataclasses import replace

    from echoic.training.synth import Utterance

    said = Utterance(12, 1, "don't count your chickens before they hatch", "espeak",
                     "gmw/en-US", 1.0, 50, None, None, 0)  # fmt: skip
    assert said.name.startswith("000012-1-dont-count-your-chickens-before-")
    assert replace(said, speed=1.1).name != said.name  # another rendering, another file
