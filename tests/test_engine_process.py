"""The engine in a process of its own (`echoic serve --engine process`): the thread
engine's results bit for bit, and the process's life and death."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

pytest.importorskip("grpc")

from echoic.model.runtime.engine import ModelError  # noqa: E402
from echoic.model.runtime.recognizer import default_model_dir  # noqa: E402
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from echoic.server.core.engine_process import EngineProcess, EngineSpec  # noqa: E402

from .test_beam_processes import _alive, _everything, _reaped  # noqa: E402
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
    stream,
    stream_messages,
    wait_until,
)


@pytest.fixture(scope="module")
def speech(corpus_audio) -> bytes:
    """Two corpus utterances with 1.2 s of silence between them, as LINEAR16 bytes."""
    gap = np.zeros(int(1.2 * 16000), np.float32)
    return pcm16(np.concatenate([corpus_audio[0][1], gap, corpus_audio[3][1]]))


def _engines(server) -> list[EngineProcess]:
    engines = [m.dispatcher for m in server.server.registry.loaded]
    assert engines and all(isinstance(e, EngineProcess) for e in engines)
    return engines


def _spec(**kw: str) -> EngineSpec:
    """The bundled model's engine on one ONNX Runtime thread, one lane, up to 64 a batch."""
    return EngineSpec(
        default_model_dir(), ("CPUExecutionProvider",), 1, False, False, None, 64, 1, 1, 0, **kw
    )  # fmt: skip


def _batches(metrics) -> float:  # noqa: ANN001 - a Metrics
    """Batches run so far for the model labelled ("m", "1"): model calls."""
    labels = {"model": "m", "version": "1"}
    return metrics.registry.get_sample_value("echoic_batch_size_count", labels) or 0.0


def _greedy_streams(server, speech: bytes) -> dict[str, list]:
    """Greedy streams with every interim result (interval 0) in pieces that do not line
    up with the model's windows: a stream that asked for its steps late would give fewer
    or later interim results."""
    words = dict(enable_word_time_offsets=True)
    endpointed = pb.EndpointingConfig(trailing_silence_ms=600, max_utterance_ms=2500)
    out = {}
    with channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        for chunk in (1000, 3200, 12346):
            for name, config in (
                ("greedy", linear16(decoder=GREEDY, **words)),
                ("endpointed", linear16(decoder=GREEDY, endpointing=endpointed, **words)),
            ):
                responses = stream(stub, speech, config, interim=True, chunk=chunk)
                out[f"{name} {chunk}"] = [r.results for r in responses]
        out["whole"] = recognize(stub, speech, linear16(decoder=GREEDY, **words)).results
        # a whole file of several 30 s windows, each window's features computed beside
        # the batches (in the engine process: with the window's step)
        long = speech * (1 + int(70 * 32000 / len(speech)))
        out["whole long"] = recognize(stub, long, linear16(decoder=GREEDY, **words)).results
    return out


def test_the_engine_process_gives_the_thread_engines_results_bit_for_bit(speech) -> None:
    """The bundled model and LM: every interim and final result of greedy streams (cut by
    endpoints or not, in pieces of several sizes), and of beam streams and whole requests
    (endpointed, boosted, n-best, without the LM) is the same whether the engine runs in a
    thread of the server or in a process of its own."""
    model = default_model_dir()
    with running(model) as server:
        want = _greedy_streams(server, speech) | _everything(server, speech)
    with running(model, engine="process") as server:
        (engine,) = _engines(server)
        pid = engine.pid
        assert pid != os.getpid() and _alive(pid)
        got = _greedy_streams(server, speech) | _everything(server, speech)
        assert _engines(server)[0].pid == pid, "the engine process restarted"
    assert got == want
    interims = [r for r in want["greedy 1000"] if r and not r[0].is_final]
    assert len(interims) > 5
    assert not _alive(pid), "the engine process outlived the server"


