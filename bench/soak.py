"""Soak: good clients beside hostile ones for minutes, at every door of one `echoic serve`.

    python bench/soak.py [--minutes 10] [--streams 64] [--hostile 0.1] [--model DIR]

Starts `echoic serve` in a subprocess (as bench/serve_load.py does) and runs `--streams`
clients for `--minutes`, spread over the doors: gRPC StreamingRecognize, HTTP uploads to
`/v1/audio/transcriptions` and realtime WebSocket sessions. A fraction `--hostile` of
each door's clients are hostile, the rest good; each door's good clients run in a process
of their own (this script with `--door`), as a user's would, and its hostile ones in
another.

Good clients send real speech utterance after utterance and check the words against
the server's own Recognize of the same audio (a difference is a wrong answer): gRPC and
realtime clients stream it at real time and time end of audio -> last final result; HTTP
clients upload each utterance as a WAV file once it has been spoken and time the request.
Hostile clients take turns at their door's abuses, each of which has one expected answer:
gRPC: messages that do not parse, streams cancelled half way, beam search at the server's
largest beam, audio longer than the server accepts, garbage bytes as WAV, a sender that
trickles bytes; HTTP: a truncated Ogg file, garbage bytes, a body that trickles in,
an upload over --max-upload-mb; realtime: a session.update over the control-message
limit, appends past a fatal error (audio over the limit), frames that are not JSON.
Run it twice (`--hostile 0` for the baseline) to compare the good clients' latency with
and without hostile traffic.

Prints, per minute: good utterances finished, their latency p50/p95, good calls that
failed, the server's RSS, threads and descriptors; then, per door, good and hostile
requests, answered OK, refused with the expected status, wrong answers and latency;
then every hostile answer by kind and status.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import soundfile as sf
from serve_load import (
    RATE,
    Server,
    Utterance,
    free_port,
    load_utterances,
    start_server,
    stop_server,
    synthesize,
    wait_until_serving,
)

from echoic.clients import AsyncClient, ClientError, RetryPolicy

DOORS = ("grpc", "http", "realtime")
# Each door's hostile kinds, and the answer that refuses each cleanly (a gRPC code, an HTTP
# status, a realtime error code); any other answer is counted as unexpected. A beam at the
# largest size is served, and a byte pair each 0.5 s is slow but never idle: both OK.
EXPECTED = {
    "grpc": {"malformed": "INVALID_ARGUMENT", "cancel": "CANCELLED", "beam": "OK",
             "too-long": "INVALID_ARGUMENT", "garbage": "INVALID_ARGUMENT", "trickle": "OK"},
    "http": {"truncated-ogg": "400", "garbage": "400", "trickle": "408", "oversize": "413"},
    "realtime": {"huge-update": "message_too_large", "after-fatal": "out_of_range",
                 "not-json": "invalid_json"},
}  # fmt: skip
MAX_AUDIO_SECONDS = 30.0  # the server's --max-audio-seconds here, s
MAX_UPLOAD_MB = 25.0  # the server's --max-upload-mb here
ROUTE = "/v1/audio/transcriptions"
SPOKEN = {"formatting": "false"}  # the OpenAI door's words as spoken, as Recognize gives them
REALTIME_SPOKEN = {  # a realtime session's settings for raw PCM16 and the words as spoken
    "input_audio_format": "pcm16",
    "input_audio_params": {"sample_rate_hz": RATE, "num_channels": 1},
    "recognition_config": {"enable_automatic_punctuation": False,
                           "enable_verbatim_transcripts": True},
}  # fmt: skip
TIMEOUT = 60.0  # s any one request may take before the client gives up


def words(text: str) -> list[str]:
    return text.lower().split()


class Record:
    """What one door's clients saw; `start` is the soak's common start (epoch s)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.latency: list[tuple[float, float]] = []  # (s since start, good latency s)
        self.good: collections.Counter[str] = collections.Counter()  # status -> count
        self.wrong: list[str] = []
        self.good_failures: list[tuple[float, str]] = []
        self.hostile: collections.Counter[tuple[str, str]] = collections.Counter()

    def good_answer(self, latency: float, text: str, want: str) -> None:
        self.latency.append((time.time() - self.start, latency))
        self.good["OK"] += 1
        if words(text) != words(want):
            self.wrong.append(f"{text!r} instead of {want!r}")

    def good_failure(self, status: str, why: str) -> None:
        self.good[status] += 1
        self.good_failures.append((time.time() - self.start, f"{status}: {why}"[:300]))

    def to_json(self) -> dict:
        return {"latency": self.latency, "good": self.good, "wrong": self.wrong,
                "good_failures": self.good_failures,
                "hostile": [[k, s, n] for (k, s), n in self.hostile.items()]}  # fmt: skip

    def add(self, data: dict) -> None:
        """Another process's record (`to_json`'s) added to this one."""
        self.latency += data["latency"]
        self.wrong += data["wrong"]
        self.good.update(data["good"])
        self.good_failures += data["good_failures"]
        self.hostile.update({(k, s): n for k, s, n in data["hostile"]})


