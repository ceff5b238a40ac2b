"""`echoic deploy`: publish a model version into a repository atomically, or take one out."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from echoic.cli.stream import add_tls_options

EXAMPLES = """\
examples:
  # a fine-tuned checkpoint, exported and published as the next version of its model
  # in the default repository (the one `echoic serve` with no model flag serves)
  echoic deploy runs/finetune/last.pt

  # ... and wait until the server on :50051 serves it
  echoic deploy runs/finetune/last.pt --wait 127.0.0.1:50051

  # an exported model directory, as version 7 of "ds2-en" in another repository
  echoic deploy exports/ds2 --repo /srv/models --name ds2-en --version 7

  # roll back: take version 4 (the first deployed over the bundled 3) out; the server
  # goes back to the newest one left
  echoic deploy --remove echoic-en-default/4

  # a second model name beside the bundled one, made the default for clients naming none
  echoic deploy runs/tiny/last.pt --name tiny --make-default

A version is built in a hidden directory beside its place and renamed into it when
complete (the server serves it under the directory's name and version, whatever its
model card says), so a server polling the repository loads it whole or not at all; SIGHUP
(kill -HUP) makes the server look at once instead of at its next poll. Streams
already open finish on the version they started on. The new version gets the word
LM of --lm (ARPA, or KenLM binary: it becomes lm.arpa or lm.bin), else the source
directory's, else the newest version's of the same name (lm.bin and lm.arpa, whichever
it has; --no-lm: none).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "deploy",
        help="publish a checkpoint or exported model to a model repository (hot reload)",
        description="Publish a new model version into a model repository, atomically: a\n"
        "checkpoint is exported (with export's parity check), a model directory copied.\n"
        "A server serving the repository switches to it without dropping a stream.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        nargs="?",
        help="a checkpoint (last.pt) or a model directory written by `echoic export`",
    )
    p.add_argument("--remove", metavar="NAME/VERSION", help="take a version out instead")
    p.add_argument(
        "--force",
        action="store_true",
        help="with --remove: even the last version of a model (it stops being served)",
    )
    p.add_argument(
        "--repo",
        metavar="DIR",
        help="model repository (default: the default one, as `echoic models` shows)",
    )
    p.add_argument("--name", metavar="N", help="model name (default: the source's own)")
    p.add_argument("--version", metavar="V", help="version (default: one more than the highest)")
    lm = p.add_mutually_exclusive_group()
    lm.add_argument(
        "--lm",
        metavar="FILE",
        help="word LM to ship with it, in place of the"
        " source's: an ARPA file (lm.arpa) or a KenLM binary file (lm.bin)",
    )
    lm.add_argument("--no-lm", action="store_true", help="ship no word LM")
    p.add_argument(
        "--make-default",
        action="store_true",
        help="make this model the repository's default: what requests that name no model "
        "get (otherwise the default stays as it was: the bundled model in the default "
        "repository)",
    )
    p.add_argument(
        "--wait",
        metavar="HOST:PORT",
        help="then wait until the server there serves (or no longer serves) it",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="s to --wait (default 120)")
    add_tls_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.model.runtime.repository import default_repository, write_default

    repo = Path(args.repo) if args.repo else default_repository()
    if (args.source is None) == (args.remove is None):
        raise UserError("give a SOURCE to publish, or --remove NAME/VERSION")
    try:
        if args.remove:
            name, version = _remove(repo, args.remove, args.force)
            print(f"removed {name} version {version} from {repo}")
            serving = False
        else:
            name, version = _publish(args, repo)
            serving = True
            if args.make_default:
                write_default(repo, name)
    except (ValueError, FileExistsError) as e:
        raise UserError(str(e)) from e
    print(_unnamed(repo))
    if args.wait:
        _wait(args, name, version, serving)
    return 0


def _unnamed(repo: Path) -> str:
    """What a server on `repo` gives requests that name no model, in one line."""
    from echoic.model.runtime.repository import (
        DEFAULT_FILE,
        default_model,
        incomplete,
        read_default,
        scan_repository,
    )

    served = {
        name for name, versions in scan_repository(repo).items()
        if any(incomplete(path) is None for path in versions.values())
    }  # fmt: skip
    name, why = default_model(read_default(repo), served)
    unless = "unless the server was started with --default-model"
    if name:
        return f"clients that name no model get {name} ({why} of {repo}; {unless})"
    return (
        f"clients that name no model are refused: {why} ({repo / DEFAULT_FILE}); name one in"
        f" each request, or make one the default: echoic deploy --make-default, {unless}"
    )


