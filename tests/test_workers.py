"""`echoic serve --workers 2`: a real supervisor and its real worker processes on real
ports, the bundled model, synthesized speech. Connections, not calls, are spread over
the workers, so every client here has a connection of its own (`own_connection`)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
pytest.importorskip("prometheus_client", reason="the server needs the serve extra")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from echoic.cli.main import main  # noqa: E402
from echoic.clients import Client  # noqa: E402
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from tests.test_server import RPC_TIMEOUT, serve_process, wait_until  # noqa: E402

READY = r"listening on 127\.0\.0\.1:(\d+) \(plaintext\), 2 workers"  # the supervisor's line
STREAMS = 16  # connections in a spreading test: all on one of two workers has odds 2**-15


@contextmanager
def two_workers(*flags: str) -> Iterator[tuple[subprocess.Popen, int, list[str]]]:
    """`echoic serve --workers 2 FLAGS` once every worker serves: (the supervisor, the
    port, its log lines, every worker's included); drained with SIGTERM if still running."""
    with serve_process("--workers", "2", *flags, listening=READY) as (process, port, log):
        try:
            yield process, port, log
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)


def metrics_port(log: list[str]) -> int:
    (port,) = re.findall(r"2 workers.*metrics on :(\d+)", "".join(log))
    return int(port)


def scrape(port: int, name: str, **labels: str) -> dict[str, float]:
    """The samples called `name` with `labels` in one scrape of the supervisor's
    --metrics-port, by their `worker` label ("" for the supervisor's own)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels.get("worker", ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    }


def worker_pids(log: list[str]) -> dict[int, int]:
    """Each worker's pid, as the supervisor last logged it."""
    found = re.findall(r"worker (\d) serving \(pid (\d+)\)", "".join(log))
    return {int(i): int(pid) for i, pid in found}


def client(port: int) -> Client:
    return Client(f"127.0.0.1:{port}", own_connection=True, timeout=RPC_TIMEOUT)


def transcript(port: int, path: Path) -> str:
    """The final transcripts of `path` streamed (as fast as the server takes it) over a
    connection of its own."""
    with client(port) as c:
        return final_text(c.stream_file(path, realtime=False, interim_results=False))


def final_text(responses) -> str:
    """The final transcripts of a stream's responses, joined."""
    finals = [r for response in responses for r in response.results if r.is_final]
    return " ".join(r.alternatives[0].transcript for r in finals)


@pytest.fixture(scope="module")
def wavs(speech_corpus: Path) -> list[Path]:
    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()][:4]
    return [speech_corpus.parent / row["audio_filepath"] for row in rows]


@pytest.fixture(scope="module")
def workers2() -> Iterator[tuple[subprocess.Popen, int, list[str]]]:
    """One `--workers 2` server with metrics, on the session's default repository (the
    bundled model), shared by the tests that leave it as they found it."""
    from tests.test_clients import free_port

    with two_workers("--metrics-port", "0", "--http-port", str(free_port())) as started:
        yield started


# ---------------------------------------------------------------- serving


@pytest.mark.slow
def test_connections_land_on_both_workers_with_one_workers_transcripts(
    workers2, wavs: list[Path], default_serve: tuple[int, int]
) -> None:
    """16 streams, each on its own connection: both workers take some (the metrics'
    worker label says which), and every transcript is what one server process gives."""
    _, port, log = workers2
    one_process, _ = default_serve  # `echoic serve` as it runs by default: one process
    expected = [transcript(one_process, wav) for wav in wavs]
    assert all(expected), expected
    jobs = [wavs[i % len(wavs)] for i in range(STREAMS)]
    before = scrape(metrics_port(log), "echoic_requests_total", method="StreamingRecognize")
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda wav: transcript(port, wav), jobs))
    assert got == [expected[i % len(wavs)] for i in range(STREAMS)]
    after = scrape(metrics_port(log), "echoic_requests_total", method="StreamingRecognize",
                   code="OK")  # fmt: skip
    per_worker = {w: after[w] - before.get(w, 0.0) for w in after}
    assert set(per_worker) == {"1", "2"} and all(n >= 1 for n in per_worker.values()), per_worker
    assert sum(per_worker.values()) == STREAMS
    assert scrape(metrics_port(log), "echoic_workers_serving") == {"": 2.0}


