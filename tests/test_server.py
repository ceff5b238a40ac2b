"""The gRPC server: real servers on port 0, real channels, the tiny exported model.

The tiny model's transcripts are junk, but distinct per utterance, which is what
equality and no-cross-talk checks need.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
pytest.importorskip("prometheus_client", reason="the server needs the serve extra")

import soundfile as sf  # noqa: E402
import soxr  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from echoic.model.core.audio import decode_audio  # noqa: E402
from echoic.model.runtime.recognizer import MAX_CUT_DELAY, Recognizer  # noqa: E402
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from echoic.server.config import ServerConfig  # noqa: E402
from echoic.server.process.background import BackgroundServer  # noqa: E402

Code = grpc.StatusCode
Config = pb.RecognitionConfig
RPC_TIMEOUT = 30.0  # s, per call: generous for a loaded 2-core machine; failures are fast
PAUSE_TIMEOUT = 600.0  # s a paused stream waits for its test to release it: a deploy and
# export in between take over 30 s on a loaded 2-core machine (a test that never releases
# fails on its own assertions first)
CHUNK = 3200  # bytes per streamed message: 100 ms of 16 kHz PCM16
OPEN = 6 * CHUNK  # bytes after which the tiny model has decoded a window (an interim result)


# ---------------------------------------------------------------- helpers


def pcm16(samples: np.ndarray) -> bytes:
    return np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def container(samples: np.ndarray, rate: int, fmt: str, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


# Asked for by the tests that compare with a greedy Recognizer: a request that names no
# decoder gets the server's default, beam search for the bundled model (it has an LM).
GREEDY = pb.DecoderConfig(kind=pb.DecoderConfig.GREEDY)


def linear16(rate: int = 16000, **kw) -> Config:
    return Config(encoding=Config.LINEAR16, sample_rate_hertz=rate, **kw)


def recognize(stub, audio: bytes, config: Config) -> pb.RecognizeResponse:
    request = pb.RecognizeRequest(config=config, audio_content=audio)
    return stub.Recognize(request, timeout=RPC_TIMEOUT)


def stream_messages(
    audio: bytes,
    config: Config,
    *,
    interim: bool = False,
    interval_ms: int = 0,
    pause: tuple[int, threading.Event] | None = None,
    chunk: int = CHUNK,
) -> Iterator[pb.StreamingRecognizeRequest]:
    """Config, then audio in `chunk`-byte messages; with `pause` = (byte offset, event),
    wait for the event before sending the bytes from that offset on."""
    yield pb.StreamingRecognizeRequest(
        streaming_config=pb.StreamingRecognitionConfig(
            config=config, interim_results=interim, interim_interval_ms=interval_ms
        )
    )
    for i in range(0, len(audio), chunk):
        if pause is not None and i >= pause[0] and not pause[1].is_set():
            assert pause[1].wait(PAUSE_TIMEOUT), "the test never released the stream"
        yield pb.StreamingRecognizeRequest(audio_content=audio[i : i + chunk])


def stream(stub, audio: bytes, config: Config, **kw) -> list[pb.StreamingRecognizeResponse]:
    return list(stub.StreamingRecognize(stream_messages(audio, config, **kw), timeout=RPC_TIMEOUT))


def finals(responses) -> list[str]:
    return [
        r.results[0].alternatives[0].transcript
        for r in responses
        if r.results and r.results[0].is_final
    ]


def texts(response: pb.RecognizeResponse) -> list[str]:
    return [r.alternatives[0].transcript for r in response.results]


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details() or ""


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextmanager
def running(model_dir: Path | None = None, **overrides) -> Iterator[BackgroundServer]:
    """A server on 127.0.0.1:<free port>, one ONNX thread, stopped on exit."""
    settings = dict(port=0, http_port=0, intra_op_threads=1, idle_timeout_seconds=10.0,
                    grace_seconds=0.0)  # fmt: skip
    if model_dir is not None:
        settings["model_dir"] = model_dir
    settings.update(overrides)
    with BackgroundServer(ServerConfig(**settings)) as server:
        yield server


@contextmanager
def channel_to(server: BackgroundServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as channel:
        yield channel


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def clips(speech_corpus: Path) -> list[tuple[bytes, np.ndarray]]:
    """(WAV file bytes, 16 kHz samples) of four corpus utterances."""
    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()][:4]
    out = []
    for row in rows:
        data = Path(row["audio_filepath"]).read_bytes()
        out.append((data, decode_audio(data, 16000)))
    return out


@pytest.fixture(scope="module")
def recognizer(tiny_model_dir: Path) -> Recognizer:
    return Recognizer(tiny_model_dir, intra_op_threads=1)


@pytest.fixture(scope="module")
def expected(recognizer: Recognizer, clips) -> list[str]:
    """In-process transcripts (model.onnx, whole utterances) of `clips`."""
    return [t.text for t in recognizer.transcribe([samples for _, samples in clips])]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    with running(tiny_model_dir, metrics_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server: BackgroundServer) -> Iterator[pb_grpc.TranscriberStub]:
    with channel_to(server) as channel:
        yield pb_grpc.TranscriberStub(channel)


# ---------------------------------------------------------------- transcripts


def test_recognize_and_stream_equal_in_process_transcribe(stub, clips, expected) -> None:
    assert len(set(expected)) == len(expected), "the tiny model should tell the clips apart"
    for (wav, samples), want in zip(clips[:2], expected[:2], strict=True):
        response = recognize(stub, wav, Config(encoding=Config.WAV, enable_word_time_offsets=True))
        assert texts(response) == [want]
        result = response.results[0]
        assert result.is_final and result.stability == 1.0
        assert response.model.name == "echoic-tiny" and response.model.version == "1"
        assert response.audio_processed_seconds == pytest.approx(len(samples) / 16000)
        words = result.alternatives[0].words
        assert [w.word for w in words] == want.split()
        assert all(0 <= w.start_time < w.end_time <= len(samples) / 16000 + 0.05 for w in words)
        assert all(0.0 <= w.confidence <= 1.0 for w in words)

        responses = stream(stub, wav, Config(encoding=Config.WAV))
        assert finals(responses) == [want]
        assert {(r.model.name, r.model.version) for r in responses} == {("echoic-tiny", "1")}
        # LINEAR16 of the same samples takes the same path after decoding.
        assert finals(stream(stub, pcm16(samples), linear16())) == [want]


def test_beam_search_equals_in_process_beam_search(stub, tiny_model_dir, clips) -> None:
    pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")
    from echoic.model.core.decoding import DecoderConfig

    beam = Recognizer(tiny_model_dir, DecoderConfig(kind="beam", beam_size=8), intra_op_threads=1)
    wav, samples = clips[1]
    want = beam.transcribe([samples])[0].text
    config = Config(decoder=pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=8))
    assert texts(recognize(stub, wav, config)) == [want]
    assert finals(stream(stub, wav, config, interim=True)) == [want]


def test_beam_final_results_carry_max_alternatives(stub, tiny_model_dir, clips) -> None:
    pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")
    from echoic.model.core.decoding import DecoderConfig

    beam = Recognizer(tiny_model_dir, DecoderConfig(kind="beam", beam_size=8), intra_op_threads=1)
    wav, samples = clips[2]
    log_probs = beam.log_probs([samples])[0]
    want = beam.decode(log_probs, n_best=3)
    want = [want.text, *(t.text for t in want.alternatives)]
    assert len(want) > 1  # the tiny model is unsure enough to have other hypotheses
    beam_config = pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=8)
    config = Config(decoder=beam_config, max_alternatives=3, enable_word_time_offsets=True)
    (result,) = recognize(stub, wav, config).results
    assert [a.transcript for a in result.alternatives] == want
    assert all(len(a.words) == len(a.transcript.split()) for a in result.alternatives)
    responses = stream(stub, wav, config, interim=True)
    results = [r.results[0] for r in responses if r.results]
    assert [a.transcript for a in results[-1].alternatives] == want and results[-1].is_final
    assert all(len(r.alternatives) == 1 for r in results if not r.is_final)
    greedy = recognize(stub, wav, Config(max_alternatives=3)).results[0]
    assert len(greedy.alternatives) == 1


def test_beam_search_uses_the_model_directorys_lm(tiny_lm_model_dir, clips) -> None:
    """A model directory with lm.arpa: BEAM requests decode with it, disable_lm without."""
    pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")
    from echoic.model.core.decoding import DecoderConfig

    with_lm = Recognizer(
        tiny_lm_model_dir, DecoderConfig(kind="beam", beam_size=8), intra_op_threads=1
    )
    assert with_lm.lm_path == str(tiny_lm_model_dir / "lm.arpa")
    without = Recognizer(with_lm.engine, DecoderConfig(kind="beam", beam_size=8, use_lm=False))
    audio = [samples for _, samples in clips]
    want = [t.text for t in with_lm.transcribe(audio)]
    plain = [t.text for t in without.transcribe(audio)]
    assert want != plain, "the LM should change what the tiny model's beam search reads"
    beam = pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=8)
    no_lm = pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=8, disable_lm=True)
    with running(tiny_lm_model_dir) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        (info,) = stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT).models
        assert info.has_language_model
        for (wav, _), lm_text, plain_text in zip(clips, want, plain, strict=True):
            assert texts(recognize(stub, wav, Config(decoder=beam))) == [lm_text]
            assert finals(stream(stub, wav, Config(decoder=beam))) == [lm_text]
            assert texts(recognize(stub, wav, Config(decoder=no_lm))) == [plain_text]


def test_interim_results_then_one_final(stub, clips, expected) -> None:
    wav, samples = clips[0]
    responses = stream(stub, wav, Config(), interim=True)
    results = [r.results[0] for r in responses]
    assert len(results) >= 3 and not any(r.is_final for r in results[:-1])
    assert results[-1].is_final and results[-1].stability == 1.0
    assert results[-1].alternatives[0].transcript == expected[0]
    assert all(0.0 <= r.stability <= 1.0 for r in results)
    processed = [r.audio_processed_seconds for r in responses]
    assert processed == sorted(processed) and processed[-1] == pytest.approx(len(samples) / 16000)
    # One interim per second of audio at most, when asked for that.
    sparse = stream(stub, wav, Config(), interim=True, interval_ms=1000)
    assert len(sparse) - 1 <= len(samples) / 16000 + 1 and len(sparse) < len(responses)


# Endpointing is checked on the bundled model, whose transcripts are real words: two
# corpus utterances with a known pause between them, so where each utterance ends is
# known from the audio itself.
PAUSE = 1.5  # s of digital silence put between the two utterances


@pytest.fixture(scope="module")
def bundled_stub() -> Iterator[pb_grpc.TranscriberStub]:
    with running() as server, channel_to(server) as channel:  # no model named: the bundled one
        yield pb_grpc.TranscriberStub(channel)


@pytest.fixture(scope="module")
def two_utterances(clips) -> tuple[np.ndarray, list[np.ndarray], tuple[float, float]]:
    """(audio, [the two parts], (quiet_from, quiet_to)): clips 0 and 1 joined by PAUSE s of
    silence, and where the signal is quiet between them (s): from the last instant of the
    first clip's speech to the first instant of the second's."""

    def speech(x: np.ndarray) -> tuple[float, float]:  # above 2% of the peak
        loud = np.flatnonzero(np.abs(x) > 0.02 * np.abs(x).max())
        return loud[0] / 16000, (loud[-1] + 1) / 16000

    (_, a), (_, b) = clips[0], clips[1]
    audio = np.concatenate([a, np.zeros(round(PAUSE * 16000), np.float32), b])
    quiet = (speech(a)[1], len(a) / 16000 + PAUSE + speech(b)[0])
    return audio, [a, b], quiet


def _utterances(response) -> list[tuple[int, float, float, str]]:
    return [
        (r.utterance_index, r.utterance_start_time, r.utterance_end_time,
         r.alternatives[0].transcript)
        for r in response.results
    ]  # fmt: skip


def _final_utterances(responses) -> list[tuple[int, float, float, str]]:
    return [u for r in responses if r.results and r.results[0].is_final for u in _utterances(r)]


def _chunking(stub) -> tuple[float, float]:
    """(chunk, frame) of the served model, s: an endpoint can only fall at a step's end."""
    (info,) = stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT).models
    return info.chunk_seconds, info.frame_seconds


