"""Streaming load: how many real-time streams one server sustains, with and without batching.

    python bench/serve_load.py [--model DIR] [--streams 1,8,32,64,128] [--seconds 20]
                               [--max-batch 32] [--max-wait-ms 0] [--manifest FILE]

Starts `echoic serve` in a subprocess on a free loopback port (once with
--max-batch, once with batching off: max batch 1), and for each level N runs N
concurrent StreamingRecognize calls from one asyncio process. Each stream sends
utterances back to back at real time in --chunk-ms chunks (starts staggered over
one second) until the level's --seconds are up. Audio: --manifest, or a few
sentences synthesized once with `echoic synth` into a temporary folder.

Per level it prints:
  kept up     streams whose results kept pace with their audio: every result came
              within --lag-limit s of the audio it covers having been sent (beyond
              the model's lookahead), and no call failed
  interim     latency of interim results: receipt - when the last audio they cover
              was sent, ms (p50/p95/p99; the model's lookahead is part of it)
  final       end of audio (half-close) -> final result, ms (p50/p95/p99)
  batch       mean streams per model call (the server's echoic_batch_size histogram)
  srv/cli CPU CPU seconds per wall second of the server and of this client process,
              % of one core (both share the machine's cores)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import soundfile as sf

from echoic.clients import AsyncClient, ClientError, RetryPolicy

SENTENCES = """\
The quick brown fox jumps over the lazy dog.
She sells sea shells by the sea shore.
A journey of a thousand miles begins with a single step.
Time flies like an arrow and fruit flies like a banana.
Actions speak louder than words.
Every cloud has a silver lining.
Good things come to those who wait.
Make hay while the sun shines over the fields.
"""
ECHOIC = [sys.executable, "-m", "echoic.cli.main"]
RATE = 16000  # Hz of the audio sent (synth writes 16 kHz mono)


# ------------------------------------------------------------------ audio


@dataclass(frozen=True)
class Utterance:
    chunks: tuple[bytes, ...]  # PCM16 pieces of --chunk-ms
    seconds: tuple[float, ...]  # audio in each piece, s


def synthesize(workdir: Path, count: int) -> Path:
    text = workdir / "sentences.txt"
    text.write_text(SENTENCES)
    out = workdir / "corpus"
    subprocess.run(
        [*ECHOIC, "synth", "--text", str(text), "--out", str(out), "--limit", str(count),
         "--jobs", "1"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out / "manifest.jsonl"


def load_utterances(manifest: Path, chunk_ms: float, limit: int) -> list[Utterance]:
    utterances = []
    for line in manifest.read_text().splitlines()[:limit]:
        path = Path(json.loads(line)["audio_filepath"])
        path = path if path.is_absolute() else manifest.parent / path
        audio, rate = sf.read(path, dtype="int16", always_2d=True)
        if rate != RATE or audio.shape[1] != 1:
            raise SystemExit(f"{path}: the load test sends 16 kHz mono audio, got {rate} Hz")
        step = round(RATE * chunk_ms / 1000)
        pieces = [audio[i : i + step] for i in range(0, len(audio), step)]
        utterances.append(
            Utterance(tuple(p.tobytes() for p in pieces), tuple(len(p) / RATE for p in pieces))
        )
    return utterances


# ------------------------------------------------------------------ server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    target: str
    metrics_url: str

    def cpu_seconds(self) -> float:
        """User + system CPU of the server process so far, s (Linux /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def batch_histogram(self) -> tuple[float, float]:
        """(sum, count) of echoic_batch_size over all models."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        total = {"_sum": 0.0, "_count": 0.0}
        for line in text.splitlines():
            for suffix in total:
                if line.startswith(f"echoic_batch_size{suffix}"):
                    total[suffix] += float(line.rsplit(" ", 1)[1])
        return total["_sum"], total["_count"]


def start_server(
    model: str | None, max_batch: int, max_wait_ms: float, max_streams: int, threads: int, log,
    extra: tuple[str, ...] | list[str] = (),
) -> Server:  # fmt: skip
    port, metrics_port = free_port(), free_port()
    cmd = [*ECHOIC, "serve", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", str(metrics_port), "--max-batch", str(max_batch),
           "--max-wait-ms", str(max_wait_ms), "--max-streams", str(max_streams),
           "--grace-seconds", "5", "--log-level", "warning", "--threads", str(threads)]  # fmt: skip
    if model:
        cmd += ["--model", model]
    cmd += list(extra)
    if "--http-port" not in cmd:
        cmd += ["--http-port", "0"]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return Server(process, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=10)


# ------------------------------------------------------------------ streams


@dataclass
class StreamStats:
    interim: list[float] = field(default_factory=list)  # s
    final: list[float] = field(default_factory=list)  # s
    worst_lag: float = 0.0  # s beyond the model's lookahead
    error: str = ""


async def one_stream(
    client: AsyncClient,
    utterances: list[Utterance],
    first: int,
    start_delay: float,
    deadline: float,
    lookahead: float,
) -> StreamStats:
    loop = asyncio.get_running_loop()
    stats = StreamStats()
    await asyncio.sleep(start_delay)
    index = first
    while loop.time() < deadline and not stats.error:
        utt = utterances[index % len(utterances)]
        index += 1
        ends = list(np.cumsum(utt.seconds))  # audio sent after each chunk, s
        sent_at: list[float] = []  # when each chunk was handed to gRPC

        async def chunks(utt=utt, ends=ends, sent_at=sent_at):
            start = loop.time()
            for chunk, end in zip(utt.chunks, ends, strict=True):
                delay = start + end - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent_at.append(loop.time())
                yield chunk

        try:
            async for response in client.stream(
                chunks(), encoding="linear16", sample_rate=RATE, interim_results=True,
                words=False,
            ):  # fmt: skip
                now = loop.time()
                for result in response.results:
                    if result.is_final:
                        latency = now - sent_at[-1]
                        stats.final.append(latency)
                    else:
                        k = bisect.bisect_left(ends, response.audio_processed_seconds - 1e-6)
                        covered = sent_at[min(k, len(sent_at) - 1)]
                        latency = now - covered
                        stats.interim.append(latency)
                        latency -= lookahead
                    stats.worst_lag = max(stats.worst_lag, latency)
        except ClientError as e:
            stats.error = f"{e.code.name if e.code else 'ERROR'}: {e}"
    return stats


@dataclass
class Level:
    streams: int
    kept_up: int
    interim: list[float]
    final: list[float]
    mean_batch: float
    server_cpu: float  # % of one core
    client_cpu: float  # % of one core
    errors: list[str]


async def run_level(
    server: Server, client: AsyncClient, utterances, n: int, seconds: float, lag_limit: float,
    lookahead: float,
) -> Level:  # fmt: skip
    loop = asyncio.get_running_loop()
    batch0, cpu0, own0, wall0 = (
        server.batch_histogram(), server.cpu_seconds(), time.process_time(), time.monotonic(),
    )  # fmt: skip
    deadline = loop.time() + seconds
    rng = random.Random(n)
    tasks = [
        one_stream(client, utterances, rng.randrange(len(utterances)), rng.random(), deadline,
                   lookahead)
        for _ in range(n)
    ]  # fmt: skip
    # Bounded: the longest utterance after the deadline, plus slack for a slow server.
    longest = max(sum(u.seconds) for u in utterances)
    results = await asyncio.wait_for(asyncio.gather(*tasks), seconds + 2 * longest + 30)
    wall = time.monotonic() - wall0
    batch1 = server.batch_histogram()
    calls = batch1[1] - batch0[1]
    return Level(
        streams=n,
        kept_up=sum(1 for s in results if not s.error and s.final and s.worst_lag <= lag_limit),
        interim=[x for s in results for x in s.interim],
        final=[x for s in results for x in s.final],
        mean_batch=(batch1[0] - batch0[0]) / calls if calls else 0.0,
        server_cpu=100 * (server.cpu_seconds() - cpu0) / wall,
        client_cpu=100 * (time.process_time() - own0) / wall,
        errors=sorted({s.error for s in results if s.error}),
    )


async def wait_until_serving(server: Server, client: AsyncClient, timeout: float = 120.0):
    """The served model, once the server answers; fails at once if the server exits."""
    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.process.returncode}")
        try:
            (model,) = await client.list_models(timeout=5)
            return model
        except ClientError as e:
            if e.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)


async def bench_server(server: Server, utterances, args, lag_limit: float) -> list[Level]:
    async with AsyncClient(server.target, retry=RetryPolicy(attempts=1), timeout=90) as client:
        model = await wait_until_serving(server, client)
        lookahead = model.lookahead_seconds
        print(
            f"  model {model.name}/{model.version}: {model.rnn_type}, chunk"
            f" {1000 * model.chunk_seconds:.0f} ms, lookahead {1000 * lookahead:.0f} ms",
            file=sys.stderr,
        )
        warm = utterances[0]
        async for _ in client.stream(warm.chunks, sample_rate=RATE, words=False):
            pass
        levels = []
        for n in args.streams:
            levels.append(
                await run_level(server, client, utterances, n, args.seconds, lag_limit, lookahead)
            )
            print(f"  {n} streams done", file=sys.stderr, flush=True)
        return levels


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    p = np.percentile(np.asarray(values) * 1000, [50, 95, 99])
    return "/".join(f"{v:.0f}" for v in p)


def print_table(runs: dict[str, list[Level]]) -> None:
    header = (
        f"{'streams':>7}  {'mode':<11} {'kept up':>8}  {'interim ms p50/95/99':>20}"
        f"  {'final ms p50/95/99':>18}  {'batch':>5}  {'srv CPU':>7}  {'cli CPU':>7}  errors"
    )
    print(header)
    print("-" * len(header))
    levels = zip(*runs.values(), strict=True)
    for row in levels:
        for mode, level in zip(runs, row, strict=True):
            print(
                f"{level.streams:>7}  {mode:<11} {f'{level.kept_up}/{level.streams}':>8}"
                f"  {percentiles(level.interim):>20}  {percentiles(level.final):>18}"
                f"  {level.mean_batch:>5.1f}  {level.server_cpu:>6.0f}%  {level.client_cpu:>6.0f}%"
                f"  {'; '.join(level.errors)[:60]}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="exported model directory (default: the bundled model)")
    p.add_argument("--streams", default="1,8,32,64,128", help="comma-separated levels")
    p.add_argument("--seconds", type=float, default=20.0, help="duration of each level, s")
    p.add_argument("--max-batch", type=int, default=32, help="batched run's max batch")
    p.add_argument("--max-wait-ms", type=float, default=0.0,
                   help="batched run: ms the server waits for a fuller batch")  # fmt: skip
    p.add_argument("--no-unbatched", action="store_true", help="skip the max-batch 1 run")
    p.add_argument("--threads", type=int, default=0,
                   help="server's ONNX Runtime threads per operator (0: its default)")  # fmt: skip
    p.add_argument("--chunk-ms", type=float, default=100.0, help="audio per message, ms")
    p.add_argument("--lag-limit", type=float, default=1.0,
                   help="s a result may trail its audio (beyond lookahead)")  # fmt: skip
    p.add_argument("--manifest", help="utterances to send (default: synthesize a few)")
    p.add_argument("--utterances", type=int, default=8, help="distinct utterances, count")
    args = p.parse_args()
    args.streams = [int(n) for n in args.streams.split(",")]
    if min(args.streams) < 1 or args.seconds <= 0:
        p.error("--streams must be positive counts and --seconds > 0")

    with tempfile.TemporaryDirectory(prefix="echoic-load-") as tmp:
        manifest = Path(args.manifest) if args.manifest else synthesize(Path(tmp), args.utterances)
        utterances = load_utterances(manifest, args.chunk_ms, args.utterances)
        audio = sum(sum(u.seconds) for u in utterances)
        print(
            f"{len(utterances)} utterances ({audio:.1f} s), {args.chunk_ms:g} ms chunks,"
            f" {args.seconds:g} s per level, {os.cpu_count()} CPUs",
            file=sys.stderr,
        )
        modes = {f"batch {args.max_batch}": args.max_batch}
        if not args.no_unbatched and args.max_batch != 1:
            modes["batch 1"] = 1
        runs: dict[str, list[Level]] = {}
        for mode, max_batch in modes.items():
            print(f"{mode}:", file=sys.stderr, flush=True)
            with open(Path(tmp) / f"server-{max_batch}.log", "wb") as log:
                wait_ms = args.max_wait_ms if max_batch > 1 else 0.0
                server = start_server(
                    args.model, max_batch, wait_ms, max(args.streams) + 8, args.threads, log
                )
                try:
                    runs[mode] = asyncio.run(bench_server(server, utterances, args, args.lag_limit))
                except (RuntimeError, ClientError, asyncio.TimeoutError) as e:
                    log.flush()
                    tail = (Path(tmp) / f"server-{max_batch}.log").read_text()[-2000:]
                    print(f"server log (tail):\n{tail}", file=sys.stderr)
                    raise SystemExit(f"serve_load: {mode}: {e or type(e).__name__}") from e
                finally:
                    stop_server(server)
        print_table(runs)


if __name__ == "__main__":
    main()
