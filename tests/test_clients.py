"""echoic.clients, `echoic stream` and `echoic transcribe --server` against a real server.

The server runs in this process (`BackgroundServer`: grpc.aio on its own
event-loop thread, port 0) with the tiny exported model; the clients talk to it
over a real loopback channel.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
import soxr

from echoic.clients import AsyncClient, Client, ClientError, RetryPolicy
from echoic.clients.audio import Chunk, paced
from echoic.clients.client import Tries

pytest.importorskip("grpc_health", reason="the server needs the serve extra")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")

from echoic.server.config import ServerConfig  # noqa: E402
from echoic.server.process.background import BackgroundServer  # noqa: E402
from tests.test_server import certificates  # noqa: E402, F401 - a fixture; belongs in conftest

ECHOIC = [sys.executable, "-m", "echoic.cli.main"]
QUICK = RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ECHOIC, *args], capture_output=True, text=True, timeout=timeout)


def start_server(model_dir: Path, port: int = 0) -> BackgroundServer:
    return BackgroundServer(
        ServerConfig(model_dir=model_dir, port=port, http_port=0, max_batch=8, grace_seconds=1.0)
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    with start_server(tiny_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: BackgroundServer):
    with Client(server.address, retry=QUICK, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def recognizer(tiny_model_dir: Path):
    from echoic.model.runtime.recognizer import Recognizer

    return Recognizer(tiny_model_dir, intra_op_threads=1)


@pytest.fixture(scope="module")
def wavs(corpus_audio, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("client-wavs")
    paths = []
    for i, (_, audio) in enumerate(corpus_audio[:3]):
        sf.write(root / f"utt{i}.wav", audio, 16000, subtype="PCM_16")
        paths.append(root / f"utt{i}.wav")
    return paths


def _in_process_text(recognizer, path: Path) -> str:
    from echoic.model.core.audio import load_audio

    return recognizer.transcribe([load_audio(path, recognizer.sample_rate)])[0].text


# ------------------------------------------------------------------ Client


def test_recognize_equals_in_process_transcription(client, recognizer, wavs) -> None:
    for path in wavs:
        result = client.recognize(path)
        assert result.text == _in_process_text(recognizer, path)
        assert result.audio_seconds == pytest.approx(sf.info(path).duration, abs=1e-3)
        assert [w.text for w in result.words] == result.text.split()
        assert all(0 <= w.start <= w.end <= result.audio_seconds + 0.1 for w in result.words)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("samples", id="float-samples-44k-stereo"),
        pytest.param("aiff", id="aiff-file-decoded-by-the-client"),
        pytest.param("streamed", id="too-big-for-one-message"),
    ],
)
def test_every_way_in_gives_the_same_text(
    client, recognizer, wavs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    audio, _ = sf.read(wavs[0], dtype="float32")
    expected = _in_process_text(recognizer, wavs[0])
    if how == "samples":
        hi = soxr.resample(audio, 16000, 44100)
        got = client.recognize(np.stack([hi, hi], axis=1), sample_rate=44100)
    elif how == "aiff":
        sf.write(tmp_path / "a.aiff", audio, 16000, format="AIFF", subtype="PCM_16")
        got = client.recognize(tmp_path / "a.aiff")
    else:
        monkeypatch.setattr("echoic.clients.messages.MAX_UNARY_AUDIO_BYTES", 1000)
        monkeypatch.setattr("echoic.clients.messages.STREAM_PIECE_BYTES", 4000)
        got = client.recognize(wavs[0])
    assert got.text == expected


@pytest.mark.parametrize(
    ("fmt", "subtype"),
    [
        pytest.param("WAV", "PCM_16", id="wav"),
        pytest.param("FLAC", "PCM_16", id="flac"),
        pytest.param("OGG", "VORBIS", id="ogg"),
        pytest.param("MP3", "MPEG_LAYER_III", id="mp3"),
    ],
)
def test_every_format_gives_the_local_transcript(
    client, recognizer, corpus_audio, tmp_path: Path, fmt: str, subtype: str
) -> None:
    """The same file transcribed here and through the server, word for word and frame
    for frame. A lossy file used to reach the server as PCM16 (rounded), so its
    transcript could differ ("one too three" against "one to three")."""
    from echoic.model.core.audio import load_audio

    path = tmp_path / f"talk.{fmt.lower()}"
    hi = soxr.resample(np.concatenate([a for _, a in corpus_audio[:3]]), 16000, 44100)
    sf.write(path, np.stack([hi, 0.6 * hi], axis=1), 44100, format=fmt, subtype=subtype)
    local = recognizer.transcribe([load_audio(path, 16000)])[0]
    served = client.recognize(path, words=True)
    assert served.text == local.text
    assert [(w.text, round(w.start, 3)) for w in served.words] == [
        (w.text, round(w.start, 3)) for w in local.words
    ]
    assert served.confidence == pytest.approx(local.confidence, abs=1e-5)


def test_stream_file_final_equals_recognize(client, wavs) -> None:
    responses = list(client.stream_file(wavs[1], realtime=False, chunk_ms=80))
    finals = [r for resp in responses for r in resp.results if r.is_final]
    assert len(finals) == 1
    assert finals[0].alternatives[0].transcript == client.recognize(wavs[1]).text
    assert responses[-1].audio_processed_seconds == pytest.approx(
        sf.info(wavs[1]).duration, abs=0.1
    )


def test_list_models(client, tiny_model_dir: Path) -> None:
    (model,) = client.list_models()
    assert model.streamable and model.sample_rate_hertz == 16000
    assert model.name == "echoic-tiny" and model.path == ""  # hidden unless --expose-paths


def test_server_errors_arrive_as_client_errors(client) -> None:
    with pytest.raises(ClientError) as e:
        client.recognize(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "decode" in str(e.value)
    with pytest.raises(ClientError) as e:
        client.recognize(b"\x00\x01" * 800, encoding="linear16", sample_rate=16000, model="nope")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "nope" in str(e.value)


def test_async_client(server: BackgroundServer, wavs, client) -> None:
    async def go() -> tuple[str, str]:
        async with AsyncClient(server.address, retry=QUICK) as aclient:
            whole = await aclient.recognize(wavs[2])
            finals = [
                r.alternatives[0].transcript
                async for resp in aclient.stream_file(wavs[2], realtime=False)
                for r in resp.results
                if r.is_final
            ]
            return whole.text, " ".join(finals)

    whole, streamed = asyncio.run(go())
    assert whole == streamed == client.recognize(wavs[2]).text


def test_paced_releases_each_chunk_when_its_audio_has_happened() -> None:
    now = [100.0]
    released = []
    chunks = [Chunk(b"x", 0.1), Chunk(b"y", 0.1), Chunk(b"z", 0.05)]
    for chunk in paced(
        chunks, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    ):
        released.append((chunk.data, round(now[0] - 100.0, 6)))
    assert released == [(b"x", 0.1), (b"y", 0.2), (b"z", 0.25)]


def test_mutual_tls(tiny_model_dir: Path, certificates, wavs) -> None:  # noqa: F811
    tls = dict(tls_cert=certificates["server.pem"], tls_key=certificates["server.key"])
    config = ServerConfig(model_dir=tiny_model_dir, port=0, http_port=0,
                          tls_client_ca=certificates["ca.pem"], **tls)  # fmt: skip
    files = (("tls_ca", "ca.pem"), ("tls_cert", "client.pem"), ("tls_key", "client.key"))
    mine = {k: str(certificates[f]) for k, f in files}
    with BackgroundServer(config) as server:
        with Client(server.address, retry=QUICK, **mine) as c:
            text = c.recognize(wavs[0]).text
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in mine.items()]
        run = _run("stream", str(wavs[0]), "--server", server.address, "--fast", *flags)
        assert run.returncode == 0, run.stderr
        assert run.stdout.rstrip().endswith(f"] {text}".rstrip())
        with Client(server.address, retry=QUICK, tls_ca=mine["tls_ca"]) as no_cert:
            with pytest.raises(ClientError) as e:
                no_cert.list_models()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------ retries


def test_unary_calls_retry_until_the_server_comes_up(
    tiny_model_dir: Path, recognizer, wavs
) -> None:
    port = free_port()
    patient = RetryPolicy(attempts=100, initial_backoff=0.1, max_backoff=0.3)  # ~30 s
    outcome: dict[str, object] = {}

    def call() -> None:
        with Client(f"127.0.0.1:{port}", retry=patient, timeout=60) as c:
            try:
                outcome["text"] = c.recognize(wavs[0]).text
            except ClientError as e:  # reported below rather than lost in the thread
                outcome["error"] = e

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)  # the client is retrying: nothing listens on the port yet
    late = start_server(tiny_model_dir, port=port)
    try:
        thread.join(timeout=60)
    finally:
        late.stop()
    assert not thread.is_alive()
    assert "error" not in outcome, outcome
    assert outcome["text"] == _in_process_text(recognizer, wavs[0])


def test_retries_are_bounded(wavs) -> None:
    started = time.monotonic()
    with Client(f"127.0.0.1:{free_port()}", retry=QUICK, timeout=10) as c:
        with pytest.raises(ClientError) as e:
            c.list_models()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "unavailable" in str(e.value)
    assert time.monotonic() - started < 10


UNAVAILABLE, INVALID = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("timeout", "codes", "tries_made"),
    [
        pytest.param(None, [UNAVAILABLE] * 5, 3, id="unavailable-until-attempts-run-out"),
        pytest.param(None, [INVALID], 1, id="invalid-argument-not-retried"),
        pytest.param(None, [UNAVAILABLE, INVALID], 2, id="unavailable-then-invalid-argument"),
        pytest.param(2.0, [UNAVAILABLE] * 5, 2, id="deadline-leaves-no-room-for-a-wait"),
    ],
)
def test_tries_decide_what_the_client_loops_do(
    timeout: float | None, codes: list[grpc.StatusCode], tries_made: int
) -> None:
    """The shared retry logic with a fake clock: each try takes 0.1 s, then fails."""
    now = [0.0]
    tries = Tries(RetryPolicy(attempts=3, initial_backoff=1.0), timeout, clock=lambda: now[0])
    made, lefts = 0, []
    for code in codes:
        lefts.append(tries.time_left())
        made += 1
        now[0] += 0.1
        wait = tries.wait_after(code)
        if wait is None:
            break
        assert 0.8 * 2 ** (made - 1) <= wait <= 1.2 * 2 ** (made - 1)  # backoff, +-20 % jitter
        now[0] += wait
    assert made == tries_made
    if timeout is None:
        assert lefts == [None] * made
    else:  # each try gets what is left of the call's timeout
        assert lefts[0] == timeout and lefts == sorted(lefts, reverse=True)
        now[0] = timeout + 1
        assert tries.time_left() == 0.0


def test_a_retry_policy_makes_at_least_one_try() -> None:
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


# ------------------------------------------------------------------ echoic stream


@pytest.mark.parametrize(
    ("fmt", "encoding"),
    [
        pytest.param("WAV", [], id="decoded-to-linear16"),
        pytest.param("WAV", ["--encoding", "wav"], id="wav-bytes-as-they-are"),
        pytest.param("FLAC", ["--encoding", "flac"], id="flac-bytes-as-they-are"),
    ],
)
def test_stream_command_prints_the_final_transcript(
    server: BackgroundServer, client, wavs, tmp_path: Path, fmt: str, encoding: list[str]
) -> None:
    audio = tmp_path / f"a.{fmt.lower()}"
    sf.write(audio, sf.read(wavs[0], dtype="int16")[0], 16000, format=fmt, subtype="PCM_16")
    run = _run("stream", str(audio), "--server", server.address, "--fast", "--chunk-ms", "50",
               *encoding)  # fmt: skip
    assert run.returncode == 0, run.stderr
    text = client.recognize(wavs[0]).text
    (line,) = run.stdout.splitlines()
    assert line.startswith("[0.00-") and line.endswith(f"] {text}".rstrip())


def test_stream_command_json_lines(server: BackgroundServer, client, wavs) -> None:
    run = _run("stream", str(wavs[1]), "--server", server.address, "--fast", "--json")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    final = rows[-1]["results"][0]
    assert final["is_final"] is True and len(rows) > 1  # interim results came before it
    assert final["alternatives"][0]["transcript"] == client.recognize(wavs[1]).text
    assert rows[-1]["model"]["version"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--server", "127.0.0.1:1", "--connect-timeout", "0.5"], "unavailable",
                     id="no-server"),
        pytest.param(["--chunk-ms", "0"], "--chunk-ms", id="bad-chunk"),
    ],
)  # fmt: skip
def test_stream_command_errors_are_one_line(wavs, args: list[str], message: str) -> None:
    run = _run("stream", str(wavs[0]), "--fast", *args)
    assert run.returncode == 1
    assert message in run.stderr and "Traceback" not in run.stderr


def test_stream_command_unreadable_file(server: BackgroundServer, tmp_path: Path) -> None:
    (tmp_path / "bad.wav").write_bytes(b"not audio at all")
    run = _run("stream", str(tmp_path / "bad.wav"), "--server", server.address, "--fast")
    assert run.returncode == 1 and "bad.wav" in run.stderr and "Traceback" not in run.stderr


# ------------------------------------------------------------------ echoic transcribe --server


@pytest.fixture(scope="module")
def mixed_folder(corpus_audio, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Good files (WAV, 44.1 kHz stereo FLAC, AIFF) and three bad ones."""
    root = tmp_path_factory.mktemp("mixed-server")
    for i, (_, audio) in enumerate(corpus_audio[:2]):
        sf.write(root / f"good{i}.wav", audio, 16000, subtype="PCM_16")
    hi = soxr.resample(corpus_audio[2][1], 16000, 44100)
    sf.write(root / "stereo44k.flac", np.stack([hi, 0.5 * hi], axis=1), 44100)
    sf.write(root / "good.aiff", corpus_audio[3][1], 16000, format="AIFF", subtype="PCM_16")
    (root / "corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage" + bytes(range(50)))
    (root / "empty.wav").write_bytes(b"")
    (root / "noise.flac").write_bytes(np.random.default_rng(0).bytes(4000))
    return root


