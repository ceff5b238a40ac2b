"""`echoic serve --workers N`: N server processes on one port, under one supervisor.

One server process tops out near one core: its Python (gRPC messages on the event
loop, features and decoding in the engine's thread) shares one interpreter lock
(docs/benchmarks.md, "Benchmarks"). With `--workers N` the `echoic serve` process supervises N
worker processes instead, each a whole server (`app.serve` with the same
ServerConfig) on the same gRPC and HTTP ports:

- Ports. The supervisor first proves each port free with a bind without
  SO_REUSEPORT (a port that another program or another echoic server holds fails
  here, with the error one server gives), then binds it again with SO_REUSEPORT and
  holds that socket, never listening, while it runs: `--port 0` becomes one real
  port for every worker, and a socket that does not listen is never handed a
  connection. The workers bind the same ports with SO_REUSEPORT, and the kernel
  spreads connections over them: connections, not calls, so the streams of one
  client connection all land on one worker.
- Signals. SIGTERM or SIGINT: every worker drains as one server does
  (--grace-seconds), and the supervisor exits once all have. SIGHUP: every serving
  worker rescans the model repository.
- Deaths. A worker that dies while serving is logged and started again after a
  backoff (1 s, doubling up to 30 s; 1 s again once it had served a minute), while
  the others serve. A worker that fails before it serves (a bad model, a certificate
  it cannot read) stops them all with its error instead of looping.
- Metrics. With --metrics-port each worker serves its own registry on a private
  loopback port, and a scrape of the supervisor's --metrics-port fetches them all
  and shows every sample with a `worker` label ("1".."N"; a restarted worker keeps
  its number, so its counters restart as after any process restart), plus the
  supervisor's own `echoic_workers_serving` and `echoic_worker_restarts_total`. The
  HTTP door's /metrics, /healthz and /readyz, gRPC health and --max-streams are per
  worker: the worker that took the connection answers.
- A worker whose supervisor is gone (the pipe between them closes) drains and exits.
- Engines. The workers share one engine process per model version (engine_process.py,
  `EngineSpec.share`), through Unix sockets in a folder the supervisor makes and removes:
  its batches take every worker's streams, and the model and LM are loaded once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echoic.server.config import ServerConfig, ServerError, busy_port_hint, probe_binds

if TYPE_CHECKING:
    from echoic.server.metrics import MetricsHttp
    from echoic.server.process.app import Server

log = logging.getLogger("echoic.server")

FIRST_BACKOFF = 1.0  # s before a worker that died starts again
MAX_BACKOFF = 30.0  # s, the longest wait between two starts of one worker
STEADY_SECONDS = 60.0  # s a worker serves before its backoff starts over
STOP_SLACK = 20.0  # s beyond its drain (grace + the last results) a worker gets to exit
REAP_SECONDS = 5.0  # s between two reapings of orphaned engine processes
PR_SET_CHILD_SUBREAPER = 36  # prctl's option (linux/prctl.h)
SCRAPE_SECONDS = 5.0  # s a scrape waits for one worker's registry
WORKER_MODULE = "echoic.server.process.workers"  # what a worker process runs (python -m)


# ------------------------------------------------------------------ ports


def hold_port(host: str, port: int, error: str, flag: str) -> tuple[int, list[socket.socket]]:
    """Prove host:port free, then hold it for the workers (SO_REUSEPORT, not listening):
    (the port, a real one for 0; the sockets to keep open). `error` starts the message of
    the ServerError a busy port raises ("cannot listen on"), `flag` its hint."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ServerError("--workers needs SO_REUSEPORT (Linux), which this system lacks")
    held: list[socket.socket] = []
    try:
        # The probe has no SO_REUSEPORT: it binds alone, or fails; port 0 becomes the one
        # port every address and worker gets.
        for family, kind, proto, address, failed in probe_binds(host, port):
            if failed is not None:
                raise failed
            port = address[1]
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            # SO_REUSEPORT alone: the workers join it, while another server's probe (or a
            # plain bind with SO_REUSEADDR) is refused even before the workers listen.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
    except socket.gaierror as e:
        raise ServerError(f"{error} {host}:{port}: {e.strerror}") from e
    except OSError as e:
        for sock in held:
            sock.close()
        raise ServerError(f"{error} {host}:{port}: {e.strerror or e}{busy_port_hint(flag)}") from e
    return port, held


# ------------------------------------------------------------------ a worker process


