"""A server no client can exhaust, against a real server: audio limits in every encoding
(as early as the audio allows, with memory bounded by what is accepted rather than by
what is sent), messages that do not parse, unbounded input, and what the server shows."""

from __future__ import annotations

import io
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")

import soundfile as sf  # noqa: E402

from echoic.model.core.audio import AudioTooLong, decode_audio  # noqa: E402
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from echoic.server.config import ServerConfig  # noqa: E402
from echoic.server.process.background import BackgroundServer  # noqa: E402
from tests.test_server import (  # noqa: E402
    channel_to,
    recognize,
    running,
    status_of,
    wait_until,
)

Code = grpc.StatusCode
Config = pb.RecognitionConfig
LIMIT = 2.0  # the servers' max_audio_seconds here, s
PIECE = 4096  # bytes per streamed message


def _container(
    seconds: float,
    rate: int,
    channels: int,
    fmt: str,
    *,
    tone: bool = False,
    subtype: str = "PCM_16",
    compression_level: float | None = None,
) -> bytes:
    """`seconds` of silence (or a quiet tone) as a WAV, FLAC or Ogg file, written a block
    at a time so that long files cost the test no memory."""
    buf = io.BytesIO()
    block = np.zeros((rate, channels), np.float32)
    if tone:
        block[:, :] = 0.1 * np.sin(2 * np.pi * 330 * np.arange(rate) / rate)[:, None]
    level = {} if compression_level is None else {"compression_level": compression_level}
    with sf.SoundFile(buf, "w", rate, channels, format=fmt, subtype=subtype, **level) as f:
        for _ in range(int(seconds)):
            f.write(block)
    return buf.getvalue()


def _unknown_length(flac: bytes) -> bytes:
    """The FLAC with STREAMINFO's total-samples field zeroed, as a live encoder writes it."""
    data = bytearray(flac)
    data[8 + 13] &= 0xF0
    data[8 + 14 : 8 + 18] = bytes(4)
    return bytes(data)


def _streaming_wav(wav: bytes) -> bytes:
    """The WAV with its RIFF and data sizes set to 0xFFFFFFFF, as a live writer leaves them."""
    data = bytearray(wav)
    data[4:8] = b"\xff\xff\xff\xff"
    at = data.index(b"data")
    data[at + 4 : at + 8] = b"\xff\xff\xff\xff"
    return bytes(data)


def _messages(
    data: bytes, encoding: int, config: pb.RecognitionConfig | None = None
) -> Iterator[pb.StreamingRecognizeRequest]:
    config = config or Config(encoding=encoding)
    yield pb.StreamingRecognizeRequest(
        streaming_config=pb.StreamingRecognitionConfig(config=config)
    )
    for i in range(0, len(data), PIECE):
        yield pb.StreamingRecognizeRequest(audio_content=data[i : i + PIECE])


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[BackgroundServer]:
    with running(tiny_model_dir, max_audio_seconds=LIMIT) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server: BackgroundServer) -> Iterator[pb_grpc.TranscriberStub]:
    with channel_to(server) as channel:
        yield pb_grpc.TranscriberStub(channel)


FLAC_10S = _container(10, 16000, 1, "FLAC")
WAV_10S = _container(10, 16000, 1, "WAV")
TOO_LONG = [
    pytest.param(FLAC_10S, Config.FLAC, id="flac-length-in-header"),
    pytest.param(WAV_10S, Config.WAV, id="wav-length-in-header"),
    pytest.param(_streaming_wav(WAV_10S), Config.WAV, id="wav-length-unknown"),
    pytest.param(_container(10, 8000, 2, "FLAC"), Config.ENCODING_UNSPECIFIED, id="auto-8k-stereo"),
    pytest.param(_container(10, 48000, 1, "OGG", tone=True, subtype="OPUS"), Config.OGG_OPUS,
                 id="ogg-opus-length-unknown"),
    pytest.param(_container(10, 44100, 2, "OGG", tone=True, subtype="VORBIS"),
                 Config.ENCODING_UNSPECIFIED, id="auto-ogg-vorbis-stereo"),
]  # fmt: skip


@pytest.mark.parametrize(("data", "encoding"), TOO_LONG)
def test_a_stream_over_the_limit_is_out_of_range_in_every_encoding(stub, data, encoding) -> None:
    call = stub.StreamingRecognize(_messages(data, encoding), timeout=30)
    code, details = status_of(lambda: list(call))
    assert code == Code.OUT_OF_RANGE and f"limit of {LIMIT:g} s" in details, details


