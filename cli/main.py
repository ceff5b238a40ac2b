"""The `echoic` command: one program, one subcommand per job.

Each subcommand lives in its own module here (`cli/synth.py`, `cli/train.py`, ...)
with `register(subparsers)`; heavy imports (torch, onnxruntime, grpc) happen only
inside the command that needs them, so `echoic serve` never loads torch.

Known errors print one line and exit 1; set ECHOIC_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from echoic.cli import (
    degrade,
    deploy,
    eval,  # noqa: A004 - the `echoic eval` module
    export,
    import_corpus,
    import_model,
    lm,
    models,
    quantize,
    serve,
    stream,
    synth,
    train,
    transcribe,
)
from echoic.cli.errors import UserError, known_errors, missing_extra

# The modules of the subcommands, in the order `echoic --help` lists them (a module
# registers its command's name: import_corpus registers `import`, a Python keyword).
# Imported by name, not by a loop over strings, so that the import graph shows that
# this module depends on every subcommand and none of them on it.
COMMANDS = (
    synth, degrade, import_corpus, train, export, quantize, import_model, deploy, models,
    transcribe, eval, lm, serve, stream,
)  # fmt: skip

__all__ = ["UserError", "build_parser", "main", "missing_extra"]


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its positionals (paths, `key=value` overrides) may come
    before, between and after its flags (`echoic train --config R out_dir=x --no-progress
    max_steps=1`); argparse alone gives a positional only the first run of them."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's
        if self._intermixing:  # parse_known_intermixed_args calls back in here
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="echoic",
        description="Deep Speech 2 style speech recognition: train, export, serve, transcribe.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from echoic.model.core.version import echoic_version

    parser.add_argument("--version", action="version", version=f"echoic {echoic_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from echoic.model.core.native import drop_stdio_chatter

    drop_stdio_chatter()  # libmpg123's notes on a damaged MP3: not for the terminal or the log
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("echoic: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place errors become exit codes
        hint = isinstance(e, ImportError) and "pip install" in str(e)
        if os.environ.get("ECHOIC_DEBUG") == "1" or not (hint or isinstance(e, known_errors())):
            raise
        print(f"echoic {args.command}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