# The messages a worker sends its supervisor, first and only (plain tuples: the worker
# runs this module as __main__, whose classes the supervisor could not unpickle).
READY = "ready"  # (READY, pid, its private metrics port or None): it serves
FAILED = "failed"  # (FAILED, the error one server would print): it could not start


def _worker_main(index: int, fd: int, level: int) -> None:
    """A worker: its ServerConfig from the supervisor through the socket `fd`, then one
    server (`app.serve`) that reports READY or FAILED back through it."""
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s %(name)s [worker {index}]: %(message)s"
    )
    from echoic.model.core.native import drop_stdio_chatter

    drop_stdio_chatter()  # as `echoic serve` itself does (cli/main.py)
    pipe = Connection(fd)
    config = pipe.recv()
    from echoic.model.runtime.card import ModelError
    from echoic.server.process.app import serve

    def ready(server: Server) -> None:
        pipe.send((READY, os.getpid(), server.metrics_port))
        loop = asyncio.get_running_loop()
        loop.add_reader(pipe.fileno(), _supervisor_gone, loop, pipe)

    try:
        serve(config, ready)
    except (ServerError, ModelError, OSError) as e:
        pipe.send((FAILED, str(e)))
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C in the terminal before this worker served
        sys.exit(130)


def _supervisor_gone(loop: asyncio.AbstractEventLoop, pipe: Connection) -> None:
    """The supervisor sends nothing: its end readable means closed (it died). Drain."""
    loop.remove_reader(pipe.fileno())
    log.warning("the supervisor is gone: draining and exiting")
    os.kill(os.getpid(), signal.SIGTERM)


# ------------------------------------------------------------------ the supervisor


def worker_settings(config: ServerConfig, port: int, http_port: int, engines: str) -> ServerConfig:
    """One worker's settings under a --workers supervisor: the supervisor's ports, shared
    (SO_REUSEPORT); a private metrics port that the supervisor scrapes; the engines'
    socket folder; and the beam decoder processes counted here, where --workers is known
    (each worker's share of the cores with an engine thread; the shared engine's with
    engine processes)."""
    return replace(
        config, workers=1, reuse_port=True, port=port, http_port=http_port,
        metrics_host="127.0.0.1",
        metrics_port=None if config.metrics_port is None else 0,  # private, any port
        engine_dir=engines, beam_processes=config.beam_decoder_processes,
    )  # fmt: skip


@dataclass
class _Worker:
    index: int  # 1..N, its `worker` label
    pid: int = 0  # 0 while not serving
    metrics_port: int | None = None
    process: Any = None  # its asyncio.subprocess.Process while one runs
    exit_code: int | None = None  # how it ended once the supervisor stopped it


