"""Errors the `echoic` command prints as one line (no traceback unless ECHOIC_DEBUG=1)."""

from __future__ import annotations


class UserError(Exception):
    """An error the user can fix; printed as one line without a traceback."""


def missing_extra(extra: str, module: str) -> UserError:
    """The one-line hint for a missing optional dependency."""
    return UserError(f"{module} is not installed: pip install 'echoic[{extra}]'")
