"""Redeploying into a running server as a user does it: versions copied file by file,
a rescan on SIGHUP, several model names with a default. Real servers, real files."""

from __future__ import annotations

import shutil
import signal
import socket
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("onnxruntime", reason="the server needs the serve extra")

from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from tests.test_server import (  # noqa: E402
    GREEDY,
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
    from echoic.model.runtime.repository import incomplete

    assert incomplete(tiny_model_dir) is None and incomplete(default_model_dir()) is None


def test_a_default_model_that_is_not_served_stops_the_start(tiny_model_dir, tmp_path) -> None:
    from echoic.server.config import ServerError

    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo / "alpha" / "1")
    with pytest.raises(ServerError, match="--default-model gamma: no such model"):
        with running(model_repo=repo, default_model="gamma"):
            pass


# ---------------------------------------------------------------- the whole loop


ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "training" / "recipes" / "finetune.toml"
DEFAULT_RECIPE = ROOT / "training" / "recipes" / "default.toml"


def _echoic(*args: str, timeout: float = 300) -> str:
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "echoic.cli.main", *args], cwd=ROOT, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    assert run.returncode == 0, f"echoic {' '.join(args)}: {run.stderr[-3000:]}"
    return run.stdout + run.stderr


def test_fine_tuning_an_export_needs_its_network(speech_corpus: Path, tmp_path: Path) -> None:
    """The same parameter shapes are not enough: a recipe whose [model] computes another
    function (here the clipped ReLU's ceiling) is refused, naming the setting."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "echoic.cli.main", "train", "--config", str(FINETUNE),
         f"data.train_manifest={speech_corpus}", f"out_dir={tmp_path / 'run'}",
         "model.relu_clip=10", "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1 and "model.relu_clip" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and not (tmp_path / "run").exists()


def test_the_finetune_recipe_is_the_bundled_models_network() -> None:
    """finetune.toml's [model] is that of the recipe the bundled model was trained with
    (gpu_default.toml, version 4), and the network rebuilt from the bundled export has
    exactly that config (same hash as its card) and reproduces its graphs. The stages that
    made versions 2 and 3 fine-tuned the bundled model of their day, default.toml's network
    (train_default.sh installs version 1 before them)."""
    import tomllib

    from echoic.model.core.configs import config_hash, from_dict
    from echoic.model.nn.network import ModelConfig
    from echoic.model.nn.rebuild import rebuild
    from echoic.model.runtime.recognizer import default_model_dir
    from echoic.model.runtime.repository import read_report_card

    recipes = ROOT / "training" / "recipes"
    finetune = tomllib.loads(FINETUNE.read_text())
    bundled = tomllib.loads((recipes / "gpu_default.toml").read_text())["model"]
    assert finetune["model"] == bundled
    default = tomllib.loads(DEFAULT_RECIPE.read_text())["model"]
    for stage in ("robust.toml", "robust3.toml"):
        robust = tomllib.loads((recipes / stage).read_text())
        assert robust["model"] == default and robust["init_from"] == "bundled", stage
    assert finetune["init_from"] == "bundled"
    _, info = rebuild(default_model_dir())
    card = read_report_card(default_model_dir())
    assert config_hash(from_dict(ModelConfig, finetune["model"])) == card.model_config_hash
    assert info["model_config_matches"] and info["parity_max_abs_diff"] <= 1e-4


@pytest.mark.slow
def test_retrain_and_redeploy_the_bundled_model_without_a_restart(
    speech_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop as a user runs it, on the bundled model: `echoic serve` with no repository
    flag (the default repository, seeded with the bundled model); fine-tune the bundled
    model on a small synthesized corpus (twice: the same checkpoint bytes); `echoic deploy`
    it; new requests get the next version while a stream opened on the bundled one ends there with
    exactly its offline transcript; `echoic deploy --remove` rolls back. A client sends
    requests the whole time: none fails, and no restart."""
    import json
    import threading

    from echoic.model.core.audio import decode_audio
    from echoic.model.runtime.recognizer import Recognizer, default_model_dir
    from tests.test_server import finals, pcm16, stream_messages

    repo = tmp_path / "default-repo"
    monkeypatch.setenv("ECHOIC_MODEL_REPO", str(repo))
    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()]
    audio = decode_audio(Path(rows[0]["audio_filepath"]).read_bytes(), 16000)
    offline_v1 = Recognizer(default_model_dir(), intra_op_threads=1).transcribe([audio])[0].text
    v1 = Recognizer(default_model_dir()).card.version  # the bundled version, seeded
    v2 = str(int(v1) + 1)  # what `echoic deploy` numbers the next one
    assert offline_v1  # the bundled model hears something in it

    # Fine-tune twice with the same seed: byte-identical checkpoints.
    runs = [tmp_path / "run-a", tmp_path / "run-b"]
    for run in runs:
        log = _echoic("train", "--config", str(FINETUNE), f"data.train_manifest={speech_corpus}",
                      f"out_dir={run}", "max_steps=3", "threads=1", "--no-progress")  # fmt: skip
        assert "an export: weights rebuilt" in log
    assert (runs[0] / "last.pt").read_bytes() == (runs[1] / "last.pt").read_bytes()

    # The paused stream sends nothing while the export runs (tens of seconds on a busy
    # machine): a generous idle limit and call deadline keep it open for that.
    flags = ("--poll-seconds", "0.5", "--idle-timeout-seconds", "900")
    with serve_process(*flags) as (process, port, server_log):
        target = f"127.0.0.1:{port}"
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.TranscriberStub(channel)
            assert _versions(stub) == [("echoic-en-default", v1)]
            assert (repo / "echoic-en-default" / v1 / "model.onnx").is_file()

            answered: list[str] = []
            failures: list[str] = []
            stop = threading.Event()

            def load() -> None:  # a client that keeps asking through every switch
                while not stop.is_set():
                    try:
                        answered.append(recognize(stub, pcm16(audio), linear16()).model.version)
                    except grpc.RpcError as e:
                        failures.append(f"{e.code()}: {e.details()}")

            client = threading.Thread(target=load)
            client.start()
            try:
                release = threading.Event()
                third = len(pcm16(audio)) // 3 // 2 * 2
                call = stub.StreamingRecognize(
                    stream_messages(pcm16(audio), linear16(decoder=GREEDY), interim=True,
                                    pause=(third, release)),
                    timeout=900,
                )  # fmt: skip
                first = next(call)  # the stream is open on version 1
                assert first.model.version == v1

                out = _echoic("deploy", str(runs[0] / "last.pt"), "--wait", target)
                assert f"deployed echoic-en-default version {v2}" in out and "word LM" in out
                assert _versions(stub) == [("echoic-en-default", v2)]
                assert recognize(stub, pcm16(audio), linear16()).model.version == v2
                listed = _echoic("models", "--server", target)
                assert "draining" in listed  # version 1 holds the open stream

                release.set()
                rest = list(call)
                assert {r.model.version for r in [first, *rest]} == {v1}
                assert " ".join(t for t in finals([first, *rest]) if t) == offline_v1

                out = _echoic("deploy", "--remove", f"echoic-en-default/{v2}", "--wait", target)
                assert f"no longer serves echoic-en-default version {v2}" in out
                assert recognize(stub, pcm16(audio), linear16()).model.version == v1
            finally:
                stop.set()
                client.join(timeout=60)
        assert process.poll() is None  # never restarted
    assert not failures, failures[:5]
    assert {v1, v2} <= set(answered), "the client saw both versions"
    assert not [line for line in server_log if " ERROR " in line], server_log


