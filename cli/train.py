"""`echoic train`: train or resume a model from a recipe."""

from __future__ import annotations

import argparse

EXAMPLES = """\
examples:
  echoic train --config default
  echoic train --config tiny data.train_manifest=corpus/manifest.jsonl max_steps=30 \\
      out_dir=runs/smoke
  echoic train --config finetune data.train_manifest=mine/manifest.jsonl   # the bundled model
  echoic train --config my-recipe.toml init_from=bundled
  mpirun -np 4 echoic train --config default out_dir=runs/ds2
  torchrun --nproc-per-node 4 -m echoic.cli.main train --config default

--config takes a TOML file or a recipe's name: {names}.
A recipe's relative paths (init_from, data.train_manifest, data.val_manifest) are
looked for in the working directory, then beside the recipe; out_dir is in the
working directory.
init_from=bundled fine-tunes the bundled model. Running the same command again resumes
from OUT_DIR/last.pt exactly.
"""


def _recipe_names() -> str:
    from echoic.training.recipe_files import recipe_names

    return ", ".join(recipe_names())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (one process, mpirun or torchrun)",
        description="Train a Deep Speech 2 model with CTC from a TOML recipe.",
        epilog=EXAMPLES.format(names=_recipe_names()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", metavar="RECIPE",
        help=f"training recipe: a TOML file, or one by name ({_recipe_names()})",
    )  # fmt: skip
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="typed recipe overrides")
    p.add_argument(
        "--rnn-impl",
        choices=("auto", "cudnn", "persistent"),
        help="recurrent kernels on GPU (same as rnn_impl=...)",
    )
    p.add_argument("--print-config", action="store_true", help="print the full config and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from echoic.training.train import config_summary, load_recipe, train
    except ModuleNotFoundError as e:
        if e.name in ("torch", "jiwer"):
            from echoic.cli.errors import missing_extra

            raise missing_extra("train", e.name) from e
        raise
    overrides = list(args.overrides)
    if args.rnn_impl:
        overrides.append(f"rnn_impl={args.rnn_impl}")
    cfg = load_recipe(args.config, overrides)
    if args.print_config:
        print(config_summary(cfg))
        return 0
    if not cfg.data.train_manifest:
        from echoic.cli.errors import UserError

        raise UserError("no training data: set data.train_manifest=PATH (a JSON-lines manifest)")
    path = train(cfg, progress=not args.no_progress)
    if path is not None:  # rank 0, the one that wrote it; the other ranks print nothing
        print(path)
    return 0