def test_a_killed_engine_process_fails_its_streams_then_serves_again(speech) -> None:
    """kill -9 of the engine process: a stream open on it ends UNAVAILABLE with a sentence
    saying what happened; a new process starts, and the next stream gets its usual result."""
    release = threading.Event()
    with running(default_model_dir(), engine="process") as server, channel_to(server) as ch:
        stub = pb_grpc.TranscriberStub(ch)
        config = linear16(decoder=GREEDY)
        want = stream(stub, speech, config)
        (engine,) = _engines(server)
        pid = engine.pid
        half = len(speech) // 2 // 3200 * 3200
        call = stub.StreamingRecognize(
            stream_messages(speech, config, interim=True, pause=(half, release)),
            timeout=RPC_TIMEOUT,
        )
        assert next(call).results  # an interim result: the engine holds the stream
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid) or _reaped(pid), what="the process to die")
        wait_until(
            lambda: engine.pid != pid and _alive(engine.pid), timeout=90,
            what="a new engine process",
        )  # fmt: skip
        release.set()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == Code.UNAVAILABLE
        assert "engine process" in e.value.details()
        assert stream(stub, speech, config) == want
        assert recognize(stub, speech, config).results
        new_pid = engine.pid
    assert not _alive(new_pid)


def test_a_replaced_version_drains_then_its_engine_process_ends(
    tiny_model_dir: Path, tmp_path: Path, corpus_audio
) -> None:
    """Hot reload with engine processes: a new version gets a process of its own and the
    new requests; the old version's process ends once its last stream has."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo / "echoic-tiny" / "1")
    audio = pcm16(corpus_audio[0][1])
    release = threading.Event()
    with running(model_repo=repo, poll_seconds=0.2, engine="process") as server:
        with channel_to(server) as ch:
            stub = pb_grpc.TranscriberStub(ch)
            (old,) = _engines(server)
            old_pid = old.pid
            call = stub.StreamingRecognize(
                stream_messages(audio, Config(encoding=Config.LINEAR16, sample_rate_hertz=16000),
                                interim=True, pause=(len(audio) // 2 // 2 * 2, release)),
                timeout=RPC_TIMEOUT,
            )  # fmt: skip
            assert next(call).results
            shutil.copytree(tiny_model_dir, repo / "echoic-tiny" / "2")
            wait_until(
                lambda: server.server.registry.serving["echoic-tiny"].version == "2",
                timeout=60, what="version 2 to serve",
            )  # fmt: skip
            assert _alive(old_pid), "the old version's process ended under an open stream"
            new_pid = server.server.registry.serving["echoic-tiny"].dispatcher.pid
            assert new_pid != old_pid
            release.set()
            responses = list(call)
            assert responses[-1].results[0].is_final
            assert responses[-1].model.version == "1"
            wait_until(lambda: not _alive(old_pid), timeout=30, what="the old process to end")
            response = recognize(stub, audio, linear16())
            assert response.model.version == "2" and response.results
    assert not _alive(new_pid)


def test_an_engine_process_that_cannot_load_its_model_says_why(tmp_path: Path) -> None:
    """A model directory whose graph is damaged: the server does not start, with the same
    error as a thread engine's (raised in the engine process, handed to the server)."""
    broken = tmp_path / "broken"
    shutil.copytree(default_model_dir(), broken)
    (broken / "model.onnx").write_bytes(b"not an onnx graph")
    errors = []
    for engine in ("thread", "process"):
        with pytest.raises(ModelError, match="not a loadable ONNX model") as e:
            with running(broken, engine=engine):
                pass
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_an_engine_process_that_cannot_restart_is_retried_until_it_can(
    tiny_model_dir: Path, tmp_path: Path, corpus_audio
) -> None:
    """The engine process dies while its model cannot be loaded: the server keeps trying
    (with a backoff) rather than leaving the version dead, and serves again once it can."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    audio = pcm16(corpus_audio[0][1])
    with running(model, engine="process") as server, channel_to(server) as ch:
        stub = pb_grpc.TranscriberStub(ch)
        want = recognize(stub, audio, linear16()).results
        (engine,) = _engines(server)
        pid = engine.pid
        graph = model / "model.onnx"
        graph.rename(tmp_path / "away.onnx")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: "retrying" in engine._broken, timeout=60, what="a failed restart")
        with pytest.raises(grpc.RpcError) as e:
            recognize(stub, audio, linear16())
        assert e.value.code() == Code.UNAVAILABLE
        (tmp_path / "away.onnx").rename(graph)
        wait_until(
            lambda: engine.pid != pid and not engine._broken, timeout=90,
            what="a restart once the model loads again",
        )  # fmt: skip
        assert recognize(stub, audio, linear16()).results == want


def test_steps_queued_for_streams_closed_meanwhile_are_not_run(corpus_audio) -> None:
    """A client that goes away while its step waits in the engine's queue: the stream is
    closed, and its step is dropped rather than run for nobody (its batch never happens),
    and a caller still waiting on it is told the stream was closed. Steps and closes sent in
    one message: the engine reads both before it runs any batch, whatever the timing."""
    import asyncio

    from echoic.model.core.decoding import DecoderConfig
    from echoic.server.core.dispatcher import DispatcherClosed
    from echoic.server.metrics import Metrics

    audio = corpus_audio[0][1]
    metrics = Metrics()
    spec = _spec()

    async def run() -> tuple[float, list]:
        engine = await EngineProcess.start(spec, metrics)
        engine.labels = ("m", "1")
        try:
            recognizer = await engine.recognizer(DecoderConfig())
            kept = recognizer.stream()
            gone = [recognizer.stream() for _ in range(8)]
            for s in [kept, *gone]:
                s.accept_audio(audio)
            steps = [asyncio.ensure_future(engine.step(s)) for s in gone]
            await asyncio.sleep(0)  # the steps queued in this turn of the loop...
            steps[0].cancel()  # ...one caller gone, the rest still waiting
            for s in gone:
                s.close()  # ...and the closes, all in one message
            answers = await asyncio.gather(*steps[1:], return_exceptions=True)
            await engine.step(kept)  # a batch after them: its reply comes after theirs
            return _batches(metrics), answers
        finally:
            await engine.close()

    ran, answers = asyncio.run(run())
    assert ran == 1.0  # the kept stream's batch alone
    assert all(isinstance(a, DispatcherClosed) for a in answers), answers


@pytest.mark.parametrize(
    ("engine", "decoder"),
    [
        pytest.param("process", "greedy", id="process-greedy"),
        pytest.param("process", "beam", id="process-beam-in-decoder-threads"),
        pytest.param("thread", "greedy", id="thread-greedy"),
    ],
)
def test_a_finished_stream_with_two_windows_left_is_answered_once(
    corpus_audio, engine: str, decoder: str
) -> None:
    """A stream that ends with more audio than one window holds: its last two windows run
    back to back in the engine (two model calls) and the stream gets one answer, after
    both, with the results the same stream gives in this process step by step."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from echoic.model.core.decoding import DecoderConfig
    from echoic.model.runtime.recognizer import Recognizer
    from echoic.server.core.dispatcher import Dispatcher
    from echoic.server.metrics import Metrics

    config = DecoderConfig() if decoder == "greedy" else DecoderConfig(kind="beam", beam_size=8)
    local = Recognizer(default_model_dir(), config)

    def pieces(audio: np.ndarray) -> list[np.ndarray]:
        return [audio[i : i + 1600] for i in range(0, len(audio), 1600)]

    def here(audio: np.ndarray) -> tuple[list, int]:
        """The stream's finals in this process, and its steps after the audio ended."""
        s, finals, after = local.stream(endpointing=None), [], 0
        for piece in [*pieces(audio), None]:
            if piece is None:
                s.finish()
            else:
                s.accept_audio(piece)
            while s.is_ready():
                local.step([s])
                finals += s.settle().finals
                after += piece is None
        return finals, after

    # the corpus utterance cut so that its end leaves two windows
    full = corpus_audio[0][1]
    audio = next(full[:n] for n in range(len(full), len(full) // 2, -800) if here(full[:n])[1] == 2)
    want, _ = here(audio)
    metrics = Metrics()

    async def run() -> tuple[list, int, float]:
        if engine == "process":
            dispatcher = await EngineProcess.start(_spec(), metrics)
            dispatcher.labels = ("m", "1")
            s = (await dispatcher.recognizer(config)).stream()
        else:
            pools = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
            dispatcher = Dispatcher(
                local, max_batch=64, max_wait_ms=0, executor=pools[0], decoders=pools[1],
                metrics=metrics, labels=("m", "1"),
            )  # fmt: skip
            s = local.stream(endpointing=None)
        try:
            finals: list = []
            for piece in pieces(audio):
                s.accept_audio(piece)
                while s.is_ready():
                    finals += (await dispatcher.step(s)).finals
            before = _batches(metrics)
            s.finish()
            answers = 0
            while s.is_ready():
                finals += (await dispatcher.step(s)).finals
                answers += 1
            assert s.is_final
            return finals, answers, _batches(metrics) - before
        finally:
            await dispatcher.close()

    got, answers, ran = asyncio.run(run())
    assert (answers, ran) == (1, 2)
    assert got == want and got[-1].transcript.text


def test_a_shared_engine_serves_every_door_and_ends_with_the_last(
    corpus_audio, tmp_path: Path
) -> None:
    """Two door processes' engines at one socket (as `--workers` makes them): the first
    starts the engine, the second joins it; their streams (the same ids in each) get the
    same words; the first's close wakes its reader at once (the engine shuts the socket
    down, which closing it would not) while the engine serves on for the second; it ends,
    and its socket goes, with the last door."""
    import asyncio

    from echoic.model.core.decoding import DecoderConfig
    from echoic.server.metrics import Metrics

    audio = corpus_audio[0][1]
    socket_path = str(tmp_path / "engine.sock")
    spec = _spec(share=socket_path)

    async def words(engine: EngineProcess) -> list[str]:
        stream = (await engine.recognizer(DecoderConfig())).stream()
        stream.accept_audio(audio)
        stream.finish()
        finals = []
        while stream.is_ready():
            finals += (await engine.step(stream)).finals
        return [u.transcript.text for u in finals]

    async def run() -> tuple[int, list[list[str]], bool]:
        first = await EngineProcess.start(spec, Metrics())
        second = await EngineProcess.start(spec, Metrics())
        try:
            assert first.pid == second.pid and first._process is not None
            assert second._process is None  # joined, not started
            heard = [await words(first), await words(second)]
            threads = first._threads
            await first.close()
            woken = not any(t.is_alive() for t in threads)
            heard.append(await words(second))
            return second.pid, heard, woken
        finally:
            await second.close()

    pid, heard, woken = asyncio.run(run())
    assert heard[0] and heard == [heard[0]] * 3
    assert woken, "the first door's reader was left blocked on its socket"
    wait_until(lambda: not _alive(pid), what="the engine to end with its last door")
    assert not Path(socket_path).exists()


def test_a_door_that_reads_nothing_holds_up_no_sender_and_is_dropped() -> None:
    """The engine's replies to a door process that stops reading (stopped, swapping) are
    queued for that door's own writer, never sent from a batch's thread: sending does not
    block, and past MAX_BACKLOG unread replies the door is dropped (its socket shut down,
    so the door process sees the end and starts over), not a batch lane frozen for every
    worker."""
    import socket
    from multiprocessing.connection import Connection

    from echoic.server.core.engine_process import MAX_BACKLOG, _Door

    ours, theirs = socket.socketpair()
    door = _Door(Connection(ours.detach()))
    reply = [("value", 1, b"x" * 1024)]
    for _ in range(2 * MAX_BACKLOG):  # a few hundred fill the socket; the rest queue
        door.send(reply)
    assert door.gone
    theirs.settimeout(RPC_TIMEOUT)
    while theirs.recv(1 << 16):  # what was sent, then the end
        pass
    theirs.close()
    door.closed()  # as its reader does at the end: the writer ended, the pipe closed
