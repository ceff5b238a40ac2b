"""`echoic quantize`: an int8 copy of an exported model directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from echoic.cli.export import (
    _explain_missing,
    add_calibration,
    calibration_audio,
    quantization_line,
)

EXAMPLES = """\
examples:
  # the bundled model as the default repository holds it, int8, as its version 5
  echoic quantize ~/.local/share/echoic/models/echoic-en-default/4 \
      ~/.local/share/echoic/models/echoic-en-default/5 --calibration data/train/manifest.jsonl

  # any export, summary as JSON
  echoic quantize models/echoic-ds2/3 models/echoic-ds2/4 --calibration cal.jsonl --json

MODEL_DIR is a directory written by `echoic export` (fp32); OUT_DIR must not exist (or
be empty). It gets model.onnx and stream.onnx with the convolutions and the output layer
quantized by ONNX Runtime's static quantization (QDQ; activation scales from the first
32 utterances of --calibration; the recurrent layers stay fp32), the card saying
precision int8, the other files of MODEL_DIR (its word LM: lm.bin, lm.arpa), and export.json.
A checkpoint goes straight to int8 with `echoic export --quantize int8`.
On the bundled model int8 is no faster than fp32 on x86 CPUs: docs/benchmarks.md, "Benchmarks".
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="write an int8 copy of an exported model directory",
        description="Quantize an exported model directory with ONNX Runtime's static\n"
        "quantization (int8 convolutions and output layer, activation scales calibrated on\n"
        "--calibration's audio) into a new one.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="fp32 model directory to read")
    p.add_argument("out_dir", metavar="OUT_DIR", help="model directory to create")
    add_calibration(p, required=True)
    p.add_argument("--to", choices=("int8",), default="int8", help="precision (default int8)")
    p.add_argument("--name", metavar="N", help="model name (default: MODEL_DIR's)")
    p.add_argument(
        "--version",
        metavar="V",
        help="model version (default: OUT_DIR's name when it is a number, else MODEL_DIR's)",
    )
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.model.runtime.card import REPORT_FILE

    try:
        from echoic.model.nn.quantize import QuantizeError, quantize_model
    except ModuleNotFoundError as e:
        _explain_missing(e)
    try:
        from echoic.model.runtime.card import ModelError, read_card

        try:
            card = read_card(Path(args.model_dir) / "model.onnx")
        except ModelError as e:
            raise UserError(str(e)) from e
        audio = calibration_audio(args.calibration, card.sample_rate)
        path = quantize_model(
            args.model_dir,
            args.out_dir,
            audio,
            scheme=args.to,
            name=args.name,
            version=args.version,
        )
    except ModuleNotFoundError as e:  # onnx and onnxruntime are imported when needed
        _explain_missing(e)
    except (QuantizeError, ModelError) as e:  # ModelError: a model directory it cannot run
        raise UserError(str(e)) from e
    report = json.loads((path / REPORT_FILE).read_text())
    card = report["model_card"]
    files = sorted(p.name for p in path.iterdir())
    if args.json:
        summary = {
            "model_dir": str(path),
            "name": card["name"],
            "version": card["version"],
            "files": files,
            "precision": card["precision"],
            "quantization": report["quantization"],
        }
        print(json.dumps(summary))
        return 0
    print(quantization_line(report["quantization"]))
    print(f"wrote {card['name']} version {card['version']} to {path} ({', '.join(files)})")
    return 0