@pytest.mark.parametrize(
    "silence_ms", [pytest.param(500, id="500ms"), pytest.param(1200, id="1200ms")]
)
def test_trailing_silence_ends_the_utterance_inside_the_pause(
    bundled_stub, two_utterances, silence_ms: int
) -> None:
    """Measured: the first clip's last word ends at 3.15 s, its speech at 3.16 s, the
    second's speech starts at 5.09 s; 500 ms ends the utterance at 4.2 s, 1200 ms at 4.8 s
    (chunks of 0.6 s). The second part's transcript differs a little from the part's
    alone, because the acoustic model's state carries over the endpoint: CER 0.125 with
    the bundled model's version 1, 0.207 with version 2. The first part's may differ at
    its end: its last chunk's backward direction sees the pause after it, where the part
    alone ends (version 4: "...laszi dage" in the stream, "...laszi dag" alone)."""
    import jiwer

    audio, parts, (quiet_from, quiet_to) = two_utterances
    chunk, frame = _chunking(bundled_stub)
    alone = [t.text for t in Recognizer(intra_op_threads=1).transcribe(parts)]
    endpointing = pb.EndpointingConfig(trailing_silence_ms=silence_ms)
    config = linear16(endpointing=endpointing, enable_word_time_offsets=True, decoder=GREEDY)
    response = recognize(bundled_stub, pcm16(audio), config)
    # One utterance a clip: no cut at a pause between words, none missed in the pause.
    assert len(response.results) == 2, _utterances(response)
    first, second = response.results
    assert first.utterance_index == 0 and second.utterance_index == 1
    assert first.is_final and second.is_final
    last_word = first.alternatives[0].words[-1].end_time
    assert quiet_from - 2 * frame <= last_word <= quiet_from + frame
    # Rule 1 fires at the end of the first step that leaves `silence_ms` after the last word.
    silence = silence_ms / 1000
    steps = np.ceil((last_word + silence) / chunk - 1e-6)
    assert first.utterance_end_time == pytest.approx(steps * chunk)
    assert quiet_from + silence - 2 * frame <= first.utterance_end_time < quiet_to
    assert second.utterance_start_time == first.utterance_end_time
    assert second.utterance_end_time == pytest.approx(len(audio) / 16000)
    assert second.alternatives[0].words[0].start_time >= quiet_to - frame
    for result in (first, second):
        words = result.alternatives[0].words
        assert [w.word for w in words] == result.alternatives[0].transcript.split()
        assert result.utterance_start_time <= words[0].start_time
        assert words[-1].end_time <= result.utterance_end_time
    assert jiwer.cer(alone[0], first.alternatives[0].transcript) <= 0.05
    assert jiwer.cer(alone[1], second.alternatives[0].transcript) <= 0.25
    assert _final_utterances(stream(bundled_stub, pcm16(audio), config)) == _utterances(response)


