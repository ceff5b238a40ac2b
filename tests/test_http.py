"""The HTTP door: real servers on loopback ports, the clients people use (OpenAI's
`openai` package, curl) and raw HTTP/1.1 for what no polite client sends, on the
bundled model (real words). Every transcript is compared with gRPC Recognize's on
the same server and the same audio.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import io
import json
import logging
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
pytest.importorskip("aiohttp", reason="the HTTP door needs the serve extra (aiohttp)")
openai = pytest.importorskip("openai", reason="the conformance tests need the dev extra (openai)")

import soundfile as sf  # noqa: E402
import soxr  # noqa: E402
from aiohttp import WSMsgType  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from echoic.model.core.audio import decode_audio  # noqa: E402
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from echoic.server.config import ServerConfig, ServerError  # noqa: E402
from echoic.server.doors.openai_api import ENDPOINTING  # noqa: E402
from echoic.server.process.background import BackgroundServer  # noqa: E402
from tests.conftest import words_heard  # noqa: E402
from tests.test_server import certificates  # noqa: E402, F401 - a fixture; belongs in conftest

TIMEOUT = 60.0  # s per call: generous for a loaded 2-core machine; failures are fast
ROUTE = "/v1/audio/transcriptions"
UPLOAD_MB = 1.0  # --max-upload-mb of the test server
# What Recognize is asked, for the HTTP door's transcripts to be compared with.
RECOGNIZE = pb.RecognitionConfig(enable_word_time_offsets=True, endpointing=ENDPOINTING)
# What the OpenAI door asks for by default: readable text (docs/formatting.md).
FORMATTED = pb.FormattingConfig(punctuation=True, inverse_normalization=True)
RAW = {"formatting": "false"}  # the form field that asks the OpenAI door for spoken words


# ---------------------------------------------------------------- servers and clients


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def http_server(**overrides) -> Iterator[BackgroundServer]:
    """A server with HTTP on a free loopback port (the bundled model unless told), one
    ONNX thread. HTTP port 0 means off, so the port is picked here; another process
    taking it in between is retried with another."""
    settings = dict(port=0, intra_op_threads=1, grace_seconds=0.0, max_upload_mb=UPLOAD_MB,
                    idle_timeout_seconds=10.0)  # fmt: skip
    settings.update(overrides)
    for attempt in range(3):
        try:
            server = BackgroundServer(ServerConfig(http_port=_free_port(), **settings))
            break
        except ServerError as e:
            if "cannot serve HTTP" not in str(e) or attempt == 2:
                raise
    with server:
        yield server


def _host_port(server: BackgroundServer) -> tuple[str, int]:
    return "127.0.0.1", server.server.http_port


def openai_client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    )


def multipart(
    fields: list[tuple[str, str]], files: list[tuple[str, bytes]] = ()
) -> tuple[bytes, str]:
    """A multipart/form-data body: (bytes, its Content-Type)."""
    boundary = "echoic-test-boundary-7d1f"
    out = io.BytesIO()
    for name, value in fields:
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode())
        out.write(value.encode() + b"\r\n")
    for name, data in files:
        out.write(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
            f'filename="audio"\r\nContent-Type: application/octet-stream\r\n\r\n'.encode()
        )
        out.write(data + b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def post(
    server: BackgroundServer, body: bytes, content_type: str, timeout: float = TIMEOUT
) -> tuple[int, dict]:
    """POST body to the transcription route: (status, JSON body)."""
    conn = http.client.HTTPConnection(*_host_port(server), timeout=timeout)
    try:
        conn.request("POST", ROUTE, body, {"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def post_form(server, fields, files=()) -> tuple[int, dict]:
    return post(server, *multipart(fields, files))


def get(server: BackgroundServer, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection(*_host_port(server), timeout=TIMEOUT)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def metric(server: BackgroundServer, name: str, **labels: str) -> float:
    """A sample's value from the HTTP door's /metrics (0 when absent)."""
    _, text = get(server, "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _config(formatted: bool) -> pb.RecognitionConfig:
    config = pb.RecognitionConfig()
    config.CopyFrom(RECOGNIZE)
    if formatted:
        config.formatting.CopyFrom(FORMATTED)
    return config


def recognize(stub, wav: bytes, formatted: bool = True) -> list[pb.SpeechRecognitionResult]:
    """gRPC Recognize as the OpenAI door asks it: formatted, unless it was sent RAW."""
    request = pb.RecognizeRequest(config=_config(formatted), audio_content=wav)
    return list(stub.Recognize(request, timeout=TIMEOUT).results)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def clips(speech_corpus: Path) -> list[tuple[bytes, np.ndarray]]:
    """(WAV bytes, 16 kHz samples) of three corpus utterances."""
    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()][:3]
    out = []
    for row in rows:
        data = (speech_corpus.parent / row["audio_filepath"]).read_bytes()
        out.append((data, decode_audio(data, 16000)))
    return out


@pytest.fixture(scope="module")
def two_utterances(clips) -> bytes:
    """Clips 0 and 1 with 1.5 s of silence between: a WAV of two utterances (segments)."""
    (_, a), (_, b) = clips[0], clips[1]
    audio = np.concatenate([a, np.zeros(24000, np.float32), b])
    buf = io.BytesIO()
    sf.write(buf, audio, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with http_server(metrics_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server: BackgroundServer) -> Iterator[pb_grpc.TranscriberStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TranscriberStub(channel)


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


# ---------------------------------------------------------------- OpenAI conformance


def _cues(text: str, separator: str) -> list[tuple[float, float, str]]:
    """(start s, end s, text) of each SRT or WebVTT cue."""
    clock = rf"(\d\d):(\d\d):(\d\d){re.escape(separator)}(\d\d\d)"
    out = []
    for m in re.finditer(rf"{clock} --> {clock}\n(.+)\n", text):
        g = [int(x) for x in m.groups()[:8]]
        start = g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000
        end = g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000
        out.append((start, end, m.group(9)))
    return out


def _flat(pairs) -> list[float]:
    return [x for pair in pairs for x in pair]


@pytest.mark.parametrize("response_format", ["json", "text", "srt", "vtt", "verbose_json"])
def test_openai_client_gets_what_recognize_gets(client, stub, two_utterances, response_format):
    """OpenAI's own client, unchanged, for each response format: the transcript (and the
    segments and word times where the format has them) equal gRPC Recognize's, here for
    the words as spoken (formatting=false)."""
    results = recognize(stub, two_utterances, formatted=False)
    assert len(results) == 2, "the pause should end the first utterance: two segments"
    texts = [r.alternatives[0].transcript for r in results]
    times = [(r.utterance_start_time, r.utterance_end_time) for r in results]
    extra = {"timestamp_granularities": ["word", "segment"]} if response_format == "verbose_json" else {}  # fmt: skip  # noqa: E501
    got = client.audio.transcriptions.create(
        model="whisper-1", file=("speech.wav", two_utterances), response_format=response_format,
        language="en", prompt="ignored", temperature=0.0, extra_body=RAW, **extra,
    )  # fmt: skip
    if response_format == "json":
        assert got.text == " ".join(texts)
    elif response_format == "text":
        assert got == " ".join(texts) + "\n"
    elif response_format in ("srt", "vtt"):
        if response_format == "vtt":
            assert got.startswith("WEBVTT\n\n")
        else:
            assert got.startswith("1\n")
        cues = _cues(got, "," if response_format == "srt" else ".")
        assert [c[2] for c in cues] == texts
        assert _flat(c[:2] for c in cues) == pytest.approx(_flat(times), abs=0.001)
    else:
        assert got.text == " ".join(texts)
        assert got.duration == pytest.approx(len(decode_audio(two_utterances, 16000)) / 16000)
        assert [s.text for s in got.segments] == texts
        assert _flat((s.start, s.end) for s in got.segments) == pytest.approx(
            _flat(times), abs=0.001
        )
        words = [w for r in results for w in r.alternatives[0].words]
        assert [w.word for w in got.words] == [w.word for w in words]
        assert _flat((w.start, w.end) for w in got.words) == pytest.approx(
            _flat((w.start_time, w.end_time) for w in words), abs=0.001
        )


def test_stream_true_sends_deltas_as_words_firm_up_then_the_text(client, stub, two_utterances):
    """stream=true, through OpenAI's client: several `transcript.text.delta` events that
    join to the final text, then `transcript.text.done` with Recognize's transcript (the
    words as spoken, so that deltas come as words firm up)."""
    results = recognize(stub, two_utterances, formatted=False)
    want = " ".join(r.alternatives[0].transcript for r in results)
    events = list(
        client.audio.transcriptions.create(
            model="whisper-1", file=("a.wav", two_utterances), stream=True, extra_body=RAW
        )
    )
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    assert events[-1].type == "transcript.text.done" and events[-1].text == want
    deltas = [e.delta for e in events[:-1]]
    assert len(deltas) >= 4 and "".join(deltas) == want
    with pytest.raises(openai.BadRequestError) as e:  # undecodable: refused before any event
        client.audio.transcriptions.create(
            model="whisper-1", file=("a.wav", b"not audio" * 10), stream=True
        )
    assert "cannot decode" in e.value.body["message"]


def test_transcripts_are_the_spoken_words(client, speech_corpus, clips) -> None:
    """The bundled model reads the synthesized sentence: most of its words come back."""
    said = json.loads(speech_corpus.read_text().splitlines()[2])["text"]
    got = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", clips[2][0]))
    spoken = set(re.findall(r"[a-z']+", said.lower()))
    heard = set(re.findall(r"[a-z']+", got.text.lower()))
    assert len(spoken & heard) >= 0.6 * len(spoken), (said, got.text)


def _recognized(stub, wav: bytes, kind: int) -> str:
    config = pb.RecognitionConfig()
    config.CopyFrom(RECOGNIZE)
    config.decoder.kind = kind
    results = stub.Recognize(pb.RecognizeRequest(config=config, audio_content=wav), timeout=TIMEOUT)
    return " ".join(r.alternatives[0].transcript for r in results.results)


def test_the_decoder_field_and_the_servers_default(server, stub, two_utterances) -> None:
    """`decoder` (greedy or beam) chooses the decoding; without it a request gets the
    server's default, which for the bundled model (it ships an LM) is the beam search;
    `echoic serve --decoder greedy` makes greedy the default, for every door. The
    realtime session echoes the decoder once given. Formatting is off throughout: the
    decodings are compared on their words as spoken."""
    greedy = _recognized(stub, two_utterances, pb.DecoderConfig.GREEDY)
    beam = _recognized(stub, two_utterances, pb.DecoderConfig.BEAM)
    assert greedy != beam, "the audio should tell the two decoders apart"
    raw = {"enable_automatic_punctuation": False, "enable_verbatim_transcripts": True}
    for decoder, want in (("", beam), ("greedy", greedy), ("beam", beam)):
        fields = [("decoder", decoder)] if decoder else []
        assert post_form(server, [*fields, *RAW.items()], [("file", two_utterances)]) == (
            200, {"text": want},
        )  # fmt: skip
        asked = {"decoder": decoder} if decoder else {}
        session = {"input_audio_format": "none", "recognition_config": {**raw, **asked}}
        events = asyncio.run(_realtime_events(server, session, two_utterances))
        assert events[0]["type"] == "transcription_session.updated", events[0]
        echoed = events[0]["session"]["recognition_config"]
        assert echoed.get("decoder") == (decoder or None), echoed
        finals = [e["transcript"] for e in events if e["type"].endswith(".completed")]
        assert " ".join(finals) == want, decoder
    unnamed = pb.RecognitionConfig()
    unnamed.CopyFrom(RECOGNIZE)
    unnamed.ClearField("decoder")
    request = pb.RecognizeRequest(config=unnamed, audio_content=two_utterances)
    got = stub.Recognize(request, timeout=TIMEOUT).results
    assert " ".join(r.alternatives[0].transcript for r in got) == beam
    with openai_client(server) as client:  # OpenAI's own client sends it with extra_body
        got = client.audio.transcriptions.create(
            model="whisper-1", file=("a.wav", two_utterances),
            extra_body={"decoder": "greedy", **RAW},
        )  # fmt: skip
    assert got.text == greedy
    with http_server(decoder="greedy") as greedy_server:
        got = post_form(greedy_server, list(RAW.items()), [("file", two_utterances)])
        assert got == (200, {"text": greedy})
        with grpc.insecure_channel(greedy_server.address) as channel:
            got = pb_grpc.TranscriberStub(channel).Recognize(request, timeout=TIMEOUT).results
        assert " ".join(r.alternatives[0].transcript for r in got) == greedy


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_a_long_recording_gives_the_same_words_on_every_path(
    server, speech_corpus, tmp_path, decoder
) -> None:
    """Four sentences joined by 1 s of silence: `echoic transcribe` here, with --server,
    and the HTTP door cut it at the same pauses (one rule, FILE_ENDPOINTING), so they give
    the same words, with the same times, none glued across a pause (the local path and
    --server gave "... nuonscould ..." where HTTP gave "nuons could"), each within the
    sentence it was said in. The HTTP door is asked for the words as spoken, as
    `echoic transcribe` gives them by default."""
    import sys

    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()][3:7]
    parts = [decode_audio((speech_corpus.parent / r["audio_filepath"]).read_bytes(), 16000)
             for r in rows]  # fmt: skip
    pause = np.zeros(16000, np.float32)
    audio = np.concatenate([x for p in parts for x in (p, pause)][:-1])
    sf.write(tmp_path / "long.wav", audio, 16000, subtype="PCM_16")
    spans, at = [], 0.0  # each sentence's (start, end), s
    for p in parts:
        spans.append((at, at + len(p) / 16000))
        at += len(p) / 16000 + 1.0

    def transcribe(*flags: str) -> dict:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "echoic.cli.main", "transcribe", str(tmp_path / "long.wav"),
             "--decoder", decoder, "--output", str(out), "--no-progress", *flags],
            capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(out.read_text())

    local, remote = transcribe(), transcribe("--server", server.address)
    fields = [("decoder", decoder), ("response_format", "verbose_json"),
              ("timestamp_granularities[]", "word"),
              ("timestamp_granularities[]", "segment"), *RAW.items()]  # fmt: skip
    status, http = post_form(server, fields, [("file", (tmp_path / "long.wav").read_bytes())])
    assert status == 200, http
    assert local["text"] == remote["text"] == http["text"]
    assert len(http["segments"]) == len(parts)
    for got in (local["words"], remote["words"], http["words"]):
        times = [(w["start"], w["end"]) for w in got]
        assert _flat(times) == pytest.approx(_flat((w["start"], w["end"]) for w in http["words"]),
                                             abs=0.001)  # fmt: skip
        for start, end in times:  # no word reaches over a pause
            assert any(a - 0.1 <= start and end <= b + 0.1 for a, b in spans), (start, end)


def test_curl_one_liner(server, stub, clips, tmp_path) -> None:
    """README: curl -F file=@a.wav -F model=whisper-1 .../v1/audio/transcriptions."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    wav = tmp_path / "a.wav"
    wav.write_bytes(clips[0][0])
    out = subprocess.run(
        [curl, "-sS", "-F", f"file=@{wav}", "-F", "model=whisper-1",
         f"{server.http_url}{ROUTE}"],
        capture_output=True, text=True, timeout=TIMEOUT, check=True,
    )  # fmt: skip
    want = " ".join(r.alternatives[0].transcript for r in recognize(stub, clips[0][0]))
    assert json.loads(out.stdout) == {"text": want}