def test_transcribe_through_the_server(
    server: BackgroundServer, recognizer, mixed_folder: Path, tmp_path: Path
) -> None:
    from echoic.cli.batch_io import Item, transcript_record
    from echoic.model.core.audio import load_audio

    out = tmp_path / "out.jsonl"
    args = ["transcribe", str(mixed_folder), "--server", server.address, "--format", "jsonl",
            "--output", str(out), "--no-progress", "--concurrency", "3"]  # fmt: skip
    run = _run(*args)
    assert run.returncode == 1, run.stderr
    rows = {
        Path(r["audio_filepath"]).name: r for r in map(json.loads, out.read_text().splitlines())
    }
    bad = ["corrupt.wav", "empty.wav", "noise.flac"]
    assert sorted(n for n, r in rows.items() if "error" in r) == bad
    for name in bad:
        assert name in run.stderr and name in rows[name]["error"]
    assert "4 of 7 files" in run.stderr and "3 failed" in run.stderr
    for name in ("good0.wav", "good1.wav", "stereo44k.flac", "good.aiff"):
        path = mixed_folder / name
        audio = load_audio(path, 16000)
        transcript = recognizer.transcribe([audio])[0]
        item = Item(str(path), str(path))
        here = transcript_record(item, transcript, len(audio) / 16000, "echoic-tiny/1")
        got = rows[name]
        assert got.keys() == here.keys() and got["text"] == here["text"]
        assert got["model"] == here["model"]  # the version that answered
        assert got["duration"] == pytest.approx(here["duration"], abs=0.002)
        assert [w.keys() for w in got["words"]] == [w.keys() for w in here["words"]]
        assert [w["word"] for w in got["words"]] == [w["word"] for w in here["words"]]
    # Resumable: a second run sends nothing (the bad files failed once, recorded).
    again = _run(*args)
    assert "4 already done" in again.stderr and "3 failed before" in again.stderr
    assert again.returncode == 1 and len(out.read_text().splitlines()) == 7