def test_deploy_and_models_in_a_repository(tiny_model_dir, tmp_path, capsys) -> None:
    """`echoic deploy` numbers versions, carries the LM forward, refuses what is not a
    complete model and an existing version, and `--remove` takes one out; `echoic
    models` lists what a server would serve, and why a version would not load."""
    import json

    from echoic.cli.main import main
    from echoic.model.runtime.recognizer import default_model_dir

    repo = tmp_path / "repo"
    assert main(["deploy", str(tiny_model_dir), "--repo", str(repo), "--name", "t"]) == 0
    (repo / "t" / "1" / "lm.arpa").write_text((default_model_dir() / "lm.arpa").read_text())
    assert main(["deploy", str(tiny_model_dir), "--repo", str(repo), "--name", "t"]) == 0
    assert "deployed t version 2" in capsys.readouterr().out
    assert (repo / "t" / "2" / "lm.arpa").read_bytes() == (
        repo / "t" / "1" / "lm.arpa"
    ).read_bytes()
    assert main(["deploy", str(tiny_model_dir), "--repo", str(repo), "--name", "t", "--no-lm"]) == 0
    assert not (repo / "t" / "3" / "lm.arpa").exists()
    half = repo / "t" / "4"
    half.mkdir()
    shutil.copy(tiny_model_dir / "model.onnx", half)

    capsys.readouterr()
    assert main(["models", "--repo", str(repo), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["version"], r["status"].split(":")[0]) for r in rows] == [
        ("4", "incomplete"),
        ("3", "newest"),
        ("2", "older"),
        ("1", "older"),
    ]
    assert "no export.json yet" in rows[0]["status"]

    def fails(*argv: str) -> str:
        assert main(list(argv)) == 1
        return capsys.readouterr().err

    assert "already exists" in fails("deploy", str(tiny_model_dir), "--repo", str(repo),
                                     "--name", "t", "--version", "2")  # fmt: skip
    assert "not a complete model directory" in fails("deploy", str(half), "--repo", str(repo))
    assert "no such checkpoint or model directory" in fails("deploy", str(tmp_path / "nope"))
    assert "give a SOURCE" in fails("deploy", "--repo", str(repo))
    assert "NAME/VERSION" in fails("deploy", "--remove", "t", "--repo", str(repo))
    assert "no version 9 of t" in fails("deploy", "--remove", "t/9", "--repo", str(repo))
    assert main(["deploy", "--remove", "t/3", "--repo", str(repo)]) == 0
    assert sorted(p.name for p in (repo / "t").iterdir()) == ["1", "2", "4"]
    assert "removed t version 3" in capsys.readouterr().out
    assert main(["deploy", "--remove", "t/2", "--repo", str(repo)]) == 0
    assert "last complete version" in fails("deploy", "--remove", "t/1", "--repo", str(repo))
    assert main(["deploy", "--remove", "t/1", "--repo", str(repo), "--force"]) == 0
    assert sorted(p.name for p in (repo / "t").iterdir()) == ["4"]  # no hidden leftovers
    assert "ASCII digits" in fails("deploy", str(tiny_model_dir), "--repo", str(repo),
                                   "--name", "t", "--version", "²")  # fmt: skip
    assert main(["models", "--bundled"]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_dir())
    # A KenLM binary LM ships as lm.bin, in place of the source's; later versions carry it.
    binary = default_model_dir() / "lm.bin"
    assert main(["deploy", str(tiny_model_dir), "--repo", str(repo), "--name", "b",
                 "--lm", str(binary)]) == 0  # fmt: skip
    assert main(["deploy", str(tiny_model_dir), "--repo", str(repo), "--name", "b"]) == 0
    for v in ("1", "2"):
        assert sorted(f.name for f in (repo / "b" / v).glob("lm.*")) == ["lm.bin"]
        assert (repo / "b" / v / "lm.bin").read_bytes() == binary.read_bytes()


