"""Imported models through every door of one real `echoic serve` process: a repository
holding a tiny Hugging Face wav2vec2 (tests/tiny_hf.py) and a tiny NeMo Conformer BPE
model (tests/fixtures/nemo/), both imported by echoic, on a real clip of speech. OpenAI's
`openai` package on the HTTP door, a realtime WebSocket, and NVIDIA's unchanged
`nvidia-riva-client` each get what echoic's own gRPC API gives for the same audio:
Recognize's transcript and word times (on the imported model's frames) for whole
files, StreamingRecognize's finals for streams.

And long files: an utterance longer than one window runs in overlapped windows
(`model/runtime/chunking.py`), its transcript the greedy decode of the windows' kept
frames, and its peak memory that of a window, not of the file."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
pytest.importorskip("transformers", reason="the import extra is not installed")
pytest.importorskip("onnx", reason="the import extra is not installed")

import soundfile as sf  # noqa: E402

from echoic.model.runtime.card import read_card  # noqa: E402
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "nemo"
MODELS = ("w2v", "bpe")  # the repository's model names: the wav2vec2, the NeMo Conformer
TIMEOUT = 60.0  # s per call


@pytest.fixture(scope="module")
def repository(hf_imported_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from echoic.model.nn.nemo_import import import_nemo

    repo = tmp_path_factory.mktemp("imported-repo")
    shutil.copytree(hf_imported_dir, repo / "w2v" / "1")
    import_nemo(FIXTURES / "bpe.onnx", repo / "bpe" / "1", nemo=FIXTURES / "bpe.nemo")
    return repo


@pytest.fixture(scope="module")
def serve(repository: Path) -> Iterator[tuple[int, int]]:
    """`echoic serve --model-repo REPO` with HTTP on: (gRPC port, HTTP port)."""
    from tests.test_clients import free_port
    from tests.test_server import serve_process

    http_port = free_port()
    with serve_process("--model-repo", str(repository), "--http-port", str(http_port)) as (
        _,
        port,
        _log,
    ):
        yield port, http_port


@pytest.fixture(scope="module")
def stub(serve: tuple[int, int]) -> Iterator[pb_grpc.TranscriberStub]:
    with grpc.insecure_channel(f"127.0.0.1:{serve[0]}") as channel:
        yield pb_grpc.TranscriberStub(channel)


@pytest.fixture(scope="module")
def wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixtures' clip ("the quick brown fox ..." by espeak-ng, 16 kHz) as a PCM16 WAV."""
    samples, rate = sf.read(FIXTURES / "clip.flac", dtype="int16")
    path = tmp_path_factory.mktemp("audio") / "clip.wav"
    sf.write(path, samples, rate, subtype="PCM_16")
    return path


def frame_seconds(repository: Path, model: str) -> float:
    return read_card(repository / model / "1" / "model.onnx").output_frame_ms / 1000


def recognize(stub, model: str, audio: bytes) -> pb.SpeechRecognitionAlternative:
    """gRPC Recognize's one result (an imported model runs a file whole): its best."""
    config = pb.RecognitionConfig(model=model, enable_word_time_offsets=True)
    response = stub.Recognize(pb.RecognizeRequest(config=config, audio_content=audio),
                              timeout=TIMEOUT)  # fmt: skip
    (result,) = response.results
    return result.alternatives[0]


def stream_finals(stub, model: str, audio: bytes) -> list[str]:
    """gRPC StreamingRecognize's final transcripts, the audio in 100 ms messages."""

    def messages():
        config = pb.RecognitionConfig(model=model)
        yield pb.StreamingRecognizeRequest(
            streaming_config=pb.StreamingRecognitionConfig(config=config, interim_results=True)
        )
        for i in range(0, len(audio), 3200):
            yield pb.StreamingRecognizeRequest(audio_content=audio[i : i + 3200])

    return [
        r.results[0].alternatives[0].transcript
        for r in stub.StreamingRecognize(messages(), timeout=TIMEOUT)
        if r.results and r.results[0].is_final
    ]


def check_times(words: list[tuple[str, float, float]], frame: float, duration: float) -> None:
    """Word times on the model's output frames, in order, inside the audio."""
    assert words, "the fixture should spell words"
    times = [t for _, start, end in words for t in (start, end)]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= duration + 1e-6
    assert all(start < end for _, start, end in words)
    for t in times:
        assert abs(t / frame - round(t / frame)) < 1e-3, (t, frame)