@pytest.mark.parametrize(
    "longest_ms", [pytest.param(1000, id="1000ms"), pytest.param(2500, id="2500ms")]
)
def test_max_utterance_cuts_pieces_no_longer_than_asked(
    bundled_stub, two_utterances, longest_ms: int
) -> None:
    """Measured at 1000 ms before cuts waited for a frame outside a character: 0-1.2,
    1.2-2.4, 2.4-3.6, 4.8-6.0, 6.0-6.91 s (3.6-4.8 s is silence alone, which gives no
    result)."""
    audio, _, (quiet_from, quiet_to) = two_utterances
    chunk, frame = _chunking(bundled_stub)
    longest = longest_ms / 1000
    config = linear16(
        endpointing=pb.EndpointingConfig(max_utterance_ms=longest_ms),
        enable_word_time_offsets=True,
        decoder=GREEDY,
    )
    response = recognize(bundled_stub, pcm16(audio), config)
    pieces = _utterances(response)
    assert [i for i, *_ in pieces] == list(range(len(pieces)))
    # Cut at the end of the first step that reaches `longest` and does not end inside a
    # character's frames (the next piece would write it again), so every piece but the
    # last is that long or at most MAX_CUT_DELAY longer, in whole steps; together they
    # cover the audio.
    cut = np.ceil(longest / chunk - 1e-6) * chunk
    latest = cut + np.ceil(MAX_CUT_DELAY / chunk - 1e-6) * chunk
    assert pieces[0][1] == 0.0 and pieces[-1][2] == pytest.approx(len(audio) / 16000)
    for _, start, end, _ in pieces[:-1]:
        assert cut - 1e-6 <= end - start <= latest + 1e-6 and cut < longest + chunk
        assert (end - start) / chunk == pytest.approx(round((end - start) / chunk))
    assert pieces[-1][2] - pieces[-1][1] <= latest + 1e-6
    for (_, _, end, _), (_, start, _, _) in zip(pieces, pieces[1:], strict=False):
        # Contiguous, but for stretches of silence alone, which give no result.
        assert start == pytest.approx(end) or quiet_from <= end < start <= quiet_to + frame
    for r in response.results:
        words = r.alternatives[0].words
        assert words and [w.word for w in words] == r.alternatives[0].transcript.split()
        assert r.utterance_start_time <= words[0].start_time
        assert words[-1].end_time <= r.utterance_end_time
    # Nothing lost or repeated at the cuts: the same letters as two utterances cut in the
    # pause (the cuts restart the decoder, so a cut inside a word splits it in two).
    whole = recognize(
        bundled_stub,
        pcm16(audio),
        linear16(endpointing=pb.EndpointingConfig(trailing_silence_ms=800), decoder=GREEDY),
    )  # fmt: skip
    letters = lambda texts: "".join(texts).replace(" ", "")  # noqa: E731
    assert letters(t for *_, t in pieces) == letters(texts(whole))
    assert _final_utterances(stream(bundled_stub, pcm16(audio), config)) == pieces


# ---------------------------------------------------------------- audio formats


def _encode(samples16k: np.ndarray, encoding: str, rate: int, channels: int):
    samples = soxr.resample(samples16k, 16000, rate) if rate != 16000 else samples16k
    if channels == 2:
        samples = np.stack([samples, 0.5 * samples], axis=1)
    if encoding in ("LINEAR16", "MULAW", "ALAW"):
        if encoding == "LINEAR16":
            data = pcm16(samples)
        else:  # raw G.711: a headerless RAW file of that subtype
            data = container(samples, rate, "RAW", "ULAW" if encoding == "MULAW" else "ALAW")
        config = Config(
            encoding=Config.AudioEncoding.Value(encoding), sample_rate_hertz=rate,
            audio_channel_count=channels,
        )  # fmt: skip
    else:
        fmt, subtype = {"FLAC": ("FLAC", "PCM_16"), "OGG_OPUS": ("OGG", "OPUS"),
                        "WAV-ULAW": ("WAV", "ULAW")}.get(encoding, ("WAV", "PCM_16"))  # fmt: skip
        data = container(samples, rate, fmt, subtype)
        config = Config(encoding=Config.AudioEncoding.Value(encoding.split("-")[0]))
    return data, config


