"""Errors the `echoic` command prints as one line (no traceback unless ECHOIC_DEBUG=1)."""

from __future__ import annotations

import sys


class UserError(Exception):
    """An error the user can fix; printed as one line without a traceback (exit 1)."""

    exit_code = 1


class JobError(UserError):
    """A batch job that could not run (bad arguments, no inputs, the server unreachable):
    exit 2, where 1 means that some inputs failed."""

    exit_code = 2


def missing_extra(extra: str, module: str) -> UserError:
    """The one-line hint for a missing optional dependency."""
    return UserError(f"{module} is not installed: pip install 'echoic[{extra}]'")


def known_errors() -> tuple[type[BaseException], ...]:
    """The errors printed as one line: ours, and those of the modules this run has loaded
    (a module not imported cannot have raised its error, and is not imported for it)."""
    from echoic.model.core.configs import ConfigError

    known: list[type[BaseException]] = [UserError, ConfigError, FileNotFoundError]
    for mod, name in (
        ("echoic.model.core.audio", "AudioError"),
        ("echoic.model.core.text", "TextError"),
        ("echoic.training.data", "ManifestError"),
        ("echoic.training.synth", "SynthError"),
        ("echoic.training.importers", "CorpusError"),
        ("echoic.training.distributed", "DistributedError"),
        ("echoic.model.nn.checkpoint", "CheckpointError"),
        ("echoic.model.runtime.card", "ModelError"),
        ("echoic.model.runtime.formatting", "FormattingUnavailable"),
        ("echoic.model.nn.export", "ExportError"),
        ("echoic.model.nn.rebuild", "RebuildError"),
        ("echoic.model.nn.persistent.capacity", "PersistentKernelError"),
        ("echoic.clients.client", "ClientError"),
    ):
        if mod in sys.modules:
            known.append(getattr(sys.modules[mod], name))
    return tuple(known)
