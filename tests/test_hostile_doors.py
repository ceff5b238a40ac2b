"""The HTTP door, the realtime WebSocket and the compressed-audio decoders behind them,
against a real server, as a hostile client would use them: one bad request never holds
up anyone else's, and what a request takes (threads, descriptors, memory, slots) is given
back when it ends. The bundled model (real words) on the corpus's speech."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
pytest.importorskip("aiohttp", reason="the HTTP door needs the serve extra (aiohttp)")

import aiohttp  # noqa: E402
import soundfile as sf  # noqa: E402
from aiohttp import WSMsgType  # noqa: E402

from echoic.model.core.audio import decode_audio  # noqa: E402
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from echoic.server.process.background import BackgroundServer  # noqa: E402
from tests.test_http import TIMEOUT, http_server, multipart, post  # noqa: E402
from tests.test_server import wait_until  # noqa: E402

# s a call may take before the test calls it hung: far above what any of them needs on a
# loaded 2-core machine, far below the 120 s a decoder thread used to stay blocked
HUNG = 20.0
RATE = 16000


def _encoded(samples: np.ndarray, fmt: str, subtype: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, RATE, format=fmt, subtype=subtype)
    return buf.getvalue()


def _transcribe(
    server: BackgroundServer, audio: bytes, timeout: float = TIMEOUT
) -> tuple[int, dict]:
    """An upload, its transcript the words as spoken (formatting=false), as gRPC gives them."""
    body, content_type = multipart(
        [("model", "whisper-1"), ("formatting", "false")], [("file", audio)]
    )
    return post(server, body, content_type, timeout)


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
    config = riva.RecognitionConfig(language_code="en-US", max_alternatives=1,
                                    verbatim_transcripts=True)  # fmt: skip
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


# ---------------------------------------------------------------- the realtime socket


def _realtime(server: BackgroundServer, talk) -> list:  # noqa: ANN001 - an async function
    """Run `talk(ws)` on a new realtime socket (after its conversation.created); its result."""
    url = server.http_url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"

    async def run() -> list:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(url, protocols=("realtime",), max_msg_size=0) as ws:
                first = await ws.receive_json(timeout=HUNG)
                assert first["type"] == "conversation.created"
                return await talk(ws)

    return asyncio.run(run())


PCM16 = {"input_audio_format": "pcm16",
         "input_audio_params": {"sample_rate_hz": RATE, "num_channels": 1}}  # fmt: skip


def _append(pcm: bytes) -> str:
    audio = base64.b64encode(pcm).decode()
    return json.dumps({"type": "input_audio_buffer.append", "audio": audio})


async def _until_closed(ws) -> list[dict]:  # noqa: ANN001 - aiohttp's socket
    """Every event until the server closes the socket (the test fails if it does not)."""
    events = []
    stop = asyncio.get_running_loop().time() + HUNG
    while True:
        left = stop - asyncio.get_running_loop().time()
        assert left > 0, f"the socket was not closed; the last events: {events[-3:]}"
        message = await ws.receive(timeout=left)
        if message.type != WSMsgType.TEXT:
            assert message.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING)
            return events
        events.append(json.loads(message.data))


def test_a_session_update_takes_only_the_settings_it_knows_within_a_size(server) -> None:
    """Unknown keys in an update are neither stored nor echoed; a control message over
    64 KiB, JSON nested 2,000 deep and a stop_history of 1e30 each get an error event a
    client can act on (not "internal"), and the socket goes on to transcribe."""
    junk = {f"junk_{i}": i for i in range(1000)}  # under 64 KiB in all
    update = {"type": "transcription_session.update", "session": {
        **PCM16, **junk, "input_audio_params": {**PCM16["input_audio_params"], **junk},
    }}  # fmt: skip
    huge = {"type": "transcription_session.update",
            "session": {**PCM16, "x": "y" * 100_000}}  # fmt: skip
    deep = "[" * 2000 + "]" * 2000
    absurd = {"type": "transcription_session.update",
              "session": {**PCM16, "endpointing_config": {"stop_history": 1e30}}}  # fmt: skip

    async def talk(ws) -> list:  # noqa: ANN001
        await ws.send_json(update)
        updated = await ws.receive_json(timeout=HUNG)
        codes = []
        for message in (json.dumps(huge), deep, json.dumps(absurd)):
            await ws.send_str(message)
            event = await ws.receive_json(timeout=HUNG)
            assert event["type"] == "error", event
            codes.append(event["error"]["code"])
        await ws.send_json(update)
        return [updated, codes, await ws.receive_json(timeout=HUNG)]

    updated, codes, again = _realtime(server, talk)
    assert updated["type"] == again["type"] == "transcription_session.updated"
    assert "junk_1" not in json.dumps(updated) and len(json.dumps(updated)) < 2000
    assert codes == ["message_too_large", "invalid_json", "invalid_value"]


@pytest.fixture(scope="module")
def limited() -> Iterator[BackgroundServer]:
    """A server whose streams may hold 1 s of audio and stay open 3 s."""
    with http_server(max_audio_seconds=1.0, max_stream_seconds=3.0) as s:
        yield s


def test_a_fatal_stream_error_closes_the_socket_after_its_event(limited, speech) -> None:
    """Past the audio limit the socket gets one error event and is closed, as
    StreamingRecognize ends there: not one error event per later append."""
    pcm = np.round(np.clip(speech, -1, 1) * 32767).astype("<i2").tobytes()
    assert len(pcm) > 2 * RATE  # over 1 s

    async def talk(ws) -> list:  # noqa: ANN001
        await ws.send_json({"type": "transcription_session.update", "session": PCM16})
        assert (await ws.receive_json(timeout=HUNG))["type"] == "transcription_session.updated"
        try:
            for i in range(0, len(pcm), 3200):
                await ws.send_str(_append(pcm[i : i + 3200]))
        except ConnectionError:
            pass  # closed by the server while the rest was sent
        return await _until_closed(ws)

    events = _realtime(limited, talk)
    errors = [e for e in events if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["out_of_range"], errors


def test_a_realtime_socket_is_closed_at_the_max_stream_time(limited) -> None:
    """A socket that only commits, often enough never to be idle, is closed at
    --max-stream-seconds with an error event saying so."""

    async def talk(ws) -> list:  # noqa: ANN001
        await ws.send_json({"type": "transcription_session.update", "session": PCM16})
        assert (await ws.receive_json(timeout=HUNG))["type"] == "transcription_session.updated"

        async def commit_forever() -> None:
            while True:
                await ws.send_json({"type": "input_audio_buffer.commit"})
                await asyncio.sleep(0.5)

        committing = asyncio.ensure_future(commit_forever())
        try:
            return await _until_closed(ws)
        finally:
            committing.cancel()

    events = _realtime(limited, talk)
    assert events[-1]["type"] == "error", events[-1]
    assert events[-1]["error"]["code"] == "max_stream_seconds"


# ---------------------------------------------------------------- what the log shows


def test_audio_over_the_limit_is_refused_in_each_doors_words(limited, speech) -> None:
    """A file over --max-audio-seconds is refused at both doors, each telling its own
    client what it can do: gRPC Recognize names StreamingRecognize; an HTTP upload is told
    to split the file and post the parts, never to use an rpc it cannot call."""
    wav = _encoded(speech, "WAV", "PCM_16")
    assert len(speech) > RATE  # over 1 s
    status, body = _transcribe(limited, wav)
    message = body["error"]["message"]
    assert status == 400 and "at most 1 s" in message, body
    assert "/v1/audio/transcriptions" in message and "Recognize" not in message, message
    with pytest.raises(grpc.RpcError) as e:
        _grpc_recognize(limited, wav)
    details = e.value.details()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1 s" in details
    assert "StreamingRecognize" in details and "/v1/" not in details, details


def test_requests_aiohttp_cannot_parse_are_one_warning_line(caplog) -> None:
    """20 requests with a header line over aiohttp's 8,190 bytes: each gets 400, and the
    log gets one rate-limited warning, no ERROR and no traceback (a server of its own, so
    that no other test's warning shares the rate limit)."""
    import logging
    import socket

    caplog.set_level(logging.INFO)
    with http_server() as server:
        for _ in range(20):
            address = ("127.0.0.1", server.server.http_port)
            with socket.create_connection(address, timeout=HUNG) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n")
                answer = s.recv(100)
            assert answer.split(b" ")[1] == b"400", answer
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]
    warnings = [r for r in caplog.records if "HTTP 400 from" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_a_stream_true_client_that_leaves_is_counted_499_without_errors(
    server, speech, caplog
) -> None:
    """A stream=true client that closes its connection after the first events: counted
    as 499 (the client went away), not 500, with no ERROR line or traceback."""
    import logging
    import socket

    from tests.test_http import metric

    caplog.set_level(logging.INFO)
    long = np.tile(speech, 8)  # events keep coming for a while
    body, content_type = multipart(
        [("model", "whisper-1"), ("stream", "true")], [("file", _encoded(long, "WAV", "PCM_16"))]
    )
    route = "/v1/audio/transcriptions"
    before = metric(server, "echoic_http_requests_total", route=route, status="499")
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=HUNG) as s:
        head = f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
        s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    wait_until(
        lambda: metric(server, "echoic_http_requests_total", route=route, status="499") > before,
        HUNG, "the request to be counted 499",
    )  # fmt: skip
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