@pytest.mark.parametrize(
    ("encoding", "rate", "channels"),
    [
        pytest.param("LINEAR16", 8000, 1, id="linear16-8k"),
        pytest.param("LINEAR16", 22050, 1, id="linear16-22.05k"),
        pytest.param("LINEAR16", 44100, 2, id="linear16-44.1k-stereo"),
        pytest.param("LINEAR16", 48000, 1, id="linear16-48k"),
        pytest.param("WAV", 48000, 2, id="wav-48k-stereo"),
        pytest.param("FLAC", 16000, 1, id="flac-16k"),
        pytest.param("FLAC", 44100, 1, id="flac-44.1k"),
        pytest.param("ENCODING_UNSPECIFIED", 22050, 1, id="auto-wav-22.05k"),
        pytest.param("MULAW", 8000, 1, id="mulaw-8k"),
        pytest.param("ALAW", 8000, 2, id="alaw-8k-stereo"),
        pytest.param("WAV-ULAW", 8000, 1, id="wav-mulaw-8k"),
        pytest.param("OGG_OPUS", 48000, 1, id="ogg-opus-48k"),
    ],
)
def test_rates_and_encodings(stub, recognizer, clips, encoding, rate, channels) -> None:
    """Each encoding, whole (Recognize) and streamed in 3,200-byte messages, gives the
    transcript of the samples `decode_audio` makes of the same bytes."""
    data, config = _encode(clips[2][1], encoding, rate, channels)
    kind = {"LINEAR16": "linear16", "ENCODING_UNSPECIFIED": "auto", "WAV-ULAW": "wav",
            "OGG_OPUS": "ogg"}.get(encoding, encoding.lower())  # fmt: skip
    rate_arg = rate if kind in ("linear16", "mulaw", "alaw") else None
    samples = decode_audio(data, 16000, encoding=kind, sample_rate=rate_arg, channels=channels)
    want = recognizer.transcribe([samples])[0].text
    assert texts(recognize(stub, data, config)) == [want]
    assert finals(stream(stub, data, config)) == [want]


@pytest.mark.parametrize(
    ("fmt", "subtype", "encoding", "rate"),
    [("RAW", "ULAW", "mulaw", 8000), ("RAW", "ALAW", "alaw", 8000), ("WAV", "ULAW", "wav", None),
     ("WAV", "ALAW", "auto", None)],
    ids=["raw-mulaw", "raw-alaw", "wav-mulaw", "wav-alaw-auto"],
)  # fmt: skip
def test_g711_decodes_as_it_arrives(clips, fmt, subtype, encoding, rate) -> None:
    """Telephony audio streams: fed 7 bytes at a time, its samples come out before the
    end (interim results are possible), and all of them equal the whole file's decode."""
    from echoic.server.core.audio_input import AudioInput

    data = container(soxr.resample(clips[1][1], 16000, 8000), 8000, fmt, subtype)
    audio = AudioInput(encoding, 16000, sample_rate=rate)
    early = [audio.feed(data[i : i + 7]) for i in range(0, len(data), 7)]
    whole = decode_audio(data, 16000, encoding=encoding, sample_rate=rate)
    assert sum(map(len, early)) > 0.9 * len(whole)
    assert np.array_equal(np.concatenate([*early, audio.finish()]), whole)


STREAMED_CONTAINERS = [
    pytest.param("FLAC", "PCM_16", 16000, 1, id="flac-16k"),
    pytest.param("FLAC", "PCM_16", 44100, 2, id="flac-44.1k-stereo"),
    pytest.param("FLAC", "PCM_16", 48000, 1, id="flac-48k"),
    pytest.param("OGG", "OPUS", 16000, 1, id="ogg-opus-16k"),
    pytest.param("OGG", "OPUS", 48000, 2, id="ogg-opus-48k-stereo"),
    pytest.param("OGG", "VORBIS", 44100, 2, id="ogg-vorbis-44.1k-stereo"),
    pytest.param("OGG", "VORBIS", 16000, 1, id="ogg-vorbis-16k"),
]


