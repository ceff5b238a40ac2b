"""Soak: good streams beside hostile clients for minutes, against one `echoic serve`.

    python bench/soak.py [--minutes 10] [--streams 64] [--hostile 0.1] [--model DIR]

Starts `echoic serve` in a subprocess (as bench/serve_load.py does) and, from this
process, runs `--streams` concurrent clients for `--minutes`: a fraction `--hostile`
of them hostile, the rest good. Good clients stream real speech at real time,
utterance after utterance, and time end of audio -> final result. Hostile ones take
turns at: messages that do not parse, streams cancelled half way, beam search at the
server's largest beam, audio longer than the server accepts, garbage bytes as WAV,
and a sender that trickles bytes. Run it twice (`--hostile 0` for the baseline) to
compare the good streams' latency with and without hostile traffic.

Prints, per minute: good utterances finished, their final-result latency p50/p95,
good calls that failed, the server's RSS; then calls by kind and status code, and
RSS after warm-up, at the end and at its peak.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from serve_load import (
    RATE,
    Server,
    load_utterances,
    start_server,
    stop_server,
    synthesize,
    wait_until_serving,
)

from echoic.clients import AsyncClient, ClientError, RetryPolicy

HOSTILE_KINDS = ("malformed", "cancel", "beam", "too-long", "garbage", "trickle")
MAX_AUDIO_SECONDS = 30.0  # the server's --max-audio-seconds here, s


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Record:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.finals: list[tuple[float, float]] = []  # (seconds since start, latency s)
        self.good_failures: list[tuple[float, str]] = []
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def minute(self, at: float) -> int:
        return int((at - self.start) // 60)


async def realtime(chunks, sent_at: list[float]):
    loop = asyncio.get_running_loop()
    start, sent = loop.time(), 0.0
    for chunk in chunks:
        sent += len(chunk) / 2 / RATE
        delay = start + sent - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent_at.append(time.monotonic())
        yield chunk


async def good(client: AsyncClient, utterances, first: int, deadline: float, rec: Record):
    index = first
    await asyncio.sleep(random.random())
    while time.monotonic() < deadline:
        utt = utterances[index % len(utterances)]
        index += 1
        sent_at: list[float] = []
        try:
            async for response in client.stream(
                realtime(utt.chunks, sent_at), sample_rate=RATE, interim_results=False,
                words=False,
            ):  # fmt: skip
                if response.results and response.results[0].is_final:
                    now = time.monotonic()
                    rec.finals.append((now - rec.start, now - sent_at[-1]))
            rec.calls["good", "OK"] += 1
        except ClientError as e:
            code = e.code.name if e.code else "ERROR"
            rec.calls["good", code] += 1
            rec.good_failures.append((time.monotonic() - rec.start, f"{code}: {e}"))


async def hostile(client: AsyncClient, channel: grpc.aio.Channel, utterances, n: int,
                  deadline: float, rec: Record) -> None:  # fmt: skip
    rng = random.Random(n)
    raw_recognize = channel.unary_unary("/echoic.v1.Transcriber/Recognize")
    pcm = b"".join(utterances[n % len(utterances)].chunks)
    while time.monotonic() < deadline:
        kind = HOSTILE_KINDS[rng.randrange(len(HOSTILE_KINDS))]
        code = "OK"
        try:
            if kind == "malformed":
                await raw_recognize(rng.randbytes(rng.randrange(1, 64)), timeout=30)
            elif kind == "cancel":
                stream = client.stream(
                    realtime(utterances[0].chunks, []), sample_rate=RATE, interim_results=True
                )
                async for _ in stream:
                    break  # the first interim result: go away
                await stream.aclose()
                code = "CANCELLED"
            elif kind == "beam":
                await client.recognize(
                    pcm, encoding="linear16", sample_rate=RATE, decoder="beam", beam_size=64
                )
            elif kind == "too-long":
                silence = bytes(int(2 * RATE * (MAX_AUDIO_SECONDS + 5)))
                await client.recognize(silence, encoding="linear16", sample_rate=RATE)
            elif kind == "garbage":
                await client.recognize(b"RIFF" + rng.randbytes(4000), encoding="wav")
            else:  # trickle: a few bytes a second, until the idle timeout or the end

                async def slow():
                    for _ in range(20):
                        await asyncio.sleep(0.5)
                        yield b"\0\0"

                async for _ in client.stream(slow(), sample_rate=RATE):
                    pass
        except ClientError as e:
            code = e.code.name if e.code else "ERROR"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        rec.calls[kind, code] += 1


async def soak(server: Server, utterances, args) -> tuple[Record, list[tuple]]:
    n_hostile = round(args.streams * args.hostile)
    target, pid = server.target, server.process.pid
    samples: list[tuple[float, float]] = []  # (seconds since start, RSS MB)
    async with AsyncClient(target, retry=RetryPolicy(attempts=1), timeout=60) as client:
        await wait_until_serving(server, client)
        rec = Record()
        deadline = time.monotonic() + 60 * args.minutes
        async with grpc.aio.insecure_channel(target) as channel:
            tasks = [
                good(client, utterances, i, deadline, rec) for i in range(args.streams - n_hostile)
            ] + [hostile(client, channel, utterances, i, deadline, rec) for i in range(n_hostile)]

            async def sample_rss() -> None:
                while time.monotonic() < deadline + 5:
                    samples.append((time.monotonic() - rec.start, rss_mb(pid)))
                    await asyncio.sleep(1.0)

            await asyncio.gather(sample_rss(), *tasks)
    return rec, samples


def report(rec: Record, samples: list[tuple[float, float]], args) -> None:
    minutes = int(np.ceil(args.minutes))
    print(f"{args.streams} streams, {args.hostile:.0%} hostile, {args.minutes:g} min")
    print(
        f"{'minute':>6}  {'finals':>6}  {'final ms p50/p95':>16}  {'good failed':>11}"
        f"  {'RSS MB':>7}"
    )
    for m in range(minutes):
        lat = [x for t, x in rec.finals if int(t // 60) == m]
        failed = sum(1 for t, _ in rec.good_failures if int(t // 60) == m)
        rss = [r for t, r in samples if int(t // 60) == m]
        pct = "-" if not lat else "/".join(f"{v:.0f}" for v in np.percentile(lat, [50, 95]) * 1000)
        print(f"{m + 1:>6}  {len(lat):>6}  {pct:>16}  {failed:>11}  {max(rss, default=0):>7.0f}")
    print()
    print(f"{'calls':<10} {'status':<20} {'count':>6}")
    for (kind, code), count in sorted(rec.calls.items()):
        print(f"{kind:<10} {code:<20} {count:>6}")
    warm = [r for t, r in samples if t >= 60] or [r for _, r in samples]
    print()
    print(
        f"RSS MB: after warm-up (1 min) {warm[0]:.0f}, end {samples[-1][1]:.0f}, "
        f"peak {max(r for _, r in samples):.0f}; growth after warm-up "
        f"{samples[-1][1] - warm[0]:+.0f}"
    )
    lat = [x for _, x in rec.finals]
    if lat:
        print(f"good final latency over the run: p95 {np.percentile(lat, 95) * 1000:.0f} ms")
    if rec.good_failures:
        print(f"good calls failed: {len(rec.good_failures)}; first: {rec.good_failures[0][1]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="exported model directory (default: the bundled model)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=64, help="concurrent clients, good + hostile")
    p.add_argument("--hostile", type=float, default=0.1, help="fraction of hostile clients")
    p.add_argument("--manifest", help="utterances to send (default: synthesize a few)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(args.manifest) if args.manifest else synthesize(Path(tmp), 8)
        utterances = load_utterances(manifest, 100.0, 8)
        with open(Path(tmp) / "server.log", "wb") as log:
            server = start_server(args.model, 32, 0.0, 4 * args.streams, 0, log,
                                  extra=["--max-audio-seconds", str(MAX_AUDIO_SECONDS),
                                         "--idle-timeout-seconds", "5"])  # fmt: skip
            try:
                rec, samples = asyncio.run(soak(server, utterances, args))
            finally:
                stop_server(server)
        report(rec, samples, args)


if __name__ == "__main__":
    sys.exit(main())
