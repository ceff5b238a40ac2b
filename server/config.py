"""ServerConfig: everything `echoic serve` can be told, with units.

Each field is a `setting`: its default, what it means (with its unit) and how it
appears on the command line (`Flag`). `echoic serve` builds its flags from these
fields (echoic.cli.serve), so a default, a type or a help text is written here once.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ServerError(Exception):
    """A server that cannot start as configured; the message says what to change."""


def busy_port_hint(flag: str) -> str:
    """What to do about a port another program holds, for the flag that chose it."""
    return f" (another server there?): stop it, or pass {flag} PORT (0 = any free port)"


def probe_binds(host: str, port: int) -> Iterator[tuple[int, int, int, Any, OSError | None]]:
    """Each address a server on host:port binds (TCP, passive; each once), bound once as
    the server will bind it (SO_REUSEADDR, no listen) and let go, for a check that the
    port is free: (family, type, proto, the address, why it could not be bound or None).
    For port 0 the port the first address got is the one tried at the others (a server
    gets one port on every address). socket.gaierror when the host does not resolve."""
    infos = socket.getaddrinfo(
        host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    for family, kind, proto, _, address in dict.fromkeys(infos):
        address = (address[0], port, *address[2:])
        error = None
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
                port = probe.getsockname()[1]
                address = (address[0], port, *address[2:])
            except OSError as e:
                error = e
        yield family, kind, proto, address, error


@dataclass(frozen=True)
class Flag:
    """How a ServerConfig field appears on `echoic serve`'s command line.

    The value's type comes from the field's annotation and "(default ...)" from its
    default (nothing for None: the field's help says what unset means).
    """

    name: str = ""  # --NAME; "" = the field's name with - for _
    metavar: str = ""  # the value's placeholder in --help; "" = NAME in capitals
    exclusive: str = ""  # flags with the same tag exclude each other; "" = none
    switch: Any = None  # not None: the flag takes no value and sets the field to this
    help: str = ""  # the flag's help where it differs from the field's (a switch); "" = same
    alias: tuple[str, Any, str] | None = None  # (NAME, value, help): --NAME, a switch setting
    # the field to value, kept for command lines written before the flag existed


def setting(default: Any, help: str, flag: Flag | None = Flag()) -> Any:  # noqa: B008 - frozen
    """A ServerConfig field: default, meaning with unit, flag (None: deliberately not one)."""
    return field(default=default, metadata={"help": help, "flag": flag})


DECODERS = ("auto", "greedy", "beam")  # ServerConfig.decoder
ENGINES = ("auto", "thread", "process")  # ServerConfig.engine


CGROUP = Path("/sys/fs/cgroup")  # where this process's cgroup (a container's own) is mounted


def _cores() -> int:
    """The cores this process may use: those it may run on (`taskset`, a cpuset), and no
    more than its cgroup's CPU quota, rounded up (a container's CPU limit: on a 64-core
    node a pod limited to 2 CPUs gets 2 lanes and 2 decoder processes, not 64)."""
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None) or (
        os.cpu_count() or 1
    )
    quota = _quota_cores(CGROUP)  # None, or at least 1
    return min(cores, quota) if quota else cores


def _quota_cores(root: Path) -> int | None:
    """The CPU quota of the cgroup mounted at `root` in cores, rounded up; None without one
    (cgroup v2's cpu.max "QUOTA PERIOD" or "max PERIOD"; v1's cpu.cfs_quota_us, -1 for
    none, and cpu.cfs_period_us)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return math.ceil(q / p) if q > 0 and p > 0 else None


DECODER_THREADS = 2  # beam searches at once, count: the machine's cores are for the batches
# --beam-processes -1 starts one per core, but no more than this: each holds its own LM, and
# each loaded model version (two during a hot reload) has its own set
MAX_AUTO_BEAM_PROCESSES = 8

