"""The HTTP door, the realtime WebSocket and the compressed-audio decoders behind them,
against a real server, as a hostile client would use them: one bad request never holds
up anyone else's, and what a request takes (threads, descriptors, memory, slots) is given
back when it ends. The bundled model (real words) on the corpus's speech."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
pytest.importorskip("aiohttp", reason="the HTTP door needs the serve extra (aiohttp)")

import soundfile as sf  # noqa: E402

from echoic.model.core.audio import decode_audio  # noqa: E402
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from echoic.server.background import BackgroundServer  # noqa: E402
from tests.test_http import http_server, multipart, post  # noqa: E402
from tests.test_server import wait_until  # noqa: E402

# s a call may take before the test calls it hung: far above what any of them needs on a
# loaded 2-core machine, far below the 120 s a decoder thread used to stay blocked
HUNG = 20.0
RATE = 16000


def _encoded(samples: np.ndarray, fmt: str, subtype: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, RATE, format=fmt, subtype=subtype)
    return buf.getvalue()


def _transcribe(server: BackgroundServer, audio: bytes) -> tuple[int, dict]:
    body, content_type = multipart([("model", "whisper-1")], [("file", audio)])
    return post(server, body, content_type)


def _grpc_recognize(server: BackgroundServer, audio: bytes) -> str:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        request = pb.RecognizeRequest(config=pb.RecognitionConfig(), audio_content=audio)
        response = stub.Recognize(request, timeout=HUNG)
    return " ".join(r.alternatives[0].transcript for r in response.results)


def _decoder_threads() -> list[str]:
    """Threads of the in-process server that decode audio or feed a decoder."""
    return [t.name for t in threading.enumerate() if t.name.startswith("echoic-")
            and t.name.split("-")[1] in ("pipe", "flac", "ogg")]  # fmt: skip


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def speech(speech_corpus: Path) -> np.ndarray:
    """One corpus utterance, 16 kHz samples."""
    row = json.loads(speech_corpus.read_text().splitlines()[0])
    return decode_audio((speech_corpus.parent / row["audio_filepath"]).read_bytes(), RATE)


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    # streams idle longer than a call may take before the tests call it hung
    with http_server(max_streams=64, idle_timeout_seconds=3 * HUNG) as s:
        yield s


def test_a_truncated_ogg_upload_holds_up_no_other_request(server, speech) -> None:
    """The first 100 bytes of an Ogg/Opus file are refused at once, and every decode after
    it (FLAC, Ogg, MP3 and WAV over HTTP, a gRPC Recognize) is answered as before, instead
    of waiting behind a decoder blocked on a pipe nobody closes; 40 more such uploads leave
    no thread or descriptor behind."""
    files = {
        "wav": _encoded(speech, "WAV", "PCM_16"),
        "flac": _encoded(speech, "FLAC", "PCM_16"),
        "ogg": _encoded(speech, "OGG", "OPUS"),
        "mp3": _encoded(speech, "MP3", "MPEG_LAYER_III"),
    }
    before = {}
    for fmt, data in files.items():
        status, body = _transcribe(server, data)
        assert status == 200, body
        before[fmt] = body["text"]
    assert before["flac"] == before["wav"] and before["wav"]
    grpc_before = _grpc_recognize(server, files["wav"])
    threads, fds = len(_decoder_threads()), _open_fds()

    status, body = _transcribe(server, files["ogg"][:100])
    assert status == 400 and "truncated" in body["error"]["message"], body
    done: dict[str, str] = {}

    def transcribe_all() -> None:
        for fmt, data in files.items():
            status, body = _transcribe(server, data)
            assert status == 200, (fmt, body)
            done[fmt] = body["text"]
        done["grpc"] = _grpc_recognize(server, files["wav"])

    worker = threading.Thread(target=transcribe_all)
    worker.start()
    worker.join(HUNG)
    assert not worker.is_alive(), f"hung after a truncated Ogg upload; answered: {sorted(done)}"
    assert done == {**before, "grpc": grpc_before}

    for _ in range(40):
        assert _transcribe(server, files["ogg"][:100])[0] == 400
    wait_until(lambda: len(_decoder_threads()) <= threads, HUNG, "the decoder threads to end")
    wait_until(lambda: _open_fds() <= fds + 2, HUNG, "the pipes' descriptors to close")


def _sox_flac(wav: bytes, tmp_path: Path) -> bytes:
    if shutil.which("sox") is None:
        pytest.skip("sox is not installed (apt-get install sox)")
    (tmp_path / "in.wav").write_bytes(wav)
    subprocess.run(["sox", tmp_path / "in.wav", tmp_path / "out.flac"], check=True, timeout=60)
    return (tmp_path / "out.flac").read_bytes()


def _ffmpeg_flac(wav: bytes, tmp_path: Path) -> bytes:
    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg is not installed (apt-get install ffmpeg)")
    (tmp_path / "in.wav").write_bytes(wav)
    subprocess.run(
        ["ffmpeg", "-loglevel", "error", "-i", tmp_path / "in.wav", tmp_path / "out.flac"],
        check=True, timeout=60,
    )  # fmt: skip
    return (tmp_path / "out.flac").read_bytes()


def _libsndfile_flac(wav: bytes, tmp_path: Path) -> bytes:
    samples, rate = sf.read(io.BytesIO(wav), dtype="int16")
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


@pytest.mark.parametrize("writer", [
    pytest.param(_sox_flac, id="sox"),
    pytest.param(_ffmpeg_flac, id="ffmpeg"),
    pytest.param(_libsndfile_flac, id="libsndfile"),
])  # fmt: skip
def test_flac_from_every_common_writer_is_read_on_every_whole_file_path(
    server, speech, writer, tmp_path
) -> None:
    """sox and ffmpeg write a SEEKTABLE block, which the whole-file paths once refused
    ("Internal psf_fseek() failed"): HTTP, gRPC Recognize and Riva's offline recognize all
    give the WAV's transcript."""
    wav = _encoded(speech, "WAV", "PCM_16")
    flac = writer(wav, tmp_path)
    want = _grpc_recognize(server, wav)
    assert want
    status, body = _transcribe(server, flac)
    assert status == 200 and body["text"] == want, body
    assert _grpc_recognize(server, flac) == want
    riva = pytest.importorskip("riva.client", reason="the Riva door needs the riva extra")
    auth = riva.Auth(uri=server.address)
    asr = riva.ASRService(auth)
    config = riva.RecognitionConfig(language_code="en-US", max_alternatives=1)
    response = asr.offline_recognize(flac, config)
    assert " ".join(r.alternatives[0].transcript for r in response.results) == want


