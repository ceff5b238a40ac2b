"""Batch dispatch: one queue and one loop per loaded model version.

Every stream with work ready (new audio to turn into features, a window for
the model), and every Recognize request (run as a stream fed all its audio at
once), puts that step in its model version's queue and awaits it. The
dispatcher loop takes whatever is queued the moment the engine is free (up to
`max_batch` streams; with `max_wait_ms` > 0 it first waits that long for a
fuller batch), runs ONE batched `Recognizer.step` - the new feature frames of
all its streams in one batch, a single stream.onnx call - and then each greedy
stream's `Stream.settle` (its decoding, the endpoint test, an ended utterance
finalized), all in one worker-thread call, and hands each stream what its step
gave (`Stepped`). A beam search's step only queues its rows: the dispatcher
settles such a stream in the decoder pool, beside the batch, so neither the batch
nor the event loop waits for a beam, and hands it what it gave once that is done.
Either way a stream awaits once per step. Under light load a window waits for
nobody; under heavy load batches grow instead of queues.

A stream has at most one step in the queue (it awaits each), so a stream with
several windows ready takes one per batch and cannot starve the others; only a
finished greedy stream's last window runs at once after its batch, in a round of its
own with the batch's other such windows, so that the final result waits for one
hand-over, not a second turn in the queue. Full
utterances of a model that cannot stream (no stream.onnx) go through the same
queue as offline jobs: `Recognizer.log_probs` computes their features and runs
them as one batch through model.onnx, and their transcripts are decoded in the
decoder pool (`decode_whole`). The dispatcher calls `Recognizer` and `Stream` and
nothing below them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from echoic.model.core.decoding import Transcript
from echoic.model.runtime.recognizer import Recognizer, Stepped, Stream
from echoic.server.metrics import Metrics

log = logging.getLogger("echoic.server")


class DispatcherClosed(Exception):
    """The model version was unloaded or the server is stopping."""


@dataclass
class _Work:
    kind: str  # "stream": one step of `payload` (a Stream); "offline": samples (N,)
    payload: Any
    future: asyncio.Future
    queued_at: float = field(default_factory=time.perf_counter)


class Dispatcher:
    def __init__(
        self,
        recognizer: Recognizer,
        *,
        max_batch: int,
        max_wait_ms: float,
        executor: Executor,
        decoders: Executor,
        metrics: Metrics,
        labels: tuple[str, str],
    ) -> None:
        """executor: where batches run (one at a time); decoders: where beam searches and
        whole utterances are decoded, beside the batches."""
        self._recognizer = recognizer
        self._max_batch = max_batch
        self._max_wait = max_wait_ms / 1000.0
        self._executor = executor
        self._decoders = decoders
        self._metrics = metrics
        self._labels = labels
        chunk_frames = recognizer.card.chunk_frames or 1
        self._window_seconds = chunk_frames * recognizer.frame_seconds  # audio per window, s
        self._queue: deque[_Work] = deque()
        self._inflight: list[_Work] = []  # the batch in the engine now
        self._wakeup = asyncio.Event()
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"dispatch {labels}")

    async def step(self, stream: Stream) -> Stepped:
        """Run the stream's next step in the next batch, and settle it (`Stream.settle`:
        in the batch's worker thread, or a deferred stream's in the decoder pool); what
        the step gave."""
        return await self._submit("stream", stream)

    async def offline(self, audio: np.ndarray) -> np.ndarray:
        """Log-probs (T', V) of one whole utterance (float32 samples at the model's rate),
        its features and model.onnx batched with the other utterances queued."""
        return await self._submit("offline", audio)

    async def decode_whole(
        self, recognizer: Recognizer, log_probs: np.ndarray, n_best: int
    ) -> Transcript:
        """One whole utterance's transcript (a model that cannot stream), in the decoder pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._decoders, recognizer.decode, log_probs, n_best)

    async def _submit(self, kind: str, payload: Any) -> Any:
        if self._closed:
            raise DispatcherClosed("the model version is unloading")
        work = _Work(kind, payload, asyncio.get_running_loop().create_future())
        self._queue.append(work)
        self._wakeup.set()
        return await work.future

    async def close(self) -> None:
        """Stop the loop; queued work fails with DispatcherClosed."""
        self._closed = True
        inflight = list(self._inflight)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        for work in [*inflight, *self._queue]:
            if not work.future.done():
                work.future.set_exception(DispatcherClosed("the model version was unloaded"))
        self._queue.clear()

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                if self._max_wait and len(self._queue) < self._max_batch:
                    await self._wait_for_more()
                batch = self._take_batch()
                if not batch:
                    continue
                self._inflight = batch
                started = time.perf_counter()
                for work in batch:
                    self._metrics.queue_wait.labels(*self._labels).observe(started - work.queued_at)
                rounds: list[tuple[int, float]] = []  # its last-window rounds: (streams, s)
                try:
                    results = await loop.run_in_executor(
                        self._executor, self._run_batch, batch, rounds
                    )
                except Exception as e:  # noqa: BLE001 - handed to every waiting stream
                    log.exception("batched model call failed (%d items)", len(batch))
                    for work in batch:
                        if not work.future.done():
                            work.future.set_exception(e)
                    continue
                finally:
                    self._inflight = []
                compute = time.perf_counter() - started - sum(t for _, t in rounds)
                self._observe(batch, compute)
                for size, seconds in rounds:  # each a model call: a batch of its own
                    observe_batch(self._metrics, self._labels, size, seconds,
                                  size * self._window_seconds)  # fmt: skip
                for work, result in zip(batch, results, strict=True):
                    if work.future.done():  # a cancelled client's window is dropped
                        continue
                    if isinstance(result, Exception):  # its last window's round failed
                        work.future.set_exception(result)
                    elif work.kind == "stream" and work.payload.deferred:
                        self._settle_beside(work, loop)
                    else:
                        work.future.set_result(result)

    def _settle_beside(self, work: _Work, loop: asyncio.AbstractEventLoop) -> None:
        """A deferred stream (a beam search) settled in the decoder pool, its waiter
        woken with what it gave (or its error) once that is done."""
        settled = loop.run_in_executor(self._decoders, work.payload.settle)

        def hand_over(done: asyncio.Future) -> None:
            if work.future.done():
                if not done.cancelled():
                    done.exception()  # its client is gone: retrieved, not logged as lost
            elif done.cancelled():
                work.future.cancel()
            elif (error := done.exception()) is not None:
                work.future.set_exception(error)
            else:
                work.future.set_result(done.result())

        settled.add_done_callback(hand_over)

    async def _wait_for_more(self) -> None:
        deadline = time.perf_counter() + self._max_wait
        while len(self._queue) < self._max_batch:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except TimeoutError:
                return

    def _take_batch(self) -> list[_Work]:
        """Up to max_batch live items of the kind at the head of the queue (a gone client's
        items dropped)."""
        return take_batch(self._queue, self._max_batch, gone=lambda work: work.future.done())

    def _run_batch(self, batch: Sequence[_Work], rounds: list[tuple[int, float]]) -> list[Any]:
        """In a worker thread: one batched model call for the whole batch, then every
        stream settled that decodes in the batch (a greedy one), so its waiter gets what
        its step gave in one hand-over; the last-window rounds after it (their sizes and
        times into `rounds`, for the metrics)."""
        if batch[0].kind == "stream":
            streams: list[Stream] = [work.payload for work in batch]
            self._recognizer.step(streams)
            results = [None if s.deferred else s.settle() for s in streams]
            # A finished greedy stream's last window at once, in a round of its own with
            # the others', its results joined to the step's: one hand-over, not a second
            # wait in the queue (beam streams settle beside, and step again from there).
            tails = [i for i, s in enumerate(streams) if not s.deferred and s.finishing]
            while tails:
                began = time.perf_counter()
                try:
                    self._recognizer.step([streams[i] for i in tails])
                    for i in tails:
                        results[i] = results[i].then(streams[i].settle())
                    rounds.append((len(tails), time.perf_counter() - began))
                except Exception as e:  # noqa: BLE001 - theirs alone: the rest keep their steps
                    log.exception("a finished stream's last window failed (%d streams)", len(tails))
                    for i in tails:
                        results[i] = e
                    break
                tails = [i for i in tails if streams[i].finishing]
            return results
        return self._recognizer.log_probs([work.payload for work in batch])

    def _observe(self, batch: Sequence[_Work], compute: float) -> None:
        if batch[0].kind == "stream":
            audio = len(batch) * self._window_seconds
        else:
            rate = self._recognizer.sample_rate
            audio = sum(len(work.payload) for work in batch) / rate
        observe_batch(self._metrics, self._labels, len(batch), compute, audio)


def take_batch(queue: deque, max_batch: int, gone: Callable[[Any], bool] | None = None) -> list:
    """Up to max_batch items (each with a `kind`) of the kind at the head of `queue`, taken
    in order; the other kinds keep their places, and items `gone` says are gone are dropped.
    The one batching rule of the thread engine (`Dispatcher`) and the engine process."""
    batch: list = []
    rest: deque = deque()
    kind = None
    while queue and len(batch) < max_batch:
        item = queue.popleft()
        if gone is not None and gone(item):
            continue
        kind = kind or item.kind
        (batch if item.kind == kind else rest).append(item)
    queue.extendleft(reversed(rest))
    return batch


def observe_batch(
    metrics: Metrics, labels: tuple[str, str], size: int, compute: float, audio: float
) -> None:
    """One batch in the metrics: its size, its compute time (s) and, for `audio` s of audio
    > 0, its real-time factor."""
    metrics.batch_size.labels(*labels).observe(size)
    metrics.compute.labels(*labels).observe(compute)
    if audio > 0:
        metrics.real_time_factor.labels(*labels).observe(compute / audio)