@pytest.mark.parametrize("model", MODELS)
def test_openai_client_gets_recognizes_transcript_and_word_times(
    serve, stub, repository, wav, model
) -> None:
    """OpenAI's client, unchanged: json, verbose_json with word times, and stream=true
    (an imported model runs the file whole there too: its text is Recognize's), the words
    as spoken (formatting=false: docs/formatting.md)."""
    import openai

    data = wav.read_bytes()
    want = recognize(stub, model, data)
    words = [(w.word, w.start_time, w.end_time) for w in want.words]
    duration = sf.info(wav).duration
    check_times(words, frame_seconds(repository, model), duration)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve[1]}/v1", api_key="unused",
                           max_retries=0, timeout=TIMEOUT)  # fmt: skip
    with client:
        raw = {"formatting": "false"}
        plain = client.audio.transcriptions.create(
            model=model, file=("clip.wav", data), extra_body=raw
        )
        verbose = client.audio.transcriptions.create(
            model=model, file=("clip.wav", data), response_format="verbose_json",
            timestamp_granularities=["word", "segment"], extra_body=raw,
        )  # fmt: skip
        events = list(
            client.audio.transcriptions.create(
                model=model, file=("clip.wav", data), stream=True, extra_body=raw
            )
        )
    assert plain.text == verbose.text == want.transcript
    assert verbose.duration == pytest.approx(duration)
    got = [(w.word, w.start, w.end) for w in verbose.words]
    assert [w for w, *_ in got] == [w for w, *_ in words]
    np.testing.assert_allclose([g[1:] for g in got], [w[1:] for w in words], atol=1e-3)
    assert events[-1].type == "transcript.text.done" and events[-1].text == want.transcript
    assert "".join(e.delta for e in events[:-1]) == want.transcript


@pytest.mark.parametrize("model", MODELS)
def test_realtime_websocket_gets_streaming_recognizes_finals(serve, stub, wav, model) -> None:
    """A realtime session naming the model, PCM16 in 50 ms appends: the `.completed`
    transcripts are StreamingRecognize's finals (overlapped chunks, both), the deltas
    join to them, and the word times (ms) lie in order inside the audio."""
    import aiohttp

    data = wav.read_bytes()
    want = stream_finals(stub, model, data)
    pcm = sf.read(wav, dtype="int16")[0].astype("<i2").tobytes()
    session = {
        "input_audio_format": "pcm16",
        "input_audio_params": {"sample_rate_hz": 16000, "num_channels": 1},
        "input_audio_transcription": {"model": model},
        # the words as spoken, as StreamingRecognize gives them by default
        "recognition_config": {"enable_word_time_offsets": True,
                               "enable_automatic_punctuation": False,
                               "enable_verbatim_transcripts": True},
    }  # fmt: skip
    url = f"ws://127.0.0.1:{serve[1]}/v1/realtime?intent=transcription"

    async def events() -> list[dict]:
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(url, protocols=("realtime",)) as ws,
        ):  # noqa: E501
            assert (await ws.receive_json(timeout=TIMEOUT))["type"] == "conversation.created"
            await ws.send_json({"type": "transcription_session.update", "session": session})
            updated = await ws.receive_json(timeout=TIMEOUT)
            assert updated["type"] == "transcription_session.updated", updated
            assert updated["session"]["input_audio_transcription"]["model"] == model
            for i in range(0, len(pcm), 1600):
                chunk = base64.b64encode(pcm[i : i + 1600]).decode()
                await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
            await ws.send_json({"type": "input_audio_buffer.done"})
            out = [await ws.receive_json(timeout=TIMEOUT)]
            while not out[-1].get("is_last_result"):
                out.append(await ws.receive_json(timeout=TIMEOUT))
            return out

    got = asyncio.run(events())
    kind = "conversation.item.input_audio_transcription."
    completed = [e for e in got if e["type"] == kind + "completed"]
    assert [e["transcript"] for e in completed] == want and want[0]
    deltas = [e["delta"] for e in got if e["type"] == kind + "delta"]
    assert "".join(deltas) == " ".join(want)
    words = [(w["word"], w["start_time"] / 1000, w["end_time"] / 1000)
             for e in completed for w in e["words_info"]["words"]]  # fmt: skip
    assert [w for w, *_ in words] == " ".join(want).split()
    times = [t for _, s, e in words for t in (s, e)]
    assert times == sorted(times) and times[-1] <= sf.info(wav).duration + 1e-3


