"""Held-out sets that measure robustness: `echoic degrade` writes degraded copies of a
set, and `echoic eval` puts any number of sets and decoders in one table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from echoic.cli.main import main


@pytest.fixture(scope="module")
def degraded(speech_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("degraded")
    assert main(["degrade", str(speech_corpus), str(out)]) == 0
    return out


def _rows(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text().splitlines()]


def _db(x: np.ndarray) -> float:
    return 20 * np.log10(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def test_each_kind_is_what_it_says(speech_corpus: Path, degraded: Path) -> None:
    source = _rows(speech_corpus)
    for kind in ("mulaw8k", "reverb", "noisy10db", "quiet"):
        rows = _rows(degraded / kind / "manifest.jsonl")
        assert len(rows) == len(source)
        for r, s in zip(rows, source, strict=True):
            assert (r["degradation"], r["text"], r["engine"]) == (kind, s["text"], s["engine"])
        for row, src in zip(rows[:5], source[:5], strict=True):
            info = sf.info(row["audio_filepath"])
            clean, _ = sf.read(src["audio_filepath"], dtype="float32")
            audio, rate = sf.read(row["audio_filepath"], dtype="float32")
            assert abs(len(audio) / rate - len(clean) / 16000) < 0.01
            if kind == "mulaw8k":
                assert (info.samplerate, info.subtype) == (8000, "ULAW")
                spectrum = np.abs(np.fft.rfft(audio)) ** 2
                freqs = np.fft.rfftfreq(len(audio), 1 / 8000)
                inside = spectrum[(freqs > 400) & (freqs < 3300)].sum()
                assert spectrum[freqs > 3500].sum() < 0.01 * inside
            elif kind == "quiet":
                assert abs(_db(audio) - -35.0) < 0.1
            elif kind == "noisy10db":
                assert abs(_db(clean) - _db(audio - clean) - 10.0) < 0.3  # PCM16 rounding
            else:
                assert (info.samplerate, info.subtype) == (16000, "PCM_16")
                assert not np.allclose(audio, clean, atol=0.01)


def test_what_a_file_gets_depends_on_its_kind_not_the_kinds_asked_for(
    speech_corpus: Path, degraded: Path, tmp_path
) -> None:
    """Alone, into a fresh folder: the same files, byte for byte, as with all four kinds."""
    assert main(["degrade", str(speech_corpus), str(tmp_path), "--kinds", "reverb"]) == 0
    alone = {p.name: p.read_bytes() for p in (tmp_path / "reverb").rglob("*.wav")}
    with_all = {p.name: p.read_bytes() for p in (degraded / "reverb").rglob("*.wav")}
    assert alone == with_all and alone
    assert main(["degrade", str(speech_corpus), str(tmp_path), "--kinds", "thunder"]) == 1


def test_eval_puts_sets_decoders_and_groups_in_one_table(
    tiny_lm_model_dir: Path, speech_corpus: Path, degraded: Path, capsys
) -> None:
    sets = [str(speech_corpus), str(degraded / "mulaw8k" / "manifest.jsonl")]
    argv = ["eval", "--model", str(tiny_lm_model_dir), "--manifest", *sets,
            "--decoders", "greedy,beam", "--by", "engine", "--limit", "8", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    names = [r["set"] for r in report["rows"]]
    assert names[0] == "corpus" and "mulaw8k" in names
    assert any(n.startswith("corpus engine=") for n in names)
    for row in report["rows"]:
        assert {"wer_greedy", "cer_greedy", "wer_beam", "cer_beam"} <= set(row)
    whole = next(r for r in report["rows"] if r["set"] == "corpus")
    parts = [r for r in report["rows"] if r["set"].startswith("corpus engine=")]
    assert sum(p["utterances"] for p in parts) == whole["utterances"] == 8
    single = ["eval", "--model", str(tiny_lm_model_dir), "--manifest", sets[0], "--limit", "8",
              "--json"]  # fmt: skip
    assert main(single) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["wer"] == whole["wer_greedy"] and alone["utterances"] == 8


@pytest.mark.parametrize(
    ("model", "extra", "decoder"),
    [
        pytest.param("tiny_lm_model_dir", [], "beam", id="an-lm-at-hand-is-beam"),
        pytest.param("tiny_lm_model_dir", ["--no-lm"], "greedy", id="no-lm-is-greedy"),
        pytest.param("tiny_model_dir", [], "greedy", id="no-lm-shipped-is-greedy"),
    ],
)
def test_eval_decoder_auto_measures_what_transcribe_would_run(
    model: str, extra: list[str], decoder: str, speech_corpus: Path, request, capsys
) -> None:
    model_dir = request.getfixturevalue(model)
    argv = ["eval", "--model", str(model_dir), "--manifest", str(speech_corpus),
            "--decoder", "auto", "--limit", "2", "--json", *extra]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["decoder"] == decoder
