"""The engine in a process of its own (`echoic serve --engine process`).

One process per loaded model version runs that version's batches: its ONNX Runtime
sessions, the streams' features, windows, recurrent states and decoders, the
endpoint test, and the beam searches. The server process keeps the doors (gRPC, HTTP,
WebSocket), the audio decoding, the sessions and the results, and feeds the engine
process audio over one socket pair. Each side then has an interpreter lock of its
own: the doors' Python no longer waits behind the batches' Python (features, greedy
decoding, settling), nor they behind it.

The server's side:

- `EngineProcess`: the process, started when a version loads and stopped when it
  unloads; what a `LoadedModel` holds in place of an in-process `Dispatcher`, with the
  same calls (`step`, `offline`, `decode_whole`, `close`) plus `recognizer(decoder)`.
  If the process dies, the requests waiting on it fail with `DispatcherClosed` (the
  doors answer UNAVAILABLE: retry), the streams open on it fail at their next step, and
  a new process starts for the streams that come next.
- `RemoteRecognizer`: what `LoadedModel.recognizer` gives: the model's card and a
  decoder config; `stream()` opens a `RemoteStream`.
- `RemoteStream`: a `Stream` as `Session` uses it. Audio waits here until the stream's
  next step and goes with it; the stream knows from the card when its next window is
  ready (the arithmetic of `WindowFeeder.ready`), so a step is asked for only when it
  has model work, as in-process. What each step said (its window position, decoded
  audio, finality) comes back with the step's result.

The engine's side (`python -m echoic.server.core.engine_process FD`, `_Host`): a thread
reads the pipe; the main thread takes whatever steps are queued the moment the batch
before is done (up to `max_batch`), runs one `Recognizer.step` for them and settles
the greedy ones there; beam searches settle in its decoder threads (or its own
`--beam-processes`), and decoders are built in a thread of their own. Replies go back as
one message per batch. A step whose stream was closed while it waited is dropped. A
finished stream left with one window, its last (a live stream's audio after its last
window ends up in one or two), is answered once, after that window too, with both
steps' results (`Stream.finishing`; the partial of the window before is not sent: the
audio has ended, and the final result follows): its final result waits for one round
trip to the door, not two. A greedy stream's last window runs at once in the same lane, in a round
of its own with the batch's other such windows (about a third of a full batch's time,
where queued again it would join a full batch); a beam search's goes back to the head
of the queue once its decoder thread has settled it.

With `--workers` (`EngineSpec.share`: a Unix socket's path) one engine process serves
every worker: the first worker to load the version starts it with `--listen PATH`, the
others connect there, each connection a `_Door` with its own streams; it ends when the
last door leaves. The path's lock (PATH.lock, flock) is held while a door connects or
starts one, and while an engine with no door left closes its socket.

The messages are pickled lists of tuples of builtins, numpy arrays and
`echoic.model` objects, one list per send each way: door -> engine `(op, ...)`
with op one of open, close, step, decoder, offline, decode; engine -> door
`("stepped", rid, Stepped, status)`, `("value", rid, value)`, `("error", rid, exc)`
and `("batch", size, compute_s, queue_waits, audio_s)` for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from echoic.model.core.decoding import DecoderConfig, Endpointing, Transcript
from echoic.model.core.features import num_frames
from echoic.model.runtime.card import ModelCard
from echoic.model.runtime.chunking import ChunkConfig
from echoic.model.runtime.engine import Engine, window_ready
from echoic.model.runtime.recognizer import Recognizer, Stepped, Stream
from echoic.server.core.dispatcher import DispatcherClosed, observe_batch, take_batch
from echoic.server.metrics import Metrics

log = logging.getLogger("echoic.server")

CHILD_MODULE = "echoic.server.core.engine_process"
START_SECONDS = 300.0  # s a new engine process gets to load its model
STOP_SECONDS = 10.0  # s it gets to exit once told, before it is killed
MAX_BACKLOG = 1024  # replies a door process may leave unread before the engine drops it
BOOSTED_KEPT = 64  # decoders with one request's boosted words an engine keeps built, count


@dataclass(frozen=True)
class EngineSpec:
    """What an engine process loads, and how it runs (from `ServerConfig`)."""

    path: Path
    providers: tuple[str, ...]
    intra_op_threads: int
    spin_wait: bool
    io_binding: bool
    chunking: ChunkConfig | None
    max_batch: int
    lanes: int  # batches run at once, count
    decoder_threads: int
    beam_processes: int
    # A Unix socket's path: the engine serves every door process that connects there (the
    # workers of `--workers`), the first of them starting it; "": this door process's own.
    share: str = ""


@dataclass(frozen=True)
class _Info:
    """What the engine process says once its model is loaded."""

    card: ModelCard
    streamable: bool
    streams_exactly: bool
    chunking: ChunkConfig | None
    pid: int


# ------------------------------------------------------------------ the server's side


class RemoteRecognizer:
    """A model version's recognizer with one decoder config, its engine in a process."""

    def __init__(self, engine: EngineProcess, decoder: DecoderConfig) -> None:
        self.engine = engine
        self.decoder_config = decoder
        info = engine.info
        self.card = info.card
        self.streamable = info.streamable
        self.streams_exactly = info.streams_exactly
        self.chunking = info.chunking
        self.sample_rate = info.card.sample_rate
        self.frame_seconds = info.card.output_frame_ms / 1000.0

    def stream(self, *, endpointing: Endpointing | None = None, n_best: int = 1) -> RemoteStream:
        return self.engine.open_stream(self, endpointing or Endpointing(), n_best)