@pytest.mark.parametrize("model", MODELS)
def test_riva_client_gets_recognize_and_streaming_recognize(
    serve, stub, repository, wav, model
) -> None:
    """nvidia-riva-client's ASRService, unchanged, naming the model: offline_recognize of
    the WAV file gives Recognize's transcript and word times (Riva's ms, to the ms);
    streaming_response_generator over its file iterator gives StreamingRecognize's finals."""
    riva_client = pytest.importorskip("riva.client", reason="the riva extra is not installed")
    data = wav.read_bytes()
    want = recognize(stub, model, data)
    asr = riva_client.ASRService(riva_client.Auth(uri=f"127.0.0.1:{serve[0]}"))
    config = riva_client.RecognitionConfig(
        language_code="en-US", max_alternatives=1, enable_word_time_offsets=True, model=model
    )
    riva_client.add_audio_file_specs_to_config(config, wav)
    (result,) = asr.offline_recognize(data, config).results
    best = result.alternatives[0]
    assert best.transcript == want.transcript
    got = [(w.word, w.start_time / 1000, w.end_time / 1000) for w in best.words]
    assert [w for w, *_ in got] == [w.word for w in want.words]
    np.testing.assert_allclose(
        [g[1:] for g in got], [(w.start_time, w.end_time) for w in want.words], atol=1e-3
    )
    check_times(got, frame_seconds(repository, model), sf.info(wav).duration)

    streaming = riva_client.StreamingRecognitionConfig(config=config, interim_results=True)
    with riva_client.AudioChunkFileIterator(str(wav), 1600) as chunks:
        results = [r for response in asr.streaming_response_generator(chunks, streaming)
                   for r in response.results]  # fmt: skip
    finals = [r.alternatives[0].transcript for r in results if r.is_final]
    assert finals == stream_finals(stub, model, data) and finals[0]
    assert any(not r.is_final for r in results)  # interim results on the way


# ---------------------------------------------------------------- long files


def long_clip(seconds: float) -> np.ndarray:
    """The clip repeated to `seconds`, as the server decodes its PCM16."""
    clip, _ = sf.read(FIXTURES / "clip.flac", dtype="int16")
    return np.resize(clip, int(seconds * 16000)).astype(np.float32) / 32768


def windowed_log_probs(recognizer, audio: np.ndarray) -> np.ndarray:  # noqa: ANN001
    """What chunking.py documents for a long utterance: window n holds output frames
    [nC - L, nC + C + R) (fewer at the ends) and gives frames [nC, nC + C); each window
    run alone (samples normalised over it, or NeMo's features of its samples)."""
    from echoic.model.runtime.chunking import output_frames

    card = recognizer.card
    chunk, left, right = recognizer.whole_chunking.frames(card)
    stride, field = card.time_stride, card.receptive_field
    if card.nemo_features is not None:
        stride = field = card.time_stride * card.nemo_features.hop_samples
    total = output_frames(card, len(audio))
    rows = []
    for first in range(0, total, chunk):
        start = max(0, first - left) * stride
        end = min((first + chunk + right - 1) * stride + field, len(audio))
        (lp,) = recognizer.engine.offline([recognizer.model_input(audio[start:end])])
        skip = first - start // stride
        rows.append(lp[skip : skip + min(chunk, total - first)])
    return np.concatenate(rows)