def test_a_stream_stalled_inside_its_header_holds_up_no_other_decode(server, speech) -> None:
    """A StreamingRecognize that sends the first 100 bytes of an Ogg file and then nothing
    keeps its decoder waiting for the header's rest; meanwhile FLAC, Ogg and MP3 uploads
    are decoded as before (libsndfile's opens do not wait behind the stalled one)."""
    ogg = _encoded(speech, "OGG", "OPUS")
    formats = (("FLAC", "PCM_16"), ("OGG", "OPUS"), ("MP3", "MPEG_LAYER_III"))
    others = {fmt: _encoded(speech, fmt, subtype) for fmt, subtype in formats}
    release = threading.Event()

    def stalled() -> Iterator[pb.StreamingRecognizeRequest]:
        config = pb.RecognitionConfig(encoding=pb.RecognitionConfig.OGG_OPUS)
        yield pb.StreamingRecognizeRequest(
            streaming_config=pb.StreamingRecognitionConfig(config=config)
        )
        yield pb.StreamingRecognizeRequest(audio_content=ogg[:100])
        release.wait(HUNG)

    with grpc.insecure_channel(server.address) as channel:
        call = pb_grpc.TranscriberStub(channel).StreamingRecognize(stalled(), timeout=2 * HUNG)
        wait_until(lambda: any(n.startswith("echoic-ogg") for n in _decoder_threads()), HUNG,
                   "the stalled stream's decoder")  # fmt: skip
        done: dict[str, int] = {}

        def transcribe_all() -> None:
            for fmt, data in others.items():
                done[fmt] = _transcribe(server, data)[0]

        worker = threading.Thread(target=transcribe_all)
        worker.start()
        worker.join(HUNG)
        release.set()
        call.cancel()
    assert not worker.is_alive(), f"decodes waited behind a stalled stream; answered: {done}"
    assert done == {"FLAC": 200, "OGG": 200, "MP3": 200}


def test_a_decode_past_its_time_limit_is_refused_and_frees_its_thread(speech) -> None:
    """--decode-timeout-seconds bounds each whole-file decode: past it the request gets
    408 (DEADLINE_EXCEEDED) naming the flag; audio that needs no container decode (WAV)
    is answered as before."""
    ogg = _encoded(speech, "OGG", "OPUS")
    with http_server(decode_timeout_seconds=1e-6, decode_threads=1) as server:
        for _ in range(3):  # one decode thread: each refused decode gave it back
            status, body = _transcribe(server, ogg)
            assert status == 408 and "--decode-timeout-seconds" in body["error"]["message"]
        status, body = _transcribe(server, _encoded(speech, "WAV", "PCM_16"))
        assert status == 200 and body["text"], body