class RemoteStream:
    """One stream whose state lives in the engine process (see the module docstring)."""

    def __init__(self, recognizer: RemoteRecognizer, sid: int, generation: int) -> None:
        self.recognizer = recognizer
        self.sid = sid
        self.generation = generation  # the engine process it lives in
        card = recognizer.card
        # Readiness by the card's arithmetic where windows come from feature frames
        # (stream.onnx); an overlapped-chunk stream asks the engine at every step.
        self._clock = card if recognizer.chunking is None else None
        self._pending: list[np.ndarray] = []  # audio not yet sent
        self.samples_in = 0  # audio accepted, samples
        self.finished = False
        self._finish_sent = False
        self._features_now = False
        # What the engine said after the last step:
        self._next_frame = 0  # the next window's first output frame
        self._engine_ready = False  # it has more windows ready already
        self.is_final = False
        self._decoded_seconds = 0.0
        self.utterance_index = 0

    def accept_audio(self, samples: np.ndarray) -> None:
        if self.finished:
            raise RuntimeError("accept_audio() after finish()")
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if len(samples):
            self._pending.append(samples)
            self.samples_in += len(samples)

    def finish(self, *, features_now: bool = False) -> None:
        self.finished = True
        self._features_now |= features_now

    def is_ready(self) -> bool:
        if self.is_final:
            return False
        if (self.finished and not self._finish_sent) or self._engine_ready:
            return True
        if not self._pending:
            return False
        card = self._clock
        if card is None:
            return True
        return window_ready(card, self._next_frame, num_frames(self.samples_in, card.features))

    @property
    def audio_seconds(self) -> float:
        return self.samples_in / self.recognizer.sample_rate

    @property
    def decoded_seconds(self) -> float:
        return self._decoded_seconds

    def compute_features(self) -> None:
        """The audio this stream holds (a whole file's window) has its features computed in
        the engine process beside its batches, with the next step, rather than in the
        batch that step joins (about 30 ms for 30 s of audio)."""
        self._features_now = True

    def settle(self) -> Stepped:
        """Nothing: the engine settles a stream with its step, and gives its last utterance
        with the step that made it final."""
        return Stepped((), None, False, self.audio_seconds)

    def close(self) -> None:
        self.recognizer.engine.close_stream(self)

    # ---- EngineProcess's side

    def take_step(self) -> tuple[np.ndarray | None, bool, bool]:
        """The audio and the end (once) that go with the next step."""
        pending, self._pending = self._pending, []
        samples = None
        if pending:
            samples = pending[0] if len(pending) == 1 else np.concatenate(pending)
        finish = self.finished and not self._finish_sent
        self._finish_sent |= finish
        features_now, self._features_now = self._features_now, False
        return samples, finish, features_now

    def update(self, status: tuple[int, bool, bool, float, int]) -> None:
        (self._next_frame, self._engine_ready, self.is_final, self._decoded_seconds,
         self.utterance_index) = status  # fmt: skip


