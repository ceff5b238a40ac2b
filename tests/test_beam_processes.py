"""Beam searches in decoder processes of their own (`echoic serve --beam-processes N`):
the same results as in the server's own threads, and a process's life and death."""

from __future__ import annotations

import os
import signal
import threading

import grpc
import numpy as np
import pytest

pytest.importorskip("grpc")
pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")

from echoic.model.runtime.recognizer import default_model_dir  # noqa: E402
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from echoic.server.config import ServerError  # noqa: E402
from echoic.server.core.beam_processes import BeamProcesses  # noqa: E402

from .test_server import (  # noqa: E402
    GREEDY,
    RPC_TIMEOUT,
    Code,
    Config,
    channel_to,
    linear16,
    pcm16,
    recognize,
    running,
    serve_process,
    stream,
    stream_messages,
    wait_until,
)

BEAM = pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=16)  # with the bundled LM


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a child of this process that has exited but not been reaped is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def speech(corpus_audio) -> bytes:
    """Two corpus utterances with 1.2 s of silence between them, as LINEAR16 bytes: one
    stream, two utterances when endpointing is on."""
    gap = np.zeros(int(1.2 * 16000), np.float32)
    return pcm16(np.concatenate([corpus_audio[0][1], gap, corpus_audio[3][1]]))


def _requests(speech: bytes) -> list[tuple[str, Config, bool]]:
    boosted = pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=16)
    boosted.boosts.add(words=["zebra", "quantum"], boost=6.0)
    words = dict(enable_word_time_offsets=True, max_alternatives=3)
    endpointed = pb.EndpointingConfig(trailing_silence_ms=600)
    return [
        ("beam", linear16(decoder=BEAM, **words), True),
        ("endpointed", linear16(decoder=BEAM, endpointing=endpointed, **words), True),
        ("boosted", linear16(decoder=boosted, **words), False),
        ("no-lm", linear16(decoder=pb.DecoderConfig(kind=pb.DecoderConfig.BEAM,
                                                    disable_lm=True), **words), False),
    ]  # fmt: skip


def _everything(server, speech: bytes) -> dict[str, list]:
    """Every request of `_requests`, streamed (interim results on) and recognized whole."""
    out = {}
    with channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        for name, config, interim in _requests(speech):
            responses = stream(stub, speech, config, interim=interim)
            out[name + " streamed"] = [r.results for r in responses]
            out[name + " whole"] = recognize(stub, speech, config).results
    return out


def test_decoder_processes_give_the_in_process_results_bit_for_bit(speech) -> None:
    """The bundled model and LM: transcripts, words, times, confidences, stability and
    n-best alternatives of streams (endpointed, boosted, without the LM) and of whole
    requests are the same whether the beam searches run in two decoder processes or in
    the server's own threads."""
    model = default_model_dir()
    # The server's own decoder processes, beside a thread engine (an engine process
    # starts its own: server/core/engine_process.py).
    with running(model, engine="thread", beam_processes=0) as server:
        assert server.server.beam_processes is None
        want = _everything(server, speech)
    with running(model, beam_processes=2, engine="thread") as server:
        pids = server.server.beam_processes.pids
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        got = _everything(server, speech)
    assert got == want
    finals = [r for r in want["endpointed streamed"] if r and r[0].is_final]
    assert len(finals) == 2 and all(r[0].alternatives[0].words for r in finals)
    assert len(want["beam whole"][0].alternatives) > 1
    assert not any(_alive(p) for p in pids), "the decoder processes outlived the server"


def test_a_killed_decoder_process_fails_only_its_streams(speech) -> None:
    """kill -9 of the decoder process: the stream it held ends UNAVAILABLE with a sentence
    saying so; a greedy stream open meanwhile is untouched, and the next beam stream
    gets a new process and its usual result."""
    release = threading.Event()
    with (
        running(default_model_dir(), beam_processes=1, engine="thread") as server,
        channel_to(server) as ch,
    ):
        stub = pb_grpc.TranscriberStub(ch)
        want = stream(stub, speech, linear16(decoder=BEAM))
        (pid,) = server.server.beam_processes.pids
        half = len(speech) // 2 // 3200 * 3200
        beam = stub.StreamingRecognize(
            stream_messages(speech, linear16(decoder=BEAM), interim=True, pause=(half, release)),
            timeout=RPC_TIMEOUT,
        )
        greedy = stub.StreamingRecognize(
            stream_messages(speech, linear16(decoder=GREEDY), pause=(half, release)),
            timeout=RPC_TIMEOUT,
        )
        assert next(beam).results  # an interim result: the process is decoding it
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid) or _reaped(pid), what="the process to die")
        release.set()
        with pytest.raises(grpc.RpcError) as e:
            list(beam)
        assert e.value.code() == Code.UNAVAILABLE
        assert "decoder process 1" in e.value.details() and "killed by signal 9" in (
            e.value.details()
        )
        assert [r for r in greedy if r.results][-1].results[0].is_final
        assert stream(stub, speech, linear16(decoder=BEAM)) == want
        (new_pid,) = server.server.beam_processes.pids
        assert new_pid != pid and _alive(new_pid)
    assert not _alive(new_pid)