@pytest.mark.slow
def test_curl_one_liner_against_the_default_server(
    default_serve: tuple[int, int], speech_corpus: Path
) -> None:
    """Issue 15 as a new user meets it: the README's main command (a real `echoic serve`
    of the bundled model, nothing else set up), then its curl line on synthesized
    sentences prints {"text": ...} with most of their words."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    _, http_port = default_serve

    def transcribe(wav: Path) -> str:
        out = subprocess.run(
            [curl, "-sS", "-F", f"file=@{wav}", "-F", "model=whisper-1",
             f"localhost:{http_port}{ROUTE}"],
            capture_output=True, text=True, timeout=TIMEOUT, check=True,
        )  # fmt: skip
        reply = json.loads(out.stdout)
        assert list(reply) == ["text"], reply
        return reply["text"]

    hits, total = words_heard(speech_corpus, transcribe)
    assert hits >= 0.5 * total, (hits, total)


def test_models(client, server, stub) -> None:
    """OpenAI's model list, and echoic's version beside it (and in gRPC ListModels)."""
    from importlib.metadata import version

    (model,) = client.models.list().data
    assert (model.id, model.object, model.owned_by) == ("echoic-en-default", "model", "echoic")
    assert json.loads(get(server, "/v1/models")[1])["server_version"] == version("echoic")
    listed = stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT)
    assert listed.server_version == version("echoic")
    assert client.models.retrieve("echoic-en-default").id == "echoic-en-default"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_an_echoic_model_name_and_formats_beyond_wav(client, stub, clips) -> None:
    """`model` may name the echoic model; FLAC, OGG and MP3 uploads read as their WAV does."""
    wav, samples = clips[1]
    want = " ".join(r.alternatives[0].transcript for r in recognize(stub, wav))
    for fmt, subtype in (("FLAC", "PCM_16"), ("OGG", "OPUS"), ("MP3", "MPEG_LAYER_III")):
        buf = io.BytesIO()
        sf.write(buf, samples, 16000, format=fmt, subtype=subtype)
        got = client.audio.transcriptions.create(
            model="echoic-en-default", file=(f"a.{fmt.lower()}", buf.getvalue())
        )
        if fmt == "FLAC":  # lossless: the same samples
            assert got.text == want
        else:  # lossy: the same words, mostly
            assert len(set(got.text.split()) & set(want.split())) >= 0.6 * len(want.split())


# ---------------------------------------------------------------- errors


def _error(status_body: tuple[int, dict]) -> tuple[int, str | None, str | None, str]:
    status, body = status_body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    e = body["error"]
    return status, e["param"], e["code"], e["message"]


WAV_HEADER_ONLY = b"RIFF\x24\x00\x00\x00WAVEfmt "


@pytest.mark.parametrize(
    ("fields", "files", "status", "param", "says"),
    [
        pytest.param([("model", "whisper-1")], [], 400, "file", "no file field", id="no-file"),
        pytest.param([], [("file", b"")], 400, "file", "empty", id="empty-file"),
        pytest.param(
            [],
            [("file", b"this is not audio at all" * 10)],
            400,
            None,
            "cannot decode",
            id="garbage-audio",
        ),  # fmt: skip
        pytest.param([], [("file", WAV_HEADER_ONLY)], 400, None, "", id="truncated-wav"),
        pytest.param(
            [("language", "fr")], [("file", b"x")], 400, "language", "English", id="language"
        ),  # fmt: skip
        pytest.param(
            [("response_format", "xml")],
            [("file", b"x")],
            400,
            "response_format",
            "json, text",
            id="response-format",
        ),  # fmt: skip
        pytest.param(
            [("temperature", "hot")],
            [("file", b"x")],
            400,
            "temperature",
            "number from 0 to 1",
            id="temperature",
        ),  # fmt: skip
        pytest.param(
            [("timestamp_granularities[]", "word")],
            [("file", b"x")],
            400,
            "timestamp_granularities[]",
            "verbose_json",
            id="granularity-needs-verbose",
        ),  # fmt: skip  # noqa: E501
        pytest.param(
            [("model", "nope")], [("file", b"x")], 404, "model", "unknown model", id="unknown-model"
        ),  # fmt: skip
        pytest.param(
            [], [("file", b"x"), ("file", b"y")], 400, "file", "two file fields", id="two-files"
        ),  # fmt: skip
        pytest.param(
            [("decoder", "viterbi")], [("file", b"x")], 400, "decoder", "greedy, beam", id="decoder"
        ),  # fmt: skip
    ],
)
def test_bad_requests_get_openai_errors(server, clips, fields, files, status, param, says):
    """Each a clear 4xx in OpenAI's error shape, counted; the server keeps serving."""
    before = metric(server, "echoic_http_requests_total", route=ROUTE, status=str(status))
    # b"x": the form field is what is wrong, so the file is real audio
    files = [(name, clips[0][0] if data == b"x" else data) for name, data in files]
    got_status, got_param, _, message = _error(post_form(server, fields, files))
    assert (got_status, got_param) == (status, param), message
    assert says in message
    after = metric(server, "echoic_http_requests_total", route=ROUTE, status=str(status))
    assert after == before + 1
    status, body = post_form(server, [], [("file", clips[0][0])])
    assert status == 200 and body["text"]


