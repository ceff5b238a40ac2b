"""A model repository on disk: `REPO/<name>/<version>/`, each version an exported model.

The server serves from one (`echoic serve --model-repo`, or the default repository
below); `echoic deploy` publishes into one. The rules both sides keep:

- Names and versions starting with "." are never loaded: a version is built in a
  dot-directory beside its place and renamed into it when complete, so it appears
  whole or not at all (`publish`). Removing one renames it out of sight first.
- A version is complete when its `export.json` (which `echoic export` writes last)
  is there with every graph its model card names (`incomplete`), so a version
  copied in file by file by other tools is not loaded half-written either.
- Versions compare as numbers (2 < 10); names that are not numbers sort before all
  numbers, alphabetically (`version_key`).

The default repository (`default_repository`) is `$ECHOIC_MODEL_REPO`, else
`$XDG_DATA_HOME/echoic/models`, else `~/.local/share/echoic/models`; the first time
it is used it is seeded with the bundled model, and a newer bundled model (an upgraded
echoic) is added beside the versions of its name once (`seed_with_bundled`).

A repository may name its default model, the one a request that names none gets, in
`REPO/.default-model` (one line: the name). Seeding names the bundled model there, so
deploying a second model name leaves clients that name none on the model they had
(`default_model`); `echoic deploy --make-default` names another, `echoic serve
--default-model` overrides it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from echoic.model.core.files import fsync_directory
from echoic.model.runtime.card import OFFLINE_FILE, REPORT_FILE, STREAM_FILE, ModelCard

ENV_REPO = "ECHOIC_MODEL_REPO"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "default"


def default_model_dir() -> Path:
    """The model bundled with the package (used when no model is named)."""
    return DEFAULT_MODEL_DIR


DEFAULT_FILE = ".default-model"  # REPO/.default-model: the name requests naming none get


def default_repository() -> Path:
    """Where `echoic serve` and `echoic deploy` look when given no repository."""
    if os.environ.get(ENV_REPO):
        return Path(os.environ[ENV_REPO]).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "echoic" / "models"


def _number(text: str) -> bool:
    """Whether `text` is a version number: ASCII digits only ("²".isdigit() is True)."""
    return bool(re.fullmatch(r"[0-9]+", text))


def version_key(version: str) -> tuple[int, int, str]:
    return (1, int(version), "") if _number(version) else (0, 0, version)


def scan_repository(repo: Path) -> dict[str, dict[str, Path]]:
    """name -> version -> directory, skipping dot-names and plain files."""
    found: dict[str, dict[str, Path]] = {}
    for name_dir in sorted(repo.iterdir()):
        if name_dir.name.startswith(".") or not name_dir.is_dir():
            continue
        versions = {
            v.name: v for v in name_dir.iterdir() if not v.name.startswith(".") and v.is_dir()
        }
        if versions:
            found[name_dir.name] = versions
    return found


def read_report_card(path: Path) -> ModelCard:
    """The model card in a version directory's `export.json` (ValueError, OSError, KeyError)."""
    return ModelCard.from_json(
        json.dumps(json.loads((path / REPORT_FILE).read_text())["model_card"])
    )


MAX_REPORT_BYTES = 16 * 2**20  # an export.json bigger than this is not an export's, bytes


def incomplete(path: Path) -> str | None:
    """Why a version directory is not ready to load yet; None when it is. A report that
    cannot be read, whatever is wrong with it, is a reason, never an exception."""
    report = path / REPORT_FILE
    if not report.is_file():
        return f"no {REPORT_FILE} yet (`echoic export` writes it last; copy it last)"
    try:
        size = report.stat().st_size
        if size > MAX_REPORT_BYTES:
            return f"{REPORT_FILE} is {size} bytes, too big to be an export's"
        card = read_report_card(path)
    except RecursionError:
        return f"{REPORT_FILE} is not readable (JSON nested too deeply)"
    except Exception as e:  # noqa: BLE001 - any file that is not an export's report
        return f"{REPORT_FILE} is not readable yet ({type(e).__name__}: {str(e)[:200]!r})"
    needed = [OFFLINE_FILE, *([STREAM_FILE] if card.streamable else [])]
    missing = [name for name in needed if not (path / name).is_file()]
    return f"{', '.join(missing)} missing (its {REPORT_FILE} names it)" if missing else None


