"""`echoic degrade`: degraded copies of a held-out set (phone line, room, noise, quiet)."""

from __future__ import annotations

import argparse

EXAMPLES = """\
examples:
  # every degradation of a held-out set, then one table over all of them
  echoic degrade data/heldout/manifest.jsonl data/heldout-degraded
  echoic eval --manifest data/heldout/manifest.jsonl \\
      --manifest data/heldout-degraded/*/manifest.jsonl --decoders greedy,beam

  # only the 8 kHz mu-law phone line
  echoic degrade data/heldout/manifest.jsonl data/phone --kinds mulaw8k

Kinds: mulaw8k (300-3400 Hz, an 8 kHz G.711 mu-law WAV), reverb (a simulated room,
RT60 0.4-0.8 s), noisy10db (pink noise at 10 dB SNR), quiet (-35 dBFS). Each writes
OUT_DIR/KIND/manifest.jsonl with the source lines' fields and "degradation": KIND.
A rerun writes the same files and skips those already there.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "degrade",
        help="degraded copies of a held-out set: phone line, room, noise, quiet",
        description="Write degraded copies of a manifest's audio, one set per kind, to measure\n"
        "how a model holds up off clean speech (`echoic eval` takes them all at once).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("manifest", metavar="MANIFEST", help="the clean set (JSON lines)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="one folder per kind is written here")
    p.add_argument("--kinds", default="mulaw8k,reverb,noisy10db,quiet", metavar="LIST",
                   help="comma-separated kinds (default: all four)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="what each utterance gets follows it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.training.heldout import degrade_manifest

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    try:
        written = degrade_manifest(args.manifest, args.out_dir, kinds, args.seed)
    except ValueError as e:
        raise UserError(str(e)) from e
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return 0
