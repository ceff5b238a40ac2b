"""The Dockerfile, checked without a Docker engine.

What can be checked here: the stages and targets, that no serving stage installs
torch (its dependency closure, from installed metadata), non-root users,
HEALTHCHECKs that work against a real server, entrypoints that `echoic serve`
accepts, and the build stage's exact steps: the context .dockerignore lets
through, the COPY lines, then `pip wheel --no-deps` into a wheel that holds the
generated stubs, the .proto and the bundled model.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
SERVING = ("serve", "gpu")


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    return [(ins.split(None, 1)[0].upper(), ins.split(None, 1)[1].strip()) for ins in logical]


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for ins, args in _instructions(DOCKERFILE.read_text()):
        if ins == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args, re.IGNORECASE)
            assert m, f"every stage is named: FROM {args}"
            current = stages.setdefault(m.group(2), [])
        if current is not None:
            current.append((ins, args))
    return stages


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"exec form expected: {args}"
    return value


def test_stages_and_targets() -> None:
    stages = _stages()
    assert list(stages) == ["build", "gpu", "serve"]  # serve last: the default target
    assert "cuda" in stages["gpu"][0][1].lower() or "CUDA_IMAGE" in stages["gpu"][0][1]


@pytest.mark.parametrize("stage", SERVING)
def test_serving_stages_never_install_torch(stage: str) -> None:
    text = " ".join(args for _, args in _stages()[stage]).lower()
    assert "torch" not in text and "[train]" not in text
    installs = re.findall(r"\.whl\)\[([\w,]+)\]", text)
    assert installs == [f"{stage if stage == 'gpu' else 'serve'},riva"]


@pytest.mark.parametrize("stage", SERVING)
def test_serving_stages_run_as_non_root(stage: str) -> None:
    users = [args for ins, args in _stages()[stage] if ins == "USER"]
    assert users, f"{stage} sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")


@pytest.mark.parametrize("stage", SERVING)
def test_serving_stages_expose_and_check_health(stage: str) -> None:
    steps = _stages()[stage]
    exposed = {p for ins, args in steps if ins == "EXPOSE" for p in args.split()}
    assert exposed == {"50051", "8000", "9090"}
    assert sum(ins == "HEALTHCHECK" for ins, _ in steps) == 1


@pytest.mark.parametrize("stage", SERVING)
def test_entrypoints_are_what_echoic_serve_accepts(stage: str) -> None:
    from echoic.cli.main import build_parser
    from echoic.cli.serve import from_flags
    from echoic.server.config import CPU, CUDA_THEN_CPU, ServerConfig

    (entrypoint,) = [_exec_form(args) for ins, args in _stages()[stage] if ins == "ENTRYPOINT"]
    assert entrypoint[:2] == ["echoic", "serve"]
    config = from_flags(ServerConfig, build_parser().parse_args(entrypoint[1:]))
    assert (config.host, config.port, config.metrics_port) == ("0.0.0.0", 50051, 9090)
    assert config.http_port == 8000
    assert config.providers == (CUDA_THEN_CPU if stage == "gpu" else CPU)


def _healthcheck_command(stage: str) -> list[str]:
    (check,) = [args for ins, args in _stages()[stage] if ins == "HEALTHCHECK"]
    return _exec_form(check.split(" CMD ", 1)[1])


@pytest.mark.slow
def test_healthcheck_asks_a_real_server(tiny_model_dir: Path) -> None:
    pytest.importorskip("grpc_health", reason="the serve extra is not installed")
    from echoic.server.config import ServerConfig
    from echoic.server.process.background import BackgroundServer

    command = _healthcheck_command("serve")
    assert command == _healthcheck_command("gpu")
    assert command[0] == "python"

    def check(target: str) -> int:
        code = command[2].replace("127.0.0.1:50051", target)
        return subprocess.run([sys.executable, "-c", code], timeout=60).returncode

    with BackgroundServer(ServerConfig(model_dir=tiny_model_dir, port=0, http_port=0)) as server:
        assert check(server.address) == 0
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        assert check(f"127.0.0.1:{s.getsockname()[1]}") != 0


# ------------------------------------------------------------------ the build stage


def _dockerignore_rules() -> list[tuple[bool, re.Pattern[str], str]]:
    """(exclude?, regex, pattern) per .dockerignore line, in Docker's matching syntax."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rules.append((not negated, re.compile(regex), pattern))
    return rules