class EngineProcess:
    """One model version's engine process, seen from the server (the module docstring)."""

    def __init__(self, spec: EngineSpec, metrics: Metrics) -> None:
        self.spec = spec
        self._metrics = metrics
        self.labels = ("", "")  # (name, version) for the metrics, set by the registry
        self.info: _Info
        self.generation = 0  # counts the processes started
        self._process: subprocess.Popen | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.Future, RemoteStream | None]] = {}
        self._outbox: list[tuple] = []
        self._flushing = False
        self._sends: queue.SimpleQueue[list[tuple] | None] = queue.SimpleQueue()
        self._live = False  # a process is up and answering
        self._closed = False
        self._broken = ""  # why no process can start; "" while one can
        self._restart: asyncio.Task | None = None
        self._threads: list[threading.Thread] = []  # the pipe's reader and writer
        self._built: set[DecoderConfig] = set()  # decoders built, to rebuild after a restart
        self._loop: asyncio.AbstractEventLoop

    @classmethod
    async def start(cls, spec: EngineSpec, metrics: Metrics) -> EngineProcess:
        """The process started and its model loaded; the load's error if it fails."""
        self = cls(spec, metrics)
        self._loop = asyncio.get_running_loop()
        await self._spawn()
        return self

    @property
    def pid(self) -> int | None:
        info = getattr(self, "info", None)  # the process that serves, or served last
        return info.pid if info is not None else None

    async def _spawn(self) -> None:
        """A process that serves this version: this door process's own, or (`spec.share`)
        the one at the shared socket, started there first if none serves it."""
        share = self.spec.share
        lock = await _lock(share + ".lock") if share else None
        try:
            pipe, process, info = _dial(share) if share else None, None, None
            if pipe is not None:
                try:
                    info = await self._handshake(pipe, None)
                except RuntimeError:  # it ended as this door joined: start one
                    pipe = None
            if pipe is None:
                mine, theirs = socket.socketpair()
                fds = (theirs.fileno(),) + ((lock.fileno(),) if lock is not None else ())
                # a shared engine holds the path's lock too (inherited) until it answers
                listen = ["--listen", share, str(lock.fileno())] if lock is not None else []
                with theirs:
                    process = subprocess.Popen(
                        [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno()), *listen],
                        pass_fds=fds,
                    )
                pipe = Connection(mine.detach())
                info = await self._handshake(pipe, process)
        finally:
            if lock is not None:
                lock.close()  # the lock goes with the last of this and the engine's copy
        self.info = info
        self._process = process
        self.generation += 1
        self._live = True
        self._sends = queue.SimpleQueue()
        self._threads = [
            threading.Thread(
                target=self._read, args=(pipe, self.generation), name="echoic-engine-read",
                daemon=True,
            ),
            threading.Thread(
                target=_write, args=(pipe, self._sends), name="echoic-engine-write",
                daemon=True,
            ),
        ]  # fmt: skip
        for thread in self._threads:
            thread.start()
        self._flush()

    async def _handshake(self, pipe: Connection, process: subprocess.Popen | None) -> _Info:
        """The spec sent, the model's info back once it is loaded; the load's error."""
        try:
            pipe.send_bytes(pickle.dumps(self.spec))
            ok, info = await asyncio.wait_for(
                asyncio.to_thread(_receive, pipe), START_SECONDS
            )  # fmt: skip
        except BaseException as e:
            if process is not None:
                process.kill()
                await asyncio.to_thread(process.wait)
            pipe.close()
            if isinstance(e, (EOFError, OSError)):
                raise RuntimeError(f"the engine process for {self.spec.path} exited") from None
            if isinstance(e, asyncio.TimeoutError):
                raise RuntimeError(
                    f"the engine process for {self.spec.path} did not load it in "
                    f"{START_SECONDS:g} s"
                ) from None
            raise
        if not ok:
            if process is not None:
                await asyncio.to_thread(process.wait)
            pipe.close()
            raise info
        return info

    # ---- what a LoadedModel calls

    async def recognizer(self, decoder: DecoderConfig) -> RemoteRecognizer:
        """A recognizer with `decoder`, built in the engine process (a beam search loads its
        LM there); ValueError for settings it refuses (a boosted word it cannot spell)."""
        await self._call(("decoder", decoder))
        if not decoder.boost:  # one request's boosted words are not worth rebuilding
            self._built.add(decoder)
        return RemoteRecognizer(self, decoder)

    def open_stream(
        self, recognizer: RemoteRecognizer, endpointing: Endpointing, n_best: int
    ) -> RemoteStream:
        if n_best < 1:
            raise ValueError(f"n_best must be at least 1, got {n_best}")
        if not self._live:
            raise DispatcherClosed(self._broken or "the engine process is restarting: retry")
        stream = RemoteStream(recognizer, next(self._ids), self.generation)
        self._send(("open", stream.sid, recognizer.decoder_config, endpointing, n_best))
        return stream

    def close_stream(self, stream: RemoteStream) -> None:
        if stream.generation == self.generation and not self._closed:
            self._send(("close", stream.sid))

    async def step(self, stream: RemoteStream) -> Stepped:
        """The stream's next step, with the audio it has been given since the last, run in
        the engine's next batch and settled there; what the step gave."""
        if stream.generation != self.generation:
            raise DispatcherClosed(
                "the engine process this stream ran in ended (its state is lost)"
            )
        samples, finish, features_now = stream.take_step()
        return await self._call(("step", stream.sid, samples, finish, features_now), stream)

    async def offline(self, audio: np.ndarray) -> np.ndarray:
        """Log-probs (T', V) of one whole utterance, batched with the others queued."""
        return await self._call(("offline", np.asarray(audio, dtype=np.float32)))

    async def decode_whole(
        self, recognizer: RemoteRecognizer, log_probs: np.ndarray, n_best: int
    ) -> Transcript:
        return await self._call(("decode", recognizer.decoder_config, log_probs, n_best))

    async def close(self) -> None:
        """Stop the process; requests still waiting fail with DispatcherClosed."""
        self._closed = True
        if self._restart is not None:
            self._restart.cancel()
        self._fail(DispatcherClosed("the model version was unloaded"))
        self._stop_process()
        process = self._process
        if process is not None and self.spec.share:
            # It ends once the last door process has left it: reaped whenever that is.
            threading.Thread(target=process.wait, name="echoic-engine-reap", daemon=True).start()
        elif process is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(process.wait), STOP_SECONDS)
            except TimeoutError:
                process.kill()
                await asyncio.to_thread(process.wait)
        for thread in self._threads:  # a closed engine leaves no thread behind
            await asyncio.to_thread(thread.join, STOP_SECONDS)

    # ---- messages

    async def _call(self, op: tuple, stream: RemoteStream | None = None) -> Any:
        if self._closed:
            raise DispatcherClosed("the model version is unloading")
        if not self._live:
            raise DispatcherClosed(self._broken or "the engine process is restarting: retry")
        rid = next(self._ids)
        future = self._loop.create_future()
        self._waiting[rid] = (future, stream)
        self._send((op[0], rid, *op[1:]))
        try:
            return await future
        finally:
            self._waiting.pop(rid, None)

    def _send(self, op: tuple) -> None:
        """Queue an op; every op queued in one turn of the event loop goes in one message."""
        self._outbox.append(op)
        if not self._flushing:
            self._flushing = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if self._live and self._outbox:
            ops, self._outbox = self._outbox, []
            self._sends.put(ops)  # pickled by the writer, off the event loop

    def _read(self, pipe: Connection, generation: int) -> None:
        """In a thread: hand each message of replies to the event loop; the process's end."""
        while True:
            try:
                replies = _receive(pipe)
            except (EOFError, OSError):
                break
            except Exception:  # a reply that does not load: this process is beyond trust
                log.exception("an engine process's reply could not be read; restarting it")
                if self._process is not None:
                    self._process.kill()
                break
            try:
                self._loop.call_soon_threadsafe(self._on_replies, replies)
            except RuntimeError:  # the loop is closed: the server is gone
                return
        pipe.close()
        try:
            self._loop.call_soon_threadsafe(self._on_exit, generation)
        except RuntimeError:
            pass

    def _on_replies(self, replies: list[tuple]) -> None:
        for reply in replies:
            kind = reply[0]
            if kind == "batch":
                self._observe(*reply[1:])
                continue
            waiting = self._waiting.pop(reply[1], None)
            if waiting is None:
                continue  # its caller went away
            future, stream = waiting
            if kind == "stepped":
                _, _, stepped, status = reply
                if stream is not None:
                    stream.update(status)
                if not future.done():
                    future.set_result(stepped)
            elif future.done():
                continue
            elif kind == "value":
                future.set_result(reply[2])
            else:
                future.set_exception(reply[2])

    def _observe(self, size: int, compute: float, waits: list[float], audio: float) -> None:
        for wait in waits:
            self._metrics.queue_wait.labels(*self.labels).observe(wait)
        observe_batch(self._metrics, self.labels, size, compute, audio)

    def _on_exit(self, generation: int) -> None:
        if generation != self.generation or self._closed:
            return
        self._live = False
        self._sends.put(None)
        self._restart = self._loop.create_task(self._respawn(self._process))

    async def _respawn(self, process: subprocess.Popen | None) -> None:
        """After the process's end: why, said to every request waiting on it; then a new one."""
        code = None
        if process is not None:
            try:
                code = await asyncio.wait_for(asyncio.to_thread(process.wait), STOP_SECONDS)
            except TimeoutError:  # it closed its pipe but lives on
                process.kill()
                await asyncio.to_thread(process.wait)
        how = (
            "ended" if process is None  # another door process started it
            else "closed its pipe" if code is None
            else f"was killed by signal {-code}" if code < 0
            else f"exited with status {code}"
        )  # fmt: skip
        pid = self.info.pid
        why = f"the engine process of {self.labels[0]} version {self.labels[1]} (pid {pid}) {how}"
        log.error("%s; failing %d waiting request(s) and starting a new one", why,
                  len(self._waiting))  # fmt: skip
        self._fail(DispatcherClosed(f"{why}: retry"))
        delay = 1.0
        while not self._closed:
            try:
                await self._spawn()
            except Exception as e:  # noqa: BLE001 - logged; requests are refused with it
                self._broken = f"the engine process could not be restarted ({e}); retrying"
                log.error("%s %s: %s", *self.labels, self._broken)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 30.0)
                continue
            self._broken = ""
            log.info("%s version %s: a new engine process (pid %s) serves", *self.labels, self.pid)
            # The decoders the old process had built, built again beside the batches (a
            # stream opened on one not yet built would build it on the batches' thread).
            for decoder in list(self._built):
                try:
                    await self._call(("decoder", decoder))
                except Exception:  # noqa: BLE001 - a later request says why, if it still fails
                    log.exception("rebuilding a decoder in the new engine process")
            return

    def _fail(self, error: Exception) -> None:
        waiting = list(self._waiting.values())
        self._waiting.clear()
        self._outbox.clear()
        for future, _ in waiting:
            if not future.done():
                future.set_exception(error)

    def _stop_process(self) -> None:
        """The process is told to stop (it exits, and the reader sees its end)."""
        if self._live:
            self._sends.put([("stop",)])
        self._live = False
        self._sends.put(None)


