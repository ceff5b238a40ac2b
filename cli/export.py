"""`echoic export`: turn a checkpoint into a model directory for the server."""

from __future__ import annotations

import argparse
import json
from typing import NoReturn

EXAMPLES = """\
examples:
  # into a model repository: MODEL_REPO/<name>/<version>/ (the version is taken from OUT_DIR)
  echoic export runs/ds2/last.pt models/echoic-ds2/3

  # a unidirectional model streamed in steps of 8 output frames, report as JSON
  echoic export runs/uni/last.pt models/uni/1 --stream-chunk 8 --json

OUT_DIR must not exist (or be empty). It gets model.onnx (offline), stream.onnx
(streaming step; streamable models only), both carrying the model card, and
export.json. Nothing is written unless ONNX Runtime reproduces the checkpoint on
several batch sizes and lengths, offline and streamed step by step.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a checkpoint to ONNX (model.onnx, stream.onnx, model card)",
        description="Export a training checkpoint to a model directory the server loads:\n"
        "ONNX graphs for offline and streaming recognition with the model card in their\n"
        "metadata, checked against torch before anything is written.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file (e.g. last.pt)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="model directory to create")
    p.add_argument("--name", metavar="N", help="model name (default: the model config's name)")
    p.add_argument(
        "--version",
        metavar="V",
        help="model version (default: OUT_DIR's name when it is a number, else 1)",
    )
    p.add_argument(
        "--stream-chunk",
        type=int,
        metavar="C",
        help="output frames per streaming step of a unidirectional model (default 16); "
        "a chunked BiRNN always uses its trained chunk",
    )
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=run)


def _explain_missing(e: ModuleNotFoundError) -> NoReturn:
    """Export needs torch and onnx (the train extra) and onnxruntime (serve) for parity."""
    from echoic.cli.errors import missing_extra

    if e.name in ("torch", "onnx", "onnxruntime"):
        raise missing_extra("serve" if e.name == "onnxruntime" else "train", e.name) from e
    raise e


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.model.runtime.card import ModelError

    try:
        from echoic.model.nn.export import ExportError, export_model, read_report
    except ModuleNotFoundError as e:
        _explain_missing(e)
    try:
        path = export_model(
            args.checkpoint,
            args.out_dir,
            name=args.name,
            version=args.version,
            stream_chunk=args.stream_chunk,
        )
    except ModuleNotFoundError as e:  # onnx and onnxruntime are imported when needed
        _explain_missing(e)
    except (ExportError, ModelError) as e:
        raise UserError(str(e)) from e
    report = read_report(path)
    card, parity = report["model_card"], report["parity"]
    offline = max(case["max_abs_diff"] for case in parity["offline"])
    stream = parity["stream"]["max_abs_diff"] if parity["stream"] else None
    files = sorted(p.name for p in path.iterdir())
    if args.json:
        summary = {
            "model_dir": str(path),
            "name": card["name"],
            "version": card["version"],
            "files": files,
            "streamable": card["streamable"],
            "chunk_frames": card["chunk_frames"],
            "parity": parity,
        }
        print(json.dumps(summary))
        return 0
    shapes = ", ".join(
        "x".join(map(str, (len(c["lengths"]), max(c["lengths"])))) for c in parity["offline"]
    )
    print(
        f"offline: torch vs model.onnx max |diff| {offline:.2e} "
        f"on batch x frames {shapes} (tolerance {parity['tolerance']:g})"
    )
    if stream is not None:
        print(
            f"streaming: stream.onnx step by step ({parity['stream']['steps']} batched steps, "
            f"chunk {card['chunk_frames']}) vs model.onnx max |diff| {stream:.2e}"
        )
    print(f"wrote {card['name']} version {card['version']} to {path} ({', '.join(files)})")
    return 0