def _adopt_orphans() -> None:
    """Make this process the one that orphaned descendants are handed to, not init
    (Linux's PR_SET_CHILD_SUBREAPER): a shared engine process whose starting worker died
    lives on for the other workers, and this process reaps it, and stops it at the end if
    it has not ended by itself. (In a container whose first process this is, nobody else
    would reap it.)"""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children() -> list[int]:
    """The pids of this process's children (/proc)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                    found.append(int(entry))
    return found


def _ended(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class Supervisor:
    """Starts, watches, restarts and stops the workers of one `echoic serve --workers N`."""

    def __init__(self, config: ServerConfig, log_level: int) -> None:
        self.config = config
        self._log_level = log_level
        self.workers = [_Worker(i) for i in range(1, config.workers + 1)]
        self._stopping = False
        self._stop = asyncio.Event()
        self._failure: str | None = None
        self._served: set[int] = set()  # the workers that have served at least once
        self._where = ""  # what the supervisor listens on, for its log line
        self._restarts: Any = None  # the restarts Counter, with --metrics-port
        self._started: set[int] = set()  # every worker process's pid

    async def run(self) -> None:
        config = self.config
        port, held = hold_port(config.host, config.port, "cannot listen on", "--port")
        metrics: MetricsHttp | None = None
        engines = ""
        stack = contextlib.ExitStack()
        try:
            http_port = 0
            if config.http_port:
                http_port, more = hold_port(
                    config.host, config.http_port, "cannot serve HTTP on", "--http-port"
                )
                held += more
            if config.metrics_port is not None:
                metrics = self._serve_metrics()
            self._where = (
                f"listening on {config.host}:{port} ({'TLS' if config.tls_cert else 'plaintext'})"
                f", {config.workers} workers" + (f", HTTP on :{http_port}" if http_port else "")
                + (f", metrics on :{metrics.server_port}" if metrics else "")
            )  # fmt: skip
            # One engine process per model version for all the workers (they connect to it
            # through a socket in this folder): its batches gather every worker's streams.
            engines = tempfile.mkdtemp(prefix="echoic-engines-")
            _adopt_orphans()
            reaping = asyncio.create_task(self._reap_orphans())
            stack.callback(reaping.cancel)
            worker_config = worker_settings(config, port, http_port, engines)
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self._on_stop, signum)
            loop.add_signal_handler(signal.SIGHUP, self._on_hangup)
            tasks = [asyncio.create_task(self._keep(w, worker_config)) for w in self.workers]
            for task in tasks:  # a supervisor that cannot keep a worker stops, not hangs
                task.add_done_callback(
                    lambda t: t.cancelled() or t.exception() is None or self._begin_stop()
                )
            await self._stop.wait()
            await self._stop_all(tasks)
            await asyncio.to_thread(self._end_orphans, STOP_SLACK)
        finally:
            stack.close()
            if metrics is not None:
                metrics.stop()
            for sock in held:
                sock.close()
            if engines:  # its engine processes ended with the last worker each served
                shutil.rmtree(engines, ignore_errors=True)
        if self._failure is not None:
            raise ServerError(self._failure)
        unclean = [f"worker {w.index} {_ended(w.exit_code)}" for w in self.workers
                   if w.exit_code not in (None, 0)]  # fmt: skip
        if unclean:
            raise ServerError(f"not every worker drained cleanly: {'; '.join(unclean)}")
        log.info("stopped")

    # ---- engine processes left by a worker that died

    def _orphans(self) -> list[int]:
        """This process's children that are not workers: engine processes whose worker
        died (`_adopt_orphans` makes them this process's)."""
        workers = self._started
        return [pid for pid in _children() if pid not in workers]

    async def _reap_orphans(self) -> None:
        """Orphaned engines that have ended, reaped (no zombies) while the server runs."""
        while True:
            await asyncio.sleep(REAP_SECONDS)
            for pid in self._orphans():
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    def _end_orphans(self, timeout: float) -> None:
        """Once every worker has stopped: the orphaned engines end by themselves (their
        last door is gone); one still there after `timeout` s is killed. Each reaped."""
        deadline = time.monotonic() + timeout
        while orphans := self._orphans():
            for pid in orphans:
                if time.monotonic() > deadline:
                    log.error("engine process %d did not end with the workers: killing it", pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)

    # ---- one worker's lives

    async def _keep(self, worker: _Worker, config: ServerConfig) -> None:
        """Start `worker`, and again each time it dies, until the supervisor stops."""
        loop = asyncio.get_running_loop()
        backoff = FIRST_BACKOFF
        while not self._stopping:
            mine, theirs = socket.socketpair()
            with theirs:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", WORKER_MODULE, str(worker.index), str(theirs.fileno()),
                    str(self._log_level), pass_fds=(theirs.fileno(),),
                )  # fmt: skip
            worker.process = process
            self._started.add(process.pid)
            pipe = Connection(mine.detach())
            served, started = False, loop.time()
            try:
                pipe.send(config)
                await _readable(pipe.fileno())
                try:
                    message = pipe.recv()
                except EOFError:  # it died before a word
                    message = (None,)
                if message[0] != READY:
                    code = await process.wait()
                    if self._stopping:
                        return
                    why = (
                        message[1] if message[0] == FAILED else
                        f"worker {worker.index} {_ended(code)} before it served "
                        "(its log above says why)"
                    )  # fmt: skip
                    if worker.index not in self._served:  # the first start: stop them all
                        self._fail(why)
                        return
                    # A restart that fails (a load error, a bad new version) leaves the
                    # other workers serving; this one tries again after its backoff.
                    log.error("worker %d did not start again: %s", worker.index, why)
                else:
                    served, started = True, loop.time()
                    _, worker.pid, worker.metrics_port = message
                    log.info("worker %d serving (pid %d)", worker.index, worker.pid)
                    if len(self._served) < len(self.workers):
                        self._served.add(worker.index)
                        if len(self._served) == len(self.workers):  # all, the first time
                            log.info("%s", self._where)
                    code = await process.wait()
            finally:
                worker.pid, worker.metrics_port, worker.process = 0, None, None
                pipe.close()
            if self._stopping:
                worker.exit_code = code
                return
            if served and loop.time() - started >= STEADY_SECONDS:
                backoff = FIRST_BACKOFF
            log.error(
                "worker %d (pid %d) %s; starting it again in %g s",
                worker.index, process.pid, _ended(code), backoff,
            )  # fmt: skip
            if self._restarts is not None:
                self._restarts.labels(str(worker.index)).inc()
            try:
                await asyncio.wait_for(self._stop.wait(), backoff)
            except TimeoutError:
                pass
            backoff = min(2 * backoff, MAX_BACKOFF)

    # ---- stopping

    def _fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
        self._begin_stop()

    def _begin_stop(self) -> None:
        self._stopping = True
        self._stop.set()

    def _on_stop(self, signum: int) -> None:
        if self._stopping:
            return
        log.info(
            "%s: draining every worker's open streams for up to %g s",
            signal.Signals(signum).name, self.config.grace_seconds,
        )  # fmt: skip
        self._begin_stop()

    def _on_hangup(self) -> None:
        if self._stopping:
            return  # shutting down: nothing new loads
        serving = [w for w in self.workers if w.pid]
        log.info("SIGHUP: passed on to %d serving worker(s)", len(serving))
        for worker in serving:  # one still starting loads the repository as it is anyway
            os.kill(worker.pid, signal.SIGHUP)

    async def _stop_all(self, tasks: list[asyncio.Task]) -> None:
        """SIGTERM to every worker, then wait for them all: the drain, the final results
        and some slack, after which a worker still there is killed."""
        from echoic.server.process.app import END_SECONDS

        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGTERM)
        limit = self.config.grace_seconds + END_SECONDS + STOP_SLACK
        _, late = await asyncio.wait(tasks, timeout=limit)
        for worker in self.workers:
            if late and worker.process is not None and worker.process.returncode is None:
                log.error("worker %d did not stop within %g s: killing it", worker.index, limit)
                worker.process.kill()
        for task in tasks:
            await task  # a bug in the supervisor surfaces here

    # ---- metrics

    def _serve_metrics(self) -> MetricsHttp:
        from prometheus_client import CollectorRegistry, Counter, Gauge
        from prometheus_client.exposition import choose_encoder

        from echoic.server.metrics import serve_http

        registry = CollectorRegistry(auto_describe=False)
        registry.register(WorkerRegistries(self.workers))
        serving = Gauge(
            "echoic_workers_serving", "Worker processes serving now.", registry=registry
        )
        serving.set_function(lambda: sum(1 for w in self.workers if w.pid))
        self._restarts = Counter(
            "echoic_worker_restarts", "Workers started again after they died, by worker.",
            ("worker",), registry=registry,
        )  # fmt: skip
        for worker in self.workers:
            self._restarts.labels(str(worker.index))

        def exposition(accept: str) -> tuple[bytes, str]:
            encode, content_type = choose_encoder(accept)
            return encode(registry), content_type

        host, port = self.config.metrics_host, self.config.metrics_port
        try:
            return serve_http(host, port, exposition, self.config.idle_timeout_seconds)
        except OSError as e:
            raise ServerError(f"cannot serve metrics on {host}:{port}: {e}") from e