@pytest.mark.parametrize(("data", "encoding"), TOO_LONG)
def test_a_request_over_the_limit_is_refused_in_every_encoding(stub, data, encoding) -> None:
    code, details = status_of(lambda: recognize(stub, data, Config(encoding=encoding)))
    assert code == Code.INVALID_ARGUMENT and f"at most {LIMIT:g} s" in details, details


def test_a_flac_without_its_length_is_refused_at_its_header(server) -> None:
    """libsndfile cannot decode such a stream to its end (it fails on the last block), so
    the server says so from STREAMINFO, before the audio arrives, and names what to send."""
    flac = _unknown_length(_container(1, 16000, 1, "FLAC", tone=True))
    with channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        for call in (
            lambda: list(stub.StreamingRecognize(_messages(flac, Config.FLAC), timeout=30)),
            lambda: recognize(stub, flac, Config(encoding=Config.FLAC)),
        ):
            code, details = status_of(call)
            assert code == Code.INVALID_ARGUMENT and "stream WAV or LINEAR16" in details


@pytest.mark.parametrize(
    ("data", "limit", "ceiling_mb"),
    [
        pytest.param(_container(600, 8000, 1, "FLAC"), 60.0, 40, id="10-min-of-silence"),
        pytest.param(_streaming_wav(_container(600, 8000, 1, "WAV")), 60.0, 40,
                     id="10-min-of-silence-wav-length-unknown"),
        pytest.param(_container(20, 192000, 8, "FLAC"), 60.0, 40, id="192khz-8-channels"),
    ],
)  # fmt: skip
def test_decoding_memory_is_bounded_by_what_is_accepted(data, limit, ceiling_mb) -> None:
    """Peak memory of decoding (numpy's allocations, traced) stays near the size of the
    audio accepted at the model's rate, however long or wide the source is."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        try:
            samples = decode_audio(data, 16000, max_seconds=limit)
        except AudioTooLong as e:
            assert e.limit == limit
            samples = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ceiling_mb * 2**20, f"peak {peak / 2**20:.0f} MB"
    if samples is not None:
        assert len(samples) == 20 * 16000


def test_an_ogg_stream_holds_what_is_not_decoded_not_the_stream() -> None:
    """A 5-minute Ogg/Opus stream (at Opus's highest bitrate, 10 MB) fed in 16 KiB pieces,
    each read by the decoder before the next (a client sending at the audio's pace),
    holds a piece and its decoded samples at a time: peak memory (Python's and numpy's
    allocations, traced) stays far below the stream's bytes, which buffering it to its
    end would hold at least."""
    from echoic.server.core.audio_input import AudioInput

    data = _container(300, 16000, 1, "OGG", tone=True, subtype="OPUS", compression_level=0.0)
    audio = AudioInput("ogg", 16000)
    decoded, piece = 0, 16 * 1024
    tracemalloc.start()
    try:
        for i in range(0, len(data), piece):
            decoded += len(audio.feed(data[i : i + piece]))
            wait_until(lambda: audio.undecoded_bytes == 0, what="the decoder to read the piece")
        decoded += len(audio.finish())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        audio.close()
    assert decoded == 300 * 16000
    assert peak < len(data) / 10, f"peak {peak} bytes for a {len(data)}-byte stream"


def test_the_header_decides_before_the_audio_arrives(server) -> None:
    """A 10-minute FLAC is refused at its first message, from STREAMINFO: the server reads
    none of the rest."""
    sent = []

    def messages() -> Iterator[pb.StreamingRecognizeRequest]:
        for message in _messages(_container(600, 8000, 1, "FLAC"), Config.FLAC):
            sent.append(message)
            yield message

    with channel_to(server) as channel:
        call = pb_grpc.TranscriberStub(channel).StreamingRecognize(messages(), timeout=30)
        code, _ = status_of(lambda: list(call))
    assert code == Code.OUT_OF_RANGE
    assert len(sent) < 10, f"{len(sent)} messages were sent before the refusal"


def test_the_beam_is_capped_by_the_server(tiny_model_dir) -> None:
    """--max-beam-size bounds what one client can make the shared batch spend on it."""
    pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")
    tone = _container(1, 16000, 1, "WAV", tone=True)

    def beam(size: int) -> Config:
        return Config(decoder=pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=size))

    with running(tiny_model_dir, max_beam_size=16) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        assert recognize(stub, tone, beam(16)).results
        assert recognize(stub, tone, beam(0)).results  # the default, within the cap
        code, details = status_of(lambda: recognize(stub, tone, beam(17)))
    assert code == Code.INVALID_ARGUMENT and "--max-beam-size" in details and "16" in details


BAD_UTF8 = bytes.fromhex("0a032201ff")  # config { model: "\xff" }: a string field, not UTF-8
STREAM_BAD_UTF8 = bytes.fromhex("0a050a032201ff")  # streaming_config { the same config }
TRUNCATED = bytes.fromhex("0a0a2203")  # config, 10 bytes long, of which 2 arrive


@pytest.mark.parametrize(
    ("method", "data"),
    [
        pytest.param("Recognize", BAD_UTF8, id="recognize-bad-utf8"),
        pytest.param("Recognize", TRUNCATED, id="recognize-truncated"),
        pytest.param("StreamingRecognize", STREAM_BAD_UTF8, id="stream-bad-utf8"),
        pytest.param("StreamingRecognize", TRUNCATED, id="stream-truncated"),
        pytest.param("ListModels", b"\xff\xff\xff", id="list-models-garbage"),
    ],
)
def test_a_message_that_does_not_parse_is_invalid_argument(
    server, stub, method, data, caplog
) -> None:
    """Counted like any request, one warning line at most, no traceback; the server
    goes on transcribing."""
    metrics = server.server.metrics.registry

    def count() -> float:
        labels = {"method": method, "code": "INVALID_ARGUMENT"}
        return metrics.get_sample_value("echoic_requests_total", labels) or 0.0

    before = count()
    with channel_to(server) as channel:
        path = f"/echoic.v1.Transcriber/{method}"
        if method == "StreamingRecognize":
            call = channel.stream_stream(path)  # raw bytes both ways
            code, details = status_of(lambda: list(call(iter([data]), timeout=30)))
        else:
            code, details = status_of(lambda: channel.unary_unary(path)(data, timeout=30))
    assert code == Code.INVALID_ARGUMENT and "not a valid" in details, details
    wait_until(lambda: count() == before + 1, what="the call counted")  # counted after abort
    assert "Traceback" not in caplog.text
    assert recognize(stub, _container(1, 16000, 1, "WAV", tone=True), Config()).results


def test_malformed_messages_log_one_line_at_most(tiny_model_dir, caplog) -> None:
    with running(tiny_model_dir) as server, channel_to(server) as channel:
        call = channel.unary_unary("/echoic.v1.Transcriber/Recognize")
        for _ in range(5):
            code, _ = status_of(lambda: call(BAD_UTF8, timeout=30))
            assert code == Code.INVALID_ARGUMENT
    lines = [r for r in caplog.records if "not a valid" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING"
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(Config(model="m" * 100_000), id="100k-model-name"),
        pytest.param(Config(model_version="9" * 100_000), id="100k-version"),
    ],
)
def test_unbounded_input_is_never_echoed(stub, config) -> None:
    """The status names the problem in a few words; it carries no copy of the input, so
    the client gets INVALID_ARGUMENT rather than a trailer too large to read."""
    tone = _container(1, 16000, 1, "WAV", tone=True)
    code, details = status_of(lambda: recognize(stub, tone, config))
    assert code == Code.INVALID_ARGUMENT and "at most 256" in details and len(details) < 200


def test_status_messages_are_cut_to_a_readable_size() -> None:
    from echoic.server.core.refusals import MAX_DETAILS
    from echoic.server.core.types import invalid
    from echoic.server.doors.service import status_of as server_status_of

    code, message = server_status_of(invalid("x" * 50_000))
    assert code == Code.INVALID_ARGUMENT and len(message) <= MAX_DETAILS
    assert message.endswith("(message cut)")


def test_what_the_server_shows(tiny_model_dir, caplog) -> None:
    """Metrics only at /metrics, with process metrics and latency buckets to 10 s and
    more; no directories in ListModels unless asked; reflection can be turned off; a
    plaintext server on a non-loopback address says so in its log."""
    import urllib.error
    import urllib.request

    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with running(tiny_model_dir, metrics_port=0) as server, channel_to(server) as channel:
        tone = _container(1, 16000, 1, "WAV", tone=True)
        assert recognize(pb_grpc.TranscriberStub(channel), tone, Config()).results
        base = f"http://127.0.0.1:{server.metrics_port}"
        text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        for path in ("/", "/other", "/metrics/x"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + path, timeout=10)
            assert e.value.code == 404
    assert "process_resident_memory_bytes" in text and "python_info" in text
    buckets = [line for line in text.splitlines() if "final_result_latency_seconds_bucket" in line]
    assert any('le="10.0"' in line for line in buckets), buckets

    def list_models(**settings) -> pb.ModelInfo:
        with running(tiny_model_dir, **settings) as server, channel_to(server) as channel:
            return pb_grpc.TranscriberStub(channel).ListModels(pb.ListModelsRequest()).models[0]

    assert list_models().path == ""
    assert list_models(expose_paths=True).path == str(tiny_model_dir.resolve())

    def reflected(**settings) -> grpc.StatusCode:
        with running(tiny_model_dir, **settings) as server, channel_to(server) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            try:
                list(stub.ServerReflectionInfo(iter([ask]), timeout=10))
            except grpc.RpcError as e:
                return e.code()
            return Code.OK

    assert reflected() == Code.OK and reflected(reflection=False) == Code.UNIMPLEMENTED

    caplog.clear()
    with running(tiny_model_dir, host="0.0.0.0"):
        pass
    assert "plaintext" in caplog.text and "0.0.0.0" in caplog.text
    caplog.clear()
    with running(tiny_model_dir):  # 127.0.0.1
        pass
    assert "reachable from other machines" not in caplog.text


def test_cutting_utterances_every_chunk_loses_and_doubles_nothing(
    tiny_model_dir, speech_corpus
) -> None:
    """max_utterance_ms=1 ends an utterance after every model step; the characters of
    all of them, in order, are those of the whole clip decoded at once (greedy): no
    character that runs across a cut is written twice, none is lost."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()][:6]
    config = Config(encoding=Config.WAV, endpointing=pb.EndpointingConfig(max_utterance_ms=1))
    utterances = 0
    with running(tiny_model_dir) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        for row in rows:
            wav = Path(row["audio_filepath"]).read_bytes()
            whole = recognize(stub, wav, Config()).results[0].alternatives[0].transcript
            call = stub.StreamingRecognize(_messages(wav, Config.WAV, config), timeout=30)
            finals = [r.results[0] for r in call if r.results and r.results[0].is_final]
            utterances += len(finals)
            cut = "".join(r.alternatives[0].transcript for r in finals)
            assert cut.replace(" ", "") == whole.replace(" ", ""), (cut, whole)
    assert utterances > 2 * len(rows), "the clips were hardly cut"


def test_a_slow_sender_cannot_hold_a_stream_forever(tiny_model_dir) -> None:
    """Two bytes every 0.2 s never trips the idle timeout; --max-stream-seconds ends the
    stream anyway and frees its slot."""
    import time

    def trickle() -> Iterator[pb.StreamingRecognizeRequest]:
        yield pb.StreamingRecognizeRequest(
            streaming_config=pb.StreamingRecognitionConfig(
                config=Config(encoding=Config.LINEAR16, sample_rate_hertz=16000)
            )
        )
        for _ in range(100):  # 20 s at most
            time.sleep(0.2)
            yield pb.StreamingRecognizeRequest(audio_content=b"\0\0")

    settings = dict(max_stream_seconds=1.0, idle_timeout_seconds=10.0)
    with running(tiny_model_dir, **settings) as server, channel_to(server) as channel:
        call = pb_grpc.TranscriberStub(channel).StreamingRecognize(trickle(), timeout=30)
        code, details = status_of(lambda: list(call))
        wait_until(lambda: server.server.service.active == 0, what="the slot freed")
    assert code == Code.DEADLINE_EXCEEDED and "--max-stream-seconds" in details, details


def test_shutdown_that_a_load_balancer_can_follow(tiny_model_dir) -> None:
    """stop(): health says NOT_SERVING at once on a connection that still works, new
    calls get UNAVAILABLE, and a stream still open when the grace ends gets its final
    result for the audio it sent, then OK."""
    import threading

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tone = _container(2, 16000, 1, "WAV", tone=True)
    pcm = np.frombuffer(tone[44:], "<i2").tobytes()  # the samples, raw
    half, release = threading.Event(), threading.Event()

    def messages() -> Iterator[pb.StreamingRecognizeRequest]:
        yield pb.StreamingRecognizeRequest(
            streaming_config=pb.StreamingRecognitionConfig(
                config=Config(encoding=Config.LINEAR16, sample_rate_hertz=16000)
            )
        )
        for i in range(0, len(pcm) // 2, 3200):
            yield pb.StreamingRecognizeRequest(audio_content=pcm[i : i + 3200])
        half.set()
        release.wait(60)  # does not half-close: the server must end the stream

    server = BackgroundServer(
        ServerConfig(
            model_dir=tiny_model_dir, port=0, http_port=0, intra_op_threads=1, grace_seconds=1.0
        )
    )
    try:
        with channel_to(server) as channel:
            stub = pb_grpc.TranscriberStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            responses: list[pb.StreamingRecognizeResponse] = []
            outcome: list[object] = []

            def run() -> None:
                try:
                    responses.extend(stub.StreamingRecognize(messages(), timeout=60))
                    outcome.append(Code.OK)
                except grpc.RpcError as e:
                    outcome.append(e.code())

            reader = threading.Thread(target=run)
            reader.start()
            assert half.wait(30)
            wait_until(lambda: server.server.service.active == 1, what="the stream open")
            stopping = threading.Thread(target=server.stop, kwargs={"grace": 1.0})
            stopping.start()
            wait_until(lambda: server.server.service.draining, what="draining")
            check = health_pb2.HealthCheckRequest(service="echoic.v1.Transcriber")
            status = health.Check(check, timeout=10).status
            code, details = status_of(lambda: recognize(stub, tone, Config()))
            reader.join(60)
            stopping.join(60)
    finally:
        release.set()
        server.stop()
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert code == Code.UNAVAILABLE and "another replica" in details
    assert outcome == [Code.OK]
    final = [r.results[0] for r in responses if r.results and r.results[0].is_final]
    assert len(final) == 1 and final[0].utterance_end_time == pytest.approx(1.0, abs=0.05)


ALLOWED = {Code.OK, Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE, Code.RESOURCE_EXHAUSTED}


def _mutate(data: bytes, rng: np.random.Generator) -> bytes:
    """One random edit of a serialized message: flip, drop, insert, truncate or repeat."""
    b = bytearray(data)
    kind = rng.integers(5)
    at = int(rng.integers(len(b))) if b else 0
    if kind == 0 and b:
        b[at] ^= 1 << int(rng.integers(8))
    elif kind == 1 and b:
        del b[at : at + int(rng.integers(1, 8))]
    elif kind == 2:
        b[at:at] = rng.integers(0, 256, int(rng.integers(1, 8)), dtype=np.uint8).tobytes()
    elif kind == 3:
        b = b[:at]
    else:
        b = b[:at] + b[at : at + 16] * int(rng.integers(2, 5)) + b[at + 16 :]
    return bytes(b)


@pytest.mark.slow
def test_fuzzed_requests_get_clean_statuses_and_the_server_goes_on(tiny_model_dir) -> None:
    """300 randomly edited Recognize and StreamingRecognize messages (fixed seed, at most
    60 s): every status is OK or one a client can act on, never INTERNAL or UNKNOWN, and
    afterwards the server gives the same transcript as before."""
    import time

    rng = np.random.default_rng(2026)
    tone = _container(1, 16000, 1, "WAV", tone=True)
    pcm = tone[44:]
    linear16 = Config(encoding=Config.LINEAR16, sample_rate_hertz=16000, max_alternatives=2)
    beam = Config(
        encoding=Config.WAV,
        decoder=pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=4),
        endpointing=pb.EndpointingConfig(trailing_silence_ms=300, max_utterance_ms=500),
    )
    unary = [
        pb.RecognizeRequest(config=linear16, audio_content=pcm).SerializeToString(),
        pb.RecognizeRequest(config=beam, audio_content=tone).SerializeToString(),
    ]
    stream_config = pb.StreamingRecognizeRequest(
        streaming_config=pb.StreamingRecognitionConfig(
            config=linear16, interim_results=True, interim_interval_ms=100
        )
    ).SerializeToString()
    chunks = [
        pb.StreamingRecognizeRequest(audio_content=pcm[i : i + 3200]).SerializeToString()
        for i in range(0, len(pcm), 3200)
    ]
    seen: dict[str, int] = {}
    settings = dict(max_audio_seconds=5.0, idle_timeout_seconds=5.0)
    with running(tiny_model_dir, **settings) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        before = recognize(stub, tone, Config()).results[0].alternatives[0].transcript
        recognize_raw = channel.unary_unary("/echoic.v1.Transcriber/Recognize")
        stream_raw = channel.stream_stream("/echoic.v1.Transcriber/StreamingRecognize")
        stop = time.monotonic() + 60
        for i in range(300):
            if time.monotonic() > stop:
                break
            try:
                if i % 2:
                    recognize_raw(_mutate(unary[i % 4 // 2], rng), timeout=30)
                else:
                    messages = [stream_config, *chunks]
                    for _ in range(int(rng.integers(1, 4))):
                        k = int(rng.integers(len(messages)))
                        messages[k] = _mutate(messages[k], rng)
                    list(stream_raw(iter(messages), timeout=30))
                code = Code.OK
            except grpc.RpcError as e:
                code = e.code()
                assert code in ALLOWED, (i, code, e.details())
            seen[code.name] = seen.get(code.name, 0) + 1
        after = recognize(stub, tone, Config()).results[0].alternatives[0].transcript
    assert sum(seen.values()) >= 100 and seen.get("INVALID_ARGUMENT", 0) > 0, seen
    assert after == before


def test_beam_search_runs_beside_the_batch_not_in_it(tiny_model_dir, monkeypatch) -> None:
    """Every beam-search step of a stream runs in the decoder pool, never in the engine
    thread that runs the batch all streams share (so a large beam delays only its own
    client); greedy streams decode in the batch, as before; transcripts are unchanged."""
    import threading

    from echoic.model.core import decoding

    pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")
    threads: dict[str, set[str]] = {"beam": set(), "greedy": set()}
    for kind, cls in (("beam", decoding.BeamStream), ("greedy", decoding.GreedyStream)):
        original = cls._accept

        def spy(self, chunk, original=original, kind=kind):
            threads[kind].add(threading.current_thread().name.rsplit("_", 1)[0])
            return original(self, chunk)

        monkeypatch.setattr(cls, "_accept", spy)
    tone = _container(3, 16000, 1, "WAV", tone=True)
    beam = Config(decoder=pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=8))
    # The threads of this process, the searches in them (no decoder processes): an engine
    # process's are its own (the same split there).
    with (
        running(tiny_model_dir, engine="thread", beam_processes=0) as server,
        channel_to(server) as channel,
    ):
        stub = pb_grpc.TranscriberStub(channel)
        got = recognize(stub, tone, beam).results[0].alternatives[0].transcript
        list(stub.StreamingRecognize(_messages(tone, Config.WAV, beam), timeout=30))
        recognize(stub, tone, Config())
    assert threads["beam"] == {"echoic-decode"}, threads
    assert threads["greedy"] == {"echoic-engine"}, threads
    from echoic.model.runtime.recognizer import Recognizer

    local = Recognizer(tiny_model_dir, decoding.DecoderConfig(kind="beam", beam_size=8))
    assert got == local.transcribe([decode_audio(tone, 16000)])[0].text


def _wav_header(rate: int, channels: int, bits: int, data_size: int) -> bytes:
    import struct

    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * block, block, bits)
    return (
        b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt
        + b"data" + struct.pack("<I", data_size)
    )  # fmt: skip


def test_a_live_capture_wav_streams_and_a_wide_one_is_refused(stub) -> None:
    """arecord and other live writers put a placeholder near 2**31 in the data size: the
    stream is read to its end and measured as it comes, not refused for a length it does
    not have. A WAV of 1,000 channels is refused at its header."""
    tone = _container(1, 16000, 1, "WAV", tone=True)
    live = _wav_header(16000, 1, 16, 0x7FFFFFFF) + tone[44:]
    responses = list(stub.StreamingRecognize(_messages(live, Config.WAV), timeout=30))
    assert responses and responses[-1].results[0].is_final
    assert responses[-1].audio_processed_seconds == pytest.approx(1.0)
    wide = _wav_header(16000, 1000, 8, 16000 * 1000) + bytes(16000)
    code, details = status_of(lambda: list(stub.StreamingRecognize(_messages(wide, Config.WAV))))
    assert code == Code.INVALID_ARGUMENT and "1-255" in details, details