async def _lock(path: str) -> Any:
    """`path` opened and locked (flock; closing it unlocks), waited for without blocking the
    event loop, and given up cleanly if the wait is cancelled."""
    lock = open(path, "a")  # noqa: SIM115 - held until the caller closes it
    try:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return lock
            except BlockingIOError:
                await asyncio.sleep(0.02)
    except BaseException:
        lock.close()
        raise


def _dial(path: str) -> Connection | None:
    """A connection to the engine serving at `path`; None if none does (or the path cannot
    be connected to: starting one there says why)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return Connection(sock.detach())


@contextlib.contextmanager
def _path_lock(path: str) -> Iterator[None]:
    """An engine socket's lock (PATH.lock, flock): held while a door process connects to the
    engine at `path` or starts one there, and while an engine with no door left closes it."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _receive(pipe: Connection) -> Any:
    return pickle.loads(pipe.recv_bytes())


def _write(pipe: Connection, sends: queue.SimpleQueue) -> None:
    """In a thread: send each message (blocking on the socket frees the lock); None, or
    a closed pipe, ends it."""
    while (ops := sends.get()) is not None:
        try:
            pipe.send_bytes(pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            return


# ------------------------------------------------------------------ the engine's side


class _Door:
    """One door process's connection to the engine: its pipe, the streams it opened (sid ->
    its stream, or why it could not be opened, said at its first step), and a writer thread
    of its own, so that a door process that stops reading (stopped, swapping) holds up no
    batch and no other door: past MAX_BACKLOG unsent messages it is dropped."""

    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe
        self.streams: dict[int, Stream | Exception] = {}
        self.gone = False
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="write", daemon=True)
        self._writer.start()

    def send(self, replies: list[tuple] | tuple) -> None:
        """Replies to this door (or its handshake), pickled here, sent by its writer;
        nothing once it has gone."""
        if self.gone:
            return
        if self._outbox.qsize() >= MAX_BACKLOG:
            log.error("a door process has read none of %d replies: dropping it", MAX_BACKLOG)
            self.shut()
            return
        self._outbox.put(pickle.dumps(replies, protocol=pickle.HIGHEST_PROTOCOL))

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.pipe.send_bytes(data)
            except OSError:
                self.shut()
                return

    def shut(self) -> None:
        """No more to or from this door: its socket shut down both ways, which wakes a
        reader or writer blocked on it (closing the descriptor would not); the reader
        closes it once both have ended (`closed`)."""
        self.gone = True
        self._outbox.put(None)
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(self.pipe.fileno()))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()

    def closed(self) -> None:
        """The reader has seen the end: the writer's end waited for, the pipe closed."""
        self.shut()
        self._writer.join(timeout=STOP_SECONDS)
        self.pipe.close()