@pytest.mark.parametrize(("fmt", "subtype", "rate", "channels"), STREAMED_CONTAINERS)
def test_flac_and_ogg_decode_as_they_arrive(clips, fmt, subtype, rate, channels) -> None:
    """A FLAC or Ogg stream's samples come out while it arrives (interim results are
    possible), all of them equal to the whole file's decode, and memory holds only what
    the decoder has not reached."""
    from echoic.server.core.audio_input import AudioInput

    samples = soxr.resample(clips[0][1], 16000, rate)
    if channels == 2:
        samples = np.stack([samples, 0.5 * samples], axis=1)
    data = container(samples, rate, fmt, subtype)
    audio = AudioInput(fmt.lower(), 16000)
    piece = max(len(data) // 40, 100)  # an Ogg is a tenth of its FLAC: pieces of 2.5 %
    early = []
    for i in range(0, len(data), piece):
        early.append(audio.feed(data[i : i + piece]))
        time.sleep(0.001)  # the decoder runs in its own thread
    whole = decode_audio(data, 16000)
    assert sum(map(len, early)) > 0.3 * len(whole) and audio.undecoded_bytes < len(data)
    assert np.array_equal(np.concatenate([*early, audio.finish()]), whole)


@pytest.mark.parametrize("subtype", ["OPUS", "VORBIS"])
def test_ogg_streams_equal_soundfiles_own_decode(clips, subtype) -> None:
    """At the model's rate (no resampling), an Ogg stream fed 50 bytes at a time gives
    libsndfile's own samples of the whole file, as soundfile reads them (clipped to
    [-1, 1], as all audio is)."""
    from echoic.server.core.audio_input import AudioInput

    data = container(clips[1][1], 16000, "OGG", subtype)
    audio = AudioInput("ogg", 16000)
    got = [audio.feed(data[i : i + 50]) for i in range(0, len(data), 50)]
    got = np.concatenate([*got, audio.finish()])
    want, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 16000 and np.array_equal(got, np.clip(want, -1.0, 1.0))


@pytest.mark.parametrize(
    ("fmt", "subtype", "threads"),
    [pytest.param("FLAC", "PCM_16", 1, id="flac"), pytest.param("OGG", "OPUS", 2, id="ogg")],
)
def test_an_abandoned_stream_frees_its_decoder(clips, fmt, subtype, threads) -> None:
    """A call that ends early ends its decoder's threads (an Ogg decoder has two: libsndfile
    reading an OS pipe, and the thread that fills it)."""
    from echoic.server.core.audio_input import AudioInput

    data = container(clips[0][1], 16000, fmt, subtype)
    before = threading.active_count()
    inputs = [AudioInput(fmt.lower(), 16000) for _ in range(5)]
    for audio in inputs:
        audio.feed(data[: len(data) // 2])
    assert threading.active_count() == before + 5 * threads
    for audio in inputs:
        audio.close()
    wait_until(lambda: threading.active_count() == before, what="the decoder threads to end")


@pytest.mark.parametrize(
    ("fmt", "subtype", "encoding", "chunk"),
    [
        pytest.param("FLAC", "PCM_16", Config.FLAC, CHUNK, id="flac"),
        pytest.param("OGG", "OPUS", Config.OGG_OPUS, 400, id="ogg-opus"),
    ],
)
def test_a_flac_or_ogg_stream_gets_interim_results(
    stub, recognizer, clips, fmt, subtype, encoding, chunk
) -> None:
    """Through the server: interim results before the end, and the final transcript of
    the whole file, as Recognize gives it for the same bytes."""
    data = container(clips[2][1], 16000, fmt, subtype)
    config = Config(encoding=encoding)
    responses = stream(stub, data, config, interim=True, chunk=chunk)
    results = [r.results[0] for r in responses if r.results]
    assert any(not r.is_final for r in results[:-1]), "no interim result before the end"
    want = recognizer.transcribe([decode_audio(data, 16000)])[0].text
    assert finals(responses) == [want] == texts(recognize(stub, data, config))


# ---------------------------------------------------------------- bad input

TONE = pcm16(0.3 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000).astype(np.float32))
WAV_GARBAGE = b"RIFF\x24\x00\x00\x00WAVEjunkjunkjunkjunk" + bytes(64)
OGG = container(0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000), 16000, "OGG", "OPUS")
OGG_CUT = OGG[: len(OGG) * 2 // 3]  # a truncated upload: ends inside a page
OGG_CUT_HALVES = (OGG_CUT[:500], OGG_CUT[500:])
OGG_GARBAGE = b"OggS" + bytes(range(1, 200))  # the capture pattern, then not an Ogg page


def _config_message(config: Config) -> pb.StreamingRecognizeRequest:
    return pb.StreamingRecognizeRequest(
        streaming_config=pb.StreamingRecognitionConfig(config=config)
    )


def _audio_message(data: bytes) -> pb.StreamingRecognizeRequest:
    return pb.StreamingRecognizeRequest(audio_content=data)


BAD_STREAMS = [
    pytest.param([_audio_message(TONE)], "streaming_config", id="audio-before-config"),
    pytest.param([], "config", id="no-config"),
    pytest.param(
        [_config_message(linear16()), _config_message(linear16())], "twice", id="config-twice"
    ),
    pytest.param([_config_message(Config(encoding=7))], "encoding", id="unsupported-encoding"),
    pytest.param(
        [_config_message(Config(encoding=Config.WAV)), _audio_message(b"\x00garbage" * 8)],
        "WAV",
        id="wav-garbage",
    ),  # fmt: skip
    pytest.param(
        [_config_message(Config(encoding=Config.FLAC)), _audio_message(b"fLaC" + bytes(200))],
        "decode",
        id="flac-garbage",
    ),  # fmt: skip
    pytest.param(
        [_config_message(Config(encoding=Config.OGG_OPUS)), *map(_audio_message, OGG_CUT_HALVES)],
        "truncated",
        id="ogg-truncated",
    ),
    pytest.param(
        [_config_message(Config(encoding=Config.OGG_OPUS)), _audio_message(OGG_GARBAGE)],
        "not an Ogg page",
        id="ogg-garbage",
    ),
    pytest.param([_config_message(linear16(model="nope"))], "unknown model", id="unknown-model"),
    pytest.param(
        [_config_message(linear16()), _audio_message(TONE[:-1])], "stray", id="half-a-sample"
    ),
]


@pytest.mark.parametrize(("messages", "says"), BAD_STREAMS)
def test_bad_streams_are_invalid_argument(stub, clips, expected, messages, says) -> None:
    code, details = status_of(
        lambda: list(stub.StreamingRecognize(iter(messages), timeout=RPC_TIMEOUT))
    )
    assert code == Code.INVALID_ARGUMENT and says in details, details
    # And it serves the next client as before.
    assert finals(stream(stub, clips[0][0], Config(encoding=Config.WAV))) == [expected[0]]


BAD_REQUESTS = [
    pytest.param(Config(encoding=7), TONE, "encoding", id="unsupported-encoding"),
    pytest.param(Config(encoding=Config.LINEAR16), TONE, "sample_rate_hertz", id="no-rate"),
    pytest.param(linear16(rate=1000), TONE, "sample rate", id="rate-too-low"),
    pytest.param(linear16(rate=16000, audio_channel_count=-1), TONE, "channel", id="bad-channels"),
    pytest.param(Config(encoding=Config.WAV), WAV_GARBAGE, "decode", id="wav-garbage"),
    pytest.param(Config(encoding=Config.FLAC), b"fLaC" + bytes(300), "decode", id="flac-garbage"),
    pytest.param(Config(encoding=Config.FLAC), container(np.zeros(800), 16000, "WAV"), "WAV",
                 id="wav-sent-as-flac"),
    pytest.param(Config(encoding=Config.OGG_OPUS), OGG_CUT, "truncated", id="ogg-truncated"),
    pytest.param(Config(), OGG_GARBAGE, "not an Ogg page", id="ogg-garbage"),
    pytest.param(Config(encoding=Config.OGG_OPUS), OGG + b"junk", "not an Ogg page",
                 id="ogg-with-junk-after"),
    pytest.param(Config(), TONE, "LINEAR16", id="raw-pcm-without-encoding"),
    pytest.param(linear16(), b"", "empty", id="no-audio"),
    pytest.param(linear16(model="nope"), TONE, "unknown model", id="unknown-model"),
    pytest.param(linear16(model_version="7"), TONE, "not loaded", id="unknown-version"),
    pytest.param(
        linear16(decoder=pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=5000)), TONE,
        "beam_size", id="beam-too-wide",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("config", "audio", "says"), BAD_REQUESTS)
def test_bad_requests_are_invalid_argument(stub, config, audio, says) -> None:
    code, details = status_of(lambda: recognize(stub, audio, config))
    assert code == Code.INVALID_ARGUMENT and says in details, details
    assert recognize(stub, TONE, linear16()).results  # and it serves the next client


# ---------------------------------------------------------------- batching


def test_concurrent_streams_are_batched_without_cross_talk(tiny_model_dir, clips, expected):
    # A short batching wait makes batches of the four streams certain on a busy machine.
    with running(tiny_model_dir, max_batch=4, max_wait_ms=50) as server, channel_to(server) as ch:
        stub = pb_grpc.TranscriberStub(ch)
        got: dict[int, list[str]] = {}

        def one(i: int) -> None:
            wav = clips[i][0]
            got[i] = (
                finals(stream(stub, wav, Config()))
                if i % 2
                else texts(recognize(stub, wav, Config()))
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RPC_TIMEOUT)
        assert {i: got.get(i) for i in range(4)} == {i: [expected[i]] for i in range(4)}
        registry = server.server.metrics.registry
        labels = {"model": "echoic-tiny", "version": "1"}
        batches = registry.get_sample_value("echoic_batch_size_count", labels)
        singles = registry.get_sample_value("echoic_batch_size_bucket", labels | {"le": "1.0"})
        assert batches and singles < batches, "no batch held more than one stream"


# ---------------------------------------------------------------- the rest of the surface


def test_list_models(stub, tiny_model_dir) -> None:
    (info,) = stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT).models
    assert (info.name, info.version, info.state) == ("echoic-tiny", "1", pb.ModelInfo.LOADED)
    assert info.sample_rate_hertz == 16000 and info.streamable and info.vocabulary_size == 29
    assert info.chunk_seconds > 0 and info.frame_seconds > 0
    assert not info.has_language_model  # no lm.arpa in the directory
    assert info.path == ""  # the server's directories stay hidden unless --expose-paths


def test_a_request_can_pin_the_serving_version(stub, clips, expected) -> None:
    """`model` / `model_version` naming what is served; test_hot_reload_under_load pins a
    version beside a draining one."""
    config = Config(encoding=Config.WAV, model="echoic-tiny", model_version="1")
    response = recognize(stub, clips[0][0], config)
    assert (response.model.name, response.model.version) == ("echoic-tiny", "1")
    assert texts(response) == [expected[0]]
    responses = stream(stub, clips[0][0], config)
    assert {r.model.version for r in responses} == {"1"} and finals(responses) == [expected[0]]


def test_metrics_endpoint_serves_every_metric(server, stub) -> None:
    recognize(stub, TONE, linear16())
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for name in (
        'echoic_requests_total{code="OK",method="Recognize"}',
        "echoic_active_streams",
        "echoic_audio_seconds_total",
        "echoic_batch_size_bucket",
        "echoic_queue_wait_seconds_bucket",
        "echoic_compute_seconds_bucket",
        "echoic_final_result_latency_seconds_bucket",
        "echoic_real_time_factor_bucket",
        'echoic_model_versions_loaded{model="echoic-tiny",state="loaded",version="1"} 1.0',
    ):
        assert name in text, name


def test_health_and_reflection(server) -> None:
    with channel_to(server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "echoic.v1.Transcriber"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {"echoic.v1.Transcriber", "grpc.health.v1.Health"} <= names
        # Reflection v1 (asked first by grpcurl, grpc-js, Postman): the same messages under
        # the package grpc.reflection.v1, called by its own method path.
        v1 = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        asks = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="echoic.v1.Transcriber"),
        ]
        listed, described = v1(iter(asks), timeout=10)
        names_v1 = {s.name for s in listed.list_services_response.service}
        assert names_v1 == names and "grpc.reflection.v1.ServerReflection" in names_v1
        files = described.file_descriptor_response.file_descriptor_proto
        assert files and any(b"echoic.v1" in f for f in files)


