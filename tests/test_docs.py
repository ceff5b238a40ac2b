"""docs/ARCHITECTURE.md and the README stay true to the tree: the folders they list
exist and are all the folders there are, and every `file:function` stop of the data
flows names a function that the file defines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"
STOP = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def _code_folders() -> set[str]:
    """Folders of the package, benchmarks, examples and deployment: model's subpackages and
    server's layers, the other top folders."""
    tops = {"training", "server", "clients", "protos", "cli", "bench", "examples", "deploy"}
    subs = {f"{top}/{p.name}" for top in ("model", "server") for p in (ROOT / top).iterdir()}
    return tops | {s for s in subs if (ROOT / s).is_dir() and not s.endswith("__pycache__")}


def _table_folders(text: str, heading: str) -> set[str]:
    """The first-column folders of the table under `heading`."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return {m.rstrip("/") for m in re.findall(r"^\| `([\w/]+/)` \|", section, re.M)}


@pytest.mark.parametrize(
    ("doc", "heading"),
    [
        pytest.param(ARCHITECTURE, "## The parts", id="architecture"),
        pytest.param(README, "## What is here", id="readme"),
    ],
)
def test_the_folder_tables_match_the_tree(doc: Path, heading: str) -> None:
    assert _table_folders(doc.read_text(), heading) == _code_folders()


def _defined(path: Path) -> set[str]:
    """Top-level functions and classes of a module, and Class.method names."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
    return names


def test_every_data_flow_stop_exists() -> None:
    stops = STOP.findall(ARCHITECTURE.read_text())
    assert len(stops) > 20
    missing = [
        f"{file}:{name}"
        for file, name in stops
        if not (ROOT / file).is_file() or name not in _defined(ROOT / file)
    ]
    assert not missing, f"docs/ARCHITECTURE.md names stops the code lacks: {missing}"


LINK = re.compile(r"\]\((docs/[\w.-]+\.md)\)")
REFERENCE = re.compile(r'(docs/[\w-]+\.md),? \(?"([^"]+)"')


def test_the_readme_is_the_first_hour_and_links_every_page() -> None:
    """Short (set-up, serve, transcribe, stream, the HTTP call, train -> deploy), the
    rest a link away: every docs/ page is linked and every link has its page; its two
    set-up commands are there, and CI runs the second."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    linked = set(LINK.findall(text))
    assert linked == {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    for command in ("bash scripts/serve.sh", "bash scripts/test.sh"):
        assert f"\n{command} " in text
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_references_to_the_docs_name_pages_and_text_they_have() -> None:
    """A page and a section named in code and comments (docs/X.md then the section in
    quotes): the page exists and says it."""
    sources = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in
               (".py", ".sh", ".toml", ".yaml", ".md") and not {".venv", ".git",
               "node_modules"} & set(p.parts)]  # fmt: skip
    seen = 0
    for source in sources:
        for page, section in REFERENCE.findall(source.read_text(errors="replace")):
            seen += 1
            target = ROOT / page
            assert target.is_file(), f"{source}: {page} does not exist"
            assert section.lower() in target.read_text().lower(), f"{source}: {page} {section!r}"
    assert seen > 10


MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize(
    "page",
    [README, *sorted((ROOT / "docs").glob("*.md"))],
    ids=lambda page: page.name,
)
def test_relative_links_lead_to_files(page: Path) -> None:
    """A link is read from the page's own folder: inside docs/, docs/X.md is broken."""
    broken = [
        target
        for target in MARKDOWN_LINK.findall(page.read_text())
        if not target.startswith(("http://", "https://", "mailto:", "#"))
        and not (page.parent / target.split("#", 1)[0]).exists()
    ]
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there: {broken}"