# ---------------------------------------------------------------- fuzzing both doors


@pytest.mark.slow
def test_fuzzed_uploads_and_realtime_audio_get_clean_errors_and_the_server_goes_on(
    server, speech
) -> None:
    """Randomly edited WAV, FLAC, Ogg and MP3 files (fixed seed, at most 60 s), uploaded
    over HTTP and sent as a realtime socket's `none` audio: every answer is a 200 or a 4xx,
    every error event one a client can act on (never "internal"), and afterwards the server
    gives the same transcript as before, without hanging."""
    import time

    from tests.test_hardening import _mutate

    rng = np.random.default_rng(2026)
    clip = speech[: 2 * RATE]
    formats = (("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("OGG", "OPUS"), ("MP3", "MPEG_LAYER_III"))
    files = [_encoded(clip, fmt, subtype) for fmt, subtype in formats]
    status, body = _transcribe(server, files[0])
    assert status == 200
    before = body["text"]
    statuses: dict[int, int] = {}
    codes: dict[str, int] = {}
    stop = time.monotonic() + 60

    async def realtime_audio(ws, data: bytes) -> list:  # noqa: ANN001
        session = {"input_audio_format": "none"}
        await ws.send_json({"type": "transcription_session.update", "session": session})
        assert (await ws.receive_json(timeout=HUNG))["type"] == "transcription_session.updated"
        try:
            for i in range(0, len(data), 2048):
                await ws.send_str(_append(data[i : i + 2048]))
            await ws.send_json({"type": "input_audio_buffer.done"})
        except ConnectionError:
            pass  # closed after a fatal error
        events = []
        while not events or not events[-1].get("is_last_result"):
            message = await ws.receive(timeout=HUNG)
            if message.type != WSMsgType.TEXT:
                break
            events.append(json.loads(message.data))  # a fatal error event: the close next
        return events

    for i in range(200):
        if time.monotonic() > stop:
            break
        data = files[i % len(files)]
        for _ in range(int(rng.integers(1, 4))):
            data = _mutate(data, rng)
        if i % 4:
            status, _ = _transcribe(server, data)
            assert status == 200 or 400 <= status < 500, (i, status)
            statuses[status] = statuses.get(status, 0) + 1
        else:
            for event in _realtime(server, lambda ws, data=data: realtime_audio(ws, data)):
                if event["type"] == "error":
                    code = event["error"]["code"]
                    assert code not in ("internal", "unknown"), (i, event)
                    codes[code] = codes.get(code, 0) + 1
    assert sum(statuses.values()) >= 50 and any(s >= 400 for s in statuses), statuses
    assert codes, codes
    status, body = _transcribe(server, files[0])
    assert status == 200 and body["text"] == before


def test_idle_and_slow_header_connections_are_closed_after_the_idle_timeout() -> None:
    """Connections that send nothing, stop inside their headers, or stay open after an
    answer are closed by the server after --idle-timeout-seconds, not held for an hour."""
    import socket

    with http_server(idle_timeout_seconds=1.0) as server:
        address = ("127.0.0.1", server.server.http_port)
        socks = [socket.create_connection(address, timeout=HUNG) for _ in range(3)]
        try:
            socks[1].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks[2].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert socks[2].recv(100).split(b" ")[1] == b"200"
            for s in socks:
                while s.recv(65536):  # the rest of an answer, then the server's close
                    pass
        finally:
            for s in socks:
                s.close()


def _closed_by_the_server(sock) -> bool:  # noqa: ANN001 - a socket
    """Whether the server has closed `sock` (its end reads EOF), without waiting."""
    import select

    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_idle_connections_to_the_metrics_port_take_no_threads_and_are_bounded() -> None:
    """Hundreds of connections to --metrics-port that send nothing (or stop inside their
    headers) start no thread each, are cut to MAX_CONNECTIONS at once (the oldest idle
    closed), and leave a scrape answered; the rest close after --idle-timeout-seconds."""
    import socket
    import urllib.request

    from echoic.server.metrics import MAX_CONNECTIONS

    many = MAX_CONNECTIONS + 200
    with http_server(metrics_port=0, idle_timeout_seconds=2.0) as server:
        address = ("127.0.0.1", server.server.metrics_port)
        url = f"http://127.0.0.1:{address[1]}/metrics"

        def scrape() -> None:
            with urllib.request.urlopen(url, timeout=HUNG) as response:
                assert b"echoic_active_streams" in response.read()

        # Counted once the server is settled: a scrape answered, and no thread started or
        # ended for half a second (a server still starting, on a busy machine, starts some).
        scrape()
        settled: list[set[int]] = []

        def settled_for_half_a_second() -> bool:  # wait_until asks every 20 ms
            settled.append({t.ident for t in threading.enumerate()})
            return len(settled) > 25 and all(x == settled[-1] for x in settled[-26:])

        wait_until(settled_for_half_a_second, HUNG, "the server's threads to settle")
        before = settled[-1]
        socks = [socket.create_connection(address, timeout=HUNG) for _ in range(many)]
        try:
            for s in socks[::2]:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            scrape()
            new = [t.name for t in threading.enumerate() if t.ident not in before]
            assert len(new) <= 1, new  # a scrape's thread at most
            closed = [s for s in socks if _closed_by_the_server(s)]
            assert len(closed) >= many - MAX_CONNECTIONS, len(closed)
            assert socks[-1] not in closed  # the newest stay, the oldest made room
            wait_until(lambda: all(_closed_by_the_server(s) or s in closed for s in socks), HUNG)
        finally:
            for s in socks:
                s.close()


def test_past_max_http_connections_the_oldest_idle_one_is_closed_never_a_busy_one(
    speech,
) -> None:
    """Past --max-http-connections the HTTP port closes its oldest connection with no
    request in progress (idle, or still sending its headers) at once, not after the idle
    timeout: idle sockets cannot use up the process's descriptors (1,100 of them once made
    the gRPC port unreachable too). A realtime socket, older than all of them, is busy for
    its whole life and stays; the newest stay; uploads are still answered."""
    import socket

    limit, many = 8, 24
    with http_server(max_http_connections=limit, idle_timeout_seconds=3 * HUNG) as server:
        address = ("127.0.0.1", server.server.http_port)

        async def talk(ws) -> list:  # noqa: ANN001 - aiohttp's socket
            socks = [socket.create_connection(address, timeout=HUNG) for _ in range(many)]
            try:
                for s in socks[::2]:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                closed: set[int] = set()

                def cut() -> bool:
                    closed.update(i for i, s in enumerate(socks) if _closed_by_the_server(s))
                    return len(closed) >= many + 1 - limit

                wait_until(cut, HUNG)
                time.sleep(0.2)  # room for a wrong close to show
                assert not cut() or len(closed) == many + 1 - limit, sorted(closed)
                assert closed == set(range(len(closed))), sorted(closed)  # the oldest
                await ws.send_json({"type": "transcription_session.update", "session": PCM16})
                updated = await ws.receive_json(timeout=HUNG)
                status, body = _transcribe(server, _encoded(speech, "WAV", "PCM_16"))
                return [updated["type"], status, bool(body.get("text"))]
            finally:
                for s in socks:
                    s.close()

        assert _realtime(server, talk) == ["transcription_session.updated", 200, True]


def test_a_response_still_being_written_when_its_connection_is_capped_arrives_whole() -> None:
    """A connection whose handler has returned while its response is still being written
    (a body larger than the sockets' buffers, to a client that reads slowly) counts as
    idle to the cap and may be the one it closes: the body is in the connection's buffer
    by then, and a close flushes that buffer first, so the client still gets all of it."""
    import asyncio
    import socket

    from aiohttp import web

    from echoic.server.connections import capped_server

    body = b"x" * (32 << 20)

    async def handler(request: web.BaseRequest) -> web.Response:
        return web.Response(body=body)

    def client(port: int) -> tuple[list[bool], bytes]:
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", port))
        slow.settimeout(HUNG)
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: slow.recv(1, socket.MSG_PEEK), HUNG)  # its response has begun
        idle = [socket.create_connection(("127.0.0.1", port), timeout=HUNG) for _ in range(3)]
        try:
            time.sleep(0.3)  # room for a wrong close to show
            closed = [_closed_by_the_server(s) for s in idle]
            received = bytearray()
            while chunk := slow.recv(1 << 20):
                received += chunk
            return closed, bytes(received)
        finally:
            for s in [slow, *idle]:
                s.close()

    async def main() -> tuple[list[bool], bytes]:
        runner = web.ServerRunner(capped_server(handler, limit=3))
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            return await asyncio.to_thread(client, runner.addresses[0][1])
        finally:
            await runner.cleanup()

    closed, received = asyncio.run(main())
    assert closed == [False, False, False]  # the cap closed the slow one, the oldest idle
    head, _, got = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and got == body


PREAMBLE_BYTES = 20 * 10**6  # junk before a form's first part, or inside its part's header
JUNK_LINE = b"x" * 62 + b"\r\n"


def _form(wav: bytes, preamble: bytes = b"", part_header: bytes = b"") -> bytes:
    return (
        preamble + b'--bnd\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        + part_header + b"\r\n" + wav + b'\r\n--bnd\r\nContent-Disposition: form-data; '
        b'name="formatting"\r\n\r\nfalse\r\n--bnd--\r\n'
    )  # fmt: skip


def _chunked(body: bytes, size: int = 1 << 20) -> bytes:
    """`body` in HTTP/1.1 chunked transfer coding (no Content-Length to refuse it by)."""
    pieces = (body[i : i + size] for i in range(0, len(body), size))
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in pieces) + b"0\r\n\r\n"


