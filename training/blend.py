"""Blend two exported models of one network: a fine-tune and the model it started from.

    python -m echoic.training.blend BASE_DIR TUNED_DIR --weight 0.5 --out blended.pt
    echoic export blended.pt models/echoic-en-default/3

A fine-tune that learns new conditions forgets some of the old ones; the weights halfway
between it and the model it started from often keep most of both (the two lie in one
basin: the fine-tune began at the base). Each model is read back from its export
(`echoic.model.nn.rebuild`), where both are in the same form, every norm folded into a
scale and a shift, so that blending weights blends like for like; the blend is
`(1 - weight) * base + weight * tuned`, written as a checkpoint for `echoic export`, whose
parity check proves the result before it is written. The checkpoint has the tuned model's
network config and step; its config hash is its own, made of the two models' hashes and
the weight (recorded in its train_config as `blend`), so that its card tells it apart
from the fine-tune. Its norms are folded as in an export: to fine-tune a blend, start
from its export (`init_from=DIR`, which recalibrates the norms), not from this file.
The bundled model's stage 3 is such a blend (docs/models-and-import.md, "Stage 3").
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path

from echoic.model.core.configs import to_dict
from echoic.model.nn.checkpoint import Checkpoint
from echoic.model.nn.network import DeepSpeech2
from echoic.model.nn.rebuild import RebuildError, rebuild
from echoic.training.checkpoint import save_atomic


class BlendError(ValueError):
    """Two models that are not the same network."""


def blend(base: str | Path, tuned: str | Path, weight: float) -> tuple[DeepSpeech2, Checkpoint]:
    """The network `(1 - weight) * base + weight * tuned` (both export directories), and
    it as a checkpoint with `tuned`'s config and step and a config hash of its own (made of
    the two models' hashes and the weight, which its train_config records)."""
    if not 0.0 <= weight <= 1.0:
        raise BlendError(f"--weight {weight}: a blend weight is between 0 and 1")
    ours, base_info = rebuild(base)
    theirs, info = rebuild(tuned)
    if base_info["model_config"] != info["model_config"]:
        raise BlendError(f"{base} and {tuned} are different networks: their configs differ")
    a, b = ours.state_dict(), theirs.state_dict()
    mixed = {k: a[k] * (1 - weight) + b[k] * weight if b[k].is_floating_point() else b[k]
             for k in b}  # fmt: skip
    theirs.load_state_dict(mixed)
    made_of = {"base": base_info["config_hash"], "tuned": info["config_hash"], "weight": weight}
    ckpt = Checkpoint(
        model=mixed, model_config=to_dict(info["model_config"]),
        train_config={"blend": made_of}, step=info["step"] or 0,
        config_hash=hashlib.sha256(repr(sorted(made_of.items())).encode()).hexdigest()[:16],
    )  # fmt: skip
    return theirs.eval(), ckpt


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", type=Path, help="the exported model the fine-tune started from")
    ap.add_argument("tuned", type=Path, help="the exported fine-tune")
    ap.add_argument("--weight", type=float, default=0.5,
                    help="the fine-tune's share, 0-1 (default: %(default)s)")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="the checkpoint to write")
    args = ap.parse_args(argv)
    try:
        _, ckpt = blend(args.base, args.tuned, args.weight)
    except (BlendError, RebuildError, FileNotFoundError) as e:
        raise SystemExit(f"blend: {e}") from e
    save_atomic(ckpt.to_dict(), args.out)
    print(f"wrote {args.out}: {1 - args.weight:g} x {args.base} + {args.weight:g} x {args.tuned}")


if __name__ == "__main__":
    main()
