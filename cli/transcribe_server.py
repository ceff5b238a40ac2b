"""`echoic transcribe --server`: many files through a server, a few requests in flight.

The caller (cli/transcribe.py) has already dropped what an earlier run finished
and owns the OutputWriter; this writes one record per file in the same shape as
in-process transcription, or an error line for a file the server (or the client)
cannot decode. Server-wide trouble (unreachable after retries, refused
credentials) stops the run instead of failing every remaining file; rerunning
resumes it.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import grpc

from echoic.cli.batch_io import Item, OutputWriter, transcript_record
from echoic.cli.errors import UserError
from echoic.clients.audio import AudioFileError
from echoic.clients.client import Client, ClientError
from echoic.clients.messages import Recognition

# Statuses that say nothing about one file: the run cannot go on.
FATAL = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.CANCELLED,
}
REQUEST_TIMEOUT = 600.0  # s per file, retries included


def _model_options(args: argparse.Namespace, client: Client) -> dict[str, str]:
    """--model as a served model NAME or NAME/VERSION, checked against ListModels."""
    try:
        served = client.list_models()
    except ClientError as e:
        raise UserError(str(e)) from e
    names = sorted({f"{m.name}/{m.version}" for m in served})
    if not args.model:
        return {}
    name, _, version = args.model.partition("/")
    if not any(m.name == name and (not version or m.version == version) for m in served):
        raise UserError(
            f"the server at {args.server} does not serve model {args.model!r}"
            f" (it serves: {', '.join(names) or 'nothing'}); with --server, --model is"
            " a served NAME or NAME/VERSION"
        )
    return {"model": name, "model_version": version}


def _decoder_options(args: argparse.Namespace) -> dict[str, object]:
    from echoic.model.core.decoding import DecoderConfig

    here = DecoderConfig()  # what the server's settings are compared with
    if args.lm or args.lm_weight != here.lm_weight or args.word_bonus != here.word_bonus:
        raise UserError(
            "--lm, --lm-weight and --word-bonus are set on the server (echoic serve);"
            " with --server only --decoder, --beam-size and --no-lm apply"
        )
    return {"decoder": args.decoder, "beam_size": args.beam_size, "disable_lm": args.no_lm}


def _error_message(path: str, error: Exception) -> str:
    message = str(error)
    return message if path in message else f"{path}: {message}"


def transcribe_with_server(
    args: argparse.Namespace, items: list[Item], writer: OutputWriter
) -> tuple[int, float, float]:
    """Transcribe `items` through args.server -> (failed files, audio s, elapsed s)."""
    started = time.perf_counter()
    if args.concurrency < 1:
        raise UserError(f"--concurrency must be at least 1, got {args.concurrency}")
    try:
        client = Client(
            args.server, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_server_name=args.tls_server_name, timeout=REQUEST_TIMEOUT,
        )  # fmt: skip
    except ClientError as e:
        raise UserError(str(e)) from e
    bar = None
    failed, seconds = 0, 0.0
    pool = ThreadPoolExecutor(max_workers=args.concurrency, thread_name_prefix="echoic-batch")
    try:
        options = {**_model_options(args, client), **_decoder_options(args)}
        if not args.no_progress and items:
            from tqdm import tqdm

            bar = tqdm(total=len(items), unit="file", file=sys.stderr, dynamic_ncols=True)

        def one(item: Item) -> Recognition:
            return client.recognize(item.path, words=True, **options)

        # At most 2 x concurrency submitted at a time: a huge folder queues no futures.
        queue = iter(items)
        pending: dict[Future[Recognition], Item] = {}
        while True:
            while len(pending) < 2 * args.concurrency:
                item = next(queue, None)
                if item is None:
                    break
                pending[pool.submit(one, item)] = item
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                item = pending.pop(future)
                try:
                    recognition = future.result()
                except ClientError as e:
                    if e.code in FATAL:
                        raise UserError(str(e)) from e
                    writer.write_error(item.path, _error_message(item.path, e))
                    failed += 1
                except (AudioFileError, OSError, ValueError) as e:
                    writer.write_error(item.path, _error_message(item.path, e))
                    failed += 1
                else:
                    seconds += recognition.audio_seconds
                    writer.write(
                        transcript_record(
                            item.path, recognition, recognition.audio_seconds, recognition.model
                        )
                    )
                if bar is not None:
                    bar.update(1)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        client.close()  # cancels what is still in flight
        if bar is not None:
            bar.close()
    return failed, seconds, time.perf_counter() - started
