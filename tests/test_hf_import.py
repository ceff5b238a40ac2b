"""`echoic import-model huggingface`: a tiny random Wav2Vec2ForCTC built with the real
transformers classes (tests/tiny_hf.py), imported, and checked against transformers
itself: its ONNX log-probs, and what a real server answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the import extra is not installed")
torch = pytest.importorskip("torch")

from echoic.model.runtime.card import read_card  # noqa: E402
from echoic.model.runtime.recognizer import Recognizer  # noqa: E402
from echoic.model.runtime.repository import incomplete  # noqa: E402
from tests.streaming import stream_all  # noqa: E402
from tests.tiny_hf import SPECIAL, VOCAB  # noqa: E402

RATE = 16000
TOLERANCE = 1e-4  # max |log-prob difference| between ONNX Runtime and transformers


def audio(seconds: float, seed: int) -> np.ndarray:
    """A few seconds of something speech-like enough: tones that glide, and noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    pitch = 120 + 80 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t)
    voiced = np.sin(2 * np.pi * np.cumsum(pitch) / RATE) * (0.5 + 0.5 * np.sin(7 * t))
    return (0.3 * voiced + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def audio_as_sent(seconds: float, seed: int) -> tuple[bytes, np.ndarray]:
    """`audio` as LINEAR16 on the wire, and the samples the server decodes from it."""
    from tests.test_server import pcm16

    wire = pcm16(audio(seconds, seed))
    return wire, np.frombuffer(wire, "<i2").astype(np.float32) / 32768


def transformers_log_probs(src: Path, audios: list[np.ndarray]) -> list[np.ndarray]:
    """Log-probs (T', V_source) per utterance, as transformers computes them: its own
    processor (normalisation, padding, attention mask) and model, on one padded batch,
    or an utterance at a time for a model fed no attention mask (padding would change
    its group norm's statistics: by 2.6 in log-prob on the tiny one)."""
    processor = transformers.Wav2Vec2Processor.from_pretrained(src)
    model = transformers.AutoModelForCTC.from_pretrained(src).eval()
    if not processor.feature_extractor.return_attention_mask:
        # A model fed no mask (group norm) runs an utterance at a time, as echoic runs it.
        alone = [processor(a, sampling_rate=RATE, return_tensors="pt") for a in audios]
        return [_log_probs(model, inputs)[0] for inputs in alone]
    inputs = processor(audios, sampling_rate=RATE, padding=True, return_tensors="pt")
    return _log_probs(model, inputs)


def _log_probs(model, inputs) -> list[np.ndarray]:
    """transformers' log-probs of a processed batch, each row trimmed to its frames."""
    mask = inputs.get("attention_mask")
    with torch.no_grad():
        logits = model(inputs.input_values, attention_mask=mask).logits
    lengths = mask.sum(-1) if mask is not None else torch.tensor([inputs.input_values.shape[1]])
    frames = model._get_feat_extract_output_lengths(lengths)
    log_probs = torch.log_softmax(logits, dim=-1)
    return [lp[: int(n)].numpy() for lp, n in zip(log_probs, frames, strict=True)]


def test_the_card_describes_a_waveform_model(hf_imported_dir: Path) -> None:
    card = read_card(hf_imported_dir / "model.onnx")
    assert (card.input, card.normalize, card.batch_padding) == ("waveform", "utterance", "masked")
    assert card.source == "huggingface:Wav2Vec2ForCTC"
    assert card.sample_rate == RATE
    # 5 * 2^6 samples per output frame; one frame sees 400 samples (25 ms), as wav2vec2's
    assert (card.time_stride, card.output_frame_ms, card.receptive_field) == (320, 20.0, 400)
    letters = [t for t in VOCAB if len(t) == 1 and t != "|"]
    assert card.vocabulary == ("<blank>", " ", *(t.lower() for t in letters))
    assert card.source_tokens == ("<pad>", "|", *letters)
    assert incomplete(hf_imported_dir) is None  # the repository would load it
    report = json.loads((hf_imported_dir / "export.json").read_text())
    assert report["source"]["folded_into_blank"] == list(SPECIAL)
    assert report["source"]["transformers"] == transformers.__version__


def check_equal(src: Path, model_dir: Path) -> None:
    """model_dir's ONNX log-probs equal transformers' on a batch of different lengths:
    echoic's symbols against the source's, the blank against its folded tokens."""
    audios = [audio(2.0, 1), audio(0.7, 2), audio(1.31, 3)]
    want = transformers_log_probs(src, audios)
    got = Recognizer(model_dir).log_probs(audios)  # one padded ONNX batch
    blank = [VOCAB["<pad>"], *(VOCAB[t] for t in SPECIAL)]
    others = [i for i in VOCAB.values() if i not in blank]
    for w, g in zip(want, got, strict=True):
        assert g.shape == (len(w), len(others) + 1)
        np.testing.assert_allclose(g[:, 1:], w[:, others], atol=TOLERANCE, rtol=0)
        folded = np.logaddexp.reduce(w[:, blank], axis=1)
        np.testing.assert_allclose(g[:, 0], folded, atol=TOLERANCE, rtol=0)


def test_onnx_equals_transformers_on_a_batch_of_different_lengths(
    hf_wav2vec2_dir: Path, hf_imported_dir: Path
) -> None:
    check_equal(hf_wav2vec2_dir, hf_imported_dir)


@pytest.mark.parametrize(
    ("architecture", "layer_norm", "padding"),
    [
        pytest.param("HubertForCTC", True, "masked", id="hubert"),
        # wav2vec2-base's front end: group norm over time, which padding would change
        pytest.param("Wav2Vec2ForCTC", False, "alone", id="wav2vec2-group-norm"),
    ],
)
def test_other_families_import_equal_to_transformers(
    tmp_path: Path, architecture: str, layer_norm: bool, padding: str
) -> None:
    from echoic.model.nn.hf_import import import_huggingface
    from tests.tiny_hf import save_tiny_ctc

    src = save_tiny_ctc(tmp_path / "src", architecture, layer_norm=layer_norm)
    model_dir = import_huggingface(src, tmp_path / "out")
    card = read_card(model_dir / "model.onnx")
    assert (card.source, card.batch_padding) == (f"huggingface:{architecture}", padding)
    check_equal(src, model_dir)


Words = list[tuple[str, float, float]]  # (word, start s, end s)


def transformers_greedy(src: Path, samples: np.ndarray) -> tuple[str, Words]:
    """transformers' own greedy decode of its logits: the text (lower-cased, as echoic
    spells it) and each word with its start and end time, s (its tokenizer's offsets)."""
    processor = transformers.Wav2Vec2Processor.from_pretrained(src)
    model = transformers.Wav2Vec2ForCTC.from_pretrained(src).eval()
    inputs = processor(samples, sampling_rate=RATE, return_tensors="pt")
    with torch.no_grad():
        ids = model(inputs.input_values).logits.argmax(-1)[0]
    out = processor.tokenizer.decode(ids, output_word_offsets=True)
    seconds = model.config.inputs_to_logits_ratio / RATE  # per output frame
    words = [
        (w["word"].lower(), w["start_offset"] * seconds, w["end_offset"] * seconds)
        for w in out.word_offsets
    ]
    # Its text keeps a space per delimiter run ("A| |B" is "A  B"); echoic joins words by one.
    return " ".join(out.text.lower().split()), words


def test_the_server_answers_transformers_greedy_decode(
    hf_wav2vec2_dir: Path, hf_imported_dir: Path
) -> None:
    from tests.test_server import channel_to, linear16, pb_grpc, recognize, running

    wire, sent = audio_as_sent(2.5, 4)
    text, words = transformers_greedy(hf_wav2vec2_dir, sent)
    assert len(words) >= 3, "the fixture should spell several words"
    with running(hf_imported_dir) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        response = recognize(stub, wire, linear16(enable_word_time_offsets=True))
    (result,) = response.results
    best = result.alternatives[0]
    assert best.transcript == text
    got = [(w.word, w.start_time, w.end_time) for w in best.words]
    assert [g[0] for g in got] == [w[0] for w in words]
    np.testing.assert_allclose([g[1:] for g in got], [w[1:] for w in words], atol=1e-9)


def test_the_command_imports_and_summarises(hf_wav2vec2_dir: Path, tmp_path: Path, capsys) -> None:
    from echoic.cli.main import main

    out = tmp_path / "w2v" / "7"
    assert main(["import-model", "huggingface", str(hf_wav2vec2_dir), str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["name"], summary["version"]) == ("tiny-wav2vec2", "7")
    assert summary["files"] == ["export.json", "model.onnx"]
    assert summary["output_frame_ms"] == 20.0
    assert max(c["max_abs_diff"] for c in summary["parity"]["offline"]) <= TOLERANCE
    card = read_card(out / "model.onnx")
    assert (card.name, card.version) == ("tiny-wav2vec2", "7")


def _break(src: Path, dst: Path, change: str) -> None:
    """A copy of the save_pretrained directory `src` with one thing wrong."""
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    vocab = json.loads((dst / "vocab.json").read_text())
    if change == "no-vocab":
        (dst / "vocab.json").unlink()
    elif change == "not-ctc":
        config["architectures"] = ["Wav2Vec2Model"]
    elif change == "subwords":
        vocab["TH"] = vocab.pop("Z")
    elif change == "vocab-size":
        config["vocab_size"] += 1
    elif change == "upper-and-lower":
        vocab["e"] = vocab.pop("Z")
    (dst / "config.json").write_text(json.dumps(config))
    if (dst / "vocab.json").exists():
        (dst / "vocab.json").write_text(json.dumps(vocab))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param("no-vocab", "vocab.json: missing", id="no-vocab"),
        pytest.param("not-ctc", "include none that echoic imports", id="not-ctc"),
        pytest.param("subwords", "'TH' (id 31) is not one character", id="subwords"),
        pytest.param("vocab-size", "vocab_size 33", id="vocab-size"),
        pytest.param("upper-and-lower", "duplicate symbols: 'e'", id="upper-and-lower"),
    ],
)
def test_a_model_echoic_cannot_import_is_one_line_naming_why(
    hf_wav2vec2_dir: Path, tmp_path: Path, capsys, change: str, message: str
) -> None:
    from echoic.cli.main import main

    src = tmp_path / "src"
    _break(hf_wav2vec2_dir, src, change)
    assert main(["import-model", "huggingface", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("echoic import-model: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- overlapped chunks


@pytest.mark.parametrize(
    ("chunk_ms", "left_ms", "right_ms", "seconds"),
    [
        pytest.param(1000.0, 1000.0, 500.0, 3.33, id="defaults"),
        pytest.param(200.0, 0.0, 0.0, 1.0, id="no-context"),
        pytest.param(500.0, 2000.0, 120.0, 0.41, id="shorter-than-a-chunk"),
        pytest.param(1000.0, 0.0, 0.0, 0.02, id="under-one-frame"),
    ],
)
def test_overlapped_windows_keep_every_frame_once_with_their_context(
    hf_imported_dir: Path, chunk_ms: float, left_ms: float, right_ms: float, seconds: float
) -> None:
    """Samples that say their own index: each window's first sample tells where it
    starts, so its kept frames and their context can be checked against the geometry."""
    from echoic.model.runtime.chunking import ChunkConfig, ChunkFeeder

    card = read_card(hf_imported_dir / "model.onnx")
    stride, field = card.time_stride, card.receptive_field
    n = int(seconds * RATE)
    total = (n - field) // stride + 1 if n >= field else 0
    ramp = np.arange(n, dtype=np.float32)  # exact below 2^24
    feeder = ChunkFeeder(card, ChunkConfig(chunk_ms, left_ms, right_ms))
    left, right = feeder.left, feeder.right
    rng = np.random.default_rng(0)
    fed, kept = 0, []
    while not feeder.done:
        if fed < n:
            step = int(rng.integers(1, 4000))
            feeder.accept(ramp[fed : fed + step])
            fed += step
            if fed >= n:
                feeder.finish()
        elif not feeder.finished:
            feeder.finish()
        while feeder.ready():
            window, first, keep = feeder.next_window()
            start = int(window[0])
            assert window.tolist() == list(range(start, start + len(window)))  # contiguous
            assert start % stride == 0
            frames = (len(window) - field) // stride + 1  # the model's output frames
            begin = start // stride + first  # the first kept frame in the utterance
            assert first == min(left, begin)  # L frames before it, fewer at the start
            assert frames - first - keep == min(right, total - begin - keep)  # R after it
            kept += range(begin, begin + keep)
    assert kept == list(range(total))


def test_the_server_streams_a_full_context_model_by_overlapped_chunks(
    hf_imported_dir: Path,
) -> None:
    from tests.test_server import (
        RPC_TIMEOUT,
        channel_to,
        finals,
        linear16,
        pb,
        pb_grpc,
        recognize,
        running,
        stream,
    )

    wire, sent = audio_as_sent(4.0, 7)
    recognizer = Recognizer(hf_imported_dir)
    streamed = stream_all(recognizer, sent).text
    offline = recognizer.transcribe([sent])[0].text
    assert streamed != offline, "this audio should show what the chunks' context costs"
    with running(hf_imported_dir) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        (info,) = stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT).models
        responses = stream(stub, wire, linear16(), interim=True)
        whole = recognize(stub, wire, linear16()).results[0].alternatives[0].transcript
    assert (info.streamable, info.chunk_seconds, info.lookahead_seconds) == (True, 1.0, 0.5)
    interims = [r for r in responses if r.results and not r.results[0].is_final]
    assert len(interims) >= 2  # a chunk a second for four seconds, before the end
    assert finals(responses) == [streamed]
    assert whole == offline  # Recognize runs the utterance whole, with its full context


def test_beam_search_on_an_imported_model(hf_imported_dir: Path) -> None:
    pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")
    from echoic.model.core.decoding import DecoderConfig
    from tests.test_server import (
        channel_to,
        finals,
        linear16,
        pb,
        pb_grpc,
        recognize,
        running,
        stream,
    )

    wire, sent = audio_as_sent(3.0, 8)
    beam = DecoderConfig(kind="beam", beam_size=8)
    whole = Recognizer(hf_imported_dir, beam).transcribe([sent])[0].text
    streamed = stream_all(Recognizer(hf_imported_dir, beam), sent).text
    assert whole and streamed
    config = linear16(decoder=pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=8))
    with running(hf_imported_dir) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        assert [r.alternatives[0].transcript for r in recognize(stub, wire, config).results] == [
            whole
        ]
        assert finals(stream(stub, wire, config, interim=True)) == [streamed]


def test_the_http_door_answers_the_same_as_recognize(
    hf_wav2vec2_dir: Path, hf_imported_dir: Path
) -> None:
    """OpenAI's own client on the HTTP door: the same whole-utterance decode (the words as
    spoken: formatting=false)."""
    from tests.test_http import http_server, openai_client
    from tests.test_server import container

    samples = audio(2.5, 4)
    wav = container(samples, RATE, "WAV")
    sent = np.frombuffer(container(samples, RATE, "RAW"), "<i2").astype(np.float32) / 32768
    text, _ = transformers_greedy(hf_wav2vec2_dir, sent)
    with http_server(model_dir=hf_imported_dir) as server:
        with openai_client(server) as client:
            got = client.audio.transcriptions.create(
                model="whisper-1", file=("speech.wav", wav), extra_body={"formatting": "false"}
            )
    assert text and got.text == text