def test_server_imports_no_torch() -> None:
    code = (
        "import sys, echoic.server.process.app, echoic.server.process.background; "
        "import echoic.cli.serve; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'onnx'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


# ---------------------------------------------------------------- limits


def _held_stream(stub, release: threading.Event, responses: list, errors: list) -> threading.Thread:
    """A stream that sends its config and some audio, then waits for `release`."""

    def run() -> None:
        messages = stream_messages(TONE * 2, linear16(), interim=True, pause=(OPEN, release))
        try:
            responses.extend(stub.StreamingRecognize(messages, timeout=RPC_TIMEOUT))
        except grpc.RpcError as e:
            errors.append(e.code())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_limits(tiny_model_dir) -> None:
    with running(
        tiny_model_dir, max_streams=2, max_audio_seconds=1.0, max_message_bytes=64 * 1024
    ) as server, channel_to(server) as channel:  # fmt: skip
        stub = pb_grpc.TranscriberStub(channel)
        service = server.server.service
        release, responses, errors = threading.Event(), [], []
        held = [_held_stream(stub, release, responses, errors) for _ in range(2)]
        wait_until(lambda: service.active == 2, what="two open streams")
        code, details = status_of(lambda: recognize(stub, TONE, linear16()))
        assert code == Code.RESOURCE_EXHAUSTED and "limit of 2" in details
        release.set()
        for t in held:
            t.join(RPC_TIMEOUT)
        assert errors == [] and len(finals(responses)) == 2
        assert recognize(stub, TONE, linear16()).results  # admitted again

        long = TONE * 3  # 1.5 s
        code, details = status_of(lambda: stream(stub, long, linear16()))
        assert code == Code.OUT_OF_RANGE and "1 s" in details
        code, details = status_of(lambda: recognize(stub, long, linear16()))
        assert code == Code.INVALID_ARGUMENT and "at most 1 s" in details
        code, _ = status_of(lambda: recognize(stub, bytes(100_000), linear16()))
        assert code == Code.RESOURCE_EXHAUSTED  # over max_message_bytes, refused by gRPC
        assert recognize(stub, TONE, linear16()).results


def test_idle_stream_gets_deadline_exceeded(tiny_model_dir) -> None:
    with running(tiny_model_dir, idle_timeout_seconds=0.3) as server, channel_to(server) as ch:
        stub = pb_grpc.TranscriberStub(ch)
        never = threading.Event()
        messages = stream_messages(TONE, linear16(), pause=(CHUNK, never))
        code, details = status_of(lambda: list(stub.StreamingRecognize(messages, timeout=10)))
        never.set()
        assert code == Code.DEADLINE_EXCEEDED and "0.3 s" in details
        assert recognize(stub, TONE, linear16()).results


def test_cancelled_client_frees_its_stream(server, stub) -> None:
    metrics, service = server.server.metrics, server.server.service
    model = server.server.registry.serving["echoic-tiny"]
    release = threading.Event()
    call = stub.StreamingRecognize(
        stream_messages(TONE * 2, linear16(), interim=True, pause=(OPEN, release)),
        timeout=RPC_TIMEOUT,
    )
    next(call)  # an interim result: the stream is open on the server
    assert service.active == 1 and model.active == 1
    gauge = metrics.registry.get_sample_value
    assert gauge("echoic_active_streams", {"method": "StreamingRecognize"}) == 1
    call.cancel()
    release.set()
    wait_until(lambda: service.active == 0 and model.active == 0, what="the stream to be freed")
    assert gauge("echoic_active_streams", {"method": "StreamingRecognize"}) == 0
    wait_until(
        lambda: gauge(
            "echoic_requests_total", {"method": "StreamingRecognize", "code": "CANCELLED"}
        ),
        what="the cancellation to be counted",
    )
    assert recognize(stub, TONE, linear16()).results


# ---------------------------------------------------------------- hot reload


def _versions(stub) -> list[tuple[str, int]]:
    models = stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT).models
    return [(m.version, m.state) for m in models]