def test_wrong_content_type_and_unknown_routes(server) -> None:
    status, _, code, message = _error(post(server, b'{"file": "a.wav"}', "application/json"))
    assert (status, code) == (415, "unsupported_media_type") and "multipart/form-data" in message
    status, body = get(server, "/v1/nothing/here")
    assert status == 404 and json.loads(body)["error"]["message"]
    assert metric(server, "echoic_http_requests_total", route="unmatched", status="404") >= 1
    conn = http.client.HTTPConnection(*_host_port(server), timeout=TIMEOUT)
    conn.request("GET", ROUTE)
    response = conn.getresponse()
    assert response.status == 405 and "error" in json.loads(response.read())
    conn.close()


def _raw_upload(server: BackgroundServer, head_fields: dict[str, str]) -> socket.socket:
    """A socket with a POST's headers sent, and the body's first part (the file's)."""
    sock = socket.create_connection(_host_port(server), timeout=TIMEOUT)
    head = "".join(f"{k}: {v}\r\n" for k, v in head_fields.items())
    sock.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
    return sock


def _response(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the answer on `sock`, read to its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status = int(head.split()[1])
    if status == 100:  # 100 Continue, then the real answer
        return _response_after(sock, body)
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return status, json.loads(body[:length])


def _response_after(sock: socket.socket, data: bytes) -> tuple[int, dict]:
    class Replay:
        def __init__(self) -> None:
            self.first = data

        def recv(self, n: int) -> bytes:
            out, self.first = self.first, b""
            return out or sock.recv(n)

    return _response(Replay())  # type: ignore[arg-type]


FILE_HEAD = (
    b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.wav"\r\n'
    b"Content-Type: audio/wav\r\n\r\n"
)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_oversize_upload_is_refused_while_it_arrives(server, clips, declared) -> None:
    """Over --max-upload-mb: 413 after the limit's bytes have arrived (with a declared
    Content-Length, before any), while the client still has most of the file to send."""
    size = int(4 * UPLOAD_MB * 2**20)  # the whole upload would be four times the limit
    headers = {"Content-Type": "multipart/form-data; boundary=b"}
    headers |= {"Content-Length": str(size)} if declared else {"Transfer-Encoding": "chunked"}
    before = metric(server, "echoic_http_requests_total", route=ROUTE, status="413")
    with _raw_upload(server, headers) as sock:
        sent = 0
        if not declared:  # the limit and a few read chunks more, then wait for the answer
            piece = FILE_HEAD + bytes(int(UPLOAD_MB * 2**20) + 4 * 65536)
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent = len(piece)
        status, body = _response(sock)
        assert sent < size / 2
    assert status == 413 and body["error"]["code"] == "file_too_large"
    assert "--max-upload-mb" in body["error"]["message"]
    assert metric(server, "echoic_http_requests_total", route=ROUTE, status="413") == before + 1
    assert post_form(server, [], [("file", clips[0][0])])[0] == 200


def test_expect_100_continue_declared_oversize_gets_413_before_the_body(server) -> None:
    headers = {"Content-Type": "multipart/form-data; boundary=b", "Expect": "100-continue",
               "Content-Length": str(int(10 * UPLOAD_MB * 2**20))}  # fmt: skip
    with _raw_upload(server, headers) as sock:
        status, body = _response(sock)
    assert status == 413 and body["error"]["code"] == "file_too_large"


def test_a_client_that_disconnects_mid_upload_is_counted(server, clips) -> None:
    wav = clips[0][0]
    body, content_type = multipart([], [("file", wav)])
    headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
    before = metric(server, "echoic_http_requests_total", route=ROUTE, status="400")
    with _raw_upload(server, headers) as sock:
        sock.sendall(body[: len(body) // 2])
    deadline = time.monotonic() + TIMEOUT
    while metric(server, "echoic_http_requests_total", route=ROUTE, status="400") == before:
        assert time.monotonic() < deadline, "the cut upload was never counted"
        time.sleep(0.05)
    assert post_form(server, [], [("file", wav)])[0] == 200


def test_a_slow_upload_gets_408_and_holds_no_stream_slot_meanwhile(clips) -> None:
    """An upload that stalls for --idle-timeout-seconds gets 408. While it arrives it holds
    no --max-streams slot (it takes one once complete): with --max-streams 1 a Recognize
    is answered meanwhile; an HTTP request is refused with 429 while a gRPC stream holds
    the slot."""
    with http_server(idle_timeout_seconds=1.0, max_streams=1) as server:
        body, content_type = multipart([], [("file", clips[0][0])])
        headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
        with _raw_upload(server, headers) as sock, grpc.insecure_channel(server.address) as ch:
            sock.sendall(body[:1000])
            stub = pb_grpc.TranscriberStub(ch)
            request = pb.RecognizeRequest(config=RECOGNIZE, audio_content=clips[0][0])
            assert stub.Recognize(request, timeout=TIMEOUT).results
            status, body_json = _response(sock)  # the server ends the stalled upload
        assert status == 408 and body_json["error"]["code"] == "request_timeout"
        # Now a gRPC stream holds the only slot: HTTP gets 429, as OpenAI's rate limit.
        release = threading.Event()

        def held():
            yield pb.StreamingRecognizeRequest(
                streaming_config=pb.StreamingRecognitionConfig(config=RECOGNIZE)
            )
            yield pb.StreamingRecognizeRequest(audio_content=clips[0][0])
            release.wait(TIMEOUT)

        with grpc.insecure_channel(server.address) as ch:
            call = pb_grpc.TranscriberStub(ch).StreamingRecognize(held(), timeout=TIMEOUT)
            deadline = time.monotonic() + TIMEOUT
            while metric(server, "echoic_active_streams", method="StreamingRecognize") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(openai.RateLimitError) as limited, openai_client(server) as c:
                c.audio.transcriptions.create(model="whisper-1", file=("a.wav", clips[0][0]))
            assert "limit of 1 concurrent" in limited.value.body["message"]
            release.set()
            list(call)
        assert post_form(server, [], [("file", clips[0][0])])[0] == 200


def test_uploads_in_progress_are_capped_at_twice_max_streams(clips) -> None:
    """Uploads hold memory before they take a --max-streams slot, so their number is
    capped: with --max-streams 1, two stalled uploads are all the server holds; a third
    request gets 429 before its body is read, and is served once one of them is gone."""
    with http_server(max_streams=1) as server:
        body, content_type = multipart([], [("file", clips[0][0])])
        headers = {"Content-Type": content_type, "Content-Length": str(len(body))}

        def status_until(want: int) -> tuple[int, dict]:
            """A form without a file (400 once it is read) sent until it gets `want`."""
            deadline = time.monotonic() + TIMEOUT
            while (answer := post_form(server, [("model", "whisper-1")]))[0] != want:
                assert time.monotonic() < deadline, answer
                time.sleep(0.05)
            return answer

        with _raw_upload(server, headers) as first, _raw_upload(server, headers) as second:
            first.sendall(body[:1000])
            second.sendall(body[:1000])
            _, refused = status_until(429)  # once both stalled uploads are being read
            assert "limit of 2 transcription requests" in refused["error"]["message"]
            assert "--max-streams" in refused["error"]["message"]
            first.sendall(body[1000:])  # one completes: its place is free again
            assert _response(first)[0] == 200
            status_until(400)
        assert post_form(server, [], [("file", clips[0][0])])[0] == 200


@pytest.mark.parametrize("limits, flag", [
    pytest.param(dict(idle_timeout_seconds=1.0, upload_timeout_seconds=2.0,
                      min_upload_bytes_per_second=0.0),
                 "--upload-timeout-seconds", id="past-the-deadline"),
    # an idle timeout well above the 0.3 s between bytes, on a loaded machine too
    pytest.param(dict(idle_timeout_seconds=2.0, upload_timeout_seconds=30.0,
                      min_upload_bytes_per_second=2000.0),
                 "--min-upload-bytes-per-second", id="under-the-least-pace"),
])  # fmt: skip
def test_an_upload_trickling_gets_408(clips, limits, flag) -> None:
    """Bytes that keep coming, each within --idle-timeout-seconds, do not keep an upload
    open past --upload-timeout-seconds, nor, slower than --min-upload-bytes-per-second
    (a few bytes a second), for longer than the idle timeout."""
    with http_server(**limits) as server:
        body, content_type = multipart([], [("file", clips[0][0])])
        headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
        with _raw_upload(server, headers) as sock:
            sock.sendall(body[:1000])
            stop = time.monotonic() + TIMEOUT
            try:
                for i in range(1000, len(body)):
                    assert time.monotonic() < stop, "the trickling upload was never ended"
                    sock.sendall(body[i : i + 1])
                    time.sleep(0.3)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered and closed while bytes still came
            status, body_json = _response(sock)
        assert status == 408 and flag in body_json["error"]["message"], body_json


# ---------------------------------------------------------------- health and metrics


def test_health_ready_and_metrics_on_the_http_port(server, client, clips) -> None:
    assert get(server, "/healthz") == (200, '{"status": "alive"}')
    assert get(server, "/readyz") == (200, '{"status": "ready"}')
    client.audio.transcriptions.create(model="whisper-1", file=("a.wav", clips[0][0]))
    status, text = get(server, "/metrics")
    assert status == 200
    ok = f'echoic_http_requests_total{{route="{ROUTE}",status="200"}}'
    assert ok in text
    buckets = re.findall(
        rf'echoic_http_request_duration_seconds_bucket{{le="([^"]+)",route="{ROUTE}"}}', text
    )  # noqa: E501
    grpc_buckets = re.findall(
        r'echoic_final_result_latency_seconds_bucket{le="([^"]+)",method="HTTPTranscriptions"}',
        text,
    )  # noqa: E501
    assert buckets and buckets == grpc_buckets  # the same bucket scheme
    # The same registry as the --metrics-port endpoint.
    with socket.create_connection(("127.0.0.1", server.metrics_port), timeout=TIMEOUT):
        pass
    conn = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=TIMEOUT)
    conn.request("GET", "/metrics")
    other = conn.getresponse().read().decode()
    conn.close()
    assert ok in other


def test_readyz_is_503_while_draining_like_grpc_health(clips) -> None:
    """Shutdown: /readyz and gRPC health turn at once, new transcriptions get 503, while an
    open gRPC stream finishes within its grace; /healthz stays 200."""
    with http_server() as server, grpc.insecure_channel(server.address) as channel:
        release = threading.Event()

        def held():
            yield pb.StreamingRecognizeRequest(
                streaming_config=pb.StreamingRecognitionConfig(config=RECOGNIZE)
            )
            yield pb.StreamingRecognizeRequest(audio_content=clips[0][0])
            release.wait(TIMEOUT)

        call = pb_grpc.TranscriberStub(channel).StreamingRecognize(held(), timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while metric(server, "echoic_active_streams", method="StreamingRecognize") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stopping = threading.Thread(target=server.stop, kwargs=dict(grace=TIMEOUT))
        stopping.start()
        try:
            deadline = time.monotonic() + TIMEOUT
            while get(server, "/readyz")[0] != 503:
                assert time.monotonic() < deadline, "/readyz never said draining"
                time.sleep(0.02)
            assert get(server, "/readyz") == (503, '{"status": "draining"}')
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT
            )
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert get(server, "/healthz")[0] == 200
            status, _, code, _ = _error(post_form(server, [], [("file", clips[0][0])]))
            assert (status, code) == (503, "unavailable")
        finally:
            release.set()
            results = list(call)
            stopping.join(TIMEOUT)
        assert results and results[-1].results[0].is_final


def test_http_port_0_turns_http_off() -> None:
    with BackgroundServer(ServerConfig(port=0, http_port=0, intra_op_threads=1)) as server:
        assert server.server.http_port is None and server.server.http is None


def test_https_with_the_grpc_tls_settings(certificates, clips) -> None:  # noqa: F811
    """--tls-cert/--tls-key serve HTTPS too, and --tls-client-ca requires client certificates
    there as it does for gRPC."""
    import ssl

    tls = dict(tls_cert=certificates["server.pem"], tls_key=certificates["server.key"])

    def ready(server: BackgroundServer, client_cert: bool) -> int:
        context = ssl.create_default_context(cafile=str(certificates["ca.pem"]))
        if client_cert:
            context.load_cert_chain(certificates["client.pem"], certificates["client.key"])
        conn = http.client.HTTPSConnection(*_host_port(server), timeout=TIMEOUT, context=context)
        try:
            conn.request("GET", "/readyz")
            return conn.getresponse().status
        finally:
            conn.close()

    with http_server(**tls) as server:
        assert ready(server, client_cert=False) == 200
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            get(server, "/readyz")  # plaintext to a TLS port
    with http_server(tls_client_ca=certificates["ca.pem"], **tls) as server:
        assert ready(server, client_cert=True) == 200
        with pytest.raises((ssl.SSLError, ConnectionError)):
            ready(server, client_cert=False)


# ---------------------------------------------------------------- realtime WebSocket


def _riva_args(server: BackgroundServer, **overrides) -> argparse.Namespace:
    """What Riva's realtime ASR script passes RealtimeClientASR for a file, unset flags
    at their defaults (-1 for endpointing, None elsewhere)."""
    args = dict(
        server=f"127.0.0.1:{server.server.http_port}", endpoint="/v1/realtime",
        query_params="intent=transcription", use_ssl=False, ssl_root_cert=None,
        ssl_client_cert=None, ssl_client_key=None, mint_api_key=None, mic=False,
        language_code="en-US", model_name=None, prompt=None, sample_rate_hz=16000,
        num_channels=1, max_alternatives=1, automatic_punctuation=None,
        word_time_offsets=True, profanity_filter=None, no_verbatim_transcripts=None,
        speaker_diarization=False, boosted_lm_words=None, start_history=-1,
        start_threshold=-1, stop_history=-1, stop_history_eou=-1, stop_threshold=-1,
        stop_threshold_eou=-1, custom_configuration=None,
    )  # fmt: skip
    args.update(overrides)
    return argparse.Namespace(**args)


def _stream_finals(stub, wav: bytes, formatted: bool = True) -> list[str]:
    """StreamingRecognize's finals, formatted as the realtime socket's are by default."""

    def messages():
        config = _config(formatted)
        yield pb.StreamingRecognizeRequest(
            streaming_config=pb.StreamingRecognitionConfig(config=config, interim_results=True)
        )
        for i in range(0, len(wav), 3200):
            yield pb.StreamingRecognizeRequest(audio_content=wav[i : i + 3200])

    return [
        r.results[0].alternatives[0].transcript
        for r in stub.StreamingRecognize(messages(), timeout=TIMEOUT)
        if r.results and r.results[0].is_final
    ]


def test_riva_realtime_client_unchanged_gets_streaming_recognizes_finals(
    server, stub, two_utterances, tmp_path, caplog
) -> None:
    """NVIDIA Riva's RealtimeClientASR, as its file script drives it (mint a session, the
    WebSocket with the realtime-token subprotocol, the WAV's bytes in chunks): every
    utterance's final transcript equals gRPC StreamingRecognize's on the same audio."""
    realtime = pytest.importorskip("riva.client.realtime", reason="needs nvidia-riva-client")
    from riva.client.asr import AudioChunkFileIterator

    wav = tmp_path / "two.wav"
    wav.write_bytes(two_utterances)
    want = _stream_finals(stub, two_utterances)
    assert len(want) == 2

    async def transcribe() -> str:
        client = realtime.RealtimeClientASR(_riva_args(server))
        await client.connect()
        assert client.session_config["input_audio_format"] == "none"  # the server's echo
        chunks = AudioChunkFileIterator(str(wav), 1600)
        await asyncio.gather(client.send_audio_chunks(chunks), client.receive_responses())
        await client.disconnect()
        return client.final_transcript

    with caplog.at_level(logging.INFO, logger="riva.client.realtime"):
        last = asyncio.run(transcribe())
    logged = [r.getMessage() for r in caplog.records if r.name == "riva.client.realtime"]
    finals = [m.split(": ", 1)[1] for m in logged
              if m.startswith(("Interim Transcript: ", "Final Transcript: "))]  # fmt: skip
    assert finals == want and last == want[-1]
    assert any(m.startswith("Transcript: ") for m in logged)  # deltas arrived as well


def test_realtime_mistakes_get_error_events_and_the_socket_goes_on(server, stub, clips) -> None:
    """Malformed JSON, audio before the update, an unknown event, audio after `.done`: an
    `error` event each, counted, the socket still serving; a token the server never
    minted is refused (401) before the upgrade. PCM16 audio gets StreamingRecognize's
    final transcript."""
    import aiohttp

    wav, samples = clips[0]
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    want = _stream_finals(stub, wav)
    url = server.http_url
    ws_url = url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    before = metric(server, "echoic_realtime_errors_total", code="invalid_json")

    async def session() -> list[dict]:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/realtime/transcription_sessions", json={}) as r:
                secret = (await r.json())["client_secret"]["value"]
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(ws_url, protocols=("realtime", "realtime-token.nope"))
            assert refused.value.status == 401
            protocols = ("realtime", f"realtime-token.{secret}")
            async with http.ws_connect(ws_url, protocols=protocols) as ws:
                assert ws.protocol == "realtime"
                assert (await ws.receive_json(timeout=TIMEOUT))["type"] == "conversation.created"

                async def error_code(text: str) -> str:
                    await ws.send_str(text)
                    event = await ws.receive_json(timeout=TIMEOUT)
                    assert event["type"] == "error", event
                    return event["error"]["code"]

                def append(data: bytes) -> str:
                    audio = base64.b64encode(data).decode()
                    return json.dumps({"type": "input_audio_buffer.append", "audio": audio})

                assert await error_code("{not json") == "invalid_json"
                assert await error_code(append(pcm[:3200])) == "session_not_configured"
                assert await error_code('{"type": "no.such.event"}') == "invalid_event"
                bad_decoder = {"type": "transcription_session.update", "session": {
                    "input_audio_format": "pcm16", "recognition_config": {"decoder": "viterbi"},
                }}  # fmt: skip
                assert await error_code(json.dumps(bad_decoder)) == "invalid_value"
                update = {"type": "transcription_session.update", "session": {
                    "input_audio_format": "pcm16",
                    "input_audio_params": {"sample_rate_hz": 16000, "num_channels": 1},
                }}  # fmt: skip
                await ws.send_json(update)
                updated = await ws.receive_json(timeout=TIMEOUT)
                assert updated["type"] == "transcription_session.updated"
                assert updated["session"]["input_audio_transcription"]["model"] == (
                    "echoic-en-default"
                )
                for i in range(0, len(pcm), 3200):
                    await ws.send_str(append(pcm[i : i + 3200]))
                await ws.send_json({"type": "input_audio_buffer.done"})
                events = []
                while not events or not events[-1].get("is_last_result"):
                    events.append(await ws.receive_json(timeout=TIMEOUT))
                assert await error_code(append(pcm[:3200])) == "session_done"
                return events

    events = asyncio.run(session())
    kind = "conversation.item.input_audio_transcription."
    completed = [e for e in events if e["type"] == kind + "completed"]
    assert [e["transcript"] for e in completed] == want
    deltas = [e["delta"] for e in events if e["type"] == kind + "delta"]
    assert "".join(deltas) == " ".join(_stream_finals(stub, wav, formatted=False))
    assert metric(server, "echoic_realtime_errors_total", code="invalid_json") == before + 1
    assert post_form(server, [], [("file", wav)])[0] == 200


async def _realtime_events(server: BackgroundServer, session: dict, audio: bytes) -> list[dict]:
    """One realtime socket: the session update, `audio` in 800-byte appends, done; every
    event after the update's echo (which comes first), to the last result."""
    import aiohttp

    url = server.http_url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    async with aiohttp.ClientSession() as http, http.ws_connect(url, protocols=("realtime",)) as ws:
        assert (await ws.receive_json(timeout=TIMEOUT))["type"] == "conversation.created"
        await ws.send_json({"type": "transcription_session.update", "session": session})
        events = [await ws.receive_json(timeout=TIMEOUT)]
        if events[0]["type"] == "error":
            return events
        for i in range(0, len(audio), 800):
            chunk = base64.b64encode(audio[i : i + 800]).decode()
            await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
        await ws.send_json({"type": "input_audio_buffer.done"})
        while not events[-1].get("is_last_result"):
            events.append(await ws.receive_json(timeout=TIMEOUT))
        return events


@pytest.mark.parametrize(("fmt", "subtype", "encoding"), [
    pytest.param("g711_ulaw", "ULAW", "mulaw", id="ulaw"),
    pytest.param("g711_alaw", "ALAW", "alaw", id="alaw"),
])  # fmt: skip
def test_realtime_g711_gets_the_transcript_of_its_pcm16(server, clips, fmt, subtype, encoding):
    """OpenAI's g711_ulaw and g711_alaw (8 kHz telephony) over a real socket: the server's
    decode of the bytes is soundfile's, sample for sample, and the transcripts equal the
    pcm16 path's for the same narrowband audio (soundfile's decode of the G.711, as PCM16
    at 8 kHz). A rate other than 8 kHz is an error event."""
    from echoic.server.core.audio_input import AudioInput

    narrow = soxr.resample(clips[2][1], 16000, 8000)
    buf = io.BytesIO()
    sf.write(buf, narrow, 8000, format="RAW", subtype=subtype)
    law = buf.getvalue()
    reference, _ = sf.read(io.BytesIO(law), dtype="int16", format="RAW", subtype=subtype,
                           samplerate=8000, channels=1)  # fmt: skip
    pcm = reference.astype("<i2").tobytes()

    def decoded(data: bytes, kind: str) -> np.ndarray:
        audio = AudioInput(kind, 16000, sample_rate=8000)
        return np.concatenate([*(audio.feed(data[i : i + 800]) for i in range(0, len(data), 800)),
                               audio.finish()])  # fmt: skip

    assert np.array_equal(decoded(law, encoding), decoded(pcm, "linear16"))

    def finals(session: dict, audio: bytes) -> list[str]:
        events = asyncio.run(_realtime_events(server, session, audio))
        assert events[0]["type"] == "transcription_session.updated", events[0]
        assert events[0]["session"]["input_audio_params"]["sample_rate_hz"] == 8000
        kind = "conversation.item.input_audio_transcription.completed"
        return [e["transcript"] for e in events if e["type"] == kind]

    want = finals({"input_audio_format": "pcm16", "input_audio_params": {"sample_rate_hz": 8000}},
                  pcm)  # fmt: skip
    assert any(want) and finals({"input_audio_format": fmt}, law) == want
    (error,) = asyncio.run(_realtime_events(
        server, {"input_audio_format": fmt, "input_audio_params": {"sample_rate_hz": 16000}}, law
    ))  # fmt: skip
    assert error["type"] == "error" and "8 kHz" in error["error"]["message"]


def test_a_silent_realtime_socket_is_closed_after_the_idle_timeout() -> None:
    """The `idle_timeout` error event, then a close with 1008 (policy violation), as every
    socket the server ends for a limit."""
    import aiohttp

    async def session(url: str) -> tuple[dict, aiohttp.WSMessage]:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(url, protocols=("realtime",)) as ws:
                assert (await ws.receive_json(timeout=TIMEOUT))["type"] == "conversation.created"
                error = await ws.receive_json(timeout=TIMEOUT)  # after 1 s of nothing
                return error, await ws.receive(timeout=TIMEOUT)

    with http_server(idle_timeout_seconds=1.0) as server:
        url = server.http_url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
        error, then = asyncio.run(session(url))
    assert error["type"] == "error" and error["error"]["code"] == "idle_timeout"
    assert (then.type, then.data, then.extra) == (WSMsgType.CLOSE, 1008, "idle_timeout")


def test_realtime_sockets_end_with_their_results_when_the_grace_ends(clips) -> None:
    """Shutdown: an open socket keeps going through the grace period, then gets the final
    result of the audio it sent (is_last_result) and a 1001 close; a new socket is
    refused (503) meanwhile."""
    import aiohttp

    _, samples = clips[0]
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()

    async def session(server: BackgroundServer) -> tuple[list[dict], int | None, int]:
        url = server.http_url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(url, protocols=("realtime",)) as ws:
                await ws.receive_json(timeout=TIMEOUT)  # conversation.created
                await ws.send_json({"type": "transcription_session.update", "session": {
                    "input_audio_format": "pcm16",
                    "input_audio_params": {"sample_rate_hz": 16000}}})  # fmt: skip
                await ws.receive_json(timeout=TIMEOUT)
                for i in range(0, len(pcm), 3200):  # all the audio, but no done
                    audio = base64.b64encode(pcm[i : i + 3200]).decode()
                    await ws.send_json({"type": "input_audio_buffer.append", "audio": audio})
                stopping = threading.Thread(target=server.stop, kwargs=dict(grace=0.5))
                stopping.start()
                while get(server, "/readyz")[0] != 503:
                    await asyncio.sleep(0.02)
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(url, protocols=("realtime",))
                events = []
                while not events or not events[-1].get("is_last_result"):
                    events.append(await ws.receive_json(timeout=TIMEOUT))
                closing = await ws.receive(timeout=TIMEOUT)
                await asyncio.to_thread(stopping.join, TIMEOUT)
                return events, closing.data, refused.value.status

    with http_server() as server:
        events, close_code, refused = asyncio.run(session(server))
    finals = [e["transcript"] for e in events if e["type"].endswith(".completed")]
    assert any(finals) and close_code == 1001 and refused == 503
