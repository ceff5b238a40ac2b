"""Errors the `echoic` command prints as one line (no traceback unless ECHOIC_DEBUG=1)."""

from __future__ import annotations


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
