"""Beam searches in decoder processes of their own (`echoic serve --beam-processes N`).

flashlight-text's beam decoder holds the interpreter lock for the whole of each call,
so beam searches run in the server's decoder threads still stall the event loop and
the engine's thread behind them. With `--beam-processes N` they run in N child
processes instead (`python -m echoic.server.core.beam_processes`, each talking to the
server over a socket pair), and a decoder thread of the server only waits on the
pipe, which releases the lock.

Server side:

- `BeamProcesses`: the N processes, started with the server and ended with it (or
  when the server process ends in any way: a child whose pipe closes exits).
- `RemoteBeamDecoder`: what `Recognizer` builds in place of `BeamSearchDecoder`
  (`Recognizer(..., beam_decoders=pool.decoder)`), with its `stream()` and `decode()`.
  The settings are checked here (`check_beam_settings`), so that a bad request is
  refused as an in-process decoder would refuse it; a decoder without boosted words
  is built at once in every process (each loads the LM once), one with boosted words
  (one request's) in the process its stream goes to.
- `RemoteBeamStream`: a `StreamingDecoder` whose `accept` and `finalize` are answered
  by a `BeamStream` in one process, the same one for the stream's whole life (the
  process with the fewest open streams when the stream first decodes). The results
  are that `BeamStream`'s own, bit for bit.

A process that dies fails the streams it holds (`BeamProcessDied`: the server
answers UNAVAILABLE, retry); the next stream that needs it gets a new one.

The messages are plain tuples of builtins, numpy arrays and `echoic.model.core`
objects (the child runs this module as __main__, whose classes the server could not
unpickle): a request `(op, drops, *args)`, where `drops` names the streams and
decoders the server has let go of, and a reply `(True, value)` or `(False, error)`.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from echoic.model.core.decoding import (
    BeamSearchDecoder,
    StreamingDecoder,
    Transcript,
    check_beam_settings,
)
from echoic.model.core.text import Vocabulary

log = logging.getLogger("echoic.server")

CHILD_MODULE = "echoic.server.core.beam_processes"
STOP_SECONDS = 5.0  # s a process gets to exit once its pipe closes, before it is killed


class BeamProcessDied(RuntimeError):
    """The decoder process that held a stream's beam search ended: that stream's decoding
    is lost (the server answers UNAVAILABLE; a new stream gets a working process)."""


# ------------------------------------------------------------------ the server's side


class _Child:
    """One decoder process, and the pipe to it; one request at a time."""

    def __init__(self, index: int) -> None:
        self.index = index
        mine, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
        self.pipe = Connection(mine.detach())
        self.lock = threading.Lock()
        self.dead = ""  # why it is gone; "" while it works
        self.open_streams = 0  # streams decoding here, count
        self.known: set[int] = set()  # decoders whose settings it has been sent
        self.drops: list[tuple[str, int]] = []  # ("stream" | "decoder", id) to let go of

    @property
    def pid(self) -> int:
        return self.process.pid

    def call(self, op: str, *args: Any) -> Any:
        """Send a request and wait for its reply (blocking on the pipe: the interpreter lock
        is free meanwhile); BeamProcessDied once the process has ended."""
        with self.lock:
            if not self.dead:
                drops, self.drops = self.drops, []
                try:
                    self.pipe.send((op, drops, *args))
                    ok, value = self.pipe.recv()
                except (EOFError, OSError):
                    self._died()
                else:
                    if ok:
                        return value
                    raise value
            raise BeamProcessDied(self.dead)

    def _died(self) -> None:
        code = self.process.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        self.dead = (
            f"the beam-search decoder process {self.index} (pid {self.pid}) {how}; the beam "
            "searches it held are lost: retry the stream"
        )
        log.error("%s (%d open)", self.dead, self.open_streams)

    def close(self) -> None:
        """Close the pipe (the process exits at its end), then wait for it, or kill it."""
        self.pipe.close()
        try:
            self.process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class BeamProcesses:
    """N decoder processes (`echoic serve --beam-processes N`); see the module docstring."""

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False
        self._ids = itertools.count(1)
        try:
            for index in range(1, processes + 1):
                self._children.append(_Child(index))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The decoder processes' pids, one per slot (a dead one's until it is replaced)."""
        return [c.pid for c in self._children]

    def next_id(self) -> int:
        return next(self._ids)

    def pick(self) -> _Child:
        """The process a new stream sticks to: the one with the fewest open streams, after
        replacing any that died."""
        with self._lock:
            if self._closed:
                raise BeamProcessDied("the server is stopping: its beam-search processes ended")
            for i, child in enumerate(self._children):
                if child.dead:
                    child.close()
                    self._children[i] = _Child(child.index)
                    log.info("started beam-search decoder process %d again", child.index)
            child = min(self._children, key=lambda c: c.open_streams)
            child.open_streams += 1
            return child

    def everyone(self) -> list[_Child]:
        with self._lock:
            return list(self._children)

    def decoder(self, vocab: Vocabulary, **settings: Any) -> RemoteBeamDecoder:
        """A beam decoder in these processes, built as `BeamSearchDecoder(vocab, ...)`."""
        return RemoteBeamDecoder(self, vocab, **settings)

    def close(self) -> None:
        """End every process (idempotent)."""
        with self._lock:
            self._closed = True
            children, self._children = self._children, []
        for child in children:
            child.close()