async def at_real_time(chunks, sent_at: list[float]):
    """`chunks` as a microphone gives them; the time each was sent goes to `sent_at`."""
    loop = asyncio.get_running_loop()
    start, sent = loop.time(), 0.0
    for chunk in chunks:
        sent += len(chunk) / 2 / RATE
        delay = start + sent - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent_at.append(time.monotonic())
        yield chunk


def encoded(pcm: bytes, fmt: str, subtype: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.frombuffer(pcm, "<i2"), RATE, format=fmt, subtype=subtype)
    return buf.getvalue()


# ------------------------------------------------------------------ the gRPC door


async def grpc_good(client: AsyncClient, utt: Utterance, want: str, rec: Record) -> None:
    sent_at: list[float] = []
    finals, last = [], 0.0
    try:
        async for response in client.stream(
            at_real_time(utt.chunks, sent_at), sample_rate=RATE, interim_results=False,
            words=False,
        ):  # fmt: skip
            if response.results and response.results[0].is_final:
                finals.append(response.results[0].alternatives[0].transcript)
                last = time.monotonic()
        rec.good_answer((last or time.monotonic()) - sent_at[-1], " ".join(finals), want)
    except ClientError as e:
        rec.good_failure(e.code.name if e.code else "ERROR", str(e))


async def grpc_hostile(client: AsyncClient, kind: str, pcm: bytes, chunks,
                       rng: random.Random) -> str:  # fmt: skip
    try:
        if kind == "malformed":
            async with grpc.aio.insecure_channel(client.target) as channel:
                raw = channel.unary_unary("/echoic.v1.Transcriber/Recognize")
                await raw(rng.randbytes(rng.randrange(1, 64)), timeout=30)
        elif kind == "cancel":
            stream = client.stream(at_real_time(chunks, []), sample_rate=RATE)
            async for _ in stream:
                break  # the first interim result: go away
            await stream.aclose()
            return "CANCELLED"
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
        return e.code.name if e.code else "ERROR"
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"


# ------------------------------------------------------------------ the HTTP door


async def http_good(http: aiohttp.ClientSession, url: str, utt: Utterance, want: str,
                    rec: Record) -> None:  # fmt: skip
    """An utterance uploaded once spoken (its duration waited first), timed to the answer."""
    await asyncio.sleep(sum(utt.seconds))
    form = aiohttp.FormData({"model": "whisper-1", **SPOKEN})
    form.add_field("file", encoded(b"".join(utt.chunks), "WAV", "PCM_16"), filename="a.wav")
    start = time.monotonic()
    try:
        async with http.post(url + ROUTE, data=form) as response:
            body = await response.json()
            if response.status != 200:
                rec.good_failure(str(response.status), str(body))
                return
        rec.good_answer(time.monotonic() - start, body["text"], want)
    except (TimeoutError, aiohttp.ClientError) as e:
        rec.good_failure(type(e).__name__, str(e))


