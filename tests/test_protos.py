"""The gRPC API: checked-in stubs match the .proto, and the .proto documents itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "protos" / "echoic" / "v1" / "transcriber.proto"
STUBS = ROOT / "protos" / "v1"


def test_stubs_are_not_stale(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) is not installed")
    if not shutil.which("bash"):
        pytest.skip("bash is not available to run scripts/gen_protos.sh")
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert generated == sorted(p.name for p in STUBS.iterdir() if p.is_file()), generated
    for name in generated:
        assert (tmp_path / name).read_bytes() == (STUBS / name).read_bytes(), (
            f"protos/v1/{name} is stale: run `bash scripts/gen_protos.sh`"
        )


def test_stubs_import_without_heavy_dependencies() -> None:
    code = (
        "import sys; from echoic.protos.v1 import transcriber_pb2, transcriber_pb2_grpc; "
        "heavy = [m for m in ('torch', 'onnxruntime', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy; "
        "print(transcriber_pb2.DESCRIPTOR.services_by_name['Transcriber'].full_name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "echoic.v1.Transcriber"


def test_every_rpc_states_its_streaming_kind() -> None:
    text = PROTO.read_text()
    rpcs = re.findall(r"((?:\s*//[^\n]*\n)+)\s*rpc (\w+)\((stream )?\w+\)", text)
    assert {name for _, name, _ in rpcs} == {"Recognize", "StreamingRecognize", "ListModels"}
    for comment, name, client_streams in rpcs:
        first = comment.strip().removeprefix("//").strip()
        kind = "Bidirectional streaming." if client_streams else "Unary."
        assert first.startswith(kind), f"rpc {name}: its comment must start with {kind!r}"


def test_every_numeric_field_states_its_unit() -> None:
    units = ("Hz", "ms", " s", "count", "[0, 1]", "Index")
    for line_no, line in enumerate(PROTO.read_text().splitlines(), 1):
        m = re.match(r"\s*(int32|int64|double|float) (\w+) = \d+;(.*)", line)
        if not m:
            continue
        _, name, trailing = m.groups()
        # The unit is on the field's line or in the comment block just above it.
        above = PROTO.read_text().splitlines()[max(0, line_no - 5) : line_no - 1]
        comment = trailing + " ".join(a for a in above if a.strip().startswith("//"))
        named = name.endswith(("_ms", "_hertz", "_seconds", "_time"))
        assert named or any(u in comment for u in units), f"line {line_no}: {name} has no unit"