@pytest.mark.slow
def test_the_http_door_is_shared_too(workers2) -> None:
    """The HTTP port is the workers' too: requests on connections of their own reach
    both, and each answers /readyz for itself."""
    import urllib.request

    _, _, log = workers2
    (http_port,) = re.findall(r"2 workers, HTTP on :(\d+)", "".join(log))
    metrics = metrics_port(log)
    before = scrape(metrics, "echoic_http_requests_total", route="/readyz")
    for _ in range(STREAMS):  # urllib: a new connection per request
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=10) as r:
            assert r.status == 200
    after = scrape(metrics, "echoic_http_requests_total", route="/readyz", status="200")
    per_worker = {w: after[w] - before.get(w, 0.0) for w in after}
    assert set(per_worker) == {"1", "2"} and sum(per_worker.values()) == STREAMS, per_worker


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-process", "another-supervisor"])
def test_a_second_server_on_the_workers_port_is_refused(workers2, workers: str) -> None:
    """The workers share their port with each other only: neither a plain `echoic serve`
    nor another `--workers` supervisor gets in beside them."""
    _, port, _ = workers2
    result = subprocess.run(
        [sys.executable, "-m", "echoic.cli.main", "serve", "--workers", workers,
         "--port", str(port), "--http-port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert f"echoic serve: error: cannot listen on 127.0.0.1:{port}" in result.stderr


# ---------------------------------------------------------------- signals and deaths


@pytest.mark.slow
def test_sigterm_drains_every_workers_open_streams(wavs: list[Path]) -> None:
    """SIGTERM to the supervisor with streams open on both workers: every worker drains,
    every stream ends with its whole transcript, none fails, and the supervisor exits 0."""
    import soundfile as sf

    with two_workers("--metrics-port", "0", "--grace-seconds", "20") as (process, port, log):
        expected = [transcript(port, wav) for wav in wavs]
        release = threading.Event()
        pcm = [sf.read(wav, dtype="int16")[0].tobytes() for wav in wavs]

        def held(i: int) -> str:
            """Half of a file, then (after the SIGTERM) the rest; its final transcripts."""
            audio = pcm[i % len(wavs)]
            half = len(audio) // 2 // 3200 * 3200

            def chunks() -> Iterator[bytes]:
                for at in range(0, len(audio), 3200):
                    if at == half:
                        assert release.wait(RPC_TIMEOUT), "the test never released the stream"
                    yield audio[at : at + 3200]

            with client(port) as c:
                return final_text(c.stream(chunks(), sample_rate=16000, interim_results=False))

        with ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(held, i) for i in range(STREAMS)]
            try:
                drain_with_streams_open(process, metrics_port(log), log)
            finally:
                release.set()  # the streams go on: the rest of their audio
            got = [f.result(timeout=RPC_TIMEOUT) for f in futures]
        assert got == [expected[i % len(wavs)] for i in range(STREAMS)]
        assert process.wait(timeout=60) == 0
    assert any("SIGTERM: draining every worker's open streams for up to 20 s" in x for x in log)


def drain_with_streams_open(process: subprocess.Popen, metrics: int, log: list[str]) -> None:
    """Once all STREAMS streams are open, on both workers: SIGTERM, and every worker drains
    while the supervisor waits."""

    def open_streams() -> dict[str, float]:
        return scrape(metrics, "echoic_active_streams", method="StreamingRecognize")

    wait_until(lambda: sum(open_streams().values()) == STREAMS, timeout=60,
               what="every stream to be open")  # fmt: skip
    assert all(n >= 1 for n in open_streams().values()), open_streams()
    process.send_signal(signal.SIGTERM)
    for i in (1, 2):
        wait_until(lambda i=i: any(f"[worker {i}]: SIGTERM: draining" in x for x in log),
                   what=f"worker {i} to drain")  # fmt: skip
    assert process.poll() is None, "the supervisor exited with streams open"


@pytest.mark.slow
def test_sighup_reaches_every_worker(tmp_path: Path) -> None:
    """With polling off, a version published into the repository is loaded by every
    worker on one SIGHUP to the supervisor."""
    import shutil

    from echoic.model.runtime.recognizer import default_model_dir

    repo = tmp_path / "repo"
    shutil.copytree(default_model_dir(), repo / "en" / "1")
    with two_workers("--model-repo", str(repo), "--poll-seconds", "0") as (process, port, log):
        shutil.copytree(default_model_dir(), repo / "en" / "2")
        process.send_signal(signal.SIGHUP)
        for i in (1, 2):
            wait_until(
                lambda i=i: any(f"[worker {i}]: serving en version 2" in x for x in log),
                timeout=60, what=f"worker {i} to serve version 2",
            )  # fmt: skip
        for _ in range(8):  # connections of their own, over both workers
            with grpc.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
            ) as channel:
                models = (
                    pb_grpc.TranscriberStub(channel)
                    .ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT)
                    .models
                )
                loaded = [m.version for m in models if m.state == pb.ModelInfo.LOADED]
                assert loaded == ["2"]
        assert process.poll() is None
    assert sum("SIGHUP: rescanning the model repository" in x for x in log) == 2, log


