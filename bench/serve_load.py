"""Streaming load, measured from outside: how many real-time streams one server sustains.

    python bench/serve_load.py [--model DIR] [--streams 32,128,192,256] [--seconds 20]
                               [--clients 2] [--channels 1] [--server-args="--max-batch 64"]
                               [--unbatched] [--manifest FILE] [--profile SECONDS]

Starts `echoic serve` in a subprocess on free loopback ports with its default
settings (plus --server-args), and for each level N runs N concurrent
StreamingRecognize calls from --clients load-client processes of its own (each
this script with --client, as a user's client would be: its own process and
interpreter, generated stubs, real-time audio). Each stream sends utterances back
to back at real time in --chunk-ms chunks (starts staggered over one second) until
the level's --seconds are up. Audio: --manifest, or a few sentences synthesized
once with `echoic synth` into a temporary folder. --server-args may be given more
than once: each setting gets a server of its own, one after the other, and the
table shows them side by side. With --unbatched, a server with --max-batch 1 runs
the same levels too, for the batching gain.

--channels K: each client process spreads its streams round robin over K
connections of its own. `echoic serve --workers N` shares its port by connection
(SO_REUSEPORT: the kernel picks a worker per connection, not per call), so one
connection per client process would reach at most --clients workers. The default
is 1 because the single-process figures in docs/benchmarks.md, "Benchmarks" were measured with
one connection per client process; give the same K to every setting compared.

Per level it prints:
  utts        utterances finished (a final result or a failed call)
  behind      utterances that fell behind real time: some result came more than
              --lag-limit s after the audio it covers was sent (beyond the model's
              lookahead), or the call failed
  failed      failed calls
  interim     receipt of an interim result - when the last audio it covers was
              sent, ms (p95; the model's lookahead is part of it)
  final       end of audio (half-close) -> final result, ms (p50/p95/p99)
  batch       streams per model call: mean, and p50/p95 of the server's
              echoic_batch_size histogram (bucket upper bounds)
  srv/cli CPU CPU seconds per wall second of the server (with --workers, the
              supervisor and its workers; with engine processes, those too) and of
              all client processes together, % of one core (both share the cores)
  RSS         the server's resident memory at the level's end (with --workers or
              engine processes, of every process together), MB
  of engine   a level the server sustained (final p95 <= 200 ms, none behind, none
              failed) as a share of the engine's own capacity: the real-time streams
              that one batched streaming step of 32 streams on every core keeps up
              with (bench/offline_rtf.py's streaming table), measured first, before
              any server runs; "-" for a level not sustained

--formatting both runs every level twice on each server, its streams' finals raw and
then formatted (punctuation and written forms, docs/formatting.md), on rows of their own
("+formatting"): what formatting adds to the final latency; "on" runs formatted only.
--formatting mixed runs every level once, every other stream of each client process
formatted and the formatted ones counted on a row of their own ("+fmt"): raw and
formatted finals measured at the same moments on the same machine, which a noisy
machine's run-to-run spread (tens of ms at the p95) would otherwise swamp.

--decoder beam makes every stream a beam search (beam 32 with the model's LM);
--beam-streams K adds K beam-search streams to each level, from a client process of
their own, on a row of their own ("+beam"): what beam streams cost the greedy ones.

--profile S runs py-spy (the dev extra) on the server for S seconds in the middle
of each level, writes its collapsed stacks into --out and prints where the server's
busy samples went.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
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

    def processes(self) -> list[int]:
        """The server's process and its descendants (a --workers supervisor's workers)."""
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(stat.parent.name))
        tree, todo = [], [self.process.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        return tree

    def cpu_seconds(self) -> float:
        """User + system CPU of the server's processes so far, s (Linux /proc): the live
        ones, plus what the server's own process has reaped (a restarted worker's)."""
        total = 0
        for pid in self.processes():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
            if pid == self.process.pid:
                total += int(fields[13]) + int(fields[14])
        return total / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        """The resident memory of the server's processes now, together, MB (Linux /proc)."""
        total = 0
        for pid in self.processes():
            try:
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            except OSError:
                continue
            total += sum(int(x.split()[1]) for x in lines if x.startswith("VmRSS:"))
        return total / 1024

    def batch_histogram(self) -> dict[str, float]:
        """echoic_batch_size over all models: cumulative bucket counts by upper bound
        ("1", ..., "+Inf"), plus "_sum" and "_count"."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        total: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("echoic_batch_size_bucket"):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                key = bound if bound == "+Inf" else f"{float(bound):g}"
            elif line.startswith(("echoic_batch_size_sum", "echoic_batch_size_count")):
                key = "_sum" if "_sum" in line.split("{", 1)[0] else "_count"
            else:
                continue
            total[key] = total.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return total


def batch_summary(before: dict[str, float], after: dict[str, float]) -> str:
    """Mean and p50/p95 batch size (the histogram's bucket bounds) between two readings."""
    calls = after.get("_count", 0.0) - before.get("_count", 0.0)
    if not calls:
        return "-"
    mean = (after["_sum"] - before.get("_sum", 0.0)) / calls
    bounds = sorted((k for k in after if not k.startswith("_")),
                    key=lambda k: float("inf") if k == "+Inf" else float(k))  # fmt: skip

    def quantile(q: float) -> str:
        for bound in bounds:
            if after[bound] - before.get(bound, 0.0) >= q * calls:
                return bound
        return "+Inf"

    return f"{mean:.1f} ({quantile(0.5)}/{quantile(0.95)})"


def start_server(
    model: str | None, max_batch: int | None, max_wait_ms: float | None,
    max_streams: int | None, threads: int | None, log,
    extra: tuple[str, ...] | list[str] = (),
) -> Server:  # fmt: skip
    """`echoic serve` on free loopback ports; a None setting keeps the server's default."""
    port, metrics_port = free_port(), free_port()
    cmd = [*ECHOIC, "serve", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", str(metrics_port), "--grace-seconds", "5",
           "--log-level", "warning"]  # fmt: skip
    for flag, value in (("--max-batch", max_batch), ("--max-wait-ms", max_wait_ms),
                        ("--max-streams", max_streams), ("--threads", threads)):  # fmt: skip
        if value is not None:
            cmd += [flag, str(value)]
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


# ------------------------------------------------------------------ one client process


@dataclass
class ClientStats:
    utterances: int = 0
    behind: int = 0  # utterances with a result later than --lag-limit, or a failed call
    failed: int = 0  # failed calls
    interim: list[float] = field(default_factory=list)  # s
    final: list[float] = field(default_factory=list)  # s
    cpu_seconds: float = 0.0  # this client process's CPU over the level
    errors: list[str] = field(default_factory=list)


async def one_stream(
    client: AsyncClient, utterances: list[Utterance], first: int, start_delay: float,
    deadline: float, lookahead: float, lag_limit: float, stats: ClientStats,
    decoder: str = "greedy", formatting: bool = False,
) -> None:  # fmt: skip
    loop = asyncio.get_running_loop()
    await asyncio.sleep(start_delay)
    index = first
    while loop.time() < deadline:
        utt = utterances[index % len(utterances)]
        index += 1
        ends = list(np.cumsum(utt.seconds))  # audio sent after each chunk, s
        sent_at: list[float] = []  # when each chunk was handed to gRPC
        worst_lag = 0.0  # s beyond the model's lookahead

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
                words=False, decoder=decoder, punctuation=formatting,
                inverse_normalization=formatting,
            ):  # fmt: skip
                now = loop.time()
                for result in response.results:
                    if result.is_final:
                        latency = now - sent_at[-1]
                        stats.final.append(latency)
                    else:
                        k = bisect.bisect_left(ends, response.audio_processed_seconds - 1e-6)
                        latency = now - sent_at[min(k, len(sent_at) - 1)]
                        stats.interim.append(latency)
                        latency -= lookahead
                    worst_lag = max(worst_lag, latency)
        except ClientError as e:
            stats.failed += 1
            stats.errors.append(f"{e.code.name if e.code else 'ERROR'}: {e}"[:200])
            worst_lag = float("inf")
            await asyncio.sleep(0.5)  # a refused stream does not spin
        stats.utterances += 1
        stats.behind += worst_lag > lag_limit


