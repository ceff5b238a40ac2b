"""Redeploying into a running server as a user does it: versions copied file by file,
a rescan on SIGHUP, several model names with a default. Real servers, real files."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")

from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from tests.test_server import (  # noqa: E402
    TONE,
    channel_to,
    linear16,
    recognize,
    running,
    serve_process,
    status_of,
    wait_until,
)


def _versions(stub) -> list[tuple[str, str]]:
    models = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
    return sorted((m.name, m.version) for m in models if m.state == pb.ModelInfo.LOADED)


def test_a_version_copied_file_by_file_loads_only_when_complete(tiny_model_dir, tmp_path, caplog):
    """model.onnx alone is a loadable (non-streaming) model: loading it would serve the
    version without streaming for good. The server waits for export.json (written last
    by `echoic export`) and every graph it names, then loads the version whole."""
    import logging

    caplog.set_level(logging.INFO, logger="echoic.server")
    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo / "tiny" / "1")
    with running(model_repo=repo, poll_seconds=0.1) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        new = repo / "tiny" / "2"
        new.mkdir()
        shutil.copy(tiny_model_dir / "model.onnx", new)
        wait_until(lambda: "no export.json yet" in caplog.text, what="the wait to be logged")
        shutil.copy(tiny_model_dir / "export.json", new)
        wait_until(lambda: "stream.onnx missing" in caplog.text, what="the missing graph")
        assert _versions(stub) == [("tiny", "1")]
        shutil.copy(tiny_model_dir / "stream.onnx", new)
        wait_until(lambda: _versions(stub) == [("tiny", "2")], what="version 2 to serve")
        (info,) = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert info.streamable
        responses = list(stub.StreamingRecognize(_stream(TONE), timeout=30))
        assert responses and {r.model.version for r in responses} == {"2"}
    waits = [r for r in caplog.records if "not loaded yet" in r.getMessage()]
    assert len(waits) == 2, [r.getMessage() for r in waits]  # one line per change, not per poll


def _stream(audio: bytes):
    yield pb.StreamingRecognizeRequest(
        streaming_config=pb.StreamingRecognitionConfig(config=linear16())
    )
    for i in range(0, len(audio), 3200):
        yield pb.StreamingRecognizeRequest(audio_content=audio[i : i + 3200])


def test_several_models_and_a_default(tiny_model_dir, tmp_path) -> None:
    repo = tmp_path / "repo"
    for name in ("alpha", "beta"):
        shutil.copytree(tiny_model_dir, repo / name / "1")
    with running(model_repo=repo) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        code, details = status_of(lambda: recognize(stub, TONE, linear16()))
        assert recognize(stub, TONE, linear16(model="beta")).model.name == "beta"
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "--model NAME" in details and "--default-model" in details and "alpha, beta" in details
    with running(model_repo=repo, default_model="beta") as server, channel_to(server) as ch:
        stub = pb_grpc.TranscriberStub(ch)
        assert recognize(stub, TONE, linear16()).model.name == "beta"
        assert recognize(stub, TONE, linear16(model="alpha")).model.name == "alpha"


@pytest.mark.slow
def test_sighup_rescans_the_repository_now(tiny_model_dir, tmp_path) -> None:
    """With polling off (--poll-seconds 0) a new version is picked up on SIGHUP, and the
    log says so; the server keeps running."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo / "tiny" / "1")
    with serve_process("--model-repo", str(repo), "--poll-seconds", "0") as (process, port, log):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TranscriberStub(channel)
            shutil.copytree(tiny_model_dir, repo / "tiny" / "2")
            assert _versions(stub) == [("tiny", "1")]  # no polling: not seen yet
            process.send_signal(signal.SIGHUP)
            wait_until(lambda: _versions(stub) == [("tiny", "2")], what="version 2 on SIGHUP")
            assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    assert any("SIGHUP: rescanning the model repository" in line for line in log), log


def test_the_completion_check_is_the_exports_own_report(tiny_model_dir: Path) -> None:
    """What `echoic export` writes is complete by this rule: the bundled model too."""
    from echoic.model.runtime.recognizer import default_model_dir
    from echoic.server.models import incomplete

    assert incomplete(tiny_model_dir) is None and incomplete(default_model_dir()) is None


def test_a_default_model_that_is_not_served_stops_the_start(tiny_model_dir, tmp_path) -> None:
    from echoic.server.config import ServerError

    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo / "alpha" / "1")
    with pytest.raises(ServerError, match="--default-model gamma: no such model"):
        with running(model_repo=repo, default_model="gamma"):
            pass