def _remove(repo: Path, what: str, force: bool) -> tuple[str, str]:
    from echoic.cli.errors import UserError
    from echoic.model.runtime.repository import incomplete, remove_version, scan_repository

    name, _, version = what.partition("/")
    if not name or not version:
        raise UserError(f"--remove {what}: give NAME/VERSION, as `echoic models` lists them")
    others = {
        v: path
        for v, path in scan_repository(repo).get(name, {}).items()
        if v != version and incomplete(path) is None
    } if repo.is_dir() else {}  # fmt: skip
    if not others and not force:
        raise UserError(
            f"{name} version {version} is the last complete version of {name}: removing it"
            f" stops the model being served (every request for it fails); add --force to do so"
        )
    remove_version(repo, name, version)
    return name, version


def _publish(args: argparse.Namespace, repo: Path) -> tuple[str, str]:
    from echoic.cli.errors import UserError
    from echoic.model.core.lm import LM_ARPA, LM_BINARY, LM_FILES, is_kenlm_binary, model_lm
    from echoic.model.runtime.repository import (
        incomplete,
        next_version,
        publish,
        read_report_card,
        scan_repository,
        staging_dir,
        version_key,
    )

    source = Path(args.source)
    if not source.exists():
        raise UserError(f"{source}: no such checkpoint or model directory")
    exported = source.is_dir()
    if exported:
        if why := incomplete(source):
            raise UserError(f"{source} is not a complete model directory: {why}")
        name = args.name or read_report_card(source).name
    else:
        name = args.name or _checkpoint_name(source)
    version = args.version or next_version(repo, name)
    if (repo / name / version).exists():
        raise UserError(f"{repo / name / version} already exists: publish another version")
    lm: dict[str, Path] = {}  # file name in the new version -> the file copied there
    if args.lm:
        given = Path(args.lm)
        if not given.is_file():
            raise UserError(f"--lm {given}: no such file")
        lm[LM_BINARY if is_kenlm_binary(given) else LM_ARPA] = given
    elif not args.no_lm and not (exported and model_lm(source) is not None):
        versions = scan_repository(repo).get(name, {}) if repo.is_dir() else {}
        for v in sorted(versions, key=version_key, reverse=True):
            if model_lm(versions[v]) is not None:
                lm = {f: versions[v] / f for f in LM_FILES if (versions[v] / f).is_file()}
                break
    tmp = staging_dir(repo, name, version)
    try:
        built = tmp / version
        if exported:  # its visible files, as repository.copy_version copies them
            built.mkdir()
            for entry in sorted(source.iterdir()):
                if entry.is_file() and not entry.name.startswith("."):
                    # --lm replaces the source's LM (both files), --no-lm drops it
                    if not ((args.lm or args.no_lm) and entry.name in LM_FILES):
                        shutil.copy2(entry, built / entry.name)
        else:
            _export(source, built, name, version)
        for target, file in lm.items():
            shutil.copy2(file, built / target)
        path = publish(built, repo, name, version)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if lm:
        note = "word LM " + ", ".join(map(str, lm.values()))
    else:
        note = "its own word LM" if model_lm(path) is not None else "no word LM"
    print(f"deployed {name} version {version} to {path} ({note})")
    return name, version


def _checkpoint_name(path: Path) -> str:
    from echoic.cli.export import _explain_missing

    try:
        from echoic.model.nn.checkpoint import load_checkpoint
    except ModuleNotFoundError as e:
        _explain_missing(e)
    return str(load_checkpoint(path).model_config["name"])


def _export(checkpoint: Path, out: Path, name: str, version: str) -> None:
    from echoic.cli.errors import UserError
    from echoic.cli.export import _explain_missing
    from echoic.model.runtime.card import ModelError

    try:
        from echoic.model.nn.export import ExportError, export_model
    except ModuleNotFoundError as e:
        _explain_missing(e)
    try:
        export_model(checkpoint, out, name=name, version=version)
    except (ExportError, ModelError) as e:
        raise UserError(str(e)) from e


def _wait(args: argparse.Namespace, name: str, version: str, serving: bool) -> None:
    """Poll the server's ListModels until `name` `version` is (or is no longer) serving."""
    from echoic.cli.errors import UserError
    from echoic.clients import Client, ClientError
    from echoic.protos.v1 import transcriber_pb2 as pb

    deadline = time.monotonic() + args.timeout
    with Client(
        args.wait, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_server_name=args.tls_server_name,
    ) as client:  # fmt: skip
        while True:
            try:
                models = client.list_models(timeout=10)
            except ClientError as e:
                raise UserError(str(e)) from e
            live = any(
                m.name == name and m.version == version and m.state == pb.ModelInfo.LOADED
                for m in models
            )
            if live == serving:
                what = "serves" if serving else "no longer serves"
                print(f"{args.wait} {what} {name} version {version}")
                return
            if time.monotonic() > deadline:
                raise UserError(
                    f"{args.wait} did not {'load' if serving else 'drop'} {name} version"
                    f" {version} within {args.timeout:g} s: is it serving this repository"
                    " (echoic models --server), and what does its log say?"
                )
            time.sleep(0.25)