async def raw_post(url: str, head: dict[str, str], body: bytes, pace: float = 0.0) -> str:
    """POST over a socket of its own: `body` at once, or a byte each `pace` s until the
    server answers; the status of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        fields = "".join(f"{k}: {v}\r\n" for k, v in head.items())
        writer.write(f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\n{fields}\r\n".encode())
        answer = asyncio.ensure_future(reader.readline())
        if pace:
            for i in range(len(body)):
                if answer.done():
                    break
                writer.write(body[i : i + 1])
                await asyncio.wait([answer], timeout=pace)
        else:
            writer.write(body)
        status_line = await asyncio.wait_for(answer, TIMEOUT)
        return status_line.split()[1].decode() if status_line else "closed"
    except (TimeoutError, ConnectionError) as e:
        return type(e).__name__
    finally:
        writer.close()


def form(data: bytes) -> tuple[dict[str, str], bytes]:
    """A multipart form with `data` as its file: (headers, body)."""
    body = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
            + data + b"\r\n--b--\r\n")  # fmt: skip
    head = {"Content-Type": "multipart/form-data; boundary=b", "Content-Length": str(len(body))}
    return head, body


async def http_hostile(url: str, kind: str, pcm: bytes, ogg: bytes, rng: random.Random) -> str:
    if kind == "truncated-ogg":
        return await raw_post(url, *form(ogg[:100]))
    if kind == "garbage":
        return await raw_post(url, *form(rng.randbytes(rng.randrange(100, 8000))))
    if kind == "trickle":  # a few bytes a second, under --min-upload-bytes-per-second
        head, body = form(encoded(pcm, "WAV", "PCM_16"))
        return await raw_post(url, head, body, pace=0.3)
    head, _ = form(b"")  # oversize: declares twice the limit, then sends the first MB
    head["Content-Length"] = str(int(2 * MAX_UPLOAD_MB * 2**20))
    return await raw_post(url, head, bytes(2**20))


# ------------------------------------------------------------------ the realtime door


def append(pcm: bytes) -> str:
    return json.dumps(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
    )


async def realtime_good(http: aiohttp.ClientSession, url: str, utt: Utterance, want: str,
                        rec: Record) -> None:  # fmt: skip
    """A socket per utterance: the update, the audio at real time, `.done`, every result."""
    sent_at: list[float] = []
    try:
        async with http.ws_connect(url, protocols=("realtime",)) as ws:
            await ws.receive_json(timeout=TIMEOUT)  # conversation.created
            await ws.send_json({"type": "transcription_session.update", "session": REALTIME_SPOKEN})
            finals, event = [], await ws.receive_json(timeout=TIMEOUT)
            if event["type"] == "transcription_session.updated":
                async for chunk in at_real_time(utt.chunks, sent_at):
                    await ws.send_str(append(chunk))
                await ws.send_json({"type": "input_audio_buffer.done"})
            while event["type"] != "error" and not event.get("is_last_result"):
                event = await ws.receive_json(timeout=TIMEOUT)
                if event["type"].endswith(".completed") and event["transcript"]:
                    finals.append(event["transcript"])
            if event["type"] == "error":
                rec.good_failure(event["error"]["code"], event["error"]["message"])
                return
        rec.good_answer(time.monotonic() - sent_at[-1], " ".join(finals), want)
    except (TimeoutError, aiohttp.ClientError, TypeError) as e:
        rec.good_failure(type(e).__name__, str(e))  # TypeError: a close where JSON was due


async def realtime_hostile(http: aiohttp.ClientSession, url: str, kind: str,
                           rng: random.Random) -> str:  # fmt: skip
    """The error codes the socket answered with, joined by '+' ('none' for none), and
    "closed" or "left-open" where the socket did not end as it should: closed after a
    fatal error, open after a client mistake."""
    codes, closed = [], False
    try:
        async with http.ws_connect(url, protocols=("realtime",)) as ws:
            await ws.receive_json(timeout=TIMEOUT)  # conversation.created
            if kind == "huge-update":
                huge = {**REALTIME_SPOKEN, "x": "y" * 100_000}
                await ws.send_json({"type": "transcription_session.update", "session": huge})
            elif kind == "not-json":
                await ws.send_str("{" + rng.randbytes(rng.randrange(1, 200)).hex())
            else:  # after-fatal: audio past --max-audio-seconds, appends going on after it
                await ws.send_json({"type": "transcription_session.update",
                                    "session": REALTIME_SPOKEN})  # fmt: skip
                await ws.receive_json(timeout=TIMEOUT)
                second = bytes(2 * RATE)
                try:
                    for _ in range(int(MAX_AUDIO_SECONDS) + 30):
                        await ws.send_str(append(second))
                except ConnectionError:
                    pass  # closed by the server after its error event
            while True:  # every event until the server closes, or is quiet for 1 s
                message = await ws.receive(timeout=1.0 if kind != "after-fatal" else TIMEOUT)
                if message.type != aiohttp.WSMsgType.TEXT:
                    closed = True
                    break
                event = json.loads(message.data)
                if event["type"] == "error":
                    codes.append(event["error"]["code"])
    except TimeoutError:
        pass  # the socket stayed open, quiet
    except aiohttp.ClientError as e:
        codes.append(type(e).__name__)
    if closed != (kind == "after-fatal"):
        codes.append("closed" if closed else "left-open")
    return "+".join(codes) or "none"


# ------------------------------------------------------------------ one door's process


async def door_clients(args: argparse.Namespace) -> Record:
    utterances = load_utterances(Path(args.manifest), 100.0, 8)
    wants = json.loads(Path(args.wants).read_text())
    rec = Record(args.start_at)
    deadline = time.monotonic() + args.start_at - time.time() + args.seconds
    kinds = tuple(EXPECTED[args.door])
    ws_url = args.http.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    connector = aiohttp.TCPConnector(limit=0)
    retry = RetryPolicy(attempts=1)
    async with AsyncClient(args.target, retry=retry, timeout=TIMEOUT) as client, \
            aiohttp.ClientSession(timeout=timeout, connector=connector) as http:  # fmt: skip

        async def good(n: int) -> None:
            await asyncio.sleep(random.random())
            while time.monotonic() < deadline:
                utt, want = utterances[n % len(utterances)], wants[n % len(utterances)]
                n += 1
                if args.door == "grpc":
                    await grpc_good(client, utt, want, rec)
                elif args.door == "http":
                    await http_good(http, args.http, utt, want, rec)
                else:
                    await realtime_good(http, ws_url, utt, want, rec)

        async def hostile(n: int) -> None:
            rng = random.Random(args.seed + n)
            utt = utterances[n % len(utterances)]
            pcm = b"".join(utt.chunks)
            ogg = encoded(pcm, "OGG", "OPUS")
            while time.monotonic() < deadline:
                kind = kinds[rng.randrange(len(kinds))]
                if args.door == "grpc":
                    status = await grpc_hostile(client, kind, pcm, utt.chunks, rng)
                elif args.door == "http":
                    status = await http_hostile(args.http, kind, pcm, ogg, rng)
                else:
                    status = await realtime_hostile(http, ws_url, kind, rng)
                rec.hostile[kind, status] += 1

        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        await asyncio.gather(*map(good, range(args.good)),
                             *map(hostile, range(args.hostile_clients)))  # fmt: skip
    return rec


# ------------------------------------------------------------------ the soak


def server_stats(server: Server) -> tuple[float, int, int]:
    """RSS MB, threads and open descriptors of the server's processes together (/proc)."""
    rss = threads = fds = 0
    for pid in server.processes():
        try:
            status = dict(line.split(":", 1) for line in
                          Path(f"/proc/{pid}/status").read_text().splitlines())  # fmt: skip
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue  # gone meanwhile
        rss += int(status["VmRSS"].split()[0])
        threads += int(status["Threads"])
    return rss / 1024, threads, fds