class RemoteBeamDecoder:
    """`BeamSearchDecoder`'s `stream()` and `decode()`, answered in the decoder processes."""

    def __init__(self, pool: BeamProcesses, vocab: Vocabulary, **settings: Any) -> None:
        check_beam_settings(vocab, settings.get("beam_size", 1), settings.get("boost", ()))
        self.vocab = vocab
        self.frame_seconds = settings["frame_seconds"]
        self._pool = pool
        self.id = pool.next_id()
        self._spec = (vocab, settings)
        if not settings.get("boost"):  # a request's own words are built where it decodes
            for child in pool.everyone():
                self.call(child, "prepare")
        weakref.finalize(self, _drop_everywhere, pool, self.id)

    def call(self, child: _Child, op: str, *args: Any) -> Any:
        """A request about this decoder; the process is sent its settings the first time."""
        spec = None if self.id in child.known else self._spec
        value = child.call(op, self.id, spec, *args)
        child.known.add(self.id)
        return value

    def stream(self) -> RemoteBeamStream:
        return RemoteBeamStream(self)

    def decode(self, log_probs: np.ndarray, n_best: int = 1) -> Transcript:
        child = self._pool.pick()
        try:
            return self.call(child, "decode", np.asarray(log_probs), n_best)
        finally:
            child.open_streams -= 1


def _drop_everywhere(pool: BeamProcesses, decoder_id: int) -> None:
    for child in pool.everyone():
        child.drops.append(("decoder", decoder_id))
        child.known.discard(decoder_id)


class RemoteBeamStream(StreamingDecoder):
    """One utterance's beam search, in the decoder process it first decodes in."""

    def __init__(self, decoder: RemoteBeamDecoder) -> None:
        super().__init__(decoder.vocab, decoder.frame_seconds)
        self._remote = decoder
        self._child: _Child | None = None
        self._id = decoder._pool.next_id()
        self._latest = Transcript("")
        self._release: weakref.finalize | None = None

    def _where(self) -> _Child:
        if self._child is None:
            child = self._child = self._remote._pool.pick()
            self._release = weakref.finalize(self, _release, child, self._id)
        return self._child

    def _accept(self, chunk: np.ndarray) -> None:
        self._latest = self._remote.call(self._where(), "accept", self._id, chunk)

    def _partial(self) -> Transcript:
        return self._latest

    def _finish(self) -> Transcript:
        try:
            return self._remote.call(self._where(), "finalize", self._id, self.n_best)
        finally:
            if self._release is not None:
                self._release()  # ended there: only the count is left to settle


def _release(child: _Child, stream_id: int) -> None:
    """A stream is done with its process: finalized, or let go of half way (a drop)."""
    child.open_streams -= 1
    child.drops.append(("stream", stream_id))


# ------------------------------------------------------------------ the process's side


def _serve(pipe: Connection) -> None:
    """Answer requests until the pipe closes."""
    decoders: dict[int, BeamSearchDecoder] = {}
    streams: dict[int, Any] = {}

    def decoder(decoder_id: int, spec: tuple | None) -> BeamSearchDecoder:
        if spec is not None and decoder_id not in decoders:
            vocab, settings = spec
            decoders[decoder_id] = BeamSearchDecoder(vocab, **settings)
        return decoders[decoder_id]

    def stream(decoder_id: int, spec: tuple | None, stream_id: int) -> Any:
        if stream_id not in streams:
            streams[stream_id] = decoder(decoder_id, spec).stream()
        return streams[stream_id]

    while True:
        try:
            op, drops, *args = pipe.recv()
        except EOFError:
            return
        for kind, key in drops:
            (streams if kind == "stream" else decoders).pop(key, None)
        try:
            if op == "prepare":
                decoder(*args)
                value = None
            elif op == "accept":
                decoder_id, spec, stream_id, chunk = args
                value = stream(decoder_id, spec, stream_id).accept(chunk)
            elif op == "finalize":
                decoder_id, spec, stream_id, n_best = args
                s = stream(decoder_id, spec, stream_id)
                s.n_best = n_best
                value = s.finalize()
                del streams[stream_id]
            elif op == "decode":
                decoder_id, spec, log_probs, n_best = args
                value = decoder(decoder_id, spec).decode(log_probs, n_best)
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as e:  # noqa: BLE001 - the server raises it where it asked
            reply = (False, e)
        else:
            reply = (True, value)
        try:
            pipe.send(reply)
        except Exception as e:  # noqa: BLE001 - an error that does not pickle
            pipe.send((False, RuntimeError(f"{type(e).__name__}: {e}")))


def main() -> None:
    # Ctrl-C and SIGTERM are the server's to handle (it drains, and these processes keep
    # decoding its streams meanwhile); a child ends when the server closes its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pipe = Connection(int(sys.argv[1]))
    try:
        _serve(pipe)
    finally:
        pipe.close()


if __name__ == "__main__":
    main()
    os._exit(0)  # nothing left to flush: skip flashlight's and KenLM's teardown