def _in_context(rel: str, rules) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for exclude, regex, _ in rules:
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = exclude
    return not excluded


def _build_context(dest: Path) -> None:
    rules = _dockerignore_rules()
    reincluded = [p for exclude, _, p in rules if not exclude]
    for top in sorted(ROOT.iterdir()):
        if not _in_context(top.name, rules) and not any(
            p == top.name or p.startswith(top.name + "/") for p in reincluded
        ):
            continue  # nothing under it can be let back in: skip .git, .venv, runs, ...
        files = [top] if top.is_file() else sorted(f for f in top.rglob("*") if f.is_file())
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if _in_context(rel, rules):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dest / rel)


def _build_stage_copies() -> list[str]:
    sources = []
    for ins, args in _stages()["build"]:
        if ins == "COPY":
            *src, _dst = shlex.split(args)
            assert not any(s.startswith("--") for s in src), "build copies from the context"
            sources += [s.rstrip("/") for s in src]
    return sources


def test_build_copies_every_package_and_the_context_has_them() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = set(_build_stage_copies())
    assert package_dirs | {"pyproject.toml", "README.md"} <= copied
    rules = _dockerignore_rules()
    for src in copied:
        assert _in_context(src, rules), f".dockerignore keeps {src} out of the build context"
    assert not _in_context(".venv", rules) and not _in_context("runs", rules)
    assert not _in_context("server/process/__pycache__/app.cpython-311.pyc", rules)


@pytest.mark.slow
def test_build_stage_makes_a_wheel_with_stubs_and_model(tmp_path: Path) -> None:
    context, src, wheels = tmp_path / "context", tmp_path / "src", tmp_path / "wheels"
    context.mkdir()
    src.mkdir()
    _build_context(context)
    for rel in _build_stage_copies():  # COPY <rel> <rel>, relative to WORKDIR /src
        if (context / rel).is_dir():
            shutil.copytree(context / rel, src / rel)
        else:
            shutil.copy2(context / rel, src / rel)
    (step,) = [a for i, a in _stages()["build"] if i == "RUN" and "pip wheel" in a]
    assert "--no-deps" in step and "--wheel-dir /wheels ." in step
    # The step itself, with the Python of this environment and no network: setuptools
    # comes from here rather than from an isolated build environment.
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-cache-dir", "--quiet", "--wheel-dir", str(wheels), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (wheel,) = wheels.glob("echoic-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "echoic/protos/v1/transcriber_pb2.py",
        "echoic/protos/v1/transcriber_pb2_grpc.py",
        "echoic/protos/echoic/v1/transcriber.proto",
        "echoic/server/process/app.py",
        "echoic/server/doors/static/index.html",  # the browser page (package data)
        "echoic/clients/client.py",
        "echoic/cli/main.py",
        "echoic/model/punct/punct.onnx",  # the punctuation tagger (docs/formatting.md)
    }
    bundled = ROOT / "model" / "default"
    if bundled.is_dir():
        expected |= {f"echoic/model/default/{f.name}" for f in bundled.iterdir() if f.is_file()}
    assert expected <= names, sorted(expected - names)
    assert not any("__pycache__" in n for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "echoic = echoic.cli.main:main" in zipfile.ZipFile(wheel).read(metadata).decode()


def _closure(extra: str) -> set[str]:
    """Distribution names that `pip install echoic[extra]` pulls in, from installed metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [("echoic", extra)]
    while todo:
        name, wanted = todo.pop()
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            env = {"extra": wanted or ""}
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonicalize_name(req.name)
            if dep in seen:
                continue
            seen.add(dep)
            try:
                metadata.distribution(dep)
            except metadata.PackageNotFoundError:
                continue  # not installed here (onnxruntime-gpu): its own deps are not known
            todo += [(dep, e) for e in req.extras] or [(dep, None)]
    return seen


@pytest.mark.parametrize("extra", SERVING)
def test_serving_extras_pull_in_no_torch(extra: str) -> None:
    pytest.importorskip("packaging", reason="packaging is needed to read requirements")
    deps = _closure("gpu" if extra == "gpu" else "serve") | _closure("riva")
    assert "nvidia-riva-client" in deps  # the Riva API is in both images
    assert "torch" not in deps and "onnx" not in deps
    assert ("onnxruntime-gpu" in deps) != ("onnxruntime" in deps)  # one or the other
