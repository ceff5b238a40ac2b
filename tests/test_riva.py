"""Riva clients against echoic: `nvidia-riva-client`'s own ASRService, unchanged, talking
to a real server on a loopback port, compared with echoic's API on the same audio."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
riva_client = pytest.importorskip("riva.client", reason="the riva extra is not installed")

from riva.client.proto import riva_asr_pb2 as rasr  # noqa: E402

from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import words_heard  # noqa: E402
from tests.test_server import (  # noqa: E402
    channel_to,
    container,
    finals,
    pcm16,
    recognize,
    running,
    status_of,
    stream,
    texts,
)

FRAME_MS = 30  # one output frame of the tiny and the bundled model, ms


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    with running(tiny_model_dir, metrics_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def wav(speech_corpus: Path) -> Path:
    """A corpus utterance: a 16 kHz mono PCM16 WAV file."""
    return Path(json.loads(speech_corpus.read_text().splitlines()[3])["audio_filepath"])


def _config(**fields) -> rasr.RecognitionConfig:
    # verbatim: these tests compare with echoic's raw words (Riva's default is written form)
    fields.setdefault("verbatim_transcripts", True)
    return riva_client.RecognitionConfig(language_code="en-US", max_alternatives=1, **fields)


def test_offline_recognize_equals_echoic_recognize(server, wav: Path) -> None:
    """The whole WAV file as Riva's examples send it (LINEAR_PCM with the header), and
    its raw PCM frames: the transcript and word times of echoic's own Recognize, in
    Riva's units (ms) to the millisecond."""
    asr = riva_client.ASRService(riva_client.Auth(uri=server.address))
    config = _config(enable_word_time_offsets=True)
    riva_client.add_audio_file_specs_to_config(config, wav)
    data = wav.read_bytes()
    with channel_to(server) as channel:
        ours = recognize(pb_grpc.TranscriberStub(channel), data,
                         pb.RecognitionConfig(enable_word_time_offsets=True))  # fmt: skip
    for audio in (data, data[44:]):  # the file, then its samples (a 44-byte header)
        theirs = asr.offline_recognize(audio, config)
        assert [r.alternatives[0].transcript for r in theirs.results] == texts(ours)
        want = [(w.word, w.start_time, w.end_time) for r in ours.results
                for w in r.alternatives[0].words]  # fmt: skip
        got = [(w.word, w.start_time, w.end_time) for r in theirs.results
               for w in r.alternatives[0].words]  # fmt: skip
        assert [w for w, *_ in got] == [w for w, *_ in want] and want
        for (_, start, end), (_, s, e) in zip(got, want, strict=True):
            assert abs(start - s * 1000) <= 1 and abs(end - e * 1000) <= 1 < FRAME_MS


def test_streaming_equals_echoic_streaming(server, wav: Path) -> None:
    """Riva's file iterator (the header in its first chunk) with interim results: the
    finals of echoic's StreamingRecognize on the same audio, and interim results before."""
    asr = riva_client.ASRService(riva_client.Auth(uri=server.address))
    config = _config()
    riva_client.add_audio_file_specs_to_config(config, wav)
    streaming = riva_client.StreamingRecognitionConfig(config=config, interim_results=True)
    with riva_client.AudioChunkFileIterator(wav, 1600) as chunks:
        responses = list(asr.streaming_response_generator(chunks, streaming))
    results = [r for response in responses for r in response.results]
    theirs = [r.alternatives[0].transcript for r in results if r.is_final]
    with channel_to(server) as channel:
        ours = finals(
            stream(pb_grpc.TranscriberStub(channel), wav.read_bytes(), pb.RecognitionConfig())
        )
    assert theirs == ours and ours
    assert any(not r.is_final for r in results)
    assert all(r.audio_processed > 0 for r in results)


def test_telephony_audio_through_riva(server, wav: Path) -> None:
    """MULAW at 8 kHz, as a call centre sends it: the transcript echoic's API gives."""
    import soundfile as sf
    import soxr

    samples, _ = sf.read(wav, dtype="float32")
    mulaw = container(soxr.resample(samples, 16000, 8000), 8000, "RAW", "ULAW")
    asr = riva_client.ASRService(riva_client.Auth(uri=server.address))
    config = _config(encoding=riva_client.AudioEncoding.MULAW, sample_rate_hertz=8000)
    theirs = asr.offline_recognize(mulaw, config)
    ours_config = pb.RecognitionConfig(encoding=pb.RecognitionConfig.MULAW, sample_rate_hertz=8000)
    with channel_to(server) as channel:
        ours = recognize(pb_grpc.TranscriberStub(channel), mulaw, ours_config)
    assert [r.alternatives[0].transcript for r in theirs.results] == texts(ours)


def test_the_served_models_and_the_metrics(server, wav: Path) -> None:
    asr = riva_client.ASRService(riva_client.Auth(uri=server.address))
    asr.offline_recognize(wav.read_bytes(), _config())
    reply = asr.stub.GetRivaSpeechRecognitionConfig(rasr.RivaSpeechRecognitionConfigRequest())
    (model,) = reply.model_config
    assert model.model_name == "echoic-tiny" and model.parameters["streaming"] == "true"
    none = asr.stub.GetRivaSpeechRecognitionConfig(
        rasr.RivaSpeechRecognitionConfigRequest(model_name="nope")
    )
    assert not none.model_config
    import urllib.request

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read()
    assert b'echoic_requests_total{code="OK",method="riva.Recognize"}' in metrics