async def references(server: Server, utterances: list[Utterance]) -> list[str]:
    """Each utterance's words as the server's Recognize gives them (once it serves)."""
    async with AsyncClient(server.target, retry=RetryPolicy(attempts=1), timeout=TIMEOUT) as c:
        await wait_until_serving(server, c)
        return [(await c.recognize(b"".join(u.chunks), encoding="linear16", sample_rate=RATE)).text
                for u in utterances]  # fmt: skip


def soak(server: Server, http: str, manifest: Path, wants: Path, args) -> tuple[dict, list]:
    """Each door's good clients in a process, its hostile ones in another (as users' are
    apart); the server sampled each second meanwhile."""
    start_at = time.time() + 5.0  # time for every client process to start and connect
    processes = []
    for i, door in enumerate(DOORS):
        n = args.streams // len(DOORS) + (i < args.streams % len(DOORS))
        hostile = round(n * args.hostile)
        for good, bad in ((n - hostile, 0), (0, hostile)):
            if good + bad == 0:
                continue
            cmd = [sys.executable, __file__, "--door", door, "--target", server.target,
                   "--http", http, "--manifest", str(manifest), "--wants", str(wants),
                   "--good", str(good), "--hostile-clients", str(bad),
                   "--start-at", repr(start_at), "--seconds", str(60 * args.minutes),
                   "--seed", str(i)]  # fmt: skip
            # its record to a file, not a pipe: a 10-minute record outgrows a pipe's 64 KiB,
            # and a client blocked writing it would never exit
            out = tempfile.TemporaryFile("w+")
            processes.append((door, subprocess.Popen(cmd, stdout=out, text=True), out))
    samples = []  # (s since start, RSS MB, threads, descriptors)
    while any(p.poll() is None for _, p, _ in processes):
        samples.append((time.time() - start_at, *server_stats(server)))
        time.sleep(1.0)
    samples.append((time.time() - start_at, *server_stats(server)))
    records = {door: Record(start_at) for door in DOORS}
    for door, process, out in processes:
        if process.wait() != 0:
            raise RuntimeError(f"{door} clients exited with status {process.returncode}")
        with out:
            out.seek(0)
            records[door].add(json.loads(out.read()))
    return records, samples


def pct(values: list[float]) -> str:
    if not values:
        return "-"
    return "/".join(f"{v:.0f}" for v in np.percentile(values, [50, 95]) * 1000)