def test_serve_with_no_model_flag_seeds_the_default_repository(tmp_path, monkeypatch) -> None:
    """The first start seeds it with the bundled model; a repository that has models is
    left as it is (a removed bundled version stays removed)."""
    from echoic.model.runtime.recognizer import default_model_dir
    from echoic.model.runtime.repository import read_report_card, seed_with_bundled

    repo = tmp_path / "fresh" / "models"
    monkeypatch.setenv("ECHOIC_MODEL_REPO", str(repo))
    version = read_report_card(default_model_dir()).version
    with running() as server, channel_to(server) as channel:
        assert _versions(pb_grpc.TranscriberStub(channel)) == [("echoic-en-default", version)]
    copied = repo / "echoic-en-default" / version
    for name in ("model.onnx", "stream.onnx", "lm.bin", "lm.arpa", "export.json"):
        assert (copied / name).read_bytes() == (default_model_dir() / name).read_bytes()
    (repo / "mine").mkdir()
    shutil.move(copied, repo / "mine" / "1")
    shutil.rmtree(repo / "echoic-en-default")
    assert seed_with_bundled(repo, default_model_dir()) is None
    assert sorted(p.name for p in repo.iterdir()) == [".bundled", ".default-model", "mine"]


def _copy_of_bundled(repo: Path, version: str, config_hash: str | None = None) -> None:
    """REPO/echoic-en-default/VERSION: the bundled model, its card saying VERSION (and, when
    given, the config hash of another model: an earlier bundled one, or a user's)."""
    import json

    from echoic.model.runtime.recognizer import default_model_dir

    where = repo / "echoic-en-default" / version
    shutil.copytree(default_model_dir(), where)
    report = json.loads((where / "export.json").read_text())
    report["model_card"]["version"] = version
    if config_hash:
        report["model_card"]["config_hash"] = config_hash
    (where / "export.json").write_text(json.dumps(report))