async def client_level(args: argparse.Namespace) -> list[ClientStats]:
    """One load-client process's share of a level: --client-streams streams from
    --start-at (a time.time()) for --seconds. Its stats, and with --formatting mixed
    those of its formatted streams (every other one) apart."""
    utterances = load_utterances(Path(args.manifest), args.chunk_ms, args.utterances)
    mixed = args.formatting == "mixed"
    groups = [ClientStats(), ClientStats()] if mixed else [ClientStats()]
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                AsyncClient(args.target, retry=RetryPolicy(attempts=1), timeout=90,
                            own_connection=True)
            )
            for _ in range(max(1, min(args.channels, args.client_streams)))
        ]  # fmt: skip
        for client in clients:  # every connection made before the start
            (model,) = await client.list_models(timeout=30)
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        cpu0 = time.process_time()
        deadline = loop.time() + args.seconds
        rng = random.Random(args.seed)
        # mixed: every other stream on each connection, so that both kinds share every
        # connection (and with --workers, every worker)
        formatted = [args.formatting == "on" or (mixed and (i // len(clients)) % 2 == 1)
                     for i in range(args.client_streams)]  # fmt: skip
        tasks = [
            one_stream(clients[i % len(clients)], utterances, rng.randrange(len(utterances)),
                       rng.random(), deadline, model.lookahead_seconds, args.lag_limit,
                       groups[int(mixed and formatted[i])], args.decoder, formatted[i])
            for i in range(args.client_streams)
        ]  # fmt: skip
        # Bounded: the longest utterance after the deadline, plus slack for a slow server.
        longest = max(sum(u.seconds) for u in utterances)
        await asyncio.wait_for(asyncio.gather(*tasks), args.seconds + 2 * longest + 30)
        groups[0].cpu_seconds = time.process_time() - cpu0  # the process's, counted once
    for stats in groups:
        stats.errors = sorted(set(stats.errors))[:5]
    return groups


# ------------------------------------------------------------------ the levels


@dataclass
class Level:
    streams: int
    stats: ClientStats  # all client processes together
    batch: str
    server_cpu: float  # % of one core
    client_cpu: float  # % of one core, all client processes
    rss_mb: float
    beam: ClientStats | None = None  # --beam-streams' own client process, apart
    formatted: ClientStats | None = None  # --formatting mixed: the formatted streams, apart


def run_level(server: Server, manifest: Path, n: int, args: argparse.Namespace,
              profile_dir: Path | None, formatted: bool = False) -> Level:  # fmt: skip
    """n streams from --clients processes of this script against the server (their finals
    formatted when `formatted`)."""
    clients = max(1, min(args.clients, n))
    start_at = time.time() + 3.0  # time for every client process to start and connect
    processes = []
    shares = [(n // clients + (i < n % clients), args.decoder) for i in range(clients)]
    if args.beam_streams:  # one more process, whose streams are counted apart
        shares.append((args.beam_streams, "beam"))
    for i, (share, decoder) in enumerate(shares):
        cmd = [sys.executable, __file__, "--client", "--target", server.target,
               "--manifest", str(manifest), "--client-streams", str(share),
               "--start-at", repr(start_at), "--seconds", str(args.seconds),
               "--seed", str(1000 * n + i), "--chunk-ms", str(args.chunk_ms),
               "--lag-limit", str(args.lag_limit), "--channels", str(args.channels),
               "--utterances", str(args.utterances), "--decoder", decoder,
               "--formatting",
               client_formatting(args.formatting, formatted, i < clients)]  # fmt: skip
        processes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    time.sleep(max(0.0, start_at - time.time()))
    batch0, cpu0, wall0 = server.batch_histogram(), server.cpu_seconds(), time.monotonic()
    profiler = None
    if profile_dir is not None:
        time.sleep(max(0.0, (args.seconds - args.profile) / 2))
        profiler = start_profile(server, profile_dir / f"profile-{n}", args.profile)
    total, beam, fmt = ClientStats(), None, None
    for i, process in enumerate(processes):
        out, _ = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"a load client exited with status {process.returncode}")
        parts = [ClientStats(**part) for part in json.loads(out)]
        if i == clients:  # the --beam-streams process
            beam = parts[0]
            continue
        add(total, parts[0])
        if len(parts) > 1:  # --formatting mixed
            fmt = add(fmt or ClientStats(), parts[1])
    wall = time.monotonic() - wall0
    if profiler is not None:
        profiler.wait()
        stem = profile_dir / f"profile-{n}"
        print(f"profile at {n} streams ({stem}.txt):", file=sys.stderr)
        print(summarize_profile(Path(f"{stem}.txt")), file=sys.stderr)
    return Level(
        streams=n, stats=total, batch=batch_summary(batch0, server.batch_histogram()),
        server_cpu=100 * (server.cpu_seconds() - cpu0) / wall,
        client_cpu=100 * total.cpu_seconds / wall, rss_mb=server.rss_mb(), beam=beam,
        formatted=fmt,
    )  # fmt: skip


def add(total: ClientStats, part: ClientStats) -> ClientStats:
    """`part` counted into `total` (returned)."""
    for name in ("utterances", "behind", "failed", "cpu_seconds"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    total.interim += part.interim
    total.final += part.final
    total.errors = sorted(set(total.errors + part.errors))[:5]
    return total


def start_profile(server: Server, stem: Path, seconds: float) -> subprocess.Popen:
    """py-spy on the server (every thread, without pausing it) for `seconds`; its
    collapsed stacks go to STEM.txt, summarised by `summarize_profile`."""
    py_spy = Path(sys.executable).with_name("py-spy")
    cmd = [str(py_spy) if py_spy.exists() else "py-spy", "record", "--pid",
           str(server.process.pid), "--duration", str(round(seconds)), "--rate", "200",
           "--format", "raw", "--output", f"{stem}.txt", "--nonblocking"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# py-spy names a file of the editable install by its path below the repository.
ECHOIC_DIRS = ("server/", "model/", "clients/", "cli/")


def summarize_profile(path: Path, top: int = 12) -> str:
    """Where the server's busy samples went: the functions that were running (self)
    and the echoic functions they were called from (inclusive), % of busy samples."""
    own: dict[str, int] = {}
    inside: dict[str, int] = {}
    busy = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.rsplit(":", 1)[0] for f in stack.split(";")]  # "function (file)"
        n = int(count)
        busy += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in {f for f in frames if f.split(" (", 1)[-1].startswith(ECHOIC_DIRS)}:
            inside[frame] = inside.get(frame, 0) + n

    def table(counts: dict[str, int]) -> str:
        rows = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return "\n".join(f"  {100 * c / busy:5.1f}%  {name}" for name, c in rows)

    return (f"{busy} busy samples\nrunning (self):\n{table(own)}\n"
            f"inside echoic functions (inclusive):\n{table(inside)}")  # fmt: skip


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


async def warm_up(server: Server, utterance: Utterance, connections: int = 4) -> None:
    """Wait until the server serves, then stream an utterance on each of a few
    connections of their own (with --workers, most workers get one)."""
    for i in range(connections):
        async with AsyncClient(server.target, retry=RetryPolicy(attempts=1), timeout=90,
                               own_connection=True) as client:  # fmt: skip
            model = await wait_until_serving(server, client)
            if i == 0:
                print(
                    f"  model {model.name}/{model.version}: {model.rnn_type}, chunk"
                    f" {1000 * model.chunk_seconds:.0f} ms, lookahead"
                    f" {1000 * model.lookahead_seconds:.0f} ms",
                    file=sys.stderr,
                )
            async for _ in client.stream(utterance.chunks, sample_rate=RATE, words=False):
                pass


def percentiles(values: list[float], qs=(50, 95, 99)) -> str:
    if not values:
        return "-"
    return "/".join(f"{v:.0f}" for v in np.percentile(np.asarray(values) * 1000, qs))


SUSTAINED_P95 = 0.2  # s: a level is sustained when its final p95 is within this, none behind


def engine_capacity(model: str | None, batch: int = 32, repeats: int = 5) -> float:
    """Real-time streams the model's batched streaming step keeps up with on every core of
    this machine (bench/offline_rtf.py's streaming table at `batch` streams): the engine's
    own ceiling, measured before any server starts."""
    from echoic.model.runtime.engine import Engine
    from echoic.model.runtime.recognizer import default_model_dir

    engine = Engine(model or default_model_dir(), intra_op_threads=0)
    card = engine.card
    rng = np.random.default_rng(1)
    windows = rng.normal(size=(batch, card.window_input_frames, card.num_features))
    windows = windows.astype(np.float32)
    frames = np.full(batch, card.chunk_frames + card.context_frames, dtype=np.int64)
    state = engine.initial_state(batch)
    engine.stream_step(windows, frames, state)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.stream_step(windows, frames, state)
        times.append(time.perf_counter() - started)
    chunk_seconds = card.chunk_frames * card.output_frame_ms / 1000
    return chunk_seconds / (float(np.median(times)) / batch)


def client_formatting(mode: str, formatted: bool, load_client: bool) -> str:
    """A client process's --formatting: the level's, or "mixed" for the load clients of a
    --formatting mixed run (the --beam-streams process is never mixed)."""
    if mode == "mixed" and load_client:
        return "mixed"
    return "on" if formatted else "off"


def of_engine(level: Level, capacity: float) -> str:
    """The level as a share of the engine's capacity, when the server sustained it (every
    group of its streams: with --formatting mixed, the formatted ones too)."""
    groups = [s for s in (level.stats, level.formatted) if s is not None]
    sustained = all(
        s.final and np.percentile(s.final, 95) <= SUSTAINED_P95 and not s.behind and not s.failed
        for s in groups
    )
    return f"{100 * level.streams / capacity:.0f}%" if sustained and capacity else "-"


def print_table(runs: dict[str, list[Level]], capacity: float = 0.0) -> None:
    header = (
        f"{'streams':>7}  {'server':<22} {'utts':>6} {'behind':>6} {'failed':>6}"
        f"  {'interim p95':>11}  {'final ms p50/95/99':>18}  {'batch (p50/95)':>14}"
        f"  {'srv CPU':>7}  {'cli CPU':>7}  {'RSS MB':>6}  {'of engine':>9}  errors"
    )
    print(header)
    print("-" * len(header))
    for row in zip(*runs.values(), strict=True):
        for mode, level in zip(runs, row, strict=True):
            s = level.stats
            print(
                f"{level.streams:>7}  {mode:<22} {s.utterances:>6} {s.behind:>6} {s.failed:>6}"
                f"  {percentiles(s.interim, (95,)):>11}  {percentiles(s.final):>18}"
                f"  {level.batch:>14}  {level.server_cpu:>6.0f}%  {level.client_cpu:>6.0f}%"
                f"  {level.rss_mb:>6.0f}  {of_engine(level, capacity):>9}"
                f"  {'; '.join(s.errors)[:60]}"
            )
            extra = [("+beam", "beam streams", level.beam),
                     ("+fmt", "formatted streams", level.formatted)]  # fmt: skip
            for label, name, b in extra:
                if b is None:
                    continue
                print(
                    f"{label:>7}  {name:<22} {b.utterances:>6}"
                    f" {b.behind:>6} {b.failed:>6}  {percentiles(b.interim, (95,)):>11}"
                    f"  {percentiles(b.final):>18}  {'':>14}  {'':>7}  {'':>7}  {'':>6}"
                    f"  {'; '.join(b.errors)[:60]}"
                )


def bench_server(name: str, flags: list[str], manifest: Path, utterances: list[Utterance],
                 args: argparse.Namespace, tmp: Path) -> dict[str, list[Level]]:  # fmt: skip
    """Every level against one server: {row name: levels}, a row per --formatting variant
    (both: raw and formatted take turns at each level, on the same warm server)."""
    variants = {"off": (False,), "on": (True,), "both": (False, True), "mixed": (False,)}[
        args.formatting
    ]
    streams = None if max(args.streams) + 8 <= 256 else max(args.streams) + 8
    log_path = tmp / f"server-{''.join(c if c.isalnum() else '_' for c in name)}.log"
    with open(log_path, "wb") as log:
        server = start_server(args.model, None, None, streams, None, log, flags)
        try:
            asyncio.run(warm_up(server, utterances[0]))
            rows: dict[str, list[Level]] = {}
            for n in args.streams:
                profile_dir = Path(args.out) if args.profile else None
                for formatted in variants:
                    row = name + (" +formatting" if formatted and len(variants) > 1 else "")
                    row += " (raw streams)" if args.formatting == "mixed" else ""
                    level = run_level(server, manifest, n, args, profile_dir, formatted)
                    rows.setdefault(row, []).append(level)
                print(f"  {name}: {n} streams done", file=sys.stderr, flush=True)
            return rows
        except (TimeoutError, RuntimeError, ClientError) as e:
            log.flush()
            print(f"server log (tail):\n{log_path.read_text()[-2000:]}", file=sys.stderr)
            raise SystemExit(f"serve_load: {name}: {e or type(e).__name__}") from e
        finally:
            stop_server(server)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="exported model directory (default: the bundled model)")
    p.add_argument("--streams", default="32,128,192,256", help="comma-separated levels")
    p.add_argument("--seconds", type=float, default=20.0, help="duration of each level, s")
    p.add_argument("--clients", type=int, default=2, help="load-client processes, count")
    p.add_argument("--channels", type=int, default=1,
                   help="connections per client process, count (see above)")  # fmt: skip
    p.add_argument("--server-args", action="append",
                   help="flags added to `echoic serve` (default: none, its defaults); "
                        "again for another server, side by side")  # fmt: skip
    p.add_argument("--unbatched", action="store_true",
                   help="also run the levels against a server with --max-batch 1")  # fmt: skip
    p.add_argument("--chunk-ms", type=float, default=100.0, help="audio per message, ms")
    p.add_argument("--formatting", choices=("off", "on", "both", "mixed"), default="off",
                   help="finals formatted (docs/formatting.md); both: side by side; mixed: "
                        "every other stream, at the same time")  # fmt: skip
    p.add_argument(
        "--decoder",
        choices=("greedy", "beam"),
        default="greedy",
        help="every stream's decoder (beam: beam 32 with the model's LM)",
    )
    p.add_argument("--beam-streams", type=int, default=0,
                   help="beam-search streams beside each level's streams, from a client "
                        "process of their own, reported on a row of their own")  # fmt: skip
    p.add_argument("--lag-limit", type=float, default=1.0,
                   help="s a result may trail its audio (beyond lookahead)")  # fmt: skip
    p.add_argument("--manifest", help="utterances to send (default: synthesize a few)")
    p.add_argument("--utterances", type=int, default=8, help="distinct utterances, count")
    p.add_argument("--profile", type=float, default=0.0,
                   help="s of py-spy on the server in each level (0: none)")  # fmt: skip
    p.add_argument("--out", default=".", help="folder for --profile's files")
    # A load-client process (started by this script, one per --clients).
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--client-streams", type=int, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        print(json.dumps([asdict(stats) for stats in asyncio.run(client_level(args))]))
        return
    args.streams = [int(n) for n in args.streams.split(",")]
    if min(args.streams) < 1 or args.seconds <= 0 or args.clients < 1 or args.channels < 1:
        p.error("--streams, --clients and --channels must be positive counts, --seconds > 0")
    if args.profile and not 0 < args.profile < args.seconds:
        p.error("--profile must be shorter than --seconds")

    with tempfile.TemporaryDirectory(prefix="echoic-load-") as tmp:
        manifest = Path(args.manifest) if args.manifest else synthesize(Path(tmp), args.utterances)
        utterances = load_utterances(manifest, args.chunk_ms, args.utterances)
        audio = sum(sum(u.seconds) for u in utterances)
        print(
            f"{len(utterances)} utterances ({audio:.1f} s), {args.chunk_ms:g} ms chunks,"
            f" {args.seconds:g} s per level, {args.clients} client processes,"
            f" {args.channels} connection(s) each, {args.decoder} decoding, {os.cpu_count()} CPUs",
            file=sys.stderr,
        )
        capacity = engine_capacity(args.model)
        print(
            f"  engine capacity: {capacity:.0f} real-time streams (one batched streaming step"
            ' of 32 streams on every core, before any server starts); "of engine" = a'
            f" level whose final p95 <= {1000 * SUSTAINED_P95:.0f} ms with none behind, as a"
            " share of it",
            file=sys.stderr,
        )
        settings = [shlex.split(a) for a in args.server_args or [""]]
        servers = {" ".join(flags) or "defaults": flags for flags in settings}
        if args.unbatched:
            servers["--max-batch 1"] = [*settings[0], "--max-batch", "1"]
        runs = {row: levels for name, f in servers.items()
                for row, levels in bench_server(name, f, manifest.resolve(), utterances, args,
                                                Path(tmp)).items()}  # fmt: skip
        print_table(runs, capacity)


if __name__ == "__main__":
    main()