def _reaped(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def test_decoder_processes_decode_through_a_sigterm_drain_then_end(speech) -> None:
    """`echoic serve --beam-processes 2` and SIGTERM (to the whole process group, as a
    terminal or a container runtime may send it): a beam stream open then still gets its
    usual final result during the drain, and the decoder processes end with the server."""
    flags = ["--model", str(default_model_dir()), "--beam-processes", "2", "--grace-seconds", "20",
             "--engine", "thread"]  # fmt: skip
    release = threading.Event()
    with serve_process(*flags) as (process, port, log):
        children = _children(process.pid)
        assert len(children) == 2, log
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TranscriberStub(channel)
            want = stream(stub, speech, linear16(decoder=BEAM))
            half = len(speech) // 2 // 3200 * 3200
            beam = stub.StreamingRecognize(
                stream_messages(speech, linear16(decoder=BEAM), interim=True,
                                pause=(half, release)),
                timeout=RPC_TIMEOUT,
            )  # fmt: skip
            assert next(beam).results
            for pid in (process.pid, *children):  # SIGTERM is the server's to act on
                os.kill(pid, signal.SIGTERM)
            wait_until(lambda: any("draining" in line for line in log), what="the drain")
            assert all(_alive(pid) for pid in children)
            release.set()
            got = list(beam)
        assert [r for r in got if r.results][-1] == want[-1]
        assert process.wait(30) == 0, "".join(log)
    wait_until(lambda: not any(_alive(p) for p in children), what="the decoder processes to end")


def _children(pid: int) -> list[int]:
    """The processes `pid` started (from any of its threads)."""
    from pathlib import Path

    tasks = Path(f"/proc/{pid}/task").glob("*/children")
    return sorted(int(p) for task in tasks for p in task.read_text().split())


@pytest.mark.parametrize(
    ("processes", "error"),
    [pytest.param(-2, "beam_processes must be >= -1", id="negative")],
)
def test_a_bad_process_count_is_refused(processes: int, error: str) -> None:
    from echoic.server.config import ServerConfig

    with pytest.raises(ServerError, match=error):
        ServerConfig(beam_processes=processes)


def test_by_default_there_is_a_decoder_process_per_core(monkeypatch) -> None:
    """-1, the default: one per core for an engine process (it serves every worker) and
    for one server process with its engine in a thread; with --engine thread and
    --workers, each worker gets its share of the cores."""
    from echoic.server import config
    from echoic.server.config import ServerConfig

    monkeypatch.setattr(config, "_cores", lambda: 4)
    assert ServerConfig().beam_processes == -1
    assert ServerConfig().beam_decoder_processes == 4
    assert ServerConfig(engine="thread").beam_decoder_processes == 4
    assert ServerConfig(engine="thread", workers=2).beam_decoder_processes == 2
    assert ServerConfig(engine="thread", workers=8).beam_decoder_processes == 1
    assert ServerConfig(engine="process", workers=2).beam_decoder_processes == 4
    assert ServerConfig(beam_processes=0).beam_decoder_processes == 0
    assert ServerConfig(beam_processes=3, workers=2).beam_decoder_processes == 3
    # what each worker of a supervisor is given: the count made with --workers known
    from echoic.server.process.workers import worker_settings

    for engine, each in (("thread", 2), ("process", 4)):
        worker = worker_settings(ServerConfig(engine=engine, workers=2), 50051, 0, "/tmp")
        assert (worker.workers, worker.beam_decoder_processes) == (1, each)
    monkeypatch.setattr(config, "_cores", lambda: 64)  # and at most 8 of them
    assert ServerConfig().beam_decoder_processes == 8
    monkeypatch.setattr(config, "_cores", lambda: 4)
    with running(default_model_dir(), engine="thread") as server:
        assert len(server.server.beam_processes.pids) == 4


@pytest.mark.parametrize(
    ("files", "cores"),
    [
        pytest.param({"cpu.max": "200000 100000\n"}, 2, id="v2-two-cpus"),
        pytest.param({"cpu.max": "150000 100000\n"}, 2, id="v2-one-and-a-half"),
        pytest.param({"cpu.max": "50000 100000\n"}, 1, id="v2-half-a-cpu"),
        pytest.param({"cpu.max": "max 100000\n"}, 64, id="v2-no-limit"),
        pytest.param(
            {"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"},
            3,
            id="v1-three-cpus",
        ),
        pytest.param(
            {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
            64,
            id="v1-no-limit",
        ),
        pytest.param({}, 64, id="no-cgroup-files"),
    ],
)
def test_the_cores_counted_are_no_more_than_the_containers_cpu_limit(
    tmp_path, monkeypatch, files: dict[str, str], cores: int
) -> None:
    """A pod limited to 2 CPUs on a 64-core node gets 2 batch lanes and 2 decoder
    processes (each holding the LM: 64 of them would not fit its memory), not 64."""
    from echoic.server import config
    from echoic.server.config import ServerConfig

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(config, "CGROUP", tmp_path)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert config._cores() == cores
    assert ServerConfig().lanes == cores
    assert ServerConfig().beam_decoder_processes == min(cores, 8)


def test_a_decoder_config_the_model_cannot_spell_is_refused_before_any_process() -> None:
    """A boosted word outside the vocabulary is refused as the in-process decoder refuses
    it (INVALID_ARGUMENT), not as a failure in a decoder process."""
    bad = pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=4)
    bad.boosts.add(words=["привет"], boost=5.0)
    tone = pcm16(0.1 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 440).astype(np.float32))
    with running(default_model_dir(), beam_processes=1) as server, channel_to(server) as ch:
        stub = pb_grpc.TranscriberStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            recognize(stub, tone, linear16(decoder=bad))
        assert e.value.code() == Code.INVALID_ARGUMENT
        assert "outside the vocabulary" in e.value.details()


def test_the_pool_ends_its_processes_when_closed() -> None:
    pool = BeamProcesses(2)
    pids = pool.pids
    assert all(_alive(p) for p in pids)
    pool.close()
    assert not any(_alive(p) for p in pids)
