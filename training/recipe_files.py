"""The recipes that ship with echoic, by name (`echoic train --config tiny`), without torch
(`echoic train --help` lists them)."""

from __future__ import annotations

from pathlib import Path

from echoic.model.core.configs import ConfigError

RECIPES = Path(__file__).resolve().parent / "recipes"  # the recipes by name (package data)
BUNDLED = "bundled"  # init_from=bundled: the bundled model (`echoic models --bundled`)


def recipe_names() -> list[str]:
    """The recipes that `--config NAME` finds."""
    return sorted(p.stem for p in RECIPES.glob("*.toml"))


def find_recipe(spec: str | Path) -> Path:
    """A recipe file: `spec` as a path, else the packaged recipe of that name (`tiny`,
    `finetune`, ...); ConfigError naming both places when neither is there."""
    path = Path(spec)
    if path.is_file():
        return path
    named = RECIPES / f"{path.name}.toml"
    if path.suffix == "" and path.name == str(spec) and named.is_file():
        return named
    raise ConfigError(
        f"no recipe {str(spec)!r}: no file {path.resolve()}, and no recipe of that name "
        f"(recipes by name: {', '.join(recipe_names())})"
    )
