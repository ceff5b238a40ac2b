"""`echoic models`: what a model repository holds, or what a running server has loaded."""

from __future__ import annotations

import argparse
import json

from echoic.cli.stream import DEFAULT_SERVER, add_tls_options

EXAMPLES = """\
examples:
  # the default repository (what `echoic serve` with no model flag serves)
  echoic models

  # another repository, as JSON lines
  echoic models --repo models --json

  # what a running server has loaded: serving (LOADED) and DRAINING versions
  echoic models --server 127.0.0.1:50051

  # the bundled model's directory (to fine-tune it: echoic train ... init_from=DIR)
  echoic models --bundled

The default repository is $ECHOIC_MODEL_REPO, else $XDG_DATA_HOME/echoic/models,
else ~/.local/share/echoic/models. A server serves the newest complete version of
each name (status "newest"; --server shows what it has actually loaded); a version
that is not complete says why.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list a model repository's versions, or a running server's loaded models",
        description="List the versions in a model repository (the default one unless --repo),\n"
        "or, with --server, the model versions a running server has loaded.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--repo", metavar="DIR", help="model repository (default: the default one)")
    where.add_argument(
        "--server",
        metavar="HOST:PORT",
        nargs="?",
        const=DEFAULT_SERVER,
        help=f"ask a running server (ListModels); no value: {DEFAULT_SERVER}",
    )
    where.add_argument("--bundled", action="store_true", help="print the bundled model's directory")
    p.add_argument("--json", action="store_true", help="one JSON object per version")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="s to reach --server")
    add_tls_options(p)
    p.set_defaults(func=run)


def _table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip())
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns).rstrip())


def repository_rows(repo) -> list[dict]:
    """One row per version directory of `repo`, newest first within a name."""
    from echoic.model.core.lm import model_lm
    from echoic.model.runtime.repository import (
        incomplete,
        read_report_card,
        scan_repository,
        version_key,
    )

    rows = []
    for name, versions in scan_repository(repo).items():
        newest = True
        for version in sorted(versions, key=version_key, reverse=True):
            path = versions[version]
            why = incomplete(path)
            card = None if why else read_report_card(path)
            status = f"incomplete: {why}" if why else ("newest" if newest else "older")
            newest = newest and bool(why)
            rows.append({
                "name": name,
                "version": version,
                "status": status,
                "step": card.training_step if card else "",
                "lm": model_lm(path) is not None,
                "streamable": card.streamable if card else "",
                "path": str(path),
            })  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from echoic.cli.errors import UserError

    if args.bundled:
        from echoic.model.runtime.recognizer import default_model_dir

        print(default_model_dir())
        return 0
    if args.server:
        return _server(args)
    from echoic.model.runtime.repository import default_repository

    repo = Path(args.repo) if args.repo else default_repository()
    if not repo.is_dir():
        hint = "" if args.repo else " (`echoic serve` creates it, seeded with the bundled model)"
        raise UserError(f"{repo}: no such model repository{hint}")
    rows = repository_rows(repo)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    elif rows:
        print(f"repository {repo}")
        _table(rows, ["name", "version", "status", "step", "lm", "path"])
    else:
        print(f"repository {repo}: no models (publish one with `echoic deploy`)")
    return 0


def _server(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.clients import Client, ClientError
    from echoic.protos.v1 import transcriber_pb2 as pb

    try:
        with Client(
            args.server, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_server_name=args.tls_server_name, connect_timeout=args.connect_timeout,
        ) as client:  # fmt: skip
            models = client.list_models(timeout=args.connect_timeout)
    except ClientError as e:
        raise UserError(str(e)) from e
    rows = [
        {
            "name": m.name,
            "version": m.version,
            "state": pb.ModelInfo.State.Name(m.state).lower(),
            "streams": m.active_streams,
            "lm": m.has_language_model,
            "streamable": m.streamable,
            "rate": m.sample_rate_hertz,
        }
        for m in models
    ]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    elif rows:
        print(f"server {args.server}")
        _table(rows, ["name", "version", "state", "streams", "lm", "streamable", "rate"])
    else:
        print(f"server {args.server}: no models loaded")
    return 0
