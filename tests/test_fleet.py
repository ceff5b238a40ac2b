"""Several servers behind one client: calls spread over all of them round robin, and a
server that drains (SIGTERM) loses nothing: its open streams get their final results,
new calls go to the others, and no call that could be retried fails."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")

from echoic.clients import Client, ClientError  # noqa: E402
from echoic.clients.client import ClientError as TargetError  # noqa: E402
from echoic.clients.client import resolve_target  # noqa: E402
from echoic.server.config import ServerConfig  # noqa: E402
from echoic.server.process.background import BackgroundServer  # noqa: E402


def _streams_served(server: BackgroundServer) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read()
    for line in text.decode().splitlines():
        if line.startswith('echoic_requests_total{code="OK",method="StreamingRecognize"}'):
            return int(float(line.split()[-1]))
    return 0


def test_targets_name_one_server_or_several() -> None:
    assert resolve_target("localhost:50051") == "localhost:50051"
    assert resolve_target("dns:///echoic-headless:50051") == "dns:///echoic-headless:50051"
    assert resolve_target("127.0.0.1:1,localhost:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert resolve_target("[::1]:1,[::1]:2") == "ipv6:[::1]:1,[::1]:2"
    for bad, says in (("a.example:1,b.example:2", "dns:///"), ("127.0.0.1,127.0.0.2:1", "PORT"),
                      ("127.0.0.1:1,[::1]:2", "not both")):  # fmt: skip
        with pytest.raises(TargetError, match=says):
            resolve_target(bad)


@pytest.mark.slow
def test_three_servers_share_the_streams_and_one_drains_without_a_failure(
    tiny_model_dir: Path, speech_corpus: Path
) -> None:
    """The figures (streams per server, calls made while server 0 drains, failed calls)
    are printed (`pytest -rP` shows them) and in every assertion's message."""
    wavs = [json.loads(line)["audio_filepath"] for line in speech_corpus.read_text().splitlines()]
    config = dict(model_dir=tiny_model_dir, port=0, http_port=0, metrics_port=0, intra_op_threads=1,
                  grace_seconds=20.0, idle_timeout_seconds=30.0)  # fmt: skip
    servers = [BackgroundServer(ServerConfig(**config)) for _ in range(3)]
    try:
        with Client(",".join(s.address for s in servers), timeout=60) as client:

            def finals(wav: str, **kw) -> list[str]:
                return [r.alternatives[0].transcript for response in
                        client.stream_file(wav, realtime=False, **kw)
                        for r in response.results if r.is_final]  # fmt: skip

            # 60 streams from one channel, six at a time.
            results: dict[int, list[str]] = {}

            def run(i: int) -> None:
                results[i] = finals(wavs[i % len(wavs)])

            for start in range(0, 60, 6):
                threads = [threading.Thread(target=run, args=(i,)) for i in range(start, start + 6)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
            assert len(results) == 60 and all(results.values())
            per_server = [_streams_served(s) for s in servers]
            assert sum(per_server) == 60 and min(per_server) >= 10, per_server

            # Server 0 drains (what SIGTERM does) while streams are open on every server
            # and a client keeps sending whole requests.
            open_results, failures = {}, []

            def slow(i: int) -> None:  # real-time pace: still open when the drain starts
                try:
                    open_results[i] = finals(wavs[i], chunk_ms=100.0)
                except ClientError as e:
                    failures.append(f"stream: {e.code}: {e}")

            openers = [threading.Thread(target=slow, args=(i,)) for i in range(6)]
            for t in openers:
                t.start()
            time.sleep(1.0)  # all six are open, two on each server
            stopping = threading.Thread(target=servers[0].stop, args=(20.0,))
            stopping.start()
            stop_requests = threading.Event()
            answered = []

            def requests() -> None:
                while not stop_requests.is_set():
                    try:
                        answered.append(client.recognize(wavs[0]).text)
                    except ClientError as e:
                        failures.append(f"recognize: {e.code}: {e}")

            requester = threading.Thread(target=requests)
            requester.start()
            time.sleep(0.5)  # health NOT_SERVING reaches the client: no new calls to it
            later = {}

            def after(i: int) -> None:
                try:
                    later[i] = finals(wavs[i])
                except ClientError as e:
                    failures.append(f"new stream: {e.code}: {e}")

            news = [threading.Thread(target=after, args=(i,)) for i in range(12)]
            for t in news:
                t.start()
            for t in [*openers, *news]:
                t.join(90)
            stop_requests.set()
            requester.join(60)
            stopping.join(60)
        recognize_failures = sum(f.startswith("recognize:") for f in failures)
        during_stop = {
            "open_streams": len(openers),  # open on every server when the drain began
            "new_streams": len(news),
            "recognize_calls": len(answered) + recognize_failures,
        }
        served_after = [_streams_served(s) for s in servers[1:]]
        # the 12 new streams and the 4 that were open there when the drain began
        after_per_server = [a - b for a, b in zip(served_after, per_server[1:], strict=True)]
        figures = dict(streams_per_server=per_server, calls_during_stop=during_stop,
                       failed_calls=len(failures),
                       streams_on_servers_1_and_2_during_stop=after_per_server)  # fmt: skip
        print(figures)
        assert not failures, (figures, failures[:5])
        assert len(open_results) == 6 and all(open_results.values()), figures  # drained
        assert len(later) == 12 and answered, figures
        assert sum(after_per_server) >= 12, figures  # the new streams went there
    finally:
        for server in servers:
            server.stop()


@pytest.mark.slow
def test_a_batch_job_spreads_over_several_servers(
    tiny_model_dir: Path, speech_corpus: Path, tmp_path: Path
) -> None:
    """`echoic transcribe --server A,B`: the files go to both servers, round robin, and
    every one is transcribed as one server alone would."""
    import subprocess
    import sys

    config = dict(model_dir=tiny_model_dir, port=0, http_port=0, metrics_port=0,
                  intra_op_threads=1)  # fmt: skip
    servers = [BackgroundServer(ServerConfig(**config)) for _ in range(2)]
    try:
        out, alone = tmp_path / "both.jsonl", tmp_path / "alone.jsonl"
        for target, output in ((",".join(s.address for s in servers), out),
                               (servers[0].address, alone)):  # fmt: skip
            run = subprocess.run(
                [sys.executable, "-m", "echoic.cli.main", "transcribe", str(speech_corpus),
                 "--server", target, "--concurrency", "4", "--output", str(output),
                 "--no-progress"],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert run.returncode == 0, run.stderr[-2000:]
        recognized = [_requests(s, "Recognize") for s in servers]
    finally:
        for server in servers:
            server.stop()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 30
    assert min(recognized[0] - 30, recognized[1]) >= 5, recognized  # both took a share
    texts = [r["pred_text"] if "pred_text" in r else r["text"] for r in rows]
    want = [json.loads(line) for line in alone.read_text().splitlines()]
    assert texts == [r["pred_text"] if "pred_text" in r else r["text"] for r in want]


def _requests(server: BackgroundServer, method: str) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read()
    prefix = f'echoic_requests_total{{code="OK",method="{method}"}}'
    for line in text.decode().splitlines():
        if line.startswith(prefix):
            return int(float(line.split()[-1]))
    return 0