@pytest.mark.parametrize(
    ("model", "seconds", "window"),
    [
        # 30 s windows: 20 s kept, 5 s of context either side (50 Hz frames)
        pytest.param("w2v", 75.0, (1000, 250, 250), id="wav2vec2"),
        # the Conformer's positional table: at most 267 output frames a call (40 ms each)
        pytest.param("bpe", 26.0, (179, 44, 44), id="nemo-conformer"),
    ],
)
def test_a_long_file_is_the_greedy_decode_of_its_windows_kept_frames(
    serve, stub, repository, tmp_path, model, seconds, window
) -> None:
    """Recognizer.log_probs, Recognize on the server and `echoic transcribe` of a file
    longer than a window: the windows' kept frames, decoded as one utterance."""
    from echoic.cli.main import main
    from echoic.model.core.decoding import GreedyDecoder
    from echoic.model.runtime.recognizer import Recognizer

    model_dir = repository / model / "1"
    recognizer = Recognizer(model_dir)
    assert recognizer.whole_chunking.frames(recognizer.card) == window
    audio = long_clip(seconds)
    want_rows = windowed_log_probs(recognizer, audio)
    (got_rows,) = recognizer.log_probs([audio])
    np.testing.assert_array_equal(got_rows, want_rows)
    want = GreedyDecoder(recognizer.vocab, frame_seconds=recognizer.frame_seconds).decode(want_rows)
    assert len(want.words) > 20
    short = audio[: int(seconds * 16000 / 4)]  # within one window: run whole, as before
    np.testing.assert_array_equal(
        recognizer.log_probs([short])[0],
        recognizer.engine.offline([recognizer.model_input(short)])[0],
    )

    path = tmp_path / "long.wav"
    sf.write(path, audio, 16000, subtype="PCM_16")
    assert recognize(stub, model, path.read_bytes()).transcript == want.text
    out = tmp_path / "out.jsonl"
    args = ["transcribe", str(path), "--model", str(model_dir), "--output", str(out)]
    assert main([*args, "--no-progress"]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["text"] == want.text


def peak_growth(model_dir: Path, seconds: float) -> dict:
    """bench/long_audio_memory.py's measurement in a fresh process: resident memory before
    and at the peak of one Recognizer.log_probs call on `seconds` of the clip, MB."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "long_audio_memory.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--child", str(model_dir), str(seconds), "--cap-gb", "6"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["error"], result["error"]
    return result


@pytest.mark.parametrize(
    ("model", "short"),
    [
        pytest.param("w2v", 28.0, id="wav2vec2"),
        pytest.param("bpe", 10.0, id="nemo-conformer"),
        pytest.param("chars", 28.0, id="nemo-convasr"),
    ],
)
def test_memory_of_a_long_file_is_that_of_one_window(
    repository, hf_imported_dir, model, short
) -> None:
    """Peak memory growth of one Recognizer.log_probs call: from a 1-minute to a 4-minute
    utterance it grows by the audio alone (and a working copy of it), and it stays
    within a few times that of an utterance run whole in one window (ONNX Runtime's arena
    keeps the blocks of the first, shorter window beside a full one's). Run whole, the
    4 minutes would take the wav2vec2 16 times the minute's attention (frames squared)
    and the ConvASR model 4 times the minute's activations."""
    from echoic.model.nn.nemo_import import import_nemo

    model_dir = repository / model / "1"
    if not model_dir.exists():
        import_nemo(FIXTURES / "chars.onnx", model_dir, nemo=FIXTURES / "chars.nemo")
    small, minute, large = (peak_growth(model_dir, s) for s in (short, 60.0, 240.0))
    grew = lambda r: r["peak"] - r["base"]  # noqa: E731
    assert grew(large) - grew(minute) < 2 * large["audio"] + 0.1 * grew(minute), (minute, large)
    assert grew(large) < 3 * grew(small) + 2 * large["audio"], (small, large)


def test_a_window_longer_than_a_conformers_positional_table_is_refused(repository) -> None:
    """Chunk settings whose window the Conformer cannot run are refused at load, and an
    input longer than the card's max_frames is refused by the engine, each with a
    sentence (the graph itself would fail with a broadcast error)."""
    from echoic.model.runtime.card import ModelError
    from echoic.model.runtime.chunking import ChunkConfig
    from echoic.model.runtime.recognizer import Recognizer

    model_dir = repository / "bpe" / "1"
    with pytest.raises(ModelError, match=r"longer than the 267 frames \(10.68 s\)"):
        Recognizer(model_dir, chunking=ChunkConfig(10000.0, 1000.0, 500.0))
    engine = Recognizer(model_dir).engine
    assert engine.offline([np.zeros((267 * 4, 80), np.float32)])[0].shape[0] == 267
    with pytest.raises(ValueError, match="gives 268 output frames; model 'bpe' gives at most"):
        engine.offline([np.zeros((267 * 4 + 1, 80), np.float32)])