def check_name(what: str, value: str) -> None:
    """A model name or version must be one visible directory name."""
    if not value.strip() or "/" in value or value.startswith(".") or not value.isprintable():
        raise ValueError(f"bad model {what} {value!r}: it becomes a directory name")
    if any(c.isdigit() for c in value) and not value.isascii():
        raise ValueError(f"bad model {what} {value!r}: write numbers with ASCII digits")


def next_version(repo: Path, name: str) -> str:
    """One more than the highest numbered version of `name` (hidden ones count too: a
    version being published or removed keeps its number); "1" for a new name."""
    numbers = [0]
    if (repo / name).is_dir():
        for entry in (repo / name).iterdir():
            digits = entry.name.lstrip(".").split(".")[0]
            if _number(digits):
                numbers.append(int(digits))
    return str(max(numbers) + 1)


def staging_dir(repo: Path, name: str, version: str) -> Path:
    """A new hidden directory beside REPO/<name>/<version>, on the same file system,
    in which to build that version before `publish` renames it into place."""
    check_name("name", name)
    check_name("version", version)
    parent = repo / name
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", suffix=".partial", dir=parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a server may run as another user
    return tmp


def publish(built: Path, repo: Path, name: str, version: str) -> Path:
    """Rename a complete version directory `built` (from `staging_dir`) to
    REPO/<name>/<version> in one step; FileExistsError if that version exists."""
    if why := incomplete(built):
        raise ValueError(f"{built} is not a complete model directory: {why}")
    for entry in built.iterdir():
        if entry.is_file():
            with open(entry, "rb") as f:
                os.fsync(f.fileno())
    fsync_directory(built)
    target = repo / name / version
    if target.exists():
        raise FileExistsError(f"{target} already exists: publish another version")
    try:
        os.rename(built, target)  # a directory appears whole, or not at all
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):  # another publisher got there first
            raise FileExistsError(f"{target} already exists: publish another version") from e
        raise
    fsync_directory(target.parent)
    return target