@dataclass
class _Work:
    kind: str  # "stream" or "offline"
    rid: int
    payload: Any  # a Stream, or samples
    queued_at: float
    door: _Door
    sid: int = 0  # a stream's id
    carried: Stepped | None = None  # a finished stream's earlier steps, not yet answered


class _Host:
    """The engine process: one model version's streams and batches, for one door process
    or, with `listen`, for every door process that connects (`--workers`)."""

    def __init__(self, pipe: Connection, spec: EngineSpec) -> None:
        self._spec = spec
        self._beams = None
        if spec.beam_processes:
            from echoic.server.core.beam_processes import BeamProcesses

            self._beams = BeamProcesses(spec.beam_processes)
        engine = Engine(
            spec.path, providers=spec.providers, intra_op_threads=spec.intra_op_threads,
            spin_wait=spec.spin_wait, io_binding=spec.io_binding,
        )  # fmt: skip
        self.greedy = Recognizer(engine, chunking=spec.chunking)
        self._recognizers: dict[DecoderConfig, Recognizer] = {DecoderConfig(): self.greedy}
        self._boosted: OrderedDict[DecoderConfig, Recognizer] = OrderedDict()
        self._building = threading.Lock()
        self._first = _Door(pipe)
        self._doors: set[_Door] = set()  # the connected ones, under _doors_lock
        self._doors_lock = threading.Lock()
        # (door, ops) as they come; (door, None) when a door has gone
        self._inbox: queue.SimpleQueue[tuple[_Door, list[tuple] | None]] = queue.SimpleQueue()
        self._dropped: list[tuple[_Door, int]] = []  # queued steps whose streams were closed
        # with decoder processes, a thread waits on each at once
        threads = max(spec.decoder_threads, spec.beam_processes)
        self._decoders = ThreadPoolExecutor(threads, thread_name_prefix="decode")
        # Decoders are built (a beam search's LM loaded, a request's boosted words spelled:
        # tens to hundreds of ms) in a thread of their own, so that the beam settles and
        # whole-file features queued in the decoder threads never wait behind a build.
        self._builds = ThreadPoolExecutor(1, thread_name_prefix="build")
        chunk_frames = self.greedy.card.chunk_frames or 1
        self._window_seconds = chunk_frames * self.greedy.frame_seconds
        self._listener: socket.socket | None = None
        self._bound = 0  # the listening socket's inode, while it is at its path

    def info(self) -> _Info:
        g = self.greedy
        return _Info(g.card, g.streamable, g.streams_exactly, g.chunking, os.getpid())

    def _connect(self, door: _Door) -> None:
        with self._doors_lock:
            self._doors.add(door)
        threading.Thread(target=self._read, args=(door,), name="read", daemon=True).start()

    def listen(self, path: str) -> None:
        """Take more door processes' connections at `path` (a Unix socket), each told the
        model's info first, as the first door was. The path's lock is held meanwhile (this
        process inherited it from the door that started it, and keeps it until the first
        door has its answer, even if that door died), so the path is this engine's."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # an engine's that died
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(16)
        self._listener = listener
        self._bound = os.stat(path).st_ino
        threading.Thread(target=self._accept, args=(listener,), name="accept",
                         daemon=True).start()  # fmt: skip

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed: the engine is ending
            pipe = Connection(sock.detach())
            try:
                _receive(pipe)  # the door's spec: the same, by the path's name
            except Exception:  # noqa: BLE001 - a connection that is not a door: not served
                pipe.close()
                continue
            door = _Door(pipe)
            # Counted before it is answered: the door holds the path's lock until then, so
            # an engine whose other doors leave meanwhile sees it and does not end.
            self._connect(door)
            door.send((True, self.info()))

    def _last_door_gone(self, path: str | None) -> bool:
        """Whether no door is left (the engine ends); with `path`, decided under the path's
        lock, so that a door connecting meanwhile either is counted or finds no socket."""
        with self._doors_lock:
            if self._doors:
                return False
        if path is None or self._listener is None:
            return True
        with _path_lock(path):
            with self._doors_lock:
                if self._doors:
                    return False
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == self._bound:  # not another engine's since
                    os.unlink(path)
        return True

    def run(self, listen: str | None = None) -> None:
        """Take the ops as they come; run the queued steps, up to max_batch at a time, the
        moment a lane is free (each lane a thread and its own ONNX Runtime call). Ends
        when the last door has gone (or said stop)."""
        self._connect(self._first)
        work: deque[_Work] = deque()
        free = self._spec.lanes
        lanes = ThreadPoolExecutor(free, thread_name_prefix="batch")
        while True:
            messages = [] if work and free else [self._inbox.get()]
            while True:
                try:
                    messages.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for door, ops in messages:
                if ops is None or any(op[0] == "stop" for op in ops):
                    self._leave(door)
                    if self._last_door_gone(listen):
                        return
                    continue
                for op in ops:
                    if op[0] == "free":
                        free += 1
                        continue
                    try:
                        self._handle(op, work, door)
                    except Exception as e:  # noqa: BLE001 - one op's fault, not the process's
                        log.exception("engine op %r failed", op[0])
                        if op[0] == "open":
                            door.streams[op[1]] = e
                        elif op[0] != "close":
                            self._reply_error(door, op[1], e)
            while work and free:
                batch = take_batch(work, self._spec.max_batch, self._gone)
                if batch:
                    free -= 1
                    lanes.submit(self._lane, batch)
            if self._dropped:
                closed = DispatcherClosed("the stream was closed")
                for door, rid in self._dropped:
                    door.send([("error", rid, closed)])
                self._dropped.clear()

    def _leave(self, door: _Door) -> None:
        """A door process has gone (or said stop): its streams with it."""
        with self._doors_lock:
            self._doors.discard(door)
        door.streams.clear()
        door.shut()

    def _gone(self, item: _Work) -> bool:
        """Whether a queued step's stream was closed meanwhile (its client went away, its
        call ended, its door process gone): the step is dropped, not run for nobody; its
        caller, if still waiting, is told the stream was closed."""
        gone = item.door.gone or (
            item.kind == "stream" and item.door.streams.get(item.sid) is not item.payload
        )
        if gone:
            self._dropped.append((item.door, item.rid))
        return gone

    def _lane(self, batch: list[_Work]) -> None:
        try:
            self._run_batch(batch)
        finally:
            self._inbox.put((self._first, [("free",)]))

    def _read(self, door: _Door) -> None:
        while True:
            try:
                self._inbox.put((door, _receive(door.pipe)))
            except (EOFError, OSError):
                self._inbox.put((door, None))
                door.closed()
                return

    def _handle(self, op: tuple, work: deque[_Work], door: _Door) -> None:
        kind = op[0]
        if kind == "close":
            door.streams.pop(op[1], None)
        elif kind == "open":
            _, sid, decoder, endpointing, n_best = op
            recognizer = self._recognizer(decoder)
            door.streams[sid] = recognizer.stream(endpointing=endpointing, n_best=n_best)
        elif kind == "step":
            self._step(op, work, door)
        elif kind == "queue":  # a step whose features were computed in a decoder thread
            work.append(op[1])
        elif kind == "again":  # a finished stream's next window: ahead of the others
            work.appendleft(op[1])
        elif kind == "offline":
            work.append(_Work("offline", op[1], op[2], time.perf_counter(), door))
        elif kind == "decoder":
            _, rid, decoder = op
            self._beside(door, rid, lambda: self._recognizer(decoder) and None, self._builds)
        elif kind == "decode":
            _, rid, decoder, log_probs, n_best = op
            self._beside(door, rid, lambda: self._recognizer(decoder).decode(log_probs, n_best))
        else:
            raise ValueError(f"unknown op {kind!r}")

    def _step(self, op: tuple, work: deque[_Work], door: _Door) -> None:
        _, rid, sid, samples, finish, features_now = op
        stream = door.streams.get(sid)
        if not isinstance(stream, Stream):
            self._reply_error(door, rid, stream or DispatcherClosed("the stream is not open here"))
            return
        item = _Work("stream", rid, stream, time.perf_counter(), door, sid)
        if samples is not None:
            stream.accept_audio(samples)
        if features_now:  # much audio: its features beside the batches

            def features() -> None:
                try:
                    if finish:
                        stream.finish(features_now=True)
                    else:
                        stream.compute_features()
                except Exception as e:  # noqa: BLE001 - raised where it was asked for
                    self._reply_error(door, rid, e)
                else:
                    self._inbox.put((door, [("queue", item)]))

            self._decoders.submit(features)
            return
        if finish:
            stream.finish()
        work.append(item)

    def _beside(
        self, door: _Door, rid: int, call: Any, pool: ThreadPoolExecutor | None = None
    ) -> None:
        """`call()` in a decoder thread (or `pool`'s); its value (or error) sent as rid's
        reply."""

        def run() -> None:
            try:
                value = call()
            except Exception as e:  # noqa: BLE001 - raised where it was asked for
                self._reply_error(door, rid, e)
            else:
                door.send([("value", rid, value)])

        (pool or self._decoders).submit(run)

    def _reply_error(self, door: _Door, rid: int, error: Exception) -> None:
        try:  # the server must be able to load it, not only this process to dump it
            pickle.loads(pickle.dumps(error))
        except Exception:  # noqa: BLE001 - an error that does not pickle both ways
            error = RuntimeError(f"{type(error).__name__}: {error}")
        door.send([("error", rid, error)])

    def _recognizer(self, decoder: DecoderConfig) -> Recognizer:
        """The recognizer for a decoder config, built once (one with boosted words: kept
        among the last BOOSTED_KEPT)."""
        with self._building:
            built = self._recognizers.get(decoder) or self._boosted.get(decoder)
            if built is not None:
                if decoder.boost:
                    self._boosted.move_to_end(decoder)
                return built
        recognizer = self.greedy.with_decoder(
            decoder, self._beams.decoder if self._beams is not None else None
        )
        with self._building:
            if decoder.boost:
                self._boosted[decoder] = recognizer
                while len(self._boosted) > BOOSTED_KEPT:
                    self._boosted.popitem(last=False)
            else:
                recognizer = self._recognizers.setdefault(decoder, recognizer)
        return recognizer

    def _run_batch(self, batch: list[_Work]) -> None:
        """The batch, then at once in this lane the next window of each of its finished
        greedy streams that has one (their last: a round of a few streams, where queued
        again they would join a full batch), its replies sent after each round."""
        while batch:
            batch = self._run_round(batch)

    def _run_round(self, batch: list[_Work]) -> list[_Work]:
        started = time.perf_counter()
        waits = [started - item.queued_at for item in batch]
        replies: list[tuple[_Work, tuple]] = []  # (whose, reply)
        again: list[_Work] = []  # finished greedy streams' last windows: the next round
        beside: list[_Work] = []  # beam searches, settled once this round's replies are sent
        try:
            if batch[0].kind == "offline":
                outs = self.greedy.log_probs([item.payload for item in batch])
                replies += (
                    (item, ("value", item.rid, out)) for item, out in zip(batch, outs, strict=True)
                )
                rate = self.greedy.sample_rate
                audio = sum(len(item.payload) for item in batch) / rate
            else:
                streams = [item.payload for item in batch]
                ready = [s.is_ready() for s in streams]
                self.greedy.step(streams)
                for item, stepped in zip(batch, ready, strict=True):
                    replies += (
                        (item, reply) for reply in self._settle(item, stepped, again, beside)
                    )
                audio = len(batch) * self._window_seconds
        except Exception as e:  # noqa: BLE001 - handed to every waiting stream
            log.exception("batched model call failed (%d items)", len(batch))
            for item in batch:
                self._reply_error(item.door, item.rid, e)
            return []
        # Each door its own replies; the batch's metrics to one of them (one still there),
        # so that a scrape summing every worker counts each batch once.
        by_door: dict[_Door, list[tuple]] = {}
        for item, reply in replies:
            by_door.setdefault(item.door, []).append(reply)
        counted = next((item.door for item in batch if not item.door.gone), batch[0].door)
        by_door.setdefault(counted, []).append(
            ("batch", len(batch), time.perf_counter() - started, waits, audio)
        )
        failed: set[_Door] = set()
        for door, theirs in by_door.items():
            try:
                door.send(theirs)
            except Exception as e:  # noqa: BLE001 - a reply that does not pickle: each told
                log.exception("the replies of a batch could not be sent")
                failed.add(door)
                for item in batch:
                    if item.door is door and item not in again:
                        self._reply_error(door, item.rid, e)
        # after the round's metrics: a beam stream's answer never overtakes its batch's
        for item in beside:
            if item.door not in failed:
                self._decoders.submit(self._settle_beside, item)
        return again

    def _settle(
        self, item: _Work, stepped: bool, again: list[_Work], beside: list[_Work]
    ) -> list[tuple]:
        """A stream's reply after its step: settled here (greedy), or in a decoder thread
        (a beam search, put in `beside`: replied from there). A stream that had no window
        only says where it stands (a final stream its last utterance)."""
        stream = item.payload
        if not stepped and not stream.is_final:
            return self._answer(item, Stepped((), None, False, stream.decoded_seconds), again)
        if stream.deferred:
            beside.append(item)
            return []
        return self._answer(item, stream.settle(), again)

    def _settle_beside(self, item: _Work) -> None:
        try:
            replies = self._answer(item, item.payload.settle())
        except Exception as e:  # noqa: BLE001 - raised where it was asked for
            self._reply_error(item.door, item.rid, e)
        else:
            if replies:
                item.door.send(replies)

    def _answer(
        self, item: _Work, stepped: Stepped, again: list[_Work] | None = None
    ) -> list[tuple]:
        """The reply to a step, with the results of the steps carried before it; none yet
        for a finished stream with another window (the door would only ask for it at
        once): that step, carrying these results, goes into `again` (the lane's next
        round), or without one back to the head of the queue."""
        stream = item.payload
        if item.carried is not None:
            stepped = item.carried.then(stepped)
        if stream.finishing:
            item.carried, item.queued_at = stepped, time.perf_counter()
            if again is not None:
                again.append(item)
            else:
                self._inbox.put((item.door, [("again", item)]))
            return []
        return [("stepped", item.rid, stepped, _status(stream))]

    def close(self) -> None:
        self._decoders.shutdown(wait=False, cancel_futures=True)
        self._builds.shutdown(wait=False, cancel_futures=True)
        if self._beams is not None:
            self._beams.close()


def _status(stream: Any) -> tuple[int, bool, bool, float, int]:
    """Where a stream stands after a step, for its `RemoteStream.update`."""
    feeder = stream._feeder  # noqa: SLF001 - the engine's own streams
    return (
        getattr(feeder, "next_frame", 0),
        stream.is_ready(),
        stream.is_final,
        stream.decoded_seconds,
        stream.utterance_index,
    )


def main() -> None:
    # Ctrl-C and SIGTERM are the server's to handle (it drains, and this process keeps
    # running its streams meanwhile); the process ends when the server closes its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    pipe = Connection(int(sys.argv[1]))
    # --listen PATH LOCK_FD: a shared engine; LOCK_FD is PATH's lock, held by the door that
    # started it, kept here until the first door has its answer
    listen, lock = (sys.argv[3], int(sys.argv[4])) if sys.argv[2:3] == ["--listen"] else (None, -1)
    host = None
    try:
        spec = _receive(pipe)
        try:
            host = _Host(pipe, spec)
            if listen is not None:
                host.listen(listen)
            answer = pickle.dumps((True, host.info()))
        except Exception as e:  # noqa: BLE001 - the server raises it as the load's error
            if host is not None:
                host.close()
                host = None
            try:
                answer = pickle.dumps((False, e))
            except Exception:  # noqa: BLE001 - an error that does not pickle
                answer = pickle.dumps((False, RuntimeError(f"{type(e).__name__}: {e}")))
        pipe.send_bytes(answer)
    except (EOFError, OSError):
        return  # the server that started it went away while it loaded: nobody to tell
    finally:
        if lock >= 0:
            os.close(lock)
    if host is None:
        pipe.close()
        return
    try:
        host.run(listen)
    finally:
        host.close()


if __name__ == "__main__":
    from echoic.server.core.engine_process import main as engine_main  # its classes, not __main__'s

    engine_main()
    os._exit(0)  # nothing left to flush: skip ONNX Runtime's, flashlight's and KenLM's teardown
