"""DESIGN.md's import boundaries: each package is imported in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    pytest.param(
        "echoic.model.audio, echoic.model.text, echoic.model.features, echoic.model.decoding,"
        " echoic.model.configs, echoic.model.card, echoic.model.engine, echoic.model.lm",
        ("torch", "grpc"),
        id="model-torch-free-parts",
    ),
    pytest.param("echoic.model.network", ("grpc", "onnxruntime"), id="model-network"),
    pytest.param(
        "echoic.training.train, echoic.training.data, echoic.training.synth",
        ("grpc", "onnxruntime"),
        id="training",
    ),
    pytest.param("echoic.server", ("torch",), id="server"),
    pytest.param("echoic.clients", ("torch", "onnxruntime"), id="clients"),
    pytest.param("echoic.cli.main", ("torch", "onnxruntime", "grpc"), id="cli-help"),
]


@pytest.mark.parametrize(("modules", "forbidden"), CASES)
def test_import_boundaries(modules: str, forbidden: tuple[str, ...]) -> None:
    code = (
        f"import sys, importlib\n"
        f"for m in {[m.strip() for m in modules.split(',')]!r}: importlib.import_module(m)\n"
        f"import echoic.cli.main as cli; cli.build_parser()\n"
        f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & {set(forbidden)!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"{modules} imported {out.stdout.strip()}"
