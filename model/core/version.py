"""echoic's version, as installed (pyproject.toml's): `echoic --version`, the server's
start line, ListModels and GET /v1/models."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def echoic_version() -> str:
    try:
        return version("echoic")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"