TONE = pcm16(0.3 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000).astype(np.float32))


@pytest.mark.parametrize(
    ("fields", "audio", "says"),
    [
        (dict(language_code="de-DE"), TONE, "transcribes English"),
        (dict(custom_configuration={"nope": "1"}), TONE, "decoder, beam_size, max_utterance_ms"),
        (dict(custom_configuration={"beam_size": "x"}), TONE, "whole number"),
        (dict(custom_configuration={"decoder": "viterbi"}), TONE, "use greedy or beam"),
        (dict(enable_separate_recognition_per_channel=True), TONE, "per channel"),
        (dict(sample_rate_hertz=0), TONE, "sample_rate_hertz"),
        (dict(sample_rate_hertz=16000, model="nope"), TONE, "unknown model"),
        (dict(sample_rate_hertz=16000), TONE[:-1], "stray"),
        (dict(encoding=riva_client.AudioEncoding.FLAC), b"fLaC" + bytes(200), "decode"),
        # phrases that normalise to no word count too, before any is read
        (dict(sample_rate_hertz=16000, speech_contexts=[rasr.SpeechContext(
            phrases=["!"] * 2000, boost=20.0)]), TONE, "2000 phrases; at most 1000"),
    ],
    ids=["language", "custom-key", "custom-value", "custom-decoder", "per-channel", "no-rate",
         "unknown-model", "half-a-sample", "bad-flac", "wordless-phrases"],
)  # fmt: skip
def test_errors_are_invalid_argument_that_say_what_to_fix(server, fields, audio, says) -> None:
    """As echoic's own API answers them: INVALID_ARGUMENT with a sentence, for whole
    requests and streams alike."""
    asr = riva_client.ASRService(riva_client.Auth(uri=server.address))
    config = riva_client.RecognitionConfig(**{"language_code": "en-US", **fields})
    code, details = status_of(lambda: asr.offline_recognize(audio, config))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details, details
    streaming = riva_client.StreamingRecognitionConfig(config=config)
    code, details = status_of(lambda: list(asr.streaming_response_generator([audio], streaming)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details, details


def test_garbage_messages_are_invalid_argument(server) -> None:
    with channel_to(server) as channel:
        call = channel.unary_unary("/nvidia.riva.asr.RivaSpeechRecognition/Recognize")
        code, details = status_of(lambda: call(b"\xff\xff\xff", timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "riva_asr.proto" in details


def test_the_same_limit_holds_for_both_apis(tiny_model_dir, wav: Path) -> None:
    """Riva calls count against --max-streams with echoic's: one open echoic stream on a
    server of one stream makes a Riva call RESOURCE_EXHAUSTED, as it would an echoic one."""
    import threading

    from tests.test_server import _held_stream, wait_until

    with running(tiny_model_dir, max_streams=1) as server, channel_to(server) as channel:
        release, responses, errors = threading.Event(), [], []
        held = _held_stream(pb_grpc.TranscriberStub(channel), release, responses, errors)
        wait_until(lambda: server.server.service.active == 1, what="the open stream")
        asr = riva_client.ASRService(riva_client.Auth(uri=server.address))
        config = _config()
        riva_client.add_audio_file_specs_to_config(config, wav)
        code, details = status_of(lambda: asr.offline_recognize(wav.read_bytes(), config))
        release.set()
        held.join(30)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 1" in details
    assert errors == []


def _offline(asr, wav: Path) -> str:
    """Riva's offline_recognize on the whole WAV file: its transcript."""
    config = _config(encoding=riva_client.AudioEncoding.LINEAR_PCM)
    riva_client.add_audio_file_specs_to_config(config, wav)
    response = asr.offline_recognize(wav.read_bytes(), config)
    return " ".join(r.alternatives[0].transcript for r in response.results)


def _streaming(asr, wav: Path) -> str:
    """Riva's streaming_response_generator over its file iterator, interim results on,
    as its examples stream: the transcripts of the final results."""
    config = _config(encoding=riva_client.AudioEncoding.LINEAR_PCM)
    riva_client.add_audio_file_specs_to_config(config, wav)
    streaming = riva_client.StreamingRecognitionConfig(config=config, interim_results=True)
    with riva_client.AudioChunkFileIterator(wav, 1600) as chunks:
        results = [r for response in asr.streaming_response_generator(chunks, streaming)
                   for r in response.results]  # fmt: skip
    return " ".join(r.alternatives[0].transcript for r in results if r.is_final)


@pytest.mark.slow
@pytest.mark.parametrize(
    "transcribe",
    [pytest.param(_offline, id="offline_recognize"),
     pytest.param(_streaming, id="streaming_response_generator")],
)  # fmt: skip
def test_a_riva_user_gets_the_words_from_the_default_server(
    default_serve: tuple[int, int], speech_corpus: Path, transcribe
) -> None:
    """`echoic serve` as the README's main command starts it (the bundled model), and
    Riva's client as its examples use it, whole files and streams: most words of the
    sentences come back."""
    grpc_port, _ = default_serve
    asr = riva_client.ASRService(riva_client.Auth(uri=f"127.0.0.1:{grpc_port}"))
    hits, total = words_heard(speech_corpus, lambda wav: transcribe(asr, wav))
    assert hits >= 0.5 * total, (hits, total)