def copy_version(source: Path, repo: Path, name: str, version: str) -> Path:
    """Publish a copy of the model directory `source` as REPO/<name>/<version>."""
    if why := incomplete(source):
        raise ValueError(f"{source} is not a complete model directory: {why}")
    tmp = staging_dir(repo, name, version)
    try:
        for entry in sorted(source.iterdir()):
            if entry.is_file() and not entry.name.startswith("."):
                shutil.copy2(entry, tmp / entry.name)
        return publish(tmp, repo, name, version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_version(repo: Path, name: str, version: str) -> None:
    """Take REPO/<name>/<version> out of the repository in one step (renamed to a
    hidden name, then deleted), so that no scan sees it half-deleted."""
    check_name("name", name)
    check_name("version", version)
    target = repo / name / version
    if not target.is_dir():
        raise FileNotFoundError(f"no version {version} of {name} in {repo}")
    hidden = Path(tempfile.mkdtemp(prefix=f".{version}.", suffix=".removed", dir=target.parent))
    os.rename(target, hidden / version)
    fsync_directory(target.parent)
    shutil.rmtree(hidden, ignore_errors=True)


def read_default(repo: Path) -> str:
    """The model name `repo`'s .default-model gives; "" when it has none."""
    try:
        return (repo / DEFAULT_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return ""


def _replace_file(repo: Path, name: str, text: str) -> None:
    """REPO/NAME holding `text`, in one rename."""
    fd, tmp = tempfile.mkstemp(prefix=name + ".", dir=repo)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, repo / name)
    fsync_directory(repo)


def write_default(repo: Path, name: str) -> None:
    """Name `repo`'s default model, in one rename."""
    check_name("name", name)
    _replace_file(repo, DEFAULT_FILE, name + "\n")


def default_model(named: str, served: list[str] | set[str]) -> tuple[str, str]:
    """(the model a request naming none gets, why) among the `served` names, given the
    default `named` (the server's --default-model, else the repository's .default-model):
    that one when served, else the only model; ("", why not) when there is none."""
    if named and named in served:
        return named, "the default model"
    if len(served) == 1:
        return next(iter(served)), "the only model"
    why = f"the default model {named!r} is not served" if named else "no default model is named"
    return "", f"several models are served and {why}"


BUNDLED_FILE = ".bundled"  # REPO/.bundled: the bundled versions seeded into it, "name/version"
# The config hashes of the models echoic bundled before: a repository seeded before
# REPO/.bundled was kept (versions 1 to 3) holds one of these, which tells it from a model
# its user deployed.
EARLIER_BUNDLED = {
    "echoic-en-default": {
        "36aa27da821fe7bc",  # version 1
        "9582e9da0b94d95f",  # version 2
        "30c91e52e61c24b2",  # version 3
    },
}


def _seeded(repo: Path) -> set[str]:
    try:
        return set((repo / BUNDLED_FILE).read_text().split())
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _record_seeded(repo: Path, entries: set[str]) -> None:
    _replace_file(repo, BUNDLED_FILE, "".join(f"{e}\n" for e in sorted(entries)))


def _holds(version_dir: Path, config_hashes: set[str]) -> bool:
    """Whether a version directory holds a model of one of these config hashes."""
    try:
        return read_report_card(version_dir).config_hash in config_hashes
    except Exception:  # noqa: BLE001 - a version that cannot be read is not one we put in
        return False


def seed_with_bundled(repo: Path, bundled: Path) -> Path | None:
    """Put a copy of the bundled model into `repo` when the repository has no model at
    all (the first use of the default repository), or when the versions of the bundled
    name it holds are all older bundled ones (echoic was upgraded: the new bundled model is
    served, the old one stays for `echoic deploy --remove` to roll back to). REPO/.bundled
    lists the bundled versions put in (versions seeded before it was kept are known by
    their config hash, `EARLIER_BUNDLED`): each is put in once, so one removed stays
    removed, and a name that holds a version its user deployed is never added to. Returns
    the new version's path, or None when the repository is left as it is (an upgrade that
    cannot write to it, a read-only one, is skipped: the versions there keep serving)."""
    repo.mkdir(parents=True, exist_ok=True)
    card = read_report_card(bundled)
    found = scan_repository(repo)
    if not read_default(repo) and (not found or card.name in found):
        # The seeded model stays the default when other names are deployed beside it
        # (a repository seeded before .default-model existed gets it named now).
        write_default(repo, card.name)
    seeded = _seeded(repo)
    versions = found.get(card.name, {})
    bundled_hashes = {card.config_hash, *EARLIER_BUNDLED.get(card.name, ())}
    ours = {v for v, d in versions.items()
            if f"{card.name}/{v}" in seeded or _holds(d, bundled_hashes)}  # fmt: skip
    entry = f"{card.name}/{card.version}"
    try:
        if found:  # an upgrade, if every version of the name is an older bundled one
            newer = _number(card.version) and all(
                _number(v) and int(v) < int(card.version) for v in versions
            )  # fmt: skip
            if card.version in ours and entry not in seeded:  # copied, then stopped
                _record_seeded(repo, seeded | {entry})
            if not versions or not newer or set(versions) - ours or entry in seeded:
                return None
        try:
            path = copy_version(bundled, repo, card.name, card.version)
        except FileExistsError:  # another process put it in first
            return None
        _record_seeded(repo, seeded | {f"{card.name}/{v}" for v in {*ours, card.version}})
    except OSError:
        if not found:
            raise  # the first use: the repository cannot be set up
        return None  # an upgrade: the versions there keep serving
    return path
