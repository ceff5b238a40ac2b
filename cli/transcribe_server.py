"""`echoic transcribe --server`: many files through a server, a few requests in flight.

The caller (cli/transcribe.py) has already dropped what an earlier run finished
and owns the writer; this writes one record per file in the same shape as
in-process transcription, or an error for a file the server (or the client)
cannot decode.

A busy server is waited for, not failed: a call refused with RESOURCE_EXHAUSTED
(the server is at `--max-streams`) or UNAVAILABLE (restarting, draining) is tried
again after a jittered exponential backoff (`RETRY`, bounded), each retry counted
in the summary; and a refusal for being full lowers how many calls this client
keeps in flight (`AdaptiveLimit`: down to what was open when the server said no,
then up by one after a window of successes, never above --concurrency), so a job
at --concurrency 16 against --max-streams 4 settles at about 4. A file still
refused after its retries fails this run without being recorded as failed (a rerun
tries it); a server still unavailable stops the job (exit 2), resumable.
"""

from __future__ import annotations

import argparse
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import grpc

from echoic.cli.batch_io import InInputOrder, Item, transcript_record
from echoic.cli.errors import JobError, UserError
from echoic.clients.audio import AudioFileError
from echoic.clients.client import Client, ClientError, RetryPolicy, Tries
from echoic.clients.messages import Recognition

BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED
# Statuses that say nothing about one file: the run cannot go on.
FATAL = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.CANCELLED,
}
# Each call's tries: about 50 s of backoff in all before a file counts as refused.
RETRY = RetryPolicy(
    attempts=15, initial_backoff=0.1, max_backoff=5.0, codes=(BUSY, grpc.StatusCode.UNAVAILABLE)
)
REQUEST_TIMEOUT = 600.0  # s per file, retries included


class AdaptiveLimit:
    """At most `limit` calls in flight, the limit following what the server admits:
    a refusal for being full lowers it to the calls still open then (the server held
    those), and `limit` successes in a row raise it by one, up to `ceiling`."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = self.limit = ceiling
        self.in_flight = 0
        self.lowest = ceiling  # the lowest the limit went, for the summary
        self._successes = 0
        self._closed = False
        self._cond = threading.Condition()

    def acquire(self) -> None:
        """Wait for a slot; Stopped once `close` was called."""
        with self._cond:
            while self.in_flight >= self.limit and not self._closed:
                self._cond.wait()
            if self._closed:
                raise Stopped
            self.in_flight += 1

    def close(self) -> None:
        """No more slots: whoever waits for one, or calls `acquire` later, gets Stopped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def release(self, *, refused: bool) -> None:
        with self._cond:
            self.in_flight -= 1
            if refused:
                self.limit = max(1, min(self.limit, self.in_flight))
                self.lowest = min(self.lowest, self.limit)
                self._successes = 0
            else:
                self._successes += 1
                if self._successes >= self.limit and self.limit < self.ceiling:
                    self.limit += 1
                    self._successes = 0
            self._cond.notify_all()


class Stopped(Exception):
    """The job is stopping (interrupted, or the server is gone): no more tries."""


def _error_message(path: str, error: Exception) -> str:
    message = str(error)
    return message if path in message else f"{path}: {message}"


def requested_decoder(args: argparse.Namespace) -> str:
    """--decoder as the server is asked for it: "auto" leaves it to the server (its
    --decoder), unless --no-lm or --beam-size say more. auto with --no-lm is greedy, as
    on the local path (cli/transcribe.py resolve_decoder: beam without an LM gains
    little); a --beam-size other than the default asks for beam, as `echoic stream`'s."""
    from echoic.model.core.decoding import DecoderConfig

    if args.decoder != "auto":
        return args.decoder
    if args.no_lm:
        return "greedy"
    if args.beam_size != DecoderConfig.beam_size:
        return "beam"
    return "auto"