def test_an_upgraded_bundled_model_is_served_once_beside_the_one_seeded_before(
    tmp_path, monkeypatch
) -> None:
    """A repository seeded by an older echoic holds an older bundled version (known by its
    config hash): the next start adds the new bundled one beside it and serves it, the old
    one kept to roll back to; removed again, it stays removed. A repository whose bundled
    name holds a version its user deployed (older, newer, not numbered, or beside the
    seeded one) is left as it is; one that got the copy but not its record gets the record."""
    from echoic.model.runtime.recognizer import default_model_dir
    from echoic.model.runtime.repository import (
        BUNDLED_FILE,
        EARLIER_BUNDLED,
        read_report_card,
        seed_with_bundled,
    )

    version = read_report_card(default_model_dir()).version
    older, theirs = str(int(version) - 1), "0123456789abcdef"
    earlier = sorted(EARLIER_BUNDLED["echoic-en-default"])[0]
    repo = tmp_path / "models"
    monkeypatch.setenv("ECHOIC_MODEL_REPO", str(repo))
    _copy_of_bundled(repo, older, earlier)
    with running() as server, channel_to(server) as channel:
        assert _versions(pb_grpc.TranscriberStub(channel)) == [("echoic-en-default", version)]
    assert sorted(p.name for p in (repo / "echoic-en-default").iterdir()) == sorted(
        [older, version]
    )
    listed = sorted(f"echoic-en-default/{v}\n" for v in (older, version))
    assert (repo / BUNDLED_FILE).read_text() == "".join(listed)  # the next upgrade adds again
    shutil.rmtree(repo / "echoic-en-default" / version)  # rolled back by hand
    assert seed_with_bundled(repo, default_model_dir()) is None
    assert [p.name for p in (repo / "echoic-en-default").iterdir()] == [older]

    own = [[(older, theirs)], [(str(int(version) + 1), theirs)], [("x", theirs)],
           [(older, earlier), (version + "0", theirs)]]  # fmt: skip
    for i, deployed in enumerate(own):
        for v, config_hash in deployed:
            _copy_of_bundled(tmp_path / f"{i}", v, config_hash)
        assert seed_with_bundled(tmp_path / f"{i}", default_model_dir()) is None
        names = sorted(p.name for p in (tmp_path / f"{i}" / "echoic-en-default").iterdir())
        assert names == sorted(v for v, _ in deployed)

    halfway = tmp_path / "halfway"  # copied in, stopped before .bundled was written
    _copy_of_bundled(halfway, older, earlier)
    _copy_of_bundled(halfway, version)
    assert seed_with_bundled(halfway, default_model_dir()) is None
    assert f"echoic-en-default/{version}" in (halfway / BUNDLED_FILE).read_text().split()