def test_a_wav_cut_short_is_transcribed_with_a_warning_through_the_server(
    server: BackgroundServer, wavs, tmp_path: Path
) -> None:
    """As in a local job (tests/test_transcribe.py): the audio there is transcribed and
    the summary says the file ends early (through a server it used to say nothing)."""
    data = wavs[0].read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(data[: 44 + (len(data) - 44) // 3 // 2 * 2])
    out = tmp_path / "out.jsonl"
    run = _run("transcribe", str(cut), str(wavs[1]), "--server", server.address,
               "--output", str(out), "--no-progress", "--json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["transcribed"] == 2
    (warning,) = summary["warnings"]
    assert str(cut) in warning and "ends early" in warning and warning in run.stderr
    header_seconds = (len(data) - 44) / 2 / 16000
    assert f"header says {header_seconds:.2f} s" in warning


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--model", "nope"], "does not serve model 'nope'", id="unknown-model"),
        pytest.param(["--lm-weight", "2"], "--lm-weight", id="server-side-decoder-option"),
    ],
)
def test_transcribe_through_the_server_refuses_what_it_cannot_do(
    server: BackgroundServer, wavs, args: list[str], message: str
) -> None:
    run = _run("transcribe", str(wavs[0]), "--server", server.address, "--no-progress", *args)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("args", "decoder"),
    [
        pytest.param([], "the server's default", id="auto-alone"),
        pytest.param(["--no-lm"], "greedy", id="auto-no-lm-is-greedy-as-locally"),
        pytest.param(["--beam-size", "4"], "beam", id="a-beam-size-asks-for-beam"),
    ],
)
def test_transcribe_through_the_server_reads_no_lm_and_beam_size_under_auto(
    server: BackgroundServer, wavs, tmp_path: Path, args: list[str], decoder: str
) -> None:
    out = tmp_path / "out.jsonl"
    run = _run("transcribe", str(wavs[0]), "--server", server.address, "--output", str(out),
               "--no-progress", *args)  # fmt: skip
    assert run.returncode == 0, run.stderr
    header = json.loads(out.with_name(out.name + ".job").read_text().splitlines()[0])
    assert header["settings"]["decoder"] == decoder