def test_hot_reload_under_load(tiny_model_dir, tmp_path, clips, expected, caplog) -> None:
    caplog.set_level(logging.INFO, logger="echoic.server")
    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo / "tiny" / "1")
    (repo / "tiny" / ".9.partial").mkdir()  # an export in progress: ignored
    with running(model_repo=repo, poll_seconds=0.1) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        stop, failures, seen = threading.Event(), [], []

        def load() -> None:  # Recognize requests all through the reload
            while not stop.is_set():
                try:
                    response = recognize(stub, clips[3][0], Config())
                    seen.append((response.model.version, texts(response)))
                except grpc.RpcError as e:
                    failures.append((e.code(), e.details()))

        release = threading.Event()
        old: dict[int, list] = {i: [] for i in range(2)}
        started = [threading.Event() for _ in range(2)]

        def old_stream(i: int) -> None:
            wav = clips[i][0]
            messages = stream_messages(wav, Config(), interim=True, pause=(OPEN, release))
            try:
                for response in stub.StreamingRecognize(messages, timeout=RPC_TIMEOUT):
                    old[i].append(response)
                    started[i].set()
            except grpc.RpcError as e:
                failures.append((e.code(), e.details()))

        threads = [threading.Thread(target=load)]
        threads += [threading.Thread(target=old_stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        try:
            for event in started:
                assert event.wait(RPC_TIMEOUT), "a stream on version 1 never started"
            wait_until(lambda: any(v == "1" for v, _ in seen), what="a request served by version 1")

            # Version 2 appears atomically (as `echoic export` writes it) while they are open.
            shutil.copytree(tiny_model_dir, repo / "tiny" / ".2.tmp")
            (repo / "tiny" / ".2.tmp").rename(repo / "tiny" / "2")
            draining = [("1", pb.ModelInfo.DRAINING), ("2", pb.ModelInfo.LOADED)]
            wait_until(lambda: _versions(stub) == draining, what="version 2 beside draining 1")
            assert recognize(stub, clips[0][0], Config()).model.version == "2"
            assert stream(stub, clips[0][0], Config())[-1].model.version == "2"
            # A request can pin the serving version, but not the draining one.
            pinned = recognize(stub, clips[0][0], Config(model="tiny", model_version="2"))
            assert pinned.model.version == "2" and texts(pinned) == [expected[0]]
            code, details = status_of(lambda: recognize(stub, TONE, linear16(model_version="1")))
            assert code == Code.INVALID_ARGUMENT and "version '1' is draining" in details, details

            release.set()  # the old streams finish, on version 1
            for t in threads[1:]:
                t.join(RPC_TIMEOUT)
            for i in range(2):
                assert {r.model.version for r in old[i]} == {"1"}
                assert finals(old[i]) == [expected[i]]
            wait_until(lambda: _versions(stub) == [("2", pb.ModelInfo.LOADED)], what="1 to unload")
            code, details = status_of(lambda: recognize(stub, TONE, Config(model_version="1")))
            assert code == Code.INVALID_ARGUMENT and "not loaded" in details

            # A broken version 3 is tried, logged and skipped; version 2 keeps serving.
            (repo / "tiny" / "3").mkdir()
            (repo / "tiny" / "3" / "model.onnx").write_bytes(b"not a model")
            (repo / "tiny" / "3" / "stream.onnx").write_bytes(b"not a model")
            shutil.copy(tiny_model_dir / "export.json", repo / "tiny" / "3")  # complete, broken
            failed = "model tiny version 3 not loaded"
            wait_until(
                lambda: any(failed in r.getMessage() for r in caplog.records),
                what="the load of version 3 to fail",
            )  # fmt: skip
            (record,) = [r.getMessage() for r in caplog.records if failed in r.getMessage()]
            assert record.endswith("tiny 2 keeps serving"), record
            assert _versions(stub) == [("2", pb.ModelInfo.LOADED)]
            assert recognize(stub, clips[3][0], Config()).model.version == "2"
        finally:  # the load thread stops, and the streams end, even when a check fails
            stop.set()
            release.set()
            for t in threads:
                t.join(RPC_TIMEOUT)

    assert failures == []
    assert {v for v, _ in seen} == {"1", "2"} and seen[-1][0] == "2"
    assert all(t == [expected[3]] for _, t in seen)


# ---------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (PEM)."""
    pytest.importorskip("cryptography", reason="cryptography (the dev extra) makes test certs")
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    root = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def build(subject, issuer, key, signer, *extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    def save(stem: str, cert, key) -> None:
        (root / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build(
        name("echoic test CA"), name("echoic test CA"), ca_key, ca_key,
        (x509.BasicConstraints(ca=True, path_length=None), True),
    )  # fmt: skip
    save("ca", ca, ca_key)
    for stem, usage, san in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH,
         [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("echoic-client")]),
    ):  # fmt: skip
        key = ec.generate_private_key(ec.SECP256R1())
        cert = build(
            name(stem), ca.subject, key, ca_key,
            (x509.BasicConstraints(ca=False, path_length=None), True),
            (x509.ExtendedKeyUsage([usage]), False),
            (x509.SubjectAlternativeName(san), False),
        )  # fmt: skip
        save(stem, cert, key)
    return {p.name: p for p in root.iterdir()}


def _list_models_over_tls(port: int, certificates, *, client_cert: bool) -> None:
    read = lambda name: certificates[name].read_bytes()  # noqa: E731
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read("ca.pem"),
        private_key=read("client.key") if client_cert else None,
        certificate_chain=read("client.pem") if client_cert else None,
    )
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        assert stub.ListModels(pb.ListModelsRequest(), timeout=10).models


def test_tls_and_mutual_tls(tiny_model_dir, certificates) -> None:
    tls = dict(tls_cert=certificates["server.pem"], tls_key=certificates["server.key"])
    with running(tiny_model_dir, **tls) as server:
        _list_models_over_tls(server.port, certificates, client_cert=False)
        with grpc.insecure_channel(server.address) as plain:  # plaintext is refused
            code, _ = status_of(
                lambda: pb_grpc.TranscriberStub(plain).ListModels(pb.ListModelsRequest(), timeout=5)
            )
            assert code == Code.UNAVAILABLE
    with running(tiny_model_dir, tls_client_ca=certificates["ca.pem"], **tls) as server:
        _list_models_over_tls(server.port, certificates, client_cert=True)
        code, _ = status_of(
            lambda: _list_models_over_tls(server.port, certificates, client_cert=False)
        )
        assert code == Code.UNAVAILABLE


# ---------------------------------------------------------------- the process


def _refused(stub) -> bool:
    """A new call fails at once with UNAVAILABLE (the server is draining)."""
    try:
        stub.ListModels(pb.ListModelsRequest(), timeout=5)
    except grpc.RpcError as e:
        return e.code() == Code.UNAVAILABLE
    return False


@contextmanager
def serve_process(
    *flags: str, listening: str = r"listening on 127\.0\.0\.1:(\d+)"
) -> Iterator[tuple[subprocess.Popen, int, list[str]]]:
    """A real `echoic serve FLAGS --port 0` process: (process, its port, its log lines so
    far, which grow until the process ends and are complete on exit), once a log line
    matches `listening` (its group: the port); killed if alive. HTTP is off unless FLAGS
    give --http-port."""
    command = [sys.executable, "-m", "echoic.cli.main", "serve", *flags, "--port", "0",
               "--threads", "1"]  # fmt: skip
    if "--http-port" not in flags:
        command += ["--http-port", "0"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    log: list[str] = []
    drain = threading.Thread(target=lambda: log.extend(process.stderr))  # keep it flowing
    try:
        port = None
        for line in process.stderr:
            log.append(line)
            if match := re.search(listening, line):
                port = int(match.group(1))
                break
        assert port, f"the server never said where it listens: {log}"
        drain.start()
        yield process, port, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        if drain.is_alive() or drain.ident:
            drain.join(timeout=10)
        process.stderr.close()


def test_echoic_serve_drains_open_streams_on_sigterm(tiny_model_dir, clips, expected) -> None:
    """README: on SIGTERM health says NOT_SERVING at once (to a watcher, and to a new Check
    on a new connection: the port still answers), new calls get UNAVAILABLE, and open
    streams get --grace-seconds to finish."""
    flags = ["--model", str(tiny_model_dir), "--grace-seconds", "20"]
    with serve_process(*flags) as (process, port, log):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TranscriberStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="echoic.v1.Transcriber"), timeout=10
            )
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            release = threading.Event()
            call = stub.StreamingRecognize(
                stream_messages(pcm16(clips[0][1]), linear16(), interim=True,
                                pause=(OPEN, release)),
                timeout=RPC_TIMEOUT,
            )  # fmt: skip
            first = next(call)  # the stream is open
            process.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            wait_until(lambda: _refused(stub), what="new calls to be refused")
            code, _ = status_of(lambda: recognize(stub, TONE, linear16()))
            assert code == Code.UNAVAILABLE
            with grpc.insecure_channel(f"127.0.0.1:{port}") as fresh:
                assert _refused(pb_grpc.TranscriberStub(fresh))
                check = health_pb2.HealthCheckRequest(service="echoic.v1.Transcriber")
                status = health_pb2_grpc.HealthStub(fresh).Check(check, timeout=10).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert process.poll() is None, "the server exited with a stream open"
            release.set()
            assert finals([first, *call]) == [expected[0]]  # the open stream's final result
        assert process.wait(timeout=30) == 0
    assert any("SIGTERM: draining open streams for up to 20 s" in line for line in log), log


@pytest.mark.gpu
def test_cuda_serving_equals_cpu(tiny_model_dir: Path, clips, expected) -> None:
    """`--device cuda`: the CUDA provider with the streaming states kept on the GPU
    (I/O binding) gives the CPU's transcripts, streamed several at once and whole."""
    import concurrent.futures

    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("no CUDA GPU (or no onnxruntime-gpu: pip install 'echoic[gpu]')")
    with running(tiny_model_dir, device="cuda") as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        config = Config(encoding=Config.WAV)
        with concurrent.futures.ThreadPoolExecutor(len(clips)) as pool:
            got = list(pool.map(lambda c: finals(stream(stub, c[0], config)), clips))
        assert got == [[want] for want in expected]
        assert texts(recognize(stub, clips[0][0], config)) == [expected[0]]