@pytest.mark.parametrize("junk, chunked, status", [
    pytest.param(dict(preamble=JUNK_LINE * (PREAMBLE_BYTES // len(JUNK_LINE))), False, 200,
                 id="preamble-of-lines"),
    pytest.param(dict(preamble=b"x" * PREAMBLE_BYTES + b"\r\n"), False, 400,
                 id="preamble-of-one-line"),
    pytest.param(dict(part_header=b"X-A: b\r\n" * (PREAMBLE_BYTES // 8)), False, 400,
                 id="part-header-of-many-lines"),
    pytest.param(dict(preamble=JUNK_LINE * (3 * PREAMBLE_BYTES // 2 // len(JUNK_LINE))), True,
                 413, id="chunked-preamble-over-the-upload-limit"),
])  # fmt: skip
def test_a_20_mb_multipart_preamble_still_arriving_is_read_or_refused(
    speech, junk, chunked, status
) -> None:
    """Megabytes before the first part, or in a part's header, arriving over longer than
    --idle-timeout-seconds: not 408 (bytes are arriving); lines of preamble are skipped and
    the file transcribed, one endless line or a header of a million lines is 400, and with
    no Content-Length the body's every byte counts against --max-upload-mb (413)."""
    import socket

    from tests.test_http import _response

    wav = _encoded(speech, "WAV", "PCM_16")
    body = _form(wav, **junk)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    with http_server(max_upload_mb=25.0, idle_timeout_seconds=1.0) as server:
        _, plain = _transcribe(server, wav)
        with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=HUNG) as s:
            s.sendall(
                b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"multipart/form-data; boundary=bnd\r\n%s\r\n\r\n" % framing.encode()
            )
            data = _chunked(body) if chunked else body
            piece = len(data) // 20 + 1
            try:
                for i in range(0, len(data), piece):  # over 1.6 s: longer than the idle timeout
                    s.sendall(data[i : i + piece])
                    time.sleep(0.08)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered and closed while bytes still came
            answer, error = _response(s)
        assert answer == status, error
        if status == 200:
            assert error["text"] == plain["text"] and plain["text"]
        _, again = _transcribe(server, wav)
        assert again == plain


def _damaged_mp3(speech: np.ndarray) -> bytes:
    """Speech as MP3 with 700 zero bytes inserted 50 times: libmpg123 resyncs and goes on."""
    mp3 = _encoded(speech, "MP3", "MPEG_LAYER_III")
    step = len(mp3) // 51
    return (
        b"".join(mp3[i * step : (i + 1) * step] + b"\0" * 700 for i in range(50)) + mp3[50 * step :]
    )


MPG123_LINES = ("Illegal Audio-MPEG-Header", "Trying to resync", "src/libmpg123")


def test_a_damaged_mp3_leaves_no_library_notes_on_stderr(speech, tmp_path) -> None:
    """libmpg123's notes on a damaged MP3 (hundreds of lines for one upload) reach neither
    a real `echoic serve`'s log, decoding uploads, nor `echoic transcribe`'s terminal."""
    import http.client
    import signal
    import socket
    import sys

    from echoic.model.core.native import MPG123_CHATTER
    from tests.test_http import _free_port

    damaged = tmp_path / "damaged.mp3"
    damaged.write_bytes(_damaged_mp3(speech))
    echoic = [sys.executable, "-m", "echoic.cli.main"]
    model = str(Path(__file__).parents[1] / "model" / "default")
    run = subprocess.run([*echoic, "transcribe", str(damaged), "--model", model,
                          "--decoder", "greedy", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    port = _free_port()
    server = subprocess.Popen(
        [*echoic, "serve", "--model", model, "--port", "0", "--http-port", str(port),
         "--threads", "1", "--decoder", "greedy"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in server.stderr:
            if "listening on" in line:
                break
        with socket.create_connection(("127.0.0.1", port), timeout=HUNG):
            pass
        for _ in range(2):
            body, content_type = multipart(
                [("model", "whisper-1")], [("file", damaged.read_bytes())]
            )
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HUNG)
            conn.request("POST", "/v1/audio/transcriptions", body, {"Content-Type": content_type})
            assert conn.getresponse().status == 200
            conn.close()
    finally:
        server.send_signal(signal.SIGTERM)
        log = server.communicate(timeout=HUNG)[1]
    for stderr in (run.stderr, log):
        assert not [line for line in stderr.splitlines() if any(m in line for m in MPG123_LINES)]
    assert "stopped" in log  # the log itself still arrives
    assert MPG123_CHATTER.fullmatch("Note: Illegal Audio-MPEG-Header 0x00000000 at offset 3276.")


def test_only_mpg123_notes_are_dropped_from_c_stderr(speech, tmp_path) -> None:
    """With the filter on, C's stdio stderr still passes a library's real message, and
    Python's own stderr is untouched; the damaged MP3's notes are gone."""
    import sys

    damaged = tmp_path / "damaged.mp3"
    damaged.write_bytes(_damaged_mp3(speech))
    script = f"""
import ctypes, sys
from echoic.model.core.audio import decode_audio
from echoic.model.core.native import drop_stdio_chatter
assert drop_stdio_chatter()
decode_audio(open({str(damaged)!r}, "rb").read(), 16000)
libc = ctypes.CDLL(None)
libc.fputs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
libc.fputs(b"a real message from C\\n", ctypes.c_void_p.in_dll(libc, "stderr").value)
sys.stderr.write("from Python\\n")  # one write, as a log line is (print makes two)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=HUNG)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert sorted(run.stderr.splitlines()) == ["a real message from C", "from Python"], run.stderr


def test_c_stderr_held_past_exit_neither_aborts_nor_loses_a_last_line() -> None:
    """A native library that kept C's `stderr` (the relay's pipe) and writes to it while
    the process ends, after the relay's own exit handler: the process still exits 0 (a
    FILE closed at exit made glibc abort it: "invalid stdio handle", seen at the end of a
    beam-search `echoic transcribe`), and a last line with no end, written before the
    handler, still reaches fd 2."""
    import sys

    script = """
import atexit, ctypes
libc = ctypes.CDLL(None)
libc.fputs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
libc.fflush.argtypes = [ctypes.c_void_p]
held = []
def late():  # registered first, so it runs after the relay's handler
    libc.fputs(b"Note: after the end\\n", held[0])
    libc.fflush(held[0])
atexit.register(late)
from echoic.model.core.native import drop_stdio_chatter
assert drop_stdio_chatter()
held.append(ctypes.c_void_p.in_dll(libc, "stderr").value)
libc.fputs(b"a real message\\n", held[0])
libc.fputs(b"a last line with no end", held[0])
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=HUNG)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == ["a real message", "a last line with no end"], run.stderr


def test_a_long_whole_file_is_featurized_a_window_at_a_time(speech, monkeypatch) -> None:
    """A 100 s upload's features (and their STFT, 16 bytes a bin) are computed at most
    WHOLE_WINDOW_SECONDS at a time, not for the whole file at once (a 12.6-minute WAV
    took the server to 1 GB): the real batch_features, its calls recorded."""
    from echoic.model.runtime import recognizer
    from echoic.server.doors.service import WHOLE_WINDOW_SECONDS

    sizes: list[int] = []
    real = recognizer.batch_features

    def recorded(streams):  # noqa: ANN001, ANN202 - batch_features' own signature
        feats = real(streams)
        sizes.extend(len(f) for f in feats)
        return feats

    monkeypatch.setattr(recognizer, "batch_features", recorded)
    gap = np.zeros(RATE // 2, np.float32)
    long = np.resize(np.concatenate([speech, gap]), 100 * RATE)
    # This process's calls: an engine process gets the same windows, one step each.
    with http_server(max_upload_mb=25.0, engine="thread") as server:
        status, body = _transcribe(server, _encoded(long, "WAV", "PCM_16"))
    assert status == 200 and body["text"]
    frames_per_second = 100  # 10 ms hop of every bundled feature config
    assert sum(sizes) >= 99 * frames_per_second
    assert max(sizes) <= (WHOLE_WINDOW_SECONDS + 1) * frames_per_second, max(sizes)