def report(records: dict[str, Record], samples: list[tuple], args) -> None:
    print(f"{args.streams} clients over {len(DOORS)} doors, {args.hostile:.0%} hostile, "
          f"{args.minutes:g} min")  # fmt: skip
    print(f"{'minute':>6}  {'good done':>9}  {'good ms p50/p95':>15}  {'good failed':>11}  "
          f"{'RSS MB':>6}  {'threads':>7}  {'fds':>5}")  # fmt: skip
    for m in range(int(np.ceil(args.minutes))):
        lat = [x for r in records.values() for t, x in r.latency if int(t // 60) == m]
        failed = sum(1 for r in records.values() for t, _ in r.good_failures if int(t // 60) == m)
        at = [s for s in samples if int(s[0] // 60) == m and s[0] >= 0] or [samples[-1]]
        rss, threads, fds = (max(s[i] for s in at) for i in (1, 2, 3))
        print(f"{m + 1:>6}  {len(lat):>9}  {pct(lat):>15}  {failed:>11}  {rss:>6.0f}  "
              f"{threads:>7}  {fds:>5}")  # fmt: skip
    print()
    print(f"{'door':<16} {'requests':>8} {'ok':>6} {'refused as expected':>19} "
          f"{'unexpected':>10} {'wrong':>5} {'ms p50/p95':>10}")  # fmt: skip
    for door, rec in records.items():
        good = sum(rec.good.values())
        print(f"{door + ' good':<16} {good:>8} {rec.good['OK']:>6} {'-':>19} "
              f"{good - rec.good['OK']:>10} {len(rec.wrong):>5} "
              f"{pct([x for _, x in rec.latency]):>10}")  # fmt: skip
        hostile = sum(rec.hostile.values())
        expected = sum(n for (k, s), n in rec.hostile.items() if s == EXPECTED[door][k])
        ok = sum(n for (_, s), n in rec.hostile.items() if s == "OK")
        print(f"{door + ' hostile':<16} {hostile:>8} {ok:>6} {expected - ok:>19} "
              f"{hostile - expected:>10} {'-':>5} {'-':>10}")  # fmt: skip
    print()
    print(f"{'hostile':<22} {'answer':<24} {'count':>6}")
    for door, rec in records.items():
        for (kind, status), count in sorted(rec.hostile.items()):
            mark = "" if status == EXPECTED[door][kind] else "  (unexpected)"
            print(f"{door + ' ' + kind:<22} {status:<24} {count:>6}{mark}")
    first = [s for s in samples if s[0] >= 0][0]
    warm = [s for s in samples if s[0] >= 60] or [first]
    last = samples[-1]
    print()
    print(f"server at start / after 1 min / end: RSS {first[1]:.0f} / {warm[0][1]:.0f} / "
          f"{last[1]:.0f} MB (peak {max(s[1] for s in samples):.0f}), threads {first[2]} / "
          f"{warm[0][2]} / {last[2]}, descriptors {first[3]} / {warm[0][3]} / "
          f"{last[3]}")  # fmt: skip
    for door, rec in records.items():
        for what, items in (("failed", [w for _, w in rec.good_failures]), ("wrong", rec.wrong)):
            if items:
                print(f"{door} good calls {what}: {len(items)}; first: {items[0]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="exported model directory (default: the bundled model)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=64, help="clients, good + hostile, all doors")
    p.add_argument("--hostile", type=float, default=0.1, help="fraction of hostile clients")
    p.add_argument("--manifest", help="utterances to send (default: synthesize a few)")
    # one door's client process (started by the soak)
    for flag in ("--door", "--target", "--http", "--wants"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    for flag, kind in (("--good", int), ("--hostile-clients", int), ("--start-at", float),
                       ("--seconds", float), ("--seed", int)):  # fmt: skip
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.door:
        print(json.dumps(asyncio.run(door_clients(args)).to_json()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(args.manifest) if args.manifest else synthesize(Path(tmp), 8)
        utterances = load_utterances(manifest, 100.0, 8)
        http_port = free_port()
        with open(Path(tmp) / "server.log", "wb") as log:
            server = start_server(args.model, 32, 0.0, 4 * args.streams, 0, log, extra=[
                "--max-audio-seconds", str(MAX_AUDIO_SECONDS), "--idle-timeout-seconds", "5",
                "--max-upload-mb", str(MAX_UPLOAD_MB), "--http-port", str(http_port)])  # fmt: skip
            try:
                wants = Path(tmp) / "wants.json"
                wants.write_text(json.dumps(asyncio.run(references(server, utterances))))
                records, samples = soak(
                    server, f"http://127.0.0.1:{http_port}", manifest, wants, args
                )
            finally:
                stop_server(server)
        report(records, samples, args)


if __name__ == "__main__":
    sys.exit(main())
