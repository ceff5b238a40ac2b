"""The import rules of docs/ARCHITECTURE.md ("Import rules"), checked two ways.

Statically: every `import` statement in every module of a part, including the
lazy ones inside functions, names only the echoic parts and the heavy libraries
that part may use. At run time: every module of a part is imported in a fresh
interpreter, and the heavy libraries it must never pull in (directly or through
another module) are absent from `sys.modules` afterwards.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {  # folder -> import name (pyproject's package-dir)
    "model": "echoic.model",
    "training": "echoic.training",
    "server": "echoic.server",
    "clients": "echoic.clients",
    "cli": "echoic.cli",
    "protos": "echoic.protos",
}
HEAVY = ("torch", "onnx", "onnxruntime", "grpc", "triton", "google", "aiohttp")  # google: protobuf

# part -> (echoic parts it may import besides itself, heavy libraries it may import)
RULES: dict[str, tuple[set[str], set[str]]] = {
    "echoic.model": (set(), set()),  # its __init__: a docstring
    "echoic.model.core": (set(), set()),
    "echoic.model.runtime": ({"echoic.model.core"}, {"onnxruntime"}),
    "echoic.model.nn": (
        {"echoic.model.core", "echoic.model.runtime"},
        {"torch", "onnx", "onnxruntime", "triton"},
    ),
    "echoic.training": ({"echoic.model.core", "echoic.model.nn"}, {"torch"}),
    # the neural voices of `echoic synth` are ONNX models (imported lazily: only
    # --engines piper or hibari loads onnxruntime; `import echoic.training` does not)
    "echoic.training.neural_tts": (set(), {"onnx", "onnxruntime"}),
    "echoic.server": (
        {"echoic.model.core", "echoic.model.runtime", "echoic.protos"},
        {"onnxruntime", "grpc", "google", "aiohttp"},
    ),
    # the recognition core's types, below the doors: in no protocol's words
    "echoic.server.core": ({"echoic.model.core", "echoic.model.runtime"}, {"onnxruntime"}),
    "echoic.clients": ({"echoic.protos"}, {"grpc"}),
    "echoic.protos": (set(), {"grpc", "google"}),
    "echoic.cli": ({"echoic"}, set(HEAVY)),  # the top: anything, heavy ones lazily
}


def _modules() -> dict[str, Path]:
    """Every module of every part: import name -> file."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _part(module: str) -> str:
    """The rule that governs a module: the longest part name that prefixes it."""
    return max((p for p in RULES if module == p or module.startswith(p + ".")), key=len)


def _imports(path: Path, module: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = module.split(".")[: -node.level or None]
                names.add(".".join([*base, node.module or ""]).rstrip("."))
            elif node.module:
                names.add(node.module)
    return names


def test_every_module_has_a_rule() -> None:
    unruled = [m for m in MODULES if not any(m == p or m.startswith(p + ".") for p in RULES)]
    assert not unruled


@pytest.mark.parametrize("module", list(MODULES))
def test_imports_follow_the_rules(module: str) -> None:
    part = _part(module)
    may_echoic, may_heavy = RULES[part]
    wrong = []
    for name in sorted(_imports(MODULES[module], module)):
        top = name.split(".")[0]
        if top == "echoic":
            if name == part or name.startswith(part + "."):
                continue
            if not any(name == p or name.startswith(p + ".") for p in may_echoic):
                wrong.append(name)
        elif top in HEAVY and top not in may_heavy:
            wrong.append(name)
    assert not wrong, f"{module} ({part}) imports {wrong}: see docs/ARCHITECTURE.md"


# part -> heavy libraries that importing all of its modules must not load, even indirectly
NEVER_LOADED = [
    pytest.param("echoic.model.core", ("torch", "onnxruntime", "grpc"), id="model-core"),
    pytest.param("echoic.model.runtime", ("torch", "grpc"), id="model-runtime"),
    pytest.param("echoic.model.nn", ("grpc",), id="model-nn"),
    pytest.param("echoic.training", ("grpc", "onnxruntime"), id="training"),
    pytest.param("echoic.server", ("torch",), id="server"),
    pytest.param("echoic.server.core", ("torch", "grpc", "google", "aiohttp"), id="server-core"),
    pytest.param("echoic.clients", ("torch", "onnxruntime"), id="clients"),
]


@pytest.mark.parametrize(("part", "forbidden"), NEVER_LOADED)
def test_importing_a_part_loads_no_forbidden_library(part: str, forbidden: tuple[str, ...]):
    modules = [m for m in MODULES if m == part or m.startswith(part + ".")]
    assert modules, f"no modules found for {part}"
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & {set(forbidden)!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True
    )
    assert out.stdout.strip() == "", f"importing {part} loaded {out.stdout.strip()}"


def test_the_command_line_starts_without_heavy_libraries() -> None:
    code = (
        "import sys\n"
        "import echoic.cli.main as cli\n"
        "cli.build_parser()\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'onnxruntime', 'grpc'})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "", f"`echoic --help` imported {out.stdout.strip()}"
