"""int8 models (`echoic quantize`, `echoic export --quantize int8`): the card says so, the
graphs keep parity with fp32 on speech, and streaming still equals offline.

Real parts: the bundled model quantized by ONNX Runtime, calibrated on the first half of
the synthesized corpus and checked on the other half; tiny networks saved as real
checkpoints for the export path.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jiwer
import numpy as np
import onnx
import pytest

from echoic.cli.main import main
from echoic.model.nn.quantize import QuantizeError, quantize_model
from echoic.model.runtime.card import read_card
from echoic.model.runtime.engine import Engine
from echoic.model.runtime.recognizer import Recognizer, default_model_dir
from tests.streaming import stream_all

# int8 vs fp32 on speech the calibration did not see, per utterance (measured on the
# bundled model: worst posterior difference 0.21, worst frame agreement 95.6%, transcripts
# 1.6% CER apart on 30 held-out utterances; with 7-bit weights on a CPU without VNNI,
# 0.26 and 96.3%; docs/benchmarks.md, "Benchmarks" has its WER; the bundled v5, 7-bit:
# 0.36, 96.2% and 1.5% CER: one frame's near-tie moves more, the frames and words do not).
MAX_POSTERIOR_DIFF = 0.45  # max |p_int8 - p_fp32| of any symbol in any frame
MIN_FRAME_AGREEMENT = 0.90  # share of frames whose most likely symbol is the same
MAX_TRANSCRIPT_CER = 0.05  # CER of the int8 transcripts against the fp32 ones
CALIBRATION = 15  # utterances of the corpus used to calibrate; the rest test

needs_bundled = pytest.mark.skipif(
    not (default_model_dir() / "model.onnx").is_file(),
    reason="no bundled model in model/default (scripts/train_default.sh makes it)",
)


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory: pytest.TempPathFactory, corpus_audio) -> Path:
    calibration = [a for _, a in corpus_audio[:CALIBRATION]]
    out = tmp_path_factory.mktemp("int8") / "echoic-en-default" / "2"
    return quantize_model(default_model_dir(), out, calibration)


@pytest.fixture(scope="module")
def held_out(corpus_audio) -> list[np.ndarray]:
    return [a for _, a in corpus_audio[CALIBRATION:]]


@needs_bundled
def test_the_card_says_int8_and_nothing_else_changed(int8_dir: Path) -> None:
    fp32 = read_card(default_model_dir() / "model.onnx")
    int8 = read_card(int8_dir / "model.onnx")
    assert int8 == read_card(int8_dir / "stream.onnx")
    assert (fp32.precision, int8.precision, int8.version) == ("fp32", "int8", "2")
    assert dataclasses.replace(int8, precision="fp32", version=fp32.version) == fp32
    assert "precision" not in json.loads(fp32.to_json())  # fp32 cards keep their bytes
    assert json.loads(int8.to_json())["precision"] == "int8"
    report = json.loads((int8_dir / "export.json").read_text())
    assert report["model_card"]["precision"] == "int8"
    assert report["quantization"]["calibration_utterances"] == CALIBRATION
    stream = onnx.load(str(default_model_dir() / "stream.onnx"))
    grus = sum(1 for n in stream.graph.node if n.op_type == "GRU")  # every one stays fp32
    assert report["quantization"]["graphs"]["stream.onnx"]["left_fp32"] == {"GRU": grus}
    assert (int8_dir / "lm.bin").is_file() and (int8_dir / "lm.arpa").is_file()  # its LM too


@needs_bundled
def test_int8_keeps_parity_with_fp32_on_speech(int8_dir: Path, held_out) -> None:
    fp32, int8 = Recognizer(intra_op_threads=1), Recognizer(int8_dir, intra_op_threads=1)
    diffs, agreements = [], []
    for a, b in zip(fp32.log_probs(held_out), int8.log_probs(held_out), strict=True):
        assert a.shape == b.shape
        assert not np.array_equal(a, b)  # it is really another graph
        diffs.append(float(np.abs(np.exp(a) - np.exp(b)).max()))
        agreements.append(float(np.mean(a.argmax(1) == b.argmax(1))))
    texts = [[t.text for t in r.transcribe(held_out)] for r in (fp32, int8)]
    cer = jiwer.cer(*texts)
    assert max(diffs) <= MAX_POSTERIOR_DIFF
    assert min(agreements) >= MIN_FRAME_AGREEMENT
    assert cer <= MAX_TRANSCRIPT_CER


@needs_bundled
def test_int8_rows_do_not_depend_on_their_batch_mates(int8_dir: Path, held_out) -> None:
    """Fixed activation scales: what dynamic quantization would break."""
    int8 = Recognizer(int8_dir, intra_op_threads=1)
    batched = int8.log_probs(held_out[:6])
    for audio, row in zip(held_out[:6], batched, strict=True):
        np.testing.assert_array_equal(int8.log_probs([audio])[0], row)


@needs_bundled
def test_int8_streaming_equals_offline(int8_dir: Path, held_out) -> None:
    int8 = Recognizer(int8_dir, intra_op_threads=1)
    for audio in held_out[:4]:
        assert stream_all(int8, audio, 3000).text == int8.transcribe([audio])[0].text


@needs_bundled
def _bias_scale_errors(proto) -> list[float]:
    """For each int32 Conv/Gemm bias: |its scale / (x_scale * w_scale) - 1|, the error a
    fused QLinearConv, which reads the bias against x_scale * w_scale, would make."""
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    dq = {n.output[0]: n for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    errors = []
    for node in proto.graph.node:
        x, w, b = (dq.get(i) for i in [*node.input[:3], "", "", ""][:3])
        if node.op_type in ("Conv", "Gemm") and x and w and b:
            ratio = inits[b.input[1]] / (inits[x.input[1]] * inits[w.input[1]])
            errors.append(float(np.max(np.abs(ratio - 1.0))))
    return errors


def test_int32_biases_follow_the_shared_input_scales(int8_dir: Path) -> None:
    """stream.onnx takes model.onnx's activation scales; its int32 biases, quantized with
    its own input scales, are quantized again for the shared ones (`_rescale_biases`):
    here with every activation scale of stream.onnx made twice what it was."""
    import onnx
    from onnx import numpy_helper

    from echoic.model.nn.quantize import _activation_scales, _rescale_biases

    for name in ("model.onnx", "stream.onnx"):
        errors = _bias_scale_errors(onnx.load(int8_dir / name))
        assert len(errors) >= 2 and max(errors) < 1e-6, name
    proto = onnx.load(int8_dir / "stream.onnx")
    before = _dequantized_biases(proto)
    scales = {scale for scale, _, _ in _activation_scales(proto)}
    for t in proto.graph.initializer:
        if t.name in scales:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 2, t.name))
    assert min(_bias_scale_errors(proto)) > 0.4  # what a fused conv would read: half off
    _rescale_biases(proto)
    assert max(_bias_scale_errors(proto)) < 1e-6
    # Each bias re-rounded to its new step (the input scale doubled, it is twice as coarse):
    # within half a step of what it was.
    steps = _bias_scales(proto)
    for name, value in _dequantized_biases(proto).items():
        assert np.all(np.abs(value - before[name]) <= steps[name] * (0.5 + 1e-6)), name


def _dequantized_biases(proto) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    return {name: inits[name] * scale for name, scale in _bias_scales(proto).items()}


def _bias_scales(proto) -> dict[str, np.ndarray]:
    """Each int32 bias's scale (its step), by the bias's initializer name."""
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    return {
        n.input[0]: inits[n.input[1]].astype(np.float64)
        for n in proto.graph.node
        if n.op_type == "DequantizeLinear" and inits.get(n.input[0], np.zeros(0)).dtype == np.int32
    }


def test_quantizing_an_int8_model_is_refused(int8_dir: Path, tmp_path: Path, held_out) -> None:
    with pytest.raises(QuantizeError, match="already int8"):
        quantize_model(int8_dir, tmp_path / "again", held_out[:1])
    assert not (tmp_path / "again").exists()


@needs_bundled
@pytest.mark.parametrize(
    ("make_manifest", "error"),
    [
        pytest.param(None, r"no-such\.jsonl: cannot read the calibration manifest", id="missing"),
        pytest.param('{"text": "hi"}\n', r"\.jsonl:1: not a manifest line with an audio_filepath",
                     id="no-audio-path"),
        pytest.param('{"audio_filepath": "gone.wav"}\n', r"\.jsonl:1: .*gone\.wav", id="no-audio"),
        pytest.param("", r"no utterances to calibrate on", id="empty"),
    ],
)  # fmt: skip
def test_bad_calibration_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make_manifest: str | None, error: str
) -> None:
    manifest = tmp_path / ("no-such.jsonl" if make_manifest is None else "calib.jsonl")
    if make_manifest is not None:
        manifest.write_text(make_manifest)
    args = ["quantize", str(default_model_dir()), str(tmp_path / "out"), "--calibration"]
    assert main([*args, str(manifest)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("echoic quantize: error: ") and err.count("\n") == 1
    assert re.search(error, err), err
    assert not (tmp_path / "out").exists()


@needs_bundled
def test_cli_quantize(speech_corpus: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "m" / "5"
    args = ["quantize", str(default_model_dir()), str(out), "--calibration", str(speech_corpus)]
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["version"], summary["precision"]) == ("5", "int8")
    assert summary["files"] == ["export.json", "lm.arpa", "lm.bin", "model.onnx", "stream.onnx"]
    assert Engine(out).card.precision == "int8"
    assert main(args) == 1  # OUT_DIR exists now
    assert "already exists" in capsys.readouterr().err