@pytest.mark.slow
def test_a_killed_worker_comes_back_while_the_other_serves(wavs: list[Path]) -> None:
    """kill -9 of one worker: the supervisor logs it and starts it again after its
    backoff; new connections in the meantime reach the other worker and succeed."""
    with two_workers("--metrics-port", "0") as (process, port, log):
        expected = transcript(port, wavs[0])
        victim = worker_pids(log)[1]
        os.kill(victim, signal.SIGKILL)
        died = f"worker 1 (pid {victim}) was killed by SIGKILL; starting it again in 1 s"
        wait_until(lambda: any(died in x for x in log), what="the death to be logged")
        # During the backoff (and the new worker's start) worker 2 serves alone.
        meanwhile = [transcript(port, wavs[0]) for _ in range(3)]
        assert meanwhile == [expected] * 3
        wait_until(lambda: worker_pids(log)[1] != victim, timeout=60, what="worker 1 again")
        mport = metrics_port(log)
        assert scrape(mport, "echoic_worker_restarts_total") == {"1": 1.0, "2": 0.0}
        assert scrape(mport, "echoic_workers_serving") == {"": 2.0}
        assert transcript(port, wavs[0]) == expected
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def engine_processes() -> dict[int, tuple[int, str]]:
    """Every engine process serving at a shared socket: pid -> (its parent, the socket)."""
    from echoic.server.core.engine_process import CHILD_MODULE

    found: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        try:
            words = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if CHILD_MODULE in words and "--listen" in words:
            found[int(entry)] = (parent, words[words.index("--listen") + 1])
    return found


def shared_engines(log: list[str], socket: str = "") -> set[int]:
    """The engine processes the workers of this supervisor share: the ones a worker started,
    and any at `socket` (one whose starter died lives on, reparented)."""
    workers = set(worker_pids(log).values())
    return {pid for pid, (parent, path) in engine_processes().items()
            if parent in workers or path == socket}  # fmt: skip