class ServerTranscriber:
    """A connection to args.server, checked (the model served, the decoder options
    that apply there), then `transcribe` for a job's files."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.concurrency < 1:
            raise UserError(f"--concurrency must be at least 1, got {args.concurrency}")
        self.args = args
        self.retries = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set when the job stops: waits and retries end
        self._check_decoder_options()
        args.decoder = requested_decoder(args)
        try:
            self.client = Client(
                args.server, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                tls_server_name=args.tls_server_name, timeout=REQUEST_TIMEOUT,
                retry=RetryPolicy(attempts=1),  # retried here, counted and paced
            )  # fmt: skip
        except ClientError as e:
            raise UserError(str(e)) from e
        try:
            self.options, self.model = self._model_options()
        except BaseException:
            self.client.close()
            raise
        self.limit = AdaptiveLimit(args.concurrency)

    def _check_decoder_options(self) -> None:
        from echoic.model.core.decoding import DecoderConfig

        a, here = self.args, DecoderConfig()  # what the server's settings are compared with
        if a.lm or a.lm_weight != here.lm_weight or a.word_bonus != here.word_bonus:
            raise UserError(
                "--lm, --lm-weight and --word-bonus are set on the server (echoic serve);"
                " with --server only --decoder, --beam-size and --no-lm apply"
            )

    def decoder_settings(self) -> dict[str, object]:
        a = self.args
        if a.decoder == "auto":
            return {"decoder": "the server's default"}
        if a.decoder != "beam":
            return {"decoder": a.decoder}
        return {"decoder": a.decoder, "beam_size": a.beam_size, "lm": "off" if a.no_lm else
                "the server's"}  # fmt: skip

    def _call(self, fn, *, paced: bool = False, policy: RetryPolicy = RETRY) -> Any:
        """fn() with retries on a busy or unavailable server; with `paced`, in a slot of
        the adaptive limit."""
        tries = Tries(policy, REQUEST_TIMEOUT)
        while True:
            if paced:
                self.limit.acquire()
            refused = False
            try:
                return fn()
            except ClientError as e:
                refused = e.code == BUSY
                if (pause := tries.wait_after(e.code)) is None:
                    raise
                with self._lock:
                    self.retries += 1
            finally:
                if paced:
                    self.limit.release(refused=refused)
            if self._stop.wait(pause):  # a worker must not hold an interrupted job's exit
                raise Stopped

    def _model_options(self) -> tuple[dict[str, str], str]:
        """--model as a served model NAME or NAME/VERSION, checked against ListModels;
        and the "name/version" the job's record is keyed on."""
        a = self.args
        try:
            # The client's own policy: a server that is not there is said so within seconds.
            served = self._call(self.client.list_models, policy=RetryPolicy())
        except ClientError as e:
            raise JobError(str(e)) from e
        names = sorted({f"{m.name}/{m.version}" for m in served})
        if not a.model:
            return {}, names[0] if len(names) == 1 else "the server's default"
        name, _, version = a.model.partition("/")
        if not any(m.name == name and (not version or m.version == version) for m in served):
            raise UserError(
                f"the server at {a.server} does not serve model {a.model!r}"
                f" (it serves: {', '.join(names) or 'nothing'}); with --server, --model is"
                " a served NAME or NAME/VERSION"
            )
        return {"model": name, "model_version": version}, a.model

    def transcribe(self, items: list[Item], writer: InInputOrder, stats: Any, bar: Any) -> None:
        """Transcribe `items`; stats gains audio seconds and retries."""
        from echoic.model.core.decoding import FILE_ENDPOINTING

        a = self.args
        # Cut where the local path and the HTTP door cut (`FILE_ENDPOINTING`), so a long
        # recording gives the same words whichever way it is transcribed.
        options = dict(self.options, words=True,
                       trailing_silence_ms=round(FILE_ENDPOINTING.trailing_silence * 1000),
                       max_utterance_ms=round(FILE_ENDPOINTING.max_utterance * 1000))  # fmt: skip
        if a.decoder != "auto":  # auto: none named, so the server's own default (--decoder)
            options.update(decoder=a.decoder, beam_size=a.beam_size, disable_lm=a.no_lm)
        concurrency = self.args.concurrency
        pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="echoic-batch")

        def one(item: Item) -> Recognition:
            return self._call(lambda: self.client.recognize(item.path, **options),
                              paced=True)  # fmt: skip

        try:
            # At most 2 x concurrency submitted at a time: a huge folder queues no futures.
            queue = iter(items)
            pending: dict[Future[Recognition], Item] = {}
            while True:
                while len(pending) < 2 * concurrency:
                    item = next(queue, None)
                    if item is None:
                        break
                    pending[pool.submit(one, item)] = item
                if not pending:
                    break
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    self._finish(pending.pop(future), future, writer, stats)
                    if bar is not None:
                        bar.update(1)
        finally:
            stats.retries += self.retries
            self.retries = 0
            self._stop.set()
            self.limit.close()
            pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _finish(item: Item, future: Future, writer: InInputOrder, stats: Any) -> None:
        try:
            recognition = future.result()
        except ClientError as e:
            if e.code in FATAL:
                raise UserError(str(e)) from e
            writer.write_error(item, _error_message(item.path, e), transient=e.code == BUSY)
        except (AudioFileError, OSError, ValueError) as e:
            writer.write_error(item, _error_message(item.path, e))
        else:
            # The local job's check (numpy only; imported here, as client code loads no
            # echoic.model): a WAV cut short is transcribed as it is, but said so.
            from echoic.model.core.audio import truncation

            if warning := truncation(item.path):
                stats.warnings.append(warning)
                writer.say(f"echoic: warning: {warning}")
            stats.audio_seconds += recognition.audio_seconds
            record = transcript_record(item, recognition, recognition.audio_seconds,
                                       recognition.model)  # fmt: skip
            writer.write(item, record)

    def close(self) -> None:
        self.client.close()  # cancels what is still in flight