CPU = ("CPUExecutionProvider",)
CUDA_THEN_CPU = ("CUDAExecutionProvider", "CPUExecutionProvider")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ServerConfig:
    # What to serve: one model directory, or a repository MODEL_REPO/<name>/<version>/.
    model_dir: Path | None = setting(
        None,
        "one model directory written by `echoic export`, served as it is (no hot reload)",
        Flag("model", "DIR", exclusive="model"),
    )
    model_repo: Path | None = setting(
        None,
        "a model repository DIR/<name>/<version>/, polled for new versions (hot reload); "
        "with neither flag: the default repository ($ECHOIC_MODEL_REPO, else "
        "~/.local/share/echoic/models), seeded with the bundled model on first use",
        Flag(metavar="DIR", exclusive="model"),
    )
    default_model: str = setting(
        "",
        'the model name a request that names none gets; "" = the only one served',
        Flag(metavar="NAME"),
    )
    poll_seconds: float = setting(
        5.0,
        "s between two scans of the model repository; 0 = scan only at start",
        Flag(metavar="S"),
    )

    # Where to listen.
    host: str = setting("127.0.0.1", "address to bind gRPC to; [::] or 0.0.0.0 = every interface")
    port: int = setting(50051, "gRPC port; 0 = any free port")
    metrics_port: int | None = setting(
        None,
        "serve Prometheus metrics at http://METRICS_HOST:PORT/metrics; 0 = any free port, "
        "unset = off",
        Flag(metavar="PORT"),
    )
    metrics_host: str = setting("127.0.0.1", "address to bind the metrics endpoint to")
    workers: int = setting(
        1,
        "server processes, count, each a whole server on the same ports (SO_REUSEPORT: the "
        "kernel spreads connections, not calls, over them) under one supervisor that serves "
        "--metrics-port for all; 1 = this process serves",
        Flag(metavar="N"),
    )
    reuse_port: bool = setting(
        False,
        "bind the gRPC and HTTP ports with SO_REUSEPORT, beside the other workers of one "
        "--workers supervisor (which holds the ports against other programs); off, a busy "
        "port is an error",
        flag=None,
    )
    engine_dir: str | None = setting(
        None,
        "a folder for the engine processes' sockets, shared by the workers of one --workers "
        "supervisor (which makes it): each model version's engine process then serves every "
        "worker; None: each server process starts its own",
        flag=None,
    )
    http_port: int = setting(
        8000,
        "HTTP port on --host, with the same TLS: the OpenAI-compatible API "
        "(/v1/audio/transcriptions, /v1/models), /healthz, /readyz and /metrics; 0 = off",
        Flag(metavar="PORT"),
    )

    # Batch dispatch (one dispatcher per loaded model version).
    max_batch: int = setting(32, "streams per ONNX Runtime call, count", Flag(metavar="N"))
    max_wait_ms: float = setting(
        0.0,
        "with --engine thread: ms a dispatcher waits for a fuller batch; 0 = run whatever "
        "is ready at once (an engine process always does)",
        Flag(metavar="MS"),
    )
    # auto by measurement (bench/serve_load.py), docs/benchmarks.md
    # "The engine in its own process": on 2 cores, 256 streams fell behind 1,029 of
    # 1,096 utterances in a thread and 2 of 1,579 in a process of its own.
    engine: str = setting(
        "auto",
        "where each model version's batches run: process = an engine process of its own "
        "(its streams' features, model calls, decoding and endpointing, beside the doors' "
        "process rather than under its interpreter lock); thread = a thread of this process; "
        "auto = process on a machine with two cores or more",
        Flag(metavar="{auto,thread,process}"),
    )
    batch_lanes: int = setting(
        0,
        "with --engine process: batches an engine process runs at once, count, each in a "
        "thread of its own with its own ONNX Runtime call (--threads each), so that one "
        "model's batches use every core without ONNX Runtime's threads waiting on each "
        "other; 0 = one per core",
        Flag(metavar="N"),
    )
    beam_processes: int = setting(
        -1,
        "beam searches run in this many decoder processes of their own, count, each "
        "stream's in one of them (flashlight's decoder holds the interpreter lock while it "
        "decodes, which stalls the server's other threads); -1 = one per core, at most 8 "
        "(with --engine thread and --workers, shared among the workers); 0 = in the "
        "server's own decoder threads",
        Flag(metavar="N"),
    )
    # auto by measurement (docs/serving.md, "Choosing the decoder"): on the bundled model, beam
    # search with its LM cuts held-out WER from 58% to 37% for 4x the decoding time (still
    # 60x faster than real time); without an LM, beam gains 1 point for 1.25x, so greedy.
    decoder: str = setting(
        "auto",
        "the decoding a request that names none gets: greedy, beam (CTC beam search with "
        "the model's word LM when it ships one), or auto = beam for a model with an LM, "
        "greedy for one without",
        Flag(metavar="{auto,greedy,beam}"),
    )
    # 1 by measurement (bench/serve_load.py, docs/benchmarks.md, "Benchmarks"): the server's Python
    # threads need a core of their own, and batched calls of this size gain little from
    # a second ONNX Runtime thread; more cores serve more streams as more replicas.
    intra_op_threads: int = setting(
        1,
        "ONNX Runtime threads inside one operator, count; 0 = onnxruntime's default (one per core)",
        Flag("threads", "N"),
    )
    ort_spin_wait: bool = setting(
        True,
        "ONNX Runtime's idle threads spin for the next call instead of sleeping (its "
        "default: fastest when the cores are otherwise idle)",
        Flag("no-ort-spin", switch=False,
             help="ONNX Runtime's idle threads sleep between calls instead of spinning, "
                  "leaving the cores to the server's own threads"),
    )  # fmt: skip
    # Streaming a full-context waveform model (an imported wav2vec2) by overlapped chunks.
    chunk_ms: float = setting(
        1000.0,
        "ms of audio each overlapped window adds to a full-context imported model's stream; "
        "0 = such models do not stream (Recognize only)",
        Flag(metavar="MS"),
    )
    chunk_left_ms: float = setting(
        1000.0, "ms of audio before the chunk each overlapped window sees again", Flag(metavar="MS")
    )
    chunk_right_ms: float = setting(
        500.0,
        "ms of audio after the chunk each overlapped window waits for (latency)",
        Flag(metavar="MS"),
    )
    device: str = setting(
        "cpu",
        "where the models run: cpu, or cuda (ONNX Runtime's CUDA execution provider, its "
        "CPU provider for the ops CUDA lacks, streaming states kept on the GPU between "
        "steps; needs onnxruntime-gpu: pip install 'echoic[gpu]')",
        Flag(metavar="DEVICE", alias=("gpu", "cuda", "the same as --device cuda")),
    )

    # Limits.
    max_streams: int = setting(
        256,
        "concurrent StreamingRecognize and Recognize calls, count, per worker process "
        "(--workers); more get RESOURCE_EXHAUSTED",
        Flag(metavar="N"),
    )
    max_audio_seconds: float = setting(
        3600.0, "audio per request or stream, s; 0 = no limit", Flag(metavar="S")
    )
    idle_timeout_seconds: float = setting(
        30.0,
        "s a stream may send nothing before it gets DEADLINE_EXCEEDED; also how long an HTTP "
        "or metrics connection with no request in progress stays open",
        Flag(metavar="S"),
    )
    max_stream_seconds: float = setting(
        3900.0,
        "wall time a stream may stay open, s, however slowly it sends (the longest audio "
        "accepted, at real time, plus slack); 0 = no limit",
        Flag(metavar="S"),
    )
    punctuation_model: Path | None = setting(
        None,
        "the punctuation and capitals tagger (an ONNX file written by python -m "
        "echoic.training.punctuation) for formatted transcripts; unset: the bundled "
        "model/punct/punct.onnx. A file that cannot be loaded leaves the server serving, "
        "formatting without punctuation refused (docs/formatting.md)",
        Flag(metavar="FILE"),
    )
    max_beam_size: int = setting(
        64,
        "largest beam_size a request may ask for, hypotheses per frame (a beam search's "
        "CPU and memory grow with it)",
        Flag(metavar="N"),
    )
    max_message_bytes: int = setting(
        32 * 1024 * 1024, "largest request message, bytes", Flag(metavar="B")
    )
    max_connection_age_seconds: float = setting(
        0.0,
        "s after which a client connection is asked to reconnect (GOAWAY), so that clients "
        "spread over new replicas; its open streams may finish (up to --max-stream-seconds); "
        "0 = never",
        Flag("max-connection-age", "S"),
    )
    max_http_connections: int = setting(
        0,
        "open connections to the HTTP port, count, per worker process; one more closes the "
        "oldest one with no request in progress (idle, or still sending its headers); 0 = "
        "half the process's open-file limit, so that HTTP sockets never use up the "
        "descriptors the gRPC port needs",
        Flag(metavar="N"),
    )
    max_upload_mb: float = setting(
        25.0,
        "largest file an HTTP transcription request may upload, MiB; a bigger one is refused "
        "(413) as it arrives, never held whole",
        Flag(metavar="MB"),
    )
    upload_timeout_seconds: float = setting(
        300.0,
        "s an HTTP upload may take from its headers to its last byte, however steadily it "
        "sends (with --idle-timeout-seconds between two reads); past it 408. A request takes "
        "a --max-streams slot only once its upload is complete",
        Flag(metavar="S"),
    )
    # Apache's mod_reqtimeout asks 500 bytes/s of a request body by default: far below any
    # real link (a 25 MiB upload at that pace would not fit --upload-timeout-seconds anyway),
    # far above a client that trickles a byte at a time to hold its place (17 bytes/s seen).
    min_upload_bytes_per_second: float = setting(
        500.0,
        "least pace of an HTTP upload, bytes/s, averaged from its headers on, once "
        "--idle-timeout-seconds have passed; slower gets 408 at once; 0 = no minimum",
        Flag(metavar="B"),
    )
    grace_seconds: float = setting(
        30.0, "s open streams get to finish on shutdown: SIGTERM or Ctrl-C", Flag(metavar="S")
    )
    decode_threads: int = setting(
        4,
        "threads that decode whole files (Recognize, HTTP uploads) and buffered streams "
        "(MP3) at their end, count: a pool of their own, so that slow decodes wait for each "
        "other, never for the server's other work",
        Flag(metavar="N"),
    )
    decode_timeout_seconds: float = setting(
        120.0,
        "s one such decode may take (CPU, from memory: it never waits for bytes); past it the "
        "request gets DEADLINE_EXCEEDED (HTTP 408); 0 = no limit",
        Flag(metavar="S"),
    )

    # What the server shows.
    reflection: bool = setting(
        True,
        "gRPC server reflection (grpcurl list/describe)",
        Flag("no-reflection", switch=False, help="turn gRPC server reflection off"),
    )
    expose_paths: bool = setting(
        False,
        "ListModels gives each version's directory on the server",
        Flag(switch=True, help="show each model version's directory in ListModels (off: hidden)"),
    )

    # TLS: a certificate and key serve TLS; a client CA as well requires client certificates.
    tls_cert: Path | None = setting(
        None, "PEM server certificate (chain): serve TLS; unset = plaintext", Flag(metavar="PEM")
    )
    tls_key: Path | None = setting(
        None, "PEM private key of the TLS certificate", Flag(metavar="PEM")
    )
    tls_client_ca: Path | None = setting(
        None,
        "PEM CA bundle that client certificates must chain to: require them (mutual TLS)",
        Flag(metavar="PEM"),
    )

    @property
    def providers(self) -> tuple[str, ...]:
        """ONNX Runtime execution providers for `device`, the first preferred."""
        return CUDA_THEN_CPU if self.device == "cuda" else CPU

    @property
    def engine_process(self) -> bool:
        """Each model version's engine runs in a process of its own (`engine`)."""
        if self.engine == "auto":
            return _cores() >= 2
        return self.engine == "process"

    @property
    def lanes(self) -> int:
        """Batches an engine process runs at once (`batch_lanes`; 0 = one per core)."""
        return self.batch_lanes or _cores()

    @property
    def beam_decoder_processes(self) -> int:
        """Beam-search decoder processes (`beam_processes`; -1 = one per core): an engine
        process's own, or, with --engine thread, each worker's share of the cores."""
        if self.beam_processes >= 0:
            return self.beam_processes
        cores = min(_cores(), MAX_AUTO_BEAM_PROCESSES)
        return cores if self.engine_process else max(1, cores // self.workers)

    def __post_init__(self) -> None:
        checks = [
            (self.device in DEVICES, f"device must be one of {', '.join(DEVICES)}"),
            (
                self.decoder in DECODERS,
                f"decoder must be one of {', '.join(DECODERS)}, got {self.decoder!r}",
            ),
            (self.model_dir is None or self.model_repo is None, "give a model or a model repo"),
            (self.poll_seconds >= 0, "poll_seconds must be >= 0"),
            (self.chunk_ms >= 0, "chunk_ms must be >= 0"),
            (self.chunk_left_ms >= 0 and self.chunk_right_ms >= 0, "chunk contexts must be >= 0"),
            (0 <= self.port <= 65535, "port must be in 0-65535"),
            (self.workers >= 1, "workers must be >= 1 (server processes; 1 = this one)"),
            (self.metrics_port is None or 0 <= self.metrics_port <= 65535, "bad metrics_port"),
            (0 <= self.http_port <= 65535, "http_port must be in 0-65535 (0 = off)"),
            (self.max_http_connections >= 0, "max_http_connections must be >= 0 (0 = auto)"),
            (self.max_upload_mb > 0, "max_upload_mb must be > 0"),
            (self.upload_timeout_seconds > 0, "upload_timeout_seconds must be > 0"),
            (self.min_upload_bytes_per_second >= 0, "min_upload_bytes_per_second must be >= 0"),
            (self.max_batch >= 1, "max_batch must be >= 1"),
            (self.max_wait_ms >= 0, "max_wait_ms must be >= 0"),
            (
                self.beam_processes >= -1,
                "beam_processes must be >= -1 (-1 = one per core, 0 = decoder threads)",
            ),
            (self.batch_lanes >= 0, "batch_lanes must be >= 0 (0 = one per core)"),
            (
                self.engine in ENGINES,
                f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}",
            ),
            (self.max_streams >= 1, "max_streams must be >= 1"),
            (self.max_audio_seconds >= 0, "max_audio_seconds must be >= 0"),
            (self.max_beam_size >= 1, "max_beam_size must be >= 1"),
            (self.max_stream_seconds >= 0, "max_stream_seconds must be >= 0"),
            (self.idle_timeout_seconds > 0, "idle_timeout_seconds must be > 0"),
            (self.max_message_bytes >= 1024, "max_message_bytes must be >= 1024"),
            (self.grace_seconds >= 0, "grace_seconds must be >= 0"),
            (self.decode_threads >= 1, "decode_threads must be >= 1"),
            (self.decode_timeout_seconds >= 0, "decode_timeout_seconds must be >= 0"),
            (self.max_connection_age_seconds >= 0, "max_connection_age_seconds must be >= 0"),
            ((self.tls_cert is None) == (self.tls_key is None), "TLS needs both cert and key"),
            (self.tls_client_ca is None or self.tls_cert is not None, "mTLS needs a server cert"),
        ]
        for ok, message in checks:
            if not ok:
                raise ServerError(message)