class WorkerRegistries:
    """A Prometheus collector: every serving worker's registry, fetched from its private
    port at each scrape, its samples labelled `worker`. A worker that does not answer
    (starting, just died) is left out of that scrape."""

    def __init__(self, workers: list[_Worker]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import Metric
        from prometheus_client.parser import text_string_to_metric_families

        # One read of each port: the supervisor's loop clears it when a worker dies.
        serving = [(w.index, port) for w in self._workers if w.pid and (port := w.metrics_port)]
        with ThreadPoolExecutor(max(1, len(serving))) as pool:
            texts = list(pool.map(_scrape, [port for _, port in serving]))
        families: dict[str, Metric] = {}
        for (index, _), text in zip(serving, texts, strict=True):
            for family in text_string_to_metric_families(text or ""):
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                merged.samples += [
                    s._replace(labels={**s.labels, "worker": str(index)}) for s in family.samples
                ]
        yield from families.values()

    def workers_serving(self) -> list[_Worker]:
        return [w for w in self._workers if w.pid and w.metrics_port]


def _scrape(port: int) -> str | None:
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=SCRAPE_SECONDS) as response:
            return response.read().decode()
    except (OSError, ValueError):  # a worker gone meanwhile: its samples are missing
        return None


def supervise(config: ServerConfig) -> None:
    """Run `config.workers` servers on the same ports until SIGTERM or SIGINT, then drain
    them all; raises ServerError when a worker cannot start (its error) or did not drain."""
    level = logging.getLogger().getEffectiveLevel()
    asyncio.run(Supervisor(config, level).run())


if __name__ == "__main__":  # a worker, started by Supervisor._keep
    _worker_main(*(int(arg) for arg in sys.argv[1:]))