def test_a_beam_size_under_auto_reaches_the_server(server: BackgroundServer, wavs) -> None:
    """The server is asked for the beam size given: one over its --max-beam-size (64 by
    default) is refused there, where auto once dropped it unsent."""
    run = _run("transcribe", str(wavs[0]), "--server", server.address, "--no-progress",
               "--beam-size", "65")  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "beam_size must be" in run.stdout + run.stderr and "Traceback" not in run.stderr


def test_transcribe_stops_when_the_server_is_unreachable(wavs) -> None:
    run = _run("transcribe", str(wavs[0]), "--server", f"127.0.0.1:{free_port()}", "--no-progress")
    assert run.returncode == 2 and "unavailable" in run.stderr and "Traceback" not in run.stderr


@pytest.fixture(scope="module")
def many_files(corpus_audio, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """48 WAVs in 8 folders: 6 utterances, each in every folder under the same names."""
    root = tmp_path_factory.mktemp("many")
    paths = []
    for folder in range(8):
        (root / f"f{folder}").mkdir()
        for i, (_, audio) in enumerate(corpus_audio[:6]):
            path = root / f"f{folder}" / f"utt{i}.wav"
            sf.write(path, audio, 16000, subtype="PCM_16")
            paths.append(path)
    return paths


@pytest.mark.slow
def test_a_busy_server_is_waited_for_not_failed(
    tiny_model_dir: Path, recognizer, many_files: list[Path], tmp_path: Path
) -> None:
    """`echoic serve --max-streams 4` and `transcribe --server --concurrency 16`: calls
    over the limit get RESOURCE_EXHAUSTED, which used to fail their files (297 of 308);
    now they are retried with backoff while the client settles to what the server admits,
    and the job ends with every file transcribed, in input order, counted retries."""
    from tests.test_server import serve_process

    want = {p.name: _in_process_text(recognizer, p) for p in many_files[:6]}
    out = tmp_path / "out.jsonl"
    with serve_process("--model", str(tiny_model_dir), "--max-streams", "4") as (_, port, _):
        run = _run("transcribe", str(many_files[0].parent.parent), "--server",
                   f"127.0.0.1:{port}", "--concurrency", "16", "--output", str(out),
                   "--no-progress", "--json", timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert (summary["transcribed"], summary["failed"]) == (48, 0), summary
    assert (f"; {summary['retries']} retries" in run.stderr) == (summary["retries"] > 0)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["audio_filepath"] for r in rows] == [str(p) for p in many_files]
    assert all(r["text"] == want[Path(r["audio_filepath"]).name] for r in rows)


@pytest.mark.slow
def test_an_interrupted_server_job_exits_130_and_resumes(
    tiny_model_dir: Path, wavs: list[Path], tmp_path: Path
) -> None:
    """SIGINT while the job waits for a full server (its one slot held by a stream):
    exit 130 at once (the retrying workers stop), the summary says so, the lock goes
    with the process, and the rerun transcribes every file once."""
    import signal

    from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc
    from tests.conftest import sigint_deliverable
    from tests.test_server import _held_stream, channel_to, running, wait_until

    out = tmp_path / "out.jsonl"
    job = [*ECHOIC, "transcribe", *map(str, wavs), "--output", str(out), "--no-progress"]
    # The held stream sends nothing while the job starts: the idle limit must outlast a
    # slow start, or the slot frees and the job finishes with nothing refused.
    with running(tiny_model_dir, max_streams=1, idle_timeout_seconds=300.0) as srv, \
            channel_to(srv) as channel:  # fmt: skip
        release, responses, errors = threading.Event(), [], []
        held = _held_stream(pb_grpc.TranscriberStub(channel), release, responses, errors)
        wait_until(lambda: srv.server.service.active == 1, what="the held stream")
        registry = srv.server.metrics.registry
        labels = {"method": "Recognize", "code": "RESOURCE_EXHAUSTED"}
        with sigint_deliverable():
            process = subprocess.Popen([*job, "--server", srv.address],
                                       stderr=subprocess.PIPE, text=True)  # fmt: skip

        def refused_twice() -> bool:
            assert process.poll() is None, f"the job ended first: {process.communicate()[1]}"
            return (registry.get_sample_value("echoic_requests_total", labels) or 0) >= 2

        try:
            wait_until(refused_twice, timeout=60, what="refused calls")
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()  # and its pipe closed, whatever failed
            release.set()
            held.join(30)
        assert errors == []  # the held stream held the slot throughout
        assert process.returncode == 130, err
        assert "interrupted (rerun to go on)" in err and "Traceback" not in err
        rerun = _run(*job[3:], "--server", srv.address, "--json")
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["transcribed"] == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["audio_filepath"] for r in rows] == [str(p) for p in wavs]


def test_adaptive_limit_follows_what_the_server_admits() -> None:
    """A refusal lowers the limit to the calls the server still holds; a window of
    successes raises it by one, never above the ceiling."""
    from echoic.cli.transcribe_server import AdaptiveLimit

    limit = AdaptiveLimit(16)
    for _ in range(16):
        limit.acquire()  # 16 in flight: the ceiling, nothing blocks
    limit.release(refused=True)  # the server held the 15 others? fewer: 4 answered first
    for _ in range(11):
        limit.release(refused=True)
    assert (limit.in_flight, limit.limit) == (4, 4)
    for _ in range(4):
        limit.release(refused=False)
    assert limit.limit == 5 and limit.lowest == 4
    for _ in range(200):
        limit.acquire()
        limit.release(refused=False)
    assert limit.limit == 16  # back up, and no further


# ------------------------------------------------------------------ boundaries


def test_client_side_modules_import_no_torch_or_onnxruntime() -> None:
    code = (
        "import sys, echoic.clients, echoic.cli.transcribe_server, echoic.cli.stream\n"
        "heavy = ('torch', 'onnxruntime', 'echoic.model', 'echoic.server')\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(heavy))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == ""