def test_a_version_that_cannot_be_read_is_skipped_with_one_line(tiny_model_dir, tmp_path, caplog):
    """export.json files that are not an export's (an empty card, a card of the wrong type,
    JSON nested 100,000 deep) and a model directory whose name holds a newline and an
    escape: the server starts on the good version, logs each bad one once (names quoted,
    never raw, and that name not loaded), and a later good version is still picked up."""
    import logging

    caplog.set_level(logging.INFO, logger="echoic.server")
    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo / "tiny" / "1")
    empty = '{"model_card": {}}'
    deep = "[" * 100_000 + "]" * 100_000
    bad = {"2": empty, "3": '{"model_card": 7}', "4": deep}
    for version, report in bad.items():
        shutil.copytree(tiny_model_dir, repo / "tiny" / version)
        (repo / "tiny" / version / "export.json").write_text(report)
    shutil.copytree(tiny_model_dir, repo / "forged\n\x1b[31mERROR" / "1")  # a good model
    with running(model_repo=repo, poll_seconds=0.1) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        assert _versions(stub) == [("tiny", "1")]
        shutil.copytree(tiny_model_dir, repo / "tiny" / "6")
        wait_until(lambda: _versions(stub) == [("tiny", "6")], what="version 6 to serve")
    skipped = [r.getMessage() for r in caplog.records if "not loaded yet" in r.getMessage()]
    assert len(skipped) == 4, "\n".join(skipped)
    assert not any("\x1b" in m or "\n" in m for m in caplog.messages), skipped


def test_a_second_model_name_leaves_clients_naming_none_on_the_seeded_one(
    tiny_model_dir, tmp_path, monkeypatch, capsys
) -> None:
    """`echoic deploy` of a new name into the default repository: a request naming no
    model still gets the bundled model, over gRPC and HTTP, and deploy says so; with no
    default named the HTTP door's error speaks of its form field; `--make-default` moves
    the default."""
    import http.client
    import json

    from echoic.cli.main import main
    from echoic.model.runtime.repository import DEFAULT_FILE

    repo = tmp_path / "fresh" / "models"
    monkeypatch.setenv("ECHOIC_MODEL_REPO", str(repo))

    def unnamed_http(server) -> tuple[int, dict]:
        wav = (tmp_path / "tone.wav").read_bytes()
        boundary = "b0undary"
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"'
                f"\r\n\r\n"
            ).encode()
            + wav
            + f"\r\n--{boundary}--\r\n".encode()
        )
        conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
        conn.request("POST", "/v1/audio/transcriptions", body,
                     {"Content-Type": f"multipart/form-data; boundary={boundary}"})  # fmt: skip
        try:
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    import soundfile as sf

    sf.write(tmp_path / "tone.wav", np.frombuffer(TONE, "<i2"), 16000, subtype="PCM_16")
    with socket.socket() as s:  # HTTP port 0 means off: a free one, picked here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with running(http_port=port, poll_seconds=0.2) as server, channel_to(server) as ch:
        stub = pb_grpc.TranscriberStub(ch)
        capsys.readouterr()
        deploy = ["deploy", str(tiny_model_dir), "--name", "tiny"]
        assert main([*deploy, "--wait", server.address]) == 0
        out = capsys.readouterr().out
        assert "clients that name no model get echoic-en-default" in out
        assert _versions(stub)[-1][0] == "tiny"
        assert recognize(stub, TONE, linear16()).model.name == "echoic-en-default"
        status, body = unnamed_http(server)
        assert status == 200, body
        (repo / DEFAULT_FILE).unlink()  # a repository that names no default
        server.run(server.server.registry.sync())
        status, body = unnamed_http(server)
        assert status == 404 and "form field `model`" in body["error"]["message"], body
        assert "RecognitionConfig" not in body["error"]["message"]
        code, details = status_of(lambda: recognize(stub, TONE, linear16()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "RecognitionConfig" in details
        assert main([*deploy, "--make-default"]) == 0
        assert "clients that name no model get tiny" in capsys.readouterr().out
        server.run(server.server.registry.sync())
        assert recognize(stub, TONE, linear16()).model.name == "tiny"