@pytest.mark.slow
def test_the_workers_share_one_engine_process_that_outlives_any_one_of_them(
    wavs: list[Path],
) -> None:
    """With engine processes, the workers of one supervisor share one per model version
    (its batches take every worker's streams): streams through both workers are served by
    it; kill -9 of it, and the two workers go on with one new one; kill -9 of the worker
    that started it, and it serves on for the other, which the restarted worker joins; it
    ends with the server."""
    with two_workers("--engine", "process", "--metrics-port", "0") as (process, port, log):
        expected = transcript(port, wavs[0])
        (engine,) = shared_engines(log)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda _: transcript(port, wavs[0]), range(STREAMS)))
        assert got == [expected] * STREAMS
        served = scrape(metrics_port(log), "echoic_requests_total", code="OK",
                        method="StreamingRecognize")  # fmt: skip
        assert set(served) == {"1", "2"}, served  # both workers' streams, one engine
        assert shared_engines(log) == {engine}

        os.kill(engine, signal.SIGKILL)
        new = "a new engine process (pid"
        wait_until(lambda: sum(new in line for line in log) == 2, timeout=60,
                   what="both workers on a new engine process")  # fmt: skip
        (engine,) = shared_engines(log)
        assert [transcript(port, wavs[0]) for _ in range(4)] == [expected] * 4
        starts_at = engine_processes()[engine][1]

        starter = {pid: i for i, pid in worker_pids(log).items()}[
            int(Path(f"/proc/{engine}/stat").read_text().rsplit(")", 1)[1].split()[1])
        ]
        victim = worker_pids(log)[starter]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: worker_pids(log)[starter] != victim, timeout=60,
                   what="the worker that started the engine, again")  # fmt: skip
        assert shared_engines(log, starts_at) == {engine}  # the same process, both again
        assert [transcript(port, wavs[0]) for _ in range(4)] == [expected] * 4
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    wait_until(lambda: not Path(f"/proc/{engine}").exists()
               or "Z" in Path(f"/proc/{engine}/stat").read_text().rsplit(")", 1)[1][:3],
               what="the engine process to end with the server")  # fmt: skip


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-process", "workers"])
@pytest.mark.parametrize("flag", ["--port", "--http-port"], ids=["grpc-port", "http-port"])
def test_a_port_another_program_holds_is_an_error(flag: str, workers: str) -> None:
    """One line naming the port and the flag to change, before any model loads."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        ports = {"--port": "0", "--http-port": "0", flag: str(taken)}
        result = subprocess.run(
            [sys.executable, "-m", "echoic.cli.main", "serve", "--workers", workers,
             "--log-level", "info", *(x for kv in ports.items() for x in kv)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    what = "cannot listen on" if flag == "--port" else "cannot serve HTTP on"
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"echoic serve: error: {what} 127.0.0.1:{taken}: Address already in use (another "
        f"server there?): stop it, or pass {flag} PORT (0 = any free port)"
    )
    assert "loading" not in result.stderr, "workers started on a port that was not free"


def test_a_restart_that_fails_leaves_the_other_worker_serving(
    tmp_path: Path, wavs: list[Path]
) -> None:
    """A worker that served, died, and cannot start again (its model is gone from the
    repository) does not stop the server: the other worker serves on, the supervisor
    tries again after each backoff, and the worker is back once the model is."""
    import shutil

    from echoic.model.runtime.recognizer import default_model_dir

    repo = tmp_path / "repo"
    shutil.copytree(default_model_dir(), repo / "en" / "1")
    flags = ("--model-repo", str(repo), "--poll-seconds", "0")
    with two_workers(*flags) as (process, port, log):
        expected = transcript(port, wavs[0])
        shutil.move(repo / "en", tmp_path / "away")
        victim = worker_pids(log)[1]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: any("worker 1 did not start again" in x for x in log),
                   timeout=60, what="the failed restart to be logged")  # fmt: skip
        assert process.poll() is None
        assert [transcript(port, wavs[0]) for _ in range(3)] == [expected] * 3
        shutil.move(tmp_path / "away", repo / "en")
        wait_until(lambda: worker_pids(log)[1] != victim, timeout=90, what="worker 1 again")
        assert transcript(port, wavs[0]) == expected


def test_a_worker_that_cannot_start_stops_them_all(tmp_path: Path) -> None:
    """A bad model fails every worker at start: the supervisor stops with that error
    (one line, exit 1) instead of starting them again and again."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.onnx").write_bytes(b"not a graph")
    result = subprocess.run(
        [sys.executable, "-m", "echoic.cli.main", "serve", "--workers", "2", "--model",
         str(bad), "--port", "0", "--http-port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"echoic serve: error: {bad / 'model.onnx'}: not a loadable ONNX model")
    assert "starting it again" not in result.stderr


def test_zero_workers_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--workers", "0"]) == 1
    assert capsys.readouterr().err == (
        "echoic serve: error: workers must be >= 1 (server processes; 1 = this one)\n"
    )
