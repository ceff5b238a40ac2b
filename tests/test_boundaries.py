"""The import rules of docs/ARCHITECTURE.md ("Import rules"), checked two ways.

Statically: every `import` statement in every module of a part, including the
lazy ones inside functions, names only the echoic parts and the heavy libraries
that part may use, and no chain of them leads from a module back to itself. At run
time: every module of a part is imported in a fresh interpreter, and the heavy
libraries it must never pull in (directly or through another module) are absent
from `sys.modules` afterwards.
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

SERVER_BASE = (  # beside every server layer
    "echoic.server.config", "echoic.server.metrics", "echoic.server.connections"
)  # fmt: skip

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
    # --engines piper, hibari or kokoro loads onnxruntime; `import echoic.training` does not)
    "echoic.training.neural_tts": (set(), {"onnx", "onnxruntime"}),
    # The server in layers, each a folder that imports only the ones below it:
    # process -> doors -> core -> model.runtime, with config, metrics and connections
    # beside them all.
    "echoic.server": (set(), set()),  # its __init__: a docstring
    "echoic.server.config": (set(), set()),  # read by every layer, so it imports none
    # aiohttp lazily: --metrics-port, on a server with its connections capped
    "echoic.server.metrics": ({"echoic.server.connections"}, {"aiohttp"}),
    "echoic.server.connections": (set(), {"aiohttp"}),  # aiohttp lazily: when serving
    # the recognition core, below the doors: in no protocol's words, no door, nothing of
    # the process level (a door's messages are written from the core's `Result`s)
    "echoic.server.core": (
        {
            "echoic.model.core",
            "echoic.model.runtime",
            "echoic.server.config",
            "echoic.server.metrics",
        },
        {"onnxruntime"},
    ),
    # the core's types: what every other module of the server speaks, so they import none
    "echoic.server.core.types": ({"echoic.model.core", "echoic.model.runtime"}, {"onnxruntime"}),
    # the doors: protocols over the core (one door importing another: DOOR_TO_DOOR below)
    "echoic.server.doors": (
        {
            "echoic.model.core",
            "echoic.model.runtime",
            "echoic.protos",
            *SERVER_BASE,
            "echoic.server.core",
        },
        {"onnxruntime", "grpc", "google", "aiohttp"},
    ),
    # the process level: servers built, run, supervised; nothing below imports it
    "echoic.server.process": (
        {
            "echoic.model.core",
            "echoic.model.runtime",
            "echoic.protos",
            *SERVER_BASE,
            "echoic.server.core",
            "echoic.server.doors",
        },
        {"onnxruntime", "grpc", "google", "aiohttp"},
    ),
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


def _depends_on(path: Path, module: str) -> set[str]:
    """The echoic modules that `module` imports anywhere in its file (inside functions and
    `if TYPE_CHECKING:` too): `from package import name` counts as the submodule `name`
    where there is one, and as the package otherwise."""
    if path.name == "__init__.py":  # relative imports resolve against the package itself
        module += ".__init__"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*module.split(".")[: -node.level], base]).rstrip(".")
            named = [f"{base}.{alias.name}" for alias in node.names] + [base]
            named = [n for n in named[:-1] if n in MODULES] or named[-1:]
        else:
            continue
        for name in named:
            parts = name.split(".")
            while parts and ".".join(parts) not in MODULES:
                parts.pop()  # a name inside a module, or a module's own attribute
            if parts:
                found.add(".".join(parts))
    found.discard(module.removesuffix(".__init__"))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each
    as one cycle through them, from its alphabetically first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_through(graph, group) for group in groups]


def _cycle_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """One shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {sorted(group)}")  # a group always has one


def test_no_module_imports_itself_through_others() -> None:
    """An import cycle (lazy, function-level imports included) is a layer that is not one:
    each part of it can only be understood, tested and moved together with the rest."""
    graph = {m: _depends_on(path, m) for m, path in MODULES.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    """The check above can fail: a cycle through three modules, and one of two, are found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert _cycles(graph) == [["d", "e", "d"], ["a", "b", "c", "a"]]


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
    # not even indirectly: the core's results are its own (`server/core/types.py:Result`),
    # and each door writes its messages from them
    pytest.param("echoic.server.core", ("torch", "grpc", "google", "aiohttp"), id="server-core"),
    pytest.param("echoic.server.doors", ("torch",), id="server-doors"),
    pytest.param("echoic.clients", ("torch", "onnxruntime"), id="clients"),
]


def _loaded_by(modules: list[str], forbidden: tuple[str, ...]) -> str:
    """The `forbidden` libraries that importing `modules` in a fresh interpreter loads."""
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & {set(forbidden)!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize(("part", "forbidden"), NEVER_LOADED)
def test_importing_a_part_loads_no_forbidden_library(part: str, forbidden: tuple[str, ...]):
    modules = [m for m in MODULES if m == part or m.startswith(part + ".")]
    assert modules, f"no modules found for {part}"
    loaded = _loaded_by(modules, forbidden)
    assert loaded == "", f"importing {part} loaded {loaded}"


DOORS = sorted(m for m in MODULES if m.startswith("echoic.server.doors."))

# (door, another door it imports) -> why. Every other door stands alone on the core; this
# list is exact, so an import added between doors, or one that goes, shows up here.
DOOR_TO_DOOR = {
    ("echoic.server.doors.service", "echoic.server.doors.grpc_api"):
        "echoic's gRPC door in two modules: the rpcs, and its messages in the core's terms",
    ("echoic.server.doors.riva", "echoic.server.doors.grpc_api"):
        "Riva's door becomes echoic's RecognitionConfig and checks it as echoic's door does",
    ("echoic.server.doors.riva", "echoic.server.doors.service"):
        "Riva's calls run through TranscriberService: the same admission, limits, metrics",
    ("echoic.server.doors.http", "echoic.server.doors.service"):
        "admission and --max-streams are TranscriberService's, shared by every door; "
        "whole files take Recognize's own path (recognize_whole)",
    ("echoic.server.doors.realtime", "echoic.server.doors.service"):
        "admission, and StreamingRecognize's audio path and limits (feed_stream)",
    ("echoic.server.doors.http", "echoic.server.doors.openai_api"):
        "the HTTP door in three modules: OpenAI's shapes",
    ("echoic.server.doors.http", "echoic.server.doors.realtime"):
        "the HTTP door in three modules: the realtime WebSocket on its port",
    ("echoic.server.doors.realtime", "echoic.server.doors.openai_api"):
        "the HTTP door in three modules: OpenAI's errors, models and text deltas, shared",
}  # fmt: skip


def test_a_door_imports_another_only_where_listed() -> None:
    found = {
        (door, other)
        for door in DOORS
        for other in _depends_on(MODULES[door], door)
        if other in DOORS
    }
    assert found - DOOR_TO_DOOR.keys() == set(), "a door imports another: list it with a reason"
    assert DOOR_TO_DOOR.keys() - found == set(), "listed door imports that are gone"


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
