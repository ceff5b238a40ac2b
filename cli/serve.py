"""`echoic serve`: the transcription server (gRPC Recognize, StreamingRecognize, ListModels;
HTTP: OpenAI's /v1/audio/transcriptions)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from echoic.server.config import Flag, ServerConfig, ServerError

C = TypeVar("C")

EXAMPLES = """\
examples:
  # the default model repository (seeded with the bundled model on first use; `echoic
  # deploy` publishes new versions into it): gRPC on 127.0.0.1:50051, HTTP on :8000
  echoic serve
  curl -F file=@talk.wav -F model=whisper-1 localhost:8000/v1/audio/transcriptions
  echoic models --server 127.0.0.1:50051

  # one exported model, reachable from other machines, metrics on :9090
  echoic serve --model models/echoic-ds2/3 --host 0.0.0.0 --metrics-port 9090

  # a model repository MODEL_REPO/<name>/<version>/, polled every 10 s: `echoic deploy`
  # a new version in and it takes over without dropping a stream
  echoic serve --model-repo models --poll-seconds 10

  # bigger batches under load (wait up to 5 ms for more streams), at most 500 streams
  echoic serve --model-repo models --max-batch 64 --max-wait-ms 5 --max-streams 500

  # TLS; add --tls-client-ca to require client certificates (mutual TLS)
  echoic serve --model-repo models --tls-cert server.pem --tls-key server.key \\
      --tls-client-ca clients-ca.pem

Check it with grpcurl (reflection is on):
  grpcurl -plaintext 127.0.0.1:50051 list
  grpcurl -plaintext 127.0.0.1:50051 echoic.v1.Transcriber/ListModels
  grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check

  # two server processes on one port (the kernel spreads connections over them), for
  # more than one core's worth of streams; --max-streams is per process
  echoic serve --workers 2 --metrics-port 9090

SIGTERM or Ctrl-C stops taking new calls and gives open streams --grace-seconds
to finish. The API is protos/echoic/v1/transcriber.proto.
"""

# Modules of the serve extra, and the package that provides each.
_SERVE_MODULES = {
    "onnxruntime": "onnxruntime",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "prometheus_client": "prometheus-client",
    "aiohttp": "aiohttp",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve models over gRPC and HTTP (streaming and batch transcription)",
        description="Serve exported models over gRPC: Recognize (whole audio), "
        "StreamingRecognize\n(bidirectional, interim and final results) and ListModels, "
        "with health checks,\nreflection, Prometheus metrics, hot reload and TLS; and over "
        "HTTP (--http-port):\nOpenAI's POST /v1/audio/transcriptions, /v1/models, /healthz, "
        "/readyz, /metrics.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p, ServerConfig)
    p.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"),
        help="server log level (default %(default)s)",
    )  # fmt: skip
    p.set_defaults(func=run)


# ---------------------------------------------------------------- flags from a config


def _flagged(config: type) -> Iterator[tuple[dataclasses.Field, Flag, Any]]:
    """The fields of a config dataclass that are flags: (field, its Flag, its type)."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if f.metadata["flag"] is not None:
            yield f, f.metadata["flag"], hints[f.name]


def _value_type(kind: Any, name: str) -> type:
    """The type a flag's value is parsed to: the annotation, without `| None`."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kinds = [k for k in typing.get_args(kind) if k is not type(None)]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind not in (Path, int, float, str):
        raise TypeError(f"{name}: no flag for a {kind!r} field; give it a Flag(switch=...)")
    return kind


def _shown(default: Any) -> str:
    return f"{default:g}" if isinstance(default, float) else str(default)


def add_flags(parser: argparse.ArgumentParser, config: type) -> None:
    """One flag per field of `config` (a dataclass of `setting`s), in field order."""
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f, flag, kind in _flagged(config):
        name = flag.name or f.name.replace("_", "-")
        target: argparse._ActionsContainer = parser
        if flag.exclusive:
            if flag.exclusive not in groups:
                groups[flag.exclusive] = parser.add_mutually_exclusive_group()
            target = groups[flag.exclusive]
        text = (flag.help or f.metadata["help"]).replace("%", "%%")  # argparse formats help
        if flag.switch is not None:
            how: dict[str, Any] = dict(action="store_const", const=flag.switch)
        else:
            metavar = flag.metavar or name.replace("-", "_").upper()
            how = dict(type=_value_type(kind, f.name), metavar=metavar)
            if f.default is not None:
                text += f" (default {_shown(f.default)})"
        target.add_argument(f"--{name}", dest=f.name, default=f.default, help=text, **how)
        if flag.alias is not None:
            alias, value, alias_help = flag.alias
            target.add_argument(
                f"--{alias}", dest=f.name, action="store_const", const=value, help=alias_help
            )


def from_flags(config: type[C], args: argparse.Namespace) -> C:
    """The `config` that parsed flags (`add_flags`) describe; fields without flags keep defaults."""
    return config(**{f.name: getattr(args, f.name) for f, _, _ in _flagged(config)})


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError, missing_extra

    try:
        config = from_flags(ServerConfig, args)  # a bad combination fails before any import
        if config.workers > 1:  # a supervisor: the workers import the server, not this process
            import importlib.util

            for module, package in _SERVE_MODULES.items():
                if importlib.util.find_spec(module) is None:
                    raise missing_extra("serve", package)
            from echoic.server.process.workers import supervise as serve
        else:
            from echoic.server.process.app import serve

        logging.basicConfig(
            level=args.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        serve(config)
    except ServerError as e:
        raise UserError(str(e)) from e
    except ModuleNotFoundError as e:
        if e.name in _SERVE_MODULES:
            raise missing_extra("serve", _SERVE_MODULES[e.name]) from e
        raise
    return 0
